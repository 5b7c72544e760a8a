"""t5x's partitioner family, rebuilt on `jax.jit` and eqshard's spec trees.

For code written around t5x's `partitioning` module (or fjformer's copy of it):
the `Partitioner` and the functions it compiles, the data layout of each process,
t5x's logical axis rules, and t5x's hardware-aware default meshes. The names are
t5x's own (`get_mesh` here builds t5x's tile mesh; it does not read the current
mesh). Everything else, including the meshes of everyday code
([`eqshard.create_mesh`][]), is at the root of `eqshard`.
"""

from .._spectree._logical_convert import (
    standard_logical_axis_rules as standard_logical_axis_rules,
)
from ._chunking import (
    DataLayout as DataLayout,
    LocalChunker as LocalChunker,
    LocalChunkInfo as LocalChunkInfo,
)
from ._partitioned import PartitionedFn as PartitionedFn
from ._partitioner import Partitioner as Partitioner
from ._topology import (
    bounds_from_last_device as bounds_from_last_device,
    default_mesh as default_mesh,
    get_coords as get_coords,
    get_cpu_mesh as get_cpu_mesh,
    get_gpu_mesh as get_gpu_mesh,
    get_mesh as get_mesh,
    HardwareMesh as HardwareMesh,
)


__all__ = [
    "Partitioner",
    "PartitionedFn",
    "DataLayout",
    "LocalChunker",
    "LocalChunkInfo",
    "standard_logical_axis_rules",
    "default_mesh",
    "get_mesh",
    "get_cpu_mesh",
    "get_gpu_mesh",
    "get_coords",
    "bounds_from_last_device",
    "HardwareMesh",
]
