"""What a training plan (`_plan.py`) reads of what is trained and its optimizer
state: which parameters are trained (`trained_mask`), the state made abstractly
(`optimizer_state`) with the specs of its arrays, following the parameters they
belong to (`state_pairs`) or matched by rules with the parameters
(`ruled_state_pairs`), and the bytes the plan's parts keep in host memory
(`host_bytes`); the abstract arrays the plan counts, in the dtype each is
placed in (`abstracter`).
"""

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec
from jaxtyping import PyTree

from .._caches import register
from .._spectree._check_spec import leaf_specs
from .._spectree._follow import follow_spec, replicated_like
from .._spectree._memory import Host, HOST_MEMORY, in_memory, is_host_memory
from .._spectree._rules import compile_rules, rules_to_specs
from .._tree import broadcast_prefix, is_array, path_name, path_str, placed_dtype
from .._typing import KeyPath
from ._strategy import analyze_pairs


def _placed(dtype: Any) -> Any:
    """The dtype an array of `dtype` is on devices: as [`eqshard.shard`][] places
    NumPy data (32-bit for 64-bit while `jax_enable_x64` is off); typed PRNG keys
    as they are."""
    if jnp.issubdtype(dtype, jax.dtypes.extended):
        return dtype
    return placed_dtype(np.dtype(dtype))


@functools.cache
def _placed_as(own: Any, dtype: Any) -> Any:
    """The dtype an array of dtype `own` is placed in when asked for `dtype`:
    `dtype` for a float array if given, else its own."""
    if dtype is None or not jnp.issubdtype(own, jnp.inexact):
        dtype = own
    return _placed(dtype)


register(_placed_as.cache_clear)


def abstracter() -> Callable[[Any, Any], Any]:
    """`abstract(leaf, dtype)`: `leaf` as a `ShapeDtypeStruct` in the dtype it
    would be placed in (`dtype` if it is a float array and `dtype` is given, else
    its own); one struct for each shape and dtype (a model repeats a few, layer
    after layer)."""
    made: dict[tuple[tuple[int, ...], Any], jax.ShapeDtypeStruct] = {}

    def abstract(leaf: Any, dtype: Any) -> Any:
        if not is_array(leaf):
            return leaf
        key = (tuple(leaf.shape), _placed_as(leaf.dtype, dtype))
        struct = made.get(key)
        if struct is None:
            struct = made[key] = jax.ShapeDtypeStruct(*key)
        return struct

    return abstract


def state_pairs(
    path_leaves: Sequence[tuple[KeyPath, Any]],
    param_pairs: dict[KeyPath, tuple[tuple[int, ...], Any]],
) -> list[tuple[KeyPath, Any]]:
    """A spec for each leaf of an optimizer state (its `(path, leaf)` pairs),
    following the parameter it belongs to as [`eqshard.derive_specs`][] does; any
    other leaf (step counts) is replicated on the parameters' mesh."""
    default: Any = PartitionSpec()
    for _, spec in param_pairs.values():
        if spec is not None:
            default = replicated_like(spec)
            break
    out = []
    for path, leaf in path_leaves:
        shape = tuple(getattr(leaf, "shape", ()))
        found, spec = follow_spec(path, shape, param_pairs)
        out.append((path, spec if found else default))
    return out


def ruled_state_pairs(
    rules: Any,
    params: PyTree,
    state: PyTree,
    followed: list[tuple[KeyPath, Any]],
    *,
    mesh: Any,
    caller: str,
) -> list[tuple[KeyPath, Any]]:
    """The optimizer state's specs, `followed` (`state_pairs`) but where a host
    rule of `rules` is the first to match a leaf's path in `(params, state)`, as
    [`eqshard.init_sharded`][] matches a state built with its model: `host()`
    keeps the followed layout in host memory, `host(spec)` gives its own."""
    compiled = compile_rules(rules, caller)
    if not any(isinstance(value, Host) for _, value in compiled):
        return followed
    both = rules_to_specs(
        rules,
        (params, state),
        mesh=mesh,
        check_on_mesh=False,
        on_invalid="ignore",
        caller=caller,
    )
    ruled = leaf_specs(both[1], state, caller=caller)
    out = []
    for (path, spec), (_, own) in zip(followed, ruled, strict=True):
        name = path_name((jtu.SequenceKey(1), *path), "/")
        value = next((v for r, v in compiled if r.search(name)), None)
        if isinstance(value, Host):
            spec = in_memory(spec, HOST_MEMORY) if value.spec is None else own
        out.append((path, spec))
    return out


def host_bytes(
    parts: Sequence[tuple[Sequence[Any], Sequence[tuple[KeyPath, Any]]]],
    mesh: Mesh | AbstractMesh,
    caller: str,
) -> np.ndarray:
    """The bytes per device of the arrays kept in host memory, of `parts` (each
    its leaves and their `(path, spec)` pairs), analysed with only those."""
    per_device = np.zeros(math.prod(mesh.axis_sizes), dtype=np.int64)
    for leaves, pairs in parts:
        host = [is_host_memory(spec) for _, spec in pairs]
        if any(host):
            only = [leaf if h else None for leaf, h in zip(leaves, host, strict=True)]
            report = analyze_pairs(only, pairs, mesh, caller=caller)
            per_device += np.asarray(report.bytes_per_device, dtype=np.int64)
    return per_device


