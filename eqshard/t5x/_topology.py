"""t5x's hardware-aware default meshes: ('data', 'model') over TPU pods, GPUs, CPUs.

Every function reads devices from its arguments (defaulting to JAX's) and only
looks at `id`, `process_index`, `platform`, `device_kind`, `coords`,
`core_on_chip` and `slice_index`, so fake device objects can stand in for a pod.
The arrangement of devices equals t5x's `partitioning` module for the same
devices; the differences are listed in the docstrings ("Differences from t5x").
"""

import collections
import math
from collections.abc import Sequence
from typing import Any, TypeAlias

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from .._mesh._build import create_hybrid_mesh, resolve_devices
from .._typing import typecheck


HardwareMesh: TypeAlias = tuple[int, ...]
"""A position or extent in the hardware mesh: `(x, y, z, core)` on TPU,
`(process, local device)` elsewhere."""

# t5x's model-parallel submesh for each partition count on TPU v2/v3 (two cores
# per chip, 2-D slices).
_V2_V3_SUBMESH = {
    1: (1, 1, 1, 1),
    2: (1, 1, 1, 2),
    4: (2, 1, 1, 2),
    8: (2, 2, 1, 2),
    16: (4, 2, 1, 2),
}


def _v4_submesh(num_partitions: int, bounds: HardwareMesh) -> HardwareMesh | None:
    """t5x's submesh on TPU v4 with megacore (one device per chip), if any."""
    x, _, z, _ = bounds
    if num_partitions == 16:
        options = [
            (z >= 16, (1, 1, 16, 1)),
            (x >= 8, (8, 2, 1, 1)),
            (x >= 4, (4, 4, 1, 1)),
        ]
        return next((s for ok, s in options if ok), (2, 2, 4, 1))
    four = (4, 1, 1, 1) if x >= 4 else (2, 2, 1, 1)
    eight = (1, 1, 8, 1) if z >= 8 else (4, 2, 1, 1)
    return {1: (1, 1, 1, 1), 2: (1, 2, 1, 1), 4: four, 8: eight}.get(num_partitions)


def _table_submesh(
    device_kind: str, num_partitions: int, bounds: HardwareMesh
) -> HardwareMesh | None:
    """The default submesh for a TPU kind and partition count, or `None`."""
    if device_kind in ("TPU v2", "TPU v3"):
        return _V2_V3_SUBMESH.get(num_partitions)
    if device_kind in ("TPU v4", "TPU v4 lite") and bounds[3] == 1:
        return _v4_submesh(num_partitions, bounds)
    return None


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _describe_platform(devices: Sequence[Any], bounds: HardwareMesh) -> str:
    """Platform, device kind and bounds, for messages."""
    last = devices[-1]
    return (
        f"platform {last.platform!r}, device kind {last.device_kind!r}, "
        f"hardware mesh bounds {bounds}"
    )


# Coordinates.


def _is_tpu(device: Any) -> bool:
    return hasattr(device, "coords")


def _host_coords(devices: Sequence[Any]) -> dict[Any, HardwareMesh]:
    """(process_index, rank of the device id within its process) for each device."""
    by_process = collections.defaultdict(list)
    for d in devices:
        by_process[d.process_index].append(d)
    return {
        d: (process, rank)
        for process, members in by_process.items()
        for rank, d in enumerate(sorted(members, key=lambda d: d.id))
    }


def _coords_table(devices: Sequence[Any]) -> dict[Any, HardwareMesh]:
    """`get_coords` for every device, computed together."""
    if all(_is_tpu(d) for d in devices):
        return {d: (*d.coords, d.core_on_chip) for d in devices}
    return _host_coords(devices)


def _platform_devices(device: Any, devices: Sequence[Any] | None) -> list[Any]:
    return list(jax.devices(device.platform) if devices is None else devices)


