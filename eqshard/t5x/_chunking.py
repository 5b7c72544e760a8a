"""Data layout: which part of the data, and of every sharded array, a process holds.

This follows t5x: [`eqshard.t5x.LocalChunker`][] finds which chunk of a mesh a process
holds from `mesh.devices` and `device.process_index` alone, so every process's view
can be computed (and tested) from one process, and [`eqshard.t5x.DataLayout`][] says
which part of a global batch a process's input pipeline must read.
"""

import dataclasses
import math
from collections.abc import Sequence, Set
from types import MappingProxyType
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from .._mesh._current import mesh_repr
from .._move._process_blocks import not_one_slice, slice_order, why_no_order
from .._typing import typecheck


@dataclasses.dataclass(frozen=True)
class LocalChunkInfo:
    """The part of a global array that one process's devices hold.

    **Fields:**

    - `slice`: one `slice` per dimension of the array; `slice(None)` for
      dimensions that are not sharded.
    - `replica_id`: the index of this process among the processes that hold the
      same slice (0 for one of them: the one that should write it to a checkpoint).
    """

    slice: tuple[slice, ...]
    replica_id: int


@dataclasses.dataclass(frozen=True)
class DataLayout:
    """How the global batch is split between processes.

    **Fields:**

    - `batch_size`: the global batch size.
    - `shard_id`: which shard of the batch this process loads, in
      `range(num_shards)`.
    - `num_shards`: how many distinct shards the batch is split into (processes
      that hold replicas of the same data share a shard).
    - `is_first_host_in_replica_set`: whether this process is the first of those
      that load the same shard.
    """

    batch_size: int | None
    shard_id: int
    num_shards: int
    is_first_host_in_replica_set: bool


def _axes_tuple(
    axes: Any,
    mesh: Mesh,
    caller: str,
    *,
    ordered: bool,
) -> tuple[str, ...]:
    """`axes` (`None`, a name, or a sequence or set of names) as a tuple of mesh
    axis names, checked against `mesh`. `Any`: checking the names is its job."""
    if axes is None:
        return ()
    if isinstance(axes, str):
        axes = (axes,)
    elif isinstance(axes, Set) and ordered and len(axes) > 1:
        raise TypeError(
            f"eqshard.{caller}: got the set {set(axes)!r}, whose order is undefined; "
            "the shard id depends on the order of the mesh axes. Pass a tuple, "
            "major axis first, e.g. ('replica', 'data')."
        )
    out = tuple(axes)
    for axis in out:
        if not isinstance(axis, str):
            raise TypeError(
                f"eqshard.{caller}: mesh axes must be strings, got {axis!r} (a "
                f"{type(axis).__name__}) in {axes!r}."
            )
    unknown = [axis for axis in out if axis not in mesh.shape]
    if unknown:
        raise ValueError(
            f"eqshard.{caller}: {', '.join(map(repr, unknown))} "
            f"{'is not an axis' if len(unknown) == 1 else 'are not axes'} of the "
            f"mesh {mesh_repr(mesh)}. Use the mesh's axis names."
        )
    return out


