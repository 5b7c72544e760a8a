import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from probes import Compiles, RUN_TIMEOUT

import eqshard


class Net(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    cache: eqx.nn.StateIndex  # a new marker object at every build

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(8, 16, key=k1)
        self.down = eqx.nn.Linear(16, 4, key=k2)
        self.cache = eqx.nn.StateIndex(jnp.zeros((4, 8)))

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


RULES = [("up/weight", P("tp")), ("down/weight", P(None, "tp")), (".*", P())]
OPTIMIZER = optax.adamw(1e-2)


def make(key):
    model = Net(key)
    return model, OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))


def train_step(batch, state):
    model, opt_state = state
    x, y = batch

    def loss_fn(model):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return (eqx.apply_updates(model, updates), opt_state), loss


BATCH = (
    np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8),
    np.linspace(0, 1, 32, dtype=np.float32).reshape(8, 4),
)


def test_a_step_keeps_its_layout_donates_and_compiles_once(mesh):
    state = eqshard.init_sharded(make, jax.random.key(0), specs=RULES, mesh=mesh)
    specs = eqshard.match_partition_rules(RULES, state)
    step = eqshard.filter_jit(
        train_step,
        in_specs=(P("dp"), RULES),
        out_specs=(1, P()),
        donate="all-except-first",
        mesh=mesh,
    )
    # The unsharded step on the same values, for the losses.
    reference = jax.tree.map(jnp.asarray, eqshard.gather(state))
    before = jax.tree.leaves(state)
    with Compiles() as compiles:
        losses = []
        for _ in range(3):
            state, loss = step(BATCH, state)
            losses.append(loss)
    assert compiles.count == 1
    assert all(x.is_deleted() for x in before if isinstance(x, jax.Array))
    eqshard.check_layout(state, specs, mesh)
    assert losses[-1].sharding == NamedSharding(mesh, P())
    plain = eqx.filter_jit(train_step)
    expected = []
    for _ in range(3):
        reference, loss = plain(BATCH, reference)
        expected.append(float(loss))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    # analyze_step reads the one jit call: shardings and donations.
    report = eqshard.analyze_step(step, BATCH, state)
    rows = {row.path: row for row in report.arguments}
    assert rows["state/0/up/weight"].spec == "P('tp',)"
    assert rows["state/0/up/weight"].donated and not rows["batch/0"].donated
    assert [m.path for m in report.moved] == ["batch/0", "batch/1"]
    outputs = {row.path: row for row in report.outputs}
    assert outputs["out/0/0/down/weight"].spec == "P(None, 'tp')"


def test_specs_from_another_build_of_a_model_with_state_index(tmp_path):
    # Each build of `Net` makes a new StateIndex marker, so the spec trees of an
    # abstract build differ from the model's in static metadata only: they fit by
    # structure and path, as inputs and as outputs (jax.jit's `out_shardings`
    # alone refuses them: "different pytree metadata").
    mesh = eqshard.create_mesh((2, 4), ("dp", "tp"))
    other = eqshard.match_partition_rules(
        RULES, eqx.filter_eval_shape(make, jax.random.key(1))
    )
    state = eqshard.init_sharded(make, jax.random.key(0), specs=other, mesh=mesh)
    step = eqshard.filter_jit(
        train_step, in_specs=(P("dp"), other), out_specs=(other, P()), mesh=mesh
    )
    state, _ = step(BATCH, state)
    eqshard.check_layout(state, other, mesh)
    partitioner = eqshard.t5x.Partitioner(mesh=mesh)
    same = partitioner.partition(train_step, (P("dp"), other), (other, P()))
    state, _ = same(BATCH, state)
    eqshard.check_layout(state, other, mesh)
    placed = eqshard.shard(eqx.filter_jit(make)(jax.random.key(1)), other, mesh)
    eqshard.check_layout(placed, other, mesh)
    moved = eqshard.restrict_specs(other, mesh, like=placed)
    assert moved[0].up.weight == P("tp")
    plan = eqshard.plan_training(placed[0], other[0], mesh, optimizer=OPTIMIZER)
    assert plan.params.total_parameters == 8 * 16 + 16 + 16 * 4 + 4 + 4 * 8
    eqshard.save(tmp_path / "c", placed)
    like = eqx.filter_eval_shape(make, jax.random.key(2))  # a third build
    back = eqshard.restore(tmp_path / "c", like, other, mesh)
    eqshard.check_layout(back, other, mesh)


