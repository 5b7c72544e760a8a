"""A running job's whole state moved to another layout or set of devices:
`shard(..., donate=True, max_inflight_bytes=n)` on placed trees, and
`shard_plan`, which says what will move before anything does."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqshard


OPTIMIZER = optax.adamw(1e-2)
TWO_AXES = [("weight", P("tp", "dp")), ("bias", P("tp")), ("key", P("dp")), (".*", P())]
ONE_AXIS = [("weight", P("dp")), ("key", P("dp")), (".*", P())]


def _mesh(shape, names, devices=None):
    devices = jax.devices() if devices is None else devices
    return jax.make_mesh(
        shape, names, devices=devices, axis_types=(AxisType.Auto,) * len(shape)
    )


def _state():
    """A model, its AdamW state (moments that are not zero, so that a moved leaf
    is not equal by chance) and a stack of typed PRNG keys, as host data: made
    from their shapes, compiling nothing."""
    rng = np.random.default_rng(0)

    def fill(x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x  # the activation functions
        if jnp.issubdtype(x.dtype, jnp.floating):
            return rng.standard_normal(x.shape).astype(x.dtype)
        return np.full(x.shape, 3, x.dtype)

    model = eqx.filter_eval_shape(eqx.nn.MLP, 12, 8, 32, 2, key=jax.random.key(0))
    model = jax.tree.map(fill, model)
    opt = jax.eval_shape(OPTIMIZER.init, eqx.filter(model, eqx.is_inexact_array))
    opt = jax.tree.map(fill, opt)
    keys = eqshard.HostKey(np.arange(16, dtype=np.uint32).reshape(8, 2), "threefry2x32")
    return {"model": model, "opt": opt, "key": keys}


def _rules(mesh):
    return TWO_AXES if len(mesh.axis_names) == 2 else ONE_AXIS


def _specs(tree, mesh):
    return eqshard.match_partition_rules(_rules(mesh), tree)


def _host_copy(tree):
    """Every array's bytes, by path: keys by their data."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        if isinstance(x, jax.Array | np.ndarray):
            out[eqshard.tree_path_to_string(path, sep="/")] = np.asarray(x).tobytes()
    return out


def _step(state):
    """One AdamW step of the model on a fixed batch: its loss and new weights."""
    x = jnp.linspace(-1, 1, 4 * 12).reshape(4, 12)

    @eqx.filter_jit
    def step(model, opt):
        def loss(m):
            return jnp.mean(jax.vmap(m)(x) ** 2)

        value, grads = eqx.filter_value_and_grad(loss)(model)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt = OPTIMIZER.update(grads, opt, params)
        return value, eqx.apply_updates(model, updates)

    return step(state["model"], state["opt"])


@pytest.mark.slow  # two steps compiled: about 6 s
def test_a_train_state_goes_round_the_meshes_bit_for_bit():
    meshes = [
        _mesh((2, 4), ("dp", "tp")),
        _mesh((4, 2), ("dp", "tp")),
        _mesh((8,), ("dp",), jax.devices()[::-1]),
        _mesh((2, 2), ("dp", "tp"), jax.devices()[2:6]),  # a subset
        _mesh((2, 4), ("dp", "tp")),  # back, onto a superset of the subset
    ]
    state = eqshard.shard(_state(), _specs(_state(), meshes[0]), meshes[0])
    want = _host_copy(state)
    loss, model = _step(state)
    assert state["key"].dtype == jax.random.key(0).dtype  # a typed key again
    for mesh in meshes[1:]:
        specs = _specs(state, mesh)
        state = eqshard.shard(state, specs, mesh, donate=True)
        eqshard.check_layout(state, specs, mesh)
        assert _host_copy(state) == want, mesh
        if mesh.size == 4:  # the step works on the subset
            sub_loss, sub_model = _step(state)
            np.testing.assert_allclose(sub_loss, loss, rtol=1e-5)
            np.testing.assert_allclose(
                sub_model.layers[0].weight, model.layers[0].weight, rtol=1e-5
            )
            assert sub_model.layers[0].weight.sharding.mesh == mesh
    new_loss, new_model = _step(state)  # back where it started: the same step
    assert np.asarray(new_loss).tobytes() == np.asarray(loss).tobytes()
    assert _host_copy(new_model) == _host_copy(model)


def _buffers(tree):
    """Every single-device array of the tree's arrays (of keys' data)."""
    out = []
    for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out += [shard.data for shard in x.addressable_shards]
    return out


