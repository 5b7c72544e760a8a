"""Each device's block of a safetensors tensor, read into a buffer that becomes
the device's own.

`load_safetensors` reads every distinct block of a tensor that this process's
devices hold into a fresh buffer aligned to 64 bytes (`aligned_empty` of
`_internals/cpu.py`), which XLA's CPU client takes as the device's buffer
without another copy: the read is the only copy of each byte (on an
accelerator, the transfer is the other one). Nothing else holds or writes these
buffers, and none is a mapping of the file, so a file changed later changes no
device's data. A block that several devices hold is read once: the first device
takes the buffer, and the others a copy of their own, made on host, so that
every block is placed by one batched `make_array_from_callback` (one
`device_put` per device cost ~1 ms per tensor of 8 devices).

How a block is read depends on where its bytes lie:

- **In one run** (a block of whole rows, a whole tensor, a slice of a vector):
  by `os.preadv` from the file straight into the buffer, with no mapping (no
  page faults on the file's pages), the GIL released.
- **Strided** (a block that splits a row): copied out of the file mapped for
  this tensor only (`np.copyto`, which releases the GIL); a read per row piece
  costs a system call each, more than the mapping's faults (and reading whole
  rows into a buffer to copy from is two copies).

The blocks are read one after the other on the calling thread: the host holds
one tensor's blocks at a time beside what is placed. Reading them on the
copying threads (`_move/_threads.py`; `preadv` and `np.copyto` release the GIL),
in pieces of one core's share, took more CPU time and no less wall time on two
cores (`benchmarks/bench_checkpoint.py`).
Where a copy remains: a block cast as it is read (`dtype=`, or 64-bit data that
JAX narrows) is converted into memory NumPy allocates, which `device_put` copies
once more; a big-endian host copies every block out of the mapping.
"""

import math
import mmap
import os
import sys
from typing import Any

import jax
import numpy as np

from .._internals.cpu import aligned_empty
from ._safetensors_files import damaged_error


# A block: its `(start, stop)` in each dimension.
Bounds = tuple[tuple[int, int], ...]


def block_bounds(sharding: Any, shape: tuple[int, ...]) -> dict[Any, Bounds]:
    """The block each of this process's devices holds of an array of `shape`,
    in the order of `addressable_devices_indices_map`."""
    return {
        device: _bounds(index, shape)
        for device, index in sharding.addressable_devices_indices_map(shape).items()
    }


