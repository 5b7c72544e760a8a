"""fjformer's pattern strings and weight-decay masks, built on the rules' regexes.

`create_pattern_based_partition_spec` reads a compact rule string
(`"attn|mlp->dp,tp,embed->None.tp"`): `_rule_tokens` splits it into rules,
`_parse_pattern` reads each with the spec syntax of `_rules_syntax.py`, and the
function it returns matches a path against them. `get_weight_decay_mask` compiles
its regexes as partition rules' are (`compile_regexes`) and maps a tree to a bool
per leaf, for optax's `mask=`.
"""

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import jax.tree_util as jtu
from jax.sharding import PartitionSpec
from jaxtyping import PyTree

from .._spectree._rules import compile_regexes
from .._spectree._rules_syntax import parse_rule, SPEC_SYNTAX
from .._tree import path_name
from .._typing import typecheck


Pattern: TypeAlias = str | re.Pattern[str]

# ---------------------------------------------------------------- pattern strings


def _pattern_error(pattern: str, index: int, token: str, why: str) -> ValueError:
    return ValueError(
        f"eqshard.compat.create_pattern_based_partition_spec: bad rule {index} "
        f"{token!r} in {pattern!r}: {why}. Rules are `REGEX->SPEC`, separated by ','; "
        f"{SPEC_SYNTAX}. Example: 'attention|mlp->dp,tp,embed->None.tp,norm->()'."
    )


def _rule_tokens(pattern: str) -> list[str]:
    """The rules of `pattern`: split at ',', where a piece without `->` continues
    the spec before it (`attn->dp,tp` and `attn->P('dp', None)` are one rule)."""
    tokens: list[str] = []
    for index, piece in enumerate(pattern.split(",")):
        if not piece.strip():
            raise _pattern_error(pattern, index, piece, "the rule is empty")
        if "->" in piece or not tokens:
            tokens.append(piece)
        else:
            tokens[-1] += "," + piece
    return tokens


def _parse_pattern(pattern: str) -> list[tuple[re.Pattern[str], PartitionSpec]]:
    rules = []
    for index, token in enumerate(_rule_tokens(pattern)):
        parts = token.split("->")
        if len(parts) != 2:
            raise _pattern_error(
                pattern,
                index,
                token,
                "expected exactly one '->' between regex and spec",
            )
        regex, spec = (part.strip() for part in parts)
        try:
            compiled, parsed = parse_rule(regex, spec)
        except ValueError as error:
            raise _pattern_error(pattern, index, token, str(error)) from None
        rules.append((compiled, parsed))
    return rules


@dataclasses.dataclass(frozen=True)
class _PatternPartitionSpec:
    rules: tuple[tuple[str, PartitionSpec], ...]
    default: PartitionSpec
    regexes: tuple[re.Pattern[str], ...] = dataclasses.field(repr=False, compare=False)

    def __call__(self, path: str, leaf: Any = None) -> PartitionSpec:
        for regex, (_, spec) in zip(self.regexes, self.rules, strict=True):
            if regex.search(path) is not None:
                return spec
        return self.default


@typecheck
def create_pattern_based_partition_spec(
    pattern: str, *, default: PartitionSpec = PartitionSpec()
) -> Callable[[str, Any], PartitionSpec]:
    """Parses a compact rule string into a function `fn(path, leaf) -> PartitionSpec`.

    The string is rules `REGEX->SPEC` separated by `,`, first match wins
    (`re.search` on the path). `REGEX` is one regular expression, so `|` is
    alternation and groups work; it cannot contain `,` or `->`. `SPEC` is
    dimensions separated by `,` or `.`, each one of:

    - an axis name: `dp`;
    - `None`: that dimension is not sharded;
    - axis names joined by `+`: `dp+fsdp` shards one dimension over both axes;

    and `()` or `P()` alone is the replicated spec; `P('dp', None)` and
    `P(('dp', 'fsdp'), 'tp')` read as in Python. So
    `"attention|mlp->dp,tp,embed->None.tp"` gives `P("dp", "tp")` for attention
    and MLP weights, and `P(None, "tp")` for embeddings (a piece without `->`
    continues the spec before it). This is the spec syntax of the rules files of
    `python -m eqshard --rules` too. The string is parsed once, strictly;
    whitespace around tokens is ignored.

    **Arguments:**

    - `pattern`: the rule string.
    - `default`: the spec of paths that no rule matches.

    **Returns:**

    A function `fn(path, leaf=None)` returning the spec for the path string `path`
    (`leaf` is accepted for use with [`eqshard.named_tree_map`][] and ignored).
    Its `rules` attribute holds the parsed `(regex, PartitionSpec)` pairs, which
    [`eqshard.match_partition_rules`][] accepts too.

    **Raises:**

    `ValueError` naming the bad rule: no `->` or more than one, an empty regex or
    spec, an invalid regex, or a dimension that is not an axis name.

    !!! Example

        ```python
        pattern = "attn|mlp->dp.tp,embed->tp"
        fn = eqshard.compat.create_pattern_based_partition_spec(pattern)
        fn("layers/0/mlp/weight", None)  # P("dp", "tp")
        fn("norm/scale", None)  # P()
        ```
    """
    parsed = _parse_pattern(pattern)
    rules = tuple((regex.pattern, spec) for regex, spec in parsed)
    regexes = tuple(regex for regex, _ in parsed)
    return _PatternPartitionSpec(rules, default, regexes)


# ---------------------------------------------------------------- weight decay


@typecheck
def get_weight_decay_mask(
    exclusions: Pattern | Sequence[Any], *, sep: str = "/"
) -> Callable[[PyTree], PyTree]:
    """Makes a weight-decay mask function from regexes of parameters to exclude.

    The function maps a parameter tree to a tree of the same structure with a bool
    per leaf: `False` where the leaf's path matches (`re.search`) any exclusion,
    `True` (apply weight decay) elsewhere. It is meant for optax's `mask=`
    argument. The regexes are compiled once, here.

    **Arguments:**

    - `exclusions`: a regex, or a sequence of regexes (strings or compiled).
    - `sep`: the separator used to build the path strings.

    **Returns:**

    A function `params -> tree of bools`.

    **Raises:**

    `ValueError` naming each exclusion whose regex is invalid; `TypeError` naming
    an exclusion that is not a regex.

    !!! Example

        ```python
        import optax

        mask = eqshard.compat.get_weight_decay_mask(["bias", "norm/scale"])
        optimizer = optax.adamw(1e-3, weight_decay=0.1, mask=mask)
        ```
    """
    if isinstance(exclusions, str | re.Pattern):
        exclusions = [exclusions]
    regexes = compile_regexes(exclusions, "compat.get_weight_decay_mask", "exclusion")

    def weight_decay_mask(params: PyTree) -> PyTree:
        path_leaves, treedef = jtu.tree_flatten_with_path(params)
        decay = []
        for path, _ in path_leaves:
            name = path_name(path, sep)
            decay.append(not any(regex.search(name) for regex in regexes))
        return jtu.tree_unflatten(treedef, decay)

    return weight_decay_mask
