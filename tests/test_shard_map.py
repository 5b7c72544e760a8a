import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from probes import Compiles

import eqshard


# Three models, each placed by `eqshard.shard` with its parameters split over
# 'tp', and the same per-device kernel for all: gather the parameters (the spec
# tree says along which dimension), then run the model on this device's rows.
# The gathered parameters are the same on every 'tp' device, which JAX's type
# check cannot see (`all_gather` returns a varying value): `check_vma=False`.


class Block(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.LayerNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(8, 8, key=key)
        self.norm = eqx.nn.LayerNorm(8)

    def __call__(self, x):
        return x + jax.nn.gelu(self.linear(self.norm(x)))


class Stack(eqx.Module):
    blocks: Block  # three blocks stacked on a leading axis, run by `lax.scan`

    def __call__(self, x):
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def step(h, p):
            return eqx.combine(p, static)(h), None

        return jax.lax.scan(step, x, params)[0]


class Attention(eqx.Module):
    mha: eqx.nn.MultiheadAttention

    def __call__(self, x):
        return self.mha(x, x, x)


def _mlp(key):
    return eqx.nn.MLP(8, 8, width_size=16, depth=2, key=key)


def _attention(key):
    return Attention(eqx.nn.MultiheadAttention(2, 8, key=key))


def _stack(key):
    return Stack(eqx.filter_vmap(Block)(jax.random.split(key, 3)))


MODELS = {
    "mlp": (_mlp, [("weight", P("tp", None)), ("bias", P("tp"))], (16, 8)),
    "attention": (_attention, [("weight", P("tp", None))], (8, 4, 8)),
    "scan": (_stack, [(".*", P(None, "tp"))], (8, 8)),
}


def _gathered(model, specs):
    """`model` with every array gathered along the dimension its spec puts on 'tp'."""

    def gather(leaf, spec):
        if spec is None or "tp" not in spec:
            return leaf
        return jax.lax.all_gather(leaf, "tp", axis=spec.index("tp"), tiled=True)

    return jtu.tree_map(gather, model, specs, is_leaf=lambda x: x is None)


def forward(model, x):
    return jax.vmap(model)(x)


def kernel(model, specs, x):
    return forward(_gathered(model, specs), x)


def _random(tree, seed=0):
    """`tree` with random NumPy values at its `jax.ShapeDtypeStruct`s (as made by
    `eqx.filter_eval_shape`): on the host, so that building a model compiles
    nothing."""
    rng = np.random.default_rng(seed)

    def fill(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return (0.3 * rng.normal(size=x.shape)).astype(x.dtype)
        return x

    return jtu.tree_map(fill, tree)


def _placed(name, mesh):
    make, rules, shape = MODELS[name]
    model = _random(eqx.filter_eval_shape(make, jax.random.key(0)))
    x = _random(jax.ShapeDtypeStruct(shape, np.float32), seed=1)
    reference = eqx.filter_jit(forward)(model, x)  # plain jit on one device
    model = eqshard.shard(model, eqshard.match_partition_rules(rules, model), mesh)
    return model, eqshard.shard(x, P("dp"), mesh), reference


def _assert_same(got, want, *, exact=True):
    """Bit for bit where the computation is the same as plain jit's; within 1e-6
    where XLA computes a batch of other size another way (attention's batched
    matrix products)."""
    if exact:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


def _on(x, spec, mesh):
    return x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_models_equal_plain_jit_with_specs_read_from_shard(
    name, kind, mesh, explicit_mesh
):
    on = {"auto": mesh, "explicit": explicit_mesh}[kind]
    model, x, reference = _placed(name, on)
    specs = eqshard.get_partition_spec(model)  # static: no arrays in it
    assert type(specs) is type(model)
    mapped = eqshard.filter_shard_map(kernel, out_specs=P("dp"), check_vma=False)
    out = mapped(model, specs, x)
    assert _on(out, P("dp"), on)
    _assert_same(out, reference, exact=name != "attention")
    # New values, and a new wrapper of the same function: nothing compiles.
    flipped = eqshard.shard(np.asarray(x)[::-1], P("dp"), on)
    with Compiles() as compiles:
        again = mapped(model, specs, flipped)
        eqshard.filter_shard_map(kernel, out_specs=P("dp"), check_vma=False)(
            model, specs, x
        )
    assert compiles.count == 0
    _assert_same(again, np.asarray(reference)[::-1], exact=False)


def test_inside_filter_jit_on_auto_axes(mesh):
    model, x, reference = _placed("mlp", mesh)
    specs = eqshard.get_partition_spec(model)

    @eqx.filter_jit
    def step(model, x):
        # Traced arrays on Auto axes carry no layout: the specs are given.
        mapped = eqshard.filter_shard_map(
            kernel, in_specs=(specs, None, P("dp")), out_specs=P("dp"), check_vma=False
        )
        return mapped(model, specs, x) * 2

    with jax.set_mesh(mesh):
        out = step(model, x)
        with Compiles() as compiles:
            step(model, x)
    assert compiles.count == 0
    assert out.sharding.spec == P("dp")
    np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(reference))


def test_inside_filter_jit_on_explicit_axes_reads_the_types(explicit_mesh):
    model, x, reference = _placed("mlp", explicit_mesh)
    specs = eqshard.get_partition_spec(model)

    @eqx.filter_jit
    def step(model, x):
        # No mesh given or set: the traced arrays' types name it.
        mapped = eqshard.filter_shard_map(kernel, out_specs=P("dp"), check_vma=False)
        return mapped(model, specs, x)

    out = step(model, x)
    assert _on(out, P("dp"), explicit_mesh)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(reference))


