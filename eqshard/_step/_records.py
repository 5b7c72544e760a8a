"""The rows of a step report (`_report.py`): each array leaf
(`StepLeaf`), each collective (`CollectiveRow` of `CollectivePart`s) with its
bytes, runs and overlap, the memory per device (`StepMemory`, on the step's
backend), the inputs moved at every call and XLA's warnings; what `diff` finds
(`StepChange`, `StepDiff`); and `OutOfMemory`, for a step the compiler refuses.
All are frozen dataclasses of plain values, compared with `==` and written to
JSON as they are.
"""

import dataclasses

from .._report import format_bytes, parse_bytes


@dataclasses.dataclass(frozen=True)
class StepLeaf:
    """An argument or output array of the step, as the program lays it out."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str  # the program's sharding of it
    bytes_per_device: int
    donated: bool = False


@dataclasses.dataclass(frozen=True)
class CollectivePart:
    """One array a collective moves (a combined collective moves several), and
    the leaves it belongs to: `via` is `""` when the data flows from or to them
    unchanged, `"producer"` when they feed the dot (or reduce, convolution,
    gather) whose partial results it combines, `"consumer"` when they feed the
    dot that consumes what it gathers (or its result reaches them), and
    `"neighbours"` either way for an all-to-all or permute."""

    shape: tuple[int, ...]
    dtype: str
    bytes: int
    paths: tuple[str, ...]
    via: str = ""


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
    """One collective instruction of the compiled program (an async start/done
    pair once).

    `bytes` is the size of its result on one device per run, as the program
    states it; `count` its runs per step (a loop's trip count multiplies; in a
    branch of a conditional, `conditional` is set and `count` is at most);
    `link_bytes` estimates what each device sends per run with ring algorithms
    over groups of `n` devices: all-gather and all-to-all `bytes * (n-1)/n`,
    reduce-scatter `bytes * (n-1)`, all-reduce `2 * bytes * (n-1)/n`,
    collective-permute `bytes`.

    `overlapped` says whether the compiled schedule runs it beside computation:
    `False` for a synchronous op (every collective on CPU, a GPU pair XLA marks
    `is_sync`) or an async pair with nothing computed between its start and its
    done, `True` when computation runs between them, `None` where the text does
    not say (its done is in another computation, a kernel). A
    `ragged-all-to-all`'s `bytes` is its output buffer, an upper bound of what
    it receives. A `kernel` row is a Pallas/Mosaic custom-call, without bytes:
    what it communicates is not in the program's text.

    `dcn` marks a transfer between TPU slices over the data-center network,
    which a multi-slice program states as a `send`/`recv` pair to the megascale
    runtime, not as a collective op: one row per pair, named by its rendezvous
    key (`all-gather.16_0`: XLA split the collective `all-gather.16` into this
    transfer and, where its groups also span devices of one slice, a collective
    over ICI, a row of its own), its kind the transfer's type, `group_size`
    its devices (one per slice for the cross-slice part of a gather or
    reduction). `bytes` is the recv's array, as for any row; what each device
    sends over DCN is `link_bytes`, on two slices the send's operand for an
    all-gather (half the gathered array), all-reduce or permute.

    `seconds` is how long one run takes on the target's links (`None` where
    the report has no `time`: on CPU, or for a kernel), as
    [`StepReport.time`][eqshard.StepReport] estimates it.
    """

    name: str
    kind: str
    parts: tuple[CollectivePart, ...]
    count: int
    axes: tuple[str, ...]
    group_size: int
    op_name: str
    source: str
    conditional: bool = False
    unknown_trip_count: bool = False
    overlapped: bool | None = None
    seconds: float | None = None
    dcn: bool = False

    @property
    def shape(self) -> tuple[int, ...] | tuple[tuple[int, ...], ...]:
        """The result's shape; the shapes of its arrays for a combined one."""
        if len(self.parts) == 1:
            return self.parts[0].shape
        return tuple(part.shape for part in self.parts)

    @property
    def dtype(self) -> str:
        return ",".join(dict.fromkeys(part.dtype for part in self.parts))

    @property
    def bytes(self) -> int:
        return sum(part.bytes for part in self.parts)

    @property
    def total_bytes(self) -> int:
        """`bytes * count`: per device per step."""
        return self.bytes * self.count

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for part in self.parts for p in part.paths))

    @property
    def link_bytes(self) -> int:
        n = self.group_size
        factor = {
            "all-reduce": 2 * (n - 1) / n,
            "reduce-scatter": float(n - 1),
            "collective-permute": 1.0,
        }.get(self.kind, (n - 1) / n)
        return round(self.bytes * factor)


