# The property suite, extended to the lifecycle (see tests/test_properties.py for
# the strategies it shares):
#
# - `init_sharded` over random constructors (nested dicts, tuples, lists,
#   NamedTuples and Equinox modules of random, bit-pattern, constant and key
#   arrays, with static fields and a value read from a closure) and random spec
#   trees: every array equals the one the `jax.jit`-ted constructor makes, bit for
#   bit, placed as asked, everything else as eager construction makes it; or an
#   eqshard error names a path. Building again with a new key compiles nothing,
#   and a closure value changed in between is read again.
# - eager `shard_map` calls with a closure's variable and NumPy data changed in
#   between: each call computes with the values of its time.
# - `plan_training` against `shard`: the parameter bytes it plans on each device
#   are the bytes of the shards `shard` places there, read from
#   `addressable_shards`, for random trees of every dtype and random specs.
#
# Each example compiles, so these run fewer examples than the profile's (a fifth).

import dataclasses
import itertools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from hypothesis import event, given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P
from probes import Compiles
from test_properties import (
    _OTHER_LEAVES,
    _paths,
    MESHES,
    Module,
    Pair,
    spec_trees,
    trees,
)

import eqshard


_FEWER = settings(max_examples=max(10, settings().max_examples // 5))


# ---------------------------------------------------------------------------------
# Random constructors: a tree of recipes, each one array made from the key.


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How the constructor makes one array (a leaf of the recipe tree)."""

    kind: str
    shape: tuple[int, ...]
    dtype: Any


_FLOATS = [jnp.float32, jnp.bfloat16, jnp.float16]
_ANY = [*_FLOATS, jnp.int32, jnp.int8, jnp.uint8, jnp.bool_]


@st.composite
def recipes(draw) -> Recipe:
    kind = draw(st.sampled_from(["normal", "uniform", "bits", "full", "keys"]))
    shape = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 3, 4, 8]), max_size=3)))
    if kind == "keys":
        shape = shape[:1]
    dtype = draw(st.sampled_from(_FLOATS if kind in ("normal", "uniform") else _ANY))
    return Recipe(kind, shape, np.dtype(dtype))


def recipe_trees() -> st.SearchStrategy:
    leaves = st.one_of(recipes(), recipes(), _OTHER_LEAVES)
    keys = st.sampled_from(["a", "b", "w", "0"])
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.dictionaries(keys, children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.lists(children, max_size=3),
            st.builds(Pair, children, children),
            st.builds(Module, children, children, st.sampled_from(["s", "t"])),
        ),
        max_leaves=5,
    )


def _make(recipe: Recipe, key: jax.Array, scale: float) -> jax.Array:
    shape, dtype = recipe.shape, recipe.dtype
    if recipe.kind == "normal":
        return jax.random.normal(key, shape, dtype) * scale
    if recipe.kind == "uniform":
        return jax.random.uniform(key, shape, dtype, minval=-scale, maxval=scale)
    if recipe.kind == "bits":  # every bit pattern of the dtype
        bits = jax.random.bits(key, shape, jnp.uint8 if dtype.itemsize == 1 else None)
        if dtype == np.bool_:
            return (bits & 1).astype(jnp.bool_)
        wide = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[dtype.itemsize]
        return jax.lax.bitcast_convert_type(bits.astype(wide), dtype)
    if recipe.kind == "full":
        return jnp.full(shape, scale, dtype)
    return jax.random.split(key, shape[0] if shape else 1).reshape(shape)


def constructor(tree: Any, read_scale: Any) -> Any:
    """A model constructor of `key` making the arrays of `tree`'s recipes, and
    reading `read_scale()` (a closure's value) each time it runs."""

    def build(key: jax.Array) -> Any:
        count = itertools.count()
        scale = read_scale()

        def make(leaf: Any) -> Any:
            if isinstance(leaf, Recipe):
                return _make(leaf, jax.random.fold_in(key, next(count)), scale)
            return leaf

        return jtu.tree_map(make, tree)

    return build


def _flat_specs(specs: Any, tree: Any) -> list[Any]:
    """The spec of each leaf of `tree`, from a spec tree that may be a prefix."""
    spec_def = jtu.tree_structure(specs, is_leaf=lambda x: x is None)
    return [
        spec
        for spec, sub in zip(
            jtu.tree_leaves(specs, is_leaf=lambda x: x is None),
            spec_def.flatten_up_to(tree),
            strict=True,
        )
        for _ in jtu.tree_leaves(sub)
    ]


def _data(x: jax.Array) -> np.ndarray:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _check_built(model: Any, fn: Any, key: jax.Array, specs: Any, mesh: Any) -> None:
    """`model` is what the jitted constructor makes from `key`, bit for bit, with
    every array placed as `specs` asks (replicated on the program's mesh where
    its spec is `None`), and everything else as eager construction makes it."""
    want_arrays = jax.jit(lambda k: eqx.filter(fn(k), eqx.is_array))(key)
    eager = eqx.filter_eval_shape(fn, key)
    assert jtu.tree_structure(model) == jtu.tree_structure(eager)
    flat_specs = _flat_specs(specs, eager)
    got, want = jtu.tree_leaves(model), jtu.tree_leaves(eager)
    wanted = iter(jtu.tree_leaves(want_arrays))
    for leaf, shape, spec in zip(got, want, flat_specs, strict=True):
        if not isinstance(shape, jax.ShapeDtypeStruct):
            assert leaf is shape or leaf == shape, (leaf, shape)
            continue
        expected = next(wanted)
        assert leaf.dtype == expected.dtype and leaf.shape == expected.shape
        assert _data(leaf).tobytes() == _data(expected).tobytes(), (leaf, expected)
        if isinstance(spec, NamedSharding | P):
            sharding = (
                spec if isinstance(spec, NamedSharding) else NamedSharding(mesh, spec)
            )
            assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf, spec)
        else:  # replicated on the mesh of the program
            assert leaf.sharding.is_fully_replicated


@_FEWER
@given(
    data=st.data(),
    tree=recipe_trees(),
    mesh=st.sampled_from(MESHES),
    scales=st.tuples(st.sampled_from([0.5, 2.0]), st.sampled_from([0.5, 2.0])),
)
def test_init_sharded_is_the_jitted_constructor_or_an_eqshard_error(
    data, tree, mesh, scales
):
    scale = [scales[0]]
    fn = constructor(tree, lambda: scale[0])
    key, other = jax.random.key(data.draw(st.integers(0, 9))), jax.random.key(10)
    shapes = eqx.filter_eval_shape(fn, key)
    specs = data.draw(spec_trees(shapes, mesh))
    try:
        model = eqshard.init_sharded(fn, key, specs=specs, mesh=mesh)
    except (ValueError, TypeError) as error:
        message = str(error)
        event(f"refused: {message[:60]}")
        assert message.startswith("eqshard.init_sharded: "), message
        assert any(f"'{p}'" in message for p in _paths(shapes)), message
        return
    event("built")
    _check_built(model, fn, key, specs, mesh)
    # Again with a new key, and the closure's value changed or not.
    scale[0] = scales[1]
    with Compiles() as compiles:
        again = eqshard.init_sharded(fn, other, specs=specs, mesh=mesh)
    if scales[0] == scales[1]:
        assert compiles.count == 0
    _check_built(again, fn, other, specs, mesh)


@_FEWER
@given(
    steps=st.lists(
        st.tuples(st.sampled_from([0.5, 2.0, -3.0]), st.sampled_from([0.0, 1.0])),
        min_size=1,
        max_size=6,
    )
)
def test_eager_shard_map_reads_what_fn_reads_at_every_call(mesh, steps):
    # A closure's variable and NumPy data changed in place between eager calls:
    # each call gives what fn computes now, as an eager `jax.shard_map` does.
    scale = [1.0]
    table = np.zeros(1, np.float32)

    def fn(x):
        return x * scale[0] + table

    mapped = eqshard.filter_shard_map(
        fn, in_specs=P("dp"), out_specs=P("dp"), mesh=mesh
    )
    x = np.arange(8.0, dtype=np.float32)
    for value, offset in steps:
        scale[0], table[:] = value, offset
        np.testing.assert_array_equal(np.asarray(mapped(x)), x * value + offset)


# ---------------------------------------------------------------------------------
# Plans against what `shard` places.


def _held_bytes(placed: Any, counted: list[bool], mesh: Any) -> tuple[int, ...]:
    """The bytes of the shards of the arrays of `placed` that are `counted`, per
    device of `mesh`, read from the arrays."""
    per = {device.id: 0 for device in mesh.devices.flat}
    for out, count in zip(jtu.tree_leaves(placed), counted, strict=True):
        if count and isinstance(out, jax.Array):
            for shard in out.addressable_shards:
                per[shard.device.id] += shard.data.nbytes
    return tuple(per[device.id] for device in mesh.devices.flat)


@_FEWER
@given(data=st.data(), tree=trees(), mesh=st.sampled_from(MESHES))
def test_planned_parameter_bytes_are_the_placed_bytes(data, tree, mesh):
    specs = data.draw(spec_trees(tree, mesh))
    try:
        placed = eqshard.shard(tree, specs, mesh)
    except (ValueError, TypeError) as error:
        event("shard refused")
        placed = error
    try:
        plan = eqshard.plan_training(tree, specs, mesh, gradients=False)
    except (ValueError, TypeError) as error:
        message = str(error)
        event(f"plan refused: {message[:60]}")
        assert message.startswith("eqshard."), message
        assert any(f"'{p}'" in message for p in _paths(tree)), message
        assert isinstance(placed, Exception), "shard placed what the plan refused"
        return
    if isinstance(placed, Exception):
        return
    event("placed")
    assert not plan.problems, plan.problems
    # The arrays with a spec, where `shard` placed them; with no specs at all
    # (`None`) the plan reads where every array is, and `shard` leaves them there.
    counted = [specs is None or spec is not None for spec in _flat_specs(specs, tree)]
    assert plan.params.bytes_per_device == _held_bytes(placed, counted, mesh)
