"""Building models straight into their shardings.

`init_sharded` (`_init.py`) traces a model's constructor, resolves its specs on
the abstract tree, and compiles the constructor under `jit` with those output
shardings, so no array is ever whole on one device; the program is kept, and
building again with a new key compiles nothing. `_init_pieces.py` runs the program
in pieces when that is cheaper: the keys op by op, each distinct piece compiled
once and run per round of its uses (`plan` says when the whole program is kept).
The program is read through `_internals/jaxpr.py` (`cut`); the whole program under
one `jit` is the plain route, taken with `EQSHARD_PLAIN_ROUTES=init` and when that
read meets something it does not recognise (`_init._pieces`).
"""
