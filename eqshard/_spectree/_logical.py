"""Logical axis names, and the rules that turn them into mesh axes.

A model names the dimensions of its arrays by what they mean (`"batch"`,
`"embed"`, `"mlp"`) with [`eqshard.AxisNames`][]; a sequence of *rules*, pairs
`(logical_name, mesh_axes)`, says which mesh axes each meaning is sharded over.
[`eqshard.logical_to_mesh_axes`][] resolves one `AxisNames` into a
`PartitionSpec` with flax's semantics, [`eqshard.logical_to_mesh_specs`][] a
whole tree of them. The rules can be passed explicitly (`axis_rules=`) or set for a
block of code with the thread-local [`eqshard.logical_axis_rules`][] context,
the one piece of module state in eqshard.
"""

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

from jax.sharding import PartitionSpec

from .._deprecated import renamed_keywords
from .._tree import path_str
from .._typing import AxisRulesArg, KeyPath, sequence_fix, typecheck


# What a rule maps a logical name to: one mesh axis, several (the dimension is
# sharded over their product), or `None` (the dimension is never sharded).
MeshAxes: TypeAlias = str | tuple[str, ...] | None
LogicalRule: TypeAlias = tuple[str, MeshAxes]
# Rules as eqshard stores and returns them: validated, tuples all the way down.
LogicalRules: TypeAlias = tuple[LogicalRule, ...]


class AxisNames(tuple):
    """The logical names of the dimensions of one array.

    A tuple of strings (or `None` for a dimension that is never sharded), one per
    dimension. It is a tuple *subclass*, which JAX's pytree utilities treat as a
    single leaf, so a tree of `AxisNames` has the structure of the tree of arrays
    it describes: `jax.tree.map` and [`eqshard.logical_to_mesh_specs`][] see one
    leaf per array. (A plain tuple would be walked into, one leaf per name.)

    It compares and hashes as the tuple of its names.

    **Arguments:**

    - `*names`: one name per dimension: a logical axis name (`str`), or `None`
      for a dimension that no rule should shard.

    **Raises:**

    `TypeError` naming the position of a name that is neither a `str` nor `None`.

    !!! Example

        ```python
        names = eqshard.AxisNames("embed", "mlp")
        names == ("embed", "mlp")  # True: a tuple
        jax.tree.leaves({"w": names})  # [AxisNames('embed', 'mlp')]: one leaf
        ```
    """

    __slots__ = ()

    def __new__(cls, *names: Any) -> "AxisNames":
        for index, name in enumerate(names):
            if not (name is None or isinstance(name, str)):
                raise TypeError(_entry_message("AxisNames", names, index))
        return super().__new__(cls, names)

    def __getnewargs__(self) -> tuple[str | None, ...]:
        # `tuple`'s default passes the contents as one argument, which `__new__`
        # would take as a single (invalid) name; copy and pickle need this.
        return tuple(self)

    def __repr__(self) -> str:
        return f"AxisNames({', '.join(map(repr, self))})"


# --------------------------------------------------------------------------------
# Error messages: one builder per kind.


def _where(path: KeyPath | None) -> str:
    """The `" at 'layers/0/w'"` that places a message at a leaf; `""` if no path."""
    return "" if path is None else f" at '{path_str(path)}'"


def _entry_message(
    caller: str, axes: Sequence[Any], index: int, path: KeyPath | None = None
) -> str:
    entry = axes[index]
    hint = ""
    if isinstance(entry, tuple | list) and caller == "AxisNames":
        hint = (
            " AxisNames takes the names as separate arguments: "
            f"AxisNames({', '.join(map(repr, entry))})."
        )
    return (
        f"eqshard.{caller}: the logical axis names {tuple(axes)!r}{_where(path)} have "
        f"{entry!r} (a {type(entry).__name__}) at position {index}. Each entry must "
        f"be a logical axis name (a str), or None for a dimension that is never "
        f"sharded.{hint}"
    )


def _duplicate_message(
    caller: str, axes: Sequence[Any], name: str, path: KeyPath | None
) -> str:
    positions = [i for i, entry in enumerate(axes) if entry == name]
    return (
        f"eqshard.{caller}: the logical axis name {name!r} appears more than once "
        f"in {tuple(axes)!r}{_where(path)} (positions {positions}). A mesh axis can "
        "shard only one dimension of an array, so each dimension needs its own "
        "logical name; use None for dimensions that should not be sharded."
    )


def _axes_type_message(caller: str, axes: Any, path: KeyPath | None) -> str:
    if isinstance(axes, str):
        fix = f"Use ({axes!r},) or eqshard.AxisNames({axes!r}) for a 1-D array."
    else:
        fix = "Use eqshard.AxisNames(...) or a tuple of names."
    return (
        f"eqshard.{caller}: expected a sequence of logical axis names"
        f"{_where(path)}, got {axes!r} (a {type(axes).__name__}). {fix}"
    )


