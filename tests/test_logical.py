import copy
import pickle
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from probes import RUN_TIMEOUT

import eqshard
from eqshard import AxisNames


@pytest.fixture(autouse=True)
def no_rules_leak():
    # Every test starts and ends with no rules set in the main thread.
    assert eqshard.get_logical_axis_rules() == ()
    yield
    leaked = eqshard.get_logical_axis_rules()
    eqshard.set_logical_axis_rules(())
    assert leaked == ()


# ---------------------------------------------------------------------------
# AxisNames


def test_axis_names_is_one_leaf():
    names = AxisNames("embed", None)
    tree = {"w": names, "b": AxisNames("mlp"), "s": AxisNames()}
    leaves = jax.tree.leaves(tree)
    assert leaves == [AxisNames("mlp"), AxisNames(), names]
    assert all(type(leaf) is AxisNames for leaf in leaves)
    assert jax.tree.structure(tree) == jax.tree.structure({"w": 0, "b": 0, "s": 0})
    # A plain tuple, by contrast, is a node.
    assert jax.tree.leaves({"w": ("embed", "mlp")}) == ["embed", "mlp"]


def test_axis_names_is_a_tuple():
    names = AxisNames("embed", None)
    assert names == ("embed", None)
    assert hash(names) == hash(("embed", None))
    assert len(names) == 2 and names[0] == "embed" and names[1] is None
    assert repr(names) == "AxisNames('embed', None)"
    assert repr(AxisNames()) == "AxisNames()"


@pytest.mark.parametrize("names", [(), ("embed",), ("batch", None, "embed")])
def test_axis_names_copy_and_pickle(names):
    original = AxisNames(*names)
    for copied in (
        copy.copy(original),
        copy.deepcopy(original),
        pickle.loads(pickle.dumps(original)),
    ):
        assert type(copied) is AxisNames
        assert tuple(copied) == names


@pytest.mark.parametrize(
    "names, match",
    [
        (("embed", 3), r"3 \(a int\) at position 1"),
        ((("embed", "mlp"),), r"AxisNames\('embed', 'mlp'\)"),
        ((P("x"),), "at position 0"),
    ],
)
def test_axis_names_rejects_bad_entries(names, match):
    with pytest.raises(TypeError, match=match):
        AxisNames(*names)


# ---------------------------------------------------------------------------
# standard_logical_axis_rules: t5x's four tables, written out by hand.

_REPLICATED = (
    ("relpos_buckets", None),
    ("abspos_buckets", None),
    ("length", None),
    ("layers", None),
    ("stack", None),
    ("mlp_activations", None),
)

_TABLES = {
    (1, 1): (
        ("batch", "data"),
        ("vocab", "model"),
        ("embed", None),
        ("mlp", "model"),
        ("heads", "model"),
        ("kv", None),
        ("joined_kv", "model"),
    ),
    (2, 1): (
        ("batch", "data"),
        ("vocab", "model"),
        ("mlp", "model"),
        ("heads", "model"),
        ("kv", None),
        ("joined_kv", "model"),
        ("embed", "model"),
    ),
    (1, 2): (
        ("batch", "data"),
        ("vocab", "model"),
        ("mlp", "model"),
        ("heads", "model"),
        ("kv", None),
        ("joined_kv", "model"),
        ("embed", "data"),
    ),
    (2, 2): (
        ("batch", "data"),
        ("vocab", "model"),
        ("mlp", "model"),
        ("heads", "model"),
        ("kv", None),
        ("joined_kv", "model"),
        ("embed", "model"),
        ("embed", "data"),
    ),
}


@pytest.mark.parametrize("dims", sorted(_TABLES))
def test_standard_rules_tables(dims):
    rules = eqshard.t5x.standard_logical_axis_rules(*dims)
    assert rules == _TABLES[dims] + _REPLICATED


def test_standard_rules_default_is_1_1():
    assert eqshard.t5x.standard_logical_axis_rules() == _TABLES[1, 1] + _REPLICATED