@typecheck
def get_coords(device: Any, *, devices: Sequence[Any] | None = None) -> HardwareMesh:
    """The position of a device in the hardware mesh.

    On TPU this is `(*device.coords, device.core_on_chip)`. Elsewhere it is
    `(process_index, local index)`, where the local index is the device's rank
    by `id` among the devices of its process.

    **Differences from t5x:** t5x's local index is `id % jax.local_device_count()`:
    the same on GPUs, but not for multi-process CPUs (ids `2048 * process + i`)
    with, say, 3 devices per process.

    **Arguments:**

    - `device`: a device (or any object with the attributes above).
    - `devices`: the devices it belongs to, used off TPU (default
      `jax.devices(device.platform)`).

    **Returns:**

    A tuple of ints.

    **Raises:**

    `ValueError` if off TPU the device is not in `devices`.

    !!! Example

        ```python
        eqshard.t5x.get_coords(jax.devices()[3])  # (0, 3) on 8 CPU devices
        ```
    """
    if _is_tpu(device):
        return (*device.coords, device.core_on_chip)
    table = _host_coords(_platform_devices(device, devices))
    if device not in table:
        raise ValueError(
            f"eqshard.t5x.get_coords: device {device} is not among the {len(table)} "
            "devices given; pass the device set it belongs to as devices=."
        )
    return table[device]


@typecheck
def bounds_from_last_device(
    last_device: Any, *, devices: Sequence[Any] | None = None
) -> HardwareMesh:
    """The extent of the hardware mesh whose highest corner is `last_device`.

    On TPU this is `coords + 1` and `core_on_chip + 1` of the device at the
    highest coordinates (the last of `jax.devices()`). Elsewhere it is
    `(number of processes, devices per process)` of `devices`, whatever the
    device.

    **Arguments:**

    - `last_device`: the device at the highest corner.
    - `devices`: the device set, used off TPU (default
      `jax.devices(last_device.platform)`).

    **Returns:**

    A tuple of ints.

    !!! Example

        ```python
        devices = jax.devices()  # 8 CPU devices, one process
        eqshard.t5x.bounds_from_last_device(devices[-1])  # (1, 8)
        ```
    """
    if _is_tpu(last_device):
        x, y, z = last_device.coords
        return x + 1, y + 1, z + 1, last_device.core_on_chip + 1
    devs = _platform_devices(last_device, devices)
    processes = collections.Counter(d.process_index for d in devs)
    return len(processes), processes[last_device.process_index]


def _place(
    caller: str, devices: Sequence[Any], coords: dict[Any, HardwareMesh]
) -> np.ndarray:
    """An object array of shape `bounds` with each device at its coordinates."""
    bounds = tuple(c + 1 for c in map(max, zip(*coords.values(), strict=True)))
    array = np.full(bounds, None, dtype=object)
    for d in devices:
        if array[coords[d]] is not None:
            raise ValueError(
                f"eqshard.{caller}: devices {array[coords[d]]} and {d} have the "
                f"same hardware coordinates {coords[d]}; pass each device once."
            )
        array[coords[d]] = d
    holes = [tuple(map(int, i)) for i in np.argwhere(array == None)]  # noqa: E711
    if holes:
        raise ValueError(
            f"eqshard.{caller}: the {len(devices)} devices do not fill the "
            f"hardware mesh {bounds} ({_describe_platform(devices, bounds)}); nothing "
            f"sits at {holes[:4]}. Pass every device of the slice (or of every "
            "process), with the same number of devices per process."
        )
    return array


def _mesh(array: np.ndarray) -> Mesh:
    return Mesh(array, ("data", "model"), axis_types=(AxisType.Auto,) * 2)


# Host tiling and the Z-major reordering of t5x's `get_mesh`.


