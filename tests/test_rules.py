import dataclasses
import re
from collections.abc import Callable
from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqshard
from eqshard.compat._patterns import _PatternPartitionSpec


def _is_array(x):
    # The test's own predicate (not eqshard's), as DESIGN defines arrays.
    return isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct)


def _is_spec(x):
    return isinstance(x, P)


def assert_spec_structure(specs, tree):
    """`specs` has the structure of `eqx.filter(tree, is_array)`, with a spec for
    every array."""
    expected = jax.tree.structure(eqx.filter(tree, _is_array), is_leaf=_is_spec)
    assert jax.tree.structure(specs, is_leaf=_is_spec) == expected
    leaves = jax.tree.leaves(specs, is_leaf=_is_spec)
    assert all(isinstance(leaf, P) for leaf in leaves)


@pytest.fixture(scope="session")
def mesh():
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)


class Block(eqx.Module):
    weight: jax.Array
    bias: jax.Array | None
    act: Callable
    name: str = eqx.field(static=True)


class Model(eqx.Module):
    layers: list[Block]
    head: jax.Array


def _model():
    layers = [
        Block(jnp.ones((8, 4)), None, jax.nn.relu, "l0"),
        Block(jnp.ones((8, 4)), jnp.zeros(4), jax.nn.gelu, "l1"),
    ]
    return Model(layers, jnp.ones((4, 8)))


MODEL_RULES = [
    ("layers/.*/weight", P("dp", "tp")),
    ("bias", P("tp")),
    ("head", P(None, "tp")),
]


# ---------------------------------------------------------------- match


def test_match_dict_first_match_wins():
    tree = {
        "attn": {"q": np.ones((4, 8)), "k": np.ones((4, 8))},
        "mlp": {"w": np.ones((8, 2)), "act": "relu", "n": 3},
        "none": None,
    }
    rules = [("attn/q", P("tp")), ("attn", P("dp", "tp")), (".*", P())]
    specs = eqshard.match_partition_rules(rules, tree)
    assert specs == {
        "attn": {"q": P("tp"), "k": P("dp", "tp")},
        "mlp": {"w": P(), "act": None, "n": None},
        "none": None,
    }
    assert_spec_structure(specs, tree)


def test_match_lists_tuples_and_int_keys():
    tree = {1: [np.ones((2, 2)), (np.ones(3), 5)], 2: np.ones((2, 6))}
    rules = [("^1/0$", P("dp")), ("^1/1/0$", P("tp")), ("^2$", P(None, "tp"))]
    specs = eqshard.match_partition_rules(rules, tree)
    assert specs == {1: [P("dp"), (P("tp"), None)], 2: P(None, "tp")}
    assert type(specs[1][1]) is tuple
    assert_spec_structure(specs, tree)


def test_match_equinox_module():
    model = _model()
    specs = eqshard.match_partition_rules(MODEL_RULES, model)
    assert type(specs) is Model and type(specs.layers[0]) is Block
    assert specs.layers[0].weight == P("dp", "tp")
    assert specs.layers[0].bias is None  # a None field
    assert specs.layers[1].bias == P("tp")
    assert specs.layers[1].act is None  # a callable field
    assert specs.layers[1].name == "l1"  # the static field is kept
    assert specs.head == P(None, "tp")
    assert_spec_structure(specs, model)


def test_match_abstract_tree_from_filter_eval_shape():
    abstract = eqx.filter_eval_shape(_model)
    assert isinstance(abstract.head, jax.ShapeDtypeStruct)
    specs = eqshard.match_partition_rules(MODEL_RULES, abstract)
    assert specs == eqshard.match_partition_rules(MODEL_RULES, _model())
    assert_spec_structure(specs, abstract)


