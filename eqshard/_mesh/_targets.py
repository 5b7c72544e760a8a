"""Compile-only devices of hardware this machine does not have: TPU slices
through `libtpu` (`eqshard[tpu]`) and NVIDIA GPUs through JAX's CUDA plugin
(`eqshard[gpu]`), named as users name them (`"v5p-1024"`, `"v5e:2x4"`,
`"h100:8x8"`). Programs compiled for them are the real compiler's; nothing can
run on them. `target_devices` is the one entry; `is_compile_only` tells a
target's devices (their client's runtime type),
`device_memory` the memory of one, `compiler_versions` what compiles for it."""

import contextlib
import dataclasses
import itertools
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from typing import Any

import jax
from jax.core import Tracer
from jax.sharding import AbstractMesh, Mesh


_GiB = 1 << 30

# One builder per kind of message.


def _target_error(caller: str, target: str, problem: str) -> ValueError:
    """A target that cannot be made, and what to do."""
    return ValueError(f"eqshard.{caller}: target={target!r}: {problem}")


def _names_known() -> str:
    return (
        "TPU topologies such as 'v5e:2x4', 'v5p:8x8x8', 'v4:4x4x4', 'v6e:16x16'; "
        "Cloud TPU names such as 'v5p-1024', 'v4-128', 'v5litepod-256', 'v5e-8', "
        f"'v6e-256'; GPUs {', '.join(map(repr, GPUS))} with an optional "
        "':HOSTSxGPUS' (default one host of 8)"
    )


# NVIDIA GPUs: the `GpuTargetConfig` fields that the installed jaxlib parses, as
# XLA's target specs (`xla/backends/gpu/target_config/specs/`) give them.


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One GPU model's target spec."""

    name: str  # XLA's device description, which becomes the devices' device_kind
    core_count: int
    fpus_per_core: int
    shared_memory_per_core: int
    shared_memory_per_block_optin: int
    memory_bandwidth: int
    l2_cache_size: int
    clock_rate_ghz: float
    device_memory_size: int
    compute_capability: int

    def config(self) -> str:
        """The `GpuTargetConfig` text proto `get_topology_desc` takes."""
        return (
            "gpu_device_info {\n"
            "  threads_per_block_limit: 1024 threads_per_warp: 32\n"
            "  shared_memory_per_block: 49152 threads_per_core_limit: 2048\n"
            f"  shared_memory_per_core: {self.shared_memory_per_core}\n"
            f"  core_count: {self.core_count} fpus_per_core: {self.fpus_per_core}\n"
            "  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535\n"
            "  block_dim_limit_z: 65535\n"
            f"  memory_bandwidth: {self.memory_bandwidth}\n"
            f"  l2_cache_size: {self.l2_cache_size}\n"
            f"  clock_rate_ghz: {self.clock_rate_ghz}\n"
            f"  device_memory_size: {self.device_memory_size}\n"
            "  shared_memory_per_block_optin: "
            f"{self.shared_memory_per_block_optin}\n"
            f"  cuda_compute_capability {{ major: {self.compute_capability} }}\n"
            "  registers_per_core_limit: 65536 registers_per_block_limit: 65536\n"
            "}\n"
            'platform_name: "CUDA"\n'
            "dnn_version_info { major: 9 minor: 8 }\n"
            "runtime_version { major: 12 minor: 8 }\n"
            f'device_description_str: "{self.name}"\n'
        )


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        "NVIDIA H100 80GB HBM3", 132, 128, 233472, 232448,
        3352320000000, 52428800, 1.98, 84942979072, 9,
    ),
    "h200": GpuSpec(
        "NVIDIA H200 141GB HBM3e", 132, 128, 233472, 232448,
        4800000000000, 52428800, 1.98, 151397597184, 9,
    ),
    "a100-40g": GpuSpec(
        "NVIDIA A100-SXM4-40GB", 108, 64, 167936, 166912,
        1555200000000, 41943040, 1.41, 42331013120, 8,
    ),
    "a100-80g": GpuSpec(
        "NVIDIA A100-SXM4-80GB", 108, 64, 167936, 166912,
        2039040000000, 41943040, 1.41, 85100068864, 8,
    ),
    "b200": GpuSpec(
        "NVIDIA B200", 148, 128, 233472, 232448,
        7672320000000, 132644864, 1.965, 191514411008, 10,
    ),
}  # fmt: skip

