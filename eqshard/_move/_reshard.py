"""A placed state moved in bounded steps: what `shard(..., donate=True,
max_inflight_bytes=n)` adds to `_shard.py`'s placing.

1. **Checked first.** A tree holding traced arrays (a call inside `jit`) is
   refused, pointing to the in-program moves (`check_traced`); so is a bound
   smaller than one device's block of some array (`check_inflight`), naming the
   paths, before anything moves.
2. **Sizes.** Each distinct array to place gives every device of its new mesh
   one block of the same size (`block_bytes`); an array already laid out as
   asked (`stays`) moves nothing.
3. **Batches.** The arrays are placed in consecutive batches (`batches`), each
   giving no device more than `max_inflight_bytes` of new blocks, so that a
   device holds at most its part of the state plus the bound (with `donate`).
4. **Release.** After each batch, each caller's array whose every move is
   placed is deleted (`release`), unless a placed array shares one of its
   buffers (an array kept where it was) or a leaf of the result keeps it.

`shard_plan` (`_shard_plan.py`) reads the same sizes and batches, so the peak it
expects is the one `shard` keeps to.
"""

import collections
import math
import typing
from collections.abc import Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding

from .._internals import cpu, routes
from .._keys import is_key, key_data
from .._tree import path_str, paths_text, placed_dtype
from .._typing import KeyPath
from ._leaves import Leaf


def check_traced(caller: str, tree: Any) -> None:
    """Raises a `TypeError` naming the traced arrays of `tree` (a call inside
    `jit`): data moves between meshes outside programs only."""
    traced = [p for p, x in jtu.tree_flatten_with_path(tree)[0] if _traced(x)]
    if traced:
        raise TypeError(
            f"eqshard.{caller}: `tree` holds traced arrays at {paths_text(traced)} "
            f"(a call inside `jax.jit` or another transformation); `{caller}` "
            "moves placed data between meshes, outside programs. Inside a "
            "function, lay values out with `eqshard.with_sharding_constraint` "
            "(or `jax.sharding.reshard` on Explicit mesh axes), or call "
            f"`{caller}` before or after the jitted function."
        )


def _traced(x: Any) -> bool:
    return isinstance(x, Tracer)


def check_max_inflight(caller: str, max_inflight_bytes: Any) -> None:
    """Raises a `ValueError` unless `max_inflight_bytes` is `None` or bytes > 0."""
    if max_inflight_bytes is None:
        return
    if isinstance(max_inflight_bytes, bool) or not isinstance(max_inflight_bytes, int):
        raise TypeError(
            f"eqshard.{caller}: `max_inflight_bytes` must be a number of bytes "
            f"(an int) or None; got {max_inflight_bytes!r}."
        )
    if max_inflight_bytes <= 0:
        raise ValueError(
            f"eqshard.{caller}: `max_inflight_bytes` must be > 0 bytes; got "
            f"{max_inflight_bytes}. Pass None for no bound."
        )


def itemsize(value: Any, cast: np.dtype | None) -> int:
    """The bytes of one element of `value` once placed (cast to `cast`): typed
    PRNG keys count their key data, NumPy data the dtype JAX places it as."""
    if cast is not None:
        return placed_dtype(np.dtype(cast)).itemsize
    if is_key(value):
        return _key_itemsize(value)
    if isinstance(value, jax.Array):
        return np.dtype(value.dtype).itemsize
    return placed_dtype(np.asarray(value).dtype).itemsize


def _key_itemsize(value: jax.Array) -> int:
    data = key_data(value)
    per_key = math.prod(data.shape[value.ndim :])
    return np.dtype(data.dtype).itemsize * per_key


def block_bytes(value: Any, sharding: NamedSharding, cast: np.dtype | None) -> int:
    """The bytes of each device's block of `value` placed on `sharding` (every
    device of a `NamedSharding` holds a block of the same shape)."""
    shape = tuple(np.shape(value))
    return math.prod(sharding.shard_shape(shape)) * itemsize(value, cast)


def stays(value: Any, sharding: NamedSharding, cast: np.dtype | None) -> bool:
    """Whether `value` is a JAX array already laid out on `sharding` in its dtype,
    which then moves nothing."""
    return (
        isinstance(value, jax.Array)
        and cast is None
        and value.sharding.is_equivalent_to(sharding, value.ndim)
        and value.sharding.memory_kind == sharding.memory_kind
    )


