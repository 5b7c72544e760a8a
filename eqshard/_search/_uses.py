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

from collections.abc import Sequence
from typing import Any, NamedTuple


class Use(NamedTuple):
    """How the step uses one parameter."""

    kind: str  # "dot", "gather", "other" or "" (unused)
    dims: tuple[int, ...]  # the dimensions contracted ("dot") or indexed ("gather")
    stacked: int  # leading dimensions a scan iterates over


# Operations whose results are their operands, dimension for dimension.
_SAME = frozenset(
    {
        "convert_element_type",
        "copy",
        "copy_p",
        "reduce_precision",
        "sharding_constraint",
        "mesh_cast",
        "pvary",
        "optimization_barrier",
    }
)
# Where a call keeps the program it calls.
_CALLEES = ("jaxpr", "call_jaxpr", "fun_jaxpr")

# A parameter's variable in a jaxpr: (its index, the parameter dimension of each
# of the variable's dimensions, `None` where there is none).
_Found = tuple[int, tuple[int | None, ...]]


def parameter_uses(closed_jaxpr: Any, count: int) -> list[Use]:
    """The use of each of the first `count` inputs of `closed_jaxpr` (as
    `jax.make_jaxpr` makes it)."""
    jaxpr = closed_jaxpr.jaxpr
    walker = _Walker()
    env: dict[int, _Found] = {}
    for i, var in enumerate(jaxpr.invars[:count]):
        env[id(var)] = (i, tuple(range(len(var.aval.shape))))
    walker.walk(jaxpr, env)
    uses = []
    for i in range(count):
        kind, dims = walker.first.get(i, ("", ()))
        scanned = walker.scanned.get(i, set())
        stacked = 0
        while stacked in scanned:
            stacked += 1
        uses.append(Use(kind, dims, stacked))
    return uses


def _callee(eqn: Any) -> Any:
    for name in _CALLEES:
        value = eqn.params.get(name)
        program = getattr(value, "jaxpr", value)
        if hasattr(program, "eqns") and hasattr(program, "invars"):
            return program
    return None


class _Walker:
    def __init__(self) -> None:
        self.first: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.scanned: dict[int, set[int]] = {}

    def _use(self, found: _Found | None, kind: str, dims: Sequence[int]) -> None:
        if found is None or found[0] in self.first:
            return
        index, mapped = found
        self.first[index] = (
            kind,
            tuple(d for d in (mapped[k] for k in dims) if d is not None),
        )

    def walk(self, jaxpr: Any, env: dict[int, _Found]) -> None:
        for eqn in jaxpr.eqns:
            found = [env.get(id(var)) for var in eqn.invars]
            if not any(found):
                continue
            name = eqn.primitive.name
            if name == "dot_general":
                contracting, _ = eqn.params["dimension_numbers"]
                for operand, dims in zip(found[:2], contracting, strict=True):
                    self._use(operand, "dot", dims)
            elif name == "gather":
                # The dimensions indexed: those of `start_index_map` it does not
                # take whole.
                shape = eqn.invars[0].aval.shape
                sizes = eqn.params["slice_sizes"]
                indexed = [
                    d
                    for d in eqn.params["dimension_numbers"].start_index_map
                    if sizes[d] < shape[d]
                ]
                self._use(found[0], "gather", indexed)
            elif name in _SAME:
                for var, f in zip(eqn.outvars, found, strict=False):
                    if f is not None:
                        env[id(var)] = f
            elif name == "transpose" and found[0] is not None:
                index, dims = found[0]
                order = eqn.params["permutation"]
                env[id(eqn.outvars[0])] = (index, tuple(dims[p] for p in order))
            elif name == "scan":
                self._scan(eqn, found)
            elif name == "while":
                skip = eqn.params["cond_nconsts"]
                self._call(eqn.params["body_jaxpr"].jaxpr, found[skip:])
            elif name == "cond":
                for branch in eqn.params["branches"]:
                    self._call(branch.jaxpr, found[1:])
            else:
                callee = _callee(eqn)
                if callee is not None:
                    self._call(callee, found)
                else:
                    for f in found:
                        self._use(f, "other", ())

    def _call(self, jaxpr: Any, found: Sequence[_Found | None]) -> None:
        if len(jaxpr.invars) != len(found):
            return
        inner = {
            id(var): f
            for var, f in zip(jaxpr.invars, found, strict=True)
            if f is not None
        }
        self.walk(jaxpr, inner)

    def _scan(self, eqn: Any, found: list[_Found | None]) -> None:
        carried = eqn.params["num_consts"] + eqn.params["num_carry"]
        inner: list[_Found | None] = []
        for k, f in enumerate(found):
            if f is not None and k >= carried:
                index, dims = f
                if dims and dims[0] is not None:
                    self.scanned.setdefault(index, set()).add(dims[0])
                f = (index, dims[1:])
            inner.append(f)
        self._call(eqn.params["jaxpr"].jaxpr, inner)