# JAX preallocates this fraction of a GPU's memory unless told otherwise.
GPU_FRACTION = 0.75

# TPUs: HBM per JAX device (one device per chip; a v4 or v5p chip is one
# "megacore" device of two TensorCores), by the devices' `device_kind`.
# What libtpu allows a program ("exceeds available HBM (15.75G)"; libtpu
# 0.0.42 keeps a further 2-4 MiB for itself), not the chip's HBM: a program
# compiles when XLA's peak (`peak_memory_in_bytes`) fits, even where its
# arguments and temporaries add up to more (measured on v5p).
TPU_MEMORY = {
    "TPU v4": int(30.75 * _GiB),
    "TPU v5 lite": int(15.75 * _GiB),
    "TPU v5": int(95.74 * _GiB),
    "TPU v6 lite": int(31.25 * _GiB),
}

# Cloud TPU accelerator names: the generation as libtpu spells it, whether N
# counts TensorCores (two per chip) or chips, and the topology's rank.
_CLOUD = {
    "v4": ("v4", True, 3),
    "v5p": ("v5p", True, 3),
    "v5litepod": ("v5e", False, 2),
    "v5e": ("v5e", False, 2),
    "v6e": ("v6e", False, 2),
}
_MAX_CHIPS = 1 << 13
# The rank of each generation's topology (a 2-D torus, or 3-D).
_RANKS = {"v4": 3, "v5p": 3, "v5e": 2, "v6e": 2}


def _cloud_topology(chips: int, rank: int) -> tuple[int, ...] | None:
    """Cloud TPU's slice shape of `chips` chips: from 2x2(x1), double the
    smallest dimension (the last of equals) until there are enough."""
    if rank == 2 and chips == 1:
        return (1, 1)
    dims = [2, 2] if rank == 2 else [2, 2, 1]
    while math.prod(dims) < chips:
        smallest = min(dims)
        i = max(j for j, d in enumerate(dims) if d == smallest)
        dims[i] *= 2
    return tuple(dims) if math.prod(dims) == chips else None


