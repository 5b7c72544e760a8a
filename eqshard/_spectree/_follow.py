"""What follows a parameter: the one rule by which an optimizer state's arrays,
gradients or an EMA copy take the specs of the parameters they belong to.

An array follows the parameter whose path ends its own path (optax's
`mu/blocks/up/weight` ends with `blocks/up/weight`) and whose shape is its shape,
or its shape with one dimension reduced away (Adafactor's factored moments).
`derive_specs` applies it to a state and its parameters, `match_partition_rules`
to the items of a tree built together (`(model, opt_state)`: `followers_of_items`,
here), and plans to the state they make abstractly.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._tree import is_array, path_name
from .._typing import KeyPath
from ._memory import Host


# A leaf smaller than this that follows no parameter (a step count, Adafactor's
# `(1,)` placeholders) is replicated; a larger one is `on_invalid`'s business.
_SMALL_BYTES = 1024


def replicated_like(spec: Any) -> Any:
    """The replicated spec where `spec` places: `P()`, or a replicated
    `NamedSharding` on its mesh, in its memory; any other sharding (a single
    device) as it is."""
    if isinstance(spec, Host):
        return Host(replicated_like(spec.spec))
    if isinstance(spec, NamedSharding):
        return NamedSharding(spec.mesh, PartitionSpec(), memory_kind=spec.memory_kind)
    if isinstance(spec, PartitionSpec):
        return PartitionSpec()
    return spec


def without_dim(spec: Any, dim: int | None) -> Any:
    """`spec` for the array with dimension `dim` reduced away (`spec` itself for
    `None`)."""
    if dim is None:
        return spec
    if isinstance(spec, Host):
        return Host(without_dim(spec.spec, dim))
    inner = spec.spec if isinstance(spec, NamedSharding) else spec
    if not isinstance(inner, PartitionSpec):
        return spec
    entries = list(inner)
    if dim < len(entries):
        del entries[dim]
    reduced = PartitionSpec(*entries)
    if isinstance(spec, NamedSharding):
        return NamedSharding(spec.mesh, reduced, memory_kind=spec.memory_kind)
    return reduced


def _reduced_dim(
    path: KeyPath, shape: tuple[int, ...], pshape: tuple[int, ...]
) -> int | None:
    """The dimension of the parameter's shape `pshape` that a leaf of `shape` has
    reduced away (Adafactor's factored `v_row`/`v_col`), or `None`. Where several
    fit (a square matrix), optax's choice: `v_row` drops the largest dimension and
    `v_col` the second largest (the last of equals counting as larger)."""
    if len(shape) != len(pshape) - 1:
        return None
    dims = [d for d in range(len(pshape)) if pshape[:d] + pshape[d + 1 :] == shape]
    if len(dims) > 1:
        order = [int(d) for d in np.argsort(pshape, kind="stable")]
        names = {path_name(path[i : i + 1], "/") for i in range(len(path))}
        preferred = (
            order[-1] if "v_row" in names else order[-2] if "v_col" in names else None
        )
        if preferred in dims:
            return preferred
    return dims[0] if dims else None


class Followed(NamedTuple):
    """The parameter a leaf follows, from `followed`: its path, and the dimension
    of its shape the leaf has reduced away (`None` for the same shape); `fits` is
    `False` for a leaf at a parameter's path whose shape is neither."""

    path: KeyPath
    dim: int | None
    fits: bool


def followed(
    path: KeyPath,
    shape: tuple[int, ...],
    shape_of: Callable[[KeyPath], tuple[int, ...] | None],
    *,
    first: int = 0,
) -> Followed | None:
    """The parameter (`shape_of(path)` is its shape, `None` where there is none;
    for example `shapes.get` of `{path: shape}`) that the leaf at `path` of
    `shape` follows: the one whose path is the longest end of the leaf's path
    (starting at index `first` or later), if its shape is the leaf's or the
    leaf's with one dimension reduced away (Adafactor's factored `v_row`/
    `v_col`). `None` if no parameter's path ends the leaf's."""
    for start in range(first, len(path)):
        key = tuple(path[start:])
        pshape = shape_of(key)
        if pshape is None:
            continue
        if shape == pshape:
            return Followed(key, None, True)
        dim = _reduced_dim(path[:start], shape, pshape)
        return Followed(key, dim, dim is not None)
    return None


def follow_spec(
    path: KeyPath,
    shape: tuple[int, ...],
    by_path: dict[KeyPath, tuple[tuple[int, ...], Any]],
) -> tuple[bool, Any]:
    """The spec of the leaf at `path` of `shape`, following the parameter (in
    `by_path`, `{path: (shape, spec)}`) whose path ends the leaf's path: its spec
    for its shape, its spec without the reduced entry for a factored shape. Returns
    `(found, spec)`; `found` is `False` (and `spec` `None`) if no parameter fits."""

    def shape_of(key: KeyPath) -> tuple[int, ...] | None:
        entry = by_path.get(key)
        return None if entry is None else entry[0]

    found = followed(path, shape, shape_of)
    if found is None or not found.fits:
        return False, None
    return True, without_dim(by_path[found.path][1], found.dim)


def is_placeholder(shape: tuple[int, ...], dtype: Any) -> bool:
    """Whether an array of `shape` and `dtype` is smaller than 1 KiB: one that
    follows no parameter (a step count, Adafactor's `(1,)` placeholders) is
    replicated."""
    # Typed PRNG keys' dtypes have an itemsize that NumPy cannot read.
    itemsize = getattr(dtype, "itemsize", None) or np.dtype(dtype).itemsize
    return math.prod(shape) * itemsize < _SMALL_BYTES


# ---------------------------------------------------------------- trees built together


class ItemFollower(NamedTuple):
    """An array that follows another of a tree built together: the index of the
    one it follows, the dimension it has reduced away (`None`: the same shape),
    and whether it fits it (else it is a placeholder, replicated)."""

    leader: int
    dim: int | None
    fits: bool


def followers_of_items(
    tree: PyTree, path_leaves: list[tuple[Any, Any]]
) -> dict[int, ItemFollower]:
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
    found: dict[int, ItemFollower] = {}
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
                found[i] = ItemFollower(index, follow.dim, True)
            elif is_placeholder(shape, path_leaves[i][1].dtype):
                found[i] = ItemFollower(index, None, False)
    return dict(sorted(found.items(), key=lambda kv: len(path_leaves[kv[0]][0])))


def item_follower_spec(follow: ItemFollower, specs: Sequence[Any]) -> Any:
    """The spec of an array that follows another (`specs`: by leaf index)."""
    if not follow.fits:
        return PartitionSpec()
    return without_dim(specs[follow.leader], follow.dim)


def item_follower_note(follow: ItemFollower, names: Sequence[str | None]) -> str:
    """What `eqshard.explain_partition_rules` says of an array that follows
    another (`names`: path strings by leaf index)."""
    name = repr(names[follow.leader])
    if not follow.fits:
        return f"a placeholder under 1 KiB at the path of {name}: replicated"
    if follow.dim is None:
        return f"follows {name}"
    return f"follows {name}, dimension {follow.dim} reduced away"
