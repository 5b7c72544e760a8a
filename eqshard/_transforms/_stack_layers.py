"""`stack_layers` and `unstack_layers`: a Python list of layers, as users write
them (`self.blocks = [Block(...) for ...]`), to the stack `jax.lax.scan` and
`eqshard.pipeline` take (every array with a leading layer axis), and back.

How a list is stacked (`_stack`, one walk down the layers' trees together):

1. **Modules** of one type are stacked field by field. A static field equal on
   every layer stays as it is; one that differs (a hook name, a layer index) is
   kept as `PerLayer`, the tuple of the layers' values, so the stack is one
   pytree and `unstack_layers` gives each layer its own value back.
2. **Other nodes** (lists, tuples, dicts, `None`) must have one structure on
   every layer; their children are stacked.
3. **Leaves.** Arrays of one shape and dtype become one array with a leading
   layer axis (`jnp.stack`, or `np.stack` for NumPy arrays); other leaves
   (functions, Python numbers in dynamic fields) equal on every layer stay as
   they are, and differing Python numbers become an array of the layers' values
   (data a scan slices). Anything else that differs is an error naming the path
   and the layers.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._tree import path_str
from .._typing import KeyPath, typecheck


@dataclasses.dataclass(frozen=True)
class PerLayer:
    """A static value that differs between the stacked layers: their values in
    layer order (a leaf of the stack, hashable, not data)."""

    values: tuple[Any, ...]


def _error(path: KeyPath, what: str, fix: str) -> ValueError:
    where = path_str(path)
    return ValueError(f"eqshard.stack_layers: at '{where}' {what}; {fix}")


def _differ(values: Sequence[Any], key: Any = lambda v: v) -> str:
    """`layer 0 ..., layer i ...`: the first layer whose value differs."""
    first = key(values[0])
    at = next(i for i, v in enumerate(values) if key(v) != first)
    return f"layer 0 has {first!r}, layer {at} has {key(values[at])!r}"


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except (TypeError, ValueError):  # an array-like comparison
        return a is b


def _stack_leaves(values: list[Any], path: KeyPath) -> Any:
    if all(isinstance(v, jax.Array | np.ndarray) for v in values):
        kinds = {(v.shape, v.dtype) for v in values}
        if len(kinds) > 1:
            raise _error(
                path,
                "the layers' arrays differ: "
                + _differ(values, lambda v: f"{v.dtype}{list(v.shape)}"),
                "stacked layers need arrays of one shape and dtype; keep the odd "
                "layer out of the stack.",
            )
        stack = (
            np.stack if all(isinstance(v, np.ndarray) for v in values) else jnp.stack
        )
        return stack(values)
    if all(_equal(v, values[0]) for v in values):
        return values[0]
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return jnp.asarray(values)
    raise _error(
        path,
        f"the layers differ: {_differ(values)}",
        "give the layers equal values there, or make them arrays or numbers "
        "(data a scan slices).",
    )


def _stack_module(values: list[Any], path: KeyPath) -> Any:
    kind = type(values[0])
    out = object.__new__(kind)
    for field in dataclasses.fields(kind):
        got = [getattr(v, field.name) for v in values]
        at = (*path, jtu.GetAttrKey(field.name))
        if not field.metadata.get("static", False):
            value = _stack(got, at)
        elif all(_equal(g, got[0]) for g in got):
            value = got[0]
        else:
            value = PerLayer(tuple(got))
        object.__setattr__(out, field.name, value)
    return out


def _stack(values: list[Any], path: KeyPath) -> Any:
    kinds = {type(v) for v in values}
    if len(kinds) > 1:
        raise _error(
            path,
            f"the layers are of different types: "
            f"{_differ(values, lambda v: type(v).__name__)}",
            "stack layers of one type (keep the odd one out of the stack).",
        )
    if isinstance(values[0], eqx.Module):
        return _stack_module(values, path)
    children, defs = [], []
    for v in values:
        kids, tree = jtu.tree_flatten_with_path(v, is_leaf=lambda y, v=v: y is not v)
        children.append(kids)
        defs.append(tree)
    if defs[0].num_leaves == 1 and defs[0] == jtu.tree_structure(0):
        return _stack_leaves(values, path)  # a leaf
    if any(d != defs[0] for d in defs):
        raise _error(
            path,
            f"the layers' structures differ: {_differ(defs)}",
            "stack layers of one structure.",
        )
    stacked = [
        _stack([kids[i][1] for kids in children], (*path, *children[0][i][0]))
        for i in range(len(children[0]))
    ]
    return defs[0].unflatten(stacked)


@typecheck
def stack_layers(layers: Sequence[PyTree]) -> PyTree:
    """Stacks a list of layers into one, every array with a leading layer axis:
    what `jax.lax.scan` and [`eqshard.pipeline`][] take, from the layers as a
    model wrote them (`[Block(...) for _ in range(n)]`).

    The layers must have one type and structure, and arrays of one shape and
    dtype at each place. A static field that differs between them (a hook name,
    a layer index) is kept as a `PerLayer` tuple of their values (the stacked
    layer sees that tuple); Python numbers in dynamic fields that differ become
    an array of the layers' values. [`eqshard.unstack_layers`][] gives the list
    back, bit for bit.

    **Arguments:**

    - `layers`: the layers, a list or tuple of pytrees (Equinox modules).

    **Returns:**

    One layer whose arrays have a leading axis of `len(layers)`.

    **Raises:**

    `ValueError`, naming the path and the layers that differ, if the layers'
    types or structures differ, or their arrays' shapes or dtypes, or values
    that can be neither carried nor made data; or if `layers` is empty.

    !!! Example

        ```python
        blocks = [eqx.nn.Linear(8, 8, key=k) for k in jax.random.split(key, 4)]
        stack = eqshard.stack_layers(blocks)
        print(stack.weight.shape)  # (4, 8, 8)
        ```
    """
    if isinstance(layers, str) or not len(layers):
        raise ValueError(
            f"eqshard.stack_layers: `layers` is {layers!r}; give a non-empty list "
            "of layers."
        )
    return _stack(list(layers), ())


def _count(stack: Any) -> int:
    sizes = {
        int(leaf.shape[0])
        for leaf in jtu.tree_leaves(stack)
        if isinstance(leaf, jax.Array | np.ndarray) and leaf.ndim
    }
    sizes |= {
        len(leaf.values)
        for leaf in jtu.tree_leaves(stack)
        if isinstance(leaf, PerLayer)
    }
    if len(sizes) != 1:
        raise ValueError(
            "eqshard.unstack_layers: the stack's arrays have leading axes "
            f"{sorted(sizes)}, not one layer axis; give a stack made by "
            "`eqshard.stack_layers` or `eqx.filter_vmap`."
        )
    return sizes.pop()


def _take(tree: Any, i: int) -> Any:
    """Layer `i` of `tree`, walked as `_stack` walked the layers."""
    if isinstance(tree, PerLayer):
        return tree.values[i]
    if isinstance(tree, jax.Array | np.ndarray):
        return tree[i]
    if isinstance(tree, eqx.Module):
        out = object.__new__(type(tree))
        for field in dataclasses.fields(tree):
            value = getattr(tree, field.name)
            if not field.metadata.get("static", False):
                value = _take(value, i)
            elif isinstance(value, PerLayer):
                value = value.values[i]
            object.__setattr__(out, field.name, value)
        return out
    kids, tree_def = jtu.tree_flatten(tree, is_leaf=lambda y: y is not tree)
    if tree_def == jtu.tree_structure(0):
        return tree  # a leaf kept as it was
    return tree_def.unflatten([_take(kid, i) for kid in kids])


@typecheck
def unstack_layers(stack: PyTree) -> list[PyTree]:
    """The list of layers [`eqshard.stack_layers`][] stacked (or any stack whose
    arrays share a leading layer axis, such as `eqx.filter_vmap`'s): layer `i`
    has each array's row `i` and its own static values back.

    **Arguments:**

    - `stack`: the stacked layers.

    **Returns:**

    A list of `L` layers, `L` the leading axis.

    **Raises:**

    `ValueError` if the stack's arrays do not share a leading axis.

    !!! Example

        ```python
        layers = eqshard.unstack_layers(stack)
        print(len(layers), layers[0].weight.shape)  # 4 (8, 8)
        ```
    """
    return [_take(stack, i) for i in range(_count(stack))]