def devices_of(sharding: NamedSharding) -> tuple[Any, ...]:
    """The devices that hold a block of an array on `sharding`, in mesh order."""
    # Data is placed on concrete meshes only (`shard` refuses abstract ones).
    return tuple(typing.cast(Mesh, sharding.mesh).devices.flat)


def move_size(leaf: Leaf) -> tuple[tuple[Any, ...], int]:
    """The devices a leaf to place puts blocks on, and the bytes of each (0 for an
    array already laid out as asked)."""
    sharding = typing.cast(NamedSharding, leaf.sharding)
    if stays(leaf.value, sharding, leaf.cast):
        return devices_of(sharding), 0
    return devices_of(sharding), block_bytes(leaf.value, sharding, leaf.cast)


def check_inflight(
    caller: str, sizes: Sequence[tuple[KeyPath, int]], bound: int | None
) -> None:
    """Raises a `ValueError` naming the arrays of which one device's block is
    larger than `bound`: no batch could move them."""
    if bound is None:
        return
    large = [(p, n) for p, n in sizes if n > bound]
    if not large:
        return
    largest = max(n for _, n in large)
    shown = ", ".join(f"'{path_str(p)}' ({n} bytes)" for p, n in large[:5])
    more = f" and {len(large) - 5} more" if len(large) > 5 else ""
    raise ValueError(
        f"eqshard.{caller}: `max_inflight_bytes={bound}` is smaller than one "
        f"device's block of the arrays at {shown}{more}, which each move whole. "
        f"Pass max_inflight_bytes >= {largest}, or split those arrays over more "
        "mesh axes. Nothing was moved."
    )


def batches(
    sizes: Sequence[tuple[tuple[Any, ...], int]], bound: int | None
) -> list[list[int]]:
    """Consecutive groups of the moves whose `(devices, block bytes)` are
    `sizes`, none giving a device more than `bound` bytes (`check_inflight` has
    made sure each move alone fits): all in one group without a bound."""
    if bound is None or not sizes:
        return [list(range(len(sizes)))]
    out: list[list[int]] = []
    current: list[int] = []
    load: collections.Counter[Any] = collections.Counter()
    for i, (devices, n) in enumerate(sizes):
        if n and current and any(load[d] + n > bound for d in devices):
            out.append(current)
            current, load = [], collections.Counter()
        current.append(i)
        for d in devices:
            load[d] += n
    out.append(current)
    return out


def _buffers(x: jax.Array) -> list[jax.Array]:
    """This process's single-device arrays of `x` (of its key data for keys)."""
    data = key_data(x) if is_key(x) else x
    return [shard.data for shard in data.addressable_shards]


def _address(buffer: jax.Array) -> int | None:
    """The address of a single-device array's buffer; `None` if it was deleted
    already (a lost device's, deleted by the caller)."""
    return None if buffer.is_deleted() else cpu.buffer_address(buffer, 0)


def release(
    batch: Sequence[tuple[Any, Any]],
    moves: Sequence[tuple[Any, Any]],
    left: collections.Counter[int],
    kept: set[int],
) -> None:
    """After a batch is placed: frees the caller's arrays of `batch` (its
    `(source, placed)` pairs) whose every move of `moves` is placed (`left`
    counts the moves still to come, by `id`), unless a leaf keeps them (`kept`).
    A buffer that a placed array shares (an array that stayed where it was, or
    a block `jax.device_put` kept on its device) is kept; the others go. Where
    the buffers' addresses cannot be read, nothing is freed (the plain route)."""
    for source, _ in batch:
        key = id(source)
        left[key] -= 1
        if left[key] or key in kept:
            continue
        if not isinstance(source, jax.Array) or source.is_deleted():
            continue
        placed = [p for v, p in moves if v is source and isinstance(p, jax.Array)]
        buffers = _buffers(source)
        try:
            shared = {_address(b) for p in placed for b in _buffers(p)}
            own = [_address(b) for b in buffers]
        except routes.Unrecognised as error:
            routes.fall_back("copies", str(error))
            continue
        if not shared & set(own) and None not in own:
            source.delete()
            continue
        for buffer, address in zip(buffers, own, strict=True):
            if address is not None and address not in shared:
                buffer.delete()
