"""`filter_shard_map`'s specs (`_shard_map.py`): resolved and checked before
tracing, one `PartitionSpec` per array, every problem reported in one error.

`resolve_in_specs` turns `in_specs` (a spec tree or prefix, partition rules,
logical `AxisNames`, or `None` to read each array's own layout, `array_layout`)
into specs on the mesh `map_mesh` finds; `resolve_out_specs` resolves `out_specs`
against the per-device blocks of the output.
"""

import functools as ft
from collections.abc import Callable
from typing import Any

import jax.tree_util as jtu
from jax.core import Tracer
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from .._mesh._current import find_mesh, mesh_repr, same_mesh
from .._spectree._carried import explicit_axes, placed_sharding, type_sharding
from .._spectree._check_spec import (
    check_leaves,
    check_spec,
    entry_axes,
    is_spec_leaf,
    leaf_specs,
    spec_error_message,
)
from .._spectree._logical import (
    AxisNames,
    LogicalRules,
)
from .._spectree._memory import refuse_host
from .._spectree._resolve import resolve_specs
from .._tree import is_array, listing, path_str, paths_text
from .._typing import KeyPath


CALLER = "filter_shard_map"
_INFER = (
    " (`in_specs=None`, the default, means: read each array's own layout. In "
    "`jax.shard_map`, `in_specs=None` means that every input is static.)"
)


# One builder per kind of message.


def _no_mesh_error() -> ValueError:
    return ValueError(
        f"eqshard.{CALLER}: no mesh: pass `mesh=`, set one with "
        "`jax.set_mesh(mesh)`, or pass arrays placed on a mesh (e.g. by "
        "`eqshard.shard`; under `jit`, `grad` or any other transformation, only "
        "arrays on Explicit axes say which mesh they are on)."
    )


def _meshes_error(meshes: list[Mesh | AbstractMesh]) -> ValueError:
    listed = ", ".join(mesh_repr(m) for m in meshes)
    return ValueError(
        f"eqshard.{CALLER}: the arguments are placed on {len(meshes)} different "
        f"meshes ({listed}) and no mesh is given or set; pass `mesh=` for the map "
        "and place every array on it."
    )


def _infer_error(found: list[tuple[KeyPath, str]], mesh: Any) -> ValueError:
    return ValueError(
        listing(
            f"eqshard.{CALLER}: cannot read the layout of {len(found)} array(s) "
            f"on mesh {mesh_repr(mesh)}:",
            [f"'{path_str(p)}' {why}." for p, why in found],
            "Pass `in_specs` (a spec tree or prefix for the tuple of "
            "arguments, e.g. `(model_specs, P('dp'))`, or rules), or place "
            "the arrays first with `eqshard.shard`." + _INFER,
            limit=None,
        )
    )


def _other_mesh_error(
    argname: str, found: list[tuple[KeyPath, Any]], mesh: Any
) -> ValueError:
    return ValueError(
        listing(
            f"eqshard.{CALLER}: `{argname}` has {len(found)} array(s) on another "
            f"mesh than the map's {mesh_repr(mesh)}:",
            [f"'{path_str(p)}': on mesh {mesh_repr(m)}." for p, m in found],
            "Place them on the map's mesh (`eqshard.shard(tree, specs, mesh)`), "
            "or pass `PartitionSpec`s instead of `NamedSharding`s.",
            limit=None,
        )
    )


def _explicit_error(found: list[tuple[KeyPath, Any, Any]], mesh: Any) -> ValueError:
    lines = [
        f"'{path_str(p)}': "
        + (
            f"laid out as {have}"
            if have is not None
            else "its type has no layout (a host array, or placed on Auto axes)"
        )
        + f", `in_specs` asks {want}."
        for p, have, want in found
    ]
    return ValueError(
        listing(
            f"eqshard.{CALLER}: on Explicit axes ({mesh_repr(mesh)}) "
            "`jax.shard_map` takes each array as its type lays it out "
            f"(`jax.typeof(x).sharding`), but {len(found)} array(s) are laid "
            "out otherwise:",
            lines,
            "Omit `in_specs` to use the arrays' own layouts, or lay them out as "
            "asked first: `eqshard.shard` outside `jit`, "
            "`jax.sharding.reshard` inside.",
            limit=None,
        )
    )