def _z_major(
    array: np.ndarray,
    bounds: HardwareMesh,
    submesh: HardwareMesh,
    describe: str,
) -> tuple[np.ndarray, HardwareMesh, HardwareMesh] | None:
    """Reorder a 4-D TPU array so that Z is major in an X or Y plane, if needed.

    Returns `None` when the submesh does not call for it.
    """
    gx, gy, gz, gc = bounds
    mx, my, mz, mc = submesh
    if (mx == gx > 1 and my == mz == 1) or (mx == 1 and my == gy > 1 and mz == gz > 1):
        order = (0, 2, 1, 3)  # YZ plane becomes ZY
    elif (my == gy > 1 and mx == mz == 1) or (
        my == 1 and mx == gx > 1 and mz == gz > 1
    ):
        order = (2, 1, 0, 3)  # XZ plane becomes ZX
    else:
        return None
    if mc != gc:
        fixed = tuple(submesh[:3]) + (gc,)
        raise ValueError(
            f"eqshard.t5x.get_mesh: the model-parallel submesh {submesh} spans all of "
            f"X or Y ({describe}), so its devices are laid out Z-major, which "
            f"needs every core of a chip: the core entry must be {gc}, not {mc}. "
            f"Use {fixed}."
        )
    array = array.transpose(order)
    return array, tuple(bounds[i] for i in order), tuple(submesh[i] for i in order)