def test_standard_rules_additional_rules_are_appended():
    extra = [("expert", "data"), ("stage", ["pipe", "data"])]
    rules = eqshard.t5x.standard_logical_axis_rules(1, 2, additional_rules=extra)
    assert rules == (
        _TABLES[1, 2] + _REPLICATED + (("expert", "data"), ("stage", ("pipe", "data")))
    )
    assert eqshard.t5x.standard_logical_axis_rules(additional_rules=()) == (
        _TABLES[1, 1] + _REPLICATED
    )


# What each table does to the usual parameter and activation layouts.
@pytest.mark.parametrize(
    "dims, axes, expected",
    [
        ((1, 1), ("embed", "mlp"), P(None, "model")),
        ((1, 1), ("batch", "length", "embed"), P("data", None, None)),
        ((1, 1), ("vocab", "embed"), P("model", None)),
        ((2, 1), ("embed", "mlp"), P(None, "model")),  # 'model' taken by 'mlp'
        ((2, 1), ("batch", "length", "embed"), P("data", None, "model")),
        ((1, 2), ("embed", "mlp"), P("data", "model")),
        ((1, 2), ("batch", "embed"), P("data", None)),  # 'data' taken by 'batch'
        ((2, 2), ("embed", "mlp"), P("data", "model")),  # falls back to 'data'
        ((2, 2), ("batch", "length", "embed"), P("data", None, "model")),
        ((2, 2), ("embed", "heads", "kv"), P("data", "model", None)),
        ((2, 2), ("layers", "embed"), P(None, "model")),
        ((1, 1), ("batch", "mlp_activations", "mlp"), P("data", None, "model")),
    ],
)
def test_standard_rules_resolve(dims, axes, expected):
    rules = eqshard.t5x.standard_logical_axis_rules(*dims)
    assert eqshard.logical_to_mesh_axes(AxisNames(*axes), rules) == expected


def test_standard_rules_additional_rule_cannot_override_the_table():
    # Rules are tried in order: t5x appends, so the table's ('embed', None) wins.
    extra = [("embed", "data")]
    appended = eqshard.t5x.standard_logical_axis_rules(additional_rules=extra)
    assert eqshard.logical_to_mesh_axes(("embed",), appended) == P(None)
    first = tuple(extra) + eqshard.t5x.standard_logical_axis_rules()
    assert eqshard.logical_to_mesh_axes(("embed",), first) == P("data")
    with pytest.raises(ValueError, match="'embed': 'data' in `first` vs None"):
        eqshard.composite_axis_rules(extra, eqshard.t5x.standard_logical_axis_rules())


@pytest.mark.parametrize(
    "dims, named, not_named",
    [
        ((3, 1), "activation_partitioning_dims=3", "parameter_partitioning_dims"),
        ((1, 0), "parameter_partitioning_dims=0", "activation_partitioning_dims="),
        (
            (0, 5),
            "activation_partitioning_dims=0 and parameter_partitioning_dims=5",
            None,
        ),
    ],
)
def test_standard_rules_bad_dims(dims, named, not_named):
    with pytest.raises(ValueError, match=named) as info:
        eqshard.t5x.standard_logical_axis_rules(*dims)
    assert "1" in str(info.value) and "2" in str(info.value)
    if not_named is not None:
        assert not_named + "=" not in str(info.value)


def test_standard_rules_bad_additional_rule():
    with pytest.raises(TypeError, match=r"additional_rules\[1\]` = \('x', 3\)"):
        eqshard.t5x.standard_logical_axis_rules(additional_rules=[("a", "b"), ("x", 3)])


# ---------------------------------------------------------------------------
# logical_to_mesh_axes: flax's semantics.


