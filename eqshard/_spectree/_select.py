"""Which part of a step's arguments is the parameters: the `params=` selector of
[`eqshard.search_layout`][] and [`eqshard.plan_training`][].

A selector is an argument's index, or a function of the argument tuple returning
a subtree, as `eqx.tree_at`'s `where` picks one (`lambda args: args[1][0]` for
`train_step(batch, (model, opt_state))`). The function is called once, on the
arguments with each leaf replaced by a marker, so what it returns is known leaf
for leaf (`select`). A selected tree whose items follow one another, as
`derive_specs` reads them (a `(model, opt_state)` given where only the model
belongs), is refused, with the selector to use (`check_parameters`).
"""

import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._tree import is_array, path_str
from .._typing import KeyPath
from ._follow import followers_of_items


class _Marker:
    """A leaf of the arguments, while a selector looks at them."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<leaf {self.index}>"


class Selection(NamedTuple):
    """The parameters among a step's arguments: the selected tree (its leaves
    the arguments' own), the index of each of its leaves among the arguments'
    leaves (`jtu.tree_leaves(args)`), and its path in the arguments (`None`
    where it is not one node of them)."""

    tree: PyTree
    leaves: list[int]
    path: KeyPath | None


def selector_text(path: KeyPath, name: str = "args") -> str:
    """The function that selects the node at `path`: `lambda args: args[1][0]`."""
    parts = []
    for key in path:
        if isinstance(key, jtu.SequenceKey):
            parts.append(f"[{key.idx}]")
        elif isinstance(key, jtu.DictKey):
            parts.append(f"[{key.key!r}]")
        elif isinstance(key, jtu.GetAttrKey):
            parts.append(f".{key.name}")
        else:
            parts.append(f"[{key!r}]")
    if len(path) == 1 and isinstance(path[0], jtu.SequenceKey):
        return str(path[0].idx)
    return f"lambda {name}: {name}{''.join(parts)}"


def _error(caller: str, message: str) -> ValueError:
    return ValueError(f"eqshard.{caller}: {message}")


def _node_path(args: tuple[Any, ...], leaves: list[int]) -> KeyPath | None:
    """The path of the node of `args` whose leaves are exactly `leaves`."""
    paths = [path for path, _ in jtu.tree_flatten_with_path(args)[0]]
    chosen = [paths[i] for i in leaves]
    if not chosen:
        return None
    common = list(chosen[0])
    for path in chosen[1:]:
        k = 0
        while k < min(len(common), len(path)) and common[k] == path[k]:
            k += 1
        del common[k:]
    below = [i for i, path in enumerate(paths) if path[: len(common)] == tuple(common)]
    return tuple(common) if below == sorted(leaves) else None


def as_index(value: Any) -> Any:
    """`value` as a Python int when it is an integer (a Python or NumPy one, or
    an integer 0-d array such as `jnp.int32(1)`; not a bool), else itself."""
    if isinstance(value, bool | np.bool_):
        return value
    if isinstance(value, int | np.integer):
        return int(value)
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape == () and dtype is not None and np.issubdtype(dtype, np.integer):
        try:
            return operator.index(value)
        except TypeError:  # a traced value: not an index
            return value
    return value


def select(
    args: Any,
    params: Any,
    *,
    caller: str,
    name: str = "params",
    what: str = "the step's arguments",
) -> Selection:
    """The tree `params` (an index or a function of `args`) selects in `args`.

    Raises `TypeError` for a selector of another type, `ValueError` for an index
    out of range or a function that selects no leaf of `args` (or raises)."""
    leaves = jtu.tree_leaves(args)
    params = as_index(params)
    if isinstance(params, int) and not isinstance(params, bool):
        if not -len(args) <= params < len(args):
            raise _error(
                caller,
                f"`{name}={params}` selects argument {params}, but the step is "
                f"given {len(args)} argument(s). Give the index of the argument "
                "that holds the parameters, or a function of the arguments such "
                "as `lambda args: args[1][0]`.",
            )
        index = params % len(args)
        start = len(jtu.tree_leaves(args[:index]))
        count = len(jtu.tree_leaves(args[index]))
        chosen = list(range(start, start + count))
        return Selection(args[index], chosen, (jtu.SequenceKey(index),))
    if not callable(params):
        raise TypeError(
            f"eqshard.{caller}: `{name}` is {params!r}; give the index of the "
            "argument that holds the parameters, or a function of the argument "
            "tuple returning them, such as `lambda args: args[1][0]`."
        )
    treedef = jtu.tree_structure(args)
    marked = jtu.tree_unflatten(treedef, [_Marker(i) for i in range(len(leaves))])
    how = (
        "Return a part of the arguments as `eqx.tree_at`'s `where` does, "
        "such as `lambda args: args[1][0]` for `step(batch, (model, opt_state))`."
    )
    try:
        picked = params(marked)
    except Exception as error:  # the user's function: say what it raised
        raise _error(
            caller,
            f"the `{name}` selector raised {type(error).__name__}: {error}. {how}",
        ) from error
    found = jtu.tree_leaves(picked)
    if not any(isinstance(x, _Marker) for x in found):
        raise _error(
            caller,
            f"the `{name}` selector returned {type(picked).__name__}, which holds "
            f"no leaf of {what}. {how}",
        )
    strays = [x for x in found if not isinstance(x, _Marker)]
    if strays:
        raise _error(
            caller,
            f"the `{name}` selector returned a tree holding {strays[0]!r}, which is "
            f"not a leaf of {what}. {how}",
        )
    chosen = [x.index for x in found]
    tree = jtu.tree_map(lambda x: leaves[x.index], picked)
    return Selection(tree, chosen, _node_path(args, chosen))


def python_fix(path: KeyPath) -> str:
    """The selector of the node at `path`, as `search_layout` takes it."""
    return f"`params={selector_text(path)}`"


def check_parameters(
    selection: Selection,
    *,
    caller: str,
    fix: Callable[[KeyPath], str] = python_fix,
) -> None:
    """Raises if the selected tree holds items of which one follows another (a
    state tuple `(model, opt_state)` given where only the model belongs), with
    `fix` of the followed item's path: the selector to use."""
    path_leaves = jtu.tree_flatten_with_path(selection.tree)[0]
    found = followers_of_items(selection.tree, path_leaves)
    follower = next((i for i, f in found.items() if f.fits), None)
    if follower is None:
        return
    leader = found[follower].leader
    lead = path_leaves[leader][0][0]
    if selection.path is None:
        how = (
            "Select the parameters alone (the item the others follow, at "
            f"'{path_str((lead,))}' of what you selected)."
        )
    else:
        how = f"Select the parameters alone: {fix(selection.path + (lead,))}."
    raise _error(
        caller,
        "the parameters selected are items built together, of which one follows "
        f"another: '{path_str(path_leaves[follower][0])}' follows "
        f"'{path_str(path_leaves[leader][0])}' (an optimizer state beside its "
        f"model), so the optimizer state would be laid out as parameters. {how}",
    )


