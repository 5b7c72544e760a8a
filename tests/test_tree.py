import collections
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import eqshard


class Block(eqx.Module):
    weight: jax.Array
    bias: jax.Array | None
    act: Callable
    name: str = eqx.field(static=True)


def _block():
    return Block(jnp.ones((2, 3)), None, jax.nn.relu, "blk")


@pytest.mark.parametrize(
    "keys, expected",
    [
        ((jtu.DictKey("a"), jtu.SequenceKey(3), jtu.GetAttrKey("w")), "a/3/w"),
        ((jtu.DictKey(7), jtu.FlattenedIndexKey(2)), "7/2"),
        ((), ""),
    ],
)
def test_tree_path_to_string(keys, expected):
    assert eqshard.tree_path_to_string(keys, sep="/") == expected
    assert eqshard.tree_path_to_string(keys) == tuple(
        expected.split("/") if keys else ()
    )
    assert eqshard.tree_path_to_string(keys, sep=".") == expected.replace("/", ".")


def test_flatten_module_and_optax_state():
    tree = {"model": _block(), "opt": optax.adam(1e-3).init({"w": jnp.ones(2)})}
    flat = eqshard.flatten_tree(tree, sep="/")
    # Paths follow attribute names; the static field, None and callable are not
    # array leaves, but the callable is a leaf of the pytree.
    assert list(flat) == [
        "model/weight",
        "model/act",
        "opt/0/count",
        "opt/0/mu/w",
        "opt/0/nu/w",
    ]
    assert flat["model/act"] is jax.nn.relu
    assert flat["model/weight"] is tree["model"].weight


def test_flatten_tuple_keys_and_non_string_dict_keys():
    tree = {1: [np.zeros(1), (2, 3)], 2: None}
    assert eqshard.flatten_tree(tree) == {
        ("1", "0"): tree[1][0],
        ("1", "1", "0"): 2,
        ("1", "1", "1"): 3,
    }


def test_flatten_collision_names_both_paths():
    with pytest.raises(
        ValueError,
        match=r"^eqshard.flatten_tree: .*'a/b': \['a'\]\['b'\] and \['a/b'\]",
    ):
        eqshard.flatten_tree({"a/b": 1, "a": {"b": 2}}, sep="/")
    with pytest.raises(ValueError, match=r"^eqshard.unflatten_tree: .*'a/b'"):
        eqshard.unflatten_tree({"a/b": 1}, {"a/b": 0, "a": {"b": 0}}, sep="/")
    # The same tree has no collision under another separator.
    assert len(eqshard.flatten_tree({"a/b": 1, "a": {"b": 2}}, sep=".")) == 2


def test_flatten_is_leaf_and_struct_leaves():
    tree = {"s": jax.ShapeDtypeStruct((4, 2), jnp.bfloat16), "pair": (1, 2)}
    flat = eqshard.flatten_tree(tree, is_leaf=lambda x: isinstance(x, tuple), sep="/")
    assert flat == {"pair": (1, 2), "s": tree["s"]}


def test_unflatten_round_trip_on_module():
    tree = {"model": _block(), "xs": [jnp.arange(3), None]}
    flat = eqshard.flatten_tree(tree, sep="/")
    out = eqshard.unflatten_tree(flat, tree, sep="/")
    assert jtu.tree_structure(out) == jtu.tree_structure(tree)
    assert out["model"].name == "blk" and out["model"].act is jax.nn.relu
    np.testing.assert_array_equal(out["xs"][0], np.arange(3))


def test_unflatten_reports_missing_and_unexpected():
    like = {"a": {"b": 0}, "c": [0, 0]}
    with pytest.raises(
        ValueError,
        match=r"^eqshard.unflatten_tree: .*Missing from `flat`: 'c/1'.*"
        r"Not in `like`: 'x'",
    ):
        eqshard.unflatten_tree({"a/b": 1, "c/0": 2, "x": 3}, like, sep="/")


def test_named_tree_map_with_rest():
    tree = {"a": [1, 2], "b": None}
    out = eqshard.named_tree_map(lambda n, x, y: f"{n}:{x + y}", tree, tree, sep="/")
    assert out == {"a": ["a/0:2", "a/1:4"], "b": None}


