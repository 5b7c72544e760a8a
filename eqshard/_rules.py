"""Regex partition rules, pattern strings and weight-decay masks.

A *rule* is a `(regex, value)` pair, where the value is a `PartitionSpec`,
logical `AxisNames`, one layer's spec for stacked layers (`stacked`, read from a
leaf's last dimensions), or a callable of the leaf's shape returning one (such as
`auto_fsdp`'s, which also reads the axis sizes of the mesh the rules are matched
on). Rules are tried in order against the path string of each array leaf
(`re.search`), and the first match gives the leaf's spec; `rule_spec` is the one
place a rule's value becomes a leaf's spec. In a tuple or list of trees built
together (`(model, opt_state)`), an array that follows another item's array
(`_follow.followed`) takes that array's spec instead (`_followers`). One private
core, `_match_leaves`, does the matching for both `match_partition_rules` and
`explain_partition_rules`: each regex is compiled once per call and each path is
built and matched once.
"""

import ast
import dataclasses
import math
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, TypeAlias

import jax.tree_util as jtu
from jax.sharding import AbstractMesh, Mesh, PartitionSpec
from jaxtyping import PyTree

from ._auto import AutoFSDP
from ._deprecated import renamed_keywords
from ._follow import followed, is_placeholder, without_dim
from ._logical import AxisNames, get_logical_axis_rules, logical_to_spec, LogicalRules
from ._mesh import mesh_repr
from ._report import Report, text_table
from ._specs import check_spec, spec_entry
from ._tree import is_array, path_name
from ._typing import (
    check_choice,
    Int,
    KeyPath,
    ON_INVALID,
    OnInvalid,
    PartitionRulesArg,
    PyTreeDef,
    sequence_fix,
    typecheck,
    warn,
)


# ---------------------------------------------------------------- stacked layers


@dataclasses.dataclass(frozen=True)
class Stacked:
    """A partition-rule value written for one layer, for layers stacked on leading
    axes; made by [`eqshard.stacked`][].

    **Fields:** `spec`, the layer's `PartitionSpec` or logical
    [`eqshard.AxisNames`][], naming the last `len(spec)` dimensions of a leaf.
    """

    spec: PartitionSpec | AxisNames

    def place(self, spec: PartitionSpec, rank: int) -> tuple[PartitionSpec, str]:
        """The layer's `spec` (resolved) for a leaf of `rank` dimensions: the
        leading ones unsharded. A spec longer than `rank` is returned as it is,
        for the caller's check to refuse."""
        layers = rank - len(spec)
        if layers <= 0 or not len(spec):
            return spec, "stacked: no layer axis in front"
        axes = "1 layer axis" if layers == 1 else f"{layers} layer axes"
        return PartitionSpec(*(None,) * layers, *spec), f"stacked: {axes} in front"

    def __repr__(self) -> str:
        return f"stacked({self.spec!r})"


@typecheck
def stacked(spec: Any) -> Stacked:
    """Marks a partition rule's spec as written for one layer, for layers stacked
    on leading axes (by `eqx.filter_vmap` over a layer's constructor, for
    `jax.lax.scan`).

    The spec names a leaf's *last* `len(spec)` dimensions, and every dimension in
    front of them is a layer axis, left unsharded: the leaf's rank says how many,
    so one rule fits layers stacked once, twice (nested `filter_vmap`) or not at
    all. `stacked(P("tp", None))` gives `P("tp", None)` for a `(192, 64)`
    weight, `P(None, "tp", None)` for 4 stacked ones `(4, 192, 64)` and
    `P(None, None, "tp", None)` for `(2, 4, 192, 64)`. Write the layer's spec to
    its full rank (`P("tp", None)`, not `P("tp")`): entries are counted from the
    end. Everywhere else a spec shorter than the rank keeps JAX's meaning (its
    entries are the leading dimensions), so only a rule marked so is read from
    the end. [`eqshard.auto_fsdp`][] takes `stacked=` itself.

    **Arguments:**

    - `spec`: the layer's `PartitionSpec`, or logical [`eqshard.AxisNames`][]
      (resolved by the logical axis rules in force).

    **Returns:**

    A rule value for [`eqshard.match_partition_rules`][] (and every `specs=` that
    takes rules).

    **Raises:**

    `TypeError` if `spec` is not a `PartitionSpec` or `AxisNames`.

    !!! Example

        ```python
        rules = [("blocks/.*/weight", eqshard.stacked(P("tp", None))), (".*", P())]
        params = {"blocks": {"up": {"weight": jnp.zeros((4, 192, 64))}}}
        eqshard.match_partition_rules(rules, params)
        # {"blocks": {"up": {"weight": P(None, "tp", None)}}}
        ```
    """
    if not isinstance(spec, PartitionSpec | AxisNames):
        hint = (
            " For automatic FSDP of stacked layers, use "
            "`eqshard.auto_fsdp(..., stacked=n)`."
            if callable(spec)
            else ""
        )
        raise TypeError(
            f"eqshard.stacked: `spec` is {spec!r}, which is not a PartitionSpec or "
            f"eqshard.AxisNames; give the spec of one layer, e.g. "
            f"eqshard.stacked(P('tp', None)).{hint}"
        )
    return Stacked(spec)


Pattern: TypeAlias = str | re.Pattern[str]
# `(regex, PartitionSpec)` pairs. Annotated loosely on purpose: beartype checks one
# random item of a sequence, so a stricter annotation would reject a malformed
# rule list on some calls and not others; `_compile_rules` checks every rule.
Rules: TypeAlias = PartitionRulesArg
# A rule's value: a `PartitionSpec`, logical `AxisNames` (resolved by the logical
# rules in force), or a callable of the leaf's shape giving a `PartitionSpec`.
RuleValue: TypeAlias = (
    PartitionSpec | AxisNames | Stacked | Callable[[tuple[int, ...]], PartitionSpec]
)
Compiled: TypeAlias = list[tuple[re.Pattern[str], RuleValue]]

