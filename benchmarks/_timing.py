"""The timing harness every benchmark script shares, and its results as JSON.

Timing:

- `once(fn)`: one call of `fn` timed with the garbage collector fixed: a
  `gc.collect()` before, the collector off during the call (results blocked
  with `jax.block_until_ready`), on again after.
- `interleaved({name: fn}, runs)`: `runs` rounds of one timed call of each
  variant in turn (so load from other processes hits every variant alike),
  returning a `Times` (min and median) per variant.
- `table(rows)`: prints an aligned table of `(case, eqshard, hand-written)` rows
  with the min and median of each, the ratio of the medians and of the mins
  (eqshard / hand-written: below 1 is faster than by hand), and returns it as a
  JSON table.

Results (what `benchmarks/render.py` turns into `benchmarks/README.md`'s tables):

- `add_json_option(parser)`: the script's `--json PATH` option.
- `as_table(columns, rows)`: a JSON table of any other columns (cells become
  strings; `None` becomes "-").
- `write_json(__file__, {name: table}, path=args.json)`: writes
  `{"script", "command", "date", "machine", "versions", "commit", "source",
  "tables"}` to `path`, by default `benchmarks/results/<script>.json`, and
  returns the path. `machine["kind"]` says what ran it ("8 cpu devices, 2
  cores"). A JSON table is `{"columns": [...], "rows": [[str, ...], ...]}`,
  with an optional `"title"` and `"unit"`.

A script adopts the results in two lines:

    add_json_option(parser)                                  # after its options
    write_json(__file__, {"main": table(rows)}, path=args.json)  # at the end

The name of each table (`"main"`) is what README.md's marker
`<!-- table SCRIPT:NAME -->` asks for.
"""

import argparse
import dataclasses
import datetime
import gc
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax


UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6}
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
Table = dict[str, Any]  # {"columns": [...], "rows": [[...]], "title"?, "unit"?}


@dataclasses.dataclass(frozen=True)
class Times:
    """The seconds of each run of one variant."""

    seconds: tuple[float, ...]

    @property
    def min(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def once(
    fn: Callable[..., Any],
    *,
    setup: Callable[[], Any] | None = None,
    start: Callable[[], Any] | None = None,
    calls: int = 1,
    block: bool = True,
) -> tuple[float, Any]:
    """Seconds per call of `calls` calls of `fn` (of `fn(setup())` if `setup` is
    given; `setup` is not timed), and the last result. The collector runs before
    and is off while timing; `start()` runs untimed after it, right before the
    clock starts (e.g. a barrier that lines processes up: a collection takes tens
    of ms, a different time on each process). Every result is blocked on: before
    the clock stops, or with `block=False` after it stops (to time dispatch
    alone)."""
    arg = setup() if setup is not None else None
    gc.collect()
    if start is not None:
        start()
    gc.disable()
    try:
        seconds = 0.0
        for _ in range(calls):
            start = time.perf_counter()
            out = fn() if setup is None else fn(arg)
            if block:
                jax.block_until_ready(out)
            seconds += time.perf_counter() - start
            jax.block_until_ready(out)
    finally:
        gc.enable()
    return seconds / calls, out


def interleaved(
    variants: Mapping[str, Callable[..., Any]],
    runs: int,
    *,
    setup: Callable[[], Any] | None = None,
    before: Callable[[], Any] | None = None,
    start: Callable[[], Any] | None = None,
    check: Callable[[str, Any], Any] | None = None,
    warmup: bool = True,
    calls: int = 1,
    block: bool = True,
) -> dict[str, Times]:
    """`runs` rounds of one timed `once` of every variant, round-robin (the
    order rotated each round, so that no variant always runs first).

    `before()` runs untimed before each call (for example `jax.clear_caches` for
    cold runs); `check(name, result)` checks each result, untimed; `warmup` calls
    each variant once first, untimed; `start`, `calls` and `block` are
    `once`'s."""
    names = list(variants)
    if warmup:
        for name in names:
            if before is not None:
                before()
            once(variants[name], setup=setup, start=start)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(runs):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            if before is not None:
                before()
            seconds, out = once(
                variants[name], setup=setup, start=start, calls=calls, block=block
            )
            if check is not None:
                check(name, out)
            del out
            times[name].append(seconds)
    return {name: Times(tuple(ts)) for name, ts in times.items()}


def table(
    rows: Sequence[tuple[Any, ...]],
    *,
    unit: str = "s",
    ours: str = "eqshard",
    theirs: str = "by hand",
    columns: Sequence[str] = (),
    title: str | None = None,
) -> Table:
    """Print `(case, eqshard Times, hand-written Times, *extra)` rows aligned:
    min and median of each in `unit`, the ratio of the medians and of the mins
    (eqshard / hand-written), then the extra cells under `columns`. A row whose
    hand-written `Times` is None shows eqshard's times only. Returns the same
    cells as a JSON table (`as_table`) for `write_json`."""
    scale = UNITS[unit]
    header = (
        "case",
        f"{ours} min",
        f"{ours} median",
        f"{theirs} min",
        f"{theirs} median",
        "x median",
        "x min",
        *columns,
    )
    body = []
    for case, mine, hand, *extra in rows:
        cells = [str(case), f"{mine.min * scale:.3f}", f"{mine.median * scale:.3f}"]
        if hand is None:
            cells += ["-", "-", "-", "-"]
        else:
            cells += [
                f"{hand.min * scale:.3f}",
                f"{hand.median * scale:.3f}",
                f"{mine.median / hand.median:.2f}",
                f"{mine.min / hand.min:.2f}",
            ]
        body.append((*cells, *(str(x) for x in extra)))
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    print(f"({unit}; x = {ours} / {theirs}, below 1 is faster than {theirs})")
    for i, row in enumerate([header, *body]):
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(w) for cell, w in zip(row[1:], widths[1:])]
        print("  ".join(cells).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    return as_table(header, body, title=title, unit=unit)


def as_table(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    title: str | None = None,
    unit: str | None = None,
) -> Table:
    """A JSON table: every cell a string (`None` is "-", floats as given to
    `str`; format them first for fewer digits)."""
    cell = lambda x: "-" if x is None else str(x)  # noqa: E731
    out: Table = {"columns": [str(c) for c in columns]}
    out["rows"] = [[cell(x) for x in row] for row in rows]
    if title is not None:
        out["title"] = title
    if unit is not None:
        out["unit"] = unit
    return out


def add_json_option(parser: argparse.ArgumentParser) -> None:
    """The `--json PATH` option every script takes (default
    `benchmarks/results/<script>.json`)."""
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="where to write the results (default: benchmarks/results/<script>.json)",
    )