def is_trainable(leaf: Any) -> bool:
    return is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact)


def _is_filter_leaf(x: Any) -> bool:
    return isinstance(x, bool) or (
        callable(x) and jtu.treedef_is_leaf(jtu.tree_structure(x))
    )


def trained_mask(trainable: Any, params: PyTree, caller: str) -> list[bool]:
    """For each leaf of `params`, whether it is trained: a floating-point array
    that the filter `trainable` (as `eqx.partition`'s `filter_spec`) selects."""
    if trainable is True:
        return [is_trainable(leaf) for leaf in jtu.tree_leaves(params)]
    pairs = broadcast_prefix(
        trainable, params, is_leaf=_is_filter_leaf, name="trainable", caller=caller
    )
    out = []
    for (path, chosen), leaf in zip(pairs, jtu.tree_leaves(params), strict=True):
        if not _is_filter_leaf(chosen):
            raise TypeError(
                f"eqshard.{caller}: `trainable` has {chosen!r} at '{path_str(path)}'; "
                "its leaves must be bools or callables of a leaf returning a bool, "
                "as `eqx.partition`'s `filter_spec`."
            )
        if callable(chosen):
            chosen = chosen(leaf)
            if not isinstance(chosen, bool | np.bool_):
                raise TypeError(
                    f"eqshard.{caller}: `trainable` returned {chosen!r} for the "
                    f"leaf at '{path_str(path)}'; a filter returns a bool."
                )
        out.append(bool(chosen) and is_trainable(leaf))
    return out


def check_optimizer(optimizer: Any, caller: str) -> None:
    if optimizer is None or callable(getattr(optimizer, "init", None)):
        return
    hint = (
        " It is callable: call it to make the transformation, e.g. "
        "`optax.adamw(1e-3)`, not `optax.adamw`."
        if callable(optimizer)
        else ""
    )
    raise TypeError(
        f"eqshard.{caller}: `optimizer` must have an `.init(params)` method, such "
        f"as an optax `GradientTransformation`; got {optimizer!r}.{hint} Pass "
        "`optimizer=None` to plan without optimizer state."
    )


def _trained_by_path(
    leaves: list[Any], trained: list[bool], pairs: list[tuple[KeyPath, Any]]
) -> dict[tuple[Any, ...], tuple[tuple[int, ...], Any]]:
    """The trained parameters' `(shape, spec)` by path, for their followers."""
    return {
        tuple(path): (tuple(leaf.shape), spec)
        for (path, spec), leaf, t in zip(pairs, leaves, trained, strict=True)
        if t
    }


def given_state_pairs(
    state: list[tuple[KeyPath, Any]],
    params: tuple[Any, list[Any], list[bool], list[tuple[KeyPath, Any]]],
    abstract: Callable[[Any, Any], Any],
    state_dtype: Any,
) -> tuple[list[Any], list[tuple[KeyPath, Any]]]:
    """An optimizer state given with the parameters (`plan_training`'s
    `params=`), its arrays by path, in `state_dtype`, and the `(path, spec)` of
    each: following its parameter (`params` as for `optimizer_state`)."""
    _, leaves, trained, pairs = params
    if state_dtype is not None:
        state = [(path, abstract(x, state_dtype)) for path, x in state]
    by_path = _trained_by_path(leaves, trained, pairs)
    return [leaf for _, leaf in state], state_pairs(state, by_path)


def optimizer_state(
    optimizer: Any,
    params: tuple[Any, list[Any], list[bool], list[tuple[KeyPath, Any]]],
    rules: Any,
    abstract: Callable[[Any, Any], Any],
    state_dtype: Any,
    mesh: Mesh | AbstractMesh,
) -> tuple[list[Any], list[tuple[KeyPath, Any]]]:
    """The optimizer state of the trained parameters (`params`: their
    structure, abstract leaves, whether each is trained, and `(path, spec)`
    pairs), made abstractly in `state_dtype`, and the `(path, spec)` of each of
    its arrays: following its parameter, or by `rules` where they hold host
    rules."""
    treedef, leaves, trained, pairs = params
    trained_params = jtu.tree_unflatten(
        treedef, [leaf if t else None for leaf, t in zip(leaves, trained, strict=True)]
    )
    state_tree = jax.eval_shape(optimizer.init, trained_params)
    state = jtu.tree_flatten_with_path(state_tree)[0]
    if state_dtype is not None:
        state = [(path, abstract(x, state_dtype)) for path, x in state]
    by_path = _trained_by_path(leaves, trained, pairs)
    specs = state_pairs(state, by_path)
    if rules is not None:
        specs = ruled_state_pairs(
            rules, trained_params, state_tree, specs, mesh=mesh, caller="plan_training"
        )
    return [leaf for _, leaf in state], specs
