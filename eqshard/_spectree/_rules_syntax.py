"""The text syntax of specs and rules: one spec syntax (`SPEC_SYNTAX`, read by
`parse_spec`) for the rules files of `python -m eqshard --rules` and the rule
strings of `eqshard.compat.create_pattern_based_partition_spec`, and `parse_rule`
for a rule written as a regex and a spec. A rule's value is written as text by
`value_text` (as Python writes it: `P('tp', None)`, `stacked(P('tp', None))`),
which `parse_value` reads back. Each reader raises a bare `ValueError` saying
what is wrong; its caller adds where.
"""

import ast
import functools
import re
from collections.abc import Callable
from typing import Any

from jax.sharding import PartitionSpec

from ._check_spec import spec_entry
from ._logical import AxisNames
from ._memory import host
from ._stacked import stacked


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


def parse_rule(
    regex: str, spec: str, *, values: bool = False
) -> tuple[re.Pattern[str], Any]:
    """A rule written as text, as rules files and rule strings write it: `regex`
    compiled, `spec` read by `parse_spec` (by `parse_value` with `values`, as a
    rules file reads it: `stacked(...)` too). Raises `ValueError` saying what is
    wrong; each caller adds where."""
    if not regex:
        raise ValueError("the regex is empty")
    try:
        compiled = re.compile(regex)
    except re.error as error:
        raise ValueError(f"invalid regex {regex!r} ({error})") from None
    return compiled, parse_value(spec) if values else parse_spec(spec)


# The rule values written as a call on a spec, `NAME(SPEC, ...)`: the name, and
# the public function that makes the value (its `repr` is such a call).
VALUE_CALLS: dict[str, Callable[..., Any]] = {"stacked": stacked, "host": host}


def value_text(value: Any) -> str:
    """A rule's value as text without object addresses: a spec, logical names or
    a value such as `stacked(P('tp', None))` as Python writes it (its `repr`,
    which `parse_value` and a rules file read back, and which
    `match_partition_rules` takes once evaluated), a function or class by its
    qualified name, anything whose `repr` holds an address by its type's name."""
    if isinstance(value, functools.partial):
        value = value.func
    name = getattr(value, "__qualname__", None)  # functions and classes
    if isinstance(name, str):
        return name
    text = repr(value)
    return type(value).__name__ if " at 0x" in text else text


def _spec_argument(node: ast.expr, body: str) -> Any:
    """The spec argument of a value's call: a spec in the spec syntax, logical
    names written `AxisNames('embed', 'mlp')`, or another value's call
    (`host(stacked(P('tp', None)))`)."""
    text = ast.get_source_segment(body, node) or ""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in VALUE_CALLS
    ):
        return parse_value(text)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "AxisNames"
    ):
        try:
            names = [ast.literal_eval(arg) for arg in node.args]
        except ValueError:
            names = [None]
        if node.keywords or not all(isinstance(n, str | None) for n in names):
            raise ValueError(f"{text!r} is not logical names: AxisNames('embed', None)")
        return AxisNames(*names)
    return parse_spec(text)


def parse_value(text: str) -> Any:
    """The rule value written as `text`: a spec (`parse_spec`), or a call of a
    value of `VALUE_CALLS` on a spec, as its `repr` writes it
    (`stacked(P('tp', None))`, with literal options after the spec) or on a
    compact spec (`stacked(tp,None)`). Raises `ValueError` saying what is wrong;
    each caller adds where."""
    body = text.strip()
    called = re.match(r"([A-Za-z_]\w*)\s*\(", body)
    if called is None or called[1] == "P":
        return parse_spec(body)
    name, make = called[1], VALUE_CALLS.get(called[1])
    spellings = " or ".join(f"{known}(SPEC)" for known in VALUE_CALLS)
    if make is None:
        raise ValueError(f"{name!r} is not a rule value: write a spec, or {spellings}")
    inner = body[called.end() : -1] if body.endswith(")") else ""
    if make is host and body.endswith(")") and not inner.strip():
        return host()  # host(): the layout of the parameter an array follows
    if inner.strip() and not any(c in inner for c in "=()'\""):
        args, options = [parse_spec(inner)], {}  # stacked(tp,None)
    else:
        args, options = _call_arguments(body, spellings)
    try:
        return make(*args, **options)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{body!r}: {error}") from None


def _call_arguments(body: str, spellings: str) -> tuple[list[Any], dict[str, Any]]:
    """The arguments of a rule value's call written as Python writes it: a spec
    first (`P(...)`, `()`, or `AxisNames(...)`), then literals."""
    try:
        call = ast.parse(body, mode="eval").body
    except SyntaxError:
        call = None
    if (
        not isinstance(call, ast.Call)
        or not call.args
        or not isinstance(call.args[0], ast.Call | ast.Tuple)
        or any(isinstance(a, ast.Starred) for a in call.args)
        or any(k.arg is None for k in call.keywords)
    ):
        raise ValueError(
            f"{body!r} is not a rule value: write {spellings} with a spec such as "
            "P('tp', None) or tp,None"
        )
    spec = _spec_argument(call.args[0], body)
    try:
        rest = [ast.literal_eval(arg) for arg in call.args[1:]]
        options = {str(k.arg): ast.literal_eval(k.value) for k in call.keywords}
    except ValueError:
        raise ValueError(
            f"the options of {body!r} must be literals (numbers, strings, None)"
        ) from None
    return [spec, *rest], options
