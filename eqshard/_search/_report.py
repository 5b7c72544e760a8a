"""The result of a layout search ([`eqshard.search_layout`][], `_search.py`): the
candidates compiled, those that fit ranked by communication, the rejected with
their figures, and the best one's rules and step report.

A candidate's `rules` are shown by `repr` of each value (`PartitionSpec(...)`,
`auto_fsdp(...)`), a function by its qualified name, so the text holds no object
addresses; `to_json` writes the same text with sorted keys and no timings, so a
search repeated on the same step gives the same bytes.
"""

import dataclasses
import json
from typing import Any

import jax
from jaxtyping import PyTree

from .._report import format_bytes, Report, text_table
from .._spectree._rules_syntax import value_text
from .._step._records import StepMemory
from .._step._report import StepReport


_FORMAT = 1  # the version of `to_json`'s format


def pattern_text(pattern: Any) -> str:
    return pattern if isinstance(pattern, str) else pattern.pattern


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class LayoutCandidate:
    """One layout of a [`eqshard.LayoutSearch`][], compiled.

    **Fields:**

    - `name`: `"fsdp(dp) x tp(tp)"` for a built-in strategy, the name you gave
      (or `"candidate 1"`, ...) for yours.
    - `origin`: `"built-in"` or `"given"`.
    - `rules`: the `(regex, value)` list, which
      `eqshard.match_partition_rules(rules, params, mesh=mesh)` turns into
      `specs`; `str(candidate.rules)` holds no object addresses.
    - `specs`: the spec tree of the parameters.
    - `report`: the compiled step's [`eqshard.StepReport`][].
    - `device_memory`: the budget it was judged against, in bytes.
    - `cost`: the bytes each device sends per step (the collectives' `link_bytes`
      times their count), each divided by the relative bandwidth of the slowest
      mesh axis it crosses.
    - `exposed_cost`: the part of `cost` the compiled schedule does not overlap
      with computation (collectives whose `overlapped` is False, or not known):
      what the ranking orders by first. On CPU, whose collectives are all
      synchronous, it is `cost`; on TPU and GPU targets the schedule decides.

    On a target mesh, `step_s` (the estimated seconds of a step,
    `report.time.step_s`) ranks the layouts that fit, and `mfu` is the
    program's FLOPs per step over those seconds at the chips' peak (it counts
    recomputed FLOPs: for the model's MFU, give
    [`eqshard.transformer_flops`][] to `report.time.mfu`).
    """

    name: str
    origin: str
    rules: list[tuple[Any, Any]]
    specs: PyTree
    report: StepReport
    device_memory: int
    cost: float
    file_text: str = dataclasses.field(repr=False)
    exposed_cost: float = 0.0

    @property
    def memory(self) -> StepMemory:
        """The compiled step's memory per device (`peak_bytes` decides the fit)."""
        return self.report.memory

    @property
    def total_bytes(self) -> int:
        """The collectives' bytes per device per step (`bytes * count`)."""
        return self.report.total_bytes

    @property
    def step_s(self) -> float | None:
        """The step's estimated seconds on the target (`None` on CPU)."""
        time = self.report.time
        return None if time is None else time.step_s

    @property
    def mfu(self) -> float | None:
        """The program's FLOPs over `step_s` at the chips' peak (`None` on
        CPU)."""
        time = self.report.time
        return None if time is None else time.mfu(time.flops * time.devices)

    @property
    def headroom(self) -> int:
        """`device_memory - peak_bytes`: negative when it does not fit."""
        return self.device_memory - self.memory.peak_bytes

    @property
    def fits(self) -> bool:
        """Whether the compiled peak fits in `device_memory`."""
        return self.headroom >= 0

    @property
    def why(self) -> str:
        """Why it was rejected (`""` if it fits)."""
        if self.fits:
            return ""
        return (
            f"compiled peak {format_bytes(self.memory.peak_bytes)} is over the "
            f"budget of {format_bytes(self.device_memory)} by "
            f"{format_bytes(-self.headroom)}"
        )

    def rules_text(self) -> str:
        """The layout as a rules file (the `--rules` format of `python -m
        eqshard`): a concrete spec per group of paths that differ only in layer
        numbers, read back by the command and by `match_partition_rules` after
        parsing."""
        return self.file_text

    def rule_lines(self) -> list[str]:
        """The rules, one a line: the regex, then the value."""
        return [f"{pattern_text(r)}  {value_text(v)}" for r, v in self.rules]

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines = [
            f"{self.name} ({self.origin}): {verdict}, peak "
            f"{format_bytes(self.memory.peak_bytes)} of "
            f"{format_bytes(self.device_memory)}, communication "
            f"{format_bytes(self.total_bytes)} per step"
        ]
        return "\n".join(lines + [f"  {line}" for line in self.rule_lines()])

    def __repr__(self) -> str:
        return (
            f"LayoutCandidate(name={self.name!r}, fits={self.fits}, "
            f"peak_bytes={self.memory.peak_bytes}, total_bytes={self.total_bytes}, "
            f"cost={self.cost:.0f})"
        )

    def _plain(self) -> dict[str, Any]:
        memory = dataclasses.asdict(self.memory)
        memory["peak_bytes"] = self.memory.peak_bytes
        return {
            "name": self.name,
            "origin": self.origin,
            "rules": [[pattern_text(r), value_text(v)] for r, v in self.rules],
            "rules_text": self.file_text,
            "fits": self.fits,
            "memory": memory,
            "total_bytes": self.total_bytes,
            "cost": self.cost,
            "exposed_cost": self.exposed_cost,
            "step_s": self.step_s,
            "bytes_by_axes": self.report.bytes_by_axes,
        }