# What happened to an array leaf, when no rule index applies.
_SCALAR, _SMALL, _UNMATCHED, _FOLLOWS = -1, -2, -3, -4
_LIMIT = 30  # lines of leaves or rules shown in one error message


def _show(name: str) -> str:
    return repr(name) if name else "<root>"


# ---------------------------------------------------------------- compiling


def _bad_regex_message(caller: str, what: str, bad: list[tuple[int, str, str]]) -> str:
    lines = [f"eqshard.{caller}: invalid regular expressions ({len(bad)}):"]
    lines += [f"  {what} {i} {pattern!r}: {error}" for i, pattern, error in bad]
    lines.append("Fix the pattern syntax (see Python's `re` module), or escape it.")
    return "\n".join(lines)


def _compile(patterns: Sequence[Any], caller: str, what: str) -> list[re.Pattern[str]]:
    """Compiles each pattern once; `TypeError` for a pattern that is not a regex,
    `ValueError` naming every invalid one."""
    compiled, bad = [], []
    for i, pattern in enumerate(patterns):
        if not isinstance(pattern, str | re.Pattern):
            raise TypeError(
                f"eqshard.{caller}: {what} {i} is {pattern!r}, which is not a regex "
                "string or compiled `re.Pattern`."
            )
        try:
            compiled.append(re.compile(pattern))
        except re.error as error:
            bad.append((i, pattern, str(error)))
    if bad:
        raise ValueError(_bad_regex_message(caller, what, bad))
    return compiled


def _compile_rules(rules: Rules, caller: str, source: str | None = None) -> Compiled:
    """The rules checked and compiled; `source` says where they were given when
    not as `rules` (e.g. "`specs`")."""
    if isinstance(rules, str) or not isinstance(rules, Sequence):
        raise TypeError(
            f"eqshard.{caller}: `rules` must be a sequence of (regex, spec) pairs, "
            f"got {rules!r} (a {type(rules).__name__}). " + sequence_fix(rules)
        )
    of = "" if source is None else f" of the partition rules {source}"
    for i, rule in enumerate(rules):
        if not (
            isinstance(rule, tuple | list)
            and len(rule) == 2
            and (
                isinstance(rule[1], PartitionSpec | AxisNames | Stacked)
                or callable(rule[1])
            )
        ):
            raise TypeError(
                f"eqshard.{caller}: rule {i}{of} is {rule!r}; every rule must be a "
                "pair `(regex, PartitionSpec)`, e.g. "
                "`('attn/.*/kernel', P('dp', 'tp'))`, "
                "`(regex, eqshard.AxisNames(...))`, `(regex, eqshard.stacked(spec))`, "
                "or `(regex, fn)` with `fn(shape) -> PartitionSpec`, such as "
                "`eqshard.auto_fsdp('fsdp')`."
            )
    regexes = _compile([pattern for pattern, _ in rules], caller, "rule")
    return [(regex, spec) for regex, (_, spec) in zip(regexes, rules, strict=True)]


# ---------------------------------------------------------------- matching


class _Follower(NamedTuple):
    """An array that follows another of a tree built together: the index of the
    one it follows, the dimension it has reduced away (`None`: the same shape),
    and whether it fits it (else it is a placeholder, replicated)."""

    leader: int
    dim: int | None
    fits: bool


class _Matches(NamedTuple):
    treedef: PyTreeDef
    leaves: list[Any]  # every leaf of the tree, in order
    names: list[str | None]  # the path string of each array; None for non-arrays
    rules: list[int | None]  # the first matching rule, or _SCALAR / _SMALL /
    # _UNMATCHED / _FOLLOWS, for each array; None for non-arrays
    follows: dict[int, _Follower]  # leaf index -> what it follows (`_followers`)


def _followers(
    tree: PyTree, path_leaves: list[tuple[Any, Any]]
) -> dict[int, _Follower]:
    """The arrays of a tuple or list of trees built together, such as
    `(model, opt_state)`, that follow an array of another of its items, as
    [`eqshard.derive_specs`][] follows parameters: their path within their item
    ends with the other's path within its item (and is longer), and their shape
    is its shape or has one dimension reduced away; at such a path, an array
    of another shape smaller than 1 KiB (Adafactor's placeholders) is
    replicated. Keyed by leaf index, followed arrays first."""
    if type(tree) not in (tuple, list) or len(tree) < 2:
        return {}
    items: list[dict[KeyPath, tuple[int, tuple[int, ...]]]] = [{} for _ in tree]
    for i, (path, leaf) in enumerate(path_leaves):
        if is_array(leaf):
            items[path[0].idx][tuple(path[1:])] = (i, tuple(map(int, leaf.shape)))
    found: dict[int, _Follower] = {}
    for k, item in enumerate(items):
        others: dict[KeyPath, tuple[int, tuple[int, ...]]] = {}
        for j in reversed(range(len(items))):  # the first item wins a tie
            if j != k:
                others.update(items[j])
        shapes = {key: shape for key, (_, shape) in others.items()}
        for key, (i, shape) in item.items():
            if not shape:
                continue  # scalars are replicated
            follow = followed(key, shape, shapes.get, first=1)
            if follow is None:
                continue
            index = others[follow.path][0]
            if follow.fits:
                found[i] = _Follower(index, follow.dim, True)
            elif is_placeholder(shape, path_leaves[i][1].dtype):
                found[i] = _Follower(index, None, False)
    return dict(sorted(found.items(), key=lambda kv: len(path_leaves[kv[0]][0])))


