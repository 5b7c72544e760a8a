"""Checking a `PartitionSpec` against an array shape and a mesh.

One function, `check_spec`, finds everything wrong with a spec for one leaf and
the nearest spec that is right. `shard` raises with its findings;
`with_sharding_constraint` corrects with them and `corrected_spec` exposes the
correction (both in `_constraint.py`). The messages for many leaves are built in
one place, `spec_error_message`, so every caller reports the same way.
"""

import dataclasses
import functools as ft
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax.tree_util as jtu
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._caches import register
from .._mesh._current import mesh_repr
from .._tree import broadcast_prefix, grouped_paths, is_array, path_str, paths_text
from .._typing import KeyPath, SpecLeaf
from ._logical import axis_names_resolver, AxisNames, normalize_rules
from ._memory import check_host_memory, Host, HOST_MEMORY


def is_spec_leaf(x: Any) -> bool:
    """Leaves of a spec tree: a `PartitionSpec`, a `NamedSharding`, a layout in
    host memory (`Host`), or `None`."""
    return x is None or isinstance(x, PartitionSpec | NamedSharding | Host)


def leaf_specs(
    specs: PyTree,
    tree: PyTree,
    *,
    caller: str,
    logical: bool = False,
    axis_rules: Any = None,
    argname: str = "specs",
) -> list[tuple[KeyPath, SpecLeaf | Host]]:
    """One `(path, spec)` pair per leaf of `tree`, broadcasting the prefix `specs`.

    With `logical=True`, `AxisNames` leaves (also in `host(...)`) are resolved to
    `PartitionSpec`s by
    `axis_rules` (or the logical-rules context). Raises a `ValueError` naming the first
    path where `specs` is not a prefix of `tree`, or a `TypeError` naming a leaf of
    `specs` that is not a spec; both call `specs` by `argname`."""
    pairs = broadcast_prefix(
        specs, tree, is_leaf=is_spec_leaf, name=argname, caller=caller
    )
    # The rules: checked now if given, read from the context at the first
    # `AxisNames` otherwise (most trees have none).
    rules = None if axis_rules is None else normalize_rules(axis_rules, caller=caller)
    resolve = axis_names_resolver(rules, caller=caller)
    for i, (path, spec) in enumerate(pairs):
        if logical and isinstance(spec, AxisNames):
            pairs[i] = (path, resolve(spec, path))
        elif isinstance(spec, Host) and not isinstance(spec.spec, PartitionSpec):
            if not (logical and isinstance(spec.spec, AxisNames)):
                raise TypeError(
                    bad_spec_leaf_message(
                        caller, path, spec, logical=logical, argname=argname
                    )
                )
            pairs[i] = (path, Host(resolve(spec.spec, path)))
        elif not is_spec_leaf(spec):
            raise TypeError(
                bad_spec_leaf_message(
                    caller, path, spec, logical=logical, argname=argname
                )
            )
    return pairs


def bad_spec_leaf_message(
    caller: str, path: KeyPath, leaf: Any, *, logical: bool, argname: str = "specs"
) -> str:
    """The message for a leaf of a spec tree that is not a spec, with the fix that
    fits what was written: `P(...)` for mesh axis names, `logical_to_mesh_specs`
    for logical ones where they are not accepted."""
    names = ", `eqshard.AxisNames`" if logical else ""
    message = (
        f"eqshard.{caller}: `{argname}` has {leaf!r} at '{path_str(path)}'. Spec "
        f"leaves must be `PartitionSpec`, `NamedSharding`{names}, "
        "`eqshard.host(PartitionSpec)` or `None`"
    )
    if isinstance(leaf, Host):
        return (
            f"{message}; in a spec tree, `eqshard.host` takes the leaf's own spec "
            "(rules' values such as `eqshard.stacked` and `eqshard.host()` without "
            "a spec belong in partition rules)."
        )
    if isinstance(leaf, AxisNames):
        return (
            f"{message}; resolve logical axis names to mesh axes first, with "
            "`eqshard.logical_to_mesh_specs(specs, rules)`."
        )
    if isinstance(leaf, str):
        fix = f"write P({leaf!r}) for a mesh axis"
        if logical:
            fix += f", or eqshard.AxisNames({leaf!r}) for a logical name"
        if path and isinstance(path[-1], jtu.SequenceKey):
            fix += (
                " (a plain tuple or list is a container, so each of its names "
                "became a leaf: wrap them all, as in P('dp', 'tp'))"
            )
        return f"{message}; {fix}."
    return f"{message}."


