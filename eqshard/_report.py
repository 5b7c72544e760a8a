"""What every report shares: `str`, a one-line `repr`, `show` and `to_json`; and
amounts of memory, written (`format_bytes`; a summary's row, `memory_row`) and
read (`parse_bytes`), and aligned text tables (`text_table`).

The reports (`ShardingReport`, `TrainingPlan`, `RulesReport`, `LayoutReport`,
`StepReport`) are frozen dataclasses deriving from `Report`, which gives them one
interface: `str(report)` is `report.table()`, `repr(report)` one line of the
numbers `_summary()` names, `report.show(file=None)` prints with `rich` when it
is installed (imported only then) and as the table otherwise, and
`report.to_json()` is a `str` with sorted keys that the same report always
writes byte for byte (`plain` turns meshes, specs and functions into text that
does not change between runs).
"""

import dataclasses
import functools
import io
import json
import re
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any, IO

import numpy as np
from jax.sharding import AbstractMesh, Mesh


def format_bytes(n: int) -> str:
    """`n` bytes in binary units: `"64 B"`, `"1.5 KiB"`, `"3.2 GiB"`."""
    if abs(n) < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "PiB":
            break
    return f"{value:.1f} {unit}"


def memory_row(name: str, nbytes: int, more: str = "") -> str:
    """A row of a memory summary (`TrainingPlan.summary`): the part's name, its
    bytes, then what `more` says of them (`"(...)"`, `"of 16.0 GiB: fits"`)."""
    return f"  {name:<16} {format_bytes(nbytes):>10}" + (f"   {more}" if more else "")


_BYTE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_bytes(text: str | int, *, caller: str = "plan_training") -> int:
    """A number of bytes: an int, or a string such as `"80GiB"`, `"16 GB"`,
    `"1.5TiB"` (GiB = 2**30 bytes, GB = 10**9)."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?I?B?)\s*", text, re.I)
        if match is None or match[2].upper() not in _BYTE_UNITS:
            raise ValueError(
                f"eqshard.{caller}: {text!r} is not an amount of memory; write a "
                "number of bytes with an optional unit, e.g. 80GiB, 16GB, 512MiB."
            )
        value = round(float(match[1]) * _BYTE_UNITS[match[2].upper()])
    if value <= 0:
        raise ValueError(
            f"eqshard.{caller}: the memory must be positive; got {text!r}."
        )
    return value


def text_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool] = ()
) -> list[str]:
    """The lines of an aligned text table: `header`, then `rows`, columns two
    spaces apart, those marked in `right` right-aligned (the others left)."""
    lines = [header, *rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    aligned = right or (False,) * len(header)
    return [
        "  ".join(
            cell.rjust(width) if r else cell.ljust(width)
            for cell, width, r in zip(line, widths, aligned, strict=True)
        ).rstrip()
        for line in lines
    ]


_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def plain(value: Any) -> Any:
    """`value` in JSON's types, the same on every run: dataclasses as dicts of their
    fields, tuples and lists as lists, meshes as `[axis, size]` pairs (in the
    mesh's order), NumPy numbers as numbers, functions by their qualified name,
    other callables (a rule's value, such as `auto_fsdp(...)`) as written, and
    anything else that is not a JSON value (specs, logical names, shardings)
    as its `str`."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.integer | np.floating | np.bool_):
        return value.item()
    if isinstance(value, Mesh | AbstractMesh):
        return [[name, int(size)] for name, size in value.shape.items()]
    if type(value) in (tuple, list):
        return [plain(v) for v in value]
    if isinstance(value, functools.partial):
        value = value.func
    if isinstance(value, _FUNCTIONS):
        return f"{value.__module__}.{value.__qualname__}"
    if callable(value):  # a rule's value, such as `auto_fsdp(...)`: as written
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return {f.name: plain(getattr(value, f.name)) for f in fields}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return str(value)


class Report:
    """The base of every report. A report defines `table()` (its text) and
    `_summary()` (the numbers of its one-line `repr`), and may define `_rich()`
    (what `show` prints with `rich`) and `_json()` (what `to_json` writes)."""

    def table(self) -> str:
        raise NotImplementedError

    def _summary(self) -> dict[str, Any]:
        raise NotImplementedError

    def _rich(self) -> list[Any]:
        """The `rich` renderables `show` prints: by default the table, as text."""
        from rich.text import Text

        return [Text(self.table())]

    def _json(self) -> Any:
        return plain(self)

    def _rich_width(self) -> int:
        """The width `show` needs for `_rich()`'s rows to stay on one line each
        (0: the console's own)."""
        return 0

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value}" for name, value in self._summary().items())
        return f"{type(self).__name__}({fields})"

    def show(self, file: io.TextIOBase | None = None) -> None:
        """Prints the report to `file` (standard output by default): with `rich`
        (tables and colours) when it is installed, as `report.table()` otherwise."""
        try:
            from rich.console import Console
        except ImportError:
            print(self.table(), file=file or sys.stdout)
            return
        console = Console(file=typing.cast(IO[str] | None, file))
        if console.width < self._rich_width():
            console = Console(
                file=typing.cast(IO[str] | None, file), width=self._rich_width()
            )
        for renderable in self._rich():
            console.print(renderable)

    def to_json(self) -> str:
        """The report as JSON: sorted keys, and nothing that changes between runs
        (no timings, timestamps or addresses), so the same report gives the same
        bytes."""
        return json.dumps(self._json(), sort_keys=True, indent=1)
