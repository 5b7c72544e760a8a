"""Data movement: trees put on meshes and copied back to host.

`shard` (`_shard.py`) takes one record per leaf, validated, then places them in
three steps: tied arrays, staging on host (`_host.py`: dtypes no device holds,
casts, private copies, no aliasing), placing. Arrays already on devices are moved
to other shardings or dtypes without a compile per shape (`_resident.py`).
`gather` and `iter_gather` (`_gather.py`) copy trees back to host (`fetch`).

On CPU devices these are memory copies, spread over the machine's cores
(`_threads.py`). When a mesh spans several processes, `_multiprocess.py` decides
what each process places or gathers, which blocks of a dimension its devices hold
(`_process_blocks.py`), and checks that every process asked for the same thing
before placing (a digest each, through the distributed client), failing together
at a barrier with a timeout.
"""
