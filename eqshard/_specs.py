"""Checking a `PartitionSpec` against an array shape and a mesh.

One function, `check_spec`, finds everything wrong with a spec for one leaf and
the nearest spec that is right. `shard` raises with its findings;
`with_sharding_constraint` corrects with them and `corrected_spec` exposes the
correction (both in `_constraint.py`). The messages for many leaves are built in
one place, `spec_error_message`, so every caller reports the same way.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import jax.tree_util as jtu
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._logical import AxisNames, logical_to_spec, rules_or_context
from ._tree import broadcast_prefix, path_str
from ._typing import KeyPath, SpecLeaf


def is_spec_leaf(x: Any) -> bool:
    """Leaves of a spec tree: a `PartitionSpec`, a `NamedSharding`, or `None`."""
    return x is None or isinstance(x, PartitionSpec | NamedSharding)


def leaf_specs(
    specs: PyTree,
    tree: PyTree,
    *,
    caller: str,
    logical: bool = False,
    rules: Any = None,
) -> list[tuple[KeyPath, SpecLeaf]]:
    """One `(path, spec)` pair per leaf of `tree`, broadcasting the prefix `specs`.

    With `logical=True`, `AxisNames` leaves are resolved to `PartitionSpec`s by
    `rules` (or the logical-rules context). Raises a `ValueError` naming the first
    path where `specs` is not a prefix of `tree`, or a `TypeError` naming a leaf of
    `specs` that is not a spec."""
    pairs = broadcast_prefix(
        specs, tree, is_leaf=is_spec_leaf, name="specs", caller=caller
    )
    # The rules: checked now if given, read from the context at the first
    # `AxisNames` otherwise (most trees have none).
    table = None if rules is None else rules_or_context(rules, caller)
    resolved: dict[AxisNames, PartitionSpec] = {}  # each distinct layout once
    for i, (path, spec) in enumerate(pairs):
        if logical and isinstance(spec, AxisNames):
            if spec not in resolved:
                if table is None:
                    table = rules_or_context(rules, caller)
                resolved[spec] = logical_to_spec(spec, table, caller=caller, path=path)
            pairs[i] = (path, resolved[spec])
        elif not is_spec_leaf(spec):
            raise TypeError(bad_spec_leaf_message(caller, path, spec, logical=logical))
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
        f"leaves must be `PartitionSpec`, `NamedSharding`{names} or `None`"
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


def named_sharding(
    spec: PartitionSpec,
    mesh: Mesh,
    *,
    caller: str,
    path: KeyPath,
    argname: str = "specs",
    logical: bool = False,
) -> NamedSharding:
    """`NamedSharding(mesh, spec)`, after checking that `spec` names only axes of
    `mesh`, each once (JAX's own errors name no path)."""
    axes = [axis for entry in spec for axis in entry_axes(entry)]
    unknown = [axis for axis in axes if axis not in mesh.shape]
    twice = sorted({axis for i, axis in enumerate(axes) if axis in axes[:i]})
    if unknown or twice:
        if unknown:
            alternative = ", or logical names (eqshard.AxisNames) with rules" * logical
            what = (
                f"names {', '.join(map(repr, unknown))}, not "
                f"{'an axis' if len(unknown) == 1 else 'axes'} of the mesh "
                f"{dict(mesh.shape)}. Use the mesh's axis names{alternative}"
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
    return NamedSharding(mesh, spec)


def entry_axes(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _entry(axes: Sequence[str]) -> str | tuple[str, ...] | None:
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def axes_repr(axes: Sequence[str]) -> str:
    return repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))


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
        fixed.append(_entry(kept))
    while fixed and fixed[-1] is None:
        fixed.pop()
    if not reasons:
        return spec, []
    return PartitionSpec(*fixed), reasons


Problem = tuple[
    KeyPath,
    tuple[int, ...],
    PartitionSpec,
    PartitionSpec,
    list[str],
    Mesh | AbstractMesh,
]


def spec_error_message(
    caller: str, problems: Sequence[Problem], *, corrected: bool = False
) -> str:
    """The message for leaves whose specs do not fit: one line per leaf with its path,
    shape, spec, what is wrong, and the nearest spec that fits (which is used
    instead if `corrected`)."""
    meshes = {str(dict(p[-1].shape)) for p in problems}
    count = (
        "1 leaf has a spec"
        if len(problems) == 1
        else f"{len(problems)} leaves have specs"
    )
    on = f" on mesh {meshes.pop()}" if len(meshes) == 1 else ""
    lines = [f"eqshard.{caller}: {count} that cannot apply{on}:"]
    for path, shape, spec, fixed, reasons, mesh in problems:
        mesh_note = "" if on else f" on mesh {dict(mesh.shape)}"
        lines.append(
            f"  - '{path_str(path)}' (shape {shape}), spec {spec}{mesh_note}: "
            f"{'; '.join(reasons)}. "
            + (
                f"Using {fixed} instead."
                if corrected
                else f"Use {fixed} for this leaf, or change the array or the mesh."
            )
        )
    return "\n".join(lines)
