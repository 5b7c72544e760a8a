"""Tests for eqshard._spectree._resolve: every `specs=` takes a spec tree or prefix,
partition rules, or a function of the abstract tree, told apart by one test."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqshard
from eqshard._spectree._resolve import is_partition_rules


RULES = [("w", P("dp", "tp")), ("b", P("tp"))]
SPECS = {"b": P("tp"), "n": None, "w": P("dp", "tp")}


def _tree():
    return {"w": np.ones((8, 8), np.float32), "b": np.arange(8.0), "n": 3}


def _by_function(abstract):
    # Called once, with every array a `jax.ShapeDtypeStruct`.
    assert isinstance(abstract["w"], jax.ShapeDtypeStruct)
    assert abstract["n"] == 3
    return SPECS


FORMS = {"tree": SPECS, "rules": RULES, "function": _by_function}


@pytest.mark.parametrize(
    "value, expected",
    [
        (RULES, True),
        (tuple(RULES), True),
        ([["w", P()]], True),
        ([(re.compile("w"), P())], True),
        ([], False),  # the spec prefix of an empty list
        ([P("dp"), P("tp")], False),
        ([None, ("w", P())], False),
        # Logical names are a tuple subclass, so two of them looked like rules.
        ([eqshard.AxisNames("batch", "embed")], False),
        ((eqshard.AxisNames("batch", None), P()), False),
        ({"w": P()}, False),
    ],
)
def test_one_test_tells_rules_from_a_list_shaped_prefix(value, expected):
    assert is_partition_rules(value) is expected


def test_every_function_of_the_family_takes_each_form(mesh):
    tree = _tree()
    expected = eqshard.named_shardings(SPECS, mesh)
    for form, specs in FORMS.items():
        placed = eqshard.shard(tree, specs, mesh)
        assert placed["w"].sharding == expected["w"], form
        assert placed["b"].sharding == expected["b"] and placed["n"] == 3
        eqshard.check_layout(placed, specs, mesh)
        target = eqshard.abstract(tree, specs, mesh)
        assert target["w"].sharding == expected["w"]
        assert eqshard.named_shardings(specs, mesh, like=tree) == expected
        report = eqshard.analyze_sharding_strategy(tree, specs, mesh)
        assert [row.spec for row in report.rows] == [P("tp"), P("dp", "tp")]
        plan = eqshard.plan_training(tree, specs, mesh, optimizer=optax.sgd(0.1))
        assert plan.params.bytes_per_device == report.bytes_per_device
        restricted = eqshard.restrict_specs(specs, mesh, like=tree)
        assert restricted == SPECS
        state = optax.adam(1e-3).init({"w": tree["w"], "b": tree["b"]})
        derived = eqshard.derive_specs(state, tree, specs)
        assert derived[0].mu == {"b": P("tp"), "w": P("dp", "tp")}
        constrained = eqshard.with_sharding_constraint(placed, specs, mesh=mesh)
        assert constrained["w"].sharding == expected["w"]
        moved = eqshard.t5x.Partitioner(mesh=mesh).move_to_devices(tree, specs)
        assert moved["w"].sharding == expected["w"]


def test_init_and_shard_map_take_each_form(mesh):
    def make(key):
        return {"w": jax.random.normal(key, (8, 8)), "b": jnp.zeros(8), "n": 3}

    def local(tree):
        return jax.lax.psum(tree["w"].sum(), ("dp", "tp"))

    key = jax.random.key(0)
    eager = jax.device_get(make(key)["w"])
    for form, specs in FORMS.items():
        tree = eqshard.init_sharded(make, key, specs=specs, mesh=mesh)
        assert tree["w"].sharding == NamedSharding(mesh, P("dp", "tp")), form
        mapped = eqshard.filter_shard_map(
            local, in_specs=(specs,), out_specs=P(), mesh=mesh
        )
        np.testing.assert_allclose(mapped(tree), eager.sum(), rtol=1e-5)


def test_a_list_of_logical_names_is_a_prefix_not_rules(mesh):
    # Logical names are a tuple subclass: a list of two-name ones looked like
    # rules to `shard_map`, which matched them and failed on the second name.
    x = eqshard.shard(jnp.arange(16.0).reshape(8, 2), P("dp"), mesh)
    names = eqshard.AxisNames("batch", None)
    with eqshard.logical_axis_rules([("batch", "dp")]):
        mapped = eqshard.filter_shard_map(
            lambda x: x * 2, in_specs=(names,), out_specs=names, mesh=mesh
        )
        np.testing.assert_array_equal(mapped(x), 2 * np.asarray(x))


def test_rules_at_a_node_of_a_prefix_apply_to_the_subtree_there(mesh):
    tree = {"model": _tree(), "step": np.int32(0)}
    specs = eqshard.abstract(tree, {"model": RULES, "step": P()}, mesh)
    assert specs["model"]["w"].sharding.spec == P("dp", "tp")
    with pytest.raises(ValueError, match=r"rules `specs` at 'model'.*\n.*'b'"):
        eqshard.shard(tree, {"model": RULES[:1], "step": P()}, mesh)


def test_rule_values_of_logical_names_use_the_axis_rules_given(mesh):
    tree = {"w": jnp.ones((8, 8))}
    rules = [("w", eqshard.AxisNames("batch", "mlp"))]
    out = eqshard.with_sharding_constraint(
        tree, rules, mesh=mesh, axis_rules=[("batch", "dp"), ("mlp", "tp")]
    )
    assert out["w"].sharding == NamedSharding(mesh, P("dp", "tp"))


@pytest.mark.parametrize(
    "call, error, match",
    [
        # Rules match every array, or the error names the argument and the path.
        (
            lambda m: eqshard.shard(_tree(), RULES[:1], m),
            ValueError,
            r"^eqshard\.shard: 1 array leaf has no valid spec by the partition rules "
            r"`specs`:\n  'b' shape \(8,\): no rule matches",
        ),
        (
            lambda m: eqshard.check_layout(_tree(), [("w", "dp")], m),
            TypeError,
            r"^eqshard\.check_layout: rule 0 of the partition rules `specs` is",
        ),
        (
            lambda m: eqshard.named_shardings(RULES, m),
            TypeError,
            r"^eqshard\.named_shardings: `specs` is partition rules, which needs the "
            r"tree it is for.*`like=`",
        ),
        (
            lambda m: eqshard.restrict_specs(_by_function, m),
            TypeError,
            r"^eqshard\.restrict_specs: `specs` is a function, which needs the tree",
        ),
        (
            lambda m: eqshard.abstract(_tree(), lambda t: RULES, m),
            TypeError,
            r"^eqshard\.abstract: the function <lambda> given as `specs` returned "
            r"partition rules",
        ),
        (
            lambda m: eqshard.abstract(_tree(), lambda t: {"w": "dp"}, m),
            ValueError,
            r"^eqshard\.abstract: .*'w'",
        ),
        (
            lambda m: eqshard.shard(
                _tree(), {**SPECS, "w": eqshard.auto_fsdp("dp")}, m
            ),
            TypeError,
            r"^eqshard\.shard: `specs` at 'w' is auto_fsdp\('dp'.*a rule's value.*"
            r"\[\('\.\*', auto_fsdp",
        ),
        (
            lambda m: eqshard.derive_specs(_tree(), _tree(), RULES[1:]),
            ValueError,
            r"^eqshard\.derive_specs: .*rules `param_specs`:\n  'w'",
        ),
        (
            lambda m: eqshard.t5x.Partitioner(mesh=m).partition(
                lambda x: x, RULES, None
            ),
            TypeError,
            r"^eqshard\.t5x\.Partitioner\.partition: `in_specs` is partition rules",
        ),
    ],
)
def test_errors_name_the_argument_and_the_path(mesh, call, error, match):
    with pytest.raises(error, match=match):
        call(mesh)