@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed target name."""

    name: str
    platform: str  # "tpu" or "cuda"
    topology: str  # libtpu's topology name, or the GPU's "slices x hosts x gpus"
    gpu: str = ""  # the key of `GPUS` for a GPU target


def _gpu_target(caller: str, target: str, gpu: str, hosts: str) -> Target:
    shape = re.fullmatch(r"(\d+)x(\d+)", hosts) if hosts else None
    if hosts and (shape is None or 0 in map(int, shape.groups())):
        raise _target_error(
            caller, target, "write a GPU target as 'h100' (one host of 8) or "
            "'h100:HOSTSxGPUS' such as 'h100:8x8'."
        )  # fmt: skip
    n_hosts, per_host = map(int, shape.groups()) if shape else (1, 8)
    if n_hosts * per_host > _MAX_CHIPS:
        raise _target_error(
            caller, target, f"{n_hosts} hosts of {per_host} GPUs are "
            f"{n_hosts * per_host} devices, more than the {_MAX_CHIPS} a target "
            "may have; name fewer hosts."
        )  # fmt: skip
    return Target(target, "cuda", f"1x{n_hosts}x{per_host}", gpu)


def _tpu_topology(caller: str, target: str, text: str) -> Target:
    generation, _, shape = text.partition(":")
    dims = [int(d) for d in shape.split("x")]
    rank = _RANKS[generation]
    if len(dims) != rank:
        example = "2x2x1" if rank == 3 else "2x4"
        raise _target_error(
            caller, target, f"a {generation} slice is a {rank}-D topology, not "
            f"{len(dims)}-D; write {rank} sizes such as '{generation}:{example}'."
        )  # fmt: skip
    if 0 in dims or math.prod(dims) > _MAX_CHIPS:
        raise _target_error(
            caller, target, f"a slice of {math.prod(dims)} chips: give sizes of "
            f"1 or more, at most {_MAX_CHIPS} chips in all."
        )  # fmt: skip
    return Target(target, "tpu", text)


def parse_target(caller: str, target: str) -> Target:
    """The hardware `target` names, or a `ValueError` listing the names known."""
    text = target.strip().lower()
    gpu, _, hosts = text.partition(":")
    if gpu in GPUS:
        return _gpu_target(caller, target, gpu, hosts)
    if gpu == "a100":
        raise _target_error(
            caller, target, "an A100 has 40 or 80 GB; name it 'a100-40g' or "
            "'a100-80g'."
        )  # fmt: skip
    if re.fullmatch(r"v(4|5e|5p|6e):\d+(x\d+)*", text):
        return _tpu_topology(caller, target, text)
    cloud = re.fullmatch(r"(v4|v5p|v5litepod|v5e|v6e)-(\d+)", text)
    if cloud is not None:
        generation, cores, rank = _CLOUD[cloud.group(1)]
        count = int(cloud.group(2))
        chips = count // 2 if cores else count
        dims = _cloud_topology(chips, rank) if 0 < chips <= _MAX_CHIPS else None
        if dims is None or (cores and count % 2):
            unit = "TensorCores (two per chip)" if cores else "chips"
            raise _target_error(
                caller, target, f"{cloud.group(1)}-N counts {unit}; N={count} "
                "is not a Cloud TPU slice size. Use a power of two such as "
                f"{cloud.group(1)}-{8 if cores else 4}, or a topology such as "
                f"'{generation}:{'2x2x1' if rank == 3 else '2x4'}'."
            )  # fmt: skip
        return Target(target, "tpu", f"{generation}:{'x'.join(map(str, dims))}")
    raise _target_error(caller, target, f"unknown name. Known: {_names_known()}.")


def _missing_extra(caller: str, target: str, extra: str, why: str) -> ImportError:
    return ImportError(
        f"eqshard.{caller}: target={target!r} needs {why}; install it with "
        f'`pip install "eqshard[{extra}]"`.'
    )


@contextlib.contextmanager
def _stderr_into(sink: Any) -> Iterator[None]:
    """Send what this process writes to file descriptor 2 (C++ logs included)
    to the file `sink` meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _quietly(make: Callable[[], Any]) -> Any:
    """`make()`, with what it writes to stderr shown only if it raises: libtpu
    starts with warnings about the cloud metadata and worker hostnames that a
    compile-only use has none of (`E0000 ... unexpected worker hostname`,
    `WARNING: could not determine TPU accelerator type`), which read as a
    failure."""
    with tempfile.TemporaryFile() as sink:
        try:
            with _stderr_into(sink):
                return make()
        except BaseException:
            sink.seek(0)
            sys.stderr.write(sink.read().decode(errors="replace"))
            sys.stderr.flush()
            raise


def _tpu_devices(caller: str, target: Target, num_slices: int) -> list[Any]:
    from jax.experimental import topologies

    try:
        metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        raise _missing_extra(caller, target.name, "tpu", "libtpu") from None
    # Compile-only use takes no TPU: several processes may load libtpu at once
    # (test workers, two notebooks), and there is no cloud metadata to ask.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    options: dict[str, Any] = {"num_slices": num_slices}
    if target.topology.startswith(("v4:", "v5p:")):
        options["chip_config_name"] = "megacore"  # one JAX device per chip
    dims = [int(d) for d in target.topology.partition(":")[2].split("x")]
    if len(dims) == 2 and min(dims) < 2:
        # libtpu's default host is 2x2 chips: a smaller slice (v5e-1, a single
        # chip) is one host of its own size.
        options["chips_per_host_bounds"] = [*dims, 1]
    try:
        topology = _quietly(
            lambda: topologies.get_topology_desc(
                topology_name=target.topology, platform="tpu", **options
            )
        )
    except Exception as error:  # libtpu's own error type and text
        raise _target_error(
            caller, target.name, f"libtpu cannot make the topology "
            f"{target.topology!r}: {error}"
        ) from error  # fmt: skip
    return list(topology.devices)


