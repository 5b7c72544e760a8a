"""Data movement: trees put on meshes and copied back to host.

`shard` (`_shard.py`) takes one record per leaf, validated (`_leaves.py`), then
places them in three steps: tied arrays, staging on host (`_host.py`: dtypes no
device holds, casts, private copies, no aliasing), placing. A tree of NumPy
arrays that `shard` checked before (a data pipeline's batch) is placed by the
plan it kept for it (`_plans.py`). Arrays already on
devices are moved to other shardings or dtypes without a compile per shape
(`_resident.py`). A placed state moves in batches of bounded bytes per device,
each caller's array freed once its new one is placed (`_reshard.py`), and
`shard_plan` (`_shard_plan.py`) says beforehand what will move, by which route,
and the peak. `gather` and `iter_gather` (`_gather.py`) copy trees back to
host.

Every copy goes through the copy engine's door (`_copies.py`), one function per
direction: `to_devices`, `to_host`, `between`. On CPU devices these are memory
copies straight from and into XLA:CPU's buffers (read through
`_internals/cpu.py`), spread over the machine's cores (`_threads.py`); beside
each is its plain route (`jax.device_put`, `jax.device_get`), taken with
`EQSHARD_PLAIN_ROUTES=copies` or when a read of those buffers meets something
unknown. When a mesh spans several processes, `_multiprocess.py` decides what
each process places or gathers, which blocks of a dimension its devices hold
(`_process_blocks.py`), and meets the others at barriers with a timeout;
`_agreement.py` checks that every process asked for the same thing before
placing (a digest each, through the distributed client of
`_internals/distributed.py`), failing together.
"""