def split_state(
    tree: PyTree, params: Any, optimizer: Any, *, caller: str
) -> tuple[PyTree, list[tuple[KeyPath, Any]] | None]:
    """The parameters `params` selects in a whole state `tree` (checked by
    `check_parameters`), and its other arrays with their paths (the optimizer
    state); `tree` itself and `None` for `params=None`."""
    if params is None:
        return tree, None
    if optimizer is not None:
        raise _error(
            caller,
            "`params` picks the parameters in a whole state, whose optimizer "
            "state is then planned as it is, but `optimizer` is given too. Leave "
            "`optimizer` out, or pass the parameters alone without `params`.",
        )
    params = as_index(params)
    if isinstance(params, int) and not isinstance(params, bool):
        if not isinstance(tree, tuple | list):
            raise _error(
                caller,
                f"`params={params}` picks an item of a tuple or list, but the tree "
                f"is a {type(tree).__name__}. Give a function of the tree "
                "returning the parameters, such as `lambda state: state.model`.",
            )
        tree = tuple(tree)
    selection = select(tree, params, caller=caller, what="the tree")
    check_parameters(
        selection, caller=caller, fix=lambda p: f"`params={selector_text(p, 'state')}`"
    )
    chosen = set(selection.leaves)
    rest = [
        (tuple(path), leaf)
        for i, (path, leaf) in enumerate(jtu.tree_flatten_with_path(tree)[0])
        if i not in chosen and is_array(leaf)
    ]
    return selection.tree, rest