@pytest.mark.parametrize(
    "axes, rules, expected",
    [
        # Tuple mesh axes.
        (
            ("batch", "embed"),
            [("batch", ("replica", "data"))],
            P(("replica", "data"), None),
        ),
        # A list of mesh axes means the same as a tuple.
        (("batch",), [("batch", ["replica", "data"])], P(("replica", "data"))),
        # Exhausted: 'data' is taken by 'batch', so 'embed' stays unsharded...
        (("batch", "embed"), [("batch", "data"), ("embed", "data")], P("data", None)),
        # ...also when only one axis of a tuple is taken.
        (
            ("batch", "embed"),
            [("batch", ("replica", "data")), ("embed", "data")],
            P(("replica", "data"), None),
        ),
        (
            ("embed", "batch"),
            [("embed", "data"), ("batch", ("replica", "data"))],
            P("data", None),
        ),
        # Priority follows the rules, not the dimensions.
        (("a", "b"), [("b", "x"), ("a", "x")], P(None, "x")),
        (("a", "b"), [("a", "x"), ("b", "x")], P("x", None)),
        # A fallback chain: the first rule whose mesh axes are free.
        (
            ("mlp", "embed"),
            [("mlp", "model"), ("embed", "model"), ("embed", "data")],
            P("model", "data"),
        ),
        (("embed",), [("embed", "model"), ("embed", "data")], P("model")),
        # A rule to None settles the dimension: later rules for it never apply.
        (("embed",), [("embed", None), ("embed", "data")], P(None)),
        # Unknown names and None entries are unsharded.
        (("batch", "unknown"), [("batch", "data")], P("data", None)),
        ((None, "batch", None), [("batch", "data")], P(None, "data", None)),
        # No rules at all.
        (("batch", "embed"), [], P(None, None)),
        # Scalars.
        ((), [("batch", "data")], P()),
        # Rules for names that are absent change nothing.
        (("mlp",), [("heads", "model"), ("mlp", "model")], P("model")),
    ],
)
def test_logical_to_mesh_axes(axes, rules, expected):
    assert eqshard.logical_to_mesh_axes(AxisNames(*axes), rules) == expected
    # Any sequence works as well as AxisNames.
    assert eqshard.logical_to_mesh_axes(list(axes), tuple(rules)) == expected


def test_logical_to_mesh_axes_never_uses_a_mesh_axis_twice():
    rules = [("a", "x"), ("b", ("x", "y")), ("c", "y"), ("d", ("y", "z")), ("e", "z")]
    spec = eqshard.logical_to_mesh_axes(("a", "b", "c", "d", "e"), rules)
    assert spec == P("x", None, "y", None, "z")


def test_logical_to_mesh_axes_rejects_repeated_names():
    with pytest.raises(ValueError, match=r"'embed' appears more than once.*\[0, 2\]"):
        eqshard.logical_to_mesh_axes(("embed", "mlp", "embed"), [("embed", "x")])


def test_logical_to_mesh_axes_allows_repeated_none():
    assert eqshard.logical_to_mesh_axes((None, None), [("a", "x")]) == P(None, None)


@pytest.mark.parametrize(
    "axes, match",
    [
        ("batch", r"got 'batch' \(a str\).*\('batch',\)"),
        (("batch", 0), r"0 \(a int\) at position 1"),
        ([("a", "b")], r"\('a', 'b'\) \(a tuple\) at position 0"),
    ],
)
def test_logical_to_mesh_axes_bad_axes(axes, match):
    with pytest.raises(TypeError, match=match):
        eqshard.logical_to_mesh_axes(axes, [])


# ---------------------------------------------------------------------------
# Rule validation.


@pytest.mark.parametrize(
    "rules, error, match",
    [
        ("batch", TypeError, r"`axis_rules` must be a sequence"),
        ([("batch",)], TypeError, r"`axis_rules\[0\]` = \('batch',\) is not a .* pair"),
        ([("a", "x"), "ab"], TypeError, r"`axis_rules\[1\]` = 'ab' is not a"),
        ([("a", "x", "y")], TypeError, r"`axis_rules\[0\]`.* is not a"),
        ([(None, "x")], TypeError, r"`axis_rules\[0\]`.* logical name None"),
        ([("a", 3)], TypeError, r"`axis_rules\[0\]` = \('a', 3\) maps to a int"),
        ([("a", ("x", 3))], TypeError, r"mesh axis 3 \(a int\)"),
        (
            [("a", "x"), ("b", ())],
            ValueError,
            r"`axis_rules\[1\]`.* no mesh axes .*use None",
        ),
        ([("a", ("x", "x"))], ValueError, r"`axis_rules\[0\]`.* repeats a mesh axis"),
    ],
)
def test_bad_rules(rules, error, match):
    with pytest.raises(error, match=match):
        eqshard.logical_to_mesh_axes(("a",), rules)
    with pytest.raises(error, match="eqshard.logical_axis_rules: .*" + match):
        eqshard.logical_axis_rules(rules)
    with pytest.raises(error, match=match):
        eqshard.set_logical_axis_rules(rules)
    assert eqshard.get_logical_axis_rules() == ()


