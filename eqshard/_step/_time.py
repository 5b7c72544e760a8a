"""How long a compiled step takes on the chips it was compiled for
(`StepTime`, on `StepReport.time`), estimated from the program's text, and the
usual count of a transformer's FLOPs for MFU (`transformer_flops`).

The estimate (`estimate_time`):

1. **Ops** (`_hlo._cost.op_costs`): each scheduled op's dot and convolution
   FLOPs by operand type and its HBM bytes, times its runs per step.
2. **Roofline per op**: an op takes the longer of its FLOPs at the chip's
   dense peak for its operands (`Chip.peaks`; on TPU an f32 dot is timed by
   its HLO precision: DEFAULT one bf16 pass, HIGH three, HIGHEST six; on GPU
   DEFAULT runs on the TF32 Tensor Cores, HIGHEST at the FP32 peak) and its
   bytes at the HBM bandwidth. `compute_s` sums the FLOPs' times of all ops,
   `memory_s` the bytes' times of the ops the bandwidth bounds.
3. **Collectives** (`_links.Links`): each row's `seconds` per run from
   its bytes, its devices' links and a ring algorithm (a transfer between
   TPU slices, a `dcn` row, over DCN); `collective_s` sums them times their
   runs. What the schedule does not overlap with computation
   (rows whose `overlapped` is not True) is exposed, and so is the part of
   the overlapped time that exceeds the ops' time.
4. `step_s` = the ops' roofline + the exposed collective time: between
   `max(compute_s, memory_s)` and `compute_s + memory_s + collective_s`.

Left out: elementwise FLOPs (their ops are timed by their bytes), the time
between ops (launches, synchronisation), caches (every op reads HBM), the
contention of several collectives on the same links, the host.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

from .._mesh._chips import Chip, chip_of
from .._typing import typecheck
from ._hlo._cost import op_costs, OpCost
from ._hlo._flow import Collective, Program
from ._links import Links, UnknownLinks
from ._records import CollectiveRow


@dataclasses.dataclass(frozen=True)
class StepTime:
    """How long one run of a step takes on the chips it was compiled for,
    estimated from the compiled program (per device; all devices run the
    same program at once).

    **Fields:**

    - `chip`: the chip's name (`"TPU v5p"`, `"H100 SXM"`).
    - `devices`: how many devices run the step.
    - `peak_flops`: one device's dense bf16 peak, FLOP/s (MFU's denominator).
    - `flops`: the dots' and convolutions' FLOPs per device per step, every
      loop's runs counted (elementwise work is not counted).
    - `hbm_bytes`: the HBM bytes the ops read and write per device per step.
    - `compute_s`: the FLOPs at the chip's peak for their operand types.
    - `memory_s`: the bytes of the bandwidth-bound ops at the HBM bandwidth.
    - `collective_s`: every collective's `seconds` times its runs.
    - `exposed_collective_s`: the collective time the schedule does not hide
      behind computation.
    - `step_s`: the estimate of a step, between `max(compute_s, memory_s)`
      and `compute_s + memory_s + collective_s`.
    """

    chip: str
    devices: int
    peak_flops: float
    flops: float
    hbm_bytes: int
    compute_s: float
    memory_s: float
    collective_s: float
    exposed_collective_s: float
    step_s: float

    def mfu(self, model_flops: float) -> float:
        """Model FLOPs utilisation: `model_flops` (the whole step's, all
        devices; [`eqshard.transformer_flops`][] counts a transformer's) over
        `step_s * peak_flops * devices`."""
        if model_flops < 0:
            raise ValueError(
                f"eqshard.StepTime.mfu: model_flops must be 0 or more; got "
                f"{model_flops}."
            )
        return model_flops / (self.step_s * self.peak_flops * self.devices)

    def summary(self) -> str:
        """One line: the step's seconds and what they are made of."""
        return (
            f"time on {self.devices} x {self.chip}: step {_s(self.step_s)} "
            f"(compute {_s(self.compute_s)}, memory {_s(self.memory_s)}, "
            f"collectives {_s(self.collective_s)} of which exposed "
            f"{_s(self.exposed_collective_s)}); {self.flops:.3g} FLOPs per device"
        )


def _s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def _peak(chip: Chip, key: str) -> tuple[float, int]:
    """The peak FLOP/s and the passes of a dot of operand type `key`."""
    if key == "f16":
        key = "bf16"
    if key.startswith("f32"):
        precision = key.partition(":")[2] or "default"
        if chip.platform == "tpu":
            passes = {"default": 1, "high": 3, "highest": 6}[precision]
            return chip.peak("bf16"), passes
        return chip.peak("f32" if precision == "highest" else "tf32"), 1
    return chip.peak(key), 1


def _roofline(ops: Sequence[OpCost], chip: Chip) -> tuple[float, float, float]:
    """(compute_s, memory_s of the bandwidth-bound ops, the ops' roofline)."""
    peaks: dict[str, tuple[float, int]] = {}
    compute = memory = roofline = 0.0
    for op in ops:
        seconds = 0.0
        for key, flops in op.flops:
            if key not in peaks:
                peaks[key] = _peak(chip, key)
            peak, passes = peaks[key]
            seconds += flops * passes / peak
        moved = op.bytes / chip.hbm
        compute += seconds * op.runs
        if moved > seconds:
            memory += moved * op.runs
        roofline += max(seconds, moved) * op.runs
    return compute, memory, roofline


def estimate_time(
    program: Program,
    collectives: Sequence[Collective],
    rows: Sequence[CollectiveRow],
    devices: Sequence[Any],
) -> tuple[StepTime | None, str, tuple[CollectiveRow, ...]]:
    """The step's time on `devices`' chip, why there is none (`""` when there
    is), and `rows` with their `seconds`."""
    chip = chip_of(devices)
    if isinstance(chip, str):
        return None, chip, tuple(rows)
    try:
        ops = op_costs(program.module, program.runs())
        compute, memory, roofline = _roofline(ops, chip)
        links = Links(devices, chip)
        timed = []
        for collective, row in zip(collectives, rows, strict=True):
            seconds = None
            if collective.dcn:
                seconds = links.transfer_seconds(
                    row.kind, row.bytes, collective.groups, collective.slices
                )
            elif row.kind != "kernel":
                seconds = links.seconds(row.kind, row.bytes, collective.groups)
            timed.append(dataclasses.replace(row, seconds=seconds))
    except (UnknownLinks, ValueError) as error:
        return None, str(error).removeprefix("eqshard.analyze_step: "), tuple(rows)
    total = sum(((r.seconds or 0.0) * r.count for r in timed), 0.0)
    exposed = sum(
        ((r.seconds or 0.0) * r.count for r in timed if r.overlapped is not True),
        0.0,
    )
    hidden = total - exposed
    exposed += max(0.0, hidden - roofline)
    time = StepTime(
        chip=chip.name,
        devices=len(devices),
        peak_flops=chip.peak("bf16"),
        flops=sum((op.total_flops * op.runs for op in ops), 0.0),
        hbm_bytes=sum(op.bytes * op.runs for op in ops),
        compute_s=compute,
        memory_s=memory,
        collective_s=total,
        exposed_collective_s=exposed,
        step_s=roofline + exposed,
    )
    return time, "", tuple(timed)


@typecheck
def transformer_flops(
    *,
    params: int,
    tokens: int,
    layers: int,
    seq: int,
    dim: int,
    causal: bool = True,
) -> float:
    """The usual count of a decoder transformer's training FLOPs for one step,
    all devices together: MFU's numerator
    ([`StepTime.mfu`][eqshard.StepTime.mfu]).

    `6 * params` per token (the forward's `2 * params` and the backward's
    twice that), plus the attention's scores and values, `12 * layers * dim *
    seq` per token, halved for causal attention, which computes half of them
    (PaLM's appendix B, Chowdhery et al. 2022; MaxText halves it likewise).
    Rematerialisation is not counted: MFU counts the model's FLOPs, not the
    program's.

    **Arguments:**

    - `params`: the model's parameters (embedding included, as PaLM counts).
    - `tokens`: tokens per step (`batch * seq`).
    - `layers`: transformer layers.
    - `seq`: the sequence length attended over.
    - `dim`: the attention's width (heads times head size; the model's width
      for most models).
    - `causal`: whether attention is causal.

    **Returns:**

    The step's FLOPs, a float.

    **Raises:**

    `ValueError` for a count that is not positive.

    !!! Example

        ```python
        flops = eqshard.transformer_flops(
            params=7_000_000_000, tokens=256 * 4096, layers=32, seq=4096,
            dim=4096,
        )
        mfu = report.time.mfu(flops)
        ```
    """
    for name, value in (("params", params), ("tokens", tokens), ("layers", layers)):
        if value <= 0:
            raise ValueError(
                f"eqshard.transformer_flops: {name} must be positive; got {value}."
            )
    for name, value in (("seq", seq), ("dim", dim)):
        if value <= 0:
            raise ValueError(
                f"eqshard.transformer_flops: {name} must be positive; got {value}."
            )
    attention = 12.0 * layers * dim * seq * (0.5 if causal else 1.0)
    return float(tokens) * (6.0 * params + attention)
