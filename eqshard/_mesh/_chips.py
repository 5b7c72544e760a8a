"""What one TPU or GPU chip computes and moves per second, for timing a step
compiled for it: the dense peak FLOP/s per operand type, the HBM bandwidth, the
bandwidth of its links (TPU ICI per link one way, GPU NVLink per GPU one way)
and of the network between slices or hosts (DCN, InfiniBand), and a latency per
hop. `chip_of` finds the chip of a program's devices by their `device_kind`;
`Chip.peak` refuses an operand type the chip has no published figure for (fp8
on a TPU v4) rather than inventing one.

Sources, cited beside each number:

- [TPU]: Google Cloud TPU documentation, "System architecture" and the
  per-generation pages (https://cloud.google.com/tpu/docs/v4,
  .../v5e, .../v5p, .../v6e): peak bf16 and int8 compute per chip, HBM
  bandwidth, ICI bandwidth per chip, chips per host.
- [SB]: "How to Scale Your Model" (Austin et al., Google DeepMind, 2025,
  https://jax-ml.github.io/scaling-book/), part 2 "TPUs": ICI bandwidth per
  link one way (4.5e10 B/s v4 and v5e, 9e10 v5p and v6e), wraparound only on
  full-length axes, DCN bandwidth per host, and the cost of collectives on a
  torus (part 3).
- [H100], [H200], [B200], [A100]: NVIDIA's datasheets (H100 Tensor Core GPU
  datasheet, SXM5 column; H200 Tensor Core GPU product brief; DGX B200 /
  HGX B200 datasheet, per GPU; A100 Tensor Core GPU datasheet, SXM column):
  dense (not 2:4 sparse) Tensor Core peaks, HBM bandwidth, NVLink bandwidth
  (total both ways; halved here for one way), and the ConnectX NICs per GPU of
  the DGX systems (400 Gb/s NDR for DGX H100/H200/B200, 200 Gb/s HDR for DGX
  A100).
- [NCCL]: NCCL's own latency model (`src/graph/tuning.cc`: `baseLat`,
  `hwLat`), for the order of magnitude of a step's latency over NVLink and
  InfiniBand.

The latencies are orders of magnitude, not measurements: they matter only for
small messages.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any


_T = 1e12


@dataclasses.dataclass(frozen=True)
class Chip:
    """One chip's figures (all per JAX device: one per TPU chip, megacore on
    v4 and v5p, or one GPU).

    `peaks`: dense peak FLOP/s by operand type (`"bf16"`, `"fp8"`, `"int8"`,
    `"f32"`; GPUs also `"tf32"`, the Tensor Cores' path for f32 dots at default
    precision). `hbm`: HBM bytes per second. `link`: bytes per second one way
    of one ICI link (TPU) or of a GPU's NVLink. `link_latency`: seconds per hop.
    `network`: bytes per second one way per chip between slices (TPU DCN) or
    hosts (GPU InfiniBand), `network_latency` seconds per hop. `wrap`: on a
    TPU, the slice extent along an axis from which it has wraparound links (4:
    any multiple of 4, as v4 and v5p; 16: exactly 16, as v5e and v6e); 0 for
    GPUs."""

    name: str
    kind: str  # the devices' `device_kind`
    platform: str  # "tpu" or "gpu"
    peaks: dict[str, float]
    hbm: float
    link: float
    link_latency: float
    network: float
    network_latency: float
    wrap: int = 0
    multiple: bool = False  # whether any multiple of `wrap` has wraparound

    def peak(self, dtype: str, *, caller: str = "analyze_step") -> float:
        """Dense peak FLOP/s for operands of `dtype` (`"bf16"`, `"fp8"`,
        ...); `ValueError` where the chip has no published figure."""
        found = self.peaks.get(dtype)
        if found is None:
            known = ", ".join(sorted(self.peaks))
            raise ValueError(
                f"eqshard.{caller}: no peak for {dtype} operands is known for "
                f"{self.name} ({self.kind}); known: {known}. eqshard does not "
                "guess one: cast the dots' operands to a known type, or time "
                "this step on the chip itself."
            )
        return found

    def wraps(self, extent: int) -> bool:
        """Whether a slice axis of `extent` chips has wraparound links."""
        if self.wrap == 0 or extent < self.wrap:
            return False
        return extent % self.wrap == 0 if self.multiple else extent == self.wrap


# DCN per host [SB]: about 2.5e10 B/s; a TPU host holds 4 chips [TPU].
_DCN = 2.5e10 / 4

# The Tensor Cores' dense peaks that two chips share (one silicon, other HBM).
# [H100] SXM5, dense: BF16 989.4 TF, FP8 1978.9 TF, INT8 1978.9 TOPS, TF32
# 494.7 TF, FP32 66.9 TF (the H200's, [H200]).
_HOPPER = {"bf16": 989.4 * _T, "fp8": 1978.9 * _T, "int8": 1978.9 * _T,
           "tf32": 494.7 * _T, "f32": 66.9 * _T}  # fmt: skip
# [A100] SXM, dense: BF16 312 TF, INT8 624 TOPS, TF32 156 TF, FP32 19.5 TF (the
# 40 GB and 80 GB A100s'). No FP8.
_AMPERE = {"bf16": 312 * _T, "int8": 624 * _T, "tf32": 156 * _T, "f32": 19.5 * _T}

CHIPS: tuple[Chip, ...] = (
    Chip(
        "TPU v4", "TPU v4", "tpu",
        # [TPU] v4: 275 TFLOP/s bf16, 275 TOPS int8; HBM2 1200 GB/s.
        {"bf16": 275 * _T, "int8": 275 * _T},
        hbm=1.2e12,
        link=4.5e10,  # [SB] per link one way
        link_latency=1e-6,  # [SB] order of 1 us per ICI hop
        network=_DCN, network_latency=1e-5,  # [SB] DCN
        wrap=4, multiple=True,  # [SB] 3D torus: wraparound on multiples of 4
    ),
    Chip(
        "TPU v5e", "TPU v5 lite", "tpu",
        # [TPU] v5e: 197 TFLOP/s bf16, 394 TOPS int8; HBM2e 819 GB/s.
        {"bf16": 197 * _T, "int8": 394 * _T},
        hbm=8.19e11,
        link=4.5e10,  # [SB]
        link_latency=1e-6,
        network=_DCN, network_latency=1e-5,
        wrap=16,  # [SB] 2D torus: wraparound only on the full 16
    ),
    Chip(
        "TPU v5p", "TPU v5", "tpu",
        # [TPU] v5p: 459 TFLOP/s bf16, 918 TOPS int8; HBM2e 2765 GB/s.
        {"bf16": 459 * _T, "int8": 918 * _T},
        hbm=2.765e12,
        link=9e10,  # [SB]
        link_latency=1e-6,
        network=_DCN, network_latency=1e-5,
        wrap=4, multiple=True,
    ),
    Chip(
        "TPU v6e", "TPU v6 lite", "tpu",
        # [TPU] v6e (Trillium): 918 TFLOP/s bf16, 1836 TOPS int8; 1640 GB/s.
        {"bf16": 918 * _T, "int8": 1836 * _T},
        hbm=1.64e12,
        link=9e10,  # [SB]
        link_latency=1e-6,
        network=_DCN, network_latency=1e-5,
        wrap=16,
    ),
    Chip(
        "H100 SXM", "NVIDIA H100 80GB HBM3", "gpu",
        _HOPPER,
        hbm=3.35e12,  # [H100] HBM3 3.35 TB/s
        link=4.5e11,  # [H100] NVLink 900 GB/s both ways
        link_latency=2e-6,  # [NCCL]
        network=5e10, network_latency=5e-6,  # 400 Gb/s NDR per GPU; [NCCL]
    ),
    Chip(
        "H200 SXM", "NVIDIA H200 141GB HBM3e", "gpu",
        _HOPPER,  # [H200] SXM: the H100's Tensor Cores
        hbm=4.8e12,  # [H200] HBM3e 4.8 TB/s
        link=4.5e11,  # [H200] NVLink 900 GB/s both ways
        link_latency=2e-6,
        network=5e10, network_latency=5e-6,
    ),
    Chip(
        "B200", "NVIDIA B200", "gpu",
        # [B200] per GPU, dense: BF16 2.25 PF, FP8 4.5 PF, INT8 4.5 POPS,
        # TF32 1.1 PF, FP32 80 TF; HBM3e 8 TB/s.
        {"bf16": 2250 * _T, "fp8": 4500 * _T, "int8": 4500 * _T,
         "tf32": 1100 * _T, "f32": 80 * _T},
        hbm=8e12,
        link=9e11,  # [B200] NVLink 5: 1.8 TB/s both ways
        link_latency=2e-6,
        network=5e10, network_latency=5e-6,
    ),
    Chip(
        "A100 40GB SXM", "NVIDIA A100-SXM4-40GB", "gpu",
        _AMPERE,
        hbm=1.555e12,  # [A100] HBM2 1555 GB/s
        link=3e11,  # [A100] NVLink 3: 600 GB/s both ways
        link_latency=2e-6,
        network=2.5e10, network_latency=5e-6,  # 200 Gb/s HDR per GPU
    ),
    Chip(
        "A100 80GB SXM", "NVIDIA A100-SXM4-80GB", "gpu",
        _AMPERE,  # [A100] SXM 80GB: the same Tensor Cores
        hbm=2.039e12,  # [A100] HBM2e 2039 GB/s
        link=3e11,
        link_latency=2e-6,
        network=2.5e10, network_latency=5e-6,
    ),
)  # fmt: skip

_BY_KIND = {chip.kind: chip for chip in CHIPS}


def chip_of(devices: Sequence[Any]) -> Chip | str:
    """The chip of `devices` (all of one kind), or why there is none: a
    sentence for the report (CPU devices, or a kind without figures)."""
    if not devices:
        return "the step runs on no device the program names"
    platform = devices[0].platform
    kind = devices[0].device_kind
    if platform == "cpu":
        return (
            "the step was compiled for CPU devices, whose speed eqshard does "
            "not model; compile it for a target (eqshard.create_mesh(..., "
            "target='v5p-1024') or 'h100:8x8') to estimate a step's seconds"
        )
    if any(d.device_kind != kind for d in devices):
        return "the devices are of several kinds"
    chip = _BY_KIND.get(kind)
    if chip is None:
        known = ", ".join(c.name for c in CHIPS)
        return (
            f"no figures are known for {kind!r} devices (known: {known}); "
            "eqshard does not guess them"
        )
    return chip