def _no_rules_error(argname: str, found: list[tuple[KeyPath, Any]]) -> ValueError:
    listed = ", ".join(f"{names!r} at '{path_str(path)}'" for path, names in found)
    return ValueError(
        f"eqshard.{CALLER}: `{argname}` has logical axis names ({listed}), but no "
        "logical axis rules are given or set, so they would resolve to no mesh "
        "axis (a replicated P(None, ...)). Pass `axis_rules=` (e.g. "
        "`axis_rules=[('batch', 'dp')]`), or set rules with "
        "`eqshard.set_logical_axis_rules` or `with eqshard.logical_axis_rules(...)`."
    )


def _no_out_spec_error(paths: list[KeyPath]) -> ValueError:
    return ValueError(
        f"eqshard.{CALLER}: `out_specs` has `None` at {paths_text(paths)}, where `fn` "
        "returns arrays: give each a spec, e.g. P() for an array that is the same "
        "on every device of the map."
    )


# Specs: resolved against a tree, checked against a mesh.


def _check(
    shape: tuple[int, ...],
    spec: PartitionSpec,
    mesh: Mesh | AbstractMesh,
    leaf: Any,
    *,
    manual: frozenset[str],
    blocks: bool,
) -> tuple[PartitionSpec, list[str]]:
    """`check_spec` for one array of the map, and the nearest spec that applies.
    Axes must be manual ones (see `axis_names`), and an array may not leave its
    layout to the compiler. With `blocks`, `shape` is one device's block of an
    output, which any sizes divide."""
    sizes = dict(mesh.shape)
    fixed, reasons = check_spec(
        shape, spec, dict.fromkeys(sizes, 1) if blocks else sizes
    )
    named = {axis for entry in spec for axis in entry_axes(entry)}
    automatic = sorted(axis for axis in named if axis in sizes and axis not in manual)
    if automatic:
        reasons.append(
            f"{', '.join(map(repr, automatic))} not among the manual axes "
            f"{tuple(sorted(manual))} (`axis_names`)"
        )
    if any(entry is PartitionSpec.UNCONSTRAINED for entry in spec):
        reasons.append("P.UNCONSTRAINED leaves a layout to the compiler")
    if automatic or PartitionSpec.UNCONSTRAINED in tuple(fixed):
        fixed = _only(fixed, manual)
    return fixed, reasons


def _only(spec: PartitionSpec, axes: frozenset[str]) -> PartitionSpec:
    """`spec` naming only `axes`, without trailing `None`s."""
    entries = []
    for entry in spec:
        kept = tuple(axis for axis in entry_axes(entry) if axis in axes)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _placement(spec: PartitionSpec, ndim: int) -> tuple[tuple[Any, ...], ...]:
    """The axes of each dimension: equal for `P('dp')` and `P(('dp',), None)`."""
    entries = tuple(spec)
    return tuple(
        tuple(entry_axes(entries[d])) if d < len(entries) else () for d in range(ndim)
    )


def array_layout(leaf: Any) -> tuple[PartitionSpec, Mesh | AbstractMesh] | str:
    """The spec and mesh an array carries, or why it carries none: a placed array's
    `NamedSharding`, a traced array's type on Explicit axes."""
    if isinstance(leaf, Tracer):
        sharding = type_sharding(leaf)
        if (
            sharding is None
            or sharding.mesh.empty
            or explicit_axes(sharding.mesh) != frozenset(sharding.mesh.axis_names)
        ):
            return (
                "is traced on Auto axes, where its type carries no layout (the "
                "compiler chooses one)"
            )
        return sharding.spec, sharding.mesh
    placed = placed_sharding(leaf)
    if placed is not None:
        return placed.spec, placed.mesh
    sharding = getattr(leaf, "sharding", None)  # for the message alone
    if sharding is None:
        return "is a NumPy array, on no mesh"
    return f"has a {type(sharding).__name__}, not a NamedSharding on a mesh"