def test_match_optax_state():
    params = {"w": jnp.ones((8, 4)), "b": jnp.ones(4)}
    state = optax.adam(0.1).init(params)
    rules = [("(mu|nu)/w$", P("dp", "tp")), ("(mu|nu)/b$", P("tp"))]
    specs = eqshard.match_partition_rules(rules, state)
    adam = specs[0]
    assert type(adam) is optax.ScaleByAdamState
    assert adam.count == P()  # a scalar needs no rule
    assert adam.mu == {"w": P("dp", "tp"), "b": P("tp")}
    assert adam.nu == {"w": P("dp", "tp"), "b": P("tp")}
    assert specs[1] == optax.EmptyState()
    assert_spec_structure(specs, state)


def test_scalars_and_min_size_are_replicated_without_rules():
    tree = {
        "scalar": jnp.float32(1.0),
        "np_scalar": np.float32(2.0),
        "small": np.ones(3),
        "big": np.ones((2, 2)),
    }
    rules = [("big", P("dp"))]
    specs = eqshard.match_partition_rules(rules, tree, min_size=4)
    assert specs == {"scalar": P(), "np_scalar": P(), "small": P(), "big": P("dp")}


def test_custom_sep_and_root_leaf():
    tree = {"a": {"b": np.ones(4)}}
    assert eqshard.match_partition_rules([(r"^a\.b$", P("dp"))], tree, sep=".") == {
        "a": {"b": P("dp")}
    }
    assert eqshard.match_partition_rules([("^$", P("dp"))], np.ones(4)) == P("dp")


def test_strict_reports_all_bad_leaves_together():
    tree = {
        "layers": [{"w": np.ones((4, 4)), "b": np.ones(4)} for _ in range(2)],
        "embed": np.ones((3, 5)),
    }
    rules = [("layers/.*/w", P("dp", "tp")), ("layers/.*/b", P("dp", "tp"))]
    with pytest.raises(ValueError) as info:
        eqshard.match_partition_rules(rules, tree)
    message = str(info.value)
    assert "3 array leaves" in message
    for path in ["'layers/0/b' shape (4,)", "'layers/1/b' shape (4,)"]:
        assert path in message
    assert "P('dp', 'tp') of rule 1 has 2 entries but the array has rank 1" in message
    assert "'embed' shape (3, 5): no rule matches" in message
    assert "0: 'layers/.*/w' -> P('dp', 'tp')" in message  # the rules tried
    assert "1: 'layers/.*/b' -> P('dp', 'tp')" in message
    assert "'layers/0/w'" not in message  # good leaves are not listed


def test_strict_unmatched_root_and_many_leaves():
    with pytest.raises(
        ValueError,
        match="(?s)1 array leaf has .*<root> shape \\(4,\\): no rule matches",
    ):
        eqshard.match_partition_rules([("x", P())], np.ones(4))
    tree = {f"p{i:02d}": np.ones(2) for i in range(40)}
    with pytest.raises(ValueError, match="(?s)40 array leaves.*p00.*and 10 more"):
        eqshard.match_partition_rules([], tree)


def test_non_strict_trims_and_replicates_without_warning():
    tree = {"b": np.ones(4), "w": np.ones((4, 4)), "other": np.ones((2, 2))}
    rules = [("b", P("dp", "tp")), ("w", P("dp", "tp"))]
    # filterwarnings = error: any warning would fail this test.
    specs = eqshard.match_partition_rules(rules, tree, on_invalid="ignore")
    assert specs == {"b": P("dp"), "w": P("dp", "tp"), "other": P()}


def test_invalid_regexes_are_named_together():
    rules = [("ok", P()), ("(attn", P("dp")), ("mlp[", P())]
    with pytest.raises(ValueError) as info:
        eqshard.match_partition_rules(rules, {"ok": np.ones(2)})
    message = str(info.value)
    assert "invalid regular expressions (2)" in message
    assert "rule 1 '(attn'" in message and "rule 2 'mlp['" in message


@pytest.mark.parametrize(
    "rules, match",
    [
        ([("w", ("dp",))], r"rule 0 is \('w', \('dp',\)\); every rule must be a pair"),
        ([("a", P()), ("b", P()), ("w",)], r"rule 2 is \('w',\)"),
        ([("a", P()), (3, P())], r"rule 1 is 3, which is not a regex"),
    ],
)
def test_rule_that_is_not_a_pair(rules, match):
    # eqshard's own message on every call, whichever rule is bad.
    for _ in range(5):
        with pytest.raises(TypeError, match=match):
            eqshard.match_partition_rules(rules, {"w": np.ones(2)})


