"""The built-in layouts of `search_layout`: rules lists a person can read, made
from the parameters' shapes, how the step uses them and where their products
go (`_uses.py`) and the mesh's axes; and the rules-file text of a layout.

How candidates are made:

1. **Parameters.** Each array of the tree with its path, shape and use
   (`_uses.py`): a *matrix* is one whose first use is a matmul (or a
   convolution) that contracts some of its dimensions past the stacked ones
   (its input: the first of them) and keeps others (its output: the first,
   the heads of a per-head `(heads, dim, head_dim)` weight), an *embedding*
   one whose first use is a gather indexing one dimension.
2. **Pairs** (`tensor_pairs`). Tensor parallelism splits the output of a
   pair's first matrices and the input of its second, so that the activations
   between them stay split and one reduction ends the pair (Megatron's
   layout). Pairs come from the step's data flow, not from names: a matrix
   whose product stays split until other matrices read it is *first* (q, k and
   v, separate, fused or per head, through attention's heads; an MLP's up and
   gate; a convolution before a channel-wise norm); the matrices its product
   feeds are *second* (the output projection, the down projection); firsts
   and seconds that feed each other are one pair. The bias of a first matrix
   follows its output. Matrices no pair holds are listed (`unpaired`).
3. **Strategies** over the mesh's axes (`strategies`): replicated; FSDP over the
   data axes ([`eqshard.auto_fsdp`][]), and over all axes; tensor parallel over
   the other axes (or over each axis, when the batch spans them all), alone or
   with FSDP over the remaining data axes, each with and without the vocabulary
   (embeddings split on the dimension they index, unpaired matmul matrices that
   widen, such as the head, on their output; not convolutions). Stacked leading
   axes are never split: the specs start with `None` there and `auto_fsdp` gets
   `stacked=`.
4. **Rules** (`strategy_rules`): a rule per group of paths that differ only in
   their layer numbers, for the arrays whose value differs from the strategy's
   default; a prefix rule for stacked subtrees; the default last (`.*`). Rules
   that match nothing are dropped, and the rules are checked to give each array
   the intended spec (else each array gets a rule of its own).
"""

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import jax.tree_util as jtu
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import PyTree

from .._spectree._auto import auto_fsdp
from .._spectree._check_spec import entry_axes
from .._spectree._memory import Host
from .._spectree._rules import match_partition_rules, rule_spec
from .._spectree._rules_report import explain_partition_rules
from .._tree import is_array, path_name
from ._flow import Use


# Arrays with fewer elements stay replicated under FSDP: gathering them costs a
# collective each for almost no memory.
FSDP_MIN_SIZE = 1024


@dataclasses.dataclass(frozen=True)
class Param:
    """An array of the tree the candidates lay out."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    use: Use

    @property
    def name(self) -> str:
        return "/".join(self.path)

    @property
    def stacked(self) -> int:
        return self.use.stacked

    @property
    def matrix(self) -> bool:
        """Whether its first use is a matmul or a convolution that contracts and
        keeps dimensions past the stacked ones."""
        use = self.use
        return (
            use.kind in ("dot", "conv")
            and bool(use.dims and use.out)
            and min(use.dims + use.out) >= self.stacked
        )

    @property
    def in_dim(self) -> int | None:
        """A matrix's input dimension (the first its matmul contracts)."""
        return self.use.dims[0] if self.matrix else None

    @property
    def out_dim(self) -> int | None:
        """A matrix's output dimension (the first its matmul keeps: the heads of
        a per-head `(heads, dim, head_dim)` weight)."""
        return self.use.out[0] if self.matrix else None

    @property
    def indexed_dim(self) -> int | None:
        """An embedding's indexed dimension."""
        if self.use.kind == "gather" and len(self.use.dims) == 1:
            dim = self.use.dims[0]
            return dim if dim >= self.stacked else None
        return None

    def size(self, dim: int | None) -> int:
        return 0 if dim is None else self.shape[dim]


