"""Reading a step report back from its JSON (`StepReport.from_json`).

`to_json` writes `plain(report)`: each frozen dataclass an object of its
fields, tuples as lists, plus the format's version and JAX's. `read_report`
checks the whole document against the dataclasses' type hints before anything
is built (every field there, of its type, integers not below their least value
nor above 64 bits, closed vocabularies kept, nothing else), collecting every
`Problem` with its JSON path, and raises one `ValueError` listing the first few.
"""

import dataclasses
import json
import typing
from typing import Any


FORMAT = 4  # the version of `to_json`'s format
# Earlier formats still read: their reports lack fields added since, which
# take their defaults (format 1: the host bytes, platform and device memory,
# versions and compiler options, whether a collective overlaps; format 2: the
# step's time and each collective's seconds; format 3: whether a collective
# is a transfer between slices over DCN).
_READABLE = (1, 2, 3, 4)

MISSING: Any = object()  # a field not in the document
UNSHOWN: Any = object()  # a problem with the text, not with a value
_SHOWN = 5  # problems listed in one message
_MOST = 2**63 - 1  # the largest integer a report holds (XLA's are int64)


@dataclasses.dataclass(frozen=True)
class Problem:
    """A field that is wrong: its JSON path, what it should hold, and what it
    holds (`MISSING`, or `UNSHOWN` for a problem with the text itself)."""

    path: str
    expected: str
    value: Any


@dataclasses.dataclass
class _Reader:
    """Builds dataclasses from `plain`'s dicts, field by field, collecting the
    problems. `choices`: the values a `(class, field)` may take; `least`: the
    least value of an integer `(class, field)` (0 unless named)."""

    choices: dict[tuple[type, str], tuple[str, ...]]
    least: dict[tuple[type, str], int]
    problems: list[Problem] = dataclasses.field(default_factory=list)
    defaults: bool = False  # whether a missing field with a default takes it

    def checked(self, cls: type, data: Any, path: str) -> Any:
        """The dataclass `cls` from its dict, or `None` with its problems added."""
        if not isinstance(data, dict):
            self.problems.append(Problem(path, f"an object ({cls.__name__})", data))
            return None
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        names = {f.name for f in fields}
        for key in data:
            if key not in names:
                shown = key if len(key) <= 40 else key[:37] + "..."
                where = f"{path}/{shown}" if path else shown
                expected = f"no field here ({cls.__name__} has none)"
                self.problems.append(Problem(where, expected, data[key]))
        kwargs = {}
        count = len(self.problems)
        for f in fields:
            where = f"{path}/{f.name}" if path else f.name
            if f.name not in data:
                has_default = f.default is not dataclasses.MISSING or (
                    f.default_factory is not dataclasses.MISSING
                )
                if not (self.defaults and has_default):
                    expected = _expected(hints[f.name])
                    self.problems.append(Problem(where, expected, MISSING))
                continue
            least = self.least.get((cls, f.name), 0)
            value = self.value(hints[f.name], data[f.name], where, least=least)
            choices = self.choices.get((cls, f.name))
            if choices is not None and type(value) is str and value not in choices:
                listed = ", ".join(repr(c) for c in choices)
                self.problems.append(Problem(where, f"one of {listed}", value))
            kwargs[f.name] = value
        return cls(**kwargs) if len(self.problems) == count else None

    def value(self, hint: Any, value: Any, path: str, *, least: int = 0) -> Any:
        """`value` as `hint` says (a dataclass, a tuple, a string, an integer of
        at least `least`, a bool), or `None` with its problems added."""
        if dataclasses.is_dataclass(hint):
            return self.checked(typing.cast(type, hint), value, path)
        optional = _optional(hint)
        if optional is not None:
            if value is None:
                return None
            return self.value(optional, value, path, least=least)
        if typing.get_origin(hint) is tuple:
            return self.items(hint, value, path)
        if hint is float and type(value) in (int, float):
            if value < 0:
                self.problems.append(Problem(path, "a number of at least 0", value))
                return None
            return float(value)
        # `type(...) is`: JSON's `true` is no integer here, nor `1` a bool.
        if type(value) is not hint:
            self.problems.append(Problem(path, _expected(hint), value))
            return None
        if hint is int and value < least:
            self.problems.append(
                Problem(path, f"an integer of at least {least}", value)
            )
            return None
        if hint is int and value > _MOST:  # XLA's figures are 64-bit
            self.problems.append(Problem(path, "an integer below 2**63", value))
            return None
        return value

    def items(self, hint: Any, value: Any, path: str) -> tuple[Any, ...] | None:
        """A list as the tuple `hint` says, each item checked."""
        args = typing.get_args(hint)
        if not isinstance(value, list):
            self.problems.append(Problem(path, _expected(hint), value))
            return None
        if len(args) == 2 and args[1] is Ellipsis:
            args = (args[0],) * len(value)
        elif len(args) != len(value):
            self.problems.append(Problem(path, f"a list of {len(args)} items", value))
            return None
        return tuple(
            self.value(a, v, f"{path}/{i}")
            for i, (a, v) in enumerate(zip(args, value, strict=True))
        )


