import io
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

import eqshard


def _mesh(shape, names, reverse=False):
    devices = np.array(jax.devices()[::-1] if reverse else jax.devices())
    return Mesh(devices.reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))


def _mlp():
    return eqx.nn.MLP(16, 8, 32, depth=2, key=jax.random.key(0))


def _blocks():
    keys = jax.random.split(jax.random.key(1), 4)
    return {
        "embed": jax.random.normal(keys[0], (64, 16)),
        "blocks": [
            {"w": jax.random.normal(k, (16, 48)), "b": jnp.zeros(48), "n": jnp.ones(16)}
            for k in keys[1:3]
        ],
        "head": eqx.nn.Linear(16, 64, key=keys[3]),
        "step": jnp.array(3, jnp.int32),  # not trainable: no gradient, no state
    }


def _rules_tp(mesh):
    return [("weight|w$|embed", P(None, "tp")), (".*", P())]


def _rules_auto(mesh):
    return [(".*", eqshard.auto_fsdp(mesh.axis_names[0], min_size=64, mesh=mesh))]


CASES = [
    # (model, mesh shape, axis names, rules, optimizer, reversed devices)
    (_mlp, (2, 4), ("dp", "tp"), _rules_tp, optax.adamw(1e-3), False),
    (_mlp, (8,), ("fsdp",), _rules_auto, optax.adamw(1e-3), False),
    (_blocks, (4, 2), ("fsdp", "tp"), _rules_tp, optax.adamw(1e-3), True),
    (_blocks, (8,), ("fsdp",), _rules_auto, optax.adamw(1e-3), False),
    (_blocks, (2, 4), ("fsdp", "tp"), _rules_auto, optax.adamw(1e-3), False),
    (_blocks, (2, 4), ("dp", "tp"), _rules_tp, optax.lion(1e-3), False),
]


def _loss(params):
    leaves = [x for x in jax.tree.leaves(params) if eqx.is_inexact_array(x)]
    return sum(jnp.sum(x**2) for x in leaves)


def _shard_bytes(mesh, *trees):
    """By hand: the bytes of every addressable shard, per device of the mesh."""
    per = {device.id: 0 for device in mesh.devices.flat}
    for tree in trees:
        for leaf in jax.tree.leaves(tree):
            if isinstance(leaf, jax.Array):
                for shard in leaf.addressable_shards:
                    per[shard.device.id] += shard.data.nbytes
    return tuple(per[device.id] for device in mesh.devices.flat)


@pytest.mark.parametrize("make,shape,names,rules,optimizer,reverse", CASES)
def test_plan_equals_the_shards_of_the_same_tree_sharded(
    make, shape, names, rules, optimizer, reverse
):
    mesh = _mesh(shape, names, reverse)
    model = make()
    specs = eqshard.match_partition_rules(rules(mesh), model)
    params = eqshard.shard(model, specs, mesh)
    trainable = eqx.filter(params, eqx.is_inexact_array)
    made = jax.jit(optimizer.init)(trainable)
    # The classic slip: `jit(init)` makes the state on one device, not the mesh.
    with pytest.raises(ValueError, match="single device"):
        eqshard.check_layout(made, P(), mesh)
    # Each state array laid out as its parameter, by optax's own map (scalars P()).
    trainable_specs = jax.tree.map(
        lambda p, s: None if p is None else s,
        trainable,
        specs,
        is_leaf=lambda x: x is None,
    )
    state_specs = optax.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        made,
        trainable_specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )
    state = eqshard.shard(made, state_specs, mesh)
    grads = jax.jit(jax.grad(_loss))(trainable)
    eqshard.check_layout(grads, trainable_specs, mesh)
    expected = _shard_bytes(mesh, params, state, grads)

    plan = eqshard.plan_training(model, specs, mesh, optimizer=optimizer)
    assert plan.bytes_per_device == expected
    # Read from the arrays themselves, the plan is the same.
    read = eqshard.plan_training(params, None, optimizer=optimizer)
    assert read.mesh == mesh
    assert read.bytes_per_device == expected
    # And abstractly, on an AbstractMesh of the same axes.
    shapes = eqx.filter_eval_shape(make)
    abstract = eqshard.plan_training(
        shapes, specs, AbstractMesh(shape, names), optimizer=optimizer
    )
    assert abstract.bytes_per_device == expected


