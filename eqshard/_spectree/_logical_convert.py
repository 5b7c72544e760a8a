"""Logical axis names applied to trees and rules built for them.

`_logical.py` holds `AxisNames`, the one resolver and the rules context; this
module builds on them: [`eqshard.logical_to_mesh_axes`][] and
[`eqshard.logical_to_mesh_specs`][] (flax's names: one `AxisNames`, or a whole tree
of them, to `PartitionSpec`s, with the rules given or the context's),
[`eqshard.composite_axis_rules`][] (rules merged from several tables),
t5x's standard tables ([`eqshard.t5x.standard_logical_axis_rules`][]) and the
names a model declares in its fields' metadata
([`eqshard.declared_axis_names`][]).
"""

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import jax.tree_util as jtu
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._deprecated import renamed_keywords
from .._tree import is_array, path_str
from .._typing import AxisRulesArg, Int, KeyPath, typecheck
from ._logical import (
    axis_names_resolver,
    AxisNames,
    logical_to_spec,
    LogicalRules,
    MeshAxes,
    normalize_rules,
    rules_or_context,
)


# --------------------------------------------------------------------------------
# Error messages: one builder per kind.


def _leaf_message(path: KeyPath, leaf: Any) -> str:
    hint = ""
    if isinstance(leaf, str):
        hint = (
            " A plain tuple of names is a pytree node, so its names became separate "
            "leaves: wrap them as eqshard.AxisNames(...) to keep them one leaf."
        )
    return (
        f"eqshard.logical_to_mesh_specs: the tree has {leaf!r} (a "
        f"{type(leaf).__name__}) at '{path_str(path)}'. Each leaf must be an "
        "eqshard.AxisNames, a PartitionSpec or NamedSharding (kept as it is), or "
        f"None (not an array).{hint}"
    )


def _conflict_message(name: str, first: tuple[MeshAxes, ...], second: Any) -> str:
    def show(targets: tuple[MeshAxes, ...]) -> str:
        return repr(targets[0]) if len(targets) == 1 else repr(list(targets))

    return (
        "eqshard.composite_axis_rules: inconsistent rules for the logical axis "
        f"{name!r}: {show(first)} in `first` vs {show(second)} in `second`. Remove "
        f"{name!r} from one of them, or make both map it to the same mesh axes."
    )


def _dims_message(activation: int, parameter: int) -> str:
    bad = [
        f"{argname}={value!r}"
        for argname, value in (
            ("activation_partitioning_dims", activation),
            ("parameter_partitioning_dims", parameter),
        )
        if value not in (1, 2)
    ]
    return (
        f"eqshard.t5x.standard_logical_axis_rules: {' and '.join(bad)} is not "
        "supported. Each of activation_partitioning_dims and "
        "parameter_partitioning_dims must be 1 (shard over one mesh axis) or 2 "
        "(also shard 'embed' over a second one)."
    )


# --------------------------------------------------------------------------------
# Public conversions and rule builders.


@typecheck
def composite_axis_rules(
    first: AxisRulesArg | None, second: AxisRulesArg | None
) -> LogicalRules:
    """Combines two sets of logical axis rules, refusing contradictions.

    The result has every rule of `first`, in order, then the rules of `second` for
    logical names that `first` does not mention. A name may have several rules (a
    fallback chain such as `("embed", "model"), ("embed", "data")`); a name in both
    sets must have the same chain in each, or the rules are inconsistent. Since
    earlier rules win when two names compete for a mesh axis, `first` has priority.

    **Arguments:**

    - `first`: a sequence of `(logical_name, mesh_axes)` pairs, or `None` (no
      rules).
    - `second`: another such sequence, or `None`.

    **Returns:**

    The combined, validated rules as a tuple of tuples.

    **Raises:**

    - `ValueError` naming a logical axis that the two sets map differently, with
      both mappings.
    - `TypeError`/`ValueError` naming a malformed rule.

    !!! Example

        ```python
        rules = eqshard.composite_axis_rules([("batch", "data")], [("mlp", "model")])
        rules  # (("batch", "data"), ("mlp", "model"))
        eqshard.composite_axis_rules([("mlp", "model")], [("mlp", "data")])  # error
        ```
    """
    a = (
        ()
        if first is None
        else normalize_rules(first, caller="composite_axis_rules", argname="first")
    )
    b = (
        ()
        if second is None
        else normalize_rules(second, caller="composite_axis_rules", argname="second")
    )
    chains: dict[str, tuple[MeshAxes, ...]] = {}
    for name, axes in a:
        chains[name] = chains.get(name, ()) + (axes,)
    theirs: dict[str, tuple[MeshAxes, ...]] = {}
    for name, axes in b:
        theirs[name] = theirs.get(name, ()) + (axes,)
    for name, chain in theirs.items():
        if name in chains and chains[name] != chain:
            raise ValueError(_conflict_message(name, chains[name], chain))
    return a + tuple((name, axes) for name, axes in b if name not in chains)


