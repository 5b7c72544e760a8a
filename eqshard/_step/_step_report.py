"""The step report: what a compiled step communicates and holds on each device,
by tree path, as [`eqshard.analyze_step`][] reads it (`_step.py`).

Rows are frozen dataclasses of plain values (strings, ints, tuples), so that a
report is compared with `==`, written by `to_json` with sorted keys and nothing
that changes between runs (no timings, timestamps or addresses), and read back
by `from_json` field by field (`_step_json.py`). `diff` compares two reports by
leaf path: layout (spec, shape, dtype), communication per collective kind, and
memory.
"""

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax

from .._report import format_bytes, parse_bytes, plain, Report, text_table
from ._step_json import FORMAT, read_report


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


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Per-device bytes of the compiled program, from XLA's memory analysis.

    `peak_bytes` is what the program holds at its peak on its backend
    (`platform`): on TPU and GPU, XLA's own `xla_peak_bytes`, which follows
    the schedule (TPU often reports `temp_bytes` as 0 while its peak is real);
    on CPU, whose `xla_peak_bytes` leaves temporaries out,
    `argument + output + temp - alias`. The `host_*` figures are the bytes in
    host memory (XLA's `host_*_size_in_bytes`; 0 where the backend reports
    none). `device_memory` is the memory of one device of a target mesh
    ([`eqshard.create_mesh`][]'s `target=`), the default budget of `fits` and
    `headroom`; `None` otherwise.
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
    per step (`what` is a collective kind), or a memory figure (`path` is
    `"memory"`)."""

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
        return tuple(sorted({c.path for c in self.changes} - {"memory", UNATTRIBUTED}))

    def __str__(self) -> str:
        if not self.changes:
            return "no changes"
        lines = []
        for c in self.changes:
            before, after = (_show(v, c.what) for v in (c.before, c.after))
            lines.append(f"{c.path}: {c.what} {before} -> {after}")
        return "\n".join(lines)


UNATTRIBUTED = "(activation)"


def _show(value: str | int | None, what: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) and what not in ("shape",):
        return format_bytes(value)
    return str(value)


@dataclasses.dataclass(frozen=True, repr=False)
class StepReport(Report):
    """What a compiled step communicates and holds on each device, named by tree
    path: made by [`eqshard.analyze_step`][].

    `str(report)` is a text summary with one line per collective;
    `report.show()` prints it with `rich` when installed. `report.to_json()` is a
    byte-stable `str` to keep in a repository, read back by
    `StepReport.from_json`; `report.diff(other)` names what changed.

    **Fields:**

    - `function`: the step's name.
    - `mesh`: the mesh's `(axis, size)` pairs (empty for a single device).
    - `arguments`, `outputs`: one
      [`StepLeaf`][eqshard._step._step_report.StepLeaf] per array, with the sharding
      the program uses (`out/...` for outputs).
    - `memory`: a [`StepMemory`][eqshard._step._step_report.StepMemory]: per-device
      bytes and `fits()`.
    - `collectives`: one [`CollectiveRow`][eqshard._step._step_report.CollectiveRow]
      per collective instruction, in program order.
    - `moved`: the [`MovedInput`][eqshard._step._step_report.MovedInput]s JAX moves
      at every call.
    - `warnings`: XLA's [`StepWarning`][eqshard._step._step_report.StepWarning]s of
      this compile.
    - `versions`: `(package, version)` of JAX, jaxlib and the target's compiler
      (`libtpu`, `jax-cuda12-plugin`) the step was compiled with.
    - `compiler_options`: the XLA options it was compiled with, as text.
    """

    function: str
    mesh: tuple[tuple[str, int], ...]
    arguments: tuple[StepLeaf, ...]
    outputs: tuple[StepLeaf, ...]
    memory: StepMemory
    collectives: tuple[CollectiveRow, ...]
    moved: tuple[MovedInput, ...] = ()
    warnings: tuple[StepWarning, ...] = ()
    versions: tuple[tuple[str, str], ...] = ()
    compiler_options: tuple[tuple[str, str], ...] = ()

    @property
    def device_memory(self) -> int | None:
        """The memory of one device of the target the step was compiled for
        (`memory.device_memory`), or `None` for this machine's devices."""
        return self.memory.device_memory

    # -- totals -------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        """Bytes of all collectives per device per step (`bytes * count`)."""
        return sum(row.total_bytes for row in self.collectives)

    def _totals(self, key: Callable[[CollectiveRow], str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for row in self.collectives:
            out[key(row)] = out.get(key(row), 0) + row.total_bytes
        return dict(sorted(out.items(), key=lambda item: (-item[1], item[0])))

    @property
    def bytes_by_kind(self) -> dict[str, int]:
        """`total_bytes` per collective kind, largest first."""
        return self._totals(lambda row: row.kind)

    @property
    def bytes_by_axes(self) -> dict[str, int]:
        """`total_bytes` per set of mesh axes communicated over (`"tp"`,
        `"dp+tp"`), largest first: a collective over two axes counts once."""
        return self._totals(lambda row: "+".join(row.axes))

    @property
    def attributed_bytes(self) -> int:
        """The bytes of `total_bytes` whose arrays belong to a leaf."""
        return sum(
            part.bytes * row.count
            for row in self.collectives
            for part in row.parts
            if part.paths
        )

    @property
    def attributed_share(self) -> float:
        """`attributed_bytes / total_bytes` (1.0 without collectives)."""
        total = self.total_bytes
        return 1.0 if total == 0 else self.attributed_bytes / total

    def by_path(self) -> dict[str, int]:
        """Communication per leaf per step, largest first; the bytes of arrays that
        belong to no leaf are under `"(activation)"`. An array that belongs to
        several leaves counts for each."""
        out: dict[str, int] = {}
        for path, _, nbytes in self._communication():
            out[path] = out.get(path, 0) + nbytes
        return dict(sorted(out.items(), key=lambda item: (-item[1], item[0])))

    def _communication(self) -> Iterator[tuple[str, str, int]]:
        """(path, kind, bytes per step) for every array of every collective."""
        for row in self.collectives:
            for part in row.parts:
                for path in part.paths or (UNATTRIBUTED,):
                    yield path, row.kind, part.bytes * row.count

    # -- comparing and keeping -----------------------------------------------------

    def diff(self, other: "StepReport") -> StepDiff:
        """What changed from this report to `other`: the leaves whose layout
        changed or that came or went, the communication per leaf and kind, and
        the memory figures."""
        changes: list[StepChange] = []
        for mine, theirs in (
            (self.arguments, other.arguments),
            (self.outputs, other.outputs),
        ):
            before = {leaf.path: leaf for leaf in mine}
            after = {leaf.path: leaf for leaf in theirs}
            for path in sorted(before.keys() | after.keys()):
                a, b = before.get(path), after.get(path)
                if a is None or b is None:
                    what = "added" if a is None else "removed"
                    changes.append(StepChange(path, what, a and a.spec, b and b.spec))
                    continue
                for field in ("spec", "shape", "dtype"):
                    x, y = getattr(a, field), getattr(b, field)
                    if x != y:
                        changes.append(StepChange(path, field, str(x), str(y)))
        sums: list[dict[tuple[str, str], int]] = []
        for report in (self, other):
            found: dict[tuple[str, str], int] = {}
            for path, kind, nbytes in report._communication():
                found[(path, kind)] = found.get((path, kind), 0) + nbytes
            sums.append(found)
        for path, kind in sorted(sums[0].keys() | sums[1].keys()):
            x, y = sums[0].get((path, kind), 0), sums[1].get((path, kind), 0)
            if x != y:
                changes.append(StepChange(path, kind, x, y))
        for field in (
            "argument_bytes",
            "output_bytes",
            "temp_bytes",
            "alias_bytes",
            "host_argument_bytes",
            "host_output_bytes",
            "host_temp_bytes",
        ):
            x, y = getattr(self.memory, field), getattr(other.memory, field)
            if x != y:
                changes.append(StepChange("memory", field, x, y))
        return StepDiff(tuple(changes))

    def _json(self) -> Any:
        data = plain(self)
        data["format"] = FORMAT
        data["jax"] = jax.__version__
        return data

    def to_json(self) -> str:
        """The report as JSON: sorted keys, no timings, timestamps or addresses,
        so the same step gives the same bytes (a layout lockfile); sources are
        relative to the working directory of the analysis when under it."""
        return super().to_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> "StepReport":
        """The report that `to_json` wrote.

        The whole document is checked before a report is built: every field is
        there, of its type (integers not negative, a collective's group at least
        one device), and nothing else is.

        **Raises:** `ValueError` naming the JSON path of the first fields that
        are wrong (`collectives/0/parts/1/bytes`) and what each should hold,
        when the text is not a step report written by `to_json`.
        """
        return read_report(cls, text, choices=_CHOICES, least=_LEAST)

    # -- showing -------------------------------------------------------------------

    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.mesh)

    def summary(self) -> str:
        """The memory, the totals and the share attributed, in a few lines."""
        m = self.memory
        lines = [
            f"step {self.function!r} on mesh {self.mesh_shape or 'of one device'}",
            f"memory per device: arguments {format_bytes(m.argument_bytes)}, "
            f"outputs {format_bytes(m.output_bytes)}, temporaries "
            f"{format_bytes(m.temp_bytes)}, aliased {format_bytes(m.alias_bytes)}: "
            f"peak {format_bytes(m.peak_bytes)} "
            f"(XLA's peak_memory_in_bytes on {m.platform}: "
            f"{format_bytes(m.xla_peak_bytes)})",
            *_host_and_budget(m),
            f"collectives: {len(self.collectives)} instructions, "
            f"{sum(r.count for r in self.collectives)} runs, "
            f"{format_bytes(self.total_bytes)} per device per step; "
            f"{self.attributed_share:.1%} of the bytes belong to a leaf",
        ]
        if self.collectives:
            axes = ", ".join(
                f"{k or 'none'} {format_bytes(v)}"
                for k, v in self.bytes_by_axes.items()
            )
            lines.append(f"by mesh axes: {axes}")
        return "\n".join(lines)

    def _rows(self) -> list[tuple[str, ...]]:
        rows = []
        for row in self.collectives:
            shape = " + ".join(str(p.shape) for p in row.parts[:3])
            if len(row.parts) > 3:
                shape += f" + {len(row.parts) - 3} more"
            count = (
                f"{row.count}{'?' if row.conditional or row.unknown_trip_count else ''}"
            )
            paths = ", ".join(row.paths[:3]) + (
                f" (+{len(row.paths) - 3})" if len(row.paths) > 3 else ""
            )
            via = {p.via for p in row.parts if p.paths} - {""}
            if via:
                paths += f" [{'/'.join(sorted(via))}]"
            rows.append(
                (
                    row.kind,
                    shape,
                    row.dtype,
                    format_bytes(row.bytes),
                    count,
                    "+".join(row.axes) or "-",
                    paths or f"{UNATTRIBUTED} {row.source}".rstrip(),
                )
            )
        return rows

    def table(self) -> str:
        """The summary, one line per collective, the inputs moved at every call,
        and XLA's warnings."""
        lines = [self.summary()]
        rows = self._rows()
        if rows:
            lines.append("")
            lines += text_table(_COLUMNS, rows)
        if self.moved:
            lines.append("inputs moved at every call:")
            lines += [f"  {m.path}: {m.have} -> {m.want}" for m in self.moved]
        if self.warnings:
            lines.append("XLA warnings while compiling:")
            for w in self.warnings:
                where = f" ({', '.join(w.paths)})" if w.paths else ""
                lines.append(f"  {w.message[:300]}{where}")
        return "\n".join(lines)

    def _summary(self) -> dict[str, Any]:
        return {
            "function": repr(self.function),
            "collectives": len(self.collectives),
            "total_bytes": self.total_bytes,
            "attributed_share": f"{self.attributed_share:.3f}",
            "peak_bytes": self.memory.peak_bytes,
            "mesh": self.mesh_shape,
        }

    def _rich(self) -> list[Any]:
        """The summary, then tables of the collectives and the inputs moved, and
        XLA's warnings."""
        from rich.table import Table
        from rich.text import Text

        out: list[Any] = [Text(self.summary())]
        if self.collectives:
            table = Table(title="collectives per step")
            for header in _COLUMNS:
                table.add_column(header, overflow="fold")
            for row, cells in zip(self.collectives, self._rows(), strict=True):
                style = None if any(p.paths for p in row.parts) else "dim"
                table.add_row(*cells, style=style)
            out.append(table)
        if self.moved:
            moved = Table(title="inputs moved at every call")
            for header in ("path", "has", "program wants"):
                moved.add_column(header)
            for m in self.moved:
                moved.add_row(m.path, m.have, m.want)
            out.append(moved)
        for w in self.warnings:
            out.append(Text.assemble(("XLA warning", "yellow"), f": {w.message}"))
        return out


_COLUMNS = ("kind", "shape", "dtype", "bytes", "count", "axes", "leaves")


def _host_and_budget(m: StepMemory) -> list[str]:
    """The summary's lines for host memory and the target's device memory."""
    lines = []
    host = (m.host_argument_bytes, m.host_output_bytes, m.host_temp_bytes)
    if any(host):
        lines.append(
            f"host memory per device: arguments {format_bytes(host[0])}, outputs "
            f"{format_bytes(host[1])}, temporaries {format_bytes(host[2])}"
        )
    if m.device_memory is not None:
        room = m.device_memory - m.peak_bytes
        verdict = "fits" if room >= 0 else "DOES NOT FIT"
        lines.append(
            f"device memory {format_bytes(m.device_memory)}: {verdict}, "
            f"{format_bytes(abs(room))} {'to spare' if room >= 0 else 'over'}"
        )
    return lines


# What `from_json` checks beyond the types: the values of a closed vocabulary,
# and the least value of integer fields (0 unless named here).
_CHOICES: dict[tuple[type, str], tuple[str, ...]] = {
    (CollectivePart, "via"): ("", "producer", "consumer", "neighbours")
}
_LEAST: dict[tuple[type, str], int] = {(CollectiveRow, "group_size"): 1}