def map_mesh(
    mesh: Mesh | AbstractMesh | None, in_specs: Any, layouts: list[Any]
) -> Mesh | AbstractMesh:
    """The mesh of the map: `mesh`, the current mesh, or the one of the
    `NamedSharding`s in `in_specs` and of the arrays' `layouts`."""
    given = find_mesh(mesh)
    if given is not None:
        return given
    found: list[Mesh | AbstractMesh] = []
    named = jtu.tree_leaves(in_specs, is_leaf=is_spec_leaf)
    meshes = [x.mesh for x in named if isinstance(x, NamedSharding)]
    meshes += [x[1] for x in layouts if isinstance(x, tuple)]
    for on in meshes:
        if not any(same_mesh(on, m) for m in found):
            found.append(on)
    if not found:
        raise _no_mesh_error()
    if len(found) > 1:
        raise _meshes_error(found)
    return found[0]


def _logical_pairs(
    specs: Any,
    tree: Any,
    *,
    argname: str,
    mesh: Mesh | AbstractMesh,
    rules: LogicalRules,
    per_item: bool = False,
) -> list[tuple[KeyPath, Any]]:
    """`leaf_specs` of `specs` (a spec tree or prefix, rules, or a function)
    resolved for `tree`, `AxisNames` resolved by `rules`: refused while there are
    no rules, since every name would then resolve to no axis (in the specs as
    given, where rules' values are, and as resolved, where a function's are)."""
    resolved = resolve_specs(
        specs,
        tree,
        caller=CALLER,
        argname=argname,
        mesh=mesh,
        axis_rules=rules,
        per_item=per_item,
    )
    if not rules:
        for given in (specs, resolved):
            found = [
                (path, leaf)
                for path, leaf in jtu.tree_leaves_with_path(
                    given, is_leaf=lambda x: isinstance(x, AxisNames)
                )
                if isinstance(leaf, AxisNames) and any(n is not None for n in leaf)
            ]
            if found:
                raise _no_rules_error(argname, found)
    pairs = leaf_specs(
        resolved,
        tree,
        caller=CALLER,
        logical=True,
        axis_rules=rules,
        argname=argname,
    )
    refuse_host(CALLER, pairs, argname, "shard_map's specs say how values are split")
    return pairs


def leaf_paths(tree: Any) -> list[KeyPath]:
    """The paths of the leaves of `tree`, for messages (found again only then)."""
    return [path for path, _ in jtu.tree_leaves_with_path(tree)]


def _leaf_specs(
    given: list[Any],
    leaves: list[Any],
    layouts: list[Any],
    mesh: Mesh | AbstractMesh,
    manual: frozenset[str],
    where: Callable[[], list[KeyPath]],
) -> list[Any]:
    """The spec of each leaf (`None` for non-arrays): the one given, else the
    array's own layout; raises for layouts that cannot be read and arrays on
    another mesh."""
    cannot, elsewhere = [], []
    specs: list[Any] = []
    for i, (spec, leaf, layout) in enumerate(zip(given, leaves, layouts, strict=True)):
        if not is_array(leaf):
            specs.append(None)
            continue
        if spec is None:
            if isinstance(layout, str):
                cannot.append((i, layout))
                continue
            spec, on = layout
            if not manual.issuperset(on.axis_names):
                spec = _only(spec, manual)
        elif isinstance(spec, NamedSharding):
            spec, on = spec.spec, spec.mesh
        else:
            on = mesh
        if not same_mesh(on, mesh):
            elsewhere.append((i, on))
        specs.append(spec)
    if cannot:
        paths = where()
        raise _infer_error([(paths[i], why) for i, why in cannot], mesh)
    if elsewhere:
        paths = where()
        found = [(paths[i], on) for i, on in elsewhere]
        raise _other_mesh_error("in_specs", found, mesh)
    return specs