def _cuda_plugin() -> tuple[str, str] | None:
    """The installed CUDA plugin of JAX and its version, or `None`."""
    for name in ("jax-cuda12-plugin", "jax-cuda13-plugin"):
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _gpu_devices(caller: str, target: Target, num_slices: int) -> list[Any]:
    from jax.experimental import topologies

    if _cuda_plugin() is None:
        raise _missing_extra(
            caller, target.name, "gpu", "JAX's CUDA plugin (jax-cuda12-plugin)"
        )
    _, hosts, per_host = target.topology.split("x")
    gpu = GPUS[target.gpu]
    try:
        topology = topologies.get_topology_desc(
            platform="cuda",
            target_config=gpu.config(),
            topology=f"{num_slices}x{hosts}x{per_host}",
        )
    except NotImplementedError:
        # JAX started without a GPU and without skipping the CUDA plugin's
        # checks: the plugin is off for the rest of this process.
        raise _target_error(
            caller, target.name, "JAX's CUDA plugin is not available in this "
            "process: JAX started before the plugin was told there is no GPU. "
            "Set JAX_PLATFORMS=cpu (or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1) in the "
            "environment before `import jax` (JAX reads it when imported): in "
            "the shell (`JAX_PLATFORMS=cpu python train.py`), or with "
            "`os.environ['JAX_PLATFORMS'] = 'cpu'` at the top of the script or "
            "notebook, before any import of jax or eqshard (in a notebook, "
            "restart the kernel first); `python -m eqshard --target` does this "
            "itself."
        ) from None  # fmt: skip
    return list(topology.devices)


def target_devices(
    caller: str, target: str | Target, *, num_slices: int = 1
) -> list[Any]:
    """The compile-only devices of `target` (`num_slices` TPU slices over DCN)."""
    name = target if isinstance(target, str) else target.name
    if num_slices < 1:
        raise _target_error(caller, name, f"num_slices={num_slices}; give 1 or more.")
    parsed = parse_target(caller, target) if isinstance(target, str) else target
    if parsed.platform == "cuda" and num_slices != 1:
        hosts = parsed.topology.split("x")[1]
        raise _target_error(
            caller, name, f"num_slices={num_slices} is for TPU slices; a GPU "
            f"target's DCN units are its hosts: write '{parsed.gpu}:HOSTSxGPUS' "
            f"such as '{parsed.gpu}:{int(hosts) * num_slices}x8' and leave "
            "num_slices out."
        )  # fmt: skip
    if parsed.platform == "tpu":
        chips = math.prod(map(int, parsed.topology.partition(":")[2].split("x")))
        if chips * num_slices > _MAX_CHIPS * 8:
            raise _target_error(
                caller, name, f"num_slices={num_slices} of {chips} chips is more "
                f"than the {_MAX_CHIPS * 8} chips a target may have; give fewer."
            )  # fmt: skip
        return _tpu_devices(caller, parsed, num_slices)
    return _gpu_devices(caller, parsed, num_slices)


def is_compile_only(device: Any) -> bool:
    """Whether `device` exists only to compile for (a target's device)."""
    client = getattr(device, "client", None)
    return getattr(client, "runtime_type", None) == "compile_only_runtime"


def device_memory(devices: Sequence[Any]) -> int | None:
    """Memory per JAX device of a target's devices, or `None` when `devices`
    are not a known target's: HBM per TPU device, and for GPUs the spec's
    memory times the fraction JAX preallocates (0.75, or
    `XLA_PYTHON_CLIENT_MEM_FRACTION`)."""
    if not devices or not all(map(is_compile_only, devices)):
        return None
    kind = devices[0].device_kind
    if devices[0].platform == "tpu":
        size = TPU_MEMORY.get(kind)
        if size is not None and kind == "TPU v4" and devices[0].num_cores == 1:
            return size // 2  # a v4 TensorCore without megacore: half a chip
        return size
    for spec in GPUS.values():
        if spec.name == kind:
            return int(spec.device_memory_size * _memory_fraction())
    return None


def _memory_fraction() -> float:
    """The fraction of a GPU's memory JAX preallocates: 0.75, or
    `XLA_PYTHON_CLIENT_MEM_FRACTION`, checked to be one (`0 < f <= 1`)."""
    name = "XLA_PYTHON_CLIENT_MEM_FRACTION"
    text = os.environ.get(name)
    if text is None:
        return GPU_FRACTION
    try:
        fraction = float(text)
    except ValueError:
        fraction = math.nan
    if not 0 < fraction <= 1:  # NaN too
        raise ValueError(
            f"eqshard: the environment variable {name}={text!r} is not a fraction "
            "of a GPU's memory: give a number above 0 and at most 1 (JAX "
            f"preallocates {GPU_FRACTION} of it when the variable is unset), e.g. "
            f"{name}=0.9, or unset it."
        )
    return fraction


