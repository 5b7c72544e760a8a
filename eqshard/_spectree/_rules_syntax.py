"""The text syntax of specs and rules: one spec syntax (`SPEC_SYNTAX`, read by
`parse_spec`) for the rules files of `python -m eqshard --rules` and the rule
strings of `eqshard.compat.create_pattern_based_partition_spec`, and `parse_rule`
for a rule written as a regex and a spec. Each raises a bare `ValueError` saying
what is wrong; its caller adds where.
"""

import ast
import re
from typing import Any

from jax.sharding import PartitionSpec

from ._memory import Host
from ._specs import spec_entry


SPEC_SYNTAX = (
    "a SPEC is dimensions separated by ',' or '.', each an axis name, None, or "
    "axis names joined by '+' (dp,tp  None.tp  dp+fsdp,None); () or P() is the "
    "replicated spec, and P('dp', None) or P(('dp', 'fsdp'), 'tp') reads as in Python; "
    "host(SPEC) keeps the layout in host memory, host() what follows a parameter"
)


def _spec_entry(entry: Any, text: str) -> str | tuple[str, ...] | None:
    """One dimension of a `P(...)` literal, checked."""
    names = entry if isinstance(entry, tuple | list) else (entry,)
    if entry is None or (
        names and all(isinstance(n, str) and n.isidentifier() for n in names)
    ):
        return entry if not isinstance(entry, list) else tuple(entry)
    raise ValueError(
        f"{entry!r} in the spec {text!r} is not an axis name, None, or a tuple of "
        "axis names"
    )


def parse_spec(text: str) -> PartitionSpec:
    """The `PartitionSpec` written as `text`, in the one spec syntax of rules files
    (`python -m eqshard --rules`) and rule strings
    (`create_pattern_based_partition_spec`): see `SPEC_SYNTAX`. Whitespace around
    dimensions is ignored. Raises `ValueError` saying what is wrong; each caller
    adds where."""
    body = text.strip()
    if not body:
        raise ValueError("the spec is empty (write () for P())")
    if body in ("()", "P()"):
        return PartitionSpec()
    if body.startswith("P(") and body.endswith(")"):
        inner = body[2:-1]
        if not inner.strip():
            return PartitionSpec()
        if not any(c in inner for c in "'\"()[]"):
            return parse_spec(inner)  # P(dp, None): the compact form inside P()
        try:
            entries = ast.literal_eval(f"[{inner}]")
        except (ValueError, SyntaxError):
            raise ValueError(
                f"the spec {body!r} is not a PartitionSpec literal (quote the axis "
                "names: P('dp', None))"
            ) from None
        return PartitionSpec(*(_spec_entry(entry, body) for entry in entries))
    if body.startswith("("):
        raise ValueError(
            f"the spec {body!r} is ambiguous: write dp+tp for one dimension over "
            "both axes, or dp,tp for two dimensions"
        )
    dims: list[str | tuple[str, ...] | None] = []
    for dim in (d.strip() for d in re.split(r"[,.]", body)):
        if dim == "None":
            dims.append(None)
            continue
        names = [name.strip() for name in dim.split("+")]
        for name in names:
            if not name.isidentifier():
                where = "" if name == body else f" in the spec {body!r}"
                raise ValueError(
                    f"{name!r}{where} is not an axis name, None, or axis names "
                    "joined by '+'"
                )
        dims.append(spec_entry(names))
    return PartitionSpec(*dims)


def parse_rule(regex: str, spec: str) -> tuple[re.Pattern[str], PartitionSpec]:
    """A rule written as text, as rules files and rule strings write it: `regex`
    compiled, `spec` read by `parse_spec`. Raises `ValueError` saying what is
    wrong; each caller adds where."""
    if not regex:
        raise ValueError("the regex is empty")
    try:
        compiled = re.compile(regex)
    except re.error as error:
        raise ValueError(f"invalid regex {regex!r} ({error})") from None
    return compiled, parse_spec(spec)


def parse_rule_value(text: str) -> PartitionSpec | Host:
    """A rules file's value: a spec (`parse_spec`), or `host(SPEC)` for that
    layout in host memory (`host()`: the layout of the parameter an array
    follows). Raises `ValueError` saying what is wrong; each caller adds where."""
    body = text.strip()
    if not (body.startswith("host(") and body.endswith(")")):
        return parse_spec(body)
    inner = body[len("host(") : -1].strip()
    if inner.startswith("host("):
        raise ValueError(f"{body!r} puts host memory in host memory; write it once")
    return Host(parse_spec(inner) if inner else None)