def test_auto_tracers_without_in_specs_say_what_to_pass(mesh):
    model, x, _ = _placed("mlp", mesh)
    specs = eqshard.get_partition_spec(model)
    mapped = eqshard.filter_shard_map(kernel, out_specs=P("dp"), mesh=mesh)
    with pytest.raises(ValueError, match="0/layers/0/weight") as info:
        eqx.filter_jit(mapped)(model, specs, x)
    message = str(info.value)
    assert message.startswith("eqshard.filter_shard_map: cannot read the layout of 7")
    assert "'2' is traced on Auto axes" in message
    assert "Pass `in_specs`" in message and "every input is static" in message


def test_unplaced_arrays_without_in_specs_say_what_to_pass(mesh):
    with pytest.raises(ValueError, match="'1' is a NumPy array") as info:
        eqshard.filter_shard_map(jnp.add, out_specs=P(), mesh=mesh)(
            jnp.zeros(8, jnp.float32), np.zeros(8, np.float32)
        )
    assert "'0' has a SingleDeviceSharding" in str(info.value)
    assert "{'dp': 2, 'tp': 4}" in str(info.value)


def test_a_wrong_spec_tree_names_every_offending_path(mesh):
    model = _random(
        eqx.filter_eval_shape(eqx.nn.MLP, 8, 8, 12, 2, key=jax.random.key(0))
    )
    specs = jtu.tree_map(lambda _: P(), model)
    specs = eqx.tree_at(
        lambda s: (s.layers[0].weight, s.layers[1].bias, s.layers[2].weight),
        specs,
        (P("x", None), P(("dp", "tp")), P(None, None, "tp")),
    )
    mapped = eqshard.filter_shard_map(
        lambda m, x: x, in_specs=(specs, P()), out_specs=P(), mesh=mesh
    )
    with pytest.raises(ValueError) as info:
        mapped(model, jnp.zeros(8))
    message = str(info.value)
    assert message.startswith(
        "eqshard.filter_shard_map: 3 leaves have specs that cannot apply on mesh "
        "{'dp': 2, 'tp': 4}:"
    )
    for line in [
        "'0/layers/0/weight' (shape (12, 8)), spec P('x', None): 'x' is not a "
        "mesh axis. Use P() for this leaf",
        "'0/layers/1/bias' (shape (12,)), spec P(('dp', 'tp'),): dimension 0 (size "
        "12) is not divisible by ('dp', 'tp') (size 8). Use P('dp',) for this leaf",
        "'0/layers/2/weight' (shape (8, 12)), spec P(None, None, 'tp'): the spec "
        "has 3 entries but the array has rank 2. Use P() for this leaf",
    ]:
        assert line in message


def test_a_prefix_that_does_not_match_names_the_path(mesh):
    model = eqx.nn.Linear(8, 8, key=jax.random.key(0))
    mapped = eqshard.filter_shard_map(
        lambda m, x: x, in_specs=({"weight": P()}, P()), out_specs=P(), mesh=mesh
    )
    with pytest.raises(ValueError, match="`in_specs` does not match .* at '0'"):
        mapped(model, jnp.zeros(8))
    with pytest.raises(ValueError, match="`out_specs` does not match .* at '1'"):
        eqshard.filter_shard_map(
            lambda x: (x, [x, x]), in_specs=P(), out_specs=(P(), (P(), P())), mesh=mesh
        )(jnp.zeros(8))