def parameters(tree: PyTree, uses: Sequence[Use]) -> list[Param]:
    """The arrays of `tree` with their uses (one a leaf, in order)."""
    leaves = [
        (path, leaf)
        for path, leaf in jtu.tree_flatten_with_path(tree)[0]
        if is_array(leaf)
    ]
    return [
        Param(path_name(path, None), tuple(int(n) for n in leaf.shape), use)
        for (path, leaf), use in zip(leaves, uses, strict=True)
    ]


# ---------------------------------------------------------------------------------
# Tensor-parallel pairs.
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pair:
    """Matrices whose outputs feed `seconds`, with the biases that follow the
    first matrices' outputs."""

    firsts: tuple[Param, ...]
    biases: tuple[Param, ...]
    seconds: tuple[Param, ...]


def tensor_pairs(params: Sequence[Param]) -> list[Pair]:
    """The tensor-parallel pairs of `params` (in the order of their first
    matrices), from the step's data flow: a matrix is *first* when its product
    stays split until other matrices read it (`Use.local`) and no first matrix
    feeds it; a matrix fed by first ones is *second*. Matrices are taken in
    the order of the flow (a matrix after those that feed it), so a chain
    alternates; firsts and seconds that feed each other form one pair."""
    index = {p.name: i for i, p in enumerate(params)}
    matrices = [i for i, p in enumerate(params) if p.matrix]
    feeds: dict[int, set[int]] = {}
    for i in matrices:
        for j in params[i].use.fed_by:
            if j < len(params) and params[j].matrix:
                feeds.setdefault(j, set()).add(i)
    role: dict[int, str] = {}
    owner = list(range(len(params)))

    def find(i: int) -> int:
        while owner[i] != i:
            owner[i] = owner[owner[i]]
            i = owner[i]
        return i

    for i in _flow_order(params, matrices, feeds):
        firsts = [j for j in params[i].use.fed_by if role.get(j) == "first"]
        if firsts:
            role[i] = "second"
            for j in firsts:
                owner[find(j)] = find(i)
        elif params[i].use.local and i in feeds:
            role[i] = "first"
    groups: dict[int, list[int]] = {}
    for i in sorted(role):
        groups.setdefault(find(i), []).append(i)
    pairs = []
    for members in groups.values():
        firsts = [params[i] for i in members if role[i] == "first"]
        seconds = [params[i] for i in members if role[i] == "second"]
        if firsts and seconds:
            pairs.append(Pair(tuple(firsts), _biases(params, firsts), tuple(seconds)))
    return sorted(pairs, key=lambda pair: index[pair.firsts[0].name])


def _flow_order(
    params: Sequence[Param], matrices: list[int], feeds: dict[int, set[int]]
) -> list[int]:
    """`matrices`, each after those that feed it (else in the tree's order)."""
    waiting = {
        i: {j for j in params[i].use.fed_by if j in feeds and j != i} for i in matrices
    }
    order: list[int] = []
    ready = [i for i in matrices if not waiting[i]]
    while ready:
        i = ready.pop(0)
        order.append(i)
        for k in sorted(feeds.get(i, ())):
            if k in waiting and i in waiting[k]:
                waiting[k].discard(i)
                if not waiting[k]:
                    ready.append(k)
                    ready.sort()
    return order + [i for i in matrices if i not in order]  # (a cycle: none)


def _biases(params: Sequence[Param], firsts: Sequence[Param]) -> tuple[Param, ...]:
    """The biases that follow the first matrices' outputs: a vector of the
    output's size beside a matrix that is the only one of its module (the
    `bias` of an `eqx.nn.Linear`)."""
    found = []
    for f in firsts:
        siblings = [p for p in params if p.path[:-1] == f.path[:-1] and p is not f]
        if any(p.matrix for p in siblings) or f.out_dim is None:
            continue
        size = f.shape[f.out_dim]
        found += [
            p
            for p in siblings
            if (dim := bias_dim(p)) is not None and p.shape[dim] == size
        ]
    return tuple(found)