def test_inputs_as_placed_decorator_and_quiet_donation(mesh):
    model = eqshard.init_sharded(Net, jax.random.key(0), specs=RULES, mesh=mesh)

    @eqshard.filter_jit(out_specs=0, donate="all")
    def scale(model, factor):  # an array of the output that no input fits
        return jax.tree.map(lambda x: x * factor, model)

    out = scale(model, jnp.float32(2.0))
    eqshard.check_layout(out, eqshard.match_partition_rules(RULES, out), mesh)
    assert out.up.weight.sharding.spec == P("tp")
    assert repr(scale) == "filter_jit(scale)"


def test_filter_jit_errors_name_what_and_where(mesh):
    model = eqshard.init_sharded(Net, jax.random.key(0), specs=RULES, mesh=mesh)
    x = np.ones((8, 8), np.float32)

    def apply(model, x):
        return jax.vmap(model)(x)

    with pytest.raises(ValueError, match=r"filter_jit: `in_specs` has 3 entries.* 2"):
        eqshard.filter_jit(apply, in_specs=(None, P("dp"), P()), mesh=mesh)(model, x)
    # A bare spec tree, or a list of entries, was 'has a dict where `tree` has a
    # tuple of length 1': the arguments' tuple, which the caller never wrote.
    specs = eqshard.match_partition_rules(RULES, model)
    for bare, kind in [(specs, "Net"), ({"x": P()}, "dict"), ([None, P()], "list")]:
        with pytest.raises(ValueError, match=rf"`in_specs` is a {kind}, .*\(specs,\)"):
            eqshard.filter_jit(lambda t: t, in_specs=bare, mesh=mesh)(model)
    with pytest.raises(
        ValueError, match=r"`out_specs` has 2 at '<root>'.*2 positional"
    ):
        eqshard.filter_jit(apply, out_specs=2)(model, x)
    with pytest.raises(TypeError, match=r"keyword arguments 'x'; pass them"):
        eqshard.filter_jit(apply)(model, x=x)
    with pytest.raises(ValueError, match=r"'1' \(shape \(8, 6\)\).*size 8"):
        eqshard.filter_jit(apply, in_specs=(None, P(None, ("dp", "tp"))), mesh=mesh)(
            model, np.ones((8, 6), np.float32)
        )
    with pytest.raises(ValueError, match=r"`in_specs` has P\('dp',\) at '1'.*no mesh"):
        eqshard.filter_jit(apply, in_specs=(None, P("dp")))(
            jax.tree.map(np.asarray, eqshard.gather(model)), x
        )
    with pytest.raises(ValueError, match=r"given one array at both '0' and '1'"):
        eqshard.filter_jit(lambda a, b: a + b, donate="all")(x := jnp.ones(3), x)
    with pytest.raises(ValueError, match=r"filter_jit: `donate` is 'first'; use"):
        # Wrong on purpose:
        eqshard.filter_jit(apply, donate="first")  # pyright: ignore[reportArgumentType]


def _copy(x):
    return x * 1


def test_specs_are_resolved_again_for_other_shapes_placements_and_meshes(mesh):
    # Regression (issue 33, item 4): specs were resolved once per tree structure,
    # from the first call's arguments.
    def shard_by_evenness(args):  # a callable `in_specs`: reads the shape
        return (P("dp") if args[0].shape[0] % 2 == 0 else P(),)

    by_shape = eqshard.filter_jit(
        _copy, in_specs=shard_by_evenness, out_specs=0, mesh=mesh
    )
    assert by_shape(np.ones((4, 3), np.float32)).sharding.spec == P("dp")
    odd = np.arange(9, dtype=np.float32).reshape(3, 3)
    out = by_shape(odd)
    assert out.sharding == NamedSharding(mesh, P())
    np.testing.assert_array_equal(np.asarray(out), odd)
    # An integer `out_specs`: the layout of this call's argument.
    as_placed = eqshard.filter_jit(_copy, out_specs=0)
    for spec in (P("dp"), P(None, "tp"), P()):
        x = jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, spec))
        assert as_placed(x).sharding == NamedSharding(mesh, spec)
    # `auto_fsdp` picks the dimension of each shape (a transposed weight).
    fsdp = eqshard.filter_jit(
        _copy,
        in_specs=([(".*", eqshard.auto_fsdp("dp", min_size=1))],),
        out_specs=0,
        mesh=mesh,
    )
    assert fsdp(np.ones((8, 3), np.float32)).sharding.spec == P("dp")
    assert fsdp(np.ones((3, 8), np.float32)).sharding.spec == P(None, "dp")
    # A mesh of the same axes over the devices in another order: set, or the
    # one the arguments are on.
    devices = np.array(jax.devices()[::-1]).reshape(2, 4)
    reverse = jax.sharding.Mesh(devices, ("dp", "tp"), axis_types=mesh.axis_types)
    by_set_mesh = eqshard.filter_jit(_copy, in_specs=P("dp"), out_specs=P("dp"))
    by_placement = eqshard.filter_jit(_copy, in_specs=P("dp"), out_specs=P("dp"))
    for m in (mesh, reverse):
        with jax.set_mesh(m):
            out = by_set_mesh(odd[:2])
        assert out.sharding == NamedSharding(m, P("dp"))
        np.testing.assert_array_equal(np.asarray(out), odd[:2])
        x = jax.device_put(odd[:2], NamedSharding(m, P("dp")))
        assert by_placement(x).sharding == NamedSharding(m, P("dp"))


