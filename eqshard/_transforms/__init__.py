"""Functions of functions: compiled with their inputs' and outputs' layouts.

`JitFunction` (`_jit.py`) is the one `jax.jit` core: arguments filtered as
`eqx.filter_jit` does, placed by their shardings, outputs laid out in theirs. Its
call path reads top to bottom in `_jit.py`, each step a leaf module: the call
keyed and its `Layout` cached (`_jit_keys.py`), the arguments and donation
checked (`_jit_checks.py`), the program traced, lowered and compiled and its
output put back together (`_jit_stages.py`). Its front ends pass small objects,
not flags: `filter_jit` (`_filter_jit.py`) a resolver of its `in_specs`/`out_specs`
for the first arguments of each structure (`_jit_specs.py`), `t5x.PartitionedFn`
the shardings built at partition time. `filter_shard_map` (`_shard_map.py`) runs
`jax.shard_map` over any pytree, its specs resolved and checked before tracing
(`_shard_map_specs.py`), its program kept in a `Programs` cache (`_programs.py`).
Inside a function, `with_sharding_constraint` (`_constraint.py`) constrains
without moving data, `auto_axes` (`_explicit.py`) runs a function with Explicit
mesh axes made Auto, turning JAX's errors there into eqshard's, and
`_offload.py` moves arguments kept in host memory to the device and outputs
back, inside the traced program.
`pipeline` (`_pipeline.py`, its checks in `_pipeline_checks.py`) runs stacked
layers as stages over one mesh axis, the circular schedule's view of the stack
from `_stage_view.py`, a list of layers stacked by `_stack_layers.py`.
`dot_product_attention` (`_attention.py`, its checks in `_attention_checks.py`)
splits the sequence over a context axis, all-gathered, by Ulysses's all-to-alls
or round the ring of `_attention_ring.py`, and `ContextParallelAttention`
(`_attention_module.py`) puts it in place of an `eqx.nn.MultiheadAttention`; and
`_balance.py` reorders a sequence for equal causal work (`balance_sequence`).
"""