def test_donate_frees_every_old_buffer_not_shared_with_the_new_state():
    before, after = _mesh((2, 4), ("dp", "tp")), _mesh((4, 2), ("dp", "tp"))
    state = eqshard.shard(_state(), _specs(_state(), before), before)
    # The leaf that stays where it is (a scalar count, replicated on the same
    # devices) keeps its buffers; the others are copied and freed.
    old = _buffers(state)
    want = _host_copy(state)
    largest = max(b.nbytes for b in old)
    moved = eqshard.shard(
        state, _specs(state, after), after, donate=True, max_inflight_bytes=largest
    )
    assert _host_copy(moved) == want
    new = {b.unsafe_buffer_pointer() for b in _buffers(moved)}
    kept = [b for b in old if not b.is_deleted()]
    assert all(b.unsafe_buffer_pointer() in new for b in kept)
    assert len(kept) < len(old) // 4
    assert state["model"].layers[0].weight.is_deleted()


def test_host_memory_leaves_move_as_they_are():
    before, after = _mesh((2, 4), ("dp", "tp")), _mesh((8,), ("dp",))
    tree = {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}
    placed = eqshard.shard(tree, {"w": eqshard.host(P("dp", "tp"))}, before)
    moved = eqshard.shard(placed, {"w": eqshard.host(P("dp"))}, after, donate=True)
    assert moved["w"].sharding == NamedSharding(
        after, P("dp"), memory_kind="pinned_host"
    )
    np.testing.assert_array_equal(np.asarray(moved["w"]), tree["w"])


def _untouched(state, want):
    return _host_copy(state) == want and not any(
        b.is_deleted() for b in _buffers(state)
    )


@pytest.mark.parametrize(
    "change, match",
    [
        ({"rules": [("weight", P("sp")), (".*", P())]}, r"model/layers/0/weight.*'sp'"),
        ({"rules": [("bias", P("dp", None)), (".*", P())]}, r"model/layers/0/bias"),
        (
            {"rules": [("layers/0/weight", P(None, ("dp", "tp"))), (".*", P())]},
            r"layers/0/weight.*divisible",
        ),
        (
            {"max_inflight_bytes": 100},
            r"max_inflight_bytes=100.*'model/layers/0/weight'",
        ),
    ],
)
def test_bad_input_raises_before_anything_moves(change, match):
    before, after = _mesh((2, 4), ("dp", "tp")), _mesh((4, 2), ("dp", "tp"))
    state = eqshard.shard(_state(), _specs(_state(), before), before)
    want = _host_copy(state)
    rules = change.get("rules", TWO_AXES)
    bound = change.get("max_inflight_bytes")
    with pytest.raises(ValueError, match=match):
        eqshard.shard(
            state,
            eqshard.match_partition_rules(rules, state),
            after,
            donate=True,
            max_inflight_bytes=bound,
        )
    assert _untouched(state, want)


def test_a_deleted_array_is_named_before_anything_moves():
    mesh = _mesh((2, 4), ("dp", "tp"))
    state = eqshard.shard(_state(), _specs(_state(), mesh), mesh)
    state["opt"][0].mu.layers[1].weight.delete()
    target = _mesh((8,), ("dp",))
    with pytest.raises(ValueError, match=r"opt/0/mu/layers/1/weight.*deleted"):
        eqshard.shard(state, _specs(state, target), target, donate=True)
    assert not state["model"].layers[0].weight.is_deleted()


def _spread(count=4):
    """`count` float32 arrays of (8, 64) on a (2, 4) mesh: 256 bytes a device each."""
    mesh = _mesh((2, 4), ("dp", "tp"))
    tree = [np.full((8, 64), i, np.float32) for i in range(count)]
    return eqshard.shard(tree, P("dp", "tp"), mesh)


def _live_bytes():
    """The bytes of the live buffers on each device (a buffer that several live
    arrays stand on, such as a placed array and its shards, counted once)."""
    buffers = {}
    for x in jax.live_arrays():
        if x.is_deleted():
            continue
        for shard in x.addressable_shards:
            key = (shard.device, shard.data.unsafe_buffer_pointer())
            buffers[key] = shard.data.nbytes
    out = {}
    for (device, _), n in buffers.items():
        out[device] = out.get(device, 0) + n
    return out


