"""Host offload by rules (`eqshard.host`): optimizer state kept in host memory
between steps, on 8 CPU devices (whose memory kinds are `device`, `pinned_host`
and `unpinned_host`)."""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqshard


OPTIMIZER = optax.adamw(1e-2)
RULES = [("w1", P("tp", "dp")), ("w2", P(None, "tp")), (".*", P())]
HOST_RULES = [("(mu|nu)/", eqshard.host()), *RULES]


def _make(key):
    k1, k2 = jax.random.split(key)
    params = {
        "w1": jax.random.normal(k1, (16, 32)) / 4,
        "w2": jax.random.normal(k2, (32, 8)) / 4,
        "b": jnp.zeros((8,)),
    }
    return params, OPTIMIZER.init(params)


def _step(x, state):
    params, opt_state = state

    def loss_fn(params):
        h = jnp.tanh(x @ params["w1"])
        return jnp.mean((h @ params["w2"] + params["b"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


def _kinds(tree):
    return {a.sharding.memory_kind for a in jax.tree.leaves(tree)}


def _moments(state):
    return (state[1][0].mu, state[1][0].nu)


def _train(mesh, rules, x, steps, check):
    state = eqshard.init_sharded(_make, jax.random.key(0), specs=rules, mesh=mesh)
    step = eqshard.filter_jit(
        _step,
        in_specs=(P("dp"), rules),
        out_specs=(1, P()),
        donate="all-except-first",
        mesh=mesh,
    )
    losses = []
    for _ in range(steps):
        old = state
        state, loss = step(x, state)
        losses.append(float(loss))
        check(state, old)
    return losses, state


@pytest.mark.slow
def test_adamw_moments_on_host_by_one_rule(mesh):
    x = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)

    def on_device(state, old):
        assert _kinds(state) == {"device"}

    def offloaded(state, old):
        assert _kinds(_moments(state)) == {"pinned_host"}
        assert _kinds(state[0]) == {"device"}
        assert _kinds(state[1][0].count) == {"device"}
        # Donation works as on device: the old moments' buffers were given up.
        assert all(a.is_deleted() for a in jax.tree.leaves(_moments(old)))

    device_losses, _ = _train(mesh, RULES, x, 5, on_device)
    host_losses, state = _train(mesh, HOST_RULES, x, 5, offloaded)
    np.testing.assert_allclose(host_losses, device_losses, rtol=1e-6)
    # And both are the unsharded step's, in raw JAX.
    reference, losses = _make(jax.random.key(0)), []
    for _ in range(5):
        reference, loss = jax.jit(_step)(x, reference)
        losses.append(float(loss))
    np.testing.assert_allclose(host_losses, losses, rtol=1e-5)
    eqshard.check_layout(state, HOST_RULES, mesh)
    report = eqshard.check_layout(state, RULES, mesh, on_invalid="ignore")
    assert {m.path for m in report.mismatches} == {
        f"1/0/{moment}/{name}" for moment in ("mu", "nu") for name in ("w1", "w2", "b")
    }
    assert all("pinned_host" in m.problem for m in report.mismatches)


@pytest.mark.slow
def test_init_sharded_builds_into_host_memory(mesh):
    rules = [("w1", eqshard.host(P("tp", "dp"))), *RULES]
    params, opt_state = eqshard.init_sharded(
        _make, jax.random.key(1), specs=rules, mesh=mesh
    )
    assert params["w1"].sharding == NamedSharding(
        mesh, P("tp", "dp"), memory_kind="pinned_host"
    )
    assert _kinds([params["w2"], params["b"]]) == {"device"}
    # The moments follow their parameter there.
    assert opt_state[0].mu["w1"].sharding.memory_kind == "pinned_host"
    expected = jax.jit(_make)(jax.random.key(1))[0]["w1"]
    np.testing.assert_array_equal(np.asarray(params["w1"]), np.asarray(expected))


@pytest.mark.slow
def test_save_restore_onto_another_mesh_keeps_memory_kinds(mesh, tmp_path):
    state = eqshard.init_sharded(_make, jax.random.key(2), specs=HOST_RULES, mesh=mesh)
    eqshard.save(tmp_path / "ckpt", state)
    other = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    restored = eqshard.restore(
        tmp_path / "ckpt", ft.partial(_make, jax.random.key(0)), HOST_RULES, other
    )
    for before, after in zip(
        jax.tree.leaves(state), jax.tree.leaves(restored), strict=True
    ):
        assert after.sharding.memory_kind == before.sharding.memory_kind
        assert dict(after.sharding.mesh.shape) == {"dp": 4, "tp": 2}
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
    assert _kinds(_moments(restored)) == {"pinned_host"}


def test_plan_counts_host_bytes_apart(mesh):
    shapes = jax.eval_shape(lambda: _make(jax.random.key(0))[0])
    sizes = dict(mesh.shape)
    # Each device's shard of each moment: w1 over tp and dp, w2 over tp, b whole.
    shard = (16 // sizes["tp"]) * (32 // sizes["dp"]) + 32 * (8 // sizes["tp"]) + 8
    moments = 2 * shard * 4  # mu and nu, float32
    plan = eqshard.plan_training(shapes, HOST_RULES, mesh, optimizer=OPTIMIZER)
    device = eqshard.plan_training(shapes, RULES, mesh, optimizer=OPTIMIZER)
    assert plan.host_bytes_per_device == (moments,) * 8
    assert device.host_bytes_per_device == (0,) * 8
    # By default the update's device copy of the moments counts on the device.
    assert plan.bytes_per_device == device.bytes_per_device
    assert plan.copy_bytes_per_device == (moments,) * 8
    none = eqshard.plan_training(
        shapes, HOST_RULES, mesh, optimizer=OPTIMIZER, offload_copy=0.0
    )
    assert none.bytes_per_device == tuple(b - moments for b in device.bytes_per_device)
    assert "in host memory" in plan.summary()


def test_rules_place_followers_in_host_memory():
    shapes = jax.eval_shape(_make, jax.random.key(0))
    specs = eqshard.match_partition_rules(HOST_RULES, shapes)
    assert specs[1][0].mu == {
        "w1": eqshard.host(P("tp", "dp")),
        "w2": eqshard.host(P(None, "tp")),
        "b": eqshard.host(P()),
    }
    assert specs[1][0].count == P()
    own = [("(mu|nu)/w1", eqshard.host(P("dp"))), *HOST_RULES]
    assert eqshard.match_partition_rules(own, shapes)[1][0].nu["w1"] == eqshard.host(
        P("dp")
    )
    # The report says what matching does.
    report = eqshard.explain_partition_rules(own, shapes)
    assert report.dead_rules == ()
    by_path = {row.path: row.spec for row in report.rows}
    assert by_path["1/0/nu/w1"] == eqshard.host(P("dp"))
    assert by_path["1/0/nu/w2"] == eqshard.host(P(None, "tp"))
    with pytest.raises(ValueError, match="'b'.*follows none"):
        eqshard.match_partition_rules([(".*", eqshard.host())], shapes[0])


def test_host_values():
    assert eqshard.host(eqshard.stacked(P("tp", None))) == eqshard.stacked(
        eqshard.host(P("tp", None))
    )
    names = eqshard.AxisNames("embed", "mlp")
    with eqshard.logical_axis_rules([("embed", "dp"), ("mlp", "tp")]):
        specs = eqshard.match_partition_rules(
            [(".*", eqshard.host(eqshard.stacked(names)))],
            {"w": jnp.zeros((3, 8, 4))},
        )
    assert specs == {"w": eqshard.host(P(None, "dp", "tp"))}
    with pytest.raises(TypeError, match="already in host memory"):
        eqshard.host(eqshard.host(P()))
    with pytest.raises(TypeError, match="not a PartitionSpec"):
        eqshard.host("dp")
    assert eqshard.derive_specs(
        {"mu": {"w": jnp.zeros((8, 4))}},
        {"w": jnp.zeros((8, 4))},
        {"w": P("dp")},
        memory_kind="pinned_host",
    ) == {"mu": {"w": eqshard.host(P("dp"))}}
    assert eqshard.derive_specs(
        {"mu": {"w": jnp.zeros((8, 4))}},
        {"w": jnp.zeros((8, 4))},
        {"w": eqshard.host(P("dp"))},
        memory_kind="device",
    ) == {"mu": {"w": P("dp")}}
    with pytest.raises(ValueError, match="memory_kind"):
        eqshard.derive_specs({}, {}, {}, memory_kind="unpinned")  # pyright: ignore[reportArgumentType]


def test_host_specs_in_spec_trees(mesh):
    tree = {"a": np.arange(32.0, dtype=np.float32).reshape(8, 4), "b": np.ones(4)}
    specs = {"a": eqshard.host(P("dp", "tp")), "b": P()}
    placed = eqshard.shard(tree, specs, mesh)
    assert placed["a"].sharding == NamedSharding(
        mesh, P("dp", "tp"), memory_kind="pinned_host"
    )
    np.testing.assert_array_equal(np.asarray(placed["a"]), tree["a"])
    assert eqshard.named_shardings(specs, mesh)["a"] == placed["a"].sharding
    assert eqshard.abstract(tree, specs, mesh)["a"].sharding == placed["a"].sharding
    with pytest.raises(eqshard.LayoutError, match="'device' memory, not 'pinned_host'"):
        eqshard.check_layout(eqshard.shard(tree, P(), mesh), specs, mesh)


def test_layouts_inside_a_program_refuse_host_memory(mesh):
    tree = eqshard.shard({"a": np.ones((8, 8), np.float32)}, P(), mesh)
    specs = {"a": eqshard.host(P("dp"))}
    with pytest.raises(TypeError, match="with_sharding_constraint.*host.*'a'"):
        jax.jit(lambda t: eqshard.with_sharding_constraint(t, specs, mesh=mesh))(tree)
    mapped = eqshard.filter_shard_map(
        lambda t: t, in_specs=(specs,), out_specs=P("dp"), mesh=mesh
    )
    with pytest.raises(TypeError, match="filter_shard_map.*host.*'0/a'"):
        mapped(tree)


def test_rules_file_writes_and_reads_host():
    from eqshard._cli._rules_file import parse_rules
    from eqshard._search._candidates import rules_text

    shapes = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    text = rules_text(shapes, {"w": eqshard.host(P("dp", None))})
    assert text == "(^|/)w$  host(dp,None)\n"
    text += "(mu|nu)/  host()\nb  host(P('dp', None))\n"
    assert parse_rules(text, "x.rules") == [
        ("(^|/)w$", eqshard.host(P("dp", None))),
        ("(mu|nu)/", eqshard.host()),
        ("b", eqshard.host(P("dp", None))),
    ]


def _analyzed(mesh, rules, make=_make):
    shapes = jax.eval_shape(make, jax.random.key(0))
    step = eqshard.filter_jit(
        _step,
        in_specs=(P("dp"), rules),
        out_specs=(1, P()),
        donate="all-except-first",
        mesh=mesh,
    )
    rows = shapes[0]["w1"].shape[0]
    x = eqshard.abstract(jax.ShapeDtypeStruct((8, rows), jnp.float32), P("dp"), mesh)
    report = eqshard.analyze_step(step, x, eqshard.abstract(shapes, rules, mesh))
    plan = eqshard.plan_training(shapes[0], rules, mesh, optimizer=OPTIMIZER)
    return report, plan


def test_analyze_step_on_cpu_counts_host_bytes_by_memory_kind(mesh):
    report, plan = _analyzed(mesh, HOST_RULES)
    memory = report.memory
    assert memory.platform == "cpu"
    assert memory.host_argument_bytes == plan.host_bytes_per_device[0] > 0
    assert memory.host_output_bytes == plan.host_bytes_per_device[0]
    (note,) = [w for w in report.warnings if w.message.startswith("eqshard:")]
    assert "XLA:CPU reports no host memory" in note.message
    assert "state/1/0/mu/w1" in note.paths
    assert eqshard.StepReport.from_json(report.to_json()) == report


@pytest.mark.slow
def test_analyze_step_on_a_tpu_target_agrees_with_the_plan():
    mesh = eqshard.create_mesh((2, 4), ("dp", "tp"), target="v5e:2x4")

    def make(key):  # every shard a whole number of TPU tiles: no padding
        k1, k2 = jax.random.split(key)
        w1, w2 = jax.random.normal(k1, (256, 1024)), jax.random.normal(k2, (1024, 256))
        params = {"w1": w1, "w2": w2, "b": jnp.zeros((256,))}
        return params, OPTIMIZER.init(params)

    rules = [("w1", P(None, "tp")), ("w2", P("tp", None)), (".*", P())]
    host_rules = [("(mu|nu)/w", eqshard.host()), *rules]
    report, plan = _analyzed(mesh, host_rules, make)
    device, _ = _analyzed(mesh, rules, make)
    assert report.memory.platform == "tpu"
    # XLA's own figures: the host arguments are the plan's host bytes, exactly,
    # and the device arguments drop by them.
    host = plan.host_bytes_per_device[0]
    assert report.memory.host_argument_bytes == host > 0
    assert device.memory.argument_bytes - report.memory.argument_bytes == host
    assert not any(w.message.startswith("eqshard:") for w in report.warnings)


def test_no_host_memory_names_the_backend():
    # The compile-only GPU devices report no memory kinds.
    gpu = eqshard.create_mesh((8,), ("dp",), target="h100")
    with pytest.raises(ValueError, match="'x' asks for host memory.*'gpu' backend"):
        eqshard.named_shardings({"x": eqshard.host(P("dp"))}, gpu)
    step = eqshard.filter_jit(lambda x: x, in_specs=eqshard.host(P("dp")), mesh=gpu)
    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    with pytest.raises(ValueError, match="in_specs.*'gpu' backend"):
        step.lower(x)
