"""The timing harness every benchmark script shares.

- `once(fn)`: one call of `fn` timed with the garbage collector fixed: a
  `gc.collect()` before, the collector off during the call (results blocked
  with `jax.block_until_ready`), on again after.
- `interleaved({name: fn}, runs)`: `runs` rounds of one timed call of each
  variant in turn (so load from other processes hits every variant alike),
  returning a `Times` (min and median) per variant.
- `table(rows)`: an aligned table of `(case, eqshard, hand-written)` rows with
  the min and median of each, the ratio of the medians and of the mins
  (eqshard / hand-written: below 1 is faster than by hand).
"""

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax


UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6}


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
) -> None:
    """Print `(case, eqshard Times, hand-written Times, *extra)` rows aligned:
    min and median of each in `unit`, the ratio of the medians and of the mins
    (eqshard / hand-written), then the extra cells under `columns`. A row whose
    hand-written `Times` is None shows eqshard's times only."""
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
