"""The matching engine of regex partition rules.

A *rule* is a `(regex, value)` pair, where the value is a `PartitionSpec`,
logical `AxisNames`, one layer's spec for stacked layers (`stacked`, from
`_stacked.py`, read from a leaf's last dimensions), or a callable of the leaf's
shape returning one (such as `auto_fsdp`'s, which also reads the axis sizes of the
mesh the rules are matched on). Rules are tried in order against the path string
of each array leaf (`re.search`), and the first match gives the leaf's spec;
`rule_spec` is the one place a rule's value becomes a leaf's spec. In a tuple or
list of trees built together (`(model, opt_state)`), an array that follows another
item's array takes that array's spec instead (`_follow.followers_of_items`).
One core, `match_leaves`, does the matching for both `match_partition_rules`
(`rules_to_specs`, here) and `explain_partition_rules` (`_rules_report.py`): each
regex is compiled once per call (`compile_rules`) and each path is built and
matched once. The text syntax of specs and rules is `_rules_syntax.py`'s.
"""

import math
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, TypeAlias

import jax.tree_util as jtu
from jax.sharding import AbstractMesh, Mesh, PartitionSpec
from jaxtyping import PyTree

from .._deprecated import renamed_keywords
from .._mesh._current import mesh_repr
from .._tree import is_array, path_name
from .._typing import (
    check_choice,
    Int,
    ON_INVALID,
    OnInvalid,
    PartitionRulesArg,
    PyTreeDef,
    sequence_fix,
    typecheck,
    warn,
)
from ._auto import AutoFSDP
from ._check_spec import check_spec
from ._follow import followers_of_items, item_follower_spec, ItemFollower
from ._logical import AxisNames, get_logical_axis_rules, logical_to_spec, LogicalRules
from ._memory import Host, in_memory
from ._rules_messages import bad_leaves_message, bad_regex_message, show, unused_message
from ._stacked import Stacked


# `(regex, PartitionSpec)` pairs. Annotated loosely on purpose: beartype checks one
# random item of a sequence, so a stricter annotation would reject a malformed
# rule list on some calls and not others; `compile_rules` checks every rule.
Rules: TypeAlias = PartitionRulesArg
# A rule's value: a `PartitionSpec`, logical `AxisNames` (resolved by the logical
# rules in force), or a callable of the leaf's shape giving a `PartitionSpec`.
RuleValue: TypeAlias = (
    PartitionSpec
    | AxisNames
    | Stacked
    | Host
    | Callable[[tuple[int, ...]], PartitionSpec]
)
Compiled: TypeAlias = list[tuple[re.Pattern[str], RuleValue]]

# What happened to an array leaf, when no rule index applies, and its name in
# `RulesReportRow.reason` (`REASONS`).
_SCALAR, _SMALL, _UNMATCHED, _FOLLOWS = -1, -2, -3, -4
REASONS: dict[int, Literal["scalar", "below_min_size", "unmatched", "follows"]] = {
    _SCALAR: "scalar",
    _SMALL: "below_min_size",
    _UNMATCHED: "unmatched",
    _FOLLOWS: "follows",
}


# ---------------------------------------------------------------- compiling


def compile_regexes(
    patterns: Sequence[Any], caller: str, what: str
) -> list[re.Pattern[str]]:
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
        raise ValueError(bad_regex_message(caller, what, bad))
    return compiled


def compile_rules(rules: Rules, caller: str, source: str | None = None) -> Compiled:
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
                isinstance(rule[1], PartitionSpec | AxisNames | Stacked | Host)
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
    regexes = compile_regexes([pattern for pattern, _ in rules], caller, "rule")
    return [(regex, spec) for regex, (_, spec) in zip(regexes, rules, strict=True)]


# ---------------------------------------------------------------- matching


class Matches(NamedTuple):
    treedef: PyTreeDef
    leaves: list[Any]  # every leaf of the tree, in order
    names: list[str | None]  # the path string of each array; None for non-arrays
    rules: list[int | None]  # the first matching rule, or _SCALAR / _SMALL /
    # _UNMATCHED / _FOLLOWS, for each array; None for non-arrays
    follows: dict[int, ItemFollower]  # leaf index -> what it follows