@pytest.mark.parametrize("bound, peak", [(256, 1024 + 256), (512, 1024 + 512)])
def test_the_peak_is_the_state_plus_the_bound(monkeypatch, bound, peak):
    tree = _spread()
    target = _mesh((8,), ("dp",))
    plan = eqshard.shard_plan(
        tree, P("dp"), target, donate=True, max_inflight_bytes=bound
    )
    # Each device holds 4 blocks of 256 bytes; a batch adds `bound` on top.
    assert plan.peak_bytes_per_device == (peak,) * 8
    assert plan.batches == 1024 // bound
    assert plan.bytes_per_device == (4 * 64 * 4,) * 8  # a (1, 64) block of each
    before = _live_bytes()
    grown = []
    real = eqshard._move._shard.release

    def measured(*args):  # the worst moment: a batch placed, none of it freed
        now = _live_bytes()
        grown.append(max(now[d] - before[d] for d in now))
        return real(*args)

    monkeypatch.setattr(eqshard._move._shard, "release", measured)
    moved = eqshard.shard(tree, P("dp"), target, donate=True, max_inflight_bytes=bound)
    assert len(grown) == 1024 // bound and max(grown) == bound
    assert [np.asarray(x)[0, 0] for x in moved] == [0, 1, 2, 3]
    keeping = eqshard.shard_plan(moved, P(), target)  # not donating: all at once
    assert keeping.peak_bytes == 1024 + 4 * 8 * 64 * 4  # replicated: whole copies


def test_the_plan_moves_nothing_and_says_what_would():
    mesh, other = _mesh((2, 4), ("dp", "tp")), _mesh((4, 2), ("dp", "tp"))
    state = eqshard.shard(_state(), _specs(_state(), mesh), mesh)
    before = _buffers(state)
    same = eqshard.shard_plan(state, _specs(state, mesh), mesh, donate=True)
    assert not same.moves and same.bytes_per_device == (0,) * 8
    assert "nothing moves" in str(same)
    plan = eqshard.shard_plan(state, _specs(state, other), other)
    routes = {row.path: row.route for row in plan.rows}
    assert routes["opt/0/count"] == "none"  # replicated on the same devices
    assert routes["opt/0/mu/layers/1/weight"] == "device to device"
    assert routes["key"] == "device to device"
    # What each device receives, from the shapes: the (4, 2) mesh's blocks.
    floats = [(32, 12), (32,), (32, 32), (32,), (8, 32), (8,)]
    divisors = {2: 2 * 4, 1: 2}  # P('tp', 'dp'): tp=2, dp=4; P('tp'): tp=2
    per_device = 3 * sum(4 * np.prod(s) // divisors[len(s)] for s in floats)
    per_device += 8 * 8 // 4  # the keys: P('dp') of 8 keys of 8 bytes, dp=4
    assert plan.bytes_per_device == (per_device,) * 8
    table = str(plan)
    assert "model/layers/1/weight (+ mu, nu)" in table and "device to device" in table
    assert all(a is b and not a.is_deleted() for a, b in zip(before, _buffers(state)))
    with pytest.raises(ValueError, match=r"model/layers/0/weight.*'sp'"):
        eqshard.shard_plan(state, P("sp"), other)


def test_going_on_after_a_loss_from_the_live_state():
    mesh, survivors = _mesh((2, 4), ("dp", "tp")), jax.devices()[:4]
    rules = [("weight", P("tp")), (".*", P())]  # one whole copy on each dp row
    state = eqshard.shard(
        _state(), eqshard.match_partition_rules(rules, _state()), mesh
    )
    want = _host_copy(state)
    remaining = _mesh((4,), ("tp",), survivors)
    specs = eqshard.match_partition_rules(rules, state)
    assert eqshard.shard_plan(state, specs, remaining).from_live
    for buffer in _buffers(state):  # the devices of the second row are lost
        if buffer.devices() <= set(jax.devices()[4:]):
            buffer.delete()
    state = eqshard.shard(state, specs, remaining, donate=True)
    eqshard.check_layout(state, specs, remaining)
    assert _host_copy(state) == want
    # Split over 'dp', half of each array was only on the lost devices.
    split = eqshard.shard(_state(), _specs(_state(), mesh), mesh)
    plan = eqshard.shard_plan(split, specs, remaining)
    assert not plan.from_live and "model/layers/0/weight" in plan.outside
    assert "opt/0/count" not in plan.outside and "checkpoint" in str(plan)