def test_out_specs_are_checked_against_the_blocks(mesh):
    def f(x):
        return {"a": x, "b": x.sum(), "name": "f"}

    with pytest.raises(ValueError) as info:
        eqshard.filter_shard_map(
            f,
            in_specs=P("dp"),
            out_specs={"a": P("dp", "tp"), "b": P("x"), "name": None},
            mesh=mesh,
        )(jnp.zeros(8))
    message = str(info.value)
    assert message.startswith("eqshard.filter_shard_map: 2 leaves have specs")
    assert "'a' (shape (4,)), spec P('dp', 'tp'): the spec has 2 entries" in message
    assert "'b' (shape ()), spec P('x',): the spec has 1 entries" in message
    assert "one device's block of the outputs" in message
    with pytest.raises(ValueError, match=r"`out_specs` has `None` at 'b'"):
        eqshard.filter_shard_map(
            f,
            in_specs=P("dp"),
            out_specs={"a": P("dp"), "b": None, "name": None},
            mesh=mesh,
        )(jnp.zeros(8))


def test_explicit_axes_take_arrays_as_they_are_laid_out(explicit_mesh):
    x = eqshard.shard(jnp.zeros((8, 4)), P("dp"), explicit_mesh)
    y = eqshard.shard(jnp.zeros((8, 4)), P(None, "tp"), explicit_mesh)
    mapped = eqshard.filter_shard_map(
        lambda x, y: x, in_specs=(P("tp"), P("dp")), out_specs=P()
    )
    with pytest.raises(ValueError) as info:
        mapped(x, y)
    message = str(info.value)
    assert "'0': laid out as P('dp', None), `in_specs` asks P('tp',)" in message
    assert "'1': laid out as P(None, 'tp'), `in_specs` asks P('dp',)" in message
    assert "Omit `in_specs`" in message
    with pytest.raises(ValueError, match="'0': its type has no layout"):
        eqshard.filter_shard_map(
            lambda x: x, in_specs=P("dp"), out_specs=P("dp"), mesh=explicit_mesh
        )(np.zeros(8))


def test_arrays_on_another_mesh_are_named(mesh):
    other = eqshard.create_mesh((4, 2), ("dp", "tp"))
    x = eqshard.shard(jnp.zeros(8), P("dp"), other)
    with pytest.raises(ValueError, match="'0': on mesh {'dp': 4, 'tp': 2}"):
        eqshard.filter_shard_map(lambda x: x, out_specs=P("dp"), mesh=mesh)(x)


def test_non_array_outputs_come_back_as_returned(mesh):
    def f(x, label):
        rows = x.shape[0]  # this device's rows: a Python int
        return x * 2, (label, rows, jax.nn.relu, None), 1.5

    mapped = eqshard.filter_shard_map(
        f, in_specs=(P("dp"), None), out_specs=P("dp"), mesh=mesh
    )
    y, (label, rows, fn, nothing), scale = mapped(jnp.arange(8.0), "eight")
    np.testing.assert_array_equal(np.asarray(y), 2 * np.arange(8.0))
    assert (label, rows, fn, nothing, scale) == ("eight", 4, jax.nn.relu, None, 1.5)
    # Kept per shape: a second shape gives its own non-array outputs.
    _, (_, rows, _, _), _ = mapped(jnp.arange(16.0), "sixteen")
    assert rows == 8
    with Compiles() as compiles:
        _, (label, rows, _, _), _ = mapped(jnp.arange(8.0), "eight")
    assert (compiles.count, label, rows) == (0, "eight", 4)


def test_static_arguments_are_told_apart_by_type(mesh):
    seen = []

    def f(x, k):
        seen.append(type(k))
        return x * k

    mapped = eqshard.filter_shard_map(f, in_specs=(P("dp"), None), out_specs=P("dp"))
    with jax.set_mesh(mesh):
        x = jnp.arange(8)
        assert mapped(x, 2).dtype == jnp.int32
        assert mapped(x, 2.0).dtype == jnp.float32
        assert mapped(x, 2).dtype == jnp.int32
    # Every call traces `fn` once, to key the program on what it read; the
    # first call of each type traces again for the program itself.
    assert seen == [int, int, float, float, int]


