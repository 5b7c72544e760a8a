"""The messages of the matching engine of partition rules (`_rules.py`): bad
regexes, leaves without a valid spec (with the rules tried), and rules that
matched nothing. One builder per kind of message."""

import re
from collections.abc import Sequence
from typing import Any

from jax.sharding import PartitionSpec


_LIMIT = 30  # lines of leaves or rules shown in one error message


def show(name: str) -> str:
    """A leaf's path in a message (`<root>` for the tree itself)."""
    return repr(name) if name else "<root>"


def bad_regex_message(caller: str, what: str, bad: list[tuple[int, str, str]]) -> str:
    lines = [f"eqshard.{caller}: invalid regular expressions ({len(bad)}):"]
    lines += [f"  {what} {i} {pattern!r}: {error}" for i, pattern, error in bad]
    lines.append("Fix the pattern syntax (see Python's `re` module), or escape it.")
    return "\n".join(lines)


def _rule_lines(compiled: Sequence[tuple[re.Pattern[str], Any]]) -> list[str]:
    lines = [f"  {i}: {r.pattern!r} -> {s!r}" for i, (r, s) in enumerate(compiled)]
    if len(lines) > _LIMIT:
        lines = lines[:_LIMIT] + [f"  ... and {len(lines) - _LIMIT} more rules"]
    return lines or ["  (no rules)"]


def bad_leaves_message(
    bad: list[tuple[str, tuple[int, ...], str, PartitionSpec]],
    compiled: Sequence[tuple[re.Pattern[str], Any]],
    sep: str,
    caller: str,
    source: str | None = None,
    *,
    corrected: bool = False,
) -> str:
    """The leaves without a valid spec (name, shape, problem, the spec used
    instead if `corrected`), and the rules tried."""
    count = "1 array leaf has" if len(bad) == 1 else f"{len(bad)} array leaves have"
    by = "" if source is None else f" by the partition rules {source}"
    lines = [f"eqshard.{caller}: {count} no valid spec{by}:"]
    for name, shape, problem, fixed in bad[:_LIMIT]:
        using = f"; using {fixed!r}" if corrected else ""
        lines.append(f"  {show(name)} shape {shape}: {problem}{using}")
    if len(bad) > _LIMIT:
        lines.append(
            f"  ... and {len(bad) - _LIMIT} more (eqshard.explain_partition_rules "
            "lists every leaf)"
        )
    lines.append(
        f"Rules tried, in order (the first `re.search` match on the {sep!r}-joined "
        "path wins):"
    )
    lines += _rule_lines(compiled)
    if corrected:
        relax = 'pass `on_invalid="ignore"` to replicate, trim and correct silently'
    elif source is None:
        relax = (
            'pass `on_invalid="warn"` (or `"ignore"`) to replicate unmatched '
            "leaves and trim or correct the specs"
        )
    else:
        relax = (
            "match them first with `eqshard.match_partition_rules(rules, tree, "
            'on_invalid="warn")`, which replicates unmatched leaves and trims the '
            "specs"
        )
    lines.append(
        "Add rules for the unmatched paths (a last rule `('.*', PartitionSpec())` "
        "replicates the rest), make each spec at most as long as the array's rank "
        f"(and, with `mesh`, one that applies on it), or {relax}."
    )
    return "\n".join(lines)


def unused_message(caller: str, unused: list[str]) -> str:
    return (
        f"eqshard.{caller}: these rules matched no array leaf: {', '.join(unused)}. "
        "Check them for typos or for an earlier rule that shadows them "
        "(eqshard.explain_partition_rules shows which rule decided each leaf)."
    )
