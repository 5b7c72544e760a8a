"""What every `specs=` argument accepts: the one resolver of the spec-tree family.

Every function that takes specs for a tree (`shard`, `init_sharded`,
`with_sharding_constraint`, `restore`, `check_layout`, `filter_shard_map`'s `in_specs`,
...) calls `resolve_specs` first, on the tree at hand, and works on the spec tree
it returns. It accepts three things, told apart by one test each:

1. **Partition rules**: a list or tuple (not a subclass, such as `AxisNames`),
   not empty, whose every item is a pair (a tuple or list of two) that starts with
   a regex (a `str` or a compiled `re.Pattern`). A spec tree has no string
   leaves, so no spec tree passes this test (`is_partition_rules`). They are
   matched against the tree as `match_partition_rules(rules, tree)` does; the
   mesh is read only by values that need axis sizes (`auto_fsdp`), so whether the
   specs fit the mesh stays the business of the function that asked.
2. **A function of the tree**: a callable that is a pytree leaf (not an Equinox
   module or another pytree node, which are spec trees). It is called once with
   the abstract tree (each array a `jax.ShapeDtypeStruct`) and returns a spec
   tree. A rule's value (`auto_fsdp(...)`) given alone is refused: it is a
   function of one leaf's shape, which belongs in rules.
3. **A spec tree or a prefix of one**: anything else, returned as it is.

Rules and functions may also stand at a node of a prefix, for the subtree there
(`{"model": rules, "opt_state": P()}`; `filter_shard_map`'s `(rules, P("dp"))`), with
paths that start inside it.
"""

import functools as ft
import re
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.sharding import AbstractMesh, Mesh
from jaxtyping import PyTree

from .._tree import flatten_up_to, is_array, path_str
from ._auto import AutoFSDP
from ._check_spec import is_spec_leaf
from ._logical import AxisNames, LogicalRules
from ._rules import rules_to_specs


def is_partition_rules(specs: Any) -> bool:
    """Whether `specs` is partition rules: a list or tuple (not a subclass), not
    empty, of pairs (tuples or lists of two) each starting with a regex."""
    return (
        type(specs) in (list, tuple)
        and len(specs) > 0
        and all(
            type(rule) in (list, tuple)
            and len(rule) == 2
            and isinstance(rule[0], str | re.Pattern)
            for rule in specs
        )
    )


def _is_function(specs: Any) -> bool:
    """Whether `specs` is a function of the tree: a callable that is a pytree leaf
    (Equinox modules and other pytree nodes are spec trees, callable or not)."""
    if not callable(specs) or is_spec_leaf(specs) or isinstance(specs, AxisNames):
        return False
    children = jtu.tree_leaves(specs, is_leaf=lambda x: x is not specs)
    return len(children) == 1 and children[0] is specs


def _is_resolved_at(x: Any) -> bool:
    """The leaves of a prefix for the resolver: specs, logical names, rules and
    functions of a subtree."""
    return is_spec_leaf(x) or isinstance(x, AxisNames) or _to_resolve(x)


def _abstract_of(tree: PyTree) -> PyTree:
    """`tree` with each array a `jax.ShapeDtypeStruct` of its shape and dtype;
    structs and leaves that are not arrays as they are."""

    def struct(leaf: Any) -> Any:
        if not is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        return jax.ShapeDtypeStruct(
            leaf.shape, leaf.dtype, weak_type=getattr(leaf, "weak_type", False)
        )

    return jtu.tree_map(struct, tree)


# Where a function has no tree to resolve rules and functions against.
NO_TREE: Any = object()


def _no_tree_error(caller: str, where: str, what: str, fix: str) -> TypeError:
    return TypeError(
        f"eqshard.{caller}: {where} is {what}, which needs the tree it is for, and "
        f"there is none here. {fix}"
    )


def _returned_error(caller: str, where: str, fn: Any, result: Any) -> TypeError:
    kind = "partition rules" if is_partition_rules(result) else "a function"
    return TypeError(
        f"eqshard.{caller}: the function {getattr(fn, '__name__', repr(fn))} given "
        f"as {where} returned {kind}; it must return a spec tree (or a prefix of "
        "one) for the abstract tree it is called with."
    )


def _rule_value_error(caller: str, where: str, value: Any) -> TypeError:
    return TypeError(
        f"eqshard.{caller}: {where} is {value!r}, a rule's value, which gives the "
        "spec of one leaf from its shape. Put it in partition rules: "
        f"[('.*', {value!r})] for every array."
    )