def abstract_mesh_error(caller: str, paths: Sequence[KeyPath]) -> TypeError:
    """The message for `NamedSharding`s of `specs` on an abstract mesh, at `paths`,
    where arrays must be put on devices."""
    return TypeError(
        f"eqshard.{caller}: `specs` has `NamedSharding`s on an abstract mesh at "
        f"{paths_text(paths)}, which has no devices to place arrays on. Pass "
        "`PartitionSpec`s and a mesh (`eqshard.get_partition_spec` reads them "
        "from a tree), or bind the shardings of an `eqx.filter_eval_shape` tree "
        "to a mesh with `eqshard.extract_shardings(shapes, mesh)`."
    )


def named_sharding(
    spec: PartitionSpec | Host,
    mesh: Mesh | AbstractMesh,
    *,
    caller: str,
    path: KeyPath,
    argname: str = "specs",
    logical: bool = False,
) -> NamedSharding:
    """`NamedSharding(mesh, spec)`, after checking that `spec` names only axes of
    `mesh`, each once (JAX's own errors name no path): the one place a
    `NamedSharding` is built from a user's spec (`shard`, `named_shardings`,
    `filter_jit`, `t5x.PartitionedFn`), on a concrete or an abstract mesh. A
    `host(spec)` gives the memory kind `"pinned_host"`, on a concrete mesh
    whose devices have it."""
    memory_kind = None
    if isinstance(spec, Host):
        if not isinstance(spec.spec, PartitionSpec):
            raise TypeError(
                bad_spec_leaf_message(
                    caller, path, spec, logical=False, argname=argname
                )
            )
        if isinstance(mesh, Mesh):
            where = f"`{argname}` at '{path_str(path)}'"
            check_host_memory(caller, where, mesh.devices.flat)
        spec, memory_kind = spec.spec, HOST_MEMORY
    axes = [axis for entry in spec for axis in entry_axes(entry)]
    unknown = [axis for axis in axes if axis not in mesh.shape]
    twice = sorted({axis for i, axis in enumerate(axes) if axis in axes[:i]})
    if unknown or twice:
        if unknown:
            alternative = ", or logical names (eqshard.AxisNames) with rules" * logical
            what = (
                f"names {', '.join(map(repr, unknown))}, not "
                f"{'an axis' if len(unknown) == 1 else 'axes'} of the mesh "
                f"{mesh_repr(mesh)}. Use the mesh's axis names "
                f"({_axes_text(mesh.axis_names)}) or None{alternative}"
            )
        else:
            what = (
                f"names {', '.join(map(repr, twice))} more than once, but a mesh axis "
                "can split one dimension only. Name each axis at most once"
            )
        raise ValueError(
            f"eqshard.{caller}: `{argname}` at '{path_str(path)}' is {spec}, which "
            f"{what}."
        )
    return NamedSharding(mesh, spec, memory_kind=memory_kind)


def _axes_text(axes: Iterable[str]) -> str:
    """A mesh's axis names, for messages: `'dp', 'tp'`."""
    return ", ".join(map(repr, axes))


