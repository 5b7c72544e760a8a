"""The command's rules files and sizes: `--rules FILE` read into partition rules
(one `REGEX VALUE` or `REGEX -> VALUE` a line, values in the syntax of
`_spectree/_rules_syntax.py`), and `--size` read as a parameter count."""

import re
from typing import Any

from .._spectree._rules_syntax import parse_rule, VALUE_CALLS
from ._load import UsageError


_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_MIN_SIZE = 10**6


def parse_size(text: str) -> int:
    """A parameter count such as `125M`, `1.5B` or `70B`."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMBGT]?)\s*", text, re.I)
    if match is None:
        raise UsageError(
            f"--size {text!r} is not a parameter count; write a number with an "
            "optional K, M, B or T suffix, e.g. 125M, 1B, 70B"
        )
    size = round(float(match[1]) * _UNITS[match[2].upper()])
    if size < _MIN_SIZE:
        raise UsageError(
            f"--size {text!r} is below the planner's minimum of 1M parameters; "
            "smaller models run for real without --size"
        )
    return size


def _rules_error(path: str, number: int, line: str, problem: str) -> UsageError:
    return UsageError(f"--rules {path}, line {number}: {problem}: {line.strip()!r}")


def _split_rule(stripped: str) -> tuple[str, str] | None:
    """A rule line's regex and value: `REGEX -> VALUE` (the value may have
    spaces), `REGEX P(...)` or `REGEX stacked(...)` (a call after a space), or
    `REGEX SPEC` (the spec is the last field); `None` if there is one field
    only."""
    if "->" in stripped:
        regex, _, spec = stripped.rpartition("->")
        return regex.strip(), spec
    if stripped.endswith(")"):
        for name in VALUE_CALLS:  # the first call after a space
            found = re.search(rf"\s({name}\s*\()", stripped)
            if found is not None:
                return stripped[: found.start()].strip(), stripped[found.start(1) :]
    start = stripped.rfind("P(")
    if stripped.endswith(")") and start > 0 and stripped[start - 1].isspace():
        return stripped[:start].strip(), stripped[start:]
    fields = stripped.split()
    if len(fields) < 2:
        return None
    return stripped[: -len(fields[-1])].strip(), fields[-1]


def parse_rules(text: str, path: str) -> list[tuple[str, Any]]:
    """The rules of a rules file: one `REGEX VALUE` (or `REGEX -> VALUE`) a line,
    `#` comment lines; a value is a spec in `_rules_syntax.parse_spec`'s syntax
    or a call on one, `stacked(P('tp', None))` (`parse_value`)."""
    rules = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        split = _split_rule(stripped)
        if split is None:
            raise _rules_error(
                path, number, line, "expected a regex, then a spec such as dp,tp"
            )
        regex, spec_text = split
        if not regex:
            raise _rules_error(path, number, line, "expected a regex before the spec")
        if regex.endswith((",", ".", "+")) and "->" not in stripped:
            # `attn  dp, tp`: without this, `dp,` would silently end the regex.
            raise _rules_error(
                path,
                number,
                line,
                "a spec without '->' before it has no spaces (attn dp,tp); "
                "write 'REGEX -> SPEC' to space it out",
            )
        try:
            _, spec = parse_rule(regex, spec_text, values=True)
        except ValueError as error:
            raise _rules_error(path, number, line, str(error)) from None
        rules.append((regex, spec))
    if not rules:
        raise UsageError(f"--rules {path}: the file has no rules")
    return rules


def read_rules(path: str) -> list[tuple[str, Any]]:
    try:
        with open(path) as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise UsageError(f"--rules {path}: cannot read the file ({reason})") from None
    return parse_rules(text, path)