def test_bf16_parameters_with_f32_moments(mesh):
    params = {
        "w": jax.ShapeDtypeStruct((64, 32), jnp.float32),
        "n": jax.ShapeDtypeStruct((32,), jnp.float32),
    }
    specs = {"w": P("dp", "tp"), "n": P()}
    plan = eqshard.plan_training(
        params,
        specs,
        mesh,
        optimizer=optax.adam(1e-3),
        param_dtype=jnp.bfloat16,
        state_dtype=jnp.float32,
        device_memory=10_000,
    )
    w_piece = (64 // 2) * (32 // 4)
    per_device = (
        (w_piece + 32) * 2  # bf16 parameters
        + (w_piece + 32) * 2  # bf16 gradients
        + 2 * (w_piece + 32) * 4  # f32 mu and nu
        + 4  # the int32 step count, replicated
    )
    assert plan.bytes_per_device == (per_device,) * 8
    assert plan.headroom == 10_000 - per_device and plan.fits
    assert plan.opt_state is not None
    assert {row.dtype for row in plan.opt_state.rows} == {"float32", "int32"}
    tight = eqshard.plan_training(params, specs, mesh, device_memory="1KiB")
    assert not tight.fits and tight.headroom == 1024 - 2 * 2 * (w_piece + 32) * 2
    assert "DOES NOT FIT" in tight.summary()


def test_adafactor_factored_moments_follow_their_parameter(mesh):
    params = {"w": jax.ShapeDtypeStruct((256, 512), jnp.float32)}
    plan = eqshard.plan_training(
        params,
        {"w": P("dp", "tp")},
        mesh,
        optimizer=optax.adafactor(1e-3),
        gradients=False,
    )
    assert plan.opt_state is not None
    rows = {row.path: row for row in plan.opt_state.rows}
    v_row = next(row for path, row in rows.items() if "v_row" in path)
    v_col = next(row for path, row in rows.items() if "v_col" in path)
    assert v_row.shape == (256,) and v_row.spec == P("dp")
    assert v_col.shape == (512,) and v_col.spec == P("tp")


def test_device_view_shows_bars_and_the_largest_replicated_arrays(mesh):
    params = {
        "big": jax.ShapeDtypeStruct((512, 512), jnp.float32),
        "rep": jax.ShapeDtypeStruct((256, 256), jnp.float32),
    }
    plan = eqshard.plan_training(
        params, {"big": P("dp", "tp"), "rep": P()}, mesh, device_memory="2MiB"
    )
    view = plan.device_view()
    assert "devices 0-7" in view and "█" in view
    # The gradient shares its parameter's line: 2 * 256 * 256 * 4 bytes.
    assert "512.0 KiB  parameters: rep (+ grad) (256, 256) float32 (replicated)" in view
    assert "gradients: rep" not in view
    assert str(plan).startswith("training memory on mesh {'dp': 2, 'tp': 4}")


def test_a_single_device_optimizer_state_is_flagged(mesh):
    params = {"w": jax.device_put(jnp.zeros((8, 8)), NamedSharding(mesh, P("dp")))}
    state = jax.jit(optax.sgd(0.1, momentum=0.9).init)({"w": jnp.zeros((8, 8))})
    plan = eqshard.plan_training({"p": params, "s": state}, None, mesh, gradients=False)
    assert any(row.single_device for row in plan.params.rows)
    assert "(single device)" in plan.device_view()


def test_bad_memory_is_an_error(mesh):
    with pytest.raises(ValueError, match="'80 parsecs' is not an amount of memory"):
        eqshard.plan_training(
            {"w": jnp.zeros(2)}, P(), mesh, device_memory="80 parsecs"
        )


def test_show_draws_with_rich_and_falls_back_to_text(mesh, monkeypatch):
    params = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    plan = eqshard.plan_training(params, P("dp"), mesh, device_memory="32KiB")
    drawn = io.StringIO()
    plan.show(file=drawn)  # rich is installed in the test environment
    assert "bytes per device" in drawn.getvalue()
    assert "devices 0-7" in drawn.getvalue() and "█" in drawn.getvalue()
    # Without rich (as if not installed), the same plan as plain text.
    monkeypatch.setitem(sys.modules, "rich.console", None)
    plain = io.StringIO()
    plan.show(file=plain)
    assert plain.getvalue() == plan.table() + "\n"


@pytest.mark.parametrize("form", ["numpy", "abstract"])
def test_64_bit_parameters_are_planned_as_placed(mesh, form):
    # With x64 off, JAX places float64 data as float32: the parameters, their
    # gradients and the optimizer state all hold 4-byte elements.
    assert not jax.enable_x64.value
    host = {"w": np.ones((64, 32)), "n": np.ones(32), "i": np.arange(8)}
    params = host
    if form == "abstract":
        params = {k: jax.ShapeDtypeStruct(x.shape, x.dtype) for k, x in host.items()}
    specs = {"w": P("dp", "tp"), "n": P(), "i": P()}
    optimizer = optax.adam(1e-3)
    plan = eqshard.plan_training(params, specs, mesh, optimizer=optimizer)

    placed = eqshard.shard(host, specs, mesh)
    assert placed["w"].dtype == jnp.float32 and placed["i"].dtype == jnp.int32
    trainable = {"w": placed["w"], "n": placed["n"]}
    trainable_specs = {"w": specs["w"], "n": P()}
    # Adam's state with specs where its arrays are:
    moments = optax.ScaleByAdamState(P(), trainable_specs, trainable_specs)  # pyright: ignore[reportArgumentType]
    state = eqshard.shard(
        jax.jit(optimizer.init)(trainable), (moments, optax.EmptyState()), mesh
    )
    grads = jax.jit(jax.grad(_loss))(trainable)
    eqshard.check_layout(grads, trainable_specs, mesh)
    assert plan.bytes_per_device == _shard_bytes(mesh, placed, grads, state)
    assert {row.dtype for row in plan.params.rows} == {"float32", "int32"}


def test_a_spec_that_cannot_apply_is_reported_not_planned_as_fitting(mesh):
    params = {"w": jax.ShapeDtypeStruct((6, 8), jnp.float32)}
    specs = {"w": P("tp", None)}  # 6 rows over 'tp' (4)
    plan = eqshard.plan_training(params, specs, mesh, device_memory="1GiB")
    assert [problem.path for problem in plan.problems] == ["w"]
    assert not plan.fits
    assert "cannot apply" in plan.summary() and "'w'" in plan.summary()
    with pytest.raises(ValueError, match=r"(?s)eqshard.plan_training: .*'w'"):
        eqshard.plan_training(params, specs, mesh, on_invalid="raise")


def test_an_optimizer_without_init_is_a_type_error(mesh):
    with pytest.raises(TypeError, match=r"eqshard.plan_training: `optimizer`.*init"):
        eqshard.plan_training({"w": jnp.zeros(8)}, P(), mesh, optimizer=optax.adam)


class _Frozen(eqx.Module):
    body: eqx.nn.Linear  # frozen
    head: eqx.nn.Linear  # trained
    cache: eqx.nn.StateIndex  # initial value of a cache: never trained

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.body = eqx.nn.Linear(32, 32, key=k1)
        self.head = eqx.nn.Linear(32, 8, key=k2)
        self.cache = eqx.nn.StateIndex(jnp.zeros((16, 32)))


def test_plan_trains_only_what_the_filter_selects():
    model = eqx.filter_eval_shape(_Frozen, jax.random.key(0))
    mesh = AbstractMesh((8,), ("dp",))
    head = 32 * 8 * 4 + 8 * 4  # bytes of the head's weight and bias
    frozen = 32 * 32 * 4 + 32 * 4 + 16 * 32 * 4
    only_head = eqx.tree_at(
        lambda m: m.head, jax.tree.map(lambda _: False, model), replace=True
    )
    by_path = lambda x: x.shape in ((32, 8), (8,), (8, 32))  # noqa: E731
    for trainable in (only_head, by_path):
        plan = eqshard.plan_training(
            model, P(), mesh, optimizer=optax.adam(1e-3), trainable=trainable
        )
        assert plan.params.bytes_per_device[0] == head + frozen
        assert plan.grads is not None and plan.opt_state is not None
        assert plan.grads.bytes_per_device[0] == head
        # Adam: mu and nu for the head, and a step count.
        assert plan.opt_state.bytes_per_device[0] == 2 * head + 4
    everything = eqshard.plan_training(model, P(), mesh, optimizer=optax.adam(1e-3))
    assert everything.grads is not None
    assert everything.grads.bytes_per_device[0] == head + frozen
    not_bool = eqx.tree_at(lambda m: m.head, only_head, replace="yes")
    with pytest.raises(TypeError, match=r"`trainable` has 'yes' at 'head/weight'"):
        eqshard.plan_training(model, P(), mesh, trainable=not_bool)
    with pytest.raises(TypeError, match=r"returned 1 for the leaf at 'body/weight'"):
        eqshard.plan_training(model, P(), mesh, trainable=lambda x: 1)