def entry_axes(entry: Any) -> tuple[Any, ...]:
    """The mesh axes of one entry of a spec. Anything but a name, a tuple (or list)
    of names or `None`, such as `P(1)`'s `1`, counts as one name, which no mesh
    has, so that the checks report it."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    if isinstance(entry, tuple | list):
        return tuple(entry)
    return (entry,)


def spec_entry(axes: Sequence[Any]) -> Any:
    """The entry of a spec for one dimension split over `axes`: `None` for none,
    the axis for one, a tuple for several (the inverse of `entry_axes`, so that
    what is not a name, such as `P(1)`'s `1`, comes back as it was)."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def axes_repr(axes: Sequence[str]) -> str:
    return repr(spec_entry(axes))


def check_spec(
    shape: tuple[int, ...], spec: PartitionSpec, mesh_shape: Mapping[str, int]
) -> tuple[PartitionSpec, list[str]]:
    """Checks `spec` for an array of `shape` on a mesh of axis sizes `mesh_shape`.

    Returns the nearest valid spec (the same spec if it is valid) and the reasons it
    is not valid (empty if it is): entries beyond the rank are dropped, unknown or
    repeated mesh axes are dropped, and of a dimension's axes only those that keep
    the dimension divisible are kept, in order."""
    reasons = []
    entries = list(spec)
    if len(entries) > len(shape):
        reasons.append(
            f"the spec has {len(entries)} entries but the array has rank {len(shape)}"
        )
        entries = entries[: len(shape)]
    used: set[str] = set()
    fixed: list[Any] = []
    for dim, entry in enumerate(entries):
        if entry is PartitionSpec.UNCONSTRAINED:
            fixed.append(entry)
            continue
        kept: list[str] = []
        for axis in entry_axes(entry):
            if axis not in mesh_shape:
                reasons.append(f"{axis!r} is not a mesh axis")
            elif axis in used:
                reasons.append(f"mesh axis {axis!r} is used twice")
            else:
                kept.append(axis)
                used.add(axis)
        size = 1
        for axis in kept:
            size *= mesh_shape[axis]
        if shape[dim] % size:
            reasons.append(
                f"dimension {dim} (size {shape[dim]}) is not divisible by "
                f"{axes_repr(kept)} (size {size})"
            )
            divisible: list[str] = []
            size = 1
            for axis in kept:
                if shape[dim] % (size * mesh_shape[axis]) == 0:
                    divisible.append(axis)
                    size *= mesh_shape[axis]
                else:
                    used.discard(axis)
            kept = divisible
        fixed.append(spec_entry(kept))
    while fixed and fixed[-1] is None:
        fixed.pop()
    if not reasons:
        return spec, []
    return PartitionSpec(*fixed), reasons


@dataclasses.dataclass(frozen=True)
class ShardingProblem:
    """A leaf whose spec cannot apply, in a [`eqshard.ShardingReport`][].

    **Fields:**

    - `path`, `shape`, `spec`: the leaf and the spec asked for.
    - `suggestion`: the nearest spec that applies (see [`eqshard.corrected_spec`][]),
      which the report uses for this leaf.
    - `reasons`: what is wrong with `spec`.
    - `mesh`: the mesh the spec was checked against.
    """

    path: str
    shape: tuple[int, ...]
    spec: PartitionSpec
    suggestion: PartitionSpec
    reasons: tuple[str, ...]
    mesh: Mesh | AbstractMesh


# How a leaf's spec is checked: `(shape, spec, mesh, leaf) -> (fixed, reasons)`.
SpecCheck = Callable[
    [tuple[int, ...], PartitionSpec, Mesh | AbstractMesh, Any],
    tuple[PartitionSpec, list[str]],
]


def check_spec_on_mesh(
    shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh | AbstractMesh, leaf: Any
) -> tuple[PartitionSpec, list[str]]:
    """`check_spec` against `mesh`: the `SpecCheck` of most callers."""
    if _fits(shape, spec, mesh):
        return spec, []
    return check_spec(shape, spec, dict(mesh.shape))


@ft.lru_cache(maxsize=4096)
def _fits(
    shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh | AbstractMesh
) -> bool:
    """Whether `spec` fits an array of `shape` on `mesh`, found once per shape,
    spec and mesh: a model's layers repeat them, and trees are placed again and
    again."""
    return not check_spec(shape, spec, dict(mesh.shape))[1]


register(_fits.cache_clear)


def check_leaf(
    path: KeyPath,
    spec: Any,
    leaf: Any,
    mesh: Mesh | AbstractMesh | None,
    *,
    check: SpecCheck = check_spec_on_mesh,
) -> tuple[PartitionSpec, Mesh | AbstractMesh, PartitionSpec, ShardingProblem | None]:
    """One array leaf's spec checked: `(spec, mesh, fixed, problem)`, with the
    spec and mesh of a `NamedSharding` unpacked (a `PartitionSpec` is on `mesh`),
    the nearest spec that fits, and what is wrong if it does not fit (`None` if it
    does). The caller passes only arrays with a spec, and a mesh for a
    `PartitionSpec`."""
    if isinstance(spec, NamedSharding):
        spec, mesh = spec.spec, spec.mesh
    elif isinstance(spec, Host):
        spec = spec.spec
    # The caller passes a mesh with every `PartitionSpec`.
    mesh = typing.cast(Mesh | AbstractMesh, mesh)
    shape = tuple(int(n) for n in leaf.shape)
    fixed, reasons = check(shape, spec, mesh, leaf)
    if not reasons:
        return spec, mesh, fixed, None
    problem = ShardingProblem(path_str(path), shape, spec, fixed, tuple(reasons), mesh)
    return spec, mesh, fixed, problem


def check_placeable(
    check: SpecCheck,
    shape: tuple[int, ...],
    spec: PartitionSpec,
    mesh: Mesh | AbstractMesh,
    leaf: Any,
) -> tuple[PartitionSpec, list[str]]:
    """`check`, and no `P.UNCONSTRAINED` entry: it leaves a layout to `jit`'s
    compiler, and an array placed now (or built into its shardings) needs one."""
    fixed, reasons = check(shape, spec, mesh, leaf)
    if any(entry is PartitionSpec.UNCONSTRAINED for entry in spec):
        reasons = [
            *reasons,
            "P.UNCONSTRAINED leaves a dimension's layout to `jit`'s compiler, but "
            "an array placed now needs one (None replicates it)",
        ]
        entries = [None if e is PartitionSpec.UNCONSTRAINED else e for e in fixed]
        while entries and entries[-1] is None:
            entries.pop()
        fixed = PartitionSpec(*entries)
    return fixed, reasons


def check_leaves(
    pairs: Sequence[tuple[KeyPath, Any]],
    leaves: Sequence[Any],
    mesh: Mesh | AbstractMesh | None,
    *,
    check: SpecCheck = check_spec_on_mesh,
) -> list[ShardingProblem]:
    """The problems of every array leaf whose spec cannot apply, in leaf order.
    `pairs` are the `(path, spec)` of the leaves; leaves that stay where they are
    (non-arrays, `None` specs, and `PartitionSpec`s when `mesh` is `None`) are
    skipped."""
    problems = []
    for (path, spec), leaf in zip(pairs, leaves, strict=True):
        if spec is None or not is_array(leaf):
            continue
        if mesh is None and not isinstance(spec, NamedSharding):
            continue
        problem = check_leaf(path, spec, leaf, mesh, check=check)[3]
        if problem is not None:
            problems.append(problem)
    return problems


def spec_error_message(
    caller: str, problems: Sequence[ShardingProblem], *, corrected: bool = False
) -> str:
    """The message for leaves whose specs do not fit: one line per leaf with its path,
    shape, spec, what is wrong, and the nearest spec that fits (which is used
    instead if `corrected`); an optimizer state's leaves with the same problem
    share their parameter's line (`'0/w' (+ mu, nu)`)."""
    meshes = {mesh_repr(p.mesh) for p in problems}
    count = (
        "1 leaf has a spec"
        if len(problems) == 1
        else f"{len(problems)} leaves have specs"
    )
    on = f" on mesh {meshes.pop()}" if len(meshes) == 1 else ""
    lines = [f"eqshard.{caller}: {count} that cannot apply{on}:"]
    # An optimizer state's leaves share their parameter's line, where the same.
    paths = [p.path for p in problems]
    keys = [(p.shape, p.spec, mesh_repr(p.mesh), p.reasons) for p in problems]
    for group in grouped_paths(paths, keys):
        p = problems[group.leader]
        mesh_note = "" if on else f" on mesh {mesh_repr(p.mesh)}"
        lines.append(
            f"  - '{p.path}'{group.suffix} (shape {p.shape}), spec {p.spec}"
            f"{mesh_note}: "
            f"{'; '.join(p.reasons)}. "
            + (
                f"Using {p.suggestion} instead."
                if corrected
                else f"Use {p.suggestion} for this leaf, or change the array or "
                "the mesh."
            )
        )
    return "\n".join(lines)
