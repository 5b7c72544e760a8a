"""How a step uses each of its parameters and where their products go, read
from its jaxpr (traced once, never compiled) by `_flow.py`, for the
candidate layouts of `search_layout` (`_candidates.py`): each parameter's first
use (a matmul's input and output dimensions, a convolution's features, an
embedding's vocabulary), the leading dimensions a `lax.scan` iterates over, the
matrices whose products feed a matrix's input, and whether a matrix's product
stays split until another matrix reads it. A step this reader does not
recognise gives "other" uses, said once in a warning.
"""

from typing import Any

from .._internals.routes import Unrecognised
from .._typing import warn
from . import _flow
from ._flow import Use


def parameter_uses(closed_jaxpr: Any, count: int) -> list[Use]:
    """The use of each of the first `count` inputs of `closed_jaxpr` (as
    `jax.make_jaxpr` makes it), read by `_flow.parameter_uses`. Where
    that read meets something it does not recognise, every parameter is an
    "other" use (the candidates then hold no tensor-parallel pairs), said
    once in a warning."""
    try:
        return _flow.parameter_uses(closed_jaxpr, count)
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
