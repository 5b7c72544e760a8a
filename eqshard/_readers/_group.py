"""Rows of repeated layers, grouped: the arrays whose tree paths differ only in
sequence indices (`blocks/0/attn/q/weight`, `blocks/1/attn/q/weight`, ...) and
that are laid out alike (the same cells but the path) become one row,
`blocks/*/attn/q/weight x80`, so an 80-layer plan is a page.

`group_rows(paths, keys)` returns `(label, members)` pairs in the order of each
group's first member. A label's `*` stands for every index its pattern has in
the tree; when one array of a layer differs (another spec, say), the others'
label lists their indices instead (`blocks/[0-4,6-79]/attn/q/weight x79`) and
the odd one keeps its own row, so a group never hides an exception.
"""

import re
from collections.abc import Hashable, Sequence


_INDEX = re.compile(r"\d+")


def _parts(path: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The path's pattern (indices as `*`) and its indices."""
    parts = path.split("/")
    pattern = tuple("*" if _INDEX.fullmatch(p) else p for p in parts)
    indices = tuple(int(p) for p in parts if _INDEX.fullmatch(p))
    return pattern, indices


def _ranges(values: set[int]) -> str:
    """`[0-4,6,8-9]`."""
    ordered = sorted(values)
    spans: list[list[int]] = []
    for value in ordered:
        if spans and value == spans[-1][1] + 1:
            spans[-1][1] = value
        else:
            spans.append([value, value])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"[{text}]"


def _label(
    pattern: tuple[str, ...], indices: list[tuple[int, ...]], whole: bool
) -> str:
    if len(indices) == 1:  # alone: its own path
        values = iter(indices[0])
        return "/".join(str(next(values)) if p == "*" else p for p in pattern)
    columns = iter(zip(*indices, strict=True))
    parts = []
    for part in pattern:
        if part != "*":
            parts.append(part)
            continue
        column = set(next(columns))
        if len(column) == 1:
            parts.append(str(column.pop()))
        else:
            parts.append("*" if whole else _ranges(column))
    return "/".join(parts)


def group_rows(
    paths: Sequence[str], keys: Sequence[Hashable]
) -> list[tuple[str, list[int]]]:
    """Groups rows `i` whose `paths[i]` differ only in their integer parts and
    whose `keys[i]` (every other cell of the row) are equal; returns
    `(label, row numbers)` per group, in the order of each group's first row.
    A path without an index is a group of one."""
    groups: dict[tuple[object, ...], list[int]] = {}
    pattern_sizes: dict[tuple[str, ...], int] = {}
    split = [_parts(path) for path in paths]
    for i, ((pattern, indices), key) in enumerate(zip(split, keys, strict=True)):
        group = (pattern, key) if indices else (i,)
        groups.setdefault(group, []).append(i)
        pattern_sizes[pattern] = pattern_sizes.get(pattern, 0) + 1
    out = []
    for members in groups.values():
        pattern, _ = split[members[0]]
        if not split[members[0]][1]:
            out.append((paths[members[0]], members))
            continue
        whole = len(members) == pattern_sizes[pattern]
        indices = [split[i][1] for i in members]
        out.append((_label(pattern, indices, whole), members))
    return out