def test_rules_may_be_lists():
    rules = [["a", P("dp")], ("b", P()), ["w", P("tp")]]
    for _ in range(5):
        specs = eqshard.match_partition_rules(rules, {"w": np.ones(4)})
        assert specs == {"w": P("tp")}


def test_negative_min_size():
    with pytest.raises(ValueError, match="min_size"):
        eqshard.match_partition_rules([], {"w": np.ones(2)}, min_size=-1)


def test_compiled_patterns_and_each_regex_compiled_once(monkeypatch):
    calls = []
    compile_ = re.compile

    def counting_compile(pattern, flags=0):
        calls.append(pattern)
        return compile_(pattern, flags)

    rules = [("a", P("dp")), ("b", P("tp")), ("c", P())]
    tree = {f"{c}{i}": np.ones(4) for c in "abc" for i in range(20)}
    monkeypatch.setattr(re, "compile", counting_compile)
    specs = eqshard.match_partition_rules(rules, tree)
    monkeypatch.undo()
    assert sorted(p for p in calls if p in {"a", "b", "c"}) == ["a", "b", "c"]
    assert specs["b7"] == P("tp")
    compiled = [(re.compile("a"), P("dp")), (re.compile("."), P())]
    assert eqshard.match_partition_rules(compiled, {"a": np.ones(2)}) == {"a": P("dp")}


def test_specs_shard_for_real(mesh):
    model = _model()
    specs = eqshard.match_partition_rules(MODEL_RULES, model)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    params = eqx.filter(model, _is_array)
    placed = jax.device_put(params, shardings)
    weight = placed.layers[0].weight
    assert weight.sharding == NamedSharding(mesh, P("dp", "tp"))
    assert {s.data.shape for s in weight.addressable_shards} == {(4, 1)}
    assert {s.data.shape for s in placed.head.addressable_shards} == {(4, 2)}

    out = jax.jit(lambda p: jax.tree.map(lambda x: x * 2, p), out_shardings=shardings)(
        placed
    )
    assert out.layers[1].bias.sharding == NamedSharding(mesh, P("tp"))
    np.testing.assert_array_equal(out.head, np.full((4, 8), 2.0))


# ---------------------------------------------------------------- property


_shapes = st.lists(st.integers(1, 3), max_size=3).map(tuple)
_leaves = st.one_of(
    _shapes.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32)),
    _shapes.map(np.zeros),
    st.just(None),
    st.integers(0, 3),
)
_trees = st.recursive(
    _leaves,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(["a", "b", "w", "bias"]), children, max_size=3
        )
    ),
    max_leaves=12,
)
_rule_specs = st.lists(st.sampled_from(["dp", "tp", None]), max_size=3).map(
    lambda parts: P(*parts)
)
_rules = st.lists(st.tuples(st.sampled_from(["a", "b/", "w$", "0", ""]), _rule_specs))


@settings(deadline=None, max_examples=40)
@given(tree=_trees, rules=_rules, min_size=st.integers(0, 4))
def test_property_structure_and_rank(tree, rules, min_size):
    specs = eqshard.match_partition_rules(
        rules, tree, min_size=min_size, on_invalid="ignore"
    )
    assert_spec_structure(specs, tree)
    arrays = jax.tree.leaves(eqx.filter(tree, _is_array))
    spec_leaves = jax.tree.leaves(specs, is_leaf=_is_spec)
    assert len(arrays) == len(spec_leaves)
    for array, spec in zip(arrays, spec_leaves):
        assert len(spec) <= len(array.shape)
    report = eqshard.explain_partition_rules(rules, tree, min_size=min_size)
    assert len(report.rows) == len(arrays)


# ---------------------------------------------------------------- explain


