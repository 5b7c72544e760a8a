"""The circular pipeline's view of stacked layers, and back.

A pipeline over S stages with R repeats splits L stacked layers into R·S chunks of
K = L/(R·S) layers, chunk `c` on stage `c % S`. A sharding gives each device one
contiguous block of a dimension, so that layout is no spec on the `(L, ...)`
leaves: it is a spec on the view `(R, S, K, ...)` of the same layer order (stage
axis second), as MaxText stores it. `stage_view` reshapes every array leaf into
that view and `unstage_view` back; both are reshapes, so layer `l` is at
`[l // (S·K), (l // K) % S, l % K]` of the view. With `repeats=1` (GPipe) the view
is `(1, S, L/S, ...)`, and the `(L, ...)` leaves laid out `P(axis)` already are.
"""

from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._tree import path_str
from .._typing import KeyPath, typecheck


def _shape_error(
    caller: str, path: KeyPath, shape: tuple[int, ...], want: str, fix: str
) -> ValueError:
    return ValueError(
        f"eqshard.{caller}: the leaf at '{path_str(path)}' has shape {shape}, "
        f"{want}; {fix}"
    )


def _reshape(leaf: Any, shape: tuple[int, ...]) -> Any:
    """`leaf` reshaped: a NumPy or JAX array as its kind does, a
    `jax.ShapeDtypeStruct` as a new one (its sharding does not apply)."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, leaf.dtype)
    return leaf.reshape(shape)


def _is_array(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _check_counts(caller: str, stages: int, repeats: int) -> None:
    if stages < 1 or repeats < 1:
        raise ValueError(
            f"eqshard.{caller}: stages={stages} and repeats={repeats}; both must be "
            "at least 1."
        )


@typecheck
def stage_view(stack: PyTree, *, stages: int, repeats: int = 1) -> PyTree:
    """The circular pipeline's view of layers stacked on a leading axis: every
    array leaf `(L, ...)` reshaped to `(repeats, stages, L/(repeats·stages), ...)`,
    the same layer order.

    Stage `s` of a circular pipeline holds chunks `s, s + S, s + 2S, ...` of
    `K = L/(R·S)` layers each: in this view that is `[:, s]`, so the spec
    `P(None, "pp")` on the view (what `eqshard.stacked(spec, stages="pp")` gives
    for such leaves) lays each stage's layers on its devices, which no spec on
    the `(L, ...)` leaves can. Non-array leaves pass through.
    [`eqshard.pipeline`][] takes a stack in this view with `staged=True`;
    [`eqshard.unstage_view`][] is the inverse, and [`eqshard.restore`][] reads a
    checkpoint of either view into the other.

    **Arguments:**

    - `stack`: any pytree whose array leaves (arrays or `jax.ShapeDtypeStruct`s)
      share the leading layer axis.
    - `stages`: the number of pipeline stages S (the size of the stage axis).
    - `repeats`: the chunks per stage R (1 for GPipe).

    **Returns:**

    The tree with every array leaf reshaped to `(R, S, L/(R·S), ...)`.

    **Raises:**

    `ValueError` naming the leaf if one has no leading axis or one not divisible
    by `stages·repeats`, or if the leaves disagree on it.

    !!! Example

        ```python
        w = jnp.arange(8.0)  # 8 layers' scalars
        eqshard.stage_view(w, stages=2, repeats=2)[:, 1]  # stage 1: [[2, 3], [6, 7]]
        ```
    """
    _check_counts("stage_view", stages, repeats)
    leaves = [
        (p, x)
        for p, x in jtu.tree_leaves_with_path(stack, is_leaf=_is_array)
        if _is_array(x)
    ]
    layers = None
    for path, leaf in leaves:
        shape = tuple(leaf.shape)
        if not shape or shape[0] % (stages * repeats):
            raise _shape_error(
                "stage_view",
                path,
                shape,
                f"whose leading (layer) axis is not divisible by stages·repeats = "
                f"{stages}·{repeats}",
                "give a stack whose number of layers is a multiple of that.",
            )
        if layers is not None and shape[0] != layers:
            raise _shape_error(
                "stage_view",
                path,
                shape,
                f"but the first leaf has {layers} layers",
                "every array leaf must share the leading layer axis.",
            )
        layers = shape[0]
    chunk = (layers or 0) // (stages * repeats)
    return jtu.tree_map(
        lambda x: (
            _reshape(x, (repeats, stages, chunk, *x.shape[1:])) if _is_array(x) else x
        ),
        stack,
        is_leaf=_is_array,
    )


@typecheck
def unstage_view(stack: PyTree, *, stages: int, repeats: int = 1) -> PyTree:
    """The inverse of [`eqshard.stage_view`][]: every array leaf
    `(repeats, stages, K, ...)` reshaped back to `(repeats·stages·K, ...)`, layers
    in their natural order (as `jax.lax.scan` runs them).

    **Arguments:**

    - `stack`: a tree in the circular view.
    - `stages`, `repeats`: as given to [`eqshard.stage_view`][].

    **Returns:**

    The tree with every array leaf reshaped to `(L, ...)`.

    **Raises:**

    `ValueError` naming the leaf if one does not start with `(repeats, stages)`.

    !!! Example

        ```python
        view = eqshard.stage_view(jnp.arange(8.0), stages=2, repeats=2)
        eqshard.unstage_view(view, stages=2, repeats=2)  # arange(8.0) again
        ```
    """
    _check_counts("unstage_view", stages, repeats)
    for path, leaf in jtu.tree_leaves_with_path(stack, is_leaf=_is_array):
        if _is_array(leaf) and (
            len(leaf.shape) < 3 or tuple(leaf.shape[:2]) != (repeats, stages)
        ):
            raise _shape_error(
                "unstage_view",
                path,
                tuple(leaf.shape),
                f"not (repeats, stages, K, ...) = ({repeats}, {stages}, K, ...)",
                "give the tree `eqshard.stage_view` returned, with the same counts.",
            )
    return jtu.tree_map(
        lambda x: (
            _reshape(x, (int(np.prod(x.shape[:3])), *x.shape[3:]))
            if _is_array(x)
            else x
        ),
        stack,
        is_leaf=_is_array,
    )
