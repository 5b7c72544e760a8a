"""Small utilities: metrics for logging, PRNG keys threaded through calls,
padding for sizes that do not divide a mesh, and fjformer's per-leaf shard and
gather functions."""

import functools as ft
import operator
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec
from jaxtyping import PRNGKeyArray, PyTree

from .._caches import register
from .._keys import is_key
from .._mesh._current import concrete_mesh
from .._move._gather import gather
from .._move._host import check_cast_dtype
from .._move._shard import shard_tree
from .._spectree._check_spec import is_spec_leaf
from .._spectree._resolve import NO_TREE, resolve_specs
from .._tree import is_array, mismatch_message, path_str
from .._typing import Int, KeyPath, typecheck


# ---------------------------------------------------------------------------------
# Metrics.
# ---------------------------------------------------------------------------------


def _metric_where(path: KeyPath, stacked: bool) -> str:
    """Where a metric is, for messages: `'loss'`, or `metrics[2] at 'loss'` when
    `path` starts with the index of a list of metric trees."""
    if not stacked:
        return f"'{path_str(path[1:])}'"
    return f"metrics[{path[0].idx}] at '{path_str(path[1:])}'"


def _unreplicate(items: list[Any], stacked: bool) -> list[Any]:
    def first(path: KeyPath, x: Any) -> Any:
        if not is_array(x):
            return x
        if np.ndim(x) == 0:
            raise ValueError(
                "eqshard.compat.get_metrics: the metric at "
                f"{_metric_where(path, stacked)} is a scalar, so it has no leading "
                "replicated axis to take element 0 of. Pass `unreplicate=False` for "
                "metrics from `jax.jit` (they are not replicated along an axis, as "
                "`jax.pmap`'s are)."
            )
        return x[0]

    return jtu.tree_map_with_path(first, items)


def _to_float(path: KeyPath, x: Any) -> Any:
    if isinstance(x, bool | int | float):
        return float(x)
    if not is_array(x):
        return x
    if np.size(x) != 1:
        raise ValueError(
            f"eqshard.compat.get_metrics: the metric at {_metric_where(path, False)} "
            f"has shape {np.shape(x)}, so it is not one number. Reduce it (e.g. "
            "`.mean()`) before returning it, or use `stack=True` for a list of metric "
            "trees."
        )
    return float(np.asarray(x).reshape(()))


def _same_structure(items: list[Any]) -> None:
    first = jtu.tree_structure(items[0])
    for i, item in enumerate(items[1:], start=1):
        if jtu.tree_structure(item) == first:
            continue
        message = mismatch_message(
            item, items[0], lambda _: False, f"metrics[{i}]", "metrics[0]"
        )
        if message.endswith("different structures."):  # `item` is a prefix
            message = mismatch_message(
                items[0], item, lambda _: False, "metrics[0]", f"metrics[{i}]"
            )
        raise ValueError(
            f"eqshard.compat.get_metrics: {message} With `stack=True`, every metric "
            "tree must have the same structure."
        )


@typecheck
def get_metrics(
    metrics: PyTree, *, unreplicate: bool = False, stack: bool = False
) -> PyTree:
    """Copies a pytree of metrics to host, for logging.

    Every `jax.Array` is copied to host in one batched transfer (see
    [`eqshard.gather`][]). Without `stack`, each metric (an array with one element,
    or a Python number) becomes a Python `float`; other leaves, such as strings, are
    returned as they are. With `stack`, `metrics` is a list of metric trees of the
    same structure (one per step, say), and each leaf becomes a NumPy array stacking
    the values of all steps along a new first axis.

    **Arguments:**

    - `metrics`: a pytree of metrics, e.g. `{"loss": loss, "accuracy": acc}`; with
      `stack=True`, a list or tuple of them.
    - `unreplicate`: take element 0 of the leading axis of every array first, as for
      metrics returned by `jax.pmap` (one copy per device). Python numbers have no
      such axis and are left as they are.
    - `stack`: stack a list of metric trees into one tree of arrays.

    **Returns:**

    A pytree of the structure of `metrics` (with `stack`, of `metrics[0]`) holding
    Python floats, or NumPy arrays with `stack`.

    **Raises:**

    - `ValueError` naming the metric, if one has more than one element (without
      `stack`), or is a scalar array with `unreplicate`; or, with `stack`, if
      `metrics` is empty or its trees differ in structure (naming the first path
      that differs).
    - `TypeError` if `stack` is set and `metrics` is not a list or tuple, or
      naming the PRNG keys among the metrics.

    !!! Example

        ```python
        eqshard.compat.get_metrics({"loss": jnp.array(0.5), "step": 3})
        # {"loss": 0.5, "step": 3.0}
        history = [{"loss": jnp.array(0.5)}, {"loss": jnp.array(0.25)}]
        eqshard.compat.get_metrics(history, stack=True)  # {"loss": array([0.5, 0.25])}
        ```
    """
    if stack:
        if not isinstance(metrics, list | tuple):
            raise TypeError(
                "eqshard.compat.get_metrics: with `stack=True`, `metrics` must be a "
                f"list or tuple of metric trees, one per step; got "
                f"{type(metrics).__name__}. Pass `stack=False` to convert a single "
                "metric tree."
            )
        if not metrics:
            raise ValueError(
                "eqshard.compat.get_metrics: with `stack=True`, `metrics` must hold at "
                "least one metric tree; got an empty sequence."
            )
        _same_structure(list(metrics))
    items = list(metrics) if stack else [metrics]
    keys = [p for p, x in jtu.tree_leaves_with_path(items) if is_key(x)]
    if keys:
        where = ", ".join(f"'{path_str(p if stack else p[1:])}'" for p in keys[:10])
        raise TypeError(
            f"eqshard.compat.get_metrics: the metrics hold PRNG keys at {where}, which "
            "are not numbers. Leave them out of the metrics."
        )
    items = gather(items)
    if unreplicate:
        items = _unreplicate(items, stack)
    if stack:
        return jax.tree.map(lambda *xs: np.stack(xs), *items)
    return jtu.tree_map_with_path(_to_float, items)[0]