def _follower_spec(follow: _Follower, specs: Sequence[Any]) -> Any:
    if not follow.fits:
        return PartitionSpec()
    return without_dim(specs[follow.leader], follow.dim)


def _follower_note(follow: _Follower, names: Sequence[str | None]) -> str:
    name = repr(names[follow.leader])
    if not follow.fits:
        return f"a placeholder under 1 KiB at the path of {name}: replicated"
    if follow.dim is None:
        return f"follows {name}"
    return f"follows {name}, dimension {follow.dim} reduced away"


def _match_leaves(
    compiled: Compiled, tree: PyTree, min_size: int, sep: str, caller: str
) -> _Matches:
    """Matches every array leaf of `tree` against the rules, once. (Parallel lists
    rather than an object per leaf: fewer allocations, fewer GC pauses.)"""
    if min_size < 0:
        raise ValueError(f"eqshard.{caller}: `min_size` must be >= 0, got {min_size}.")
    path_leaves, treedef = jtu.tree_flatten_with_path(tree)
    searches = [regex.search for regex, _ in compiled]
    leaves, names, rules = [], [], []
    for path, leaf in path_leaves:
        leaves.append(leaf)
        if not is_array(leaf):
            names.append(None)
            rules.append(None)
            continue
        shape = leaf.shape
        name = path_name(path, sep)
        if not shape:
            rule = _SCALAR
        elif min_size and math.prod(shape) < min_size:
            rule = _SMALL
        else:
            rule = _UNMATCHED
            for i, search in enumerate(searches):
                if search(name) is not None:
                    rule = i
                    break
        names.append(name)
        rules.append(rule)
    follows = _followers(tree, path_leaves)
    for i in follows:
        rules[i] = _FOLLOWS
    return _Matches(treedef, leaves, names, rules, follows)


def rule_spec(
    value: RuleValue,
    shape: tuple[int, ...],
    *,
    caller: str,
    name: str | None,
    rule: int,
    mesh: Mesh | AbstractMesh | None,
    axis_rules: LogicalRules | None = None,
) -> tuple[PartitionSpec, str | None]:
    """The spec a rule's value gives a leaf of `shape` at `name`, and a note on how
    it was chosen (`None` for a `PartitionSpec`, which is as written). `mesh` is
    the mesh the rules are matched on: a value that needs axis sizes
    ([`eqshard.auto_fsdp`][]) reads them from it, and from nowhere else. Logical
    names are resolved by `axis_rules`, or by the rules in force."""
    if isinstance(value, PartitionSpec):
        return value, None
    if isinstance(value, AxisNames):
        table = get_logical_axis_rules() if axis_rules is None else axis_rules
        spec = logical_to_spec(value, table, caller=caller)
        return spec, f"logical {tuple(value)}"
    if isinstance(value, AutoFSDP):
        return value.choose(shape, mesh)
    if isinstance(value, Stacked):
        layer, _ = rule_spec(
            value.spec, shape, caller=caller, name=name, rule=rule, mesh=mesh
        )
        return value.place(layer, len(shape))
    spec = value(shape)
    if not isinstance(spec, PartitionSpec):
        raise TypeError(
            f"eqshard.{caller}: rule {rule}'s function {value!r} returned {spec!r} "
            f"for {_show(name or '')} (shape {shape}); it must return a "
            "PartitionSpec."
        )
    return spec, f"computed by {getattr(value, '__name__', repr(value))}"


def _strict_spec(
    rule: int,
    shape: tuple[int, ...],
    compiled: Compiled,
    caller: str,
    name: str | None,
    mesh: Mesh | AbstractMesh | None,
    *,
    check_on_mesh: bool = True,
    axis_rules: LogicalRules | None = None,
) -> tuple[PartitionSpec | None, str | None, str | None]:
    """The spec an array gets by the rules, what is wrong with it if
    anything (on `mesh`, if given and `check_on_mesh`), and how a rule's function
    chose it."""
    if rule == _UNMATCHED:
        return None, "no rule matches", None
    if rule < 0:  # _FOLLOWS leaves are given their spec by the caller
        return PartitionSpec(), None, None
    spec, note = rule_spec(
        compiled[rule][1],
        shape,
        caller=caller,
        name=name,
        rule=rule,
        mesh=mesh,
        axis_rules=axis_rules,
    )
    rank = len(shape)
    if len(spec) > rank:
        problem = (
            f"spec {spec!r} of rule {rule} has {len(spec)} entries but the "
            f"array has rank {rank}"
        )
        return spec, problem, note
    if mesh is not None and check_on_mesh:
        _, reasons = check_spec(shape, spec, dict(mesh.shape))
        if reasons:
            problem = (
                f"spec {spec!r} of rule {rule} cannot apply on mesh "
                f"{mesh_repr(mesh)}: {'; '.join(reasons)}"
            )
            return spec, problem, note
    return spec, None, note


def _relax(
    spec: PartitionSpec | None,
    shape: tuple[int, ...],
    mesh: Mesh | AbstractMesh | None,
) -> PartitionSpec:
    """The fix of `on_invalid="warn"` and `"ignore"`: unmatched -> replicated,
    long specs trimmed to rank, and on `mesh` the nearest spec that applies (as
    `corrected_spec`)."""
    if spec is None:
        return PartitionSpec()
    spec = spec.update(partitions=spec.partitions[: len(shape)])
    return spec if mesh is None else check_spec(shape, spec, dict(mesh.shape))[0]