class LocalChunker:
    """Which chunk of the mesh, and so of every sharded array, a process holds.

    A process's devices form a block of the mesh. Along each mesh axis, the block
    covers `mesh.shape[axis] // num_chunks[axis]` devices, and is chunk
    `chunk_ids[axis]` of `num_chunks[axis]` along that axis. Everything is derived
    from `mesh.devices` and each device's `process_index`, so the view of any
    process can be computed from one process, and meshes of stand-in device
    objects (anything with a `process_index`) work too. These are t5x's
    `LocalChunker` semantics, extended to dimensions sharded over several mesh axes.

    **Arguments:**

    - `mesh`: a `jax.sharding.Mesh`.
    - `process_index`: the process to describe; defaults to `jax.process_index()`.

    **Attributes:**

    - `mesh`, `process_index`: as given.
    - `mesh_axes`: the mesh's axis names, in order.
    - `num_chunks`, `chunk_ids`: read-only mappings from each mesh axis to the
      number of chunks along it, and to this process's chunk along it.

    **Raises:**

    `ValueError` if the process has no devices in the mesh, or if its devices do
    not form a block that tiles the mesh (the message shows the block).

    !!! Example

        ```python
        @dataclasses.dataclass(frozen=True)
        class Device:  # a stand-in for a device of a 4-process run
            id: int
            process_index: int

        # 4 processes of 2 devices; process p holds row p of a (4, 2) mesh.
        devices = np.array([Device(i, i // 2) for i in range(8)]).reshape(4, 2)
        mesh = jax.sharding.Mesh(devices, ("data", "model"))
        chunker = eqshard.t5x.LocalChunker(mesh, process_index=2)
        dict(chunker.num_chunks)  # {"data": 4, "model": 1}
        chunker.get_shard_id("data")  # 2
        info = chunker.get_local_chunk_info((8, 6), ("data", None))
        info.slice  # (slice(4, 6), slice(None))
        ```
    """

    @typecheck
    def __init__(self, mesh: Mesh, *, process_index: int | None = None):
        if process_index is None:
            process_index = jax.process_index()
        devices = np.asarray(mesh.devices)
        owners = np.array(
            [device.process_index for device in devices.flat], dtype=np.int64
        ).reshape(devices.shape)
        local = np.argwhere(owners == process_index)
        if not len(local):
            raise ValueError(
                f"eqshard.t5x.LocalChunker: process {process_index} has no devices in "
                f"the mesh {mesh_repr(mesh)}; its devices belong to processes "
                f"{sorted(set(owners.ravel().tolist()))}."
            )
        low = local.min(axis=0)
        extent = local.max(axis=0) + 1 - low
        names = tuple(mesh.axis_names)
        block = {name: int(size) for name, size in zip(names, extent, strict=True)}
        if math.prod(block.values()) != len(local):
            raise ValueError(
                f"eqshard.t5x.LocalChunker: the {len(local)} devices of process "
                f"{process_index} do not form a block of the mesh "
                f"{mesh_repr(mesh)}: they span {block} devices along its axes, "
                "which also holds devices of other processes. Arrange the mesh so "
                "each process's devices are contiguous (as eqshard.create_mesh and "
                "eqshard.t5x.default_mesh do)."
            )
        num_chunks, chunk_ids = {}, {}
        for name, start, size in zip(names, low, extent, strict=True):
            total = mesh.shape[name]
            if total % size or start % size:
                raise ValueError(
                    f"eqshard.t5x.LocalChunker: the devices of process {process_index} "
                    f"span {int(size)} devices from position {int(start)} along mesh "
                    f"axis {name!r} (size {total}), which does not tile that axis "
                    f"into equal chunks (mesh {mesh_repr(mesh)}). Give every "
                    "process the same number of devices along each axis."
                )
            num_chunks[name] = total // int(size)
            chunk_ids[name] = int(start) // int(size)
        self.mesh = mesh
        self.process_index = process_index
        self.mesh_axes = names
        self.num_chunks = MappingProxyType(num_chunks)
        self.chunk_ids = MappingProxyType(chunk_ids)

    def __repr__(self) -> str:
        return (
            f"LocalChunker(process_index={self.process_index}, "
            f"num_chunks={dict(self.num_chunks)}, chunk_ids={dict(self.chunk_ids)})"
        )

    def _mixed_radix(self, axes: Sequence[str]) -> int:
        index = 0
        for axis in axes:
            index = index * self.num_chunks[axis] + self.chunk_ids[axis]
        return index

    @typecheck
    def get_shard_id(
        self, sharded_mesh_axes: str | Sequence[str] | Set[str] | None
    ) -> int:
        """This process's index along the given mesh axes.

        The chunk ids along `sharded_mesh_axes` read as one number, the first axis
        most significant: with 2 chunks along `'replica'` and 2 along `'data'`, the
        process at `('replica': 1, 'data': 0)` has shard id 2.

        **Arguments:**

        - `sharded_mesh_axes`: a mesh axis name or a sequence of them, major axis
          first (a set only of one axis); `None` or `()` gives 0.

        **Returns:**

        An int in `range(prod(num_chunks[axis] for axis in sharded_mesh_axes))`.

        **Raises:**

        `ValueError` naming an axis the mesh lacks; `TypeError` for a set of
        several axes (whose order is undefined).

        !!! Example

            ```python
            chunker.get_shard_id(("replica", "data"))
            ```
        """
        axes = _axes_tuple(
            sharded_mesh_axes, self.mesh, "t5x.LocalChunker.get_shard_id", ordered=True
        )
        return self._mixed_radix(axes)

    @typecheck
    def get_replica_id(
        self, sharded_mesh_axes: str | Sequence[str] | Set[str] | None
    ) -> int:
        """This process's index along the mesh axes *not* given.

        An array sharded over `sharded_mesh_axes` is replicated over the other
        axes; the replica id tells apart the processes that hold the same part of
        it. The chunk ids along the other axes, in mesh order, read as one number.

        **Arguments:**

        - `sharded_mesh_axes`: a mesh axis name, or a sequence or set of them.

        **Returns:**

        An int; 0 for exactly one of the processes holding each part.

        **Raises:**

        `ValueError` naming an axis the mesh lacks.

        !!! Example

            ```python
            chunker.get_replica_id("data")  # index along 'model'
            ```
        """
        axes = _axes_tuple(
            sharded_mesh_axes,
            self.mesh,
            "t5x.LocalChunker.get_replica_id",
            ordered=False,
        )
        return self._mixed_radix([axis for axis in self.mesh_axes if axis not in axes])

    @typecheck
    def get_local_chunk_info(
        self,
        global_shape: Sequence[int],
        mesh_axes: Sequence[Any] | PartitionSpec,
    ) -> LocalChunkInfo:
        """The slice of a global array that this process's devices hold.

        **Arguments:**

        - `global_shape`: the shape of the global array.
        - `mesh_axes`: a `PartitionSpec`, or a sequence with one entry per leading
          dimension: `None`, a mesh axis name, or a tuple of mesh axis names for a
          dimension sharded over several axes (major first, as in a
          `PartitionSpec`).

        **Returns:**

        A [`eqshard.t5x.LocalChunkInfo`][]: the slice (`slice(None)` for unsharded
        dimensions) and the replica id among processes holding the same slice.

        **Raises:**

        - `ValueError` for an unknown or repeated mesh axis, more entries than
          dimensions, a dimension its mesh axes do not divide, or a dimension over
          several mesh axes whose local part is not one slice (the message says
          which order of axes would make it one).
        - `TypeError` for an entry of another type.

        !!! Example

            ```python
            info = chunker.get_local_chunk_info((8, 6), ("data", None))
            local_batch = global_batch[info.slice]
            ```
        """
        caller = "t5x.LocalChunker.get_local_chunk_info"
        shape = tuple(int(size) for size in global_shape)
        entries = tuple(mesh_axes)
        if len(entries) > len(shape):
            raise ValueError(
                f"eqshard.{caller}: `mesh_axes` {entries!r} has {len(entries)} "
                f"entries but the array has rank {len(shape)} (shape {shape})."
            )
        slices = [slice(None)] * len(shape)
        sharded: list[str] = []
        for dim, entry in enumerate(entries):
            if not (entry is None or isinstance(entry, str | tuple | list)):
                raise TypeError(
                    f"eqshard.{caller}: entry {dim} of `mesh_axes` is {entry!r} (a "
                    f"{type(entry).__name__}); use None, a mesh axis name, or a "
                    "tuple of them."
                )
            axes = _axes_tuple(entry, self.mesh, caller, ordered=True)
            if not axes:
                continue
            repeated = [axis for axis in axes if axis in sharded]
            if repeated or len(set(axes)) != len(axes):
                raise ValueError(
                    f"eqshard.{caller}: mesh axis {(repeated or list(axes))[0]!r} "
                    f"shards more than one dimension in {entries!r}; a mesh axis "
                    "can shard one dimension."
                )
            devices = math.prod(self.mesh.shape[axis] for axis in axes)
            if shape[dim] % devices:
                raise ValueError(
                    f"eqshard.{caller}: dimension {dim} (size {shape[dim]}) of shape "
                    f"{shape} is not divisible by {entry!r} (size {devices}) on "
                    f"mesh {mesh_repr(self.mesh)}."
                )
            problem = not_one_slice(self.mesh, axes, self.process_index)
            if problem is not None:
                order = slice_order(self.mesh, axes, self.process_index)
                fix = (
                    f"No order of the axes does: "
                    f"{why_no_order(self.mesh, axes, self.process_index)}."
                    if order is None
                    else f"Order the axes as {order!r}: those where each process "
                    "holds one device first, those it holds whole last."
                )
                raise ValueError(
                    f"eqshard.{caller}: the dimension sharded over {axes!r} (in "
                    f"{entries!r}) is split so that {problem}. {fix}"
                )
            chunks = math.prod(self.num_chunks[axis] for axis in axes)
            size = shape[dim] // chunks
            index = self._mixed_radix(axes)
            slices[dim] = slice(index * size, (index + 1) * size)
            sharded.extend(axes)
        return LocalChunkInfo(tuple(slices), self.get_replica_id(sharded))