def read_report(
    cls: type,
    text: str | bytes,
    *,
    choices: dict[tuple[type, str], tuple[str, ...]],
    least: dict[tuple[type, str], int],
) -> Any:
    """The report `cls` that `to_json` wrote as `text`; raises `_json_error`
    with every problem found."""
    try:
        data = json.loads(text)
    except RecursionError:
        problem = Problem("", "JSON nested at most a few levels deep", UNSHOWN)
        raise _json_error([problem]) from None
    except (ValueError, TypeError) as e:
        raise _json_error([Problem("", f"JSON text ({e})", UNSHOWN)]) from None
    reader = _Reader(choices, least)
    if not isinstance(data, dict):
        raise _json_error([Problem("", "an object", data)])
    data = dict(data)
    version = data.pop("format", MISSING)
    if type(version) is not int or version not in _READABLE:
        listed = " or ".join(map(str, _READABLE))
        reader.problems.append(Problem("format", f"a format version {listed}", version))
    reader.defaults = version != FORMAT
    version = data.pop("jax", MISSING)
    if type(version) is not str:
        reader.problems.append(Problem("jax", "the JAX version, a string", version))
    report = reader.checked(cls, data, "")
    if reader.problems:
        raise _json_error(reader.problems)
    return report


def _optional(hint: Any) -> Any:
    """`X` of a hint `X | None`, else `None`."""
    args = typing.get_args(hint)
    if type(None) in args and len(args) == 2:
        return next(a for a in args if a is not type(None))
    return None


def _expected(hint: Any) -> str:
    optional = _optional(hint)
    if optional is not None:
        return f"{_expected(optional)} or null"
    if dataclasses.is_dataclass(hint):
        return f"an object ({typing.cast(type, hint).__name__})"
    if typing.get_origin(hint) is tuple:
        return "a list"
    return {
        str: "a string",
        int: "an integer",
        bool: "true or false",
        float: "a number",
    }[hint]


def _got(value: Any) -> str:
    """A value as a message shows it: short, and a list or object by its size."""
    if value is MISSING:
        return "nothing (the field is missing)"
    if isinstance(value, list | dict):  # not its repr: it may be large
        return f"{'a list' if isinstance(value, list) else 'an object'} of " + (
            f"{len(value)} items"
        )
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"{shown} ({type(value).__name__})"


def _json_error(problems: list[Problem]) -> ValueError:
    """The one message of `from_json`: what each wrong field should hold, at its
    JSON path, and how to fix it."""
    lines = []
    for problem in problems[:_SHOWN]:
        where = f"at '{problem.path}'" if problem.path else "at the top level"
        found = "" if problem.value is UNSHOWN else f", got {_got(problem.value)}"
        lines.append(f"  {where}: expected {problem.expected}{found}")
    if len(problems) > _SHOWN:
        lines.append(f"  and {len(problems) - _SHOWN} more")
    return ValueError(
        "eqshard.StepReport.from_json: the text is not a step report written by "
        f"StepReport.to_json (format {FORMAT}):\n"
        + "\n".join(lines)
        + "\nRead only what to_json wrote, or write the report again with "
        "eqshard.analyze_step(...).to_json()."
    )