def match_leaves(
    compiled: Compiled, tree: PyTree, min_size: int, sep: str, caller: str
) -> Matches:
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
    follows = followers_of_items(tree, path_leaves)
    for i in follows:
        rules[i] = _FOLLOWS
    return Matches(treedef, leaves, names, rules, follows)


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
    if isinstance(value, Host):  # the layout; `rules_to_specs` puts it on host
        if value.spec is None:
            raise ValueError(
                f"eqshard.{caller}: rule {rule} is {value!r}, which keeps the layout "
                f"of the parameter an array follows, but {show(name or '')} (shape "
                f"{shape}) follows none. Give the layout: eqshard.host(P(...))."
            )
        return rule_spec(
            value.spec, shape, caller=caller, name=name, rule=rule, mesh=mesh
        )
    if isinstance(value, Stacked):
        layer, _ = rule_spec(
            value.spec, shape, caller=caller, name=name, rule=rule, mesh=mesh
        )
        return value.place(layer, len(shape))
    spec = value(shape)
    if not isinstance(spec, PartitionSpec):
        raise TypeError(
            f"eqshard.{caller}: rule {rule}'s function {value!r} returned {spec!r} "
            f"for {show(name or '')} (shape {shape}); it must return a "
            "PartitionSpec."
        )
    return spec, f"computed by {getattr(value, '__name__', repr(value))}"