def test_specs_that_read_static_leaves_are_resolved_per_value(mesh):
    # Rules for the output read its shapes, which a static argument may change.
    zeros = eqshard.filter_jit(
        lambda x, n: x.sum() + jnp.zeros((n, 10 - n)),
        out_specs=[(".*", eqshard.auto_fsdp("dp", min_size=1))],
        mesh=mesh,
    )
    x = np.ones(3, np.float32)
    assert zeros(x, 8).sharding == NamedSharding(mesh, P("dp"))  # (8, 2)
    assert zeros(x, 2).sharding == NamedSharding(mesh, P(None, "dp"))  # (2, 8)


_DONATION_CRASHES = """
import jax, numpy as np
jax.config.update("jax_num_cpu_devices", 8)
from jax.sharding import NamedSharding, PartitionSpec as P
import eqshard
mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
a = jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, P("dp")))
b = jax.make_array_from_single_device_arrays(  # another array over a's buffers
    a.shape, a.sharding, [s.data for s in a.addressable_shards]
)
both = eqshard.filter_jit(lambda x, y: (x + 1, y + 2), donate="all")
try:
    both(a, b)
except ValueError as e:
    print("SHARED:", e)
step = eqshard.filter_jit(lambda x: x + 1, donate="all")
step(a)
try:
    step(a)
except ValueError as e:
    print("DONATED:", e)
print("SURVIVED")
"""