@renamed_keywords("logical_to_mesh_axes", rules="axis_rules")
@typecheck
def logical_to_mesh_axes(
    axes: Sequence[Any] | None, axis_rules: AxisRulesArg | None = None
) -> PartitionSpec | None:
    """Turns the logical names of an array's dimensions into a `PartitionSpec`.

    The rules are tried in order. A rule `(name, mesh_axes)` sets the entry of the
    dimension called `name` if no earlier rule has set it and none of `mesh_axes`
    shards another dimension yet: a mesh axis is used at most once per spec, and a
    later rule for the same name is a fallback for when its mesh axes are taken. A
    rule mapping to `None` settles its dimension as unsharded. A dimension no rule
    sets is `None` (replicated): names no rule mentions (as in flax, not an error:
    check their spelling if an array comes out unsharded), `None` entries of
    `axes`, names whose mesh axes were all taken. These are flax's semantics. The
    result depends only on `axes` and `axis_rules` (`None` reads
    [`eqshard.get_logical_axis_rules`][]; with no rules set every entry is `None`).

    **Arguments:**

    - `axes`: one logical name (`str`) or `None` per dimension; an
      [`eqshard.AxisNames`][] or any sequence. `None` (no names known) gives
      `None`, as in flax.
    - `axis_rules`: a sequence of `(logical_name, mesh_axes)` pairs in priority
      order; `None` reads the current [`eqshard.logical_axis_rules`][].

    **Returns:**

    A `PartitionSpec` with one entry per dimension: a mesh axis name, a tuple of
    them, or `None`; `None` if `axes` is `None`.

    **Raises:**

    `ValueError` if a logical name appears twice in `axes`; `TypeError` if `axes`
    is a string or has an entry neither a `str` nor `None`; `TypeError` or
    `ValueError` naming the first malformed rule.

    !!! Example

        ```python
        rules = [("batch", "data"), ("mlp", "model"), ("embed", "model"),
                 ("embed", "data")]
        eqshard.logical_to_mesh_axes(("batch", "embed"), rules)  # P("data", "model")
        eqshard.logical_to_mesh_axes(("embed", "mlp"), rules)  # P("data", "model")
        eqshard.logical_to_mesh_axes(("length", None), rules)  # P(None, None)
        ```
    """
    table = rules_or_context(axis_rules, "logical_to_mesh_axes")
    if axes is None:  # no logical axes known: nothing to shard (flax)
        return None
    return logical_to_spec(axes, table, caller="logical_to_mesh_axes")


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec | NamedSharding)