@pytest.mark.parametrize(
    "rules, fix",
    [
        ({"batch": "data"}, r"list\(rules.items\(\)\)"),
        (iter([("batch", "data")]), r"list\(rules\)"),
    ],
)
def test_rules_must_be_a_sequence(rules, fix):
    # eqshard's own error (what and how to fix), not the type checker's.
    with pytest.raises(
        TypeError, match=r"^eqshard.logical_axis_rules: `axis_rules` must.*"
    ):
        eqshard.logical_axis_rules(rules)
    for call in (
        lambda: eqshard.logical_to_mesh_axes(("batch",), rules),
        lambda: eqshard.logical_to_mesh_specs({"a": AxisNames("batch")}, rules),
        lambda: eqshard.composite_axis_rules(rules, None),
        lambda: eqshard.t5x.standard_logical_axis_rules(additional_rules=rules),
    ):
        with pytest.raises(TypeError, match=r"^eqshard\.[\w.]+: .*" + fix):
            call()


def test_logical_to_mesh_axes_of_none_is_none():
    # flax: no logical axes known, nothing to shard.
    assert eqshard.logical_to_mesh_axes(None, [("batch", "data")]) is None


# ---------------------------------------------------------------------------
# The rules context.


def test_context_sets_and_restores():
    rules = [("batch", "data"), ("mlp", ["model", "expert"])]
    with eqshard.logical_axis_rules(rules) as active:
        assert active == (("batch", "data"), ("mlp", ("model", "expert")))
        assert eqshard.get_logical_axis_rules() == active
        spec = eqshard.logical_to_mesh_axes(("batch", "mlp"))
        assert spec == P("data", ("model", "expert"))
    assert eqshard.get_logical_axis_rules() == ()
    assert eqshard.logical_to_mesh_axes(("batch", "mlp")) == P(None, None)


def test_explicit_rules_win_over_the_context():
    with eqshard.logical_axis_rules([("batch", "data")]):
        assert eqshard.logical_to_mesh_axes(("batch",), [("batch", "x")]) == P("x")
        assert eqshard.logical_to_mesh_axes(("batch",), []) == P(None)
        tree = {"a": AxisNames("batch")}
        assert eqshard.logical_to_mesh_specs(tree, [("batch", "x")]) == {"a": P("x")}


def test_context_nests():
    outer, inner = [("a", "x")], [("a", "y")]
    with eqshard.logical_axis_rules(outer):
        with eqshard.logical_axis_rules(inner):
            assert eqshard.logical_to_mesh_axes(("a",)) == P("y")
            with eqshard.logical_axis_rules([]):
                assert eqshard.logical_to_mesh_axes(("a",)) == P(None)
            assert eqshard.logical_to_mesh_axes(("a",)) == P("y")
        assert eqshard.logical_to_mesh_axes(("a",)) == P("x")
    assert eqshard.get_logical_axis_rules() == ()


def test_context_restores_on_exception():
    with eqshard.logical_axis_rules([("a", "x")]):
        with pytest.raises(RuntimeError, match="boom"):
            with eqshard.logical_axis_rules([("a", "y")]):
                raise RuntimeError("boom")
        assert eqshard.get_logical_axis_rules() == (("a", "x"),)
    assert eqshard.get_logical_axis_rules() == ()


def test_context_object_can_be_reentered():
    ctx = eqshard.logical_axis_rules([("a", "x")])
    with ctx:
        with eqshard.logical_axis_rules([("a", "y")]):
            with ctx:
                assert eqshard.get_logical_axis_rules() == (("a", "x"),)
            assert eqshard.get_logical_axis_rules() == (("a", "y"),)
        assert eqshard.get_logical_axis_rules() == (("a", "x"),)
    with ctx:
        assert eqshard.get_logical_axis_rules() == (("a", "x"),)
    assert eqshard.get_logical_axis_rules() == ()