def _tile_by_host(
    array: np.ndarray,
    bounds: HardwareMesh,
    submesh: HardwareMesh,
    local: HardwareMesh,
    describe: str,
) -> np.ndarray:
    """Arrange `array` as (data hosts, data devices, model hosts, model devices)."""
    split = []
    for g, m, l in zip(bounds, submesh, local, strict=True):
        if (m >= l and m % l) or (m < l and l % m):
            raise ValueError(
                f"eqshard.t5x.get_mesh: to tile the mesh by hosts, each entry of the "
                f"model-parallel submesh {submesh} must be a factor or a multiple "
                f"of the per-host hardware mesh {local} ({describe}); {m} and {l} "
                "are neither. Change the submesh, or pass "
                "tile_by_host_if_needed=False."
            )
        # Each dimension splits into data-hosts, data-devices, model-hosts and
        # model-devices parts.
        split.append((g // m, 1, m // l, l) if m >= l else (g // l, l // m, 1, m))
    n = len(bounds)
    array = array.reshape([s for part in split for s in part])
    return array.transpose([4 * i + k for k in range(4) for i in range(n)])


def _check_submesh(
    submesh: HardwareMesh, bounds: HardwareMesh, local: HardwareMesh, describe: str
) -> None:
    """Raise unless the submesh and the per-host mesh both divide the bounds."""
    names = "(x, y, z, core)" if len(bounds) == 4 else "(processes, local devices)"
    if len(submesh) != len(bounds) or min(submesh) < 1:
        raise ValueError(
            f"eqshard.t5x.get_mesh: the model-parallel submesh {submesh} must have "
            f"{len(bounds)} positive entries {names} for {describe}."
        )
    if any(g % m for g, m in zip(bounds, submesh, strict=True)):
        options = ", ".join(f"{_divisors(g)}" for g in bounds)
        raise ValueError(
            f"eqshard.t5x.get_mesh: each entry of the model-parallel submesh {submesh} "
            f"must divide the hardware mesh bounds ({describe}); the entries "
            f"{names} can be {options}."
        )
    if any(g % l for g, l in zip(bounds, local, strict=True)):
        raise ValueError(
            f"eqshard.t5x.get_mesh: the local devices span the hardware mesh {local}, "
            f"which does not tile the bounds ({describe}); pass the devices of "
            "one process as local_devices=."
        )


@typecheck
def get_mesh(
    model_parallel_submesh: Sequence[int],
    *,
    devices: Sequence[Any] | None = None,
    local_devices: Sequence[Any] | None = None,
    tile_by_host_if_needed: bool = True,
    backend: str | None = None,
) -> Mesh:
    """A ('data', 'model') mesh whose model axis is a tile of the hardware mesh.

    Each 'model' row is one copy of `model_parallel_submesh`, a block of the
    hardware mesh (`(x, y, z, core)` on TPU, `(processes, local devices)`
    elsewhere; see [`eqshard.t5x.get_coords`][]); 'data' runs over the copies. As in
    t5x, on a 4-D TPU mesh a submesh spanning a whole X or Y extent is laid out
    Z-major, and otherwise, if `tile_by_host_if_needed`, the devices are tiled
    by host so that each process holds contiguous blocks.

    **Differences from t5x:** the default `local_devices` are those of the
    process holding the device at the origin, where t5x takes process 0's (the
    same on real pods); off TPU the hardware mesh is as in
    [`eqshard.t5x.get_coords`][].

    **Arguments:**

    - `model_parallel_submesh`: the tile, one entry per hardware dimension,
      each dividing the bounds. Prefer cores first: `(1, 1, 1, 2)` over
      `(2, 1, 1, 1)`.
    - `devices`: all devices (default `jax.devices(backend)`).
    - `local_devices`: one process's devices (default: those of the process of
      the device at the origin).
    - `tile_by_host_if_needed`: tile the arrangement by host (see above).
    - `backend`: where to take devices from when `devices` is not given.

    **Returns:**

    A `jax.sharding.Mesh` with `Auto` axes ('data', 'model').

    **Raises:**

    `ValueError` naming the platform, device kind, bounds and submesh when the
    submesh has the wrong length, does not divide the bounds (the message lists
    the entries that would), cannot be tiled by host, or needs all cores for
    the Z-major layout; or when the devices do not fill the hardware mesh, or
    `local_devices` is empty or does not tile it.

    !!! Example

        ```python
        mesh = eqshard.t5x.get_mesh((1, 2))  # 8 CPU devices, one process
        dict(mesh.shape)  # {"data": 4, "model": 2}
        ```
    """
    devs = resolve_devices("t5x.get_mesh", devices, backend)
    submesh = tuple(model_parallel_submesh)
    coords = _coords_table(devs)
    ordered = sorted(devs, key=coords.__getitem__)
    bounds = bounds_from_last_device(ordered[-1], devices=devs)
    if local_devices is None:
        home = ordered[0].process_index
        local_devices = [d for d in devs if d.process_index == home]
    elif len(local_devices) == 0:
        raise ValueError(
            "eqshard.t5x.get_mesh: local_devices= is empty; pass the devices of one "
            "process, or leave it out to use those of the device at the origin."
        )
    if _is_tpu(ordered[-1]):
        local_coords = _coords_table(local_devices)
        local = bounds_from_last_device(
            max(local_devices, key=local_coords.__getitem__)
        )
    else:
        local = bounds  # As t5x: off TPU the bounds ignore the device.
    describe = _describe_platform(ordered, bounds)
    _check_submesh(submesh, bounds, local, describe)
    array = _place("t5x.get_mesh", devs, coords)
    tile = tile_by_host_if_needed
    if len(bounds) == 4:
        swapped = _z_major(array, bounds, submesh, describe)
        if swapped is not None:
            array, bounds, submesh = swapped
            tile = False
    if tile:
        array = _tile_by_host(array, bounds, submesh, local, describe)
    else:
        split = [s for g, m in zip(bounds, submesh, strict=True) for s in (g // m, m)]
        n = len(bounds)
        array = array.reshape(split).transpose(
            [*range(0, 2 * n, 2), *range(1, 2 * n, 2)]
        )
    return _mesh(array.reshape(-1, math.prod(submesh)))


def _per_process_count(caller: str, devices: Sequence[Any]) -> tuple[int, int]:
    """(processes, devices per process); raise if processes differ in size."""
    counts = collections.Counter(d.process_index for d in devices)
    if len(set(counts.values())) > 1:
        raise ValueError(
            f"eqshard.{caller}: processes hold different numbers of devices "
            f"{dict(sorted(counts.items()))}; pass the same number per process."
        )
    return len(counts), next(iter(counts.values()))


@typecheck
def get_cpu_mesh(*, devices: Sequence[Any] | None = None) -> Mesh:
    """The trivial ('data', 'model') mesh: processes x devices per process.

    Row `p` holds process `p`'s devices in `id` order. Used by
    [`eqshard.t5x.default_mesh`][] on CPU.

    **Arguments:**

    - `devices`: the devices (default `jax.devices()`).

    **Returns:**

    A `jax.sharding.Mesh` of shape `(processes, local devices)`.

    **Raises:**

    `ValueError` if processes hold different numbers of devices.

    !!! Example

        ```python
        mesh = eqshard.t5x.get_cpu_mesh()  # 8 CPU devices, one process
        dict(mesh.shape)  # {"data": 1, "model": 8}
        ```
    """
    devs = resolve_devices("t5x.get_cpu_mesh", devices, None)
    _per_process_count("t5x.get_cpu_mesh", devs)
    return _mesh(_place("t5x.get_cpu_mesh", devs, _host_coords(devs)))


@typecheck
def get_gpu_mesh(num_partitions: int, *, devices: Sequence[Any] | None = None) -> Mesh:
    """A ('data', 'model') mesh that keeps 'model' on NVLink where it can.

    With `L` devices per process and `P` processes, 'model' takes
    `min(num_partitions, L)` devices of one process and, when `num_partitions`
    is larger, that many processes; 'data' takes the rest (see
    [`eqshard.create_hybrid_mesh`][] with processes as the slow units).

    **Arguments:**

    - `num_partitions`: the size of the 'model' axis.
    - `devices`: the devices (default `jax.devices()`).

    **Returns:**

    A `jax.sharding.Mesh` of shape `(P * L / num_partitions, num_partitions)`.

    **Raises:**

    `ValueError` (listing the partition counts that work) unless
    `num_partitions` divides `L`, or is `L` times a divisor of `P`.

    !!! Example

        ```python
        mesh = eqshard.t5x.get_gpu_mesh(2, devices=jax.devices())  # 8 devices
        dict(mesh.shape)  # {"data": 4, "model": 2}
        ```
    """
    devs = resolve_devices("t5x.get_gpu_mesh", devices, None)
    processes, local = _per_process_count("t5x.get_gpu_mesh", devs)
    nvlink_mp = min(num_partitions, local)
    if (
        num_partitions < 1
        or local % nvlink_mp
        or num_partitions % nvlink_mp
        or (processes % (num_partitions // nvlink_mp))
    ):
        working = sorted(
            {*_divisors(local), *(local * k for k in _divisors(processes))}
        )
        raise ValueError(
            f"eqshard.t5x.get_gpu_mesh: cannot split {processes} process(es) of "
            f"{local} device(s) ({_describe_platform(devs, (processes, local))}) into "
            f"num_partitions={num_partitions}: it must divide {local}, or be "
            f"{local} times a divisor of {processes}. Use one of {working}."
        )
    dcn_mp = num_partitions // nvlink_mp
    array = mesh_utils.create_hybrid_device_mesh(
        (local // nvlink_mp, nvlink_mp),
        (processes // dcn_mp, dcn_mp),
        devs,
        process_is_granule=True,
    )
    return _mesh(array)


@typecheck
def default_mesh(
    num_partitions: int,
    model_parallel_submesh: Sequence[int] | None = None,
    *,
    devices: Sequence[Any] | None = None,
    local_devices: Sequence[Any] | None = None,
    backend: str | None = None,
    ici_mesh_shape: Sequence[int] | None = None,
    dcn_mesh_shape: Sequence[int] | None = None,
) -> Mesh:
    """t5x's default mesh for the hardware: ('data', 'model'), or
    ('replica', 'data', 'model') over several slices.

    In order: with `ici_mesh_shape` and `dcn_mesh_shape`, a multi-slice mesh
    from [`eqshard.create_hybrid_mesh`][]; with `model_parallel_submesh`,
    [`eqshard.t5x.get_mesh`][] of it; on CPU, [`eqshard.t5x.get_cpu_mesh`][] (which
    ignores `num_partitions`); on GPU, [`eqshard.t5x.get_gpu_mesh`][]; on TPU v2/v3
    and TPU v4 with megacore, the submesh t5x's tables give for 1, 2, 4, 8 or
    16 partitions.

    **Differences from t5x:** giving only one of `ici_mesh_shape` and
    `dcn_mesh_shape` is an error (t5x ignored it), and the slow units of a
    multi-slice mesh are processes when the devices have no slices. The
    platform, device kind and bounds are read from the device at the highest
    coordinates, where t5x reads the last of `jax.devices()` (the same device
    when the devices come in JAX's order), so their order does not matter.

    **Arguments:**

    - `num_partitions`: the size of the 'model' axis (ignored on CPU and with
      a submesh).
    - `model_parallel_submesh`: an explicit tile for [`eqshard.t5x.get_mesh`][].
    - `devices`, `local_devices`, `backend`: as for [`eqshard.t5x.get_mesh`][].
    - `ici_mesh_shape`, `dcn_mesh_shape`: three sizes each, for
      ('replica', 'data', 'model') inside and across slices.

    **Returns:**

    A `jax.sharding.Mesh` with `Auto` axes.

    **Raises:**

    `ValueError` naming platform, device kind, bounds and partitions when no
    table entry exists (listing the counts that work), and the errors of the
    functions above.

    !!! Example

        ```python
        mesh = eqshard.t5x.default_mesh(4)  # 8 CPU devices: num_partitions ignored
        dict(mesh.shape)  # {"data": 1, "model": 8}
        ```
    """
    devs = resolve_devices("t5x.default_mesh", devices, backend)
    if (ici_mesh_shape is None) != (dcn_mesh_shape is None):
        raise ValueError(
            "eqshard.t5x.default_mesh: give both ici_mesh_shape and dcn_mesh_shape "
            f"for a multi-slice mesh, or neither (got ici_mesh_shape="
            f"{ici_mesh_shape}, dcn_mesh_shape={dcn_mesh_shape})."
        )
    if ici_mesh_shape is not None and dcn_mesh_shape is not None:
        if len(ici_mesh_shape) != 3 or len(dcn_mesh_shape) != 3:
            raise ValueError(
                "eqshard.t5x.default_mesh: ici_mesh_shape and dcn_mesh_shape need "
                "three sizes each, for ('replica', 'data', 'model'); got "
                f"{tuple(ici_mesh_shape)} and {tuple(dcn_mesh_shape)}."
            )
        names = ("replica", "data", "model")
        return create_hybrid_mesh(ici_mesh_shape, dcn_mesh_shape, names, devices=devs)
    if model_parallel_submesh is not None:
        return get_mesh(
            model_parallel_submesh, devices=devs, local_devices=local_devices
        )
    coords = _coords_table(devs)
    last = max(devs, key=coords.__getitem__)
    if last.platform == "cpu":
        return get_cpu_mesh(devices=devs)
    if last.platform == "gpu":
        return get_gpu_mesh(num_partitions, devices=devs)
    bounds = bounds_from_last_device(last, devices=devs)
    submesh = _table_submesh(last.device_kind, num_partitions, bounds)
    if submesh is None:
        working = [
            n
            for n in _V2_V3_SUBMESH
            if (s := _table_submesh(last.device_kind, n, bounds)) is not None
            and not any(g % m for g, m in zip(bounds, s, strict=True))
        ]
        raise ValueError(
            f"eqshard.t5x.default_mesh: no default mesh for num_partitions="
            f"{num_partitions} on {_describe_platform([last], bounds)}. "
            + (f"num_partitions can be one of {working}, or " if working else "")
            + "pass model_parallel_submesh= explicitly, one entry per hardware "
            "dimension, each dividing the bounds."
        )
    return get_mesh(submesh, devices=devs, local_devices=local_devices)
