"""Functions of functions: compiled with their inputs' and outputs' layouts.

`JitFunction` (`_jit.py`) is the one `jax.jit` wrapper: arguments filtered as
`eqx.filter_jit` does, placed by their shardings, outputs laid out in theirs,
donation, a cache per structure of the arguments. `filter_jit` (`_filter_jit.py`)
resolves its `in_specs`/`out_specs` for the first arguments of each structure and
builds on it, as `t5x.PartitionedFn` does. `shard_map` (`_shard_map.py`) runs
`jax.shard_map` over any pytree, its specs resolved and checked before tracing,
its program kept in a `Programs` cache (`_programs.py`). Inside a function,
`with_sharding_constraint` (`_constraint.py`) constrains without moving data, and
`auto_axes` (`_explicit.py`) runs a function with Explicit mesh axes made Auto,
turning JAX's errors there into eqshard's.
"""