@dataclasses.dataclass(frozen=True, repr=False)
class LayoutSearch(Report):
    """The layouts [`eqshard.search_layout`][] compiled: those that fit, ranked
    by a step's estimated seconds on a target mesh (by communication on CPU),
    then those that do not, by peak memory.

    `str(result)` is the ranking and the best layout's rules (or, when nothing
    fits, the smallest peak and how far over budget it is); `result.show()`
    prints it with `rich` when installed; `result.to_json()` is byte-stable.

    **Fields:**

    - `function`: the step's name.
    - `mesh`: the mesh's `(axis, size)` pairs.
    - `device_memory`: the budget per device, in bytes.
    - `data_axes`: the mesh axes that split the batch's leading dimension (all
      axes when none does), which FSDP shards over.
    - `bandwidth`: the relative bandwidth of each mesh axis used in `cost`.
    - `candidates`: the [`LayoutCandidate`][eqshard.LayoutCandidate]s, ranked.
    - `skipped`: `(name, why)` of the layouts not compiled: the same layout as
      an earlier one, beyond `max_candidates` or the time budget, or, on
      Explicit axes, one with which JAX cannot type the step (why says where).
    - `unpaired`: the paths of the matrices (and convolutions) that the
      built-in tensor-parallel candidates found no pair for, in the step's data
      flow: they are replicated there (or, with the vocabulary, split on their
      output where they widen, as a head).
    """

    function: str
    mesh: tuple[tuple[str, int], ...]
    device_memory: int
    data_axes: tuple[str, ...]
    bandwidth: tuple[tuple[str, float], ...]
    candidates: tuple[LayoutCandidate, ...]
    skipped: tuple[tuple[str, str], ...] = ()
    unpaired: tuple[str, ...] = ()

    @property
    def best(self) -> LayoutCandidate | None:
        """The first candidate that fits, or `None` if none does."""
        first = self.candidates[0] if self.candidates else None
        return first if first is not None and first.fits else None

    @property
    def smallest_peak(self) -> LayoutCandidate | None:
        """The candidate with the smallest compiled peak."""
        if not self.candidates:
            return None
        return min(self.candidates, key=lambda c: c.memory.peak_bytes)

    def summary(self) -> str:
        fitting = sum(c.fits for c in self.candidates)
        lines = [
            f"layout search for step {self.function!r} on mesh {dict(self.mesh)}: "
            f"{len(self.candidates)} layouts compiled, {fitting} fit in "
            f"{format_bytes(self.device_memory)} per device",
            f"data axes: {', '.join(self.data_axes)}",
        ]
        best, smallest = self.best, self.smallest_peak
        if best is not None:
            seconds = "" if best.step_s is None else f", step {best.step_s:.4g} s"
            lines.append(
                f"best: {best.name}, peak {format_bytes(best.memory.peak_bytes)}, "
                f"communication {format_bytes(best.total_bytes)} per step{seconds}"
            )
        elif smallest is not None:
            lines.append(
                f"nothing fits: the smallest peak is "
                f"{format_bytes(smallest.memory.peak_bytes)} ({smallest.name}), "
                f"{format_bytes(-smallest.headroom)} over the budget. Add devices, "
                "lower the batch per device, or remat activations."
            )
        timed = bool(self.candidates) and all(
            c.step_s is not None for c in self.candidates
        )
        lines.append(
            "ranked by a step's estimated seconds on the target's chips"
            if timed
            else "ranked by the communication left exposed, in bytes (no time "
            "estimate without a target: compile for one, create_mesh(target=...))"
        )
        return "\n".join(lines)

    def _rows(self) -> list[tuple[str, ...]]:
        rows = []
        for rank, c in enumerate(self.candidates, start=1):
            rows.append(
                (
                    str(rank) if c.fits else "-",
                    c.name,
                    format_bytes(c.memory.peak_bytes),
                    format_bytes(c.headroom)
                    if c.fits
                    else f"over by {format_bytes(-c.headroom)}",
                    format_bytes(c.total_bytes),
                    format_bytes(round(c.cost)),
                    "-" if c.step_s is None else f"{c.step_s:.4g} s",
                    "-" if c.mfu is None else f"{c.mfu:.1%}",
                )
            )
        return rows

    def table(self) -> str:
        """The summary, the ranking, what was not compiled, and the best rules."""
        lines = [self.summary(), "", *text_table(_COLUMNS, self._rows())]
        for name, why in self.skipped:
            lines.append(f"not compiled: {name} ({why})")
        if self.unpaired:
            lines.append(self._unpaired_line())
        best = self.best
        if best is not None:
            lines += ["", f"rules of {best.name}:"]
            lines += [f"  {line}" for line in best.rule_lines()]
        return "\n".join(lines)

    def _unpaired_line(self) -> str:
        shown = ", ".join(self.unpaired[:_UNPAIRED_SHOWN])
        more = len(self.unpaired) - _UNPAIRED_SHOWN
        rest = f" and {more} more (`.unpaired`)" if more > 0 else ""
        return (
            f"not paired for tensor parallelism ({len(self.unpaired)}): {shown}{rest}"
        )

    def _summary(self) -> dict[str, Any]:
        best = self.best
        return {
            "function": repr(self.function),
            "candidates": len(self.candidates),
            "fit": sum(c.fits for c in self.candidates),
            "best": repr(best.name) if best is not None else None,
            "mesh": dict(self.mesh),
        }

    def _rich_width(self) -> int:
        # The rows on one line each: padding and a border a cell.
        rows = [_COLUMNS, *self._rows()]
        return 1 + sum(max(len(r[i]) for r in rows) + 3 for i in range(len(_COLUMNS)))

    def _rich(self) -> list[Any]:
        from rich.table import Table
        from rich.text import Text

        table = Table(title="layouts, ranked")
        for header in _COLUMNS:
            table.add_column(header, no_wrap=True)
        for c, cells in zip(self.candidates, self._rows(), strict=True):
            table.add_row(*cells, style=None if c.fits else "dim")
        out: list[Any] = [Text(self.summary()), table]
        out += [Text(f"not compiled: {name} ({why})") for name, why in self.skipped]
        if self.unpaired:
            out.append(Text(self._unpaired_line()))
        best = self.best
        if best is not None:
            out.append(Text(f"rules of {best.name}:"))
            out += [Text(f"  {line}") for line in best.rule_lines()]
        return out

    def _json(self) -> Any:
        # The candidates in rank order with their rules, memory and
        # communication, what was skipped, and the best candidate's step report.
        best = self.best
        data = {
            "format": _FORMAT,
            "jax": jax.__version__,
            "function": self.function,
            "mesh": [list(pair) for pair in self.mesh],
            "device_memory": self.device_memory,
            "data_axes": list(self.data_axes),
            "bandwidth": dict(self.bandwidth),
            "candidates": [c._plain() for c in self.candidates],
            "skipped": [list(pair) for pair in self.skipped],
            "unpaired": list(self.unpaired),
            "best": best.name if best is not None else None,
            "best_report": json.loads(best.report.to_json()) if best else None,
        }
        return data


_UNPAIRED_SHOWN = 8  # names in the text; all of them in `unpaired` and the JSON
_COLUMNS = (
    "rank",
    "layout",
    "peak",
    "headroom",
    "communication",
    "cost",
    "step",
    "mfu",
)
