"""A traced program and its equations as the layout search reads them: keys of
variables, shapes, parameters by name and the programs an equation holds
(`Program`, `Equation`), and the dimension numbers of matmuls, gathers and
convolutions decoded (`contracting_dims`, `gathered_dims`, `conv_dims`).

`_search/_flow.py` follows a step's data through these views, never through
JAX's classes. A parameter an equation lacks, or laid out as these do not
expect, raises `Unrecognised`.
"""

from collections.abc import Iterator, Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr

from .jaxpr import eqn_name, eqn_param, inner_program
from .routes import Unrecognised


# Where a call keeps the program it calls.
_CALLEES = ("jaxpr", "call_jaxpr", "fun_jaxpr")


class Program:
    """A traced program, as `_search/_flow.py` reads it: its inputs and outputs
    (keys that tell its variables apart), their shapes, and its equations."""

    __slots__ = ("_jaxpr",)

    def __init__(self, jaxpr: Jaxpr) -> None:
        self._jaxpr = jaxpr

    @property
    def ins(self) -> list[int]:
        return [id(var) for var in self._jaxpr.invars]

    @property
    def outs(self) -> list[int]:
        return [id(var) for var in self._jaxpr.outvars]

    def in_shape(self, k: int) -> tuple[int, ...]:
        var: Any = self._jaxpr.invars[k]
        return var.aval.shape

    @property
    def equations(self) -> Iterator["Equation"]:
        return map(Equation, self._jaxpr.eqns)


def program_of(closed: ClosedJaxpr) -> Program:
    """The program of `closed` (as `jax.make_jaxpr` makes it)."""
    return Program(closed.jaxpr)


class Equation:
    """One equation of a traced program, as `_search/_flow.py` reads it: its
    primitive's `name`, its operands and results (`ins`, `outs`: keys of the
    variables), their shapes, its parameters and the programs it holds."""

    __slots__ = ("_eqn",)

    def __init__(self, eqn: Any) -> None:
        self._eqn = eqn

    @property
    def name(self) -> str:
        return eqn_name(self._eqn)

    @property
    def ins(self) -> list[int]:
        return [id(var) for var in self._eqn.invars]

    @property
    def outs(self) -> list[int]:
        return [id(var) for var in self._eqn.outvars]

    def in_shape(self, k: int) -> tuple[int, ...]:
        return self._eqn.invars[k].aval.shape

    def out_shape(self, k: int) -> tuple[int, ...]:
        return self._eqn.outvars[k].aval.shape

    def param(self, name: str) -> Any:
        """Its parameter `name`, or `Unrecognised` if it has none."""
        return eqn_param(self._eqn, name)

    def given(self, name: str) -> bool:
        """Whether it has a parameter `name` that is not `None`."""
        return self._eqn.params.get(name) is not None

    def program(self, name: str, what: str) -> Program:
        """The program its parameter `name` holds (`what` names it in errors)."""
        return Program(inner_program(eqn_param(self._eqn, name), what))

    def programs(self, name: str, what: str) -> list[Program]:
        """The programs its parameter `name` holds, a sequence (a `cond`'s)."""
        return [Program(inner_program(p, what)) for p in eqn_param(self._eqn, name)]

    def callee(self) -> Program | None:
        """The program it calls (a `jit`, a `checkpoint`, a custom derivative's,
        a `shard_map`'s), or `None`."""
        for name in _CALLEES:
            value = self._eqn.params.get(name)
            program = getattr(value, "jaxpr", value)
            if isinstance(program, Jaxpr):
                return Program(program)
        return None


def contracting_dims(eqn: Equation) -> tuple[tuple[Sequence[int], ...], ...]:
    """A `dot_general`'s `((lhs, rhs) contracting, (lhs, rhs) batch)` dims."""
    try:
        (contracting, batch) = eqn.param("dimension_numbers")
        (lc, rc), (lb, rb) = contracting, batch
        ints = [tuple(int(d) for d in dims) for dims in (lc, rc, lb, rb)]
        return (ints[0], ints[1]), (ints[2], ints[3])
    except (TypeError, ValueError) as error:
        raise Unrecognised(f"'dot_general' dimension numbers ({error})") from None


def gathered_dims(eqn: Equation) -> list[int]:
    """The dimensions of its operand that a `gather` indexes: those of
    `start_index_map` it does not take whole."""
    shape = eqn.in_shape(0)
    sizes = eqn.param("slice_sizes")
    index_map = getattr(eqn.param("dimension_numbers"), "start_index_map", None)
    if index_map is None:
        raise Unrecognised("'gather' dimension numbers without start_index_map")
    return [int(d) for d in index_map if sizes[d] < shape[d]]


def conv_dims(
    eqn: Equation,
) -> tuple[Sequence[int], Sequence[int], Sequence[int]] | None:
    """A convolution's `(lhs, rhs, out)` dimension specs (batch or output
    feature, then feature, then spatial), or `None` for a grouped one."""
    numbers = eqn.param("dimension_numbers")
    specs: list[Any] = [
        getattr(numbers, name, None) for name in ("lhs_spec", "rhs_spec", "out_spec")
    ]
    if any(spec is None for spec in specs):
        raise Unrecognised("convolution dimension numbers without their specs")
    groups = eqn.param("feature_group_count")
    batches = eqn.param("batch_group_count")
    if groups != 1 or batches != 1:
        return None
    lhs, rhs, out = (tuple(int(d) for d in spec) for spec in specs)
    return lhs, rhs, out
