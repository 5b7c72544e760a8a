"""Stand-in devices for the topology and data-layout tests: frozen dataclasses with
only the attributes eqshard reads, so TPU pods and multi-process runs can be laid
out in one process without mocking JAX."""

import dataclasses


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
