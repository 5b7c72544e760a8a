"""The step report: what a compiled step communicates and holds on each device,
by tree path, as [`eqshard.analyze_step`][] reads it (`_step.py`).

Rows are frozen dataclasses of plain values (strings, ints, tuples), so that a
report is compared with `==`, written by `to_json` with sorted keys and nothing
that changes between runs (no timings, timestamps or addresses), and read back
by `from_json` field by field (`_json.py`). `diff` compares two reports by
leaf path: layout (spec, shape, dtype), communication per collective kind, and
memory.
"""

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from .._report import format_bytes, plain, Report, text_table
from .._tree import grouped_paths
from ._json import FORMAT, read_report
from ._records import (
    CollectivePart,
    CollectiveRow,
    COMMUNICATION,
    MovedInput,
    StepChange,
    StepDiff,
    StepLeaf,
    StepMemory,
    StepWarning,
    UNATTRIBUTED,
)
from ._time import StepTime


_TOP = 20  # collectives (and moved inputs) that `str(report)` lists


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
      [`StepLeaf`][eqshard._step._records.StepLeaf] per array, with the sharding
      the program uses (`out/...` for outputs).
    - `memory`: a [`StepMemory`][eqshard._step._records.StepMemory]: per-device
      bytes and `fits()`.
    - `collectives`: one [`CollectiveRow`][eqshard._step._records.CollectiveRow]
      per collective instruction, and per transfer between TPU slices over
      DCN (`dcn`), in program order.
    - `moved`: the [`MovedInput`][eqshard._step._records.MovedInput]s JAX moves
      at every call.
    - `warnings`: XLA's [`StepWarning`][eqshard._step._records.StepWarning]s of
      this compile.
    - `versions`: `(package, version)` of JAX, jaxlib and the target's compiler
      (`libtpu`, `jax-cuda12-plugin`) the step was compiled with.
    - `compiler_options`: the XLA options it was compiled with, as text.
    - `time`: a [`StepTime`][eqshard.StepTime], how long a
      step takes on the chips it was compiled for (a target mesh), estimated
      from the program; `None` where it cannot be, `time_note` saying why (on
      CPU, a chip without figures, unknown links).
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
    time: StepTime | None = None
    time_note: str = ""

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
    def dcn_bytes(self) -> int:
        """The bytes of `total_bytes` that move between TPU slices over DCN
        (rows whose `dcn` is set); what each device sends over it is the sum
        of those rows' `link_bytes * count`."""
        return sum(r.total_bytes for r in self.collectives if r.dcn)

    @property
    def exposed_bytes(self) -> int:
        """The bytes of `total_bytes` that the schedule does not overlap with
        computation (rows whose `overlapped` is False)."""
        return sum(r.total_bytes for r in self.collectives if r.overlapped is False)

    @property
    def unknown_overlap_bytes(self) -> int:
        """The bytes of `total_bytes` whose overlap the program's text does not
        tell (rows whose `overlapped` is None)."""
        return sum(r.total_bytes for r in self.collectives if r.overlapped is None)

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
            "total_bytes",
            "dcn_bytes",
            "exposed_bytes",
            "unknown_overlap_bytes",
        ):
            x, y = getattr(self, field), getattr(other, field)
            if x != y:
                changes.append(StepChange(COMMUNICATION, field, x, y))
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
        relative to the working directory of the analysis when under it, and to
        their `site-packages` in an installed package
        (`equinox/nn/_linear.py:97`)."""
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
        if self.dcn_bytes:
            lines.append(
                f"between slices over DCN: {format_bytes(self.dcn_bytes)} per "
                "device per step"
            )
        if self.exposed_bytes != self.total_bytes:
            lines.append(
                f"overlap with computation: {format_bytes(self.exposed_bytes)} "
                f"exposed, {format_bytes(self.unknown_overlap_bytes)} not known, "
                "the rest overlapped"
            )
        if self.collectives:
            axes = ", ".join(
                f"{k or 'none'} {format_bytes(v)}"
                for k, v in self.bytes_by_axes.items()
            )
            lines.append(f"by mesh axes: {axes}")
        if self.time is not None:
            lines.append(self.time.summary())
        elif self.time_note and m.platform != "cpu":
            lines.append(f"no time estimate: {self.time_note}")
        return "\n".join(lines)

    @staticmethod
    def _leaves_text(paths: tuple[str, ...], shapes: dict[str, tuple[int, ...]]) -> str:
        """A collective's leaves, an optimizer state's with their parameter's
        (`out/0/w (+ mu, nu)`, `shapes` by path), the first three groups and
        how many more."""
        groups = grouped_paths(paths, [shapes.get(p) for p in paths])
        text = ", ".join(group.name(paths) for group in groups[:3])
        if len(groups) > 3:
            text += f" (+{len(groups) - 3} more)"
        return text

    def _largest(
        self, top: int | None
    ) -> tuple[list[CollectiveRow], list[CollectiveRow]]:
        """The collectives largest first (bytes per step; program order among
        equals): the first `top` (all for `None`), and the rest."""
        if top is not None and top < 0:
            raise ValueError(
                f"eqshard.StepReport.table: `top` must be 0 or more (or None for "
                f"every row); got {top}."
            )
        rows = sorted(self.collectives, key=lambda row: -row.total_bytes)
        cut = len(rows) if top is None else top
        return rows[:cut], rows[cut:]

    def _rows(self, collectives: Sequence[CollectiveRow]) -> list[tuple[str, ...]]:
        rows = []
        shapes = {leaf.path: leaf.shape for leaf in self.arguments + self.outputs}
        for row in collectives:
            shape = " + ".join(str(p.shape) for p in row.parts[:3])
            if len(row.parts) > 3:
                shape += f" + {len(row.parts) - 3} more"
            count = (
                f"{row.count}{'?' if row.conditional or row.unknown_trip_count else ''}"
            )
            paths = self._leaves_text(row.paths, shapes)
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

    @staticmethod
    def _rest(rest: Sequence[CollectiveRow]) -> str:
        """The line for the collectives a table leaves out."""
        total = format_bytes(sum(row.total_bytes for row in rest))
        many = "collective" if len(rest) == 1 else "collectives"
        return (
            f"... and {len(rest)} more {many}, {total} per device per step "
            "(table(top=None) lists every one)"
        )

    def table(self, *, top: int | None = _TOP) -> str:
        """The summary, one line per collective (the `top` largest by bytes per
        step first, then how many more and their bytes; `top=None` for all), the
        inputs moved at every call, and XLA's warnings. `str(report)` is
        `report.table()`. An optimizer state's leaves are listed with their
        parameter's: `out/0/blocks/0/up/weight (+ mu, nu)`."""
        lines = [self.summary()]
        shown, rest = self._largest(top)
        if shown:
            lines.append("")
            lines += text_table(_COLUMNS, self._rows(shown))
        if rest:
            lines.append(self._rest(rest))
        if self.moved:
            lines.append("inputs moved at every call:")
            moved, paths = self.moved, [m.path for m in self.moved]
            groups = grouped_paths(paths, [(m.shape, m.have, m.want) for m in moved])
            cut = len(groups) if top is None else top
            for group in groups[:cut]:
                m = moved[group.leader]
                lines.append(f"  {group.name(paths)}: {m.have} -> {m.want}")
            if len(groups) > cut:
                rest = sum(len(group.members()) for group in groups[cut:])
                lines.append(f"  ... and {rest} more")
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
        shown, rest = self._largest(_TOP)
        if shown:
            table = Table(title="collectives per step, largest first")
            for header in _COLUMNS:
                table.add_column(header, overflow="fold")
            for row, cells in zip(shown, self._rows(shown), strict=True):
                style = None if any(p.paths for p in row.parts) else "dim"
                table.add_row(*cells, style=style)
            out.append(table)
        if rest:
            out.append(Text(self._rest(rest)))
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
