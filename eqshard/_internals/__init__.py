"""The one door to JAX's, XLA's and orbax's moving parts.

Everything eqshard reads beyond their public API lives here, one module per part:

- `jaxpr`: primitives of traced programs and their parameters (`init_sharded`'s
  pieces, a step's boundary).
- `equations`: a program's equations as `search_layout` reads them (keys,
  shapes, parameters, nested programs, dimension numbers).
- `program_keys`: what tells two traced programs apart, the key of a kept
  program (`init_sharded`, eager `filter_shard_map`).
- `closures`: what a function reads besides its arguments (closure cells,
  globals), found by one walk (`find_reads`): keyed by value (`reads_key`), for
  the traces `init_sharded` and eager `filter_shard_map` keep, and searched for
  the NumPy data `init_sharded`'s trace captured.
- `xla`: XLA's warnings, captured from the process's stderr around a compile.
- `errors`: JAX's and XLA's errors, known by their words or class name.
- `distributed`: the distributed client's key-value store.
- `orbax`: orbax's type handlers (the tensorstore specs it reads with, and the
  handler `save` writes with in one process).
- `cpu`: XLA:CPU's buffers (addresses, alignment) for the CPU copy engine.
- `routes`: the switches that force each fast path's plain-JAX route.

A read that meets something it does not recognise does not guess: it raises
`Unrecognised`, and the fast path that made it takes its plain route, saying so
once in a warning (`routes.fall_back`). Nothing outside this package reads these
parts (`tests/test_architecture.py` checks). The door is the lowest wing: it
imports nothing of eqshard's, so the base modules use it too (`_typing.py` knows
JAX's errors by `errors`), and `cpu`'s caches are registered with `_caches` by
the copy engine that reads them (`_move/_copies.py`).
"""