def test_explain_rows_and_dead_rules():
    tree = {
        "attn": {"w": np.ones((4, 4)), "b": np.ones(4)},
        "count": np.int32(0),
        "tiny": np.ones(2),
        "embed": np.ones((8, 2)),
    }
    rules = [("attn/w", P("dp", "tp")), ("attn/b", P("dp", "tp")), ("embedd", P())]
    report = eqshard.explain_partition_rules(rules, tree, min_size=3)
    rows = {row.path: row for row in report.rows}
    assert list(rows) == ["attn/b", "attn/w", "count", "embed", "tiny"]
    assert rows["attn/w"] == eqshard.RulesReportRow(
        path="attn/w",
        shape=(4, 4),
        reason="matched",
        rule=0,
        pattern="attn/w",
        spec=P("dp", "tp"),
        problem=None,
    )
    assert rows["attn/b"].rule == 1 and "rank 1" in (rows["attn/b"].problem or "")
    assert rows["count"].reason == "scalar" and rows["count"].spec == P()
    assert rows["tiny"].reason == "below_min_size" and rows["tiny"].spec == P()
    assert rows["embed"].reason == "unmatched" and rows["embed"].spec is None
    assert report.dead_rules == (2,)
    assert [row.path for row in report.problems] == ["attn/b", "embed"]
    assert report.rules == tuple(rules)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.dead_rules = ()  # type: ignore[misc]


def test_explain_agrees_with_match():
    model = _model()
    report = eqshard.explain_partition_rules(MODEL_RULES, model)
    specs = eqshard.match_partition_rules(MODEL_RULES, model)
    assert [row.spec for row in report.rows] == jax.tree.leaves(specs, is_leaf=_is_spec)
    assert [row.path for row in report.rows] == [
        "layers/0/weight",
        "layers/1/weight",
        "layers/1/bias",
        "head",
    ]
    assert report.problems == () and report.dead_rules == ()


def test_explain_table_is_aligned():
    tree = {"attention/weight": np.ones((4, 4)), "b": np.ones(4), "s": np.float32(1)}
    rules = [("attention", P("dp")), ("typo", P())]
    report = eqshard.explain_partition_rules(rules, tree)
    text = report.table()
    assert str(report) == text
    lines = text.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("path")))
    column = lines[header].index("shape")
    rows = lines[header + 1 : header + 4]
    assert [row[column] for row in rows] == ["(", "(", "("]
    assert [row[:column].rstrip() for row in rows] == ["attention/weight", "b", "s"]
    assert "no rule matches" in rows[1] and "scalar" in rows[2]
    dead = next(line for line in lines if "'typo'" in line)
    assert "dead" in dead
    assert "1 problems, 1 dead rules" in lines[0]


def test_explain_invalid_regex():
    with pytest.raises(ValueError, match="rule 0 '\\[bad'"):
        eqshard.explain_partition_rules([("[bad", P())], {"w": np.ones(2)})


# ---------------------------------------------------------------- pattern strings


@pytest.mark.parametrize(
    "path, expected",
    [
        ("layers/0/attention/q", P("dp", "tp")),
        ("layers/0/mlp/up", P("dp", "tp")),
        ("embed/table", P(None, "tp")),
        ("x/kernel", P(("dp", "fsdp"), None)),
        ("final_norm", P()),
        ("unmatched", P("dp")),  # the default
    ],
)
def test_pattern_based_spec(path, expected):
    fn = eqshard.compat.create_pattern_based_partition_spec(
        " attention|mlp -> dp.tp , embed->None.tp, (q|k)ernel->dp+fsdp.None,norm->()",
        default=P("dp"),
    )
    assert fn(path, None) == expected


def test_pattern_based_spec_default_and_rules_attribute():
    fn = eqshard.compat.create_pattern_based_partition_spec("attn->dp,.*->tp")
    assert isinstance(fn, _PatternPartitionSpec)  # its type, for the `rules` attribute
    assert fn.rules == (("attn", P("dp")), (".*", P("tp")))
    tree = {"attn": np.ones((2, 2)), "b": np.ones(3)}
    assert eqshard.match_partition_rules(fn.rules, tree) == {
        "attn": P("dp"),
        "b": P("tp"),
    }
    assert eqshard.named_tree_map(fn, tree, sep="/") == {"attn": P("dp"), "b": P("tp")}
    assert (
        eqshard.compat.create_pattern_based_partition_spec("a->dp")("zzz", None) == P()
    )