def _machine(kind: str | None) -> dict[str, Any]:
    """What ran the script: JAX's devices (unless `kind` says), the host's cores
    and load."""
    devices = jax.devices()
    plural = "s" if len(devices) > 1 else ""
    if kind is None and devices[0].platform == "cpu":
        kind = f"{len(devices)} cpu device{plural}, {os.cpu_count()} cores"
    elif kind is None:
        kind = f"{len(devices)} x {devices[0].device_kind}, {os.cpu_count()} cores"
    return {
        "kind": kind,
        "device_kind": devices[0].device_kind,
        "host": f"{platform.system()} {platform.machine()}",
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def _commit() -> str | None:
    """The repository's commit (with "+changes" when the tree differs), if git
    can tell."""
    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        git = ["git", "-C", str(root)]
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def _dumps(record: Any, depth: int = 0) -> str:
    """`record` as indented JSON with each list of plain values (a table's
    columns, each of its rows) on one line, so that diffs show rows."""
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(record, Mapping) and record:
        items = [
            f"{inner}{json.dumps(str(k))}: {_dumps(v, depth + 1).strip()}"
            for k, v in record.items()
        ]
        text = "{\n" + ",\n".join(items) + f"\n{pad}}}"
    elif isinstance(record, list | tuple) and any(
        isinstance(x, Mapping | list | tuple) for x in record
    ):
        items = [inner + _dumps(x, depth + 1).strip() for x in record]
        text = "[\n" + ",\n".join(items) + f"\n{pad}]"
    else:
        text = json.dumps(record, ensure_ascii=False)
    return text + "\n" if depth == 0 else text


def write_json(
    script: str,
    tables: Mapping[str, Table],
    *,
    path: str | os.PathLike[str] | None = None,
    source: str = "measured",
    machine: str | None = None,
) -> pathlib.Path:
    """Write the results of `script` (pass `__file__`) to `path` (default
    `benchmarks/results/<script>.json`) and return the path written.

    `tables` maps a name to a JSON table (what `table` returns, or `as_table`'s).
    The file also records the command line, the date (UTC), the machine (its
    `kind` read from this process's JAX devices unless `machine` says, as for
    a script whose devices are in child processes), the versions of Python, JAX
    and eqshard, and the git commit."""
    import importlib.metadata

    name = pathlib.Path(script).name
    out = pathlib.Path(path) if path is not None else RESULTS / (name[:-3] + ".json")
    try:
        eqshard_version = importlib.metadata.version("eqshard")
    except importlib.metadata.PackageNotFoundError:
        eqshard_version = None
    record = {
        "script": name,
        "command": " ".join(["python", f"benchmarks/{name}", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "machine": _machine(machine),
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "eqshard": eqshard_version,
        },
        "commit": _commit(),
        "source": source,
        "tables": dict(tables),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_dumps(record))
    print(f"results written to {out}")
    return out
