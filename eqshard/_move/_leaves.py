"""The leaves of a tree to place, one record each, validated before anything moves.

The tree is flattened once, and each leaf becomes a `Leaf`: its path, its value,
the `NamedSharding` it must get (`None` for the leaves that stay where they are:
static fields, callables, Python scalars, `None` specs) and the dtype it is cast
to. The spec tree (or a prefix of one) is broadcast against the tree to get
there. Every array's spec is checked against its shape and the mesh, and all the
leaves that do not fit are reported in one error; so are all the leaves that
cannot move whatever their spec (`_shard.py` then places them).
"""

import functools as ft
import typing
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._caches import register
from .._mesh._current import concrete_mesh
from .._spectree._check_spec import (
    abstract_mesh_error,
    check_leaves,
    check_placeable,
    check_spec,
    check_spec_on_mesh,
    leaf_specs,
    named_sharding,
    spec_error_message,
)
from .._spectree._memory import Host
from .._tree import (
    abstract_leaf_error,
    deleted_error,
    is_array,
    is_deleted,
    listing,
    path_str,
)
from .._typing import KeyPath, PyTreeDef
from ._host import leaf_casts, unplaceable
from ._multiprocess import host_local_shape, is_global


# The `NamedSharding` of each checked `PartitionSpec` on each mesh, built once: JAX
# keeps what it derives from a sharding (its hash, its device assignment) on the
# object, so a tree placed again hands `device_put` the objects it has seen.
_SHARDINGS: dict[tuple[PartitionSpec, Mesh], NamedSharding] = {}
_SHARDINGS_MAX = 1024
register(_SHARDINGS.clear)


def _sharding(
    spec: PartitionSpec | Host, mesh: Mesh, *, caller: str, path: KeyPath
) -> NamedSharding:
    """`named_sharding(spec, mesh)`, the same object for an equal `PartitionSpec`
    on an equal mesh (a spec that does not fit raises each time, and is not kept)."""
    if not isinstance(spec, PartitionSpec):
        return named_sharding(spec, mesh, caller=caller, path=path)
    found = _SHARDINGS.get((spec, mesh))
    if found is None:
        found = named_sharding(spec, mesh, caller=caller, path=path)
        if len(_SHARDINGS) >= _SHARDINGS_MAX:
            _SHARDINGS.clear()
        _SHARDINGS[spec, mesh] = found
    return found


class Leaf(NamedTuple):
    """One leaf of the tree being placed."""

    path: KeyPath  # from the root of the call's tree
    value: Any
    sharding: NamedSharding | None  # `None`: the leaf stays where it is
    cast: np.dtype | None  # the dtype asked for with `dtype=`, if any


def _unplaceable_error(
    caller: str, found: list[tuple[KeyPath, np.dtype, str]]
) -> TypeError:
    return TypeError(
        listing(
            f"eqshard.{caller}: NumPy arrays of dtypes no device can hold:",
            [f"'{path_str(p)}' ({dtype}): {reason}." for p, dtype, reason in found],
        )
    )


def _check_movable(
    caller: str, pairs: list[tuple[KeyPath, Any]], leaves: list[Any]
) -> None:
    """Raises a `TypeError` naming the leaves that cannot move whatever their spec:
    structs without data, NumPy arrays no device can hold, and shardings on an
    abstract mesh."""
    given = list(zip(pairs, leaves, strict=True))
    abstract = [p for (p, _), x in given if isinstance(x, jax.ShapeDtypeStruct)]
    if abstract:
        raise abstract_leaf_error(caller, abstract)
    deleted = [p for (p, spec), x in given if spec is not None and is_deleted(x)]
    if deleted:
        raise deleted_error(caller, deleted)
    untyped = [
        (path, x.dtype, reason)
        for (path, spec), x in given
        if spec is not None
        and isinstance(x, np.ndarray | np.generic)
        and (reason := unplaceable(x.dtype)) is not None
    ]
    if untyped:
        raise _unplaceable_error(caller, untyped)
    unbound = [
        path
        for (path, spec), x in given
        if isinstance(spec, NamedSharding)
        and not isinstance(spec.mesh, Mesh)
        and is_array(x)
    ]
    if unbound:
        raise abstract_mesh_error(caller, unbound)


def _check_block(
    shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh | AbstractMesh, leaf: Any
) -> tuple[PartitionSpec, list[str]]:
    """`check_spec` for one process's block of a global array (a host array with
    `host_local`): each process's devices must hold one slice of the array, and the
    array must fit `spec`."""
    if is_global(leaf) or not isinstance(mesh, Mesh):
        return check_spec(shape, spec, dict(mesh.shape))
    full, block_reasons, block_fixed = host_local_shape(shape, spec, mesh)
    fixed, reasons = check_spec(full, spec, dict(mesh.shape))
    if reasons and full != shape:
        reasons.insert(0, f"the blocks of all processes make an array of shape {full}")
    if block_reasons:
        return block_fixed, block_reasons + reasons
    return fixed, reasons


def leaves_of(
    tree: PyTree,
    specs: PyTree,
    mesh: Mesh | AbstractMesh | None,
    *,
    dtype: Any,
    caller: str,
    root: KeyPath,
    host_local: bool,
) -> tuple[list[Leaf], PyTreeDef]:
    """`tree` flattened once, one `Leaf` per leaf, and its structure. All the
    leaves that cannot move, and all whose spec does not fit, are reported in one
    error each. With `host_local`, host arrays are each process's block of the
    global array, whose shape is checked instead."""
    path_leaves, treedef = jtu.tree_flatten_with_path(tree)
    values = [value for _, value in path_leaves]
    pairs = [(root + p, s) for p, s in leaf_specs(specs, tree, caller=caller)]
    _check_movable(caller, pairs, values)
    if any(
        isinstance(spec, PartitionSpec | Host) and is_array(value)
        for (_, spec), value in zip(pairs, values, strict=True)
    ):
        mesh = concrete_mesh(mesh, caller=caller)
    check = _check_block if host_local else check_spec_on_mesh
    problems = check_leaves(
        pairs, values, mesh, check=ft.partial(check_placeable, check)
    )
    if problems:
        raise ValueError(spec_error_message(caller, problems))
    casts = leaf_casts(dtype, tree, caller=caller, root=root, leaves=values)
    leaves = []
    made: dict[int, NamedSharding] = {}  # by the spec's `id`: its spelling kept
    for (path, spec), value, cast in zip(pairs, values, casts, strict=True):
        sharding = None
        if isinstance(spec, NamedSharding) and is_array(value):
            sharding = spec  # its memory kind included
        elif isinstance(spec, PartitionSpec | Host) and is_array(value):
            sharding = made.get(id(spec))
            if sharding is None:
                # `mesh` is the concrete mesh found above; the spec is checked.
                mesh = typing.cast(Mesh, mesh)
                sharding = _sharding(spec, mesh, caller=caller, path=path)
                made[id(spec)] = sharding
        leaves.append(Leaf(path, value, sharding, cast))
    return leaves, treedef