@pytest.mark.parametrize(
    "pattern, token",
    [
        ("mlp=>dp", "rule 0 'mlp=>dp'"),
        ("attn->dp,->tp", "rule 1 '->tp'"),
        ("mlp->", "rule 0 'mlp->'"),
        ("a->dp,(b->tp", "rule 1 '(b->tp'"),
        ("a->dp..tp", "rule 0 'a->dp..tp'"),
        ("a->dp,,b->tp", "rule 1 ''"),
        ("a->b->c", "rule 0 'a->b->c'"),
        ("a->dp-x", "rule 0 'a->dp-x'"),
        ("", "rule 0 ''"),
    ],
)
def test_pattern_based_spec_malformed(pattern, token):
    with pytest.raises(ValueError, match=re.escape(token)):
        eqshard.compat.create_pattern_based_partition_spec(pattern)


# The one spec syntax: rules files (`python -m eqshard --rules`) and rule strings
# read every spelling alike. A rules file takes spaces inside a spec after `->`.
@pytest.mark.parametrize(
    "text, expected",
    [
        ("dp,tp", P("dp", "tp")),
        ("dp.tp", P("dp", "tp")),
        ("None,tp", P(None, "tp")),
        ("None.tp", P(None, "tp")),
        ("dp", P("dp")),
        ("None", P(None)),
        ("dp+fsdp,None", P(("dp", "fsdp"), None)),
        ("tp.dp+fsdp", P("tp", ("dp", "fsdp"))),
        ("()", P()),
        ("P()", P()),
        ("P('dp',None)", P("dp", None)),
        ("P('dp', None)", P("dp", None)),
        ('P("dp", "tp")', P("dp", "tp")),
        ("P(('dp', 'fsdp'), 'tp')", P(("dp", "fsdp"), "tp")),
        ("P(dp, None)", P("dp", None)),
        ("P(dp+fsdp,tp)", P(("dp", "fsdp"), "tp")),
        (" dp , tp ", P("dp", "tp")),
        ("dp + fsdp", P(("dp", "fsdp"))),
    ],
)
def test_one_spec_syntax(text, expected):
    from eqshard._cli._rules_file import parse_rules

    pattern = eqshard.compat.create_pattern_based_partition_spec(f"x->{text},y->tp")
    assert isinstance(pattern, _PatternPartitionSpec)
    assert pattern.rules == (("x", expected), ("y", P("tp")))
    assert parse_rules(f"x -> {text}\n", "r") == [("x", expected)]
    if " " not in text.strip():
        assert parse_rules(f"x  {text}\n", "r") == [("x", expected)]


@pytest.mark.parametrize(
    "text, match",
    [
        ("(dp,tp)", "ambiguous"),
        ("P(1)", "'1' is not an axis name"),
        ("P('dp'", "not an axis name"),
        ("dp,,tp", "empty|'' in the spec"),
        ("dp-x", "'dp-x' is not an axis name"),
        ("P(('dp', 1))", "not an axis name"),
        ("P(dp, 'tp')", "not a PartitionSpec literal"),
    ],
)
def test_one_spec_syntax_refused(text, match):
    from eqshard._cli._load import UsageError
    from eqshard._cli._rules_file import parse_rules

    pattern = f"x->{text}"
    with pytest.raises(ValueError, match=re.escape(f"in {pattern!r}: ")) as info:
        eqshard.compat.create_pattern_based_partition_spec(pattern)
    assert re.search(match, str(info.value))
    with pytest.raises(UsageError, match="rules.txt, line 2: ") as info:
        parse_rules(f"# rules\nx -> {text}\n", "rules.txt")
    assert re.search(match, str(info.value))


