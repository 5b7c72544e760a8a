"""Tree paths as strings, and prefix trees matched against the trees they describe.

Everything in eqshard names a leaf by its path: dict keys, attribute names and
sequence indices joined by a separator, so `model.layers[3].attn.q.weight` is
`layers/3/attn/q/weight`. This module turns JAX key paths into those names, lists
them in messages, and matches *prefix* trees (spec trees, trees of functions)
against the trees they describe, with errors that name the first path that
differs. The public tree utilities built on it (`flatten_tree`, `named_tree_map`,
...) are in `_tree_utils.py`.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, overload

import jax
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer

from ._caches import register
from ._typing import KeyPath, PyTreeDef, typecheck


_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)
_is_array_type: dict[type, bool] = {}
register(_is_array_type.clear)


def is_array(x: Any) -> bool:
    """Whether `x` is an array to eqshard.

    Arrays are `jax.Array`s, NumPy arrays and scalars, and `jax.ShapeDtypeStruct`s,
    so the skeleton made by `eqx.filter_eval_shape` or `jax.eval_shape` can be
    filtered as the real tree is (`eqx.is_array` rejects `ShapeDtypeStruct`s).
    Python scalars are not arrays (Equinox's convention).

    **Arguments:**

    - `x`: anything.

    **Returns:**

    `True` or `False`.

    !!! Example

        ```python
        eqshard.is_array(jnp.zeros(3))  # True
        eqshard.is_array(jax.ShapeDtypeStruct((3,), jnp.float32))  # True
        eqshard.is_array(1.0)  # False
        ```
    """
    # `isinstance(x, jax.Array)` is slow (an ABC check); the answer depends only on
    # the type, so it is looked up once per type.
    kind = type(x)
    found = _is_array_type.get(kind)
    if found is None:
        found = _is_array_type[kind] = isinstance(x, _ARRAY_TYPES)
    return found


# The names of attribute and sequence keys, which repeat in every layer of a tree
# (and are equal only to keys of their own type with the same name or index; a
# `DictKey` can equal another of a different name, `DictKey(1.0) == DictKey(1)`,
# so those are not kept).
_KEY_NAMES: dict[Any, str] = {}
register(_KEY_NAMES.clear)
_KEPT = (jtu.GetAttrKey, jtu.SequenceKey)


def _key_to_string(key: Any) -> str:
    if type(key) not in _KEPT:
        return _key_name(key)  # (keys of user-registered nodes may not hash)
    name = _KEY_NAMES.get(key)
    if name is None:
        name = _key_name(key)
        if len(_KEY_NAMES) < 2**16:
            _KEY_NAMES[key] = name
    return name


def _key_name(key: Any) -> str:
    if isinstance(key, jtu.DictKey):
        return str(key.key)
    if isinstance(key, jtu.SequenceKey):
        return str(key.idx)
    if isinstance(key, jtu.GetAttrKey):
        return key.name
    if isinstance(key, jtu.FlattenedIndexKey):
        return str(key.key)
    return str(key)  # keys of user-registered pytree nodes


@typecheck
def tree_path_to_string(path: KeyPath, sep: str | None = None) -> str | tuple[str, ...]:
    """Turns a JAX key path into a name.

    Dict keys (`DictKey`) become `str(key)`, attribute names (`GetAttrKey`, as used
    by Equinox modules and namedtuples such as optax states) their name, sequence
    indices (`SequenceKey`) and flattened indices (`FlattenedIndexKey`) their
    number.

    **Arguments:**

    - `path`: a key path, as given by `jax.tree_util.tree_flatten_with_path`.
    - `sep`: the separator to join the parts with. If `None`, the parts are
      returned as a tuple of strings.

    **Returns:**

    A string such as `"layers/3/attn/weight"`, or the tuple of its parts.

    !!! Example

        ```python
        path, _ = jax.tree_util.tree_flatten_with_path({"a": [1, 2]})[0][1]
        eqshard.tree_path_to_string(path, sep="/")  # "a/1"
        eqshard.tree_path_to_string(path)  # ("a", "1")
        ```
    """
    return path_name(path, sep)


@overload
def path_name(path: KeyPath, sep: str) -> str: ...


@overload
def path_name(path: KeyPath, sep: None) -> tuple[str, ...]: ...


@overload
def path_name(path: KeyPath, sep: str | None) -> str | tuple[str, ...]: ...


def path_name(path: KeyPath, sep: str | None) -> str | tuple[str, ...]:
    """[`eqshard.tree_path_to_string`][] without the runtime type check, which would
    cost ~5 us a leaf in eqshard's own loops."""
    parts = tuple(map(_key_to_string, path))
    return parts if sep is None else sep.join(parts)


def path_str(path: KeyPath) -> str:
    """The `/`-joined name of `path` for eqshard messages; `<root>` if empty."""
    return "/".join(map(_key_to_string, path)) or "<root>"


def paths_text(paths: Sequence[KeyPath | str], limit: int = 10) -> str:
    """The first `limit` of `paths` (key paths, or names already made), quoted and
    comma-separated, and how many more: the one way messages list paths."""
    names = [p if isinstance(p, str) else path_str(p) for p in paths[:limit]]
    shown = ", ".join(f"'{name}'" for name in names)
    more = len(paths) - limit
    return shown + (f" and {more} more" if more > 0 else "")


def listing(
    header: str, lines: Sequence[str], *after: str, limit: int | None = 10
) -> str:
    """A message of one line per item: `header`, the first `limit` of `lines`
    (all with `None`), each as `  - line`, a line saying how many more, and the
    lines `after`."""
    shown = [f"  - {line}" for line in lines[:limit]]
    if limit is not None and len(lines) > limit:
        shown.append(f"  ... and {len(lines) - limit} more.")
    return "\n".join([header, *shown, *after])


def is_deleted(x: Any) -> bool:
    """Whether `x` is a JAX array whose buffers were deleted (donated, or
    `.delete()`d); tracers never are."""
    return isinstance(x, jax.Array) and not isinstance(x, Tracer) and x.is_deleted()


# How an array comes to be deleted, for every message about one.
DELETED = (
    "deleted: donated to a function (`donate_argnums`, "
    "`Partitioner.move_to_devices`) or freed with `.delete()`"
)


def deleted_error(caller: str, paths: Sequence[KeyPath]) -> ValueError:
    """The message for arrays that were deleted, at `paths`."""
    return ValueError(
        f"eqshard.{caller}: the arrays at {paths_text(paths)} have been {DELETED}. "
        "Use what that function returned in their place, or keep a copy of them."
    )


def abstract_leaf_error(caller: str, paths: list[KeyPath]) -> TypeError:
    return TypeError(
        f"eqshard.{caller}: `tree` holds `jax.ShapeDtypeStruct` leaves at "
        f"{paths_text(paths)}, which have no data to move. Create the arrays "
        "first, or plan with abstract trees through "
        "`eqshard.analyze_sharding_strategy`."
    )


def placed_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype JAX places NumPy data of `dtype` as: in native byte order, and
    narrowed to 32 bits while `jax_enable_x64` is off."""
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype.newbyteorder("=")))


def repeated_arrays(leaves: Sequence[Any]) -> list[tuple[int, int]]:
    """`(first, again)` index pairs of the JAX arrays of `leaves` that stand at
    more than one place (one object, e.g. tied weights): such an array has one
    buffer, which cannot be donated at one place and used at another."""
    first: dict[int, int] = {}
    pairs = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, jax.Array):
            j = first.setdefault(id(leaf), i)
            if j != i:
                pairs.append((j, i))
    return pairs


def collision_message(name: Any, first: KeyPath, second: KeyPath) -> str:
    return (
        f"Two leaves flatten to the same name {name!r}: {jtu.keystr(first)} and "
        f"{jtu.keystr(second)}. Names must be unique; use another `sep`, or rename "
        "one of the keys."
    )


def keys_text(keys: Iterable[Any], limit: int = 10) -> str:
    """The reprs of the first `limit` of `keys`, and how many more."""
    keys = [repr(k) for k in keys]
    more = f", ... ({len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _children(x: Any) -> tuple[list[tuple[KeyPath, Any]], PyTreeDef]:
    """The direct children of the node `x`, with their one-key paths."""
    return jtu.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)


def _describe_value(x: Any) -> str:
    if is_array(x):
        return f"an array of shape {tuple(x.shape)}"
    if x is None:
        return "None"
    kind = type(x).__name__  # a dict's own: an `OrderedDict` is another node
    if isinstance(x, dict):
        return (
            f"{_a(kind)} with keys {keys_text(x.keys())}" if x else f"an empty {kind}"
        )
    if isinstance(x, list | tuple):
        return f"a {kind} of length {len(x)}"
    return _a(kind)


def _a(kind: str) -> str:
    return f"an {kind}" if kind[:1].lower() in "aeiou" else f"a {kind}"


def _keys(children: list[tuple[KeyPath, Any]]) -> list[Any]:
    return [path[0] for path, _ in children]


def _same_node(
    prefix: Any,
    prefix_children: list[tuple[KeyPath, Any]],
    full: Any,
    full_children: list[tuple[KeyPath, Any]],
) -> bool:
    """Whether two nodes match by structure and path: the same type, and children
    under the same keys. Static metadata is not compared: Equinox's static fields,
    and the marker each build of an `eqx.nn.StateIndex` makes anew."""
    return type(prefix) is type(full) and _keys(prefix_children) == _keys(full_children)


def _first_mismatch(
    prefix: Any, full: Any, is_leaf: Callable[[Any], bool], path: KeyPath = ()
) -> tuple[KeyPath, str, str] | None:
    """The first place where `prefix` is not a prefix of `full` (as
    `_match_by_path` matches), with a description of what each has there."""
    if is_leaf(prefix):
        return None
    prefix_children, prefix_def = _children(prefix)
    if jtu.treedef_is_leaf(prefix_def) and prefix_def.num_leaves == 1:
        return None  # a leaf that `is_leaf` did not claim: the caller checks leaves
    # `None` and empty containers are nodes without children: compared below.
    full_children, _ = _children(full)
    if not _same_node(prefix, prefix_children, full, full_children):
        mine, theirs = _describe_value(prefix), _describe_value(full)
        if mine == theirs:  # same type, children under other keys
            mine = f"{mine} (children {_children_text(prefix_children)})"
            theirs = f"{theirs} (children {_children_text(full_children)})"
        return path, mine, theirs
    for (key, p_child), (_, f_child) in zip(
        prefix_children, full_children, strict=True
    ):
        found = _first_mismatch(p_child, f_child, is_leaf, path + key)
        if found is not None:
            return found
    return None


def _children_text(children: list[tuple[KeyPath, Any]]) -> str:
    return keys_text(path_str(path) for path, _ in children)


def mismatch_message(
    prefix: Any, full: Any, is_leaf: Callable[[Any], bool], name: str, other: str
) -> str:
    found = _first_mismatch(prefix, full, is_leaf)
    if found is None:  # not expected: flatten_up_to and the walk disagree
        return f"`{name}` and `{other}` have different structures."
    where, mine, theirs = found
    hint = ""
    if theirs.startswith("an array") and mine.startswith(("a tuple", "a list")):
        hint = " (a tuple or list is a subtree; a spec for one array is a `P(...)`)"
    return (
        f"`{name}` does not match the structure of `{other}` at "
        f"'{path_str(where)}': `{name}` has {mine} where `{other}` has {theirs}{hint}."
    )


def prefix_error(
    prefix: Any, tree: Any, *, is_leaf: Callable[[Any], bool], name: str, caller: str
) -> ValueError:
    """The error for a `prefix` argument that is not a prefix of `tree`."""
    return ValueError(
        f"eqshard.{caller}: {mismatch_message(prefix, tree, is_leaf, name, 'tree')} "
        f"`{name}` must have the structure of `tree`, or of a prefix of it (one entry "
        "standing for a whole subtree)."
    )


def _match_by_path(
    prefix: Any, full: Any, is_leaf: Callable[[Any], bool], out: list[Any]
) -> bool:
    """Appends to `out` the subtree of `full` under each leaf of `prefix`, in
    order, matching nodes by `_same_node`; `False` where they differ."""
    if is_leaf(prefix):
        out.append(full)
        return True
    prefix_children, prefix_def = _children(prefix)
    if jtu.treedef_is_leaf(prefix_def) and prefix_def.num_leaves == 1:
        out.append(full)
        return True
    full_children, _ = _children(full)
    if not _same_node(prefix, prefix_children, full, full_children):
        return False
    return all(
        _match_by_path(p_child, f_child, is_leaf, out)
        for (_, p_child), (_, f_child) in zip(
            prefix_children, full_children, strict=True
        )
    )


def flatten_up_to(
    prefix: Any, tree: Any, *, is_leaf: Callable[[Any], bool], name: str, caller: str
) -> tuple[list[KeyPath], list[Any], list[Any], PyTreeDef]:
    """Flattens `tree` up to the leaves of its prefix `prefix`.

    Nodes are matched by structure and path: the same type and children under the
    same keys, whatever their static metadata (an Equinox module's static fields,
    the marker each build of an `eqx.nn.StateIndex` makes anew), so a spec tree
    made from one build of a model fits another. Returns the paths and leaves of
    `prefix`, the subtree of `tree` under each of them, and the structure of
    `prefix`. Raises the error of `prefix_error`.
    """
    path_leaves, prefix_def = jtu.tree_flatten_with_path(prefix, is_leaf=is_leaf)
    try:
        subtrees = prefix_def.flatten_up_to(tree)
    except (ValueError, TypeError):
        # JAX compares static metadata too: walk again by type and keys.
        subtrees = []
        if not _match_by_path(prefix, tree, is_leaf, subtrees):
            raise prefix_error(
                prefix, tree, is_leaf=is_leaf, name=name, caller=caller
            ) from None
    paths = [path for path, _ in path_leaves]
    leaves = [leaf for _, leaf in path_leaves]
    return paths, leaves, subtrees, prefix_def


def broadcast_prefix(
    prefix: Any, tree: Any, *, is_leaf: Callable[[Any], bool], name: str, caller: str
) -> list[tuple[KeyPath, Any]]:
    """Broadcasts a prefix tree against `tree`: one `(path, prefix_leaf)` pair for
    each leaf of `tree`, in the order of `jax.tree_util.tree_leaves(tree)`. The path
    is that of the leaf of `tree`. Raises the error of `prefix_error`."""
    paths, leaves, subtrees, _ = flatten_up_to(
        prefix, tree, is_leaf=is_leaf, name=name, caller=caller
    )
    out = []
    for path, leaf, subtree in zip(paths, leaves, subtrees, strict=True):
        if isinstance(subtree, jax.Array | np.ndarray):  # a leaf: no need to walk
            out.append((path, leaf))
            continue
        for sub_path, _ in jtu.tree_flatten_with_path(subtree)[0]:
            out.append((path + sub_path, leaf))
    return out


# ---------------------------------------------------------------- followers in lists


class PathGroup(NamedTuple):
    """A leaf listed with the leaves that follow it (`grouped_paths`): the index
    of its path, and each follower's index and label (`mu`)."""

    leader: int
    followers: tuple[tuple[int, str], ...] = ()

    def members(self) -> tuple[int, ...]:
        return (self.leader, *(i for i, _ in self.followers))

    @property
    def suffix(self) -> str:
        """`" (+ mu, nu)"`: the labels of the followers (`""` without any)."""
        if not self.followers:
            return ""
        return f" (+ {', '.join(label for _, label in self.followers)})"

    def name(self, paths: Sequence[str]) -> str:
        """`blocks/3/attn/q/weight (+ mu, nu)`: the leader's path and the labels
        of its followers."""
        return paths[self.leader] + self.suffix


def _follower_label(lead: list[str], follow: list[str]) -> str | None:
    """The label of a path whose segments in front of the shared end are `follow`
    when the leader's are `lead` (`mu` for `out/1/0/mu` against `out/0`), or
    `None` if it does not follow: they differ just in front of the shared end;
    after their common start, the leader's part is one segment naming the item
    that holds it (an argument, `params`; or, below a common start, a tuple's
    index: `out/0`), the follower's part starts with another item and ends
    with a name that is not an index (the label). So `params/text/model/w` does
    not follow `params/vision/w`: both are in the item `params`."""
    if lead and follow and lead[-1] == follow[-1]:
        return None
    common = 0
    while common < min(len(lead), len(follow)) and lead[common] == follow[common]:
        common += 1
    mine, theirs = lead[common:], follow[common:]
    if len(mine) != 1 or len(theirs) <= 1:
        return None
    if common and not (mine[0].isdigit() and theirs[0].isdigit()):
        return None
    return None if theirs[-1].isdigit() else theirs[-1]


def grouped_paths(
    paths: Sequence[str], keys: Sequence[Any] | None = None
) -> list[PathGroup]:
    """`paths` (`/`-joined) grouped as an optimizer state's leaves follow their
    parameter's: a path follows another of the list whose end it shares (the
    parameter's own path, after the segments naming its tree: `params/`, with
    the indices after it, `out/0/`, `out/0/0/`) when it is longer in front of
    that end (`out/1/0/mu/`) and, with `keys`, has the same key (its shape, what
    a message says of it). Each follower is labelled by the name in front of
    the shared end (`mu`; its whole front where labels repeat). Groups come in
    the order of their leaders; a path whose leader follows another stands
    alone. Only what is shown is grouped: the reports keep every path."""
    split = [p.split("/") for p in paths]
    ends: dict[tuple[str, ...], list[tuple[int, int]]] = {}
    for i, segments in enumerate(split):
        start = 1  # the tree holding it: `params`, `out/0`, `out/0/0`
        while start < len(segments) - 1 and segments[start].isdigit():
            start += 1
        if start < len(segments):
            ends.setdefault(tuple(segments[start:]), []).append((i, start))
    leader_of: dict[int, tuple[int, str, tuple[str, ...]]] = {}
    for q, segments in enumerate(split):
        for cut in range(1, len(segments)):  # the longest shared end first
            found = None
            for p, start in ends.get(tuple(segments[cut:]), ()):
                if p == q or (keys is not None and keys[p] != keys[q]):
                    continue
                label = _follower_label(split[p][:start], segments[:cut])
                if label is not None:
                    found = (p, label, tuple(segments[:cut]))
                    break
            if found is not None:
                leader_of[q] = found
                break
    followers: dict[int, list[tuple[int, str, tuple[str, ...]]]] = {}
    for q, (p, label, front) in leader_of.items():
        if p not in leader_of:
            followers.setdefault(p, []).append((q, label, front))
    groups = []
    for i in range(len(paths)):
        if i in leader_of and leader_of[i][0] not in leader_of:
            continue
        own = followers.get(i, [])
        labels = [label for _, label, _ in own]
        groups.append(
            PathGroup(
                i,
                tuple(
                    (q, label if labels.count(label) == 1 else "/".join(front))
                    for q, label, front in own
                ),
            )
        )
    return groups