def test_prefix_rules_and_logical_specs_give_the_same_result(mesh):
    model, x, reference = _placed("mlp", mesh)
    specs = eqshard.get_partition_spec(model)
    rules = MODELS["mlp"][1]
    expected = np.asarray(reference)

    def run(in_specs, out_specs, specs=specs):
        with jax.set_mesh(mesh):
            mapped = eqshard.filter_shard_map(
                kernel, in_specs=in_specs, out_specs=out_specs, check_vma=False
            )
            return np.asarray(mapped(model, specs, x))

    # A prefix: the whole model whole on every device, so there is nothing to
    # gather (the kernel's spec tree says so).
    whole = jtu.tree_map(lambda _: P(), specs)
    np.testing.assert_array_equal(run((P(), None, P("dp")), P("dp"), whole), expected)
    # Rules for one argument, matched inside it; rules for the output.
    np.testing.assert_array_equal(
        run((rules, None, P("dp")), [(".*", P("dp"))]), expected
    )
    # Logical names, resolved by the rules in force.
    batch = eqshard.AxisNames("batch", None)
    with eqshard.logical_axis_rules([("batch", "dp")]):
        np.testing.assert_array_equal(run((specs, None, batch), batch), expected)


def test_rules_as_in_specs_apply_to_each_argument(mesh):
    seen = {}

    def f(a, b):
        seen["shapes"] = (a["w"].shape, b["w"].shape)
        return a["w"].sum() + b["w"].sum()

    mapped = eqshard.filter_shard_map(
        f, in_specs=[("w", P("tp"))], out_specs=P(), mesh=mesh, check_vma=False
    )
    mapped({"w": jnp.ones(8)}, {"w": jnp.ones(4)})
    assert seen["shapes"] == ((2,), (1,))


def test_partial_manual_axes(mesh):
    x = eqshard.shard(jnp.arange(32.0).reshape(8, 4), P("dp", "tp"), mesh)
    mapped = eqshard.filter_shard_map(
        lambda x: x * 2, out_specs=P("dp"), axis_names={"dp"}
    )
    out = mapped(x)  # the inferred spec keeps the manual axis only
    np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(x))
    with pytest.raises(ValueError, match=r"'0' .*'tp' not among the manual axes"):
        eqshard.filter_shard_map(
            lambda x: x, in_specs=P("dp", "tp"), out_specs=P("dp"), axis_names={"dp"}
        )(x)


def test_a_ring_with_check_vma_passed_on(mesh):
    def ring_sum(x):  # each step passes its block on to the next device
        n = jax.lax.axis_size("dp")
        total = block = x
        for _ in range(n - 1):
            block = jax.lax.ppermute(block, "dp", [(i, (i + 1) % n) for i in range(n)])
            total = total + block
        return total

    x = jnp.arange(8.0)
    out = eqshard.filter_shard_map(
        ring_sum, in_specs=P("dp"), out_specs=P(), mesh=mesh, check_vma=False
    )(x)
    np.testing.assert_array_equal(np.asarray(out), x[:4] + x[4:])


@pytest.mark.parametrize("where", ["set_mesh", "named_sharding"])
def test_the_mesh_of_host_arrays(mesh, where):
    add = eqshard.filter_shard_map(lambda x: x + 1, in_specs=P("dp"), out_specs=P("dp"))
    if where == "set_mesh":
        with jax.set_mesh(mesh):
            out = add(np.arange(8.0))
    else:  # a `NamedSharding` names its mesh
        sharding = NamedSharding(mesh, P("dp"))
        out = eqshard.filter_shard_map(
            lambda x: x + 1, in_specs=sharding, out_specs=P("dp")
        )(np.arange(8.0))
    assert out.sharding == NamedSharding(mesh, P("dp"))
    np.testing.assert_array_equal(np.asarray(out), np.arange(8.0) + 1)