def bias_dim(param: Param) -> int | None:
    """The dimension of a bias: its one dimension past the stacked ones other
    than 1 (a convolution's bias is `(channels, 1, 1)`)."""
    dims = [d for d in range(param.stacked, len(param.shape)) if param.shape[d] != 1]
    return dims[0] if len(dims) == 1 else None


def unpaired(params: Sequence[Param], pairs: Sequence[Pair]) -> list[str]:
    """The matrices (and convolutions) that no pair holds, by path."""
    paired = {m.name for pair in pairs for m in pair.firsts + pair.seconds}
    return [p.name for p in params if p.matrix and p.name not in paired]


# ---------------------------------------------------------------------------------
# Strategies.
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A built-in layout: tensor parallel over `tp` (with the vocabulary if
    `vocab`), FSDP over `fsdp`; with neither, replicated."""

    tp: tuple[str, ...] = ()
    fsdp: tuple[str, ...] = ()
    vocab: bool = False

    @property
    def name(self) -> str:
        parts = []
        if self.fsdp:
            parts.append(f"fsdp({'+'.join(self.fsdp)})")
        if self.tp:
            parts.append(f"tp({'+'.join(self.tp)}{', vocab' if self.vocab else ''})")
        return " x ".join(parts) or "replicated"


def strategies(mesh: Mesh, data_axes: Sequence[str]) -> list[Strategy]:
    """The built-in strategies for `mesh` whose batch is split over `data_axes`,
    in the order they are tried: replicated, FSDP, tensor parallel, hybrids."""
    axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    data = [a for a in axes if a in data_axes]
    model = [a for a in axes if a not in data]
    found = [Strategy()]
    if data:
        found.append(Strategy(fsdp=tuple(data)))
    if model and data:
        found.append(Strategy(fsdp=tuple(axes)))
    # Tensor parallel over the axes the batch does not use; if it uses them all,
    # over each axis in turn, the largest first.
    largest = sorted(axes, key=lambda a: (-mesh.shape[a], mesh.axis_names.index(a)))
    tps = [tuple(model)] if model else [(a,) for a in largest]
    for tp in tps:
        for vocab in (False, True):
            found.append(Strategy(tp=tp, vocab=vocab))
        rest = tuple(a for a in data if a not in tp)
        if rest:
            for vocab in (False, True):
                found.append(Strategy(tp=tp, fsdp=rest, vocab=vocab))
    return found


def _split(dim: int, axes: tuple[str, ...]) -> PartitionSpec:
    """The spec that splits dimension `dim` over `axes`."""
    entry = axes[0] if len(axes) == 1 else axes
    return PartitionSpec(*([None] * dim), entry)


def tp_specs(
    params: Sequence[Param],
    pairs: Sequence[Pair],
    axes: tuple[str, ...],
    size: int,
    vocab: bool,
) -> dict[str, PartitionSpec]:
    """The specs tensor parallelism over `axes` (of total `size`) gives, by path;
    a matrix whose dimension `size` does not divide is left out."""
    specs: dict[str, PartitionSpec] = {}
    paired: set[str] = set()
    for pair in pairs:
        paired.update(m.name for m in pair.firsts + pair.seconds)
        seconds = [s for s in pair.seconds if s.size(s.in_dim) % size == 0]
        if not seconds:
            continue
        for f in pair.firsts:
            dim = f.out_dim
            if dim is not None and f.shape[dim] % size == 0:
                specs[f.name] = _split(dim, axes)
        for b in pair.biases:
            dim = bias_dim(b)
            if dim is not None and b.shape[dim] % size == 0:
                specs[b.name] = _split(dim, axes)
        for s in seconds:
            specs[s.name] = _split(s.in_dim or 0, axes)
    if vocab:
        for p in params:
            dim = p.indexed_dim
            if dim is None and p.name not in paired:
                widens = p.use.kind == "dot" and p.size(p.out_dim) > p.size(p.in_dim)
                dim = p.out_dim if widens else None
            if dim is not None and p.shape[dim] % size == 0:
                specs.setdefault(p.name, _split(dim, axes))
    return specs


# ---------------------------------------------------------------------------------
# Rules.
# ---------------------------------------------------------------------------------


def path_pattern(parts: Sequence[str], *, whole: bool = True) -> str:
    """A regex for the path `parts` with its sequence indices generalised:
    `(^|/)blocks/\\d+/mlp/up/weight$`; a prefix (`(^|/)blocks/`) if not
    `whole`. It matches the path at the start of a path or after a `/`: the
    parameters' own path, and theirs inside the step's state (`0/blocks/...`
    of `(model, opt_state)`, whose optimizer state follows the model), so the
    rules lay out the step's arguments as the search compiled them."""
    body = "/".join(r"\d+" if part.isdigit() else re.escape(part) for part in parts)
    return _START + body + ("$" if whole else "/")


