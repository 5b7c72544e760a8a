"""What a pipeline schedule keeps on each device, for `plan_training(pipeline=)`.

`eqshard.pipeline` runs `R·M + S - 1` steps (S stages, R repeats, M
microbatches); for the backward pass every stage keeps its input at each step
(one microbatch's activation), and it holds a buffer of the M microbatches'
inputs (the ring's returns, for the circular schedule) and one of the outputs;
the backward loop holds in flight the cotangents of the R·M chunk boundaries
and the one passed between stages. With `a` the bytes of one microbatch's
activation on a device, that is `(R·M + S - 1)·a + 2·M·a + (R·M + 1)·a`, within
10 % of XLA's temporaries for steps whose activations dominate (measured on
8 CPU devices, GPipe and circular, S = 2 and 4: tests/test_pipeline.py); the
layers' own activations inside a stage are the compiled step's to report
(`analyze_step`). The stage's parameters and optimizer
state are the plan's other parts, per device as their specs (the layer axis over
the stage axis) put them.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from .._mesh._current import mesh_repr
from .._report import format_bytes, memory_row
from .._transforms._pipeline_checks import count, GATHERS, schedule_counts, SCHEDULES


_KEYS = (
    "microbatches",
    "activation",
    "axis",
    "schedule",
    "repeats",
    "activation_spec",
    "fsdp_gather",
    "layers",
    "layer_bytes",
)
# The chunks of K layers each `fsdp_gather` holds gathered: one, the stage's
# R, or two (at most R).
_HELD = {
    "per_step": lambda r: 1,
    "once": lambda r: r,
    "per_repeat": lambda r: min(2, r),
}


def _pipeline_error(what: str, fix: str) -> ValueError:
    return ValueError(f"eqshard.plan_training: `pipeline` {what}; {fix}")


@dataclasses.dataclass(frozen=True)
class PipelineBuffers:
    """What a pipeline schedule keeps on each device (see
    [`eqshard.plan_training`][]'s `pipeline=`).

    **Fields:** `axis`, `stages`, `schedule`, `repeats`, `microbatches`;
    `steps` (`R·M + S - 1`); `activation_bytes`, one microbatch's activation on
    a device; `kept`, the stage inputs kept for the backward pass
    (`steps · activation_bytes`); `buffers`, the inputs' and outputs' buffers
    (`2 · M · activation_bytes`); `in_flight`, what the backward loop holds
    besides (`(R·M + 1) · activation_bytes`); `fsdp_gather` and `gathered`,
    the stage weights it holds gathered over the data axes (`layer_bytes`
    times K layers for `"per_step"`, R·K for `"once"`, 2·K for
    `"per_repeat"`; 0 when `layer_bytes` is not given).
    """

    axis: str
    stages: int
    schedule: str
    repeats: int
    microbatches: int
    steps: int
    activation_bytes: int
    kept: int
    buffers: int
    in_flight: int
    fsdp_gather: str = "per_step"
    gathered: int = 0

    @property
    def total(self) -> int:
        """The bytes on each device."""
        return self.kept + self.buffers + self.in_flight + self.gathered

    @property
    def bubble(self) -> float:
        """The fraction of the loop's steps each stage idles, `(S-1)/steps`."""
        return (self.stages - 1) / self.steps

    def line(self) -> str:
        """The plan's summary line."""
        gathered = (
            f", weights gathered {self.fsdp_gather} {format_bytes(self.gathered)}"
            if self.gathered
            else ""
        )
        return memory_row(
            "pipeline",
            self.total,
            f"({self.schedule} over {self.axis!r}: {self.steps} steps, bubble "
            f"{self.bubble:.1%}; stage inputs kept {format_bytes(self.kept)}, "
            f"buffers {format_bytes(self.buffers)}, in flight "
            f"{format_bytes(self.in_flight)}{gathered})",
        )


def _per_device(
    shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh | AbstractMesh
) -> int:
    """The elements of one device's block of `shape` laid out by `spec`."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    count = 1
    for i, dim in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        unknown = [a for a in axes if a not in sizes]
        if unknown:
            raise _pipeline_error(
                f"has activation_spec {spec}, naming {unknown} not in mesh "
                f"{mesh_repr(mesh)}",
                "name axes of the mesh.",
            )
        count *= -(-dim // math.prod(sizes[a] for a in axes))
    return count


def pipeline_buffers(
    pipeline: Mapping[str, Any], mesh: Mesh | AbstractMesh
) -> PipelineBuffers:
    """The buffers `pipeline`'s schedule keeps on each device of `mesh`."""
    unknown = sorted(set(pipeline) - set(_KEYS))
    missing = [k for k in ("microbatches", "activation") if k not in pipeline]
    if unknown or missing:
        raise _pipeline_error(
            f"has unknown keys {unknown} or lacks {missing}",
            f"give {', '.join(map(repr, _KEYS))} (the first two required), e.g. "
            "{'microbatches': 8, 'activation': jax.ShapeDtypeStruct((4, 1024), "
            "jnp.bfloat16), 'activation_spec': P('dp')}.",
        )
    axis = pipeline.get("axis", "pp")
    schedule = pipeline.get("schedule", "gpipe")
    repeats = count(pipeline.get("repeats", 1), "repeats", _pipeline_error)
    m = count(pipeline["microbatches"], "microbatches", _pipeline_error)
    if axis not in mesh.axis_names:
        raise _pipeline_error(
            f"names the stage axis {axis!r}, not in mesh {mesh_repr(mesh)}",
            "give `axis` one of its axes.",
        )
    if schedule not in SCHEDULES:
        raise _pipeline_error(
            f"has schedule={schedule!r}", "use 'gpipe' (repeats 1) or 'circular'."
        )
    stages = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))[axis]
    schedule_counts(schedule, repeats, m, stages, _pipeline_error)
    activation = pipeline["activation"]
    if not hasattr(activation, "shape") or not hasattr(activation, "dtype"):
        raise _pipeline_error(
            f"has activation {activation!r}, which has no shape and dtype",
            "give one microbatch's activation as a jax.ShapeDtypeStruct.",
        )
    spec = pipeline.get("activation_spec", PartitionSpec())
    shape = tuple(int(n) for n in activation.shape)
    if any(n < 0 for n in shape):
        raise _pipeline_error(
            f"has an activation of shape {shape}", "give sizes of at least 0."
        )
    a = _per_device(shape, spec, mesh) * np.dtype(activation.dtype).itemsize
    steps = repeats * m + stages - 1
    gather, gathered = _gathered(pipeline, stages, repeats)
    return PipelineBuffers(
        axis,
        stages,
        schedule,
        repeats,
        m,
        steps,
        a,
        steps * a,
        2 * m * a,
        (repeats * m + 1) * a,
        gather,
        gathered,
    )


