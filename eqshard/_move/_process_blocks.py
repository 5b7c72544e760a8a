"""Which blocks of a sharded dimension each process's devices hold.

A dimension split over some mesh axes (the first one major, as in a
`PartitionSpec`) is cut into one block per position along those axes, and each
device holds one block. This module answers, from `mesh.devices` and each
device's `process_index` alone (so for any process, from one process, and for
meshes of stand-in devices too):

- **Which blocks** each process's devices hold (`blocks_by_process`).
- **Whether that is one contiguous slice** per process, all of one size
  (`one_slice_each`, `not_one_slice`): what a process can read or write as one
  piece, such as a host-local block or t5x's local chunk.
- **Which axes span processes** (`spanning_axes`): those along which the devices
  belong to different processes.
- **Which order of the axes** would make it one slice per process
  (`slice_order`), or why none does (`why_no_order`).

Both [`eqshard.shard`][]'s host-local blocks (`_multiprocess.host_local_shape`) and
[`eqshard.t5x.LocalChunker`][] ask these questions here.
"""

import functools as ft
import math

import numpy as np
from jax.sharding import Mesh


# `((process_index, blocks), ...)`, by process, each `blocks` sorted.
Held = tuple[tuple[int, tuple[int, ...]], ...]


@ft.lru_cache(maxsize=256)
def blocks_by_process(mesh: Mesh, axes: tuple[str, ...]) -> Held:
    """For a dimension split over mesh `axes` (the first one major), the blocks of
    it that each process's devices hold: `((process_index, blocks), ...)`."""
    devices = np.asarray(mesh.devices)
    block = np.zeros(devices.shape, np.int64)
    for axis in axes:
        dim = mesh.axis_names.index(axis)
        coords = np.arange(devices.shape[dim]).reshape(
            [-1 if i == dim else 1 for i in range(devices.ndim)]
        )
        block = block * devices.shape[dim] + coords
    held: dict[int, set[int]] = {}
    for device, b in zip(
        devices.flat, np.broadcast_to(block, devices.shape).flat, strict=True
    ):
        held.setdefault(device.process_index, set()).add(int(b))
    return tuple((p, tuple(sorted(blocks))) for p, blocks in sorted(held.items()))


def _held(mesh: Mesh, axes: tuple[str, ...], process: int | None) -> Held:
    """`blocks_by_process`, of every process or only of `process`."""
    held = blocks_by_process(mesh, axes)
    return held if process is None else tuple(h for h in held if h[0] == process)


def _one_slice(blocks: tuple[int, ...], size: int) -> bool:
    """Whether `blocks` are one aligned run of `size` blocks."""
    return (
        len(blocks) == size
        and blocks[0] % size == 0
        and blocks == tuple(range(blocks[0], blocks[0] + size))
    )


def one_slice_each(held: Held) -> bool:
    """Whether every process holds one aligned run of blocks, all of one length."""
    size = len(held[0][1])
    return all(_one_slice(blocks, size) for _, blocks in held)


def not_one_slice(
    mesh: Mesh, axes: tuple[str, ...], process: int | None = None
) -> str | None:
    """`None` if the devices of every process (or only of `process`) hold one
    contiguous slice of a dimension split over `axes`, all of one size; otherwise
    what they hold instead, for the first process that does not."""
    held = _held(mesh, axes, process)
    size = len(held[0][1])
    for p, blocks in held:
        if _one_slice(blocks, size):
            continue
        total = math.prod(mesh.shape[a] for a in axes)
        return (
            f"process {p}'s devices hold blocks {list(blocks)} of {total}"
            f"{_spread(mesh, axes, p)}, not one contiguous slice"
        )
    return None


def _along(mesh: Mesh, axis: str, process: int | None) -> set[int]:
    """How many devices along `axis` the devices of each process (or `process`)
    cover."""
    return {len(blocks) for _, blocks in _held(mesh, (axis,), process)}


def _spread(mesh: Mesh, axes: tuple[str, ...], process: int) -> str:
    """Why `process`'s blocks are not one slice: after an axis where it holds
    several devices comes one it does not hold whole ("" if not so simple)."""
    spread = None
    for axis in axes:
        (count,) = _along(mesh, axis, process)
        if spread is not None and count < mesh.shape[axis]:
            return (
                f" (it holds {spread[1]} devices along {spread[0]!r} but only "
                f"{count} of the {mesh.shape[axis]} along {axis!r})"
            )
        if count > 1 and spread is None:
            spread = (axis, count)
    return ""


def spanning_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes along which the devices belong to different processes."""
    return tuple(
        axis
        for axis in mesh.axis_names
        if any(count < mesh.shape[axis] for count in _along(mesh, axis, None))
    )


def _rank(mesh: Mesh, axis: str, process: int | None) -> int:
    """0: every process (or `process`) holds one device along `axis`; 2: every
    device along it; 1: anything else."""
    counts = _along(mesh, axis, process)
    if counts == {1}:
        return 0
    return 2 if counts == {mesh.shape[axis]} else 1


def slice_order(
    mesh: Mesh, axes: tuple[str, ...], process: int | None = None
) -> tuple[str, ...] | None:
    """An order of `axes` that makes a dimension split over them one contiguous
    slice on every process (or on `process`): the axes where each process holds
    one device first, those it holds whole last. `None` if that order does not."""
    order = tuple(sorted(axes, key=lambda a: _rank(mesh, a, process)))
    return order if one_slice_each(_held(mesh, order, process)) else None


def why_no_order(mesh: Mesh, axes: tuple[str, ...], process: int | None = None) -> str:
    """Why no order of `axes` makes one slice per process (`slice_order` is
    `None`), and what would."""
    partial = tuple(a for a in axes if _rank(mesh, a, process) == 1)
    if len(partial) > 1:
        who = "the processes hold" if process is None else f"process {process} holds"
        return (
            f"{who} some but not all of the devices along each of {partial!r}. "
            "Shard this dimension over only one of them, or arrange the mesh so "
            "that each process holds one device or every device along each of "
            "these axes"
        )
    return (
        "the devices of each process do not form a block of the mesh. Arrange the "
        "mesh so each process's devices are contiguous (as eqshard.create_mesh and "
        "eqshard.t5x.default_mesh do)"
    )


def clear_cache() -> None:
    """Forgets the meshes this module has looked at."""
    blocks_by_process.cache_clear()