_START = "(^|/)"  # the start of a path, or of a part of one


def _grouped(
    params: Sequence[Param], values: dict[str, Any], default: dict[str, Any]
) -> list[tuple[str, Any]]:
    """A rule per group of paths that differ only in sequence indices, for the
    arrays whose value is not their default; a rule per path where a group's
    values differ."""
    groups: dict[str, list[Param]] = {}
    for p in params:
        groups.setdefault(path_pattern(p.path), []).append(p)
    rules = []
    for pattern, members in groups.items():
        wanted = [values[p.name] for p in members]
        if all(values[p.name] == default[p.name] for p in members):
            continue
        if all(w == wanted[0] for w in wanted):
            rules.append((pattern, wanted[0]))
            continue
        rules += [
            (_exact(p), values[p.name])
            for p in members
            if values[p.name] != default[p.name]
        ]
    return rules


def _exact(param: Param) -> str:
    return _START + re.escape(param.name) + "$"


def _stacked_prefixes(params: Sequence[Param]) -> list[tuple[str, int]]:
    """For each stacked subtree, the shortest prefix under which every array is
    stacked as deep, with that depth."""
    found: dict[str, int] = {}
    for p in params:
        if not p.stacked:
            continue
        for j in range(1, len(p.path) + 1):
            under = [q for q in params if q.path[:j] == p.path[:j]]
            if all(q.stacked == p.stacked for q in under):
                found[path_pattern(p.path[:j], whole=j == len(p.path))] = p.stacked
                break
    return list(found.items())


def strategy_rules(
    strategy: Strategy,
    params: Sequence[Param],
    pairs: Sequence[Pair],
    tree: PyTree,
    mesh: Mesh,
) -> list[tuple[str, Any]]:
    """The rules of `strategy` for `tree` (whose arrays are `params`)."""
    tp = {}
    if strategy.tp:
        size = math.prod(mesh.shape[a] for a in strategy.tp)
        tp = tp_specs(params, pairs, strategy.tp, size, strategy.vocab)

    def fsdp(stacked: int, base: PartitionSpec = PartitionSpec()) -> Any:
        return auto_fsdp(
            strategy.fsdp, min_size=FSDP_MIN_SIZE, stacked=stacked, base=base
        )

    default: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for p in params:
        default[p.name] = fsdp(p.stacked) if strategy.fsdp else PartitionSpec()
        spec = tp.get(p.name)
        if spec is None:
            values[p.name] = default[p.name]
        else:
            values[p.name] = fsdp(p.stacked, spec) if strategy.fsdp else spec
    rules = _grouped(params, values, default)
    if strategy.fsdp:
        rules += [(prefix, fsdp(k)) for prefix, k in _stacked_prefixes(params)]
    rules.append((".*", fsdp(0) if strategy.fsdp else PartitionSpec()))
    rules = _without_dead_rules(rules, tree, mesh)
    if not _gives(rules, tree, mesh, params, values):
        exact = [(_exact(p), values[p.name]) for p in params]
        rules = _without_dead_rules(exact, tree, mesh)
    return rules