def test_usage_errors(mesh):
    x = jnp.zeros(8)
    with pytest.raises(TypeError, match="unknown option 'donate'"):
        eqshard.filter_shard_map(lambda x: x, out_specs=P(), donate=True)
    with pytest.raises(TypeError, match="keyword arguments 'x'"):
        eqshard.filter_shard_map(lambda x: x, out_specs=P(), mesh=mesh)(x=x)
    model = eqx.nn.Linear(8, 8, key=jax.random.key(0))
    with pytest.raises(TypeError, match="`fn` holds arrays .*'weight'"):
        eqshard.filter_shard_map(model, in_specs=P(), out_specs=P(), mesh=mesh)(x)
    with pytest.raises(TypeError, match="arguments at '1/0' cannot be hashed"):
        eqshard.filter_shard_map(
            lambda x, s: x, in_specs=P(), out_specs=P(), mesh=mesh
        )(x, [{1}])
    with pytest.raises(ValueError, match="no mesh"):
        eqshard.filter_shard_map(lambda x: x, in_specs=P(), out_specs=P())(np.zeros(8))
    # The spec tree of one argument, given bare, not in a tuple of one.
    with pytest.raises(ValueError, match=r"`in_specs` is a dict, .*`\(specs,\)`"):
        eqshard.filter_shard_map(
            lambda t: t, in_specs={"a": P("dp")}, out_specs=P(), mesh=mesh
        )({"a": x})


def test_gradients_flow_through(mesh):
    x = eqshard.shard(jnp.arange(8.0), P("dp"), mesh)
    sin = eqshard.filter_shard_map(
        jnp.sin, in_specs=P("dp"), out_specs=P("dp"), mesh=mesh
    )
    grad = jax.grad(lambda x: sin(x).sum())(x)
    np.testing.assert_allclose(np.asarray(grad), np.cos(np.arange(8.0)), rtol=1e-6)


def test_an_eager_call_reads_what_fn_closes_over_again(mesh):
    scale = 2.0
    table = np.ones(1, np.float32)  # added to each block

    def f(x):
        return x * scale + table

    mapped = eqshard.filter_shard_map(f, in_specs=P("dp"), out_specs=P("dp"), mesh=mesh)
    x = jnp.arange(8.0)
    np.testing.assert_array_equal(np.asarray(mapped(x)), np.arange(8.0) * 2 + 1)
    scale = 5.0  # as an eager `jax.shard_map` would, the new value is read
    np.testing.assert_array_equal(np.asarray(mapped(x)), np.arange(8.0) * 5 + 1)
    table[:] = 3.0  # NumPy data changed in place too
    np.testing.assert_array_equal(np.asarray(mapped(x)), np.arange(8.0) * 5 + 3)
    scale, table[:] = 2.0, 1.0  # a program made before: nothing compiles
    with Compiles() as compiles:
        again = mapped(x)
    assert compiles.count == 0
    np.testing.assert_array_equal(np.asarray(again), np.arange(8.0) * 2 + 1)


def test_logical_names_without_rules_are_refused(mesh):
    x = jnp.arange(8.0)
    double = eqshard.filter_shard_map(
        lambda x: {"y": x * 2},
        in_specs=(eqshard.AxisNames("batch"),),
        out_specs={"y": eqshard.AxisNames("batch")},
        mesh=mesh,
    )
    assert eqshard.get_logical_axis_rules() == ()
    # Without rules every name would resolve to no axis: P(None), silently.
    with pytest.raises(
        ValueError,
        match=r"`in_specs` has logical axis names \(AxisNames\('batch'\) at '0'\)"
        r".*`axis_rules=`.*set_logical_axis_rules",
    ):
        double(x)
    with pytest.raises(ValueError, match=r"`out_specs` .*AxisNames.* at 'y'"):
        eqshard.filter_shard_map(
            lambda x: {"y": x * 2},
            in_specs=P("dp"),
            out_specs={"y": eqshard.AxisNames("batch")},
            mesh=mesh,
        )(x)
    # Given or set, the rules resolve them.
    with_rules = eqshard.filter_shard_map(
        lambda x: {"y": x * 2},
        in_specs=(eqshard.AxisNames("batch"),),
        out_specs={"y": eqshard.AxisNames("batch")},
        mesh=mesh,
        axis_rules=[("batch", "dp")],
    )
    for out in (with_rules(x), _with_rules(double, x)):
        assert out["y"].sharding.spec == P("dp")
        np.testing.assert_array_equal(np.asarray(out["y"]), 2 * np.arange(8.0))


def _with_rules(mapped, x):
    with eqshard.logical_axis_rules([("batch", "dp")]):
        return mapped(x)
