"""Stand-in devices for the topology and data-layout tests: frozen dataclasses with
only the attributes eqshard reads, so TPU pods and multi-process runs can be laid
out in one process without mocking JAX."""

import dataclasses

import numpy as np
from jax.sharding import AxisType, Mesh


@dataclasses.dataclass(frozen=True)
class HostDevice:
    """A CPU or GPU device of a (possibly multi-process) run: no coordinates. JAX
    numbers the CPU devices of process `p` from `2048 * p`."""

    id: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"


@dataclasses.dataclass(frozen=True)
class TpuDevice:
    """A TPU core: core `core_on_chip` of the chip at `coords`, in slice
    `slice_index` of a multi-slice job."""

    id: int
    process_index: int
    coords: tuple
    core_on_chip: int
    device_kind: str
    slice_index: int = 0
    platform: str = "tpu"


def host_mesh(owners: list, names: tuple[str, ...]) -> Mesh:
    """A mesh of `HostDevice`s; `owners[position]` is the process of each device."""
    owners_array = np.asarray(owners)
    devices = [HostDevice(i, int(p)) for i, p in enumerate(owners_array.flat)]
    array = np.array(devices, dtype=object).reshape(owners_array.shape)
    return Mesh(array, names, axis_types=(AxisType.Auto,) * len(names))