def _without_dead_rules(
    rules: list[tuple[str, Any]], tree: PyTree, mesh: Mesh
) -> list[tuple[str, Any]]:
    dead = set(explain_partition_rules(rules, tree, mesh=mesh).dead_rules)
    return [rule for i, rule in enumerate(rules) if i not in dead]


def _gives(
    rules: list[tuple[str, Any]],
    tree: PyTree,
    mesh: Mesh,
    params: Sequence[Param],
    values: dict[str, Any],
) -> bool:
    """Whether `rules` give each array the spec its value gives it."""
    specs = match_partition_rules(rules, tree, mesh=mesh)
    got = [s for s in jtu.tree_leaves(specs) if isinstance(s, PartitionSpec)]
    for p, spec in zip(params, got, strict=True):
        want, _ = rule_spec(
            values[p.name],
            p.shape,
            caller="search_layout",
            name=p.name,
            rule=0,
            mesh=mesh,
        )
        if not p.shape:
            want = PartitionSpec()
        if normalized(spec) != normalized(want):
            return False
    return True


def normalized(spec: PartitionSpec) -> tuple[tuple[str, ...], ...]:
    """A spec as a tuple of axis tuples, without trailing `None`s: equal for
    specs that lay an array out the same way."""
    entries = [tuple(entry_axes(e)) for e in spec]
    while entries and not entries[-1]:
        entries.pop()
    return tuple(entries)


# ---------------------------------------------------------------------------------
# The rules-file text.
# ---------------------------------------------------------------------------------


def _placed(spec: PartitionSpec | Host) -> tuple[Any, ...]:
    """`normalized`, and whether the spec is in host memory."""
    if isinstance(spec, Host):
        return (normalized(spec.spec), "host")
    return (normalized(spec),)


def spec_text(spec: PartitionSpec | Host) -> str:
    """`spec` in the rules-file form: `dp,tp`, `None,tp`, `dp+fsdp`, `()`, and
    `host(dp,tp)` for a layout in host memory."""
    if isinstance(spec, Host):
        return f"host({spec_text(spec.spec)})"
    if not len(spec):
        return "()"
    return ",".join("+".join(entry_axes(entry)) or "None" for entry in spec)


def rules_text(tree: PyTree, specs: PyTree, *, header: Sequence[str] = ()) -> str:
    """A rules file (the `--rules` format of `python -m eqshard`) that gives every
    array of `tree` its spec in `specs`: one line per group of paths that differ
    only in sequence indices (the layers), or one line per path where a group's
    specs differ. Scalars, which rules never place, have no line."""
    names = [
        path_name(path, None)
        for path, leaf in jtu.tree_flatten_with_path(tree)[0]
        if is_array(leaf)
    ]
    ranks = [len(leaf.shape) for leaf in jtu.tree_leaves(tree) if is_array(leaf)]
    spec_leaves = [
        spec
        for spec in jtu.tree_leaves(
            specs, is_leaf=lambda x: isinstance(x, PartitionSpec | Host)
        )
        if isinstance(spec, PartitionSpec | Host)
    ]
    groups: dict[str, list[tuple[str, PartitionSpec | Host]]] = {}
    for parts, rank, spec in zip(names, ranks, spec_leaves, strict=True):
        if rank:
            groups.setdefault(path_pattern(parts), []).append(("/".join(parts), spec))
    lines = [f"# {line}" for line in header]
    for pattern, members in groups.items():
        if len({_placed(spec) for _, spec in members}) == 1:
            lines.append(f"{pattern}  {spec_text(members[0][1])}")
        else:
            for name, spec in members:
                lines.append(f"{_START}{re.escape(name)}$  {spec_text(spec)}")
    return "\n".join(lines) + "\n"
