"""How a step uses its parameters, and where their products go: read from the
step's jaxpr (traced once, never compiled) for `search_layout`'s candidates.

Each parameter's variable is followed through the jaxpr, into calls (`jit`,
`checkpoint`, custom derivatives, `shard_map`), loops (`scan`, `while`) and
branches (`cond`), and through the operations that keep its dimensions
(conversions, copies, sharding constraints, `rev`; `transpose` permutes them).
Four facts per parameter (`Use`):

- **Its first use**: the dimensions the first `dot_general` that consumes it
  contracts and those it keeps (a matrix's input and output: `eqx.nn.Linear`
  contracts dimension 1, `x @ kernel` dimension 0, a per-head `(heads, dim,
  head_dim)` weight dimension 1), a convolution's input and output features,
  the dimensions a `gather` indexes (an embedding's vocabulary), or another
  operation. The forward pass comes first in a differentiated step, so the
  backward pass's uses do not count.
- **Its stacked dimensions**: the leading dimensions a `lax.scan` iterates over
  (layers stacked with `eqx.filter_vmap`), which no layout should split.
- **What feeds it** (`fed_by`): the matrices whose products reach the
  dimensions its first use contracts. A matrix's product is *tagged* on its
  output dimension (with the factors a `reshape` makes of it: heads, then
  head size; the first is the one a layout splits), and the tag follows the
  data: elementwise operations, broadcasts, transposes, reshapes, slices
  (strided too: rotary embeddings' `x[..., ::2]`), concatenations and stacks,
  reductions and products of activations over other dimensions (attention's
  heads are a batch dimension of both its products).
- **Whether its product stays local** (`local`): a tag *ends* where the split
  would need a collective before another matrix reads it: a reduction or a
  product over its split dimension, an elementwise operation with a value
  reduced over it (a norm: `x - mean(x)`), or a sum with a product of other
  matrices (a residual). Only what happens before the last matrix's first use
  (the forward pass) counts.

Operations this does not know end the tags they meet (a pair is then not
found: the hints are vaguer, never wrong); a known primitive whose parameters
are not laid out as expected, or any equation this reader cannot follow,
raises `Unrecognised` (the search then warns and pairs nothing). The program is
read through `_internals/equations.py`'s views (`Program`, `Equation`).
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

from .._internals.equations import (
    contracting_dims,
    conv_dims,
    Equation,
    gathered_dims,
    Program,
    program_of,
)
from .._internals.routes import Unrecognised


class Use(NamedTuple):
    """How the step uses one parameter."""

    kind: str  # "dot", "conv", "gather", "other" or "" (unused)
    dims: tuple[int, ...]  # contracted ("dot"), input features ("conv"), indexed
    stacked: int  # leading dimensions a scan iterates over
    out: tuple[int, ...] = ()  # the dimensions a "dot" keeps, a "conv"'s outputs
    fed_by: tuple[int, ...] = ()  # the parameters whose products reach `dims`
    local: bool = False  # whether its product stays split until another reads it


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
        "stop_gradient",
    }
)
# Elementwise operations (operands of one rank, or scalars); the sums among them.
_ELEMENTWISE = frozenset(
    """abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp
    complex cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag
    integer_pow is_finite le log log1p logistic lt max min mul ne neg nextafter
    not or pow real rem round rsqrt select_n sign sin sinh sqrt square sub tan tanh
    xor""".split()
)
_SUMS = frozenset({"add", "add_any", "sub"})
_REDUCTIONS = frozenset(
    """reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or
    reduce_xor argmax argmin""".split()
)
_CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())

# A parameter's variable: (its index, the parameter dimension of each of the
# variable's dimensions, `None` where there is none).
_Found = tuple[int, tuple[int | None, ...]]


class _Flow(NamedTuple):
    """An activation: the matrices whose products it carries, each with the
    dimensions of its output (the split one first), and the matrices a
    reduction over whose split dimension it holds."""

    tags: dict[int, tuple[int, ...]]
    reduced: frozenset[int]


def parameter_uses(closed: Any, count: int) -> list[Use]:
    """The use of each of the first `count` inputs of `closed` (as
    `jax.make_jaxpr` makes it)."""
    program = program_of(closed)
    walker = _Walker()
    env: dict[int, Any] = {}
    for i, key in enumerate(program.ins[:count]):
        env[key] = (i, tuple(range(len(program.in_shape(i)))))
    try:
        walker.walk(program, env)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as error:
        # An equation laid out as this reader does not expect.
        raise Unrecognised(f"{type(error).__name__}: {error}") from None
    horizon = max(
        (at for i, at in walker.first_at.items() if walker.first[i][0] in _MATRIX),
        default=-1,
    )
    uses = []
    for i in range(count):
        kind, dims, out = walker.first.get(i, ("", (), ()))
        scanned = walker.scanned.get(i, set())
        stacked = 0
        while stacked in scanned:
            stacked += 1
        ended = walker.ended.get(i, horizon + 1) <= horizon
        local = kind in _MATRIX and not ended
        fed_by = tuple(sorted(walker.fed_by.get(i, ())))
        uses.append(Use(kind, dims, stacked, out, fed_by, local))
    return uses


_MATRIX = ("dot", "conv")


def reshape_groups(old: Sequence[int], new: Sequence[int]) -> list[tuple]:
    """The dimensions of `old` and of `new` that a reshape maps onto each other,
    as `(old dims, new dims)` groups of equal size."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(old) and j < len(new):
        a, b, pa, pb = [i], [j], old[i], new[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(old):
                a.append(i)
                pa, i = pa * old[i], i + 1
            elif j < len(new):
                b.append(j)
                pb, j = pb * new[j], j + 1
            else:
                raise Unrecognised("a 'reshape' that changes the size")
        groups.append((a, b))
    if groups:  # trailing dimensions of size 1
        groups[-1][0].extend(range(i, len(old)))
        groups[-1][1].extend(range(j, len(new)))
    return groups


def _ordered(dims: Sequence[int | None]) -> tuple[int, ...]:
    seen: list[int] = []
    for d in dims:
        if d is not None and d not in seen:
            seen.append(d)
    return tuple(seen)


class _Walker:
    """One walk over a program in order: parameters' first uses, the scans'
    stacked dimensions, the matrices that feed each matrix, and where (the
    walk's clock) each matrix's tag ended."""

    def __init__(self) -> None:
        self.first: dict[int, tuple[str, tuple[int, ...], tuple[int, ...]]] = {}
        self.first_at: dict[int, int] = {}
        self.scanned: dict[int, set[int]] = {}
        self.fed_by: dict[int, set[int]] = {}
        self.ended: dict[int, int] = {}
        self.clock = 0

    # --------------------------------------------------------------- parameters

    def _use(
        self,
        found: _Found | None,
        kind: str,
        dims: Sequence[int],
        out: Sequence[int] = (),
    ) -> bool:
        """Records `found`'s first use; whether this is it."""
        if found is None or found[0] in self.first:
            return False
        index, mapped = found
        self.first[index] = (
            kind,
            tuple(sorted(_ordered([mapped[k] for k in dims]))),
            tuple(sorted(_ordered([mapped[k] for k in out]))),
        )
        self.first_at[index] = self.clock
        return True

    def _end(self, sources: Any) -> None:
        for source in sources:
            self.ended.setdefault(source, self.clock)

    # ------------------------------------------------------------------- walking

    def walk(self, program: Program, env: dict[int, Any]) -> None:
        for eqn in program.equations:
            self.clock += 1
            found = [env.get(key) for key in eqn.ins]
            if any(f is not None for f in found):
                self._eqn(eqn, found, env)

    def _eqn(self, eqn: Equation, found: list[Any], env: dict) -> None:
        name = eqn.name
        params = [
            f if isinstance(f, tuple) and not isinstance(f, _Flow) else None
            for f in found
        ]
        flows = [f if isinstance(f, _Flow) else None for f in found]
        outs: list[Any]
        if name == "dot_general":
            outs = [self._dot(eqn, params, flows)]
        elif name == "conv_general_dilated":
            outs = [self._conv(eqn, params, flows)]
        elif name == "gather":
            self._use(params[0], "gather", gathered_dims(eqn))
            outs = [None]
        elif name in _SAME or name == "rev":
            outs = [p if p is not None else f for p, f in zip(params, flows)]
        elif name == "transpose":
            outs = [self._transpose(eqn, found[0])]
        elif name == "scan":
            outs = self._scan(eqn, found)
        elif name == "while":
            skip = eqn.param("cond_nconsts")
            body = eqn.program("body_jaxpr", "a 'while' body")
            outs = self._call(body, found[skip:])
        elif name == "cond":
            outs = []
            for branch in eqn.programs("branches", "a 'cond' branch"):
                made = self._call(branch, found[1:])
                outs = [_merge(a, b) for a, b in zip(made, outs)] if outs else made
        elif (callee := eqn.callee()) is not None:
            outs = self._call(callee, found)
        else:
            for p in params:
                self._use(p, "other", ())
            outs = self._activation(eqn, name, flows)
        for key, out in zip(eqn.outs, outs, strict=False):
            if out is not None:
                env[key] = out

    def _call(self, program: Program, found: Sequence[Any]) -> list[Any]:
        ins = program.ins
        if len(ins) != len(found):
            return []
        inner = {key: f for key, f in zip(ins, found, strict=True) if f is not None}
        self.walk(program, inner)
        return [inner.get(key) for key in program.outs]

    def _scan(self, eqn: Equation, found: list[Any]) -> list[Any]:
        carried = eqn.param("num_consts") + eqn.param("num_carry")
        body = eqn.program("jaxpr", "a 'scan' body")
        inner: list[Any] = []
        for k, f in enumerate(found):
            if f is not None and k >= carried:
                if isinstance(f, _Flow):
                    f = _moved(f, lambda d: None if d == 0 else d - 1)
                else:
                    index, dims = f
                    if dims and dims[0] is not None:
                        self.scanned.setdefault(index, set()).add(dims[0])
                    f = (index, dims[1:])
            inner.append(f)
        made = self._call(body, inner)
        carry = eqn.param("num_carry")
        # The carry comes out as it went in; the stacked outputs gain an axis.
        return [
            f
            if k < carry
            else _moved(f, lambda d: d + 1)
            if isinstance(f, _Flow)
            else None
            for k, f in enumerate(made)
        ]

    def _transpose(self, eqn: Equation, found: Any) -> Any:
        order = [int(p) for p in eqn.param("permutation")]
        if isinstance(found, _Flow):
            return _moved(found, lambda d: list(order).index(d))
        if found is None:
            return None
        index, dims = found
        return (index, tuple(dims[p] for p in order))

    # ------------------------------------------------------------------ products

    def _dot(self, eqn: Equation, params: list[Any], flows: list[Any]) -> _Flow | None:
        (lc, rc), (lb, rb) = contracting_dims(eqn)
        ranks = [len(eqn.in_shape(k)) for k in (0, 1)]
        free = [
            [d for d in range(ranks[0]) if d not in lc and d not in lb],
            [d for d in range(ranks[1]) if d not in rc and d not in rb],
        ]
        # Where each operand's dimensions land in the result.
        place: list[dict[int, int]] = [{}, {}]
        for k, (a, b) in enumerate(zip(lb, rb, strict=True)):
            place[0][a], place[1][b] = k, k
        for side, offset in ((0, len(lb)), (1, len(lb) + len(free[0]))):
            for k, d in enumerate(free[side]):
                place[side][d] = offset + k
        contracted = (lc, rc)
        new: list[bool] = []
        for side in (0, 1):
            dims = contracted[side]
            new.append(self._use(params[side], "dot", dims, free[side]))
        if any(p is not None for p in params):
            matrix = next((side for side in (0, 1) if new[side]), None)
            if matrix is None:  # a later use: the backward pass
                return None
            other = flows[1 - matrix]
            index = params[matrix][0]
            tags: dict[int, tuple[int, ...]] = {}
            if other is not None:
                for source, dims in other.tags.items():
                    if dims[0] in contracted[1 - matrix]:
                        self.fed_by.setdefault(index, set()).add(source)
                    else:
                        tags[source] = _ordered(
                            [place[1 - matrix].get(d) for d in dims]
                        )
            mapped = params[matrix][1]
            order = sorted(free[matrix], key=lambda d: _rank(mapped, d))
            own = [place[matrix][d] for d in order]
            if own:
                tags[index] = tuple(own)
            return _Flow(tags, frozenset())
        tags, reduced = {}, set()
        for side in (0, 1):
            flow = flows[side]
            if flow is None:
                continue
            reduced |= flow.reduced
            for source, dims in flow.tags.items():
                if dims[0] in contracted[side]:
                    reduced.add(source)
                    self._end([source])
                elif source not in tags:
                    tags[source] = _ordered([place[side].get(d) for d in dims])
        return _Flow(tags, frozenset(reduced))

    def _conv(self, eqn: Equation, params: list[Any], flows: list[Any]) -> _Flow | None:
        specs = conv_dims(eqn)
        kernel = params[1]
        if specs is None or kernel is None or params[0] is not None:
            for p in params:
                self._use(p, "other", ())
            return None
        lhs, rhs, out = specs
        if not self._use(kernel, "conv", (rhs[1],), (rhs[0],)):
            return None
        tags: dict[int, tuple[int, ...]] = {}
        flow = flows[0]
        for source, dims in (flow.tags if flow is not None else {}).items():
            if dims[0] == lhs[1]:
                self.fed_by.setdefault(kernel[0], set()).add(source)
            elif dims[0] == lhs[0]:
                tags[source] = (out[0],)
        tags[kernel[0]] = (out[1],)
        return _Flow(tags, frozenset())

    # --------------------------------------------------------------- activations

    def _activation(self, eqn: Equation, name: str, flows: list[Any]) -> list[Any]:
        """The flows of an operation on activations (`[]`: ends them)."""
        if not any(f is not None for f in flows):
            return []
        if name in _ELEMENTWISE:
            rank = len(eqn.out_shape(0))
            same = [
                f if f is not None and len(eqn.in_shape(k)) == rank else None
                for k, f in enumerate(flows)
            ]
            return [self._combine(same, residual=name in _SUMS)]
        flow = flows[0]
        if name == "broadcast_in_dim" and flow is not None:
            where = eqn.param("broadcast_dimensions")
            return [_moved(flow, lambda d: int(where[d]))]
        if name == "reshape" and flow is not None:
            old, new = eqn.in_shape(0), eqn.out_shape(0)
            if 0 in old or eqn.given("dimensions"):
                return []
            return [_reshaped(flow, reshape_groups(old, new), old, new)]
        if name == "squeeze" and flow is not None:
            gone = {int(d) for d in eqn.param("dimensions")}
            keep = [d for d in range(len(eqn.in_shape(0))) if d not in gone]
            return [_moved(flow, lambda d: keep.index(d) if d in keep else None)]
        if name in ("slice", "dynamic_slice", "pad", "split", "rev"):
            return [flow] * len(eqn.outs)
        if name in ("concatenate", "dynamic_update_slice"):
            return [self._combine(flows, residual=False)]
        if name == "stack":  # operands of one shape along a new axis
            axis = int(eqn.param("axis"))
            moved = [
                None if f is None else _moved(f, lambda d: d + (d >= axis))
                for f in flows
            ]
            return [self._combine(moved, residual=False)]
        if name in _REDUCTIONS and flow is not None:
            axes = {int(a) for a in eqn.param("axes")}
            keep = [d for d in range(len(eqn.in_shape(0))) if d not in axes]
            return [self._reduced(flow, axes, lambda d: keep.index(d))]
        if name in _CUMULATIVE and flow is not None:
            axis = int(eqn.param("axis"))
            return [self._reduced(flow, {axis}, lambda d: d)]
        return []

    def _reduced(self, flow: _Flow, axes: set[int], where: Any) -> _Flow:
        """`flow` reduced over `axes`: a tag split on one of them ends."""
        tags, reduced = {}, set(flow.reduced)
        for source, dims in flow.tags.items():
            if dims[0] in axes:
                reduced.add(source)
                self._end([source])
            else:
                kept = [where(d) for d in dims if d not in axes]
                tags[source] = tuple(kept)
        return _Flow(tags, frozenset(reduced))

    def _combine(self, flows: Sequence[Any], *, residual: bool) -> _Flow:
        """The flow of an elementwise operation of these operands' flows."""
        present = [f for f in flows if f is not None]
        reduced = frozenset().union(*(f.reduced for f in present))
        tagged = [set(f.tags) for f in present if f.tags]
        if residual and len(tagged) > 1 and any(t != tagged[0] for t in tagged):
            self._end(set().union(*tagged))
            return _Flow({}, reduced)
        tags: dict[int, tuple[int, ...]] = {}
        for flow in present:
            for source, dims in flow.tags.items():
                if source in reduced:
                    self._end([source])
                else:
                    tags.setdefault(source, dims)
        return _Flow(tags, reduced)


def _rank(mapped: Sequence[int | None], d: int) -> int:
    """The parameter dimension behind dimension `d` of its variable."""
    at = mapped[d]
    return at if at is not None else len(mapped) + d


def _moved(flow: _Flow, where: Any) -> _Flow:
    """`flow` with each dimension `d` moved to `where(d)` (`None`: gone); a tag
    whose split dimension is gone goes on with its next factor."""
    tags = {}
    for source, dims in flow.tags.items():
        kept = _ordered([where(d) for d in dims])
        if kept:
            tags[source] = kept
    return _Flow(tags, flow.reduced)


def _reshaped(
    flow: _Flow, groups: list[tuple], old: Sequence[int], new: Sequence[int]
) -> _Flow:
    """`flow` through a reshape: a tagged dimension split into several is
    tagged on each (the major first); dimensions merged keep the tag when the
    major of them is tagged."""
    group_of = {d: g for g, (a, _) in enumerate(groups) for d in a}
    tags = {}
    for source, dims in flow.tags.items():
        made: list[int] = []
        for k, d in enumerate(dims):
            a, b = groups[group_of[d]]
            lead = next((x for x in a if old[x] > 1), a[0])
            if d == lead or lead in dims:
                made += [j for j in b if new[j] > 1] or b[:1]
            elif k == 0:
                break  # the split dimension is a minor part of a merged one
        else:
            if made:
                tags[source] = _ordered(made)
    return _Flow(tags, flow.reduced)


def _merge(a: Any, b: Any) -> Any:
    if isinstance(a, _Flow) and isinstance(b, _Flow):
        return _Flow({**b.tags, **a.tags}, a.reduced | b.reduced)
    return a if a is not None else b