# ---------------------------------------------------------------------------------
# PRNG keys threaded through calls.
# ---------------------------------------------------------------------------------


class RngFunction(eqx.Module):
    """A function together with the PRNG key for its next call.

    Made by [`eqshard.compat.wrap_function_with_rng`][]. Calling it splits `key`,
    calls the function with one half, and returns the result together with a new
    `RngFunction` holding the other half: `out, f = f(*args)`. It is a pytree
    (an Equinox module whose only leaf is `key`), so it can be passed into and
    returned from `jax.jit`, and checkpointed with the rest of the training state.

    **Fields:**

    - `fn`: the wrapped function, called as `fn(key, *args, **kwargs)`.
    - `key`: the PRNG key the next call splits.
    """

    fn: Callable[..., Any] = eqx.field(static=True)
    key: PRNGKeyArray

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, "RngFunction"]:
        key, subkey = jax.random.split(self.key)
        return self.fn(subkey, *args, **kwargs), type(self)(self.fn, key)


@ft.cache
def _raw_key_shape() -> tuple[int, ...]:
    """The shape of a legacy `uint32` key of the default PRNG implementation."""
    return jax.eval_shape(lambda: jax.random.PRNGKey(0)).shape


register(_raw_key_shape.cache_clear)


def _check_key(key: jax.Array | np.ndarray) -> None:
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if (typed and key.shape == ()) or (
        not typed and key.dtype == np.uint32 and key.shape == _raw_key_shape()
    ):
        return
    raise TypeError(
        "eqshard.compat.wrap_function_with_rng: `key` must be one PRNG key, as made by "
        "`jax.random.key(seed)` (a key array of shape ()) or the legacy "
        f"`jax.random.PRNGKey(seed)` (uint32, of shape {_raw_key_shape()}); got an "
        f"array of shape {key.shape} and dtype {key.dtype}. For several keys, wrap "
        "one function per key."
    )


@typecheck
def wrap_function_with_rng(
    key: jax.Array | np.ndarray,
) -> Callable[[Callable[..., Any]], RngFunction]:
    """Makes a decorator that threads a PRNG key through calls of a function.

    The decorated function is called as `fn(subkey, *args, **kwargs)` with a fresh
    key each time. Unlike fjformer's version, nothing is kept in hidden state: the
    result is an [`eqshard.compat.RngFunction`][], and each call returns the output
    *and the next `RngFunction`*, holding the key for the following call. So it is
    pure, works inside and across `jax.jit`, and two calls of the same
    `RngFunction` give the same key (as two uses of one key should).

    **Arguments:**

    - `key`: the first PRNG key, from `jax.random.key(seed)` or
      `jax.random.PRNGKey(seed)`.

    **Returns:**

    A decorator turning `fn(key, *args, **kwargs)` into an `RngFunction` `f` that
    is called as `out, f = f(*args, **kwargs)`.

    **Raises:**

    A `TypeError` if `key` is not a single PRNG key.

    !!! Example

        ```python
        @eqshard.compat.wrap_function_with_rng(jax.random.key(0))
        def noise(key, shape):
            return jax.random.normal(key, shape)

        a, noise = noise((3,))
        b, noise = noise((3,))  # a fresh key: b differs from a
        ```
    """
    _check_key(key)
    key = jnp.asarray(key)

    def decorator(fn: Callable[..., Any]) -> RngFunction:
        return RngFunction(fn, key)

    return decorator


# ---------------------------------------------------------------------------------
# Padding sizes up to a multiple of a mesh axis.
# ---------------------------------------------------------------------------------


def _check_multiple(caller: str, multiple: int) -> None:
    if multiple < 1:
        raise ValueError(
            f"eqshard.{caller}: `multiple` must be a positive integer, such as the "
            f"size of the mesh axes a dimension is sharded over; got {multiple}."
        )


