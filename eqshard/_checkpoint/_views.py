"""Stacked layers restored in another view of the same layer order.

A pipeline's circular layout keeps stacked layers `(L, ...)` as the view
`(R, S, K, ...)` (`eqshard.stage_view`, a reshape), and GPipe and unpipelined
runs keep `(L, ...)`. A checkpoint of one restores into the other: where a leaf
of `like` and the array saved differ only in their leading layer axes (one or
three of them, the same number of layers, the same dimensions after), the array
is read in its saved shape, its layer axes whole and the dimensions after them
laid out as the target's, then reshaped onto the target's sharding. Both sides
of three layer axes must be laid out as the circular view is (`laid_as_stages`:
dimension 1 over mesh axes as many as its length): the target's sharding says
so for `like`, and `save` records it for each array saved (eqshard's file,
`stage_views`; a checkpoint without that record has none). Arrays of the same
size that merely differ in shape are a mismatch, not a view. Reshapes keep
the row-major order, so every value is where `jax.lax.scan` over the layers
expects it, bit for bit.
"""

import math
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .._keys import is_key
from .._tree import paths_text
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


def laid_as_stages(shape: tuple[int, ...], sharding: Any) -> bool:
    """Whether an array of three layer axes `(R, S, K, ...)` on `sharding` is laid
    out as the circular view is: its dimension 1, the stages, over mesh axes of
    `S` devices in all (`stacked(spec, stages=...)`). Other arrays of the same
    size (a `(2, 3, 4)` saved, a `(4, 3, 2)` in `like`) differ in shape, not in
    view: a reshape would scramble them silently."""
    if len(shape) < 3:
        return False
    entry = None
    if isinstance(sharding, NamedSharding) and len(sharding.spec) > 1:
        entry = sharding.spec[1]
    names = () if entry is None else (entry,) if isinstance(entry, str) else entry
    sizes = dict(sharding.mesh.shape) if isinstance(sharding, NamedSharding) else {}
    return math.prod(sizes[name] for name in names) == shape[1]


def _staged(target: jax.ShapeDtypeStruct) -> bool:
    return laid_as_stages(tuple(target.shape), target.sharding)


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
        if (
            leads is None
            or (leads[1] == 3 and not _staged(target))
            or (leads[0] == 3 and not saved[name].stage_view)
        ):
            continue
        i, path, leaf = named[name]
        read[name] = _read_as(target, shape, leads)
        compared[name] = (i, path, jax.ShapeDtypeStruct(shape, leaf.dtype))
        views[name] = target
    return read, compared, views


def unstaged_fix(
    targets: dict[str, jax.ShapeDtypeStruct],
    named: dict[str, tuple[int, KeyPath, Any]],
    saved: dict[str, Saved],
) -> str:
    """The fix for arrays saved with three leading axes that `like` has as one
    (`(2, 3, 4)` saved, `(24,)` in `like`), not read as a view: the checkpoint
    does not say they were a circular pipeline's view; empty if there are none."""
    paths = [
        named[name][1]
        for name, target in targets.items()
        if name in saved
        and not saved[name].stage_view
        and (leads := _leads(tuple(saved[name].shape), tuple(target.shape)))
        and leads[0] == 3
    ]
    if not paths:
        return ""
    return (
        f" The arrays at {paths_text(paths)} have three leading axes in the "
        "checkpoint, which does not record them as a circular pipeline's stacked "
        "layers (saved laid out by `eqshard.stacked(spec, stages=...)`; "
        "checkpoints saved before eqshard recorded it have none), so they are not "
        "reshaped: if they are layers in the view `(R, S, K, ...)`, restore them "
        "in their saved shape, then `eqshard.unstage_view(tree, stages=S, "
        "repeats=R)`."
    )


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