def _gathered(
    pipeline: Mapping[str, Any], stages: int, repeats: int
) -> tuple[str, int]:
    """`fsdp_gather` and the bytes of stage weights it holds gathered."""
    gather = pipeline.get("fsdp_gather", "per_step")
    if gather not in GATHERS:
        raise _pipeline_error(
            f"has fsdp_gather={gather!r}", "use 'per_step', 'once' or 'per_repeat'."
        )
    if "layer_bytes" not in pipeline:
        return gather, 0
    layers = count(pipeline.get("layers", 0), "layers", _pipeline_error)
    size = count(pipeline["layer_bytes"], "layer_bytes", _pipeline_error)
    if layers % (stages * repeats) or not layers:
        raise _pipeline_error(
            f"has layers={layers} with layer_bytes",
            f"give the stack's layer count L, a multiple of S·R = {stages * repeats}.",
        )
    chunk = layers // (stages * repeats)
    return gather, _HELD[gather](repeats) * chunk * size


def pipeline_from_text(text: str, dtypes: Mapping[str, Any]) -> dict[str, Any]:
    """`microbatches=8,activation=4x1024,dtype=bfloat16,spec=dp,...` (the
    command's `--pipeline`) as `plan_training`'s `pipeline=`; `dtypes` by name.
    Raises `ValueError` saying how to write it."""
    fields: dict[str, str] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        fields[key] = value
    usage = ValueError(
        f"--pipeline {text!r}: write microbatches=M,activation=ROWSxD (one "
        "microbatch's activation), "
        "optionally dtype=, spec=AXIS (joined by +), axis=, schedule=, repeats=, "
        "fsdp_gather= with layers=L,layer_bytes=N (one layer's weights gathered "
        "on a device), e.g. microbatches=8,activation=4x1024,dtype=bfloat16,spec=dp"
    )
    known = {"microbatches", "activation", "dtype", "spec", "axis", "schedule"}
    known |= {"repeats", "fsdp_gather", "layers", "layer_bytes"}
    if set(fields) - known or not {"microbatches", "activation"} <= set(fields):
        raise usage
    try:
        shape = tuple(int(n) for n in fields["activation"].split("x"))
        plan: dict[str, Any] = {
            "microbatches": int(fields["microbatches"]),
            "repeats": int(fields.get("repeats", "1")),
            **{k: int(fields[k]) for k in ("layers", "layer_bytes") if k in fields},
            "activation": jax.ShapeDtypeStruct(
                shape, dtypes[fields.get("dtype", "float32").lower()]
            ),
        }
    except (ValueError, KeyError):
        raise usage from None
    if "spec" in fields:
        axes = fields["spec"].split("+")
        plan["activation_spec"] = PartitionSpec(
            tuple(axes) if len(axes) > 1 else axes[0]
        )
    plan.update(
        {k: fields[k] for k in ("axis", "schedule", "fsdp_gather") if k in fields}
    )
    return plan