@renamed_keywords("logical_to_mesh_specs", rules="axis_rules")
@typecheck
def logical_to_mesh_specs(
    tree: PyTree, axis_rules: AxisRulesArg | None = None
) -> PyTree:
    """Turns a tree of logical axis names into a spec tree of `PartitionSpec`s.

    Every [`eqshard.AxisNames`][] leaf is resolved by
    [`eqshard.logical_to_mesh_axes`][] with the same rules; `None` (for leaves that
    are not arrays) stays `None`, and `PartitionSpec`/`NamedSharding` leaves, which
    already name mesh axes, are kept as they are, so a spec tree may mix both. The
    result has the structure of `tree` (same containers and module types), ready
    for [`eqshard.shard`][]. This is t5x's `get_mesh_axes` for any pytree, without
    a `TrainState`.

    **Arguments:**

    - `tree`: a pytree (an Equinox module, dicts, lists, ...) whose leaves are
      `AxisNames`, `PartitionSpec`, `NamedSharding` or `None`.
    - `axis_rules`: a sequence of `(logical_name, mesh_axes)` pairs in priority
      order; `None` reads the current [`eqshard.logical_axis_rules`][].

    **Returns:**

    A pytree of the structure of `tree` with a `PartitionSpec` for every
    `AxisNames`.

    **Raises:**

    - `TypeError` naming the path of a leaf of another type; a plain tuple of
      names is walked into by JAX, so its names show up as `str` leaves at paths
      like `'w/0'` (wrap it in `AxisNames`).
    - `ValueError` naming the path of an `AxisNames` that repeats a name.
    - `TypeError`/`ValueError` naming the first malformed rule.

    !!! Example

        ```python
        axes = {"w": eqshard.AxisNames("embed", "mlp"), "step": None}
        specs = eqshard.logical_to_mesh_specs(axes, [("mlp", "model")])
        specs  # {"w": P(None, "model"), "step": None}
        ```
    """
    caller = "logical_to_mesh_specs"
    resolve = axis_names_resolver(rules_or_context(axis_rules, caller), caller=caller)

    def convert(path: KeyPath, leaf: Any) -> Any:
        if isinstance(leaf, AxisNames):
            return resolve(leaf, path)
        if _is_spec(leaf):
            return leaf
        raise TypeError(_leaf_message(path, leaf))

    return jtu.tree_map_with_path(convert, tree)


# t5x's default tables, keyed by (activation_partitioning_dims,
# parameter_partitioning_dims). 1-D both: 'embed' is never sharded. Otherwise
# 'embed' comes last: 2-D activations shard it over 'model', 2-D parameters over
# 'data', and with both 'model' is tried first.
_SHARDED_RULES: LogicalRules = (
    ("batch", "data"),
    ("vocab", "model"),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv", None),
    ("joined_kv", "model"),
)
_STANDARD_RULES: dict[tuple[int, int], LogicalRules] = {
    (1, 1): _SHARDED_RULES[:2] + (("embed", None),) + _SHARDED_RULES[2:],
    (2, 1): _SHARDED_RULES + (("embed", "model"),),
    (1, 2): _SHARDED_RULES + (("embed", "data"),),
    (2, 2): _SHARDED_RULES + (("embed", "model"), ("embed", "data")),
}

# Logical axes that every standard table keeps unsharded.
_REPLICATED_AXES = (
    "relpos_buckets",
    "abspos_buckets",
    "length",
    "layers",
    "stack",
    "mlp_activations",
)


