"""The public pytree utilities: leaves named by their paths (`flatten_tree`,
`unflatten_tree`, `named_tree_map`), trees of functions applied to trees
(`tree_apply`), and the mesh axes a tree of specs names
(`get_names_from_partition_spec`). Paths and prefix matching come from `_tree.py`.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax.tree_util as jtu
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._tree import (
    collision_message,
    flatten_up_to,
    keys_text,
    mismatch_message,
    path_name,
    path_str,
)
from ._typing import IsLeaf, KeyPath, PyTreeDef, typecheck


def _flatten_with_names(
    tree: PyTree, is_leaf: IsLeaf, sep: str | None, caller: str
) -> tuple[dict[Any, Any], PyTreeDef]:
    path_leaves, treedef = jtu.tree_flatten_with_path(tree, is_leaf=is_leaf)
    flat: dict[Any, Any] = {}
    owner: dict[Any, KeyPath] = {}
    for path, leaf in path_leaves:
        name = path_name(path, sep)
        if name in owner:
            message = collision_message(name, owner[name], path)
            raise ValueError(f"eqshard.{caller}: {message}")
        owner[name] = path
        flat[name] = leaf
    return flat, treedef


@typecheck
def flatten_tree(
    tree: PyTree, *, is_leaf: IsLeaf = None, sep: str | None = None
) -> dict[Any, Any]:
    """Flattens a pytree into a dict from leaf names to leaves.

    Names are made by [`eqshard.tree_path_to_string`][], in the order of
    `jax.tree_util.tree_leaves`. `None` subtrees have no leaves, and so no names.

    **Arguments:**

    - `tree`: any pytree.
    - `is_leaf`: as in `jax.tree_util.tree_flatten`.
    - `sep`: the separator for names; `None` gives tuples of key strings.

    **Returns:**

    A dict `{name: leaf}`.

    **Raises:**

    A `ValueError` naming both paths if two leaves get the same name, e.g. the
    dict keys `1` and `"1"`.

    !!! Example

        ```python
        eqshard.flatten_tree({"a": {"b": 1}, "c": [2, 3]}, sep="/")
        # {"a/b": 1, "c/0": 2, "c/1": 3}
        ```
    """
    flat, _ = _flatten_with_names(tree, is_leaf, sep, "flatten_tree")
    return flat


# The default of `unflatten_tree`'s `like` (`None` is a pytree: the empty one).
_NO_LIKE: Any = object()


@typecheck
def unflatten_tree(
    flat: dict[Any, Any],
    like: PyTree = _NO_LIKE,
    *,
    is_leaf: IsLeaf = None,
    sep: str | None = None,
) -> PyTree:
    """Rebuilds a pytree of the structure of `like` from a dict of named leaves.

    The inverse of [`eqshard.flatten_tree`][]: `unflatten_tree(flatten_tree(t), t)`
    is `t`. The leaves of `like` are only used for their names. Without `like`,
    nested dicts are rebuilt from the names, as flax's `unflatten_dict` does.

    **Arguments:**

    - `flat`: a dict `{name: leaf}`.
    - `like`: a pytree with the structure to rebuild. Omitted: nested dicts,
      keyed by the parts of each name (split at `sep`, or the tuple itself when
      `sep` is `None`).
    - `is_leaf`, `sep`: as given to [`eqshard.flatten_tree`][].

    **Returns:**

    A pytree with the structure of `like` (or nested dicts) and the leaves of
    `flat`.

    **Raises:**

    A `ValueError` listing the names `like` has and `flat` lacks, and the names
    `flat` has and `like` lacks; without `like`, naming a name that is also the
    start of another (`"a"` and `"a/b"`), or for `sep=""`. A `TypeError` without
    `like` for a name that is not a `str` (with `sep`) or a tuple (without).

    !!! Example

        ```python
        like = {"a": {"b": 0}, "c": [0, 0]}
        eqshard.unflatten_tree({"a/b": 1, "c/0": 2, "c/1": 3}, like, sep="/")
        # {"a": {"b": 1}, "c": [2, 3]}
        eqshard.unflatten_tree({"a/b": 1, "a/c": 2}, sep="/")  # {"a": {"b": 1, "c": 2}}
        ```
    """
    if like is _NO_LIKE:
        return _nested_dicts(flat, sep)
    names, treedef = _flatten_with_names(like, is_leaf, sep, "unflatten_tree")
    missing = [name for name in names if name not in flat]
    unexpected = [name for name in flat if name not in names]
    if missing or unexpected:
        lines = [
            "eqshard.unflatten_tree: `flat` does not have the names of the leaves "
            "of `like`."
        ]
        if missing:
            lines.append(f"Missing from `flat`: {keys_text(missing)}.")
        if unexpected:
            lines.append(f"Not in `like`: {keys_text(unexpected)}.")
        lines.append("Check that `sep` and `is_leaf` are those used to flatten.")
        raise ValueError(" ".join(lines))
    return jtu.tree_unflatten(treedef, [flat[name] for name in names])


def _nested_dicts(flat: dict[Any, Any], sep: str | None) -> dict[Any, Any]:
    """Nested dicts from names split at `sep` (or tuples of keys)."""
    if sep == "":
        raise ValueError(
            "eqshard.unflatten_tree: names joined with sep='' cannot be split "
            "back into keys. Pass `like` for the structure, or flatten with "
            "another `sep` (e.g. '/')."
        )
    leaves: dict[tuple[Any, ...], Any] = {}  # parts -> the name of the leaf there
    through: dict[tuple[Any, ...], Any] = {}  # prefix -> a name that continues it
    for name in flat:
        if sep is not None and not isinstance(name, str):
            raise TypeError(
                f"eqshard.unflatten_tree: the name {name!r} (a {type(name).__name__}) "
                f"cannot be split at sep={sep!r}; names must be strings, or pass "
                "`sep=None` for tuples of keys."
            )
        if sep is None and not (isinstance(name, tuple) and name):
            raise TypeError(
                f"eqshard.unflatten_tree: the name {name!r} is not a non-empty tuple "
                "of keys; pass the `sep` the names were joined with (e.g. sep='/')."
            )
        parts = tuple(name.split(sep) if isinstance(name, str) else name)
        for k in range(1, len(parts)):
            if parts[:k] in leaves:
                raise ValueError(_nesting_message(leaves[parts[:k]], name))
            through.setdefault(parts[:k], name)
        if parts in through:
            raise ValueError(_nesting_message(name, through[parts]))
        leaves[parts] = name
    out: dict[Any, Any] = {}
    for parts, name in leaves.items():
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = flat[name]
    return out


def _nesting_message(leaf: Any, deeper: Any) -> str:
    return (
        f"eqshard.unflatten_tree: {leaf!r} is a leaf, but {deeper!r} continues it, "
        "so it would also be a dict. Without `like`, no name may be the start of "
        "another: rename one, or pass `like` for the structure."
    )


@typecheck
def named_tree_map(
    f: Callable[..., Any],
    tree: PyTree,
    *rest: PyTree,
    is_leaf: IsLeaf = None,
    sep: str | None = None,
) -> PyTree:
    """Maps `f(name, leaf, *rest_leaves)` over a pytree.

    As `jax.tree.map`, but `f` also gets the name of each leaf, made by
    [`eqshard.tree_path_to_string`][].

    **Arguments:**

    - `f`: called as `f(name, leaf, *rest_leaves)`.
    - `tree`: the pytree to map over.
    - `*rest`: pytrees that have `tree`'s structure (or `tree` as a prefix).
    - `is_leaf`: as in `jax.tree.map`.
    - `sep`: the separator for names; `None` gives tuples of key strings.

    **Returns:**

    A pytree of the structure of `tree` holding the results of `f`.

    **Raises:**

    A `ValueError` naming the first path where a tree of `rest` differs from `tree`.

    !!! Example

        ```python
        eqshard.named_tree_map(lambda name, x: f"{name}={x}", {"a": [1, 2]}, sep="/")
        # {"a": ["a/0=1", "a/1=2"]}
        ```
    """
    path_leaves, treedef = jtu.tree_flatten_with_path(tree, is_leaf=is_leaf)
    rest_leaves = []
    for i, other in enumerate(rest):
        try:
            rest_leaves.append(treedef.flatten_up_to(other))
        except (ValueError, TypeError):
            raise _rest_error(tree, other, is_leaf, i) from None
    out = [
        f(path_name(path, sep), leaf, *others)
        for (path, leaf), *others in zip(path_leaves, *rest_leaves, strict=True)
    ]
    return jtu.tree_unflatten(treedef, out)


def _rest_error(tree: Any, other: Any, is_leaf: IsLeaf, i: int) -> ValueError:
    def leaf(x):
        return (is_leaf is not None and is_leaf(x)) or jtu.all_leaves([x])

    message = mismatch_message(tree, other, leaf, "tree", f"rest[{i}]")
    return ValueError(f"eqshard.named_tree_map: {message}")


def _is_fn_leaf(x: Any) -> bool:
    return x is None or (callable(x) and jtu.all_leaves([x]))


@typecheck
def tree_apply(fns: PyTree, tree: PyTree) -> PyTree:
    """Applies a tree of functions to a pytree.

    `fns` has the structure of `tree`, or of a prefix of it: each function is called
    on the subtree (often a single leaf) at its position, and `None` leaves that
    subtree untouched. This is how the trees of
    [`eqshard.compat.make_shard_and_gather_fns`][] are used.

    **Arguments:**

    - `fns`: a pytree whose leaves are callables or `None`. Callables that are
      themselves pytrees (Equinox modules, `jax.tree_util.Partial`) are walked into,
      not called.
    - `tree`: the pytree to apply them to.

    **Returns:**

    A pytree of the structure of `fns`, each subtree replaced by the result of its
    function.

    **Raises:**

    - `ValueError` naming the first path where `fns` is not a prefix of `tree`.
    - `TypeError` naming the path of a leaf of `fns` that is not callable.

    !!! Example

        ```python
        fns = {"a": lambda x: x + 1, "b": None}
        eqshard.tree_apply(fns, {"a": 1, "b": [2, 3]})  # {"a": 2, "b": [2, 3]}
        ```
    """
    paths, leaves, subtrees, fns_def = flatten_up_to(
        fns, tree, is_leaf=_is_fn_leaf, name="fns", caller="tree_apply"
    )
    for path, fn in zip(paths, leaves, strict=True):
        if not _is_fn_leaf(fn):
            raise TypeError(
                f"eqshard.tree_apply: `fns` has {fn!r} at '{path_str(path)}', which is "
                "not callable. Every leaf of `fns` must be a function or `None`."
            )
    out = [
        sub if fn is None else fn(sub) for fn, sub in zip(leaves, subtrees, strict=True)
    ]
    return jtu.tree_unflatten(fns_def, out)


def _names_of_spec(spec: PartitionSpec) -> Iterable[str]:
    for entry in spec:
        if isinstance(entry, str):
            yield entry
        elif isinstance(entry, Sequence):
            yield from (name for name in entry if isinstance(name, str))


@typecheck
def get_names_from_partition_spec(specs: PyTree) -> list[str]:
    """The mesh axis names used anywhere in a pytree of partition specs.

    **Arguments:**

    - `specs`: a pytree whose leaves are `PartitionSpec`s, `NamedSharding`s, axis
      name strings or `None`.

    **Returns:**

    The names, sorted and without repeats.

    **Raises:**

    A `TypeError` naming the path of any other kind of leaf.

    !!! Example

        ```python
        specs = {"w": P("dp", ("fsdp", "tp")), "b": P(None), "s": None}
        eqshard.compat.get_names_from_partition_spec(specs)  # ["dp", "fsdp", "tp"]
        ```
    """
    names: set[str] = set()
    for path, leaf in jtu.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )[0]:
        if isinstance(leaf, NamedSharding):
            leaf = leaf.spec
        if isinstance(leaf, PartitionSpec):
            names.update(_names_of_spec(leaf))
        elif isinstance(leaf, str):
            names.add(leaf)
        else:
            raise TypeError(
                f"eqshard.compat.get_names_from_partition_spec: {leaf!r} at "
                f"'{path_str(path)}' is not a PartitionSpec, NamedSharding, axis "
                "name or None."
            )
    return sorted(names)