def test_rules_file_spaced_spec_needs_an_arrow():
    from eqshard._cli._load import UsageError
    from eqshard._cli._rules_file import parse_rules

    with pytest.raises(UsageError, match="r, line 1: a spec without '->'"):
        parse_rules("attn  dp, tp\n", "r")


# ---------------------------------------------------------------- weight decay


def test_weight_decay_mask_tree():
    params = {"dense": {"w": np.ones((2, 2)), "bias": np.ones(2)}, "ln": [np.ones(2)]}
    mask = eqshard.compat.get_weight_decay_mask(["bias", re.compile("^ln/")])(params)
    assert mask == {"dense": {"w": True, "bias": False}, "ln": [False]}
    only = eqshard.compat.get_weight_decay_mask("w$")(params)  # a single regex
    assert only == {"dense": {"w": False, "bias": True}, "ln": [True]}


def test_weight_decay_mask_on_module_and_invalid_regex():
    params = eqx.filter(_model(), eqx.is_array)
    mask = eqshard.compat.get_weight_decay_mask(["bias", "head"])(params)
    assert mask.layers[1].bias is False and mask.head is False
    assert mask.layers[0].weight is True and mask.layers[0].bias is None
    with pytest.raises(ValueError, match="exclusion 1 '\\(bias'"):
        eqshard.compat.get_weight_decay_mask(["ok", "(bias"])
    with pytest.raises(TypeError, match="exclusion 2 is 3, which is not a regex"):
        eqshard.compat.get_weight_decay_mask(["ok", "bias", 3])


def test_weight_decay_mask_with_optax_adamw():
    params = {"w": jnp.ones(2), "b": jnp.ones(2)}
    mask = eqshard.compat.get_weight_decay_mask(["^b$"])
    optimizer = optax.adamw(learning_rate=0.1, weight_decay=0.5, mask=mask)
    state = optimizer.init(params)
    grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = optimizer.update(grads, state, params)
    updates = cast(dict[str, jax.Array], updates)  # optax types it as any ArrayTree
    # Zero gradients: Adam's part is 0, decay adds -lr * wd * param where masked in.
    np.testing.assert_allclose(updates["w"], np.full(2, -0.05), rtol=1e-6)
    np.testing.assert_array_equal(updates["b"], np.zeros(2))


@pytest.mark.parametrize(
    "rules, fix",
    [
        ({"w": P()}, r"list\(rules.items\(\)\)"),
        (iter([("w", P())]), r"list\(rules\)"),
    ],
)
def test_rules_must_be_a_sequence(rules, fix):
    tree = {"w": np.ones(4)}
    with pytest.raises(TypeError, match=r"^eqshard.match_partition_rules: .*" + fix):
        eqshard.match_partition_rules(rules, tree)
    with pytest.raises(TypeError, match=r"^eqshard.explain_partition_rules: .*" + fix):
        eqshard.explain_partition_rules(rules, tree)


def test_rules_checked_against_a_mesh_before_shard():
    # A 33-token vocabulary cannot be split over an axis of size 4: found here,
    # naming the leaf, rather than by shard.
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    tree = {"embed": np.ones((33, 8)), "w": np.ones((8, 8))}
    rules = [("embed", P("tp")), ("w", P("dp", "tp"))]
    assert eqshard.match_partition_rules(rules, tree) == {
        "embed": P("tp"),
        "w": P("dp", "tp"),
    }
    match = r"'embed' shape \(33, 8\): spec P\('tp',\) of rule 0 cannot apply on mesh"
    with pytest.raises(ValueError, match=match):
        eqshard.match_partition_rules(rules, tree, mesh=mesh)
    relaxed = eqshard.match_partition_rules(rules, tree, mesh=mesh, on_invalid="ignore")
    assert relaxed == {"embed": P(), "w": P("dp", "tp")}
    report = eqshard.explain_partition_rules(rules, tree, mesh=mesh.abstract_mesh)
    assert [row.path for row in report.problems] == ["embed"]
    assert "dimension 0 (size 33) is not divisible by 'tp' (size 4)" in (
        report.problems[0].problem or ""
    )
    # What shard would say, for comparison: the same leaf refused.
    with pytest.raises(ValueError, match="embed"):
        eqshard.shard(tree, eqshard.match_partition_rules(rules, tree), mesh)