def _check_explicit(
    specs: list[Any],
    leaves: list[Any],
    mesh: Mesh | AbstractMesh,
    manual: frozenset[str],
    where: Callable[[], list[KeyPath]],
) -> None:
    """On a mesh all Explicit and all mapped over, raises for arrays whose spec is
    not their own layout (their type)."""
    if manual != frozenset(mesh.axis_names) or set(mesh.axis_types) != {
        AxisType.Explicit
    }:
        return
    differ = []
    for i, spec in enumerate(specs):
        if spec is None:
            continue
        typed, ndim = type_sharding(leaves[i]), leaves[i].ndim
        if typed is None:  # no JAX type: nothing to compare
            continue
        if _placement(typed.spec, ndim) != _placement(spec, ndim):
            explicit = set(typed.mesh.axis_types) == {AxisType.Explicit}
            differ.append((i, typed.spec if explicit else None, spec))
    if differ:
        paths = where()
        raise _explicit_error(
            [(paths[i], have, want) for i, have, want in differ], mesh
        )


def resolve_in_specs(
    in_specs: Any,
    args: tuple[Any, ...],
    leaves: list[Any],
    layouts: list[Any],
    mesh: Mesh | AbstractMesh,
    manual: frozenset[str],
    rules: LogicalRules,
) -> tuple[PartitionSpec, ...]:
    """One spec per array of `args`, checked against it; raises the errors above,
    each listing every array it concerns. `layouts` are those of `array_layout`."""
    if in_specs is None:  # every layout read: no spec tree to match
        given: list[Any] = [None] * len(leaves)
        paths: list[KeyPath] | None = None
    else:
        pairs = _logical_pairs(
            in_specs, args, argname="in_specs", mesh=mesh, rules=rules, per_item=True
        )
        paths = [path for path, _ in pairs]
        given = [spec for _, spec in pairs]

    def where() -> list[KeyPath]:
        return paths or leaf_paths(args)

    specs = _leaf_specs(given, leaves, layouts, mesh, manual, where)
    if paths is not None:  # given specs: checked (read layouts fit already)
        given = [s.spec if isinstance(s, NamedSharding) else s for s in given]
        problems = check_leaves(
            list(zip(paths, given, strict=True)),
            leaves,
            mesh,
            check=ft.partial(_check, manual=manual, blocks=False),
        )
        if problems:
            raise ValueError(spec_error_message(CALLER, problems))
    _check_explicit(specs, leaves, mesh, manual, where)
    return tuple(spec for spec in specs if spec is not None)


def resolve_out_specs(
    out_specs: Any,
    blocks: Any,
    mesh: Mesh | AbstractMesh,
    manual: frozenset[str],
    rules: LogicalRules,
) -> list[PartitionSpec]:
    """One spec per array output, given each device's `blocks` of the outputs."""
    pairs = _logical_pairs(
        out_specs, blocks, argname="out_specs", mesh=mesh, rules=rules
    )
    leaves = jtu.tree_leaves(blocks)
    missing, elsewhere = [], []
    specs: list[tuple[KeyPath, Any]] = []
    for (path, spec), leaf in zip(pairs, leaves, strict=True):
        if not is_array(leaf):
            continue
        if spec is None:
            missing.append(path)
        elif isinstance(spec, NamedSharding):
            if not same_mesh(spec.mesh, mesh):
                elsewhere.append((path, spec.mesh))
            spec = spec.spec
        specs.append((path, spec))
    if missing:
        raise _no_out_spec_error(missing)
    if elsewhere:
        raise _other_mesh_error("out_specs", elsewhere, mesh)
    arrays = [leaf for leaf in leaves if is_array(leaf)]
    problems = check_leaves(
        specs, arrays, mesh, check=ft.partial(_check, manual=manual, blocks=True)
    )
    if problems:
        raise ValueError(
            spec_error_message(CALLER, problems)
            + "\n(The shapes are those of one device's block of the outputs.)"
        )
    return [spec for _, spec in specs]


# The program, kept.