def _run(bounds: Bounds, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The first element and the count of the block `bounds` of a C-ordered
    array of `shape`, if its elements lie in one run (the dimensions before some
    dimension one element wide, those after it whole); else `None`."""
    split = len(shape)
    while split > 0 and bounds[split - 1] == (0, shape[split - 1]):
        split -= 1
    if any(b - a != 1 for a, b in bounds[: max(split - 1, 0)]):
        return None
    first = sum(a * math.prod(shape[i + 1 :]) for i, (a, _) in enumerate(bounds))
    return first, math.prod(b - a for a, b in bounds)


def _read_run(fd: int, block: np.ndarray, offset: int) -> bool:
    """Reads `block`'s bytes from byte `offset` of the file `fd` into it; `False`
    if the file ends first."""
    view = block.reshape(-1).view(np.uint8).data
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            return False
        done += got
    return True


def read_tensor(
    path: str,
    start: int,
    shape: tuple[int, ...],
    stored: np.dtype,
    wanted: list[Bounds],
    caller: str,
) -> dict[Bounds, np.ndarray]:
    """Each block of `wanted` of the C-ordered little-endian tensor of `shape` and
    `stored` dtype at byte `start` of `path`, in an aligned buffer of its own (as
    the module's docstring says). Raises eqshard's error naming `path` if the
    file has changed since its header was read (ends early)."""
    wanted = list(dict.fromkeys(wanted))
    out = {b: aligned_empty(tuple(y - x for x, y in b), stored) for b in wanted}
    runs = {b: _run(b, shape) for b in wanted if out[b].size}
    if sys.byteorder != "little" or not hasattr(os, "preadv"):
        runs = dict.fromkeys(runs)  # every block copied from the mapping
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except OSError as error:  # removed since its header was read
        raise damaged_error(caller, path, str(error), None) from None
    try:
        mapped = (
            _mapped(fd, start, shape, stored)
            if None in runs.values()
            else np.empty(0, stored)
        )
        complete = _read_all(fd, start, mapped, out, runs)
    except (OSError, ValueError) as error:  # changed since its header was read
        raise damaged_error(caller, path, str(error), None) from None
    finally:
        os.close(fd)
    if not complete:
        raise damaged_error(caller, path, "the file ends before the tensor", None)
    return out


def _mapped(
    fd: int, start: int, shape: tuple[int, ...], stored: np.dtype
) -> np.ndarray:
    """The tensor of `shape` and little-endian `stored` dtype at byte `start` of
    the file `fd`, mapped (unmapped once no view of it is left)."""
    nbytes = math.prod(shape) * stored.itemsize
    skip = start % mmap.ALLOCATIONGRANULARITY
    region = mmap.mmap(fd, skip + nbytes, access=mmap.ACCESS_READ, offset=start - skip)
    flat = np.frombuffer(
        region, stored.newbyteorder("<"), nbytes // stored.itemsize, skip
    )
    return flat.reshape(shape)


def _read_all(
    fd: int,
    start: int,
    mapped: np.ndarray,
    out: dict[Bounds, np.ndarray],
    runs: dict[Bounds, tuple[int, int] | None],
) -> bool:
    """Reads each block of `runs` into its buffer in `out`: a run by `preadv`
    from byte `start` of `fd` on, the others copied from `mapped`. Whether
    every block was read whole."""
    for bounds, run in runs.items():
        if run is None:
            index = tuple(slice(a, b) for a, b in bounds)
            np.copyto(out[bounds], mapped[index] if index else mapped)
        elif not _read_run(fd, out[bounds], start + run[0] * mapped.itemsize):
            return False
    return True


# A fully replicated block smaller than this is copied to each device by one
# batched placement, rather than by a `device_put` per device (~0.1 ms each).
_SMALL = 1 << 20
# Bytes past the alignment (`ALIGNMENT`) that no device takes in place.
_OFF = 16


def _copy(block: np.ndarray, offset: int = 0) -> np.ndarray:
    """A copy of `block` in a buffer of its own, `offset` bytes past an
    `ALIGNMENT` boundary."""
    out = aligned_empty((block.nbytes + offset,), np.dtype(np.uint8))[offset:]
    out = out.view(block.dtype).reshape(block.shape)
    np.copyto(out, block)
    return out


def place(
    shape: tuple[int, ...],
    sharding: Any,
    blocks: dict[Bounds, np.ndarray],
    where: dict[Any, Bounds],
) -> jax.Array:
    """The array of `shape` on `sharding` whose devices (`where`) hold their
    blocks: the first device of each block takes its buffer (on a CPU device,
    without a copy), the others a copy of their own, so that no two devices
    share a buffer."""
    given: set[Bounds] = set()

    def own(bounds: Bounds) -> np.ndarray:
        block = blocks[bounds]
        if bounds in given:
            return _copy(block)
        given.add(bounds)
        return block

    if not sharding.is_fully_replicated or len(where) == 1:
        # One batched placement (`make_array_from_callback` asks for the
        # devices' blocks in the order of `where`).
        return jax.make_array_from_callback(
            shape, sharding, lambda index: own(_bounds(index, shape))
        )
    # `make_array_from_callback` asks once here, and would give every device
    # that one buffer. A small block goes in a buffer that no device takes in
    # place (off the alignment): one batched placement copies it to each.
    whole = blocks[next(iter(where.values()))]
    if whole.nbytes < _SMALL:
        return jax.make_array_from_callback(
            shape, sharding, lambda _: _copy(whole, offset=_OFF)
        )
    placed = jax.device_put(
        [own(bounds) for bounds in where.values()],
        [
            jax.sharding.SingleDeviceSharding(d, memory_kind=sharding.memory_kind)
            for d in where
        ],
        may_alias=True,
    )
    return jax.make_array_from_single_device_arrays(shape, sharding, placed)


def _bounds(index: Any, shape: tuple[int, ...]) -> Bounds:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