def test_numpy_integer_min_size():
    tree = {"small": np.ones(4), "big": np.ones(16)}
    rules = [(".*", P("dp"))]
    specs = eqshard.match_partition_rules(rules, tree, min_size=np.int64(8))
    assert specs == {"small": P(), "big": P("dp")}
    report = eqshard.explain_partition_rules(rules, tree, min_size=np.int64(8))
    assert type(report.min_size) is int


# Trees built together: the optimizer state follows the model --------------------


class _Tied(eqx.Module):
    blocks: eqx.nn.Linear  # two layers stacked by filter_vmap
    head: eqx.nn.Linear
    cache: eqx.nn.StateIndex

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 16, key=k))(
            jax.random.split(k1, 2)
        )
        self.head = eqx.nn.Linear(16, 32, key=k2)
        self.cache = eqx.nn.StateIndex(jnp.zeros((4, 8)))


_FOLLOW_RULES = [
    ("blocks/weight", eqshard.stacked(P("tp", None))),
    ("head/weight", P(None, "tp")),
    (".*", P()),
]


def _trimmed(spec):
    """A spec's entries without trailing `None`s: `P('tp', None)` places as
    `P('tp')`."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def _by_path(tree, specs):
    """`{path: spec}` of the arrays of `tree`, written out by hand from JAX's paths."""
    out = {}
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    arrays = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(tree)]
    arrays = [(p, x) for p, x in arrays if _is_array(x)]
    for (path, _), spec in zip(arrays, flat_specs, strict=True):
        out[jax.tree_util.keystr(path, simple=True, separator="/")] = spec
    return out


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda labels: optax.adamw(1e-3),
        lambda labels: optax.adafactor(1e-3, min_dim_size_to_factor=4),
        lambda labels: optax.multi_transform(
            {"m": optax.adam(1e-3), "v": optax.sgd(1e-3, momentum=0.9)}, labels
        ),
    ],
    ids=["adamw", "adafactor", "multi_transform"],
)
def test_rules_for_the_model_place_its_optimizer_state(make_optimizer):
    model = eqx.filter_eval_shape(_Tied, jax.random.key(0))
    params = eqx.filter(model, _is_array)
    labels = jax.tree.map(lambda x: "m" if x.ndim > 1 else "v", params)
    optimizer = make_optimizer(labels)
    tree = (model, jax.eval_shape(optimizer.init, params))
    got = _by_path(tree, eqshard.match_partition_rules(_FOLLOW_RULES, tree))
    # The parameters' own specs, by the rules; a stacked rule's from the end.
    model_specs = {
        "blocks/weight": P(None, "tp", None),
        "blocks/bias": P(),
        "head/weight": P(None, "tp"),
        "head/bias": P(),
        "cache/init": P(),
    }
    shapes = {
        "blocks/weight": (2, 16, 8),
        "blocks/bias": (2, 16),
        "head/weight": (32, 16),
        "head/bias": (32,),
        "cache/init": (4, 8),
    }
    for name, spec in model_specs.items():
        assert got.pop(f"0/{name}") == spec, name
    # Every array of the state ends with a parameter's path, after optax's own keys.
    for name, spec in got.items():
        param = next((p for p in shapes if name.endswith("/" + p)), None)
        if param is None:  # optax's step counts
            assert spec == P() and name.endswith("count"), name
            continue
        leaf = {
            jax.tree_util.keystr(p, simple=True, separator="/"): x
            for p, x in jax.tree_util.tree_leaves_with_path(tree)
        }[name]
        if leaf.shape == shapes[param]:
            expected = model_specs[param]  # mu, nu, trace: the same spec
        elif len(leaf.shape) == len(shapes[param]) - 1:
            # Adafactor's factored moments: the parameter's spec without the
            # dimension optax reduced (v_row the largest, v_col the next).
            order = np.argsort(shapes[param], kind="stable")
            dim = order[-1] if "/v_row/" in name else order[-2]
            entries = list(model_specs[param]) + [None] * 3
            expected = P(
                *(e for d, e in enumerate(entries[: leaf.ndim + 1]) if d != dim)
            )
        else:
            expected = P()  # Adafactor's (1,) placeholders, step counts
        assert _trimmed(spec) == _trimmed(expected), (name, spec, expected)