def _resolve(
    specs: Any,
    tree: Any,
    where: str,
    *,
    caller: str,
    mesh: Mesh | AbstractMesh | None,
    axis_rules: LogicalRules | None,
    no_tree: str,
) -> Any:
    """`specs` resolved against `tree`, when `specs` is rules or a function; its
    errors say `where` it was given."""
    if isinstance(specs, AutoFSDP):
        raise _rule_value_error(caller, where, specs)
    if tree is NO_TREE:
        what = "partition rules" if is_partition_rules(specs) else "a function"
        raise _no_tree_error(caller, where, what, no_tree)
    if is_partition_rules(specs):
        return rules_to_specs(
            specs,
            tree,
            mesh=mesh,
            check_on_mesh=False,
            axis_rules=axis_rules,
            caller=caller,
            source=where,
        )
    resolved = specs(_abstract_of(tree))
    if is_partition_rules(resolved) or _is_function(resolved):
        raise _returned_error(caller, where, specs, resolved)
    return resolved


def _to_resolve(x: Any) -> bool:
    return is_partition_rules(x) or _is_function(x) or isinstance(x, AutoFSDP)


def resolve_specs(
    specs: Any,
    tree: Any,
    *,
    caller: str,
    argname: str = "specs",
    mesh: Mesh | AbstractMesh | None = None,
    axis_rules: LogicalRules | None = None,
    per_item: bool = False,
    no_tree: str = "Match them first: `eqshard.match_partition_rules(rules, tree)`.",
) -> Any:
    """The spec tree (or prefix) that `specs` gives for `tree`: see the module's
    docstring. `mesh` gives the axis sizes that rule values such as `auto_fsdp`
    read, `axis_rules` resolves rules' `AxisNames` values (the rules in force
    otherwise). With `per_item` (for a tuple of arguments), rules at the top are
    matched inside each item. A `tree` of `NO_TREE` refuses rules and functions,
    with `no_tree` as the fix. Errors name `argname` and the path."""
    if is_spec_leaf(specs):  # the common case, and `None`: nothing to resolve
        return specs
    resolve = ft.partial(
        _resolve, caller=caller, mesh=mesh, axis_rules=axis_rules, no_tree=no_tree
    )
    if per_item and tree is not NO_TREE and is_partition_rules(specs):
        return tuple(resolve(specs, item, f"`{argname}`") for item in tree)
    if per_item and (isinstance(specs, dict | list | eqx.Module)):
        raise ValueError(  # the spec tree of one argument, given bare
            f"eqshard.{caller}: `{argname}` is a {type(specs).__name__}, but it "
            "takes a tuple of one entry per positional argument (or one spec, "
            "rules or callable for all of them): `(specs,)` for the spec tree of a "
            "function of one argument, `tuple(entries)` for a list of entries."
        )
    if _to_resolve(specs):
        return resolve(specs, tree, f"`{argname}`")
    if isinstance(specs, AxisNames) or not any(
        map(_to_resolve, jtu.tree_leaves(specs, is_leaf=_is_resolved_at))
    ):
        return specs
    if tree is NO_TREE:
        path_leaves, treedef = jtu.tree_flatten_with_path(
            specs, is_leaf=_is_resolved_at
        )
        paths = [path for path, _ in path_leaves]
        leaves = [leaf for _, leaf in path_leaves]
        subtrees = [NO_TREE] * len(leaves)
    else:
        paths, leaves, subtrees, treedef = flatten_up_to(
            specs, tree, is_leaf=_is_resolved_at, name=argname, caller=caller
        )
    out = [
        resolve(leaf, subtree, f"`{argname}` at '{path_str(path)}'")
        if _to_resolve(leaf)
        else leaf
        for path, leaf, subtree in zip(paths, leaves, subtrees, strict=True)
    ]
    return jtu.tree_unflatten(treedef, out)


def resolve_like(
    specs: Any, like: Any, *, caller: str, mesh: Mesh | AbstractMesh | None
) -> Any:
    """`resolve_specs` for a function whose tree is the optional `like=`: without
    it (`None`), rules and functions are refused, with that fix."""
    tree = NO_TREE if like is None else like
    fix = "Pass the tree they are for as `like=`."
    return resolve_specs(specs, tree, caller=caller, mesh=mesh, no_tree=fix)