@typecheck
def round_up_to_multiple(n: Int, multiple: Int) -> int:
    """Rounds a size up to the next multiple of `multiple`.

    For sizes that must divide over a mesh axis, such as a vocabulary of 50257
    tokens sharded 8 ways: `round_up_to_multiple(50257, 8)` is 50264.

    **Arguments:**

    - `n`: a size, at least 0 (a Python or NumPy integer).
    - `multiple`: a positive integer.

    **Returns:**

    The smallest multiple of `multiple` that is at least `n`.

    **Raises:**

    A `ValueError` if `n` is negative or `multiple` is not positive.

    !!! Example

        ```python
        eqshard.compat.round_up_to_multiple(50257, 8)  # 50264
        eqshard.compat.round_up_to_multiple(64, 8)  # 64
        ```
    """
    n, multiple = operator.index(n), operator.index(multiple)
    _check_multiple("compat.round_up_to_multiple", multiple)
    if n < 0:
        raise ValueError(
            "eqshard.compat.round_up_to_multiple: `n` must be a size (at least 0); "
            f"got {n}."
        )
    return -(-n // multiple) * multiple


@typecheck
def pad_to_multiple(
    x: jax.Array | np.ndarray, multiple: Int, *, axis: Int = 0
) -> jax.Array | np.ndarray:
    """Pads one dimension of an array with zeros, up to a multiple of `multiple`.

    So that the dimension divides over the mesh axes it is sharded over (e.g. an
    embedding table whose vocabulary size does not divide by the `tp` axis). The
    new entries are zeros at the end of `axis`. JAX arrays are padded with
    `jnp.pad` (which also works inside `jax.jit`) and NumPy arrays with `np.pad`, on
    host; an array whose dimension already divides is returned as it is.

    **Arguments:**

    - `x`: a `jax.Array` or NumPy array.
    - `multiple`: a positive integer, such as the size of the mesh axes.
    - `axis`: the dimension to pad; negative values count from the end.

    **Returns:**

    An array of the same kind and dtype, with `x.shape[axis]` rounded up by
    [`eqshard.compat.round_up_to_multiple`][].

    **Raises:**

    A `ValueError` if `multiple` is not positive or `axis` is not a dimension of `x`.

    !!! Example

        ```python
        table = jnp.ones((50257, 768))
        eqshard.compat.pad_to_multiple(table, 8).shape  # (50264, 768)
        ```
    """
    multiple, axis = operator.index(multiple), operator.index(axis)
    _check_multiple("compat.pad_to_multiple", multiple)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(
            f"eqshard.compat.pad_to_multiple: `axis` {axis} is not a dimension of an "
            f"array of shape {x.shape}; use an axis in [{-x.ndim}, {x.ndim})."
        )
    axis %= x.ndim
    extra = round_up_to_multiple(x.shape[axis], multiple) - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    if isinstance(x, np.ndarray):
        return np.pad(x, widths)
    return jnp.pad(x, widths)


# ---------------------------------------------------------------------------------
# Per-leaf shard and gather functions.
# ---------------------------------------------------------------------------------


@typecheck
def make_shard_and_gather_fns(
    specs: PyTree, mesh: Mesh | AbstractMesh | None = None, *, dtype: Any = None
) -> tuple[PyTree, PyTree]:
    """Makes trees of functions that shard and gather one leaf (or subtree) each.

    For code that moves a tree piece by piece, such as a checkpoint loader, with
    [`eqshard.tree_apply`][]. Each function does what [`eqshard.shard`][] or
    [`eqshard.gather`][] does for its part of the tree, with no compilation, and its
    errors name the full path.

    **Arguments:**

    - `specs`: a spec tree (or prefix of one), as for [`eqshard.shard`][].
    - `mesh`: defaults to the mesh set by `jax.set_mesh` when the functions are made.
    - `dtype`: if given, a floating dtype the functions cast floating arrays to
      (one dtype: each function sees only its part of the tree).

    **Returns:**

    `(shard_fns, gather_fns)`, two pytrees of the structure of `specs`, with a
    function where `specs` has a spec and `None` where it has `None`.

    **Raises:**

    As [`eqshard.shard`][], when a function is called.

    !!! Example

        ```python
        shard_fns, gather_fns = eqshard.compat.make_shard_and_gather_fns(specs, mesh)
        model = eqshard.tree_apply(shard_fns, host_model)
        host_model = eqshard.tree_apply(gather_fns, model)
        ```
    """
    caller = "compat.make_shard_and_gather_fns"
    specs = resolve_specs(specs, NO_TREE, caller=caller, mesh=mesh)
    path_specs, treedef = jtu.tree_flatten_with_path(specs, is_leaf=is_spec_leaf)
    if dtype is not None:
        check_cast_dtype(dtype, caller)
    if any(isinstance(spec, PartitionSpec) for _, spec in path_specs):
        mesh = concrete_mesh(mesh, caller=caller)
    gather_fn = ft.partial(gather, dtype=dtype)
    shard_fns, gather_fns = [], []
    for path, spec in path_specs:
        if spec is None:
            shard_fns.append(None)
            gather_fns.append(None)
            continue
        shard_fns.append(
            ft.partial(
                shard_tree,
                specs=spec,
                mesh=mesh,
                dtype=dtype,
                caller="shard",
                root=path,
            )
        )
        gather_fns.append(gather_fn)
    return jtu.tree_unflatten(treedef, shard_fns), jtu.tree_unflatten(
        treedef, gather_fns
    )