def test_set_and_get():
    eqshard.set_logical_axis_rules([("a", "x")])
    assert eqshard.get_logical_axis_rules() == (("a", "x"),)
    with eqshard.logical_axis_rules([("a", "y")]):
        eqshard.set_logical_axis_rules([("a", "z")])
        assert eqshard.logical_to_mesh_axes(("a",)) == P("z")
    # Leaving the block restores what was there before it.
    assert eqshard.get_logical_axis_rules() == (("a", "x"),)
    eqshard.set_logical_axis_rules(())
    assert eqshard.get_logical_axis_rules() == ()


def test_threads_see_their_own_rules():
    # Two threads hold different rules at the same time (the barrier makes both be
    # inside their blocks before either reads), while the main thread holds a third.
    barrier = threading.Barrier(2)
    seen = {}

    def work(name, axis):
        with eqshard.logical_axis_rules([("a", axis)]):
            barrier.wait(timeout=RUN_TIMEOUT)
            seen[name] = eqshard.logical_to_mesh_axes(("a",))
            barrier.wait(timeout=RUN_TIMEOUT)
        seen[name + "_after"] = eqshard.get_logical_axis_rules()

    with eqshard.logical_axis_rules([("a", "main")]):
        threads = [
            threading.Thread(target=work, args=("t1", "x")),
            threading.Thread(target=work, args=("t2", "y")),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert eqshard.logical_to_mesh_axes(("a",)) == P("main")
    assert seen == {"t1": P("x"), "t2": P("y"), "t1_after": (), "t2_after": ()}


def test_new_thread_starts_without_rules():
    seen = []
    with eqshard.logical_axis_rules([("a", "x")]):
        thread = threading.Thread(
            target=lambda: seen.append(eqshard.get_logical_axis_rules())
        )
        thread.start()
        thread.join(timeout=30)
    assert seen == [()]


# ---------------------------------------------------------------------------
# composite_axis_rules


def test_composite_rules_merges_in_order():
    first = [("batch", "data"), ("mlp", "model")]
    second = [("heads", "model"), ("batch", "data"), ("kv", None)]
    assert eqshard.composite_axis_rules(first, second) == (
        ("batch", "data"),
        ("mlp", "model"),
        ("heads", "model"),
        ("kv", None),
    )


@pytest.mark.parametrize(
    "first, second, expected",
    [
        (None, None, ()),
        ((), [], ()),
        ([("a", "x")], None, (("a", "x"),)),
        (None, [("a", ["x", "y"])], (("a", ("x", "y")),)),
        ([("a", ["x", "y"])], [("a", ("x", "y"))], (("a", ("x", "y")),)),
    ],
)
def test_composite_rules_empty_and_equal(first, second, expected):
    assert eqshard.composite_axis_rules(first, second) == expected


def test_composite_rules_keeps_fallback_chains():
    table = eqshard.t5x.standard_logical_axis_rules(2, 2)
    assert eqshard.composite_axis_rules(table, table) == table
    merged = eqshard.composite_axis_rules([("batch", "data")], table)
    assert merged == table  # 'batch' agrees; the rest follows in table order
    assert [axes for name, axes in merged if name == "embed"] == ["model", "data"]


def test_composite_rules_first_has_priority():
    merged = eqshard.composite_axis_rules([("heads", "model")], [("mlp", "model")])
    assert eqshard.logical_to_mesh_axes(("mlp", "heads"), merged) == P(None, "model")


@pytest.mark.parametrize(
    "first, second, match",
    [
        ([("mlp", "model")], [("mlp", "data")], r"'mlp': 'model' in `first` vs 'data'"),
        ([("mlp", "model")], [("mlp", None)], r"'mlp': 'model' in `first` vs None"),
        (
            [("embed", "model"), ("embed", "data")],
            [("embed", "model")],
            r"'embed': \['model', 'data'\] in `first` vs 'model' in `second`",
        ),
        ([("a", ("x", "y"))], [("a", ("y", "x"))], r"'a': \('x', 'y'\)"),
    ],
)
def test_composite_rules_conflicts(first, second, match):
    with pytest.raises(ValueError, match=match):
        eqshard.composite_axis_rules(first, second)


def test_composite_rules_bad_rule_names_the_argument():
    with pytest.raises(TypeError, match=r"`second\[0\]` = \('a', 1\)"):
        eqshard.composite_axis_rules([("a", "x")], [("a", 1)])


# ---------------------------------------------------------------------------
# logical_to_mesh_specs


def test_specs_dict_tree_with_none_and_specs():
    tree = {
        "embedding": AxisNames("vocab", "embed"),
        "layers": [
            {"w": AxisNames("embed", "mlp"), "b": AxisNames("mlp")},
            {"w": AxisNames("mlp", "embed"), "b": None},
        ],
        "step": None,
        "fixed": P("data"),
        "scale": AxisNames(),
    }
    rules = eqshard.t5x.standard_logical_axis_rules(1, 2)
    specs = eqshard.logical_to_mesh_specs(tree, rules)
    assert specs == {
        "embedding": P("model", "data"),
        "layers": [
            {"w": P("data", "model"), "b": P("model")},
            {"w": P("model", "data"), "b": None},
        ],
        "step": None,
        "fixed": P("data"),
        "scale": P(),
    }
    assert tree["fixed"] is specs["fixed"]


class _Linear(eqx.Module):
    weight: object
    bias: object
    features: int = eqx.field(static=True)


class _Model(eqx.Module):
    embed: object
    layers: list
    temperature: object


def _model():
    key = jax.random.key(0)
    return _Model(
        embed=jax.random.normal(key, (8, 4)),
        layers=[
            _Linear(jnp.zeros((4, 16)), jnp.zeros(16), 16),
            _Linear(jnp.zeros((16, 4)), None, 4),
        ],
        temperature=jnp.ones(()),
    )


def _model_axes(model, up=("embed", "mlp"), down=("mlp", "embed")):
    return eqx.tree_at(
        lambda m: (
            m.embed,
            m.layers[0].weight,
            m.layers[0].bias,
            m.layers[1].weight,
            m.temperature,
        ),
        model,
        (
            AxisNames("vocab", "embed"),
            AxisNames(*up),
            AxisNames("mlp"),
            AxisNames(*down),
            AxisNames(),
        ),
    )


def test_specs_equinox_module():
    model = _model()
    with eqshard.logical_axis_rules(eqshard.t5x.standard_logical_axis_rules(2, 2)):
        specs = eqshard.logical_to_mesh_specs(_model_axes(model))
    assert type(specs) is _Model and type(specs.layers[0]) is _Linear
    assert specs.embed == P("model", "data")
    assert specs.layers[0].weight == P("data", "model")
    assert specs.layers[0].bias == P("model")
    assert specs.layers[0].features == 16  # static fields are untouched
    assert specs.layers[1].weight == P("model", "data")
    assert specs.layers[1].bias is None
    assert specs.temperature == P()
    # The spec tree has the structure of the model's arrays.
    arrays = eqx.filter(model, eqx.is_array)
    assert jax.tree.structure(specs) == jax.tree.structure(
        jax.tree.map(lambda _: P(), arrays)
    )


def test_specs_place_arrays():
    # The specs drive a real placement on a 2 x 4 ('data', 'model') mesh.
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    axes = {"w": AxisNames("embed", "mlp"), "x": AxisNames("batch", "length", "embed")}
    specs = eqshard.logical_to_mesh_specs(
        axes, eqshard.t5x.standard_logical_axis_rules(2, 2)
    )
    arrays = {"w": np.zeros((8, 16), np.float32), "x": np.zeros((4, 3, 8), np.float32)}
    placed = jax.device_put(
        arrays, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    )
    assert placed["w"].addressable_shards[0].data.shape == (4, 4)
    assert placed["x"].addressable_shards[0].data.shape == (2, 3, 2)


def test_specs_plain_tuple_error_names_the_path():
    model = _model()
    axes = eqx.tree_at(
        lambda m: m.layers[1].weight, _model_axes(model), ("mlp", "embed")
    )
    with pytest.raises(
        TypeError, match=r"'mlp' \(a str\) at 'layers/1/weight/0'.*AxisNames"
    ):
        eqshard.logical_to_mesh_specs(axes, [])


def test_specs_repeated_name_error_names_the_path():
    axes = _model_axes(_model(), down=("embed", "embed"))
    with pytest.raises(
        ValueError, match=r"'embed' appears more than once .* at 'layers/1/weight'"
    ):
        eqshard.logical_to_mesh_specs(axes, [("embed", "data")])


@pytest.mark.parametrize(
    "leaf, match",
    [
        (3, r"3 \(a int\) at 'layers/0/w'"),
        (np.zeros(2), r"\(a ndarray\) at 'layers/0/w'"),
        ("embed", r"'embed' \(a str\) at 'layers/0/w'"),
    ],
)
def test_specs_bad_leaf_error_names_the_path(leaf, match):
    with pytest.raises(TypeError, match=match):
        eqshard.logical_to_mesh_specs({"layers": [{"w": leaf}]}, [])


def test_specs_root_leaf():
    assert eqshard.logical_to_mesh_specs(AxisNames("a"), [("a", "x")]) == P("x")
    assert eqshard.logical_to_mesh_specs(None, [("a", "x")]) is None
    with pytest.raises(TypeError, match="at '<root>'"):
        eqshard.logical_to_mesh_specs(1.5, [])


def test_specs_bad_rules():
    with pytest.raises(TypeError, match=r"logical_to_mesh_specs: `axis_rules\[0\]`"):
        eqshard.logical_to_mesh_specs({"w": AxisNames("a")}, [("a",)])


@pytest.mark.parametrize(
    "spec, match",
    [
        (AxisNames("embed"), r"AxisNames\('embed'\) at 'w'.*logical_to_mesh_specs"),
        ("dp", r"'dp' at 'w'.*write P\('dp'\) for a mesh axis\.$"),
        (3, r"3 at 'w'\. .* or `None`\.$"),
    ],
)
def test_shard_rejects_non_spec_leaves_with_the_fitting_fix(spec, match):
    # `shard` takes mesh axes only: logical names must be resolved first.
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with pytest.raises(TypeError, match=match):
        eqshard.shard({"w": np.zeros(8)}, {"w": spec}, mesh)


def test_constraint_suggests_axis_names_for_a_string_leaf():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with pytest.raises(TypeError, match=r"P\('batch'\).*AxisNames\('batch'\)"):
        eqshard.with_sharding_constraint(jnp.zeros(8), "batch", mesh=mesh)


def test_standard_rules_take_numpy_integers():
    assert eqshard.t5x.standard_logical_axis_rules(
        np.int64(1), np.int64(2)
    ) == eqshard.t5x.standard_logical_axis_rules(1, 2)


class _Declared(eqx.Module):
    weight: jax.Array = eqx.field(metadata={"logical_axes": ("embed", "mlp")})
    bias: jax.Array
    inner: list

    def __init__(self):
        self.weight = jnp.zeros((8, 16))
        self.bias = jnp.zeros(16)
        self.inner = [_Inner()]


class _Inner(eqx.Module):
    kernel: jax.Array = eqx.field(metadata={"logical_axes": (None, "mlp")})
    n: int

    def __init__(self):
        self.kernel = jnp.zeros((4, 16))
        self.n = 3


def test_declared_axis_names(mesh):
    model = _Declared()
    names = eqshard.declared_axis_names(model)
    assert names.weight == eqshard.AxisNames("embed", "mlp")
    assert names.bias is None
    assert names.inner[0].kernel == eqshard.AxisNames(None, "mlp")
    assert names.inner[0].n is None
    abstract_names = eqshard.declared_axis_names(eqx.filter_eval_shape(_Declared))
    assert abstract_names.weight == eqshard.AxisNames("embed", "mlp")
    specs = eqshard.logical_to_mesh_specs(names, [("embed", "dp"), ("mlp", "tp")])
    assert specs.weight == P("dp", "tp") and specs.inner[0].kernel == P(None, "tp")


def test_axis_names_as_rule_values():
    tree = {"w": jnp.zeros((8, 16)), "b": jnp.zeros(16)}
    rules = [("w", eqshard.AxisNames("embed", "mlp")), ("b", eqshard.AxisNames("mlp"))]
    with eqshard.logical_axis_rules([("embed", "dp"), ("mlp", "tp")]):
        specs = eqshard.match_partition_rules(rules, tree)
    assert specs == {"w": P("dp", "tp"), "b": P("tp")}
