"""Which partition rule decided each array leaf: `explain_partition_rules` and its
report.

`explain_partition_rules` runs the matching engine of `_rules.py` as
`match_partition_rules` does (`compile_rules`, `match_leaves`, `strict_spec`, and
`_follow.item_follower_spec` for arrays that follow another), but keeps a row per
array leaf (`RulesReportRow`) instead of raising, and lists the rules that matched
nothing (`RulesReport.dead_rules`).
"""

import dataclasses
import operator
from typing import Any, Literal

from jax.sharding import AbstractMesh, Mesh, PartitionSpec
from jaxtyping import PyTree

from .._report import plain, Report, text_table
from .._typing import Int, typecheck
from ._follow import item_follower_note, item_follower_spec
from ._memory import Host, HOST_MEMORY, in_memory
from ._rules import (
    compile_rules,
    host_followers,
    match_leaves,
    REASONS,
    Rules,
    RuleValue,
    strict_spec,
)
from ._rules_syntax import value_text


@dataclasses.dataclass(frozen=True)
class RulesReportRow:
    """One array leaf in a [`eqshard.RulesReport`][].

    - `path`, `shape`: the leaf's path string and shape.
    - `reason`: `"matched"`, `"scalar"`, `"below_min_size"`, `"unmatched"` or
      `"follows"` (an array of a tree built together that follows another, such
      as an optimizer state's `mu`: see [`eqshard.match_partition_rules`][]).
    - `rule`, `pattern`: index and regex of the matching rule, or `None`.
    - `spec`: the matching rule's spec as written (for a function or a
      [`eqshard.stacked`][] value, as it came out for this leaf); `P()` for
      scalars and small arrays; the followed array's for one that follows;
      `None` if no rule matches.
    - `problem`: why `match_partition_rules` rejects (by default) this leaf,
      or `None` if it accepts it.
    - `note`: how `spec` was chosen, for a rule whose value is a function (such
      as [`eqshard.auto_fsdp`][]), a [`eqshard.stacked`][] value, or an array
      that follows another (naming it); `None` otherwise.
    """

    path: str
    shape: tuple[int, ...]
    reason: Literal["matched", "scalar", "below_min_size", "unmatched", "follows"]
    rule: int | None
    pattern: str | None
    spec: PartitionSpec | Host | None
    problem: str | None
    note: str | None = None


@dataclasses.dataclass(frozen=True, repr=False)
class RulesReport(Report):
    """Which partition rule decided each array leaf, from
    [`eqshard.explain_partition_rules`][].

    - `rows`: one [`eqshard.RulesReportRow`][] per array leaf, in tree order.
    - `rules`: the rules, as `(pattern string, value)` pairs.
    - `dead_rules`: indices of the rules that matched no leaf (often a typo, or a
      rule shadowed by an earlier one).
    - `min_size`: as given.

    `str(report)` and `report.table()` render it as an aligned text table,
    `report.show()` prints it with `rich` when it is installed, and
    `report.to_json()` is a byte-stable `str`.
    """

    rows: tuple[RulesReportRow, ...]
    rules: tuple[tuple[str, RuleValue], ...]
    dead_rules: tuple[int, ...]
    min_size: int

    @property
    def problems(self) -> tuple[RulesReportRow, ...]:
        """The rows that `match_partition_rules` rejects (by default)."""
        return tuple(row for row in self.rows if row.problem is not None)

    def table(self) -> str:
        """The report as an aligned text table: leaves, then rules."""
        notes = {"scalar": "scalar", "below_min_size": f"size < {self.min_size}"}
        body = [
            (
                row.path or "<root>",
                str(row.shape),
                "-" if row.rule is None else f"{row.rule} {row.pattern!r}",
                "-" if row.spec is None else repr(row.spec),
                row.problem or row.note or notes.get(row.reason, ""),
            )
            for row in self.rows
        ]
        counts = [0] * len(self.rules)
        for row in self.rows:
            if row.rule is not None:
                counts[row.rule] += 1
        rule_body = [
            (
                str(i),
                repr(pattern),
                value_text(spec),
                str(count),
                "dead: matched nothing" if i in self.dead_rules else "",
            )
            for i, ((pattern, spec), count) in enumerate(
                zip(self.rules, counts, strict=True)
            )
        ]
        return "\n".join(
            [
                f"{len(self.rows)} array leaves, {len(self.rules)} rules: "
                f"{len(self.problems)} problems, {len(self.dead_rules)} dead rules",
                "",
                *text_table(("path", "shape", "rule", "spec", "note"), body),
                "",
                *text_table(("rule", "pattern", "spec", "leaves", "note"), rule_body),
            ]
        )

    def _json(self) -> Any:
        """The fields, each rule's value as Python writes it (`P('tp', None)`,
        `stacked(P('tp', None))`; a function by its name): as a rules file and
        `match_partition_rules` read them back."""
        data = plain(self)
        data["rules"] = [[pattern, value_text(value)] for pattern, value in self.rules]
        return data

    def _summary(self) -> dict[str, Any]:
        return {
            "leaves": len(self.rows),
            "rules": len(self.rules),
            "problems": len(self.problems),
            "dead_rules": self.dead_rules,
        }