def test_donating_a_donated_array_or_one_buffer_twice_is_refused():
    # Regression (issue 33, item 9): XLA crashes the process on both calls, so
    # they run in a child process.
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).parents[1]
    result = subprocess.run(
        [sys.executable, "-c", _DONATION_CRASHES],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=RUN_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[-1] == "SURVIVED"
    (shared,) = [line for line in lines if line.startswith("SHARED:")]
    assert "arrays at '0' and '1' that share their buffers" in shared
    assert "donate='all'" in shared and "jnp.copy" in shared
    (donated,) = [line for line in lines if line.startswith("DONATED:")]
    assert "eqshard.filter_jit: the arrays at '0' have been deleted" in donated


def test_filter_jit_refuses_abstract_arguments_meshes_and_unknown_axes(mesh):
    x = np.ones((8, 4), np.float32)
    with pytest.raises(TypeError, match=r"ShapeDtypeStruct` arguments at '1'.*lower"):
        eqshard.filter_jit(jnp.add)(x, jax.ShapeDtypeStruct((8, 4), jnp.float32))
    lowered = eqshard.filter_jit(jnp.add, mesh=mesh).lower(
        x, jax.ShapeDtypeStruct((8, 4), jnp.float32)
    )
    assert "add" in lowered.as_text()
    abstract = eqshard.filter_jit(_copy, in_specs=P("dp"), mesh=mesh.abstract_mesh)
    with pytest.raises(TypeError, match=r"`mesh` is an `AbstractMesh`.*concrete"):
        abstract(x)
    with pytest.raises(TypeError, match=r"`mesh` is an `AbstractMesh`.*concrete"):
        abstract.lower(x)
    with jax.set_mesh(mesh):  # inside another jit, the abstract mesh is enough
        np.testing.assert_array_equal(jax.jit(lambda y: abstract(y) + 1)(x), x + 1)
    with pytest.raises(ValueError, match=r"`in_specs` at '1/b' is P\('zz',\).*'dp'"):
        eqshard.filter_jit(lambda *a: a, in_specs=(P(), {"b": P("zz")}), mesh=mesh)(
            x, {"b": x}
        )
    with pytest.raises(ValueError, match=r"`out_specs` at '1' is P\('zz',\).*'tp'"):
        eqshard.filter_jit(lambda y: (y, y), out_specs=(P(), P("zz")), mesh=mesh)(x)
    gone = jnp.ones(3)
    gone.delete()
    with pytest.raises(ValueError, match=r"arrays at '1' have been deleted"):
        eqshard.filter_jit(jnp.add)(jnp.ones(3), gone)


def test_the_functions_own_error_is_not_replaced(mesh):
    # An error the function raises while traced is its own, whatever its text;
    # only JAX's errors before tracing become eqshard's messages.
    def fn(x):
        raise ValueError("the step's own mistake")

    x = jax.device_put(np.zeros((8, 4)), NamedSharding(mesh, P()))  # placed otherwise
    step = eqshard.filter_jit(fn, in_specs=P("dp"), mesh=mesh)
    with pytest.raises(ValueError, match="^the step's own mistake"):
        step(x)


class _Scaled(eqx.Module):
    scale: float | int = eqx.field(static=True)
    w: jax.Array


@pytest.mark.parametrize("route", ["field", "argument"])
def test_static_values_are_told_apart_by_type_and_sign(route):
    # Values equal under `==` that trace to other programs: `1` then `1.0` (an
    # int32 then a float32 program), `0.0` then `-0.0` (the sign), as raw JAX
    # traces them.
    if route == "field":
        f = eqshard.filter_jit(lambda m: m.w * m.scale)
        sign = eqshard.filter_jit(lambda m: m.w * jnp.copysign(1.0, m.scale))

        def call(fn, w, s):
            return fn(_Scaled(s, w))
    else:
        f = eqshard.filter_jit(lambda w, s: w * s)
        sign = eqshard.filter_jit(lambda w, s: w * jnp.copysign(1.0, s))

        def call(fn, w, s):
            return fn(w, s)

    ints = jnp.arange(3, dtype=jnp.int32)
    for s in (1, 1.0, 1):
        want = jax.jit(lambda w: w * s)(ints)
        got = call(f, ints, s)
        assert got.dtype == want.dtype and np.array_equal(got, want), s
    ones = jnp.ones(2)
    for s in (0.0, -0.0, 0.0):
        assert np.asarray(call(sign, ones, s)).tolist() == [np.copysign(1.0, s)] * 2
    if route == "field":  # (a NaN field: JAX's structures compare unequal)
        return
    # A NaN argument is itself: the same program, not a compile per call.
    call(f, ints, float("nan"))
    with Compiles() as compiles:
        call(f, ints, float("nan"))
    assert compiles.count == 0


class _Nested(eqx.Module):
    config: tuple = eqx.field(static=True)
    w: jax.Array


def test_static_values_among_others_are_told_apart_by_type_and_sign():
    # The keys read types in bulk where they can: a float or a tuple among other
    # non-array leaves (functions, strings), or inside a tuple of a static field,
    # must still pick its own program, as raw JAX traces it.
    ints = jnp.arange(3, dtype=jnp.int32)
    step = eqshard.filter_jit(lambda w, config: config[0](w * config[2]))
    for s in (1, 1.0, True, 1):
        want = jax.jit(lambda w: jnp.negative(w * s))(ints)
        got = step(ints, (jnp.negative, "name", s))
        assert got.dtype == want.dtype and np.array_equal(got, want), s
    ones = jnp.ones(2)
    sign = eqshard.filter_jit(lambda w, config: w * jnp.copysign(1.0, config[1][0]))
    for s in (0.0, -0.0, 0.0):
        got = sign(ones, (jnp.negative, (s,)))
        assert np.asarray(got).tolist() == [np.copysign(1.0, s)] * 2
    field = eqshard.filter_jit(lambda m: m.w * m.config[1][0])
    for s in (1, 1.0, True):
        want = jax.jit(lambda w: w * s)(ints)
        got = field(_Nested(("name", (s,)), ints))
        assert got.dtype == want.dtype and np.array_equal(got, want), s
    flat = eqshard.filter_jit(lambda m: jnp.asarray(m.scale))
    for s in (1, True, 1):
        assert flat(_Scaled(s, ints)).dtype == jnp.asarray(s).dtype, s
