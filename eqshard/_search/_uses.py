"""How a step uses each of its parameters, read from its jaxpr (traced once,
never compiled), for the candidate layouts of `search_layout` (`_candidates.py`).

Two facts per parameter, found by following each parameter's variable through
the jaxpr, into calls (`jit`, `checkpoint`, custom derivatives, `shard_map`),
loops (`scan`, `while`) and branches (`cond`), and through the operations that
keep its dimensions (conversions, copies, sharding constraints; `transpose`
permutes them):

- **Its first use**: the dimensions the first `dot_general` that consumes it
  contracts (a matrix's input dimension: `eqx.nn.Linear` contracts dimension 1,
  `x @ kernel` dimension 0), or those the first `gather` indexes (an embedding's
  vocabulary), or another operation. The forward pass comes first in a
  differentiated step, so a matrix's transposed use in the backward pass does
  not count.
- **Its stacked dimensions**: the leading dimensions a `lax.scan` iterates over
  (layers stacked with `eqx.filter_vmap` and run by a scan), which no layout
  should split.
"""

from typing import Any

from .._internals import jaxpr as jaxprs
from .._internals.jaxpr import Use as Use
from .._internals.routes import Unrecognised
from .._typing import warn


def parameter_uses(closed_jaxpr: Any, count: int) -> list[Use]:
    """The use of each of the first `count` inputs of `closed_jaxpr` (as
    `jax.make_jaxpr` makes it), read by `_internals.jaxpr.parameter_uses`. Where
    that read meets something it does not recognise, every parameter is an
    "other" use (the candidates are then made from paths and shapes only),
    said once in a warning."""
    try:
        return jaxprs.parameter_uses(closed_jaxpr, count)
    except Unrecognised as error:
        if str(error) not in _WARNED:
            _WARNED.add(str(error))
            warn(
                f"eqshard.search_layout: the step's program holds something this "
                f"JAX's reader does not recognise ({error}); the candidate layouts "
                "are made without how the step uses its parameters.",
                RuntimeWarning,
            )
        return [Use("other", (), 0)] * count


_WARNED: set[str] = set()
