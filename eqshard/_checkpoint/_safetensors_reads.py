"""Blocks of safetensors tensors read ahead, on the copying threads, into
buffers of their own.

`load_safetensors` reads each device's block of a tensor here: copied out of
the file, mapped for that tensor only, into a fresh 64-byte aligned buffer
(`aligned_empty`), which XLA's CPU client then takes as the device's buffer
without another copy (a block copied into memory NumPy allocated is copied
once more when placed). Nothing else holds or writes these buffers, and none
is the mapping itself, so a file changed or unmapped later changes no device's
data. The tensors of a group (`_AHEAD` bytes) are read on the copying threads
(`_move/_threads.py`: NumPy's copies release the GIL) while the calling thread
waits, then placed one by one.

Reads without a mapping (`os.preadv` into the same buffers) were measured
slower here: 36 ms of CPU for the blocks of a (4096, 4096) float32 tensor on
a (2, 4) mesh, against 25 ms for the mapped copy (the file in the page cache,
`benchmarks/bench_checkpoint.py`), so the mapping stays.
"""

import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .._internals.cpu import aligned_empty
from .._move._threads import spread
from ._safetensors_files import damaged_error


# A block's key: `(start, stop)` per dimension.
Key = tuple[tuple[int, int], ...]


def read_blocks(
    path: str, start: int, shape: tuple[int, ...], dtype: np.dtype, keys: Sequence[Key]
) -> dict[Key, np.ndarray | None]:
    """Each distinct block (`keys`) of the C-ordered tensor of `shape` and
    little-endian `dtype` at byte `start` of `path`, copied into an aligned
    buffer of its own; `None` for a block of size 0 (or of a 0-d tensor), which
    the caller makes. Raises `OSError` or `ValueError` if the file cannot be
    mapped there (changed since its header was read)."""
    keys = list(dict.fromkeys(keys))
    sized = [key for key in keys if shape and all(b > a for a, b in key)]
    out: dict[Key, np.ndarray | None] = {key: None for key in keys}
    if not sized:
        return out
    nbytes = math.prod(shape) * dtype.itemsize
    data = np.memmap(path, np.uint8, "r", offset=start, shape=(nbytes,))
    piece = data.view(dtype.newbyteorder("<")).reshape(shape)
    for key in sized:
        block = aligned_empty(tuple(b - a for a, b in key), dtype)
        np.copyto(block, piece[tuple(slice(a, b) for a, b in key)])
        out[key] = block
    return out


def keys_of(sharding: Any, shape: tuple[int, ...]) -> list[Key]:
    """The key of each block this process's devices hold."""
    return [
        tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        for index in sharding.addressable_devices_indices_map(shape).values()
    ]


# The bytes of the tensors read ahead at once (at least one tensor): placed on
# CPU devices, the buffers read are the devices' own; elsewhere this bounds what
# the host holds beside the device copies.
_AHEAD = 512 << 20

# What a job names: `(name, path, start, shape, stored dtype, target)`.
Job = tuple[str, str, int, tuple[int, ...], np.dtype, Any]


def read_ahead(jobs: Sequence[Job], caller: str) -> Iterator[dict[Key, Any]]:
    """For each job in order, its blocks on this process's devices
    (`read_blocks`), read on the copying threads a group of tensors at a time
    (`_AHEAD` bytes). On a big-endian host nothing is read ahead (every block is
    `None`). A file that ends early is eqshard's error, naming it."""
    group: list[Job] = []
    size = 0
    for job in jobs:
        nbytes = math.prod(job[3]) * job[4].itemsize
        if group and size + nbytes > _AHEAD:
            yield from _read_group(group, caller)
            group, size = [], 0
        group.append(job)
        size += nbytes
    yield from _read_group(group, caller)


def _read_group(group: list[Job], caller: str) -> list[dict[Key, Any]]:
    if sys.byteorder != "little":
        return [{} for _ in group]

    def read(indices: list[int]) -> list[dict[Key, Any]]:
        out = []
        for i in indices:
            _, path, start, shape, stored, target = group[i]
            keys = keys_of(target.sharding, shape)
            try:
                out.append(read_blocks(path, start, shape, stored, keys))
            except (OSError, ValueError) as error:  # changed since read
                raise damaged_error(caller, path, str(error), None) from None
        return out

    weights = [math.prod(job[3]) * job[4].itemsize for job in group]
    return spread(read, weights, pinned=[False] * len(group))
