"""t5x's partitioner family, rebuilt on `jax.jit` and eqshard's spec trees.

For code written around t5x's `partitioning` module (or fjformer's copy of it):
a `Partitioner` (`_partitioner.py`) holds a mesh (t5x's hardware-aware default
ones come from `_topology.py`) and logical axis rules (by default t5x's standard
tables). `partition(fn, in_specs, out_specs)` turns the logical names of its
arguments into specs once and compiles `fn` as a `PartitionedFn`
(`_partitioned.py`, on the transforms' `JitFunction`); its options are checked
by `_config.py`; `move_to_devices` places trees through `shard`; `data_layout` and the
`LocalChunker` (`_chunking.py`) say which slice of the global batch each
process loads. The names are t5x's own (`get_mesh` here builds t5x's tile mesh;
it does not read the current mesh). Everything else, including the meshes of
everyday code ([`eqshard.create_mesh`][]), is at the root of `eqshard`.
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
