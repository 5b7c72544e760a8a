"""Stacked layers restored in another view of the same layer order.

A pipeline's circular layout keeps stacked layers `(L, ...)` as the view
`(R, S, K, ...)` (`eqshard.stage_view`, a reshape), and GPipe and unpipelined
runs keep `(L, ...)`. A checkpoint of one restores into the other: where a leaf
of `like` and the array saved differ only in their leading layer axes (one or
three of them, the same number of layers, the same dimensions after), the array
is read in its saved shape, its layer axes whole and the dimensions after them
laid out as the target's, then reshaped onto the target's sharding. A target of
three layer axes must have its stages laid out as the circular view's (over
mesh axes as many as its dimension 1): arrays of the same size that merely
differ in shape are a mismatch, not a view. Reshapes keep
the row-major order, so every value is where `jax.lax.scan` over the layers
expects it, bit for bit.
"""

import math
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .._keys import is_key
from .._typing import KeyPath
from ._disk import Saved


def _leads(saved: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, int] | None:
    """How many leading layer axes the saved shape and the target's have, when
    one is the other's view: (1, 3), (3, 1) or (3, 3), the same number of layers
    and the same dimensions after them."""
    if saved == shape:
        return None
    for a, b in ((1, 3), (3, 1), (3, 3)):
        if (
            len(saved) >= a
            and len(shape) >= b
            and saved[a:] == shape[b:]
            and math.prod(saved[:a]) == math.prod(shape[:b])
        ):
            return a, b
    return None


def _staged(target: jax.ShapeDtypeStruct) -> bool:
    """Whether a target of three layer axes `(R, S, K, ...)` is laid out as the
    circular view is: its dimension 1, the stages, over mesh axes of `S` devices
    in all (`stacked(spec, stages=...)`). Other arrays of the same size (a
    `(2, 3, 4)` saved, a `(4, 3, 2)` in `like`) differ in shape, not in view: a
    reshape would scramble them silently."""
    sharding = target.sharding
    entry = None
    if isinstance(sharding, NamedSharding) and len(sharding.spec) > 1:
        entry = sharding.spec[1]
    names = () if entry is None else (entry,) if isinstance(entry, str) else entry
    sizes = dict(sharding.mesh.shape) if isinstance(sharding, NamedSharding) else {}
    return math.prod(sizes[name] for name in names) == target.shape[1]


def _read_as(
    target: jax.ShapeDtypeStruct, shape: tuple[int, ...], leads: tuple[int, int]
) -> jax.ShapeDtypeStruct:
    """The struct the saved array is read into: its own shape, the layer axes
    whole, the dimensions after them sharded as the target's."""
    sharding = target.sharding
    if isinstance(sharding, NamedSharding):
        spec = (*sharding.spec, *(None,) * (len(target.shape) - len(sharding.spec)))
        spec = PartitionSpec(*(None,) * leads[0], *spec[leads[1] :])
        sharding = NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)
    return jax.ShapeDtypeStruct(shape, target.dtype, sharding=sharding)


def layer_views(
    targets: dict[str, jax.ShapeDtypeStruct],
    named: dict[str, tuple[int, KeyPath, Any]],
    saved: dict[str, Saved],
) -> tuple[
    dict[str, jax.ShapeDtypeStruct],
    dict[str, tuple[int, KeyPath, Any]],
    dict[str, jax.ShapeDtypeStruct],
]:
    """For every array saved in another view of its layers than `like`'s: the
    targets to read (in the saved shape), `named` with that shape for the
    comparison with the checkpoint, and the targets the reads are reshaped into."""
    read, compared, views = dict(targets), dict(named), {}
    for name, target in targets.items():
        if name not in saved or is_key(target):
            continue
        shape = tuple(saved[name].shape)
        leads = _leads(shape, tuple(target.shape))
        if leads is None or (leads[1] == 3 and not _staged(target)):
            continue
        i, path, leaf = named[name]
        read[name] = _read_as(target, shape, leads)
        compared[name] = (i, path, jax.ShapeDtypeStruct(shape, leaf.dtype))
        views[name] = target
    return read, compared, views


def into_views(
    restored: dict[str, jax.Array], views: dict[str, jax.ShapeDtypeStruct]
) -> dict[str, jax.Array]:
    """The arrays read in another view, reshaped onto their targets."""
    out = dict(restored)
    for name, target in views.items():
        out[name] = jax.jit(
            lambda a, shape=target.shape: a.reshape(shape),
            out_shardings=target.sharding,
        )(restored[name])
    return out