def _rule_lines(compiled: Compiled) -> list[str]:
    lines = [f"  {i}: {r.pattern!r} -> {s!r}" for i, (r, s) in enumerate(compiled)]
    if len(lines) > _LIMIT:
        lines = lines[:_LIMIT] + [f"  ... and {len(lines) - _LIMIT} more rules"]
    return lines or ["  (no rules)"]


def _bad_leaves_message(
    bad: list[tuple[str, tuple[int, ...], str, PartitionSpec]],
    compiled: Compiled,
    sep: str,
    caller: str,
    source: str | None = None,
    *,
    corrected: bool = False,
) -> str:
    """The leaves without a valid spec (name, shape, problem, the spec used
    instead if `corrected`), and the rules tried."""
    count = "1 array leaf has" if len(bad) == 1 else f"{len(bad)} array leaves have"
    by = "" if source is None else f" by the partition rules {source}"
    lines = [f"eqshard.{caller}: {count} no valid spec{by}:"]
    for name, shape, problem, fixed in bad[:_LIMIT]:
        using = f"; using {fixed!r}" if corrected else ""
        lines.append(f"  {_show(name)} shape {shape}: {problem}{using}")
    if len(bad) > _LIMIT:
        lines.append(
            f"  ... and {len(bad) - _LIMIT} more (eqshard.explain_partition_rules "
            "lists every leaf)"
        )
    lines.append(
        f"Rules tried, in order (the first `re.search` match on the {sep!r}-joined "
        "path wins):"
    )
    lines += _rule_lines(compiled)
    if corrected:
        relax = 'pass `on_invalid="ignore"` to replicate, trim and correct silently'
    elif source is None:
        relax = (
            'pass `on_invalid="warn"` (or `"ignore"`) to replicate unmatched '
            "leaves and trim or correct the specs"
        )
    else:
        relax = (
            "match them first with `eqshard.match_partition_rules(rules, tree, "
            'on_invalid="warn")`, which replicates unmatched leaves and trims the '
            "specs"
        )
    lines.append(
        "Add rules for the unmatched paths (a last rule `('.*', PartitionSpec())` "
        "replicates the rest), make each spec at most as long as the array's rank "
        f"(and, with `mesh`, one that applies on it), or {relax}."
    )
    return "\n".join(lines)


def _unused_message(caller: str, unused: list[str]) -> str:
    return (
        f"eqshard.{caller}: these rules matched no array leaf: {', '.join(unused)}. "
        "Check them for typos or for an earlier rule that shadows them "
        "(eqshard.explain_partition_rules shows which rule decided each leaf)."
    )


@renamed_keywords(
    "match_partition_rules", strict=("on_invalid", {True: "raise", False: "ignore"})
)
@typecheck
def match_partition_rules(
    rules: Rules,
    tree: PyTree,
    *,
    min_size: Int = 0,
    on_invalid: OnInvalid = "raise",
    sep: str = "/",
    mesh: Mesh | AbstractMesh | None = None,
    exact_rank: bool = False,
    on_unused: OnInvalid = "ignore",
) -> PyTree:
    """Builds a spec tree for `tree` from regex partition rules.

    Each array leaf (`jax.Array`, `numpy.ndarray` or `jax.ShapeDtypeStruct`) is named
    by its path (`layers/3/attn/q/weight`, see [`eqshard.tree_path_to_string`][]),
    and gets the spec of the first rule whose regex `re.search`es that name.
    Scalars, and arrays with fewer than `min_size` elements, are replicated
    (`PartitionSpec()`) without consulting the rules. Everything that is not an
    array gets `None`, so the result has the structure of
    `eqx.filter(tree, is_array)`: Equinox modules, optax states and any other
    pytree keep their types. Only shapes are read, so abstract trees from
    `eqx.filter_eval_shape` work.

    What does not fit is of two kinds, each with its own option in the one
    vocabulary of `on_invalid` (`"raise"`, `"warn"`, `"ignore"`): a leaf without
    a valid spec is a problem of the result (`on_invalid`), a rule that matched
    nothing is a problem of the rules (`on_unused`), and one may be expected
    while the other is not.

    Rules written for a model place what follows its parameters too. When `tree`
    is a tuple or list of trees built together, such as `(model, opt_state)` or
    `(model, state, opt_state)`, an array of one item follows an array of another
    as [`eqshard.derive_specs`][] has it: when its path within its item ends with
    the other's path within its item (optax's `0/mu/blocks/up/weight` ends with
    `blocks/up/weight`) and its shape is the other's, it gets the other's spec;
    with one dimension reduced away (Adafactor's factored `v_row`/`v_col`), that
    spec without the dimension's entry; with another shape and under 1 KiB
    (Adafactor's `(1,)` placeholders), `P()`. Such arrays are not matched against
    the rules, so `mu` and `nu` are placed like their parameters whatever the
    rules' regexes say. Everything else, step counts included (a scalar is
    replicated), is matched as usual. So the spec tree of what
    [`eqshard.init_sharded`][] built from rules is this function of the rules and
    the built tree, for the step, [`eqshard.check_layout`][] and
    [`eqshard.restore`][] to reuse.

    A rule's spec applies to the leading dimensions, as in JAX (`P("dp")` on a
    `(batch, d)` array shards the batch); a spec marked with
    [`eqshard.stacked`][] applies to the last ones, for stacked layers.

    **Arguments:**

    - `rules`: `(regex, value)` pairs, in priority order: the value is a
      `PartitionSpec`, logical [`eqshard.AxisNames`][] (resolved by the logical
      axis rules in force, see [`eqshard.logical_axis_rules`][]), one layer's
      spec for stacked layers ([`eqshard.stacked`][]), or a function of the
      leaf's shape returning a `PartitionSpec`, such as [`eqshard.auto_fsdp`][]
      (which chooses the dimension to shard). Regexes are strings or compiled
      patterns.
    - `tree`: any pytree.
    - `min_size`: arrays with fewer elements than this are replicated.
    - `on_invalid`: what to do with a leaf that no rule matches, or whose spec is
      longer than its rank: `"raise"` (the default) raises; `"warn"` replicates
      it or trims its spec to its rank, and warns naming each; `"ignore"` does
      the same silently.
    - `sep`: the separator used to build the path strings.
    - `mesh`: if given, a spec that cannot apply on it (an axis it lacks or uses
      twice, a dimension its axes do not divide, such as a 33-token vocabulary
      over an axis of size 4) is a bad leaf too, found here rather than by
      [`eqshard.shard`][]; with `"warn"` or `"ignore"` it is corrected as
      [`eqshard.corrected_spec`][] does.
    - `exact_rank`: if `True`, a spec shorter than its array's rank is a bad leaf
      too, rather than applying to the leading dimensions (`P()` still replicates
      an array of any rank). This catches per-layer
      rules applied to layers stacked by `eqx.filter_vmap` (a `P("tp", None)`
      meant for a `(192, 64)` weight landing on the layer axis of a
      `(4, 192, 64)` one); see [`eqshard.stacked`][] for the fix.
    - `on_unused`: what to do with rules that matched no leaf, as
      [`eqshard.explain_partition_rules`][] lists them (often a typo, or a rule
      shadowed by an earlier one): `"ignore"` (the default) nothing, `"warn"` a
      `UserWarning` naming each, `"raise"` a `ValueError` naming each.

    **Returns:**

    The spec tree: a `PartitionSpec` for each array, `None` elsewhere.

    **Raises:**

    - `ValueError` listing every bad leaf (path, shape, problem) and the rules
      tried, with `on_invalid="raise"`; naming each rule that matched nothing,
      with `on_unused="raise"`; or naming each rule whose regex is invalid.
    - `TypeError` if a rule is not a `(regex, PartitionSpec)` or `(regex, fn)`
      pair, or `fn` returns something else than a `PartitionSpec`.

    !!! Example

        ```python
        rules = [("attn/.*/weight", P("dp", "tp")), (".*", P())]
        params = {"attn": {"q": {"weight": jnp.ones((8, 8)), "bias": jnp.ones(8)}}}
        eqshard.match_partition_rules(rules, params)
        # {"attn": {"q": {"weight": P("dp", "tp"), "bias": P()}}}
        ```
    """
    caller = "match_partition_rules"
    check_choice(on_invalid, ON_INVALID, caller=caller, name="on_invalid")
    check_choice(on_unused, ON_INVALID, caller=caller, name="on_unused")
    return rules_to_specs(
        rules,
        tree,
        min_size=min_size,
        on_invalid=on_invalid,
        sep=sep,
        mesh=mesh,
        exact_rank=exact_rank,
        on_unused=on_unused,
        caller=caller,
    )