def _rule_message(
    caller: str, argname: str, index: int, rule: Any, problem: str
) -> str:
    return (
        f"eqshard.{caller}: `{argname}[{index}]` = {rule!r} {problem}. Each rule is a "
        "pair (logical_name, mesh_axes): a str, then a mesh axis name, a non-empty "
        "tuple of distinct mesh axis names, or None (never sharded); e.g. "
        "('batch', 'data') or ('batch', ('replica', 'data'))."
    )


def _rules_type_message(caller: str, argname: str, rules: Any) -> str:
    return (
        f"eqshard.{caller}: `{argname}` must be a sequence of (logical_name, "
        f"mesh_axes) pairs, got {rules!r} (a {type(rules).__name__}). "
        + sequence_fix(rules)
    )


# --------------------------------------------------------------------------------
# Validation and resolution (pure; no module state).


def _rule_problem(rule: Any) -> tuple[type[Exception], str] | None:
    """What is wrong with one rule, as the error type and a phrase, or `None`."""
    if not isinstance(rule, tuple | list) or len(rule) != 2:
        return TypeError, "is not a (logical_name, mesh_axes) pair"
    name, axes = rule
    if not isinstance(name, str):
        kind = type(name).__name__
        return TypeError, f"has the logical name {name!r} (a {kind}, not a str)"
    if axes is None or isinstance(axes, str):
        return None
    if not isinstance(axes, tuple | list):
        return TypeError, f"maps to a {type(axes).__name__}"
    if not axes:
        return ValueError, "maps to no mesh axes (use None instead)"
    for axis in axes:
        if not isinstance(axis, str):
            return TypeError, f"has the mesh axis {axis!r} (a {type(axis).__name__})"
    if len(set(axes)) != len(axes):
        return ValueError, "repeats a mesh axis"
    return None


def normalize_rules(
    rules: Any, *, caller: str, argname: str = "axis_rules"
) -> LogicalRules:
    """Validates rules and returns them as a tuple of `(str, MeshAxes)` tuples,
    with lists of mesh axes turned into tuples. Raises TypeError/ValueError naming
    the first bad rule."""
    if isinstance(rules, str) or not isinstance(rules, Sequence):
        raise TypeError(_rules_type_message(caller, argname, rules))
    out = []
    for index, rule in enumerate(rules):
        problem = _rule_problem(rule)
        if problem is not None:
            error, what = problem
            raise error(_rule_message(caller, argname, index, rule, what))
        name, axes = rule
        if not (axes is None or isinstance(axes, str)):
            axes = tuple(axes)
        out.append((name, axes))
    return tuple(out)


_UNASSIGNED = object()


def logical_to_spec(
    axes: Any, rules: LogicalRules, *, caller: str, path: KeyPath | None = None
) -> PartitionSpec:
    """Resolves one sequence of logical names with already-validated rules."""
    if isinstance(axes, str) or not isinstance(axes, Sequence):
        raise TypeError(_axes_type_message(caller, axes, path))
    position: dict[str, int] = {}
    for index, name in enumerate(axes):
        if name is None:
            continue
        if not isinstance(name, str):
            raise TypeError(_entry_message(caller, axes, index, path))
        if name in position:
            raise ValueError(_duplicate_message(caller, axes, name, path))
        position[name] = index
    result: list[Any] = [_UNASSIGNED] * len(axes)
    used: set[str] = set()
    pending = len(position)
    # Rules are tried in priority order; a rule applies to its dimension if no
    # earlier rule did, and if none of its mesh axes shards another dimension yet.
    for name, mesh_axes in rules:
        if not pending:
            break
        index = position.get(name)
        if index is None or result[index] is not _UNASSIGNED:
            continue
        if mesh_axes is None:
            wanted: tuple[str, ...] = ()
        elif isinstance(mesh_axes, str):
            wanted = (mesh_axes,)
        else:
            wanted = mesh_axes
        if used.isdisjoint(wanted):
            result[index] = mesh_axes
            used.update(wanted)
            pending -= 1
    return PartitionSpec(*(None if r is _UNASSIGNED else r for r in result))


def axis_names_resolver(
    rules: LogicalRules | None, *, caller: str
) -> Callable[[AxisNames, KeyPath], PartitionSpec]:
    """`(axes, path) -> PartitionSpec` for the `AxisNames` of one tree, by
    already-validated `rules` (`None`: the rules of the current context, read at
    the first call). Models repeat a few layouts many times: each distinct one is
    resolved once."""
    resolved: dict[AxisNames, PartitionSpec] = {}

    def resolve(axes: AxisNames, path: KeyPath) -> PartitionSpec:
        nonlocal rules
        spec = resolved.get(axes)
        if spec is None:
            if rules is None:
                rules = _state.rules
            spec = logical_to_spec(axes, rules, caller=caller, path=path)
            resolved[axes] = spec
        return spec

    return resolve