@typecheck
def standard_logical_axis_rules(
    activation_partitioning_dims: Int = 1,
    parameter_partitioning_dims: Int = 1,
    additional_rules: AxisRulesArg | None = None,
) -> LogicalRules:
    """The default logical axis rules of t5x, for a `('data', 'model')` mesh.

    `'batch'` is sharded over `'data'`; `'vocab'`, `'mlp'`, `'heads'` and
    `'joined_kv'` over `'model'`; `'kv'` never. `'embed'` depends on the
    arguments: unsharded for 1-D activations and parameters, `'model'` for 2-D
    activations, `'data'` for 2-D parameters, and `'model'` then `'data'` for
    both. Then `'relpos_buckets'`, `'abspos_buckets'`, `'length'`, `'layers'`,
    `'stack'` and `'mlp_activations'` are replicated, and `additional_rules`
    follow. Rules are tried in order, so an additional rule for a name the table
    already maps never applies: to override the table, put your rules first,
    `tuple(mine) + standard_logical_axis_rules()`
    ([`eqshard.composite_axis_rules`][] would refuse the contradiction).

    **Arguments:**

    - `activation_partitioning_dims`: 1, or 2 to also shard activations' `'embed'`
      dimension over `'model'`.
    - `parameter_partitioning_dims`: 1, or 2 to also shard parameters' `'embed'`
      dimension over `'data'`.
    - `additional_rules`: `(logical_name, mesh_axes)` pairs appended at the end.

    **Returns:**

    The rules as a tuple of `(logical_name, mesh_axes)` tuples.

    **Raises:**

    - `ValueError` naming a partitioning-dims value other than 1 or 2.
    - `TypeError`/`ValueError` naming a malformed additional rule.

    !!! Example

        ```python
        rules = eqshard.t5x.standard_logical_axis_rules(parameter_partitioning_dims=2)
        eqshard.logical_to_mesh_axes(("embed", "mlp"), rules)  # P("data", "model")
        ```
    """
    dims = (
        operator.index(activation_partitioning_dims),
        operator.index(parameter_partitioning_dims),
    )
    table = _STANDARD_RULES.get(dims)
    if table is None:
        raise ValueError(_dims_message(*dims))
    extra = ()
    if additional_rules is not None:
        extra = normalize_rules(
            additional_rules,
            caller="t5x.standard_logical_axis_rules",
            argname="additional_rules",
        )
    return table + tuple((name, None) for name in _REPLICATED_AXES) + extra


# The key of `eqx.field(metadata=...)` that declares a field's logical axis names.
AXES_METADATA_KEY = "logical_axes"


def _collect_declared(node: Any, path: KeyPath, out: dict[KeyPath, AxisNames]) -> None:
    children = jtu.tree_flatten_with_path(node, is_leaf=lambda y: y is not node)[0]
    if len(children) == 1 and children[0][0] == ():
        return  # a leaf
    declared: dict[str, Any] = {}
    if dataclasses.is_dataclass(node):
        for field in dataclasses.fields(node):
            names = field.metadata.get(AXES_METADATA_KEY)
            if names is not None:
                declared[field.name] = names
    for key, child in children:
        names = None
        if isinstance(key[0], jtu.GetAttrKey):
            names = declared.get(key[0].name)
        if names is not None and is_array(child):
            out[path + key] = AxisNames(*names)
        else:
            _collect_declared(child, path + key, out)


@typecheck
def declared_axis_names(tree: PyTree) -> PyTree:
    """The logical axis names that a model declares on its fields, as a tree of
    [`eqshard.AxisNames`][].

    A module says where its axes are where it is defined, as flax users do:
    `weight: jax.Array = eqx.field(metadata={"logical_axes": ("embed", "mlp")})`.
    The result has the structure of `eqx.filter(tree, eqshard.is_array)`: the
    declared `AxisNames` at each array of such a field, `None` at every other
    leaf. Resolve it with [`eqshard.logical_to_mesh_specs`][], or pass it as the
    specs of [`eqshard.shard`][] inside [`eqshard.logical_axis_rules`][].

    Names are declared per array as the field holds it: for layers stacked by
    `eqx.filter_vmap`, declare the stacking axis too (e.g. `("layers", "embed",
    "mlp")`), or resolve per layer and use [`eqshard.stack_specs`][].

    **Arguments:**

    - `tree`: any pytree, usually an Equinox module (concrete or abstract).

    **Returns:**

    A tree of `AxisNames` and `None`s.

    **Raises:**

    `TypeError` naming the position of a declared name that is neither a `str`
    nor `None`.

    !!! Example

        ```python
        class Dense(eqx.Module):
            weight: jax.Array = eqx.field(metadata={"logical_axes": ("embed", "mlp")})
            bias: jax.Array

            def __init__(self):
                self.weight, self.bias = jnp.zeros((8, 16)), jnp.zeros(16)

        eqshard.declared_axis_names(Dense())
        # Dense(weight=AxisNames('embed', 'mlp'), bias=None)
        ```
    """
    found: dict[KeyPath, AxisNames] = {}
    _collect_declared(tree, (), found)
    return jtu.tree_map_with_path(
        lambda path, leaf: found.get(tuple(path)) if is_array(leaf) else None, tree
    )