def rules_to_specs(
    rules: Rules,
    tree: PyTree,
    *,
    min_size: Int = 0,
    on_invalid: str = "raise",
    sep: str = "/",
    mesh: Mesh | AbstractMesh | None = None,
    exact_rank: bool = False,
    on_unused: str = "ignore",
    check_on_mesh: bool = True,
    axis_rules: LogicalRules | None = None,
    caller: str,
    source: str | None = None,
) -> PyTree:
    """[`eqshard.match_partition_rules`][], its errors in the name of `caller`
    (and of `source`, e.g. "`specs`", for rules given elsewhere than as `rules`).
    Without `check_on_mesh`, `mesh` only gives rule values the axis sizes they
    read; `axis_rules` resolves logical names (the rules in force otherwise)."""
    min_size = operator.index(min_size)
    compiled = _compile_rules(rules, caller, source)
    matches = _match_leaves(compiled, tree, min_size, sep, caller)
    specs: list[PartitionSpec | None] = []
    bad = []
    for leaf, name, rule in zip(
        matches.leaves, matches.names, matches.rules, strict=True
    ):
        if rule is None:
            specs.append(None)
            continue
        shape = tuple(leaf.shape)
        spec, problem, _ = _strict_spec(
            rule,
            shape,
            compiled,
            caller,
            name,
            mesh,
            check_on_mesh=check_on_mesh,
            axis_rules=axis_rules,
        )
        stacked_value = rule >= 0 and isinstance(compiled[rule][1], Stacked)
        short = (
            spec is not None
            and rule >= 0
            and not stacked_value
            and 0 < len(spec) < len(shape)
        )
        if problem is None and exact_rank and short:
            problem = (
                f"spec {spec!r} of rule {rule} has {len(spec or ())} entries but the "
                f"array has rank {len(shape)} (exact_rank=True); for stacked layers "
                "mark the rule's spec as one layer's, eqshard.stacked(spec)"
            )
        elif problem is not None:
            spec = _relax(spec, shape, mesh if check_on_mesh else None)
        if problem is not None:
            bad.append((name, shape, problem, spec))
        specs.append(spec)
    if bad and on_invalid != "ignore":
        message = _bad_leaves_message(
            bad, compiled, sep, caller, source, corrected=on_invalid == "warn"
        )
        if on_invalid == "raise":
            raise ValueError(message)
        warn(message)
    for i, follow in matches.follows.items():
        specs[i] = _follower_spec(follow, specs)
    if on_unused != "ignore":
        used = {rule for rule in matches.rules if rule is not None}
        unused = [
            f"{i}: {pattern.pattern!r}"
            for i, (pattern, _) in enumerate(compiled)
            if i not in used
        ]
        if unused and on_unused == "raise":
            raise ValueError(_unused_message(caller, unused))
        if unused:
            warn(_unused_message(caller, unused))
    return jtu.tree_unflatten(matches.treedef, specs)