class OutOfMemory(ValueError):
    """The compiler refused the step: it needs more memory than a device has
    (the TPU compiler checks this itself, and stops)."""


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Per-device bytes of the compiled program, from XLA's memory analysis.

    `peak_bytes` is what the program holds at its peak on its backend
    (`platform`): on TPU and GPU, XLA's own `xla_peak_bytes`, which follows
    the schedule (TPU often reports `temp_bytes` as 0 while its peak is real);
    on CPU, whose `xla_peak_bytes` leaves temporaries out,
    `argument + output + temp - alias`. The `host_*` figures are the bytes in
    host memory (XLA's `host_*_size_in_bytes`; on CPU, whose XLA reports
    none, the arguments and outputs in host memory counted by their memory
    kinds, which a note in the report's `warnings` says). `device_memory` is
    the memory of one device of a target mesh ([`eqshard.create_mesh`][]'s
    `target=`), the default budget of `fits` and `headroom`; `None` otherwise.
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    xla_peak_bytes: int
    host_argument_bytes: int = 0
    host_output_bytes: int = 0
    host_temp_bytes: int = 0
    platform: str = "cpu"
    device_memory: int | None = None

    @property
    def peak_bytes(self) -> int:
        if self.platform in ("tpu", "gpu") and self.xla_peak_bytes > 0:
            return self.xla_peak_bytes
        return (
            self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes
        )

    def headroom(self, device_memory: int | str | None = None) -> int:
        """`device_memory - peak_bytes` (negative when it does not fit);
        `device_memory` in bytes or as a string such as `"16GiB"`, by default
        the target's (`self.device_memory`)."""
        return self._budget("headroom", device_memory) - self.peak_bytes

    def fits(self, device_memory: int | str | None = None) -> bool:
        """Whether `peak_bytes` fits in `device_memory` (by default the
        target's, `self.device_memory`)."""
        return self._budget("fits", device_memory) >= self.peak_bytes

    def _budget(self, method: str, device_memory: int | str | None) -> int:
        caller = f"StepMemory.{method}"
        if device_memory is not None:
            return parse_bytes(device_memory, caller=caller)
        if self.device_memory is None:
            raise ValueError(
                f"eqshard.{caller}: device_memory is None and the report knows no "
                "device memory (it does only for a target mesh, made by "
                "eqshard.create_mesh(..., target=...)). Pass device_memory, e.g. "
                f"report.memory.{method}('16GiB')."
            )
        return self.device_memory


@dataclasses.dataclass(frozen=True)
class MovedInput:
    """An argument that JAX moves onto the devices at every call."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    have: str  # where it is
    want: str  # the program's sharding of it


@dataclasses.dataclass(frozen=True)
class StepWarning:
    """A warning XLA logged while compiling the step, with the leaves of the
    instructions it names, where it names one."""

    message: str
    paths: tuple[str, ...]
    source: str


@dataclasses.dataclass(frozen=True)
class StepChange:
    """One difference between two step reports: a leaf's layout (`what` is
    `"spec"`, `"shape"`, `"dtype"`, `"added"` or `"removed"`), its communication
    per step (`what` is a collective kind), a memory figure (`path` is
    `"memory"`), or a total of the communication (`path` is `"communication"`,
    `what` is `"total_bytes"`, `"dcn_bytes"`, `"exposed_bytes"` or
    `"unknown_overlap_bytes"`)."""

    path: str
    what: str
    before: str | int | None
    after: str | int | None


@dataclasses.dataclass(frozen=True)
class StepDiff:
    """What changed between two [`eqshard.StepReport`][]s, by path and kind, as
    [`StepReport.diff`][eqshard.StepReport.diff] finds it; empty (falsy) when
    nothing did. `str(diff)` is one line per change."""

    changes: tuple[StepChange, ...]

    def __bool__(self) -> bool:
        return bool(self.changes)

    @property
    def paths(self) -> tuple[str, ...]:
        """The leaves whose layout or communication changed."""
        found = {c.path for c in self.changes}
        return tuple(sorted(found - {"memory", COMMUNICATION, UNATTRIBUTED}))

    def __str__(self) -> str:
        if not self.changes:
            return "no changes"
        lines = []
        for c in self.changes:
            before, after = (_show(v, c.what) for v in (c.before, c.after))
            lines.append(f"{c.path}: {c.what} {before} -> {after}")
        return "\n".join(lines)


UNATTRIBUTED = "(activation)"
COMMUNICATION = "communication"  # the `path` of a change in the report's totals


def _show(value: str | int | None, what: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) and what not in ("shape",):
        return format_bytes(value)
    return str(value)
