"""What tells two traced programs apart: the key under which `init_sharded` and
eager `filter_shard_map` keep their compiled programs (`_transforms/_programs.py`).

It reads every equation's parameters and literals, so it lives behind the door.
"""

import hashlib
import struct
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal


# Parameters that running a program never reads: the rules for differentiating
# a custom_jvp/custom_vjp function (its `call_jaxpr` is what runs). They are new
# objects on every trace, so keying on them would compile every time.
_NOT_RUN = {
    "custom_jvp_call": frozenset({"jvp_jaxpr_fun"}),
    "custom_vjp_call": frozenset({"fwd_jaxpr_thunk", "bwd", "out_trees"}),
}


def scalar_key(value: float | complex) -> tuple[type, bytes]:
    """A key of a Python float or complex that `==` would not give: its type and
    its bits, so that `0.0` and `-0.0` differ, and a NaN is itself."""
    if isinstance(value, complex):
        return type(value), struct.pack("<dd", value.real, value.imag)
    return type(value), struct.pack("<d", value)


class _Keyer:
    """The parts of `program_key`: each value, parameter and jaxpr's key, and the
    objects keyed by identity (`keep`). A class rather than closures, which would
    refer to each other in a cycle holding `keep`'s arrays until the next garbage
    collection."""

    def __init__(self) -> None:
        self.keep: list[Any] = []
        self.seen: dict[int, Hashable] = {}

    def value_key(self, value: Any) -> Hashable:
        if isinstance(value, jax.Array):
            self.keep.append(value)
            return ("array", id(value))
        if isinstance(value, np.ndarray | np.generic):
            digest = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
            return ("numpy", value.dtype.str, value.shape, digest)
        return self.param_key(value)

    def param_key(self, value: Any) -> Hashable:
        if isinstance(value, ClosedJaxpr):
            return (
                self.jaxpr_key(value.jaxpr),
                tuple(map(self.value_key, value.consts)),
            )
        if isinstance(value, Jaxpr):
            return self.jaxpr_key(value)
        if isinstance(value, tuple | list):
            return (type(value).__name__, tuple(map(self.param_key, value)))
        if isinstance(value, dict):
            return ("dict", tuple((k, self.param_key(v)) for k, v in value.items()))
        if isinstance(value, float | complex):
            return scalar_key(value)
        try:
            hash(value)
        except TypeError:
            self.keep.append(value)
            return ("object", id(value))
        return value

    def jaxpr_key(self, jaxpr: Jaxpr) -> Hashable:
        if id(jaxpr) not in self.seen:
            self.seen[id(jaxpr)] = tuple(
                (
                    tuple(
                        self.value_key(var.val)
                        for var in eqn.invars
                        if isinstance(var, Literal)
                    ),
                    tuple(
                        (name, self.param_key(value))
                        for name, value in eqn.params.items()
                        if name not in _NOT_RUN.get(eqn.primitive.name, ())
                    ),
                )
                for eqn in jaxpr.eqns
            ) + tuple(
                self.value_key(var.val)
                for var in jaxpr.outvars
                if isinstance(var, Literal)
            )
        return self.seen[id(jaxpr)]


def program_key(
    closed: ClosedJaxpr,
    extra: Hashable = (),
    *,
    skip: Callable[[Any], bool] = lambda const: False,
) -> tuple[Hashable, list[Any]]:
    """What tells two traced programs apart, and the objects that must stay alive
    while the key is used (those keyed by identity).

    The key is the jaxpr's text (operations, data flow, types and scalar literal
    values, nested programs included), every parameter by value (the printer
    leaves some out or prints a callable by name), the values of the constants
    (NumPy arrays by content, since they can change in place; JAX arrays, which
    cannot, by identity), `extra` (such as the shardings of the outputs) and
    JAX's configuration. Top-level constants for which `skip` holds are left
    out (their types are in the text): the caller feeds them to the program."""
    keeper = _Keyer()
    # JAX's configuration can change how the same jaxpr is lowered (e.g.
    # `jax_threefry_partitionable`), and lowering is cached per nested jaxpr.
    config = tuple(sorted((name, repr(v)) for name, v in jax.config.values.items()))
    consts = tuple(None if skip(c) else keeper.value_key(c) for c in closed.consts)
    key = (str(closed.jaxpr), keeper.jaxpr_key(closed.jaxpr), consts, extra, config)
    return key, keeper.keep