@typecheck
def explain_partition_rules(
    rules: Rules,
    tree: PyTree,
    *,
    min_size: Int = 0,
    sep: str = "/",
    mesh: Mesh | AbstractMesh | None = None,
) -> RulesReport:
    """Reports which rule decides the spec of each array leaf, and which rules
    match nothing.

    Matches exactly as [`eqshard.match_partition_rules`][] does, but never raises
    for a bad leaf: each row says what `match_partition_rules` would do with the
    leaf, and why it would reject it. Rules that match no leaf are listed as dead:
    a dead rule is usually a typo in its regex, or shadowed by an earlier rule.
    Scalars and arrays below `min_size` are not matched against the rules. For a
    rule whose value is a function, such as [`eqshard.auto_fsdp`][], the row's
    `spec` is the spec it chose and its `note` says why.

    **Arguments:**

    As for [`eqshard.match_partition_rules`][]: with `mesh`, a spec that cannot
    apply on it is a problem of its row.

    **Returns:**

    A [`eqshard.RulesReport`][]; `print(report)` shows it as a table.

    **Raises:**

    `ValueError` naming each rule whose regex is invalid; `TypeError` if a rule is
    not a `(regex, PartitionSpec)` pair.

    !!! Example

        ```python
        params = {"attn": {"weight": jnp.ones((8, 8))}, "embed": jnp.ones((16, 8))}
        rules = [("attn/weight", P("dp", "tp")), ("embeding", P("tp"))]
        report = eqshard.explain_partition_rules(rules, params)
        report.dead_rules  # (1,): the typo never matched
        report.problems[0].path  # "embed": no rule matches it
        print(report)
        ```
    """
    min_size = operator.index(min_size)
    compiled = compile_rules(rules, "explain_partition_rules")
    matches = match_leaves(compiled, tree, min_size, sep, "explain_partition_rules")
    to_host = host_followers(compiled, matches)
    found: list[Any] = [None] * len(matches.leaves)
    for i, (leaf, name, rule) in enumerate(
        zip(matches.leaves, matches.names, matches.rules, strict=True)
    ):
        if rule is not None and name is not None:  # an array
            found[i] = strict_spec(
                rule, tuple(leaf.shape), compiled, "explain_partition_rules", name, mesh
            )
            if rule >= 0 and isinstance(compiled[rule][1], Host) and found[i][0]:
                found[i] = (Host(found[i][0]), *found[i][1:])
    specs = [None if f is None else f[0] for f in found]
    for i, follow in matches.follows.items():
        specs[i] = item_follower_spec(follow, specs)
        note = item_follower_note(follow, matches.names)
        if i in to_host:
            specs[i] = in_memory(specs[i], HOST_MEMORY)
            note += f", in host memory by rule {to_host[i]}"
        found[i] = (specs[i], None, note)
    rows = []
    used = set(to_host.values())
    for leaf, name, rule, spec_problem_note in zip(
        matches.leaves, matches.names, matches.rules, found, strict=True
    ):
        if rule is None or name is None:  # not an array
            continue
        spec, problem, note = spec_problem_note
        matched = rule >= 0
        if matched:
            used.add(rule)
        rows.append(
            RulesReportRow(
                path=name,
                shape=tuple(leaf.shape),
                reason="matched" if matched else REASONS[rule],
                rule=rule if matched else None,
                pattern=compiled[rule][0].pattern if matched else None,
                spec=spec,
                problem=problem,
                note=note,
            )
        )
    return RulesReport(
        rows=tuple(rows),
        rules=tuple((regex.pattern, spec) for regex, spec in compiled),
        dead_rules=tuple(i for i in range(len(compiled)) if i not in used),
        min_size=min_size,
    )