# ---------------------------------------------------------------- explaining


@dataclasses.dataclass(frozen=True)
class RulesReportRow:
    """One array leaf in a [`eqshard.RulesReport`][].

    - `path`, `shape`: the leaf's path string and shape.
    - `reason`: `"matched"`, `"scalar"`, `"below_min_size"`, `"unmatched"` or
      `"follows"` (an array of a tree built together that follows another, such
      as an optimizer state's `mu`: see [`eqshard.match_partition_rules`][]).
    - `rule`, `pattern`: index and regex of the matching rule, or `None`.
    - `spec`: the matching rule's spec as written (for a function or a
      [`eqshard.stacked`][] value, as it came out for this leaf); `P()` for
      scalars and small arrays; the followed array's for one that follows;
      `None` if no rule matches.
    - `problem`: why `match_partition_rules` rejects (by default) this leaf,
      or `None` if it accepts it.
    - `note`: how `spec` was chosen, for a rule whose value is a function (such
      as [`eqshard.auto_fsdp`][]), a [`eqshard.stacked`][] value, or an array
      that follows another (naming it); `None` otherwise.
    """

    path: str
    shape: tuple[int, ...]
    reason: Literal["matched", "scalar", "below_min_size", "unmatched", "follows"]
    rule: int | None
    pattern: str | None
    spec: PartitionSpec | None
    problem: str | None
    note: str | None = None


@dataclasses.dataclass(frozen=True, repr=False)
class RulesReport(Report):
    """Which partition rule decided each array leaf, from
    [`eqshard.explain_partition_rules`][].

    - `rows`: one [`eqshard.RulesReportRow`][] per array leaf, in tree order.
    - `rules`: the rules, as `(pattern string, value)` pairs.
    - `dead_rules`: indices of the rules that matched no leaf (often a typo, or a
      rule shadowed by an earlier one).
    - `min_size`: as given.

    `str(report)` and `report.table()` render it as an aligned text table,
    `report.show()` prints it with `rich` when it is installed, and
    `report.to_json()` is a byte-stable `str`.
    """

    rows: tuple[RulesReportRow, ...]
    rules: tuple[tuple[str, RuleValue], ...]
    dead_rules: tuple[int, ...]
    min_size: int

    @property
    def problems(self) -> tuple[RulesReportRow, ...]:
        """The rows that `match_partition_rules` rejects (by default)."""
        return tuple(row for row in self.rows if row.problem is not None)

    def table(self) -> str:
        """The report as an aligned text table: leaves, then rules."""
        notes = {"scalar": "scalar", "below_min_size": f"size < {self.min_size}"}
        body = [
            (
                row.path or "<root>",
                str(row.shape),
                "-" if row.rule is None else f"{row.rule} {row.pattern!r}",
                "-" if row.spec is None else repr(row.spec),
                row.problem or row.note or notes.get(row.reason, ""),
            )
            for row in self.rows
        ]
        counts = [0] * len(self.rules)
        for row in self.rows:
            if row.rule is not None:
                counts[row.rule] += 1
        rule_body = [
            (
                str(i),
                repr(pattern),
                repr(spec),
                str(count),
                "dead: matched nothing" if count == 0 else "",
            )
            for i, ((pattern, spec), count) in enumerate(
                zip(self.rules, counts, strict=True)
            )
        ]
        return "\n".join(
            [
                f"{len(self.rows)} array leaves, {len(self.rules)} rules: "
                f"{len(self.problems)} problems, {len(self.dead_rules)} dead rules",
                "",
                *text_table(("path", "shape", "rule", "spec", "note"), body),
                "",
                *text_table(("rule", "pattern", "spec", "leaves", "note"), rule_body),
            ]
        )

    def _summary(self) -> dict[str, Any]:
        return {
            "leaves": len(self.rows),
            "rules": len(self.rules),
            "problems": len(self.problems),
            "dead_rules": self.dead_rules,
        }


# Why an array matched no rule, for `RulesReportRow.reason`.
_REASONS: dict[int, Literal["scalar", "below_min_size", "unmatched", "follows"]] = {
    _SCALAR: "scalar",
    _SMALL: "below_min_size",
    _UNMATCHED: "unmatched",
    _FOLLOWS: "follows",
}


