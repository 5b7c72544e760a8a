"""XLA:CPU's buffers, as the CPU copy engine (`eqshard/_move/`) reads them.

On CPU devices a device's memory is host memory, and the copy engine rests on
what XLA's CPU client does with it, beyond JAX's documented contract:

- a device buffer can be read as a NumPy array without a copy
  (`device_buffer`: `np.asarray` of one device's data);
- `jax.device_put` takes a dense run of a NumPy array's memory as a device
  buffer of its own, without copying it, and copies a strided block
  (`has_dense_block`, `takes_in_place`); it does so for a buffer aligned to
  `ALIGNMENT` bytes (`aligned_empty`, `aligned_blocks`);
- a device buffer's address says whether it is a NumPy array's memory
  (`buffer_address`, `shares_memory`: `unsafe_buffer_pointer`).

A read that gets something other than it expects raises `routes.Unrecognised`;
the engine then takes its plain route (`jax.device_put`, `jax.device_get`),
which rests on none of this (`eqshard/_move/_copies.py`).
"""

import functools as ft
import math

import jax
import numpy as np
from jax.sharding import NamedSharding

from .routes import Unrecognised


# XLA's CPU client uses a host buffer in place when its data starts on a
# boundary of this many bytes.
ALIGNMENT = 64
# `aligned_blocks`: the huge-page size of x86-64 and most arm64 kernels, and
# the mean block size above which blocks share one allocation.
HUGE_PAGE = 2**21
SLAB = 2**20


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on an `ALIGNMENT`-byte boundary,
    which XLA's CPU client can use in place."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.__array_interface__["data"][0] % ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def aligned_blocks(shapes: list[tuple[int, ...]], dtype: np.dtype) -> list[np.ndarray]:
    """Uninitialised arrays of `shapes`, each starting on an `ALIGNMENT`-byte
    boundary. Where they average `SLAB` bytes or more, they are carved from one
    allocation that starts on a `HUGE_PAGE` boundary: NumPy asks the kernel for
    transparent huge pages for it, so filling the blocks faults once per 2 MiB,
    where a buffer per block of that size is mapped afresh by the C allocator
    and faults on every 4 KiB page (65,536 faults, most of the time of a 256 MiB
    move in `benchmarks/bench_reshard.py`; ~150 with the slab). The allocation
    lives while any of its blocks does, and its last huge page may hold up to
    2 MiB that no block uses. Smaller blocks, which the allocator reuses, get
    one `aligned_empty` each."""
    sizes = [math.prod(shape) * dtype.itemsize for shape in shapes]
    if not sizes or sum(sizes) < SLAB * len(sizes):
        return [aligned_empty(shape, dtype) for shape in shapes]
    spans = [-(-n // ALIGNMENT) * ALIGNMENT for n in sizes]
    total = -(-sum(spans) // HUGE_PAGE) * HUGE_PAGE
    raw = np.empty(total + HUGE_PAGE, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    out = []
    for shape, n, span in zip(shapes, sizes, spans, strict=True):
        out.append(raw[start : start + n].view(dtype).reshape(shape))
        start += span
    return out


def device_buffer(array: jax.Array, k: int) -> np.ndarray:
    """The buffer of `array`'s `k`-th addressable device (in the order of
    `addressable_devices_indices_map`) as a NumPy array, without a copy on CPU
    (so nothing is cached on `array`). Raises `Unrecognised` if it is not an
    array of `array`'s dtype and rank."""
    view = np.asarray(array.addressable_data(k))
    if (
        not isinstance(view, np.ndarray)
        or view.dtype != array.dtype
        or view.ndim != array.ndim
    ):
        raise Unrecognised(
            f"a CPU device buffer read as {type(view).__name__} "
            f"{getattr(view, 'dtype', '?')}{getattr(view, 'shape', '')}"
        )
    return view


def buffer_address(array: jax.Array, k: int) -> int:
    """The address of the buffer of `array`'s `k`-th addressable device. Raises
    `Unrecognised` if JAX gives none."""
    read = getattr(array.addressable_data(k), "unsafe_buffer_pointer", None)
    address = None if read is None else read()
    if not isinstance(address, int):
        raise Unrecognised("no address for a device buffer (unsafe_buffer_pointer)")
    return address


def shares_memory(placed: jax.Array, leaf: np.ndarray) -> bool:
    """Whether a device buffer of `placed` lies in the memory of `leaf`."""
    start = leaf.ctypes.data
    end = start + leaf.nbytes
    return any(
        start <= buffer_address(placed, k) < end
        for k in range(len(placed.sharding.addressable_devices))
    )


@ft.lru_cache(maxsize=1024)
def may_alias(sharding: NamedSharding) -> bool:
    """Whether `jax.device_put` may place host data on `sharding` without copying
    it: on CPU devices, or in a host memory."""
    return sharding.memory_kind not in (None, "device") or any(
        device.platform == "cpu" for device in sharding.device_set
    )


def has_dense_block(leaf: np.ndarray, sharding: NamedSharding) -> bool:
    """Whether a block of `sharding` is a dense run of `leaf`'s memory (in C or
    Fortran order), which `jax.device_put` may take in place on CPU; it copies a
    strided block, as a device buffer is dense."""
    return _dense_block(sharding, leaf.shape, leaf.strides, leaf.dtype.itemsize)


@ft.lru_cache(maxsize=4096)
def _dense_block(
    sharding: NamedSharding,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    itemsize: int,
) -> bool:
    """`has_dense_block`, once per sharding and layout: a model's arrays share a
    few, and trees are placed again and again."""
    # A view of the layout alone, never read: only its flags are asked for. Its
    # elements are raw bytes of the array's item size (NumPy cannot make such a
    # view of every dtype JAX has, such as float8).
    item = np.empty(1, np.dtype((np.void, itemsize)))
    layout = np.lib.stride_tricks.as_strided(item, shape, strides)
    return any(
        layout[index].flags.c_contiguous or layout[index].flags.f_contiguous
        for index in sharding.addressable_devices_indices_map(shape).values()
    )


# This module's caches' clearers, which the copy engine registers with
# `_caches.register` (the door imports nothing of eqshard's: it sits below the
# base modules).
CACHE_CLEARERS = (may_alias.cache_clear, _dense_block.cache_clear)


def takes_in_place(leaf: np.ndarray, sharding: NamedSharding) -> bool:
    """Whether `jax.device_put` of `leaf` onto `sharding` may use some of its memory
    as a device buffer, without copying: on CPU devices or in a host memory, for a
    dense block (`has_dense_block`)."""
    return may_alias(sharding) and has_dense_block(leaf, sharding)