def test_following_reports_what_it_follows_and_is_only_between_items():
    tree = {
        "params": {"w": np.zeros((8, 8))},
        "copy": {"params": {"w": np.zeros((8, 8))}},
    }
    rules = [("params/w", P("tp")), ("w", P("dp"))]
    # A dict is one tree: its arrays are matched by the rules, none follows.
    specs = eqshard.match_partition_rules(rules, tree)
    assert specs["copy"]["params"]["w"] == P("tp") and specs["params"]["w"] == P("tp")
    pair = ({"w": np.zeros((8, 8))}, {"mu": {"w": np.zeros((8, 8))}})
    specs = eqshard.match_partition_rules([("^0/w", P("tp")), ("w", P("dp"))], pair)
    assert specs == ({"w": P("tp")}, {"mu": {"w": P("tp")}})
    report = eqshard.explain_partition_rules([("^0/w", P("tp")), ("w", P("dp"))], pair)
    row = report.rows[1]
    assert (row.path, row.reason, row.spec, row.rule) == (
        "1/mu/w",
        "follows",
        P("tp"),
        None,
    )
    assert row.note == "follows '0/w'"
    assert report.dead_rules == (1,)


def test_stacked_rule_values_read_the_spec_from_the_end():
    rules = [("w$", eqshard.stacked(P("tp", None))), ("b$", eqshard.stacked(P()))]
    tree = {
        "one": {"w": np.zeros((8, 4)), "b": np.zeros(8)},
        "once": {"w": np.zeros((3, 8, 4)), "b": np.zeros((3, 8))},
        "twice": {"w": np.zeros((2, 3, 8, 4)), "b": np.zeros((2, 3, 8))},
    }
    specs = eqshard.match_partition_rules(rules, tree, exact_rank=True)
    assert specs["one"] == {"w": P("tp", None), "b": P()}
    assert specs["once"] == {"w": P(None, "tp", None), "b": P()}
    assert specs["twice"] == {"w": P(None, None, "tp", None), "b": P()}
    report = eqshard.explain_partition_rules(rules, tree)
    assert report.rows[5].note == "stacked: 2 layer axes in front"
    # A spec shorter than the rank keeps JAX's meaning: the leading dimensions.
    batch = {"x": np.zeros((16, 4))}
    assert eqshard.match_partition_rules([("x", P("dp"))], batch) == {"x": P("dp")}
    with pytest.raises(
        ValueError, match=r"'x' shape \(16, 4\): spec.*exact_rank.*stacked"
    ):
        eqshard.match_partition_rules([("x", P("dp"))], batch, exact_rank=True)
    with pytest.raises(ValueError, match=r"'one/w' shape \(8, 4\): spec P\(None, 'tp'"):
        eqshard.match_partition_rules(
            [(".*", eqshard.stacked(P(None, "tp", None)))], tree
        )
    with pytest.raises(
        TypeError, match=r"eqshard.stacked: .*auto_fsdp\(\.\.\., stacked=n\)"
    ):
        eqshard.stacked(eqshard.auto_fsdp("dp"))


def test_cli_hints_a_last_rule_only_when_no_rule_matches():
    # The command decides by the error's type, never by its text.
    from eqshard._cli._fit import _match
    from eqshard._cli._load import UsageError

    tree = {"a": np.zeros((3,)), "b": np.zeros((4,))}
    with pytest.raises(UsageError, match="a last rule"):
        _match([("a", P())], tree, "rules.txt")
    with pytest.raises(UsageError) as error:  # another mistake: a bad pattern
        _match([("(", P())], tree, "rules.txt")
    assert "a last rule" not in str(error.value)