def strict_spec(
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

    Each array leaf (`jax.Array`, NumPy or `jax.ShapeDtypeStruct`: only shapes are
    read) is named by its path (`layers/3/attn/q/weight`) and gets the spec of the
    first rule whose regex `re.search`es that name; scalars and arrays under
    `min_size` elements are replicated, non-arrays get `None`. In a tuple of trees
    built together (`(model, opt_state)`), arrays that follow a parameter (`mu`,
    `nu`) get its spec whatever the regexes say ([optimizer
    states](../how-to/shard-modules.md#optimizer-states-and-other-pytrees)). Specs
    apply to the leading dimensions, as in JAX; [`eqshard.stacked`][] to the last.

    **Arguments:**

    - `rules`: `(regex, value)` pairs in priority order; the value is a
      `PartitionSpec`, logical [`eqshard.AxisNames`][], a [`eqshard.stacked`][]
      spec, or a function of the leaf's shape such as [`eqshard.auto_fsdp`][].
    - `tree`: any pytree; `min_size`: as above; `sep`: the paths' separator.
    - `on_invalid`: for a leaf no rule matches, or whose spec outranks it: `"raise"`
      (default), `"warn"` (replicated or trimmed, warning) or `"ignore"` (silently).
    - `mesh`: if given, a spec that cannot apply on it is a bad leaf too (corrected
      as [`eqshard.corrected_spec`][] does under `"warn"`/`"ignore"`).
    - `exact_rank`: if `True`, a spec shorter than its array's rank (not `P()`)
      is a bad leaf too: it catches per-layer rules applied to stacked layers.
    - `on_unused`: rules that matched no leaf (often a typo or a shadowed rule):
      `"ignore"` (the default), `"warn"` or `"raise"`.

    **Returns:**

    The spec tree: a `PartitionSpec` for each array, `None` elsewhere.

    **Raises:**

    `ValueError` listing every bad leaf (path, shape, problem) and the rules tried
    (`on_invalid="raise"`), each rule that matched nothing (`on_unused="raise"`),
    or each invalid regex; `TypeError` if a rule is not a `(regex, value)` pair,
    or a function returns something else than a `PartitionSpec`.

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
    compiled = compile_rules(rules, caller, source)
    matches = match_leaves(compiled, tree, min_size, sep, caller)
    to_host = host_followers(compiled, matches)
    specs: list[PartitionSpec | Host | None] = []
    bad = []
    for leaf, name, rule in zip(
        matches.leaves, matches.names, matches.rules, strict=True
    ):
        if rule is None:
            specs.append(None)
            continue
        shape = tuple(leaf.shape)
        spec, problem = _leaf_spec(
            rule,
            shape,
            compiled,
            caller,
            name,
            mesh,
            exact_rank=exact_rank,
            check_on_mesh=check_on_mesh,
            axis_rules=axis_rules,
        )
        if problem is not None:
            bad.append((name, shape, problem, spec))
        specs.append(Host(spec) if _is_host_rule(compiled, rule) else spec)
    if bad and on_invalid != "ignore":
        _check_bad_leaves(bad, compiled, sep, caller, source, on_invalid)
    for i, follow in matches.follows.items():
        spec = item_follower_spec(follow, specs)
        specs[i] = in_memory(spec, "pinned_host") if i in to_host else spec
    if on_unused != "ignore":
        _check_unused(compiled, matches.rules, caller, on_unused)
    return jtu.tree_unflatten(matches.treedef, specs)


def _is_host_rule(compiled: Compiled, rule: int) -> bool:
    return rule >= 0 and isinstance(compiled[rule][1], Host)


def host_followers(compiled: Compiled, matches: Matches) -> dict[int, int]:
    """Arrays that follow a parameter but whose first matching rule is a host
    rule: with a spec (`host(P(...))`) they are matched by it (`matches`
    updated); those left (whose rule is `host()`) follow in host memory, and are
    returned with their rule."""
    to_host = {}
    for i in list(matches.follows):
        name = matches.names[i] or ""
        rule = next((j for j, (r, _) in enumerate(compiled) if r.search(name)), -1)
        value = compiled[rule][1] if rule >= 0 else None
        if isinstance(value, Host) and value.spec is None:
            to_host[i] = rule
        elif isinstance(value, Host):
            del matches.follows[i]
            matches.rules[i] = rule
    return to_host


def _leaf_spec(
    rule: int,
    shape: tuple[int, ...],
    compiled: Compiled,
    caller: str,
    name: str | None,
    mesh: Mesh | AbstractMesh | None,
    *,
    exact_rank: bool,
    check_on_mesh: bool,
    axis_rules: LogicalRules | None,
) -> tuple[PartitionSpec | None, str | None]:
    """The spec `rules_to_specs` gives an array, and what is wrong with it if
    anything: a spec with a problem of `strict_spec`'s is relaxed (`_relax`), one
    too short for `exact_rank` is kept as it is."""
    spec, problem, _ = strict_spec(
        rule,
        shape,
        compiled,
        caller,
        name,
        mesh,
        check_on_mesh=check_on_mesh,
        axis_rules=axis_rules,
    )
    if problem is not None:
        return _relax(spec, shape, mesh if check_on_mesh else None), problem
    short = (
        spec is not None
        and rule >= 0
        and not isinstance(compiled[rule][1], Stacked)
        and 0 < len(spec) < len(shape)
    )
    if exact_rank and short:
        problem = (
            f"spec {spec!r} of rule {rule} has {len(spec or ())} entries but the "
            f"array has rank {len(shape)} (exact_rank=True); for stacked layers "
            "mark the rule's spec as one layer's, eqshard.stacked(spec)"
        )
    return spec, problem


class NoRuleMatchesError(ValueError):
    """Leaves without a valid spec, some because no rule matches them."""


def _check_bad_leaves(
    bad: list[tuple[str, tuple[int, ...], str, PartitionSpec]],
    compiled: Compiled,
    sep: str,
    caller: str,
    source: str | None,
    on_invalid: str,
) -> None:
    """Raises (`on_invalid="raise"`) or warns listing the leaves without a valid
    spec."""
    message = bad_leaves_message(
        bad, compiled, sep, caller, source, corrected=on_invalid == "warn"
    )
    if on_invalid == "raise":
        unmatched = any(reason == "no rule matches" for _, _, reason, _ in bad)
        raise (NoRuleMatchesError if unmatched else ValueError)(message)
    warn(message)


def _check_unused(
    compiled: Compiled, matched: Sequence[int | None], caller: str, on_unused: str
) -> None:
    """Raises (`on_unused="raise"`) or warns naming each rule that no array leaf
    matched."""
    used = set(matched)
    unused = [
        f"{i}: {pattern.pattern!r}"
        for i, (pattern, _) in enumerate(compiled)
        if i not in used
    ]
    if unused and on_unused == "raise":
        raise ValueError(unused_message(caller, unused))
    if unused:
        warn(unused_message(caller, unused))