def test_named_tree_map_structure_error_names_path():
    with pytest.raises(ValueError, match=r"'a'.*list of length 2.*list of length 3"):
        eqshard.named_tree_map(lambda n, x, y: x, {"a": [1, 2]}, {"a": [1, 2, 3]})


@pytest.mark.parametrize(
    "tree, other, match",
    [
        ({"a": None, "b": 1}, {"a": 1, "b": 1}, r"at 'a': `tree` has None where"),
        ({"a": ()}, {"a": (1,)}, r"at 'a': `tree` has a tuple of length 0 where"),
        ({"a": {}}, {"a": {"w": 1}}, r"at 'a': `tree` has an empty dict where"),
    ],
)
def test_named_tree_map_childless_node_error_names_path(tree, other, match):
    # None and empty containers are nodes with no leaves, not leaves.
    with pytest.raises(ValueError, match=match):
        eqshard.named_tree_map(lambda n, x, y: x, tree, other)


def test_a_dict_and_a_dict_subclass_are_told_apart_in_the_message():
    # Both were 'a dict with keys 'a', 'b'': the message named no difference.
    tree = collections.defaultdict(list, {"a": 1, "b": 2})
    with pytest.raises(ValueError, match=r"has a dict with keys 'a', 'b' where "):
        eqshard.tree_apply({"a": None, "b": None}, tree)
    with pytest.raises(ValueError, match=r"`tree` has a defaultdict with keys 'a'"):
        eqshard.tree_apply({"a": None, "b": None}, tree)
    with pytest.raises(ValueError, match=r"`tree` has an OrderedDict with keys"):
        eqshard.named_tree_map(
            lambda n, x, y: x, collections.OrderedDict(a=1), {"a": 1}, sep="/"
        )


def test_tree_apply_prefix_and_none():
    tree = {"a": 1, "b": [2, 3], "m": _block()}
    fns = {"a": lambda x: x + 1, "b": lambda xs: sum(xs), "m": None}
    out = eqshard.tree_apply(fns, tree)
    assert out["a"] == 2 and out["b"] == 5 and out["m"] is tree["m"]


def test_tree_apply_walks_into_callable_modules():
    # An Equinox module of functions is a tree of functions, not one function.
    block = _block()
    fns = eqx.filter(block, eqx.is_array)
    fns = jtu.tree_map(lambda _: lambda x: x * 2, fns)
    out = eqshard.tree_apply(fns, block)
    np.testing.assert_array_equal(out.weight, 2 * np.ones((2, 3)))


def test_tree_apply_errors():
    with pytest.raises(ValueError, match=r"at 'x'.*`fns` has a list of length 1"):
        eqshard.tree_apply({"x": [None]}, {"x": 3})
    with pytest.raises(TypeError, match=r"`fns` has 3 at 'a'"):
        eqshard.tree_apply({"a": 3}, {"a": 1})
    with pytest.raises(ValueError, match=r"at 'x': `fns` has a list of length 0"):
        eqshard.tree_apply({"x": []}, {"x": [1]})


def test_names_from_partition_spec():
    mesh = jax.make_mesh(
        (2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    specs = {
        "w": P("dp", ("fsdp", "tp")),
        "n": NamedSharding(mesh, P(None, "dp")),
        "b": [P(None), None, "ep"],
    }
    assert eqshard.compat.get_names_from_partition_spec(specs) == [
        "dp",
        "ep",
        "fsdp",
        "tp",
    ]
    with pytest.raises(TypeError, match=r"at 'b/0'"):
        eqshard.compat.get_names_from_partition_spec({"b": [3]})


_leaf = st.one_of(
    st.integers(0, 9),
    st.just(None),
    st.builds(lambda n: np.zeros(n), st.integers(0, 3)),
)
_trees = st.recursive(
    _leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text("abc", min_size=1, max_size=2), children, max_size=3),
    ),
    max_leaves=12,
)


@settings(deadline=None, max_examples=60)
@given(_trees)
def test_flatten_unflatten_round_trip(tree):
    for sep in (None, "/"):
        flat = eqshard.flatten_tree(tree, sep=sep)
        leaves = jtu.tree_leaves(tree)
        assert len(flat) == len(leaves)
        assert all(a is b for a, b in zip(flat.values(), leaves))
        out = eqshard.unflatten_tree(flat, tree, sep=sep)
        assert jtu.tree_structure(out) == jtu.tree_structure(tree)
        assert all(a is b for a, b in zip(jtu.tree_leaves(out), jtu.tree_leaves(tree)))