def _ceil(n: int, m: int) -> int:
    return -(-n // m) * m


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tpu_padded_bytes(shape: Sequence[int], itemsize: int) -> int:
    """The bytes a TPU lays an array of `shape` out in: its two most minor
    dimensions in tiles of (rows, 128) elements, rows a power of two from
    the packing (1 for 32-bit, 2 for 16-bit, 4 for 8-bit elements) to 8, in
    the order of dimensions that pads least, as XLA's layouts for TPU choose
    them (`f32[64,32]{0,1:T(8,128)}`); a vector in tiles of 128 to 1024
    elements. Measured with libtpu 0.0.42 on host and device arguments."""
    if itemsize not in (1, 2, 4):
        return math.prod(shape) * itemsize
    pack = 4 // itemsize
    if len(shape) <= 1:
        n = shape[0] if shape else 1
        return _ceil(n, min(max(_pow2(n), 128 * pack), 1024)) * itemsize
    best = None
    for minor, second in itertools.permutations(range(len(shape)), 2):
        rows = min(max(_pow2(shape[second]), pack), 8)
        rest = math.prod(d for k, d in enumerate(shape) if k not in (minor, second))
        n = rest * _ceil(shape[second], rows) * _ceil(shape[minor], 128)
        best = n if best is None else min(best, n)
    return int(best or 0) * itemsize


def pads_to_tiles(mesh: Any) -> bool:
    """Whether `mesh` is a TPU target's, whose arrays `tpu_padded_bytes` lays
    out."""
    first = next(iter(mesh.devices.flat), None) if isinstance(mesh, Mesh) else None
    return first is not None and is_compile_only(first) and first.platform == "tpu"


def compiler_versions(devices: Sequence[Any]) -> dict[str, str]:
    """The versions of JAX and of the compiler behind `devices`."""
    versions = {"jax": jax.__version__, "jaxlib": metadata.version("jaxlib")}
    platform = devices[0].platform if devices else "cpu"
    if platform == "tpu":
        try:
            versions["libtpu"] = metadata.version("libtpu")
        except metadata.PackageNotFoundError:
            pass
    elif platform in ("gpu", "cuda"):
        plugin = _cuda_plugin()
        if plugin is not None:
            versions[plugin[0]] = plugin[1]
    return versions


def compile_only_error(caller: str, mesh: Any) -> ValueError | None:
    """The message for placing data on, or running on, a target's mesh; `None`
    where `mesh` has devices that run."""
    if not isinstance(mesh, Mesh):  # no mesh, or an AbstractMesh: no devices
        return None
    first = next(iter(mesh.devices.flat), None)
    if first is None or not is_compile_only(first):
        return None
    return ValueError(
        f"eqshard.{caller}: the mesh {dict(mesh.shape)} is made of compile-only "
        f"devices ({first.device_kind}, from create_mesh(target=...)): nothing "
        "can be placed or run on them. Compile for them instead: "
        "eqshard.abstract(...) gives abstract arrays on the mesh, and "
        "eqshard.analyze_step, eqshard.search_layout or "
        "filter_jit(...).lower(...).compile() take them."
    )


def require_runnable(caller: str, mesh: Any) -> None:
    """Raise `compile_only_error` where `mesh` is a target's."""
    error = compile_only_error(caller, mesh)
    if error is not None:
        raise error


def require_traced_or_runnable(
    caller: str, mesh: Any, values: Any, *, abstract: bool = False
) -> None:
    """For a call that runs now unless it is traced (inside `jit`, for a
    compile): where none of `values` is a tracer, raise `compile_only_error`
    for a target's mesh and, with `abstract`, an error for an `AbstractMesh`
    (no devices to run on)."""
    if any(isinstance(leaf, Tracer) for leaf in jax.tree.leaves(values)):
        return
    require_runnable(caller, mesh)
    if abstract and isinstance(mesh, AbstractMesh):
        raise ValueError(
            f"eqshard.{caller}: mesh=AbstractMesh {dict(mesh.shape)} has no devices "
            "to run on: it only traces, for a compile. Call it inside a function "
            "that is compiled (`eqshard.filter_jit(f).lower(...).compile()`, "
            "`eqshard.analyze_step`), or give a `Mesh` of devices "
            "(`eqshard.create_mesh`)."
        )
