"""What follows a parameter: the one rule by which an optimizer state's arrays,
gradients or an EMA copy take the specs of the parameters they belong to.

An array follows the parameter whose path ends its own path (optax's
`mu/blocks/up/weight` ends with `blocks/up/weight`) and whose shape is its shape,
or its shape with one dimension reduced away (Adafactor's factored moments).
`derive_specs` applies it to a state and its parameters, `match_partition_rules`
to the items of a tree built together (`(model, opt_state)`), and plans to the
state they make abstractly.
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ._tree import path_name
from ._typing import KeyPath


# A leaf smaller than this that follows no parameter (a step count, Adafactor's
# `(1,)` placeholders) is replicated; a larger one is `on_invalid`'s business.
_SMALL_BYTES = 1024


def replicated_like(spec: Any) -> Any:
    """The replicated spec where `spec` places: `P()`, or a replicated
    `NamedSharding` on its mesh; any other sharding (a single device) as it is."""
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