@typecheck
def explain_partition_rules(
    rules: Rules,
    tree: PyTree,
    *,
    min_size: Int = 0,
    sep: str = "/",
    mesh: Mesh | AbstractMesh | None = None,
) -> RulesReport:
    """Reports which rule decides the spec of each array leaf, and which rules
    match nothing.

    Matches exactly as [`eqshard.match_partition_rules`][] does, but never raises
    for a bad leaf: each row says what `match_partition_rules` would do with the
    leaf, and why it would reject it. Rules that match no leaf are listed as dead:
    a dead rule is usually a typo in its regex, or shadowed by an earlier rule.
    Scalars and arrays below `min_size` are not matched against the rules. For a
    rule whose value is a function, such as [`eqshard.auto_fsdp`][], the row's
    `spec` is the spec it chose and its `note` says why.

    **Arguments:**

    As for [`eqshard.match_partition_rules`][]: with `mesh`, a spec that cannot
    apply on it is a problem of its row.

    **Returns:**

    A [`eqshard.RulesReport`][]; `print(report)` shows it as a table.

    **Raises:**

    `ValueError` naming each rule whose regex is invalid; `TypeError` if a rule is
    not a `(regex, PartitionSpec)` pair.

    !!! Example

        ```python
        params = {"attn": {"weight": jnp.ones((8, 8))}, "embed": jnp.ones((16, 8))}
        rules = [("attn/weight", P("dp", "tp")), ("embeding", P("tp"))]
        report = eqshard.explain_partition_rules(rules, params)
        report.dead_rules  # (1,): the typo never matched
        report.problems[0].path  # "embed": no rule matches it
        print(report)
        ```
    """
    min_size = operator.index(min_size)
    compiled = _compile_rules(rules, "explain_partition_rules")
    matches = _match_leaves(compiled, tree, min_size, sep, "explain_partition_rules")
    found: list[Any] = [None] * len(matches.leaves)
    for i, (leaf, name, rule) in enumerate(
        zip(matches.leaves, matches.names, matches.rules, strict=True)
    ):
        if rule is not None and name is not None:  # an array
            found[i] = _strict_spec(
                rule, tuple(leaf.shape), compiled, "explain_partition_rules", name, mesh
            )
    specs = [None if f is None else f[0] for f in found]
    for i, follow in matches.follows.items():
        specs[i] = _follower_spec(follow, specs)
        found[i] = (specs[i], None, _follower_note(follow, matches.names))
    rows = []
    used = set()
    for leaf, name, rule, spec_problem_note in zip(
        matches.leaves, matches.names, matches.rules, found, strict=True
    ):
        if rule is None or name is None:  # not an array
            continue
        spec, problem, note = spec_problem_note
        matched = rule >= 0
        if matched:
            used.add(rule)
        rows.append(
            RulesReportRow(
                path=name,
                shape=tuple(leaf.shape),
                reason="matched" if matched else _REASONS[rule],
                rule=rule if matched else None,
                pattern=compiled[rule][0].pattern if matched else None,
                spec=spec,
                problem=problem,
                note=note,
            )
        )
    return RulesReport(
        rows=tuple(rows),
        rules=tuple((regex.pattern, spec) for regex, spec in compiled),
        dead_rules=tuple(i for i in range(len(compiled)) if i not in used),
        min_size=min_size,
    )


# ---------------------------------------------------------------- pattern strings


SPEC_SYNTAX = (
    "a SPEC is dimensions separated by ',' or '.', each an axis name, None, or "
    "axis names joined by '+' (dp,tp  None.tp  dp+fsdp,None); () or P() is the "
    "replicated spec, and P('dp', None) or P(('dp', 'fsdp'), 'tp') reads as in Python"
)


def _spec_entry(entry: Any, text: str) -> str | tuple[str, ...] | None:
    """One dimension of a `P(...)` literal, checked."""
    names = entry if isinstance(entry, tuple | list) else (entry,)
    if entry is None or (
        names and all(isinstance(n, str) and n.isidentifier() for n in names)
    ):
        return entry if not isinstance(entry, list) else tuple(entry)
    raise ValueError(
        f"{entry!r} in the spec {text!r} is not an axis name, None, or a tuple of "
        "axis names"
    )


def parse_spec(text: str) -> PartitionSpec:
    """The `PartitionSpec` written as `text`, in the one spec syntax of rules files
    (`python -m eqshard --rules`) and rule strings
    (`create_pattern_based_partition_spec`): see `SPEC_SYNTAX`. Whitespace around
    dimensions is ignored. Raises `ValueError` saying what is wrong; each caller
    adds where."""
    body = text.strip()
    if not body:
        raise ValueError("the spec is empty (write () for P())")
    if body in ("()", "P()"):
        return PartitionSpec()
    if body.startswith("P(") and body.endswith(")"):
        inner = body[2:-1]
        if not inner.strip():
            return PartitionSpec()
        if not any(c in inner for c in "'\"()[]"):
            return parse_spec(inner)  # P(dp, None): the compact form inside P()
        try:
            entries = ast.literal_eval(f"[{inner}]")
        except (ValueError, SyntaxError):
            raise ValueError(
                f"the spec {body!r} is not a PartitionSpec literal (quote the axis "
                "names: P('dp', None))"
            ) from None
        return PartitionSpec(*(_spec_entry(entry, body) for entry in entries))
    if body.startswith("("):
        raise ValueError(
            f"the spec {body!r} is ambiguous: write dp+tp for one dimension over "
            "both axes, or dp,tp for two dimensions"
        )
    dims: list[str | tuple[str, ...] | None] = []
    for dim in (d.strip() for d in re.split(r"[,.]", body)):
        if dim == "None":
            dims.append(None)
            continue
        names = [name.strip() for name in dim.split("+")]
        for name in names:
            if not name.isidentifier():
                where = "" if name == body else f" in the spec {body!r}"
                raise ValueError(
                    f"{name!r}{where} is not an axis name, None, or axis names "
                    "joined by '+'"
                )
        dims.append(spec_entry(names))
    return PartitionSpec(*dims)


def parse_rule(regex: str, spec: str) -> tuple[re.Pattern[str], PartitionSpec]:
    """A rule written as text, as rules files and rule strings write it: `regex`
    compiled, `spec` read by `parse_spec`. Raises `ValueError` saying what is
    wrong; each caller adds where."""
    if not regex:
        raise ValueError("the regex is empty")
    try:
        compiled = re.compile(regex)
    except re.error as error:
        raise ValueError(f"invalid regex {regex!r} ({error})") from None
    return compiled, parse_spec(spec)


def _pattern_error(pattern: str, index: int, token: str, why: str) -> ValueError:
    return ValueError(
        f"eqshard.compat.create_pattern_based_partition_spec: bad rule {index} "
        f"{token!r} in {pattern!r}: {why}. Rules are `REGEX->SPEC`, separated by ','; "
        f"{SPEC_SYNTAX}. Example: 'attention|mlp->dp,tp,embed->None.tp,norm->()'."
    )