# --------------------------------------------------------------------------------
# The rules context: thread-local, nestable.


class _RulesState(threading.local):
    # `threading.local` runs `__init__` once in every thread that touches it, so a
    # new thread starts with no rules, whatever its parent had.
    def __init__(self) -> None:
        self.rules: LogicalRules = ()
        self.saved: list[LogicalRules] = []


_state = _RulesState()


class RulesContext:
    """Sets already-validated rules for the current thread while active.

    Saved rules live on a per-thread stack, so one instance may be entered again,
    nested, or from several threads at once. Private: the Partitioner validates its
    rules once with `normalize_rules` and enters a `RulesContext` per call.
    """

    __slots__ = ("_rules",)

    def __init__(self, rules: LogicalRules) -> None:
        self._rules = rules

    def __enter__(self) -> LogicalRules:
        _state.saved.append(_state.rules)
        _state.rules = self._rules
        return self._rules

    def __exit__(self, *exc_info: Any) -> None:
        _state.rules = _state.saved.pop()

    def __repr__(self) -> str:
        return f"eqshard.logical_axis_rules({self._rules!r})"


@renamed_keywords("logical_axis_rules", rules="axis_rules")
@typecheck
def logical_axis_rules(axis_rules: AxisRulesArg) -> RulesContext:
    """Sets the logical axis rules for the current thread inside a `with` block.

    Inside the block, every eqshard function whose `axis_rules=` is left as `None`
    reads these rules. Blocks nest: the innermost wins, and on leaving a block
    (also by an exception) the rules from before it are back. The rules belong to
    the thread that entered the block: other threads, including ones started
    inside it, do not see them. Entering costs well under a microsecond, and the
    returned object may be entered again.

    Rules are read when code runs in Python, so under `jax.jit` when a function is
    traced: a compiled function keeps the rules of its trace, and changing the
    rules later does not retrace it. Pass `axis_rules=` explicitly where that
    matters.

    **Arguments:**

    - `axis_rules`: a sequence of `(logical_name, mesh_axes)` pairs in priority
      order; `mesh_axes` is a mesh axis name, a tuple of them, or `None`.

    **Returns:**

    A context manager; `with ... as rules` gives the validated rules (a tuple of
    tuples).

    **Raises:**

    `TypeError`/`ValueError` naming the first malformed rule, on the call (before
    the block runs).

    !!! Example

        ```python
        with eqshard.logical_axis_rules([("batch", "data"), ("mlp", "model")]):
            spec = eqshard.logical_to_mesh_axes(("batch", "mlp"))
        spec  # P('data', 'model')
        ```
    """
    return RulesContext(normalize_rules(axis_rules, caller="logical_axis_rules"))


@renamed_keywords("set_logical_axis_rules", rules="axis_rules")
@typecheck
def set_logical_axis_rules(axis_rules: AxisRulesArg) -> None:
    """Sets the logical axis rules of the current thread until set again.

    Prefer [`eqshard.logical_axis_rules`][], which restores the previous rules on
    leaving its block. Rules set here inside such a block last only until the block
    ends.

    **Arguments:**

    - `axis_rules`: a sequence of `(logical_name, mesh_axes)` pairs in priority
      order; `()` clears the rules.

    **Returns:**

    `None`.

    **Raises:**

    `TypeError`/`ValueError` naming the first malformed rule.

    !!! Example

        ```python
        eqshard.set_logical_axis_rules([("batch", "data")])
        eqshard.get_logical_axis_rules()  # (('batch', 'data'),)
        eqshard.set_logical_axis_rules(())
        ```
    """
    _state.rules = normalize_rules(axis_rules, caller="set_logical_axis_rules")


@typecheck
def get_logical_axis_rules() -> LogicalRules:
    """Returns the logical axis rules of the current thread.

    These are the rules of the innermost active [`eqshard.logical_axis_rules`][]
    block, or the last ones given to [`eqshard.set_logical_axis_rules`][], or `()`.

    **Returns:**

    The rules as a tuple of `(logical_name, mesh_axes)` tuples, with any lists of
    mesh axes turned into tuples.

    !!! Example

        ```python
        with eqshard.logical_axis_rules([("mlp", ["model", "data"])]):
            eqshard.get_logical_axis_rules()  # (('mlp', ('model', 'data')),)
        eqshard.get_logical_axis_rules()  # ()
        ```
    """
    return _state.rules


def rules_or_context(axis_rules: Any, caller: str) -> LogicalRules:
    """`axis_rules` checked, or the context's rules when it is `None`."""
    if axis_rules is None:
        return _state.rules
    return normalize_rules(axis_rules, caller=caller)