@pytest.mark.parametrize(
    "flat, sep, expected",
    [
        ({"a/b": 1, "a/c": 2, "d": 3}, "/", {"a": {"b": 1, "c": 2}, "d": 3}),
        ({("a", "b"): 1, ("d",): 3}, None, {"a": {"b": 1}, "d": 3}),
        ({}, "/", {}),
    ],
)
def test_unflatten_tree_without_like_rebuilds_nested_dicts(flat, sep, expected):
    # flax's unflatten_dict
    assert eqshard.unflatten_tree(flat, sep=sep) == expected


@pytest.mark.parametrize(
    "flat, sep, error, match",
    [
        ({"a": 1, "a/b": 2}, "/", ValueError, r"'a' is a leaf, but 'a/b' continues"),
        ({"a/b": 1, "a": 2}, "/", ValueError, r"'a' is a leaf, but 'a/b' continues"),
        ({1: 2}, "/", TypeError, r"the name 1 \(a int\) cannot be split"),
        ({"a": 1}, None, TypeError, r"the name 'a' is not a non-empty tuple.*sep="),
        ({"ab": 1}, "", ValueError, r"names joined with sep='' cannot be split"),
    ],
)
def test_unflatten_tree_without_like_errors(flat, sep, error, match):
    with pytest.raises(error, match="^eqshard.unflatten_tree: " + match):
        eqshard.unflatten_tree(flat, sep=sep)


def _mixed():
    # Keys of several types in one dict: JAX cannot sort them to flatten it.
    return {"model": {"layers": {0: np.zeros(4), "head": np.zeros(4)}}}


@pytest.mark.parametrize(
    "name, call",
    [
        ("shard", lambda mesh: eqshard.shard(_mixed(), P(), mesh)),
        ("gather", lambda mesh: eqshard.gather(_mixed())),
        (
            "match_partition_rules",
            lambda mesh: eqshard.match_partition_rules([(".*", P())], _mixed()),
        ),
        ("flatten_tree", lambda mesh: eqshard.flatten_tree(_mixed())),
        ("plan_training", lambda mesh: eqshard.plan_training(_mixed(), P(), mesh)),
        (
            "with_sharding_constraint",
            lambda mesh: eqshard.with_sharding_constraint(_mixed(), P(), mesh=mesh),
        ),
    ],
)
def test_a_dict_with_keys_of_several_types_is_named(mesh, name, call):
    argument = "tree"  # every one of them names its argument so
    with pytest.raises(
        ValueError,
        match=rf"^eqshard.{name}: the dict at 'model/layers' in `{argument}` has "
        r"keys of several types \(int, str\)",
    ):
        call(mesh)


def test_a_spec_dict_with_keys_of_several_types_is_named(mesh):
    tree = {"w": {0: np.zeros(4), 1: np.zeros(4)}}
    specs = {"w": {0: P(), "1": P()}}
    with pytest.raises(ValueError, match=r"^eqshard.shard: the dict at 'w' in `specs`"):
        eqshard.shard(tree, specs, mesh)
    with pytest.raises(ValueError, match=r"^eqshard.shard: the dict `specs`"):
        eqshard.shard(tree, {0: P(), "w": P()}, mesh)


def test_non_string_keys_of_one_type_make_paths(mesh):
    tree = {"a": {1: np.ones(8), 2: np.zeros(8)}, "b": {(2, "x"): np.ones(4)}}
    specs = eqshard.match_partition_rules([("a/1", P("dp")), (".*", P())], tree)
    assert specs == {"a": {1: P("dp"), 2: P()}, "b": {(2, "x"): P()}}
    placed = eqshard.shard(tree, specs, mesh)
    assert placed["a"][1].sharding.spec == P("dp")
    assert set(eqshard.flatten_tree(tree, sep="/")) == {"a/1", "a/2", "b/(2, 'x')"}
    # Two keys that make the same name are the one error.
    with pytest.raises(ValueError, match="same name 'a/1'"):
        eqshard.flatten_tree({"a": {1: np.ones(2)}, "a/1": np.ones(2)}, sep="/")