def _rule_tokens(pattern: str) -> list[str]:
    """The rules of `pattern`: split at ',', where a piece without `->` continues
    the spec before it (`attn->dp,tp` and `attn->P('dp', None)` are one rule)."""
    tokens: list[str] = []
    for index, piece in enumerate(pattern.split(",")):
        if not piece.strip():
            raise _pattern_error(pattern, index, piece, "the rule is empty")
        if "->" in piece or not tokens:
            tokens.append(piece)
        else:
            tokens[-1] += "," + piece
    return tokens


def _parse_pattern(pattern: str) -> list[tuple[re.Pattern[str], PartitionSpec]]:
    rules = []
    for index, token in enumerate(_rule_tokens(pattern)):
        parts = token.split("->")
        if len(parts) != 2:
            raise _pattern_error(
                pattern,
                index,
                token,
                "expected exactly one '->' between regex and spec",
            )
        regex, spec = (part.strip() for part in parts)
        try:
            compiled, parsed = parse_rule(regex, spec)
        except ValueError as error:
            raise _pattern_error(pattern, index, token, str(error)) from None
        rules.append((compiled, parsed))
    return rules


@dataclasses.dataclass(frozen=True)
class _PatternPartitionSpec:
    rules: tuple[tuple[str, PartitionSpec], ...]
    default: PartitionSpec
    regexes: tuple[re.Pattern[str], ...] = dataclasses.field(repr=False, compare=False)

    def __call__(self, path: str, leaf: Any = None) -> PartitionSpec:
        for regex, (_, spec) in zip(self.regexes, self.rules, strict=True):
            if regex.search(path) is not None:
                return spec
        return self.default


@typecheck
def create_pattern_based_partition_spec(
    pattern: str, *, default: PartitionSpec = PartitionSpec()
) -> Callable[[str, Any], PartitionSpec]:
    """Parses a compact rule string into a function `fn(path, leaf) -> PartitionSpec`.

    The string is rules `REGEX->SPEC` separated by `,`, first match wins
    (`re.search` on the path). `REGEX` is one regular expression, so `|` is
    alternation and groups work; it cannot contain `,` or `->`. `SPEC` is
    dimensions separated by `,` or `.`, each one of:

    - an axis name: `dp`;
    - `None`: that dimension is not sharded;
    - axis names joined by `+`: `dp+fsdp` shards one dimension over both axes;

    and `()` or `P()` alone is the replicated spec; `P('dp', None)` and
    `P(('dp', 'fsdp'), 'tp')` read as in Python. So
    `"attention|mlp->dp,tp,embed->None.tp"` gives `P("dp", "tp")` for attention
    and MLP weights, and `P(None, "tp")` for embeddings (a piece without `->`
    continues the spec before it). This is the spec syntax of the rules files of
    `python -m eqshard --rules` too. The string is parsed once, strictly;
    whitespace around tokens is ignored.

    **Arguments:**

    - `pattern`: the rule string.
    - `default`: the spec of paths that no rule matches.

    **Returns:**

    A function `fn(path, leaf=None)` returning the spec for the path string `path`
    (`leaf` is accepted for use with [`eqshard.named_tree_map`][] and ignored).
    Its `rules` attribute holds the parsed `(regex, PartitionSpec)` pairs, which
    [`eqshard.match_partition_rules`][] accepts too.

    **Raises:**

    `ValueError` naming the bad rule: no `->` or more than one, an empty regex or
    spec, an invalid regex, or a dimension that is not an axis name.

    !!! Example

        ```python
        pattern = "attn|mlp->dp.tp,embed->tp"
        fn = eqshard.compat.create_pattern_based_partition_spec(pattern)
        fn("layers/0/mlp/weight", None)  # P("dp", "tp")
        fn("norm/scale", None)  # P()
        ```
    """
    parsed = _parse_pattern(pattern)
    rules = tuple((regex.pattern, spec) for regex, spec in parsed)
    regexes = tuple(regex for regex, _ in parsed)
    return _PatternPartitionSpec(rules, default, regexes)


# ---------------------------------------------------------------- weight decay


@typecheck
def get_weight_decay_mask(
    exclusions: Pattern | Sequence[Any], *, sep: str = "/"
) -> Callable[[PyTree], PyTree]:
    """Makes a weight-decay mask function from regexes of parameters to exclude.

    The function maps a parameter tree to a tree of the same structure with a bool
    per leaf: `False` where the leaf's path matches (`re.search`) any exclusion,
    `True` (apply weight decay) elsewhere. It is meant for optax's `mask=`
    argument. The regexes are compiled once, here.

    **Arguments:**

    - `exclusions`: a regex, or a sequence of regexes (strings or compiled).
    - `sep`: the separator used to build the path strings.

    **Returns:**

    A function `params -> tree of bools`.

    **Raises:**

    `ValueError` naming each exclusion whose regex is invalid; `TypeError` naming
    an exclusion that is not a regex.

    !!! Example

        ```python
        import optax

        mask = eqshard.compat.get_weight_decay_mask(["bias", "norm/scale"])
        optimizer = optax.adamw(1e-3, weight_decay=0.1, mask=mask)
        ```
    """
    if isinstance(exclusions, str | re.Pattern):
        exclusions = [exclusions]
    regexes = _compile(exclusions, "compat.get_weight_decay_mask", "exclusion")

    def weight_decay_mask(params: PyTree) -> PyTree:
        path_leaves, treedef = jtu.tree_flatten_with_path(params)
        decay = []
        for path, _ in path_leaves:
            name = path_name(path, sep)
            decay.append(not any(regex.search(name) for regex in regexes))
        return jtu.tree_unflatten(treedef, decay)

    return weight_decay_mask
