import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from fakes import host_mesh
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import eqshard
from eqshard import AxisNames


# ---------------------------------------------------------------------------------
# Fixtures and helpers.


@pytest.fixture(scope="module")
def mesh42():
    """(4, 2) over ('data', 'model'), the axes of t5x's standard rules."""
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def partitioner(mesh42):
    return eqshard.t5x.Partitioner(mesh=mesh42)


# Device arrangements: the process that owns each position of the mesh.
ROWS = ([[0, 0], [1, 1], [2, 2], [3, 3]], ("data", "model"))  # process p: row p
HALF_ROWS = ([[0, 0, 1, 1], [2, 2, 3, 3]], ("data", "model"))
COLUMNS = ([[0, 1], [0, 1], [2, 3], [2, 3]], ("data", "model"))
SLICES = ([[[0, 0], [1, 1]], [[2, 2], [3, 3]]], ("replica", "data", "model"))


def _jax_local_slice(owners, names, shape, spec, process):
    """The part of an array of `shape` that `process` holds, and the processes
    holding the same part, worked out by JAX on a real mesh of the same
    arrangement: the union of the index slices of the process's devices."""
    owners = np.asarray(owners)
    real = Mesh(np.array(jax.devices()).reshape(owners.shape), names)
    indices = NamedSharding(real, spec).devices_indices_map(shape)

    def bounds(p):
        parts = [indices[real.devices[pos]] for pos in zip(*np.nonzero(owners == p))]
        out = []
        for dim, size in enumerate(shape):
            ranges = {part[dim].indices(size)[:2] for part in parts}
            start = min(r[0] for r in ranges)
            stop = max(r[1] for r in ranges)
            assert sum(b - a for a, b in ranges) == stop - start  # one slice
            out.append((start, stop))
        return tuple(out)

    mine = bounds(process)
    sharing = [p for p in sorted(set(owners.flat)) if bounds(p) == mine]
    return mine, sharing


def _bounds(info, shape):
    return tuple(s.indices(size)[:2] for s, size in zip(info.slice, shape))


def _arrays(tree):
    return jtu.tree_leaves(eqx.filter(tree, eqx.is_array))


# ---------------------------------------------------------------------------------
# A partitioned training step matches the unsharded one.


class Mlp(eqx.Module):
    w1: jax.Array
    b1: jax.Array
    w2: jax.Array
    activation: Callable
    name: str = eqx.field(static=True)


def _mlp(key):
    k1, k2 = jax.random.split(key)
    return Mlp(
        w1=jax.random.normal(k1, (8, 16)) / 4,
        b1=jnp.zeros(16),
        w2=jax.random.normal(k2, (16, 8)) / 4,
        activation=jax.nn.gelu,
        name="mlp",
    )


# An Mlp with axis names, or None, where its fields' values are (not their types).
MLP_AXES = Mlp(
    w1=AxisNames("embed", "mlp"),  # pyright: ignore[reportArgumentType]
    b1=AxisNames("mlp"),  # pyright: ignore[reportArgumentType]
    w2=AxisNames("mlp", "embed"),  # pyright: ignore[reportArgumentType]
    activation=None,  # pyright: ignore[reportArgumentType]
    name="mlp",
)


def _loss(model, x, y):
    h = model.activation(x @ model.w1 + model.b1)
    return jnp.mean((h @ model.w2 - y) ** 2)


@pytest.mark.slow
def test_training_step_matches_unsharded(partitioner, mesh42):
    seen = {}

    def step(model, x, y):
        seen["rules"] = eqshard.get_logical_axis_rules()
        seen["mesh"] = eqshard.current_mesh()
        x = eqshard.with_sharding_constraint(
            x, eqshard.logical_to_mesh_axes(("batch", "embed"))
        )
        loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
        new = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))
        return new, loss, grads

    batch = AxisNames("batch", "embed")
    partitioned = partitioner.partition(
        step,
        in_specs=(MLP_AXES, batch, batch),
        out_specs=(MLP_AXES, P(), MLP_AXES),
    )
    model = _mlp(jax.random.key(0))
    x = np.asarray(jax.random.normal(jax.random.key(1), (8, 8)))
    y = np.asarray(jax.random.normal(jax.random.key(2), (8, 8)))

    new, loss, grads = partitioned(model, x, y)

    expected_loss, expected_grads = jax.value_and_grad(
        lambda arrays: _loss(eqx.combine(arrays, model), x, y)
    )(eqx.filter(model, eqx.is_array))
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for got, want in zip(_arrays(grads), _arrays(expected_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for got, old, g in zip(_arrays(new), _arrays(model), _arrays(expected_grads)):
        np.testing.assert_allclose(got, old - 0.1 * g, rtol=1e-5, atol=1e-6)
    # Non-array leaves come back; arrays are laid out as the logical names say.
    assert type(new) is Mlp and new.activation is jax.nn.gelu and new.name == "mlp"
    assert new.w1.sharding == NamedSharding(mesh42, P(None, "model"))
    assert grads.w2.sharding == NamedSharding(mesh42, P("model", None))
    assert loss.sharding.is_fully_replicated
    # The function was traced under the partitioner's rules and mesh.
    assert seen["rules"] == partitioner.axis_rules
    assert seen["mesh"] == mesh42.abstract_mesh
    assert eqshard.get_logical_axis_rules() == ()


# ---------------------------------------------------------------------------------
# Calling: arrays, modules, static values, donation, outputs.


def test_array_arguments_take_partition_time_shardings(partitioner, mesh42):
    traces = []

    def matmul(x, w):
        traces.append(1)
        return x @ w

    partitioned = partitioner.partition(
        matmul, [AxisNames("batch", None), P(None, "model")], P("data", "model")
    )
    assert partitioned.in_shardings == (
        NamedSharding(mesh42, P("data", None)),
        NamedSharding(mesh42, P(None, "model")),
    )
    x = jnp.arange(32.0).reshape(8, 4)
    w = jnp.arange(24.0).reshape(4, 6)
    out = [partitioned(x, w) for _ in range(3)][-1]
    assert out.sharding == NamedSharding(mesh42, P("data", "model"))
    np.testing.assert_allclose(out, np.asarray(x) @ np.asarray(w))
    assert len(traces) == 1


def test_one_spec_for_all_arguments_and_none_outputs(partitioner, mesh42):
    partitioned = partitioner.partition(lambda a, b: (a + b, a), P("data"), None)
    a = jnp.ones((8, 2))
    total, first = partitioned(a, 2 * a)
    np.testing.assert_array_equal(total, np.full((8, 2), 3.0))
    assert first.sharding.is_equivalent_to(NamedSharding(mesh42, P("data")), 2)


def test_transformations_of_a_partitioned_function(partitioner):
    f = partitioner.partition(lambda x: jnp.sin(x).sum(), P("data"), P())
    x = jnp.arange(8.0)
    np.testing.assert_allclose(jax.grad(f)(x), np.cos(np.arange(8.0)), rtol=1e-6)
    np.testing.assert_allclose(
        jax.jit(lambda x: 2 * f(x))(x), 2 * np.sin(np.arange(8.0)).sum(), rtol=1e-6
    )


def test_static_argnums(partitioner):
    traces = []

    def scale(x, n, y):
        traces.append(n)
        return x * n + y

    partitioned = partitioner.partition(
        scale, (P("data"), P("data")), P("data"), static_argnums=1
    )
    x = jnp.ones(8)
    np.testing.assert_array_equal(partitioned(x, 2, x), np.full(8, 3.0))
    np.testing.assert_array_equal(partitioned(x, 3, x), np.full(8, 4.0))
    np.testing.assert_array_equal(partitioned(x, 2, x), np.full(8, 3.0))
    assert traces == [2, 3]
    compiled = partitioned.compile(x, 2, x)
    np.testing.assert_array_equal(compiled(x, 2, x), np.full(8, 3.0))
    with pytest.raises(TypeError, match="Compile again"):
        compiled(x, 3, x)
    # Static arguments also work beside pytree arguments.
    tree_fn = partitioner.partition(
        lambda t, n: t["a"] * n, ({"a": P("data")},), P("data"), static_argnums=(1,)
    )
    np.testing.assert_array_equal(tree_fn({"a": x}, 5), np.full(8, 5.0))


@pytest.mark.parametrize("tree_argument", [False, True])
@pytest.mark.parametrize("wrap", [lambda v: v, lambda v: (v,)])
def test_static_values_equal_but_of_other_types_compile_again(
    partitioner, tree_argument, wrap
):
    # True == 1 == 1.0, but the traced programs differ (bool, int32, float32).
    def fill(x, s):
        x = x[0] if tree_argument else x
        return jnp.full(x.shape, jtu.tree_leaves(s)[0])

    f = partitioner.partition(fill, P(), P(), static_argnums=1)
    x = (jnp.ones(8),) if tree_argument else jnp.ones(8)
    for value, dtype in [(True, jnp.bool_), (1, jnp.int32), (1.0, jnp.float32)]:
        assert f(x, wrap(value)).dtype == dtype
        assert f.compile(x, wrap(value))(x, wrap(value)).dtype == dtype
    with pytest.raises(TypeError, match="Compile again"):
        f.compile(x, wrap(1))(x, wrap(True))


def test_python_scalars_and_callables_are_static(partitioner):
    traces = []

    def apply(tree, x):
        traces.append(tree["scale"])
        return tree["f"](x) * tree["scale"]

    partitioned = partitioner.partition(apply, (None, P("data")), P("data"))
    x = jnp.arange(8.0)
    np.testing.assert_allclose(
        partitioned({"f": jnp.sin, "scale": 2.0}, x), 2 * np.sin(x), rtol=1e-6
    )
    np.testing.assert_allclose(
        partitioned({"f": jnp.sin, "scale": 2.0}, x), 2 * np.sin(x), rtol=1e-6
    )
    np.testing.assert_allclose(
        partitioned({"f": jnp.cos, "scale": 3.0}, x), 3 * np.cos(x), rtol=1e-6
    )
    assert traces == [2.0, 3.0]


def test_outputs_keep_non_array_leaves(partitioner):
    def f(x):
        return {"y": x + 1, "tag": "done", "fn": jnp.tanh, "n": 3, "none": None}

    out = partitioner.partition(
        f, P("data"), {"y": P("data")} | dict.fromkeys(("tag", "fn", "n", "none"))
    )(jnp.zeros(8))
    assert out["tag"] == "done" and out["fn"] is jnp.tanh and out["n"] == 3
    assert out["none"] is None
    np.testing.assert_array_equal(out["y"], np.ones(8))


def test_donate_argnums_deletes_the_input(partitioner, mesh42):
    partitioned = partitioner.partition(
        lambda x, y: x + y, P("data"), P("data"), donate_argnums=0
    )
    # Arrays already in place are donated (others are copied in, as in jax.jit).
    x, y = jax.device_put([jnp.ones(8), jnp.ones(8)], NamedSharding(mesh42, P("data")))
    out = partitioned(x, y)
    assert x.is_deleted() and not y.is_deleted()
    np.testing.assert_array_equal(out, np.full(8, 2.0))


def test_donate_argnums_for_a_module(partitioner, mesh42):
    def step(model, x):
        arrays, static = eqx.partition(model, eqx.is_array)
        return eqx.combine(jax.tree.map(lambda w: w * 2, arrays), static), x.sum()

    specs = eqshard.logical_to_mesh_specs(MLP_AXES, partitioner.axis_rules)
    model = partitioner.move_to_devices(_mlp(jax.random.key(0)), specs)
    before = [np.asarray(a) for a in _arrays(model)]
    partitioned = partitioner.partition(
        step, (MLP_AXES, P("data")), (MLP_AXES, P()), donate_argnums=(0,)
    )
    x = jnp.ones(8)
    new, total = partitioned(model, x)
    assert all(a.is_deleted() for a in _arrays(model))
    assert not x.is_deleted()
    for got, old in zip(_arrays(new), before):
        np.testing.assert_array_equal(got, 2 * old)
    assert float(total) == 8.0


# One array at two places of a call whose donation covers one of them: XLA would
# use the buffer after giving it away (it crashed the process). The check runs
# before the call, so `x` is still there afterwards.
@pytest.mark.parametrize(
    "fn, donate, args, paths",
    [
        (lambda a, b: (a + b, a - b), (0, 1), lambda x: (x, x), ("'0'", "'1'")),
        (lambda a, b: a + b, 0, lambda x: (x, x), ("'0'", "'1'")),
        (
            lambda t: (t[0] + t[1], t[0] - t[1]),
            0,
            lambda x: ((x, x),),
            ("'0/0'", "'0/1'"),
        ),
        (lambda t, u: t["w"] + u, 0, lambda x: ({"w": x, "n": 1}, x), ("'0/w'", "'1'")),
    ],
)
def test_donating_an_array_that_stands_at_two_places_is_refused(
    partitioner, mesh42, fn, donate, args, paths
):
    partitioned = partitioner.partition(fn, P("data"), P("data"), donate_argnums=donate)
    x = jax.device_put(jnp.ones(8), NamedSharding(mesh42, P("data")))
    for call in (partitioned, partitioned.compile(*args(jnp.ones(8)))):
        with pytest.raises(ValueError, match=rf"both {paths[0]} and {paths[1]}"):
            call(*args(x))
    assert not x.is_deleted()
    # A copy at one of them is fine.
    two = args(x)
    copy = lambda a: jnp.copy(a) if isinstance(a, jax.Array) else a  # noqa: E731
    copied = (*jtu.tree_map(copy, two[:1]), *two[1:])
    expected = fn(*args(np.ones(8, np.float32)))
    jtu.tree_map(np.testing.assert_array_equal, partitioned(*copied), expected)


def test_lower_and_compile(partitioner, mesh42):
    def f(model, x):
        return model.activation(x @ model.w1)

    partitioned = partitioner.partition(f, (MLP_AXES, AxisNames("batch", None)), P())
    model = _mlp(jax.random.key(0))
    x = jnp.ones((8, 8))
    lowered = partitioned.lower(model, x)
    assert isinstance(lowered.lowered, jax.stages.Lowered)
    assert "sharding" in lowered.as_text()
    assert "module @jit_f " in lowered.as_text()  # named after the function
    # Compiling the lowered function gives one that takes the function's own
    # arguments and returns its own outputs (not the internal flat signature).
    expected = jax.nn.gelu(np.asarray(x) @ np.asarray(model.w1))
    np.testing.assert_allclose(lowered.compile()(model, x), expected, rtol=1e-5)
    compiled = partitioned.compile(model, x)
    assert compiled.memory_analysis() is not None
    assert compiled.cost_analysis()["flops"] > 0
    assert "dot" in compiled.as_text()
    np.testing.assert_allclose(compiled(model, x), partitioned(model, x), rtol=1e-6)
    np.testing.assert_allclose(
        compiled(model, x), jax.nn.gelu(np.asarray(x) @ np.asarray(model.w1)), rtol=1e-5
    )
    assert isinstance(compiled.compiled, jax.stages.Compiled)
    other = eqx.tree_at(lambda m: m.activation, model, jnp.tanh)
    with pytest.raises(TypeError, match="Compile again"):
        compiled(other, x)

    # Array arguments, and abstract arguments for planning.
    def product(a, b):
        return a @ b

    matmul = partitioner.partition(product, P("data"), P("data"))
    spec = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    text = matmul.lower(spec, jax.ShapeDtypeStruct((4, 4), jnp.float32)).as_text()
    assert "dot" in text
    assert "module @jit_product " in text
    compiled = matmul.compile(jnp.ones((8, 4)), jnp.ones((4, 4)))
    np.testing.assert_array_equal(compiled(jnp.ones((8, 4)), jnp.ones((4, 4))), 4.0)


@pytest.mark.parametrize("tree_argument", [False, True])
def test_compiled_function_given_other_shapes_names_the_paths(
    partitioner, tree_argument
):
    wrap = (lambda a: {"w": a}) if tree_argument else (lambda a: a)
    f = partitioner.partition(lambda a, b: a, P("data"), P("data"))
    compiled = f.compile(wrap(jnp.ones(8)), jnp.ones(8, jnp.int32))
    path = "0/w" if tree_argument else "0"
    with pytest.raises(TypeError, match="compiled for") as info:
        compiled(wrap(jnp.ones(16)), jnp.ones(8))
    message = str(info.value)
    assert message.startswith("eqshard.t5x.PartitionedFn.compile:")
    assert f"'{path}': compiled for float32[8], given float32[16]" in message
    assert "'1': compiled for int32[8], given float32[8]" in message


# ---------------------------------------------------------------------------------
# Errors when partitioning and calling.


def test_partitioner_submesh_off_tpu():
    # Off TPU the hardware mesh is (processes, local devices): a (1, 2) tile puts
    # two local devices in each model replica.
    partitioner = eqshard.t5x.Partitioner(model_parallel_submesh=(1, 2))
    assert dict(partitioner.mesh.shape) == {"data": 4, "model": 2}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "exactly one of .* got none"),
        ({"num_partitions": 2, "mesh": "MESH"}, "got num_partitions and mesh"),
        ({"mesh": "MESH", "backend": "cpu"}, "backend only shape the default mesh"),
        ({"model_parallel_submesh": (1, 1, 2)}, r"\(1, 1, 2\) must have 2 .* 'cpu'"),
        ({"num_partitions": 0}, "at least 1, got 0"),
        ({"num_partitions": 1, "ici_mesh_shape": (1, 8, 1)}, "only one was given"),
        (
            {"mesh": "MESH", "axis_rules": [("batch", "dp")]},
            r"'batch' .* 'dp', but the mesh \{'data': 4, 'model': 2\} has no axis 'dp'",
        ),
    ],
)
def test_partitioner_configuration_errors(mesh42, kwargs, match):
    kwargs = {k: mesh42 if v == "MESH" else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        eqshard.t5x.Partitioner(**kwargs)


def test_partition_spec_errors(partitioner):
    with pytest.raises(
        TypeError, match=r"has 'batch' at '1/w/0'.*AxisNames\('batch'\).*plain tuple"
    ):
        partitioner.partition(lambda a, b: a, (P(), {"w": ("batch", "embed")}), None)
    with pytest.raises(ValueError, match=r"'0' is P\('dp',\).* 'dp'"):
        partitioner.partition(lambda a: a, (P("dp"),), None)
    with pytest.raises(ValueError, match=r"\[1\] are both static and donated"):
        partitioner.partition(
            lambda a, b: a, P(), None, static_argnums=1, donate_argnums=(0, 1)
        )
    with pytest.raises(ValueError, match=r"`static_argnums` must be non-negative"):
        partitioner.partition(lambda a: a, P(), None, static_argnums=-1)
    with pytest.raises(ValueError, match=r"`donate_argnums` must be non-negative"):
        partitioner.partition(lambda a: a, P(), None, donate_argnums=True)
    with pytest.raises(ValueError, match=r"`donate_argnums` repeats a position"):
        partitioner.partition(lambda a: a, P(), None, donate_argnums=(0, 0))


def test_call_errors_name_the_path(partitioner, mesh42):
    f = partitioner.partition(lambda t: t["w"].sum(), ({"w": P("data")},), None)
    with pytest.raises(
        ValueError, match=r"at '0': `in_specs` has a dict .* where `tree` has an array"
    ):
        f(jnp.ones(8))
    one_arg = partitioner.partition(lambda t: t["w"], {"w": P("data")}, None)
    with pytest.raises(ValueError, match=r"has a dict .*wrap .* in a 1-tuple"):
        one_arg({"w": jnp.ones(8)})
    with pytest.raises(ValueError, match=r"'0/w' \(shape \(6,\)\).*'data' \(size 4\)"):
        f({"w": np.ones(6)})
    placed = jax.device_put(jnp.ones(8), NamedSharding(mesh42, P("model")))
    with pytest.raises(ValueError, match=r"'0/w' is already placed"):
        f({"w": placed})
    g = partitioner.partition(lambda x: {"out": x[:6]}, P("data"), {"out": P("data")})
    with pytest.raises(
        ValueError, match=r"at '<root>': `out_specs` has a tuple.*output"
    ):
        partitioner.partition(lambda x: x, P(), (P(), P()))(jnp.ones(8))
    with pytest.raises(ValueError, match=r"(?s)out_specs.*'out' \(shape \(6,\)\)"):
        g(jnp.ones(8))
    h = partitioner.partition(lambda t, x: x, (None, P()), P())
    with pytest.raises(TypeError, match=r"'0/1' is \{1, 2\} \(a set\).*nor hashable"):
        h((jnp.ones(2), {1, 2}), jnp.ones(2))
    with pytest.raises(TypeError, match="needs at least 2"):
        partitioner.partition(lambda a, n: a, P(), None, static_argnums=1)(jnp.ones(2))


# ---------------------------------------------------------------------------------
# Data layout and local chunks on one process with 8 devices.


def test_data_layout_single_process(partitioner):
    assert partitioner.data_partition_spec == P("data")
    assert partitioner.data_mesh_size == 4
    assert partitioner.data_shards == 1
    assert partitioner.data_shard_id == 0
    assert partitioner.data_layout() == eqshard.t5x.DataLayout(4, 0, 1, True)
    assert partitioner.data_layout(64) == eqshard.t5x.DataLayout(64, 0, 1, True)
    with pytest.raises(
        ValueError, match=r"batch size 6 .* data mesh size .*, 4\. .*e\.g\. 8"
    ):
        partitioner.data_layout(6)
    with pytest.raises(ValueError, match="process 1 has no devices"):
        partitioner.data_layout(8, process_index=1)
    with pytest.raises(ValueError, match=r"data_layout: `batch_size` must be positive"):
        partitioner.data_layout(0)
    info = partitioner.local_chunk_info((8, 6), AxisNames("batch", "mlp"))
    assert info == eqshard.t5x.LocalChunkInfo((slice(0, 8), slice(0, 6)), 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.replica_id = 1


def test_default_mesh_on_cpu_is_processes_by_devices():
    # t5x's CPU quirk: num_partitions is ignored, the mesh is (1 process, 8 devices).
    partitioner = eqshard.t5x.Partitioner(num_partitions=2)
    assert dict(partitioner.mesh.shape) == {"data": 1, "model": 8}
    assert partitioner.data_mesh_size == 1
    assert partitioner.data_layout(3) == eqshard.t5x.DataLayout(3, 0, 1, True)


def test_multi_slice_mesh_splits_batch_over_replica_and_data():
    partitioner = eqshard.t5x.Partitioner(
        num_partitions=1, ici_mesh_shape=(2, 2, 2), dcn_mesh_shape=(1, 1, 1)
    )
    assert partitioner.mesh.axis_names == ("replica", "data", "model")
    assert ("batch", ("replica", "data")) in partitioner.axis_rules
    assert partitioner.data_partition_spec == P(("replica", "data"))
    assert partitioner.data_mesh_size == 4


def test_no_data_axes(mesh42):
    partitioner = eqshard.t5x.Partitioner(mesh=mesh42, axis_rules=[("mlp", "model")])
    assert partitioner.data_partition_spec == P(None)
    assert partitioner.data_mesh_size == 1
    assert partitioner.data_layout(5) == eqshard.t5x.DataLayout(5, 0, 1, True)
    assert partitioner.data_layout(5, process_index=3) == eqshard.t5x.DataLayout(
        5, 0, 1, False
    )


def test_move_to_devices(partitioner, mesh42):
    specs = {"mlp": MLP_AXES, "step": None, "x": P("data")}
    host = {"mlp": jax.device_get(_mlp(jax.random.key(0))), "step": 3, "x": np.ones(8)}
    host["mlp"] = eqx.tree_at(lambda m: m.b1, host["mlp"], jnp.arange(16.0))
    out = partitioner.move_to_devices(host, specs)
    assert out["step"] == 3 and out["mlp"].activation is jax.nn.gelu
    assert out["mlp"].w1.sharding == NamedSharding(mesh42, P(None, "model"))
    assert out["mlp"].b1.sharding == NamedSharding(mesh42, P("model"))
    assert out["x"].sharding == NamedSharding(mesh42, P("data"))
    for got, want in zip(_arrays(out), _arrays(host)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"'x' \(shape \(6,\)\)"):
        partitioner.move_to_devices({"x": np.ones(6)}, {"x": P("data")})


# ---------------------------------------------------------------------------------
# Local chunks and data layout on fake multi-process meshes.


@pytest.mark.parametrize("process", range(4))
def test_chunker_rows(process):
    # 4 processes x 2 devices; process p holds row p of data=4, model=2.
    mesh = host_mesh(*ROWS)
    chunker = eqshard.t5x.LocalChunker(mesh, process_index=process)
    assert dict(chunker.num_chunks) == {"data": 4, "model": 1}
    assert dict(chunker.chunk_ids) == {"data": process, "model": 0}
    assert chunker.get_shard_id("data") == process
    assert chunker.get_replica_id("data") == 0
    info = chunker.get_local_chunk_info((8, 6), ("data", "model"))
    assert info == eqshard.t5x.LocalChunkInfo(
        (slice(2 * process, 2 * process + 2), slice(0, 6)), 0
    )
    partitioner = eqshard.t5x.Partitioner(mesh=mesh)
    assert partitioner.data_layout(8, process_index=process) == eqshard.t5x.DataLayout(
        8, process, 4, True
    )


@pytest.mark.parametrize("process", range(4))
def test_chunker_half_rows(process):
    # 4 processes x 2 devices on data=2, model=4: process p holds half of row p // 2.
    mesh = host_mesh(*HALF_ROWS)
    chunker = eqshard.t5x.LocalChunker(mesh, process_index=process)
    assert dict(chunker.num_chunks) == {"data": 2, "model": 2}
    assert dict(chunker.chunk_ids) == {"data": process // 2, "model": process % 2}
    partitioner = eqshard.t5x.Partitioner(mesh=mesh)
    assert partitioner.data_layout(8, process_index=process) == eqshard.t5x.DataLayout(
        8, process // 2, 2, process % 2 == 0
    )
    info = partitioner.local_chunk_info((8, 8), P("data"), process_index=process)
    assert info == eqshard.t5x.LocalChunkInfo(
        (slice(4 * (process // 2), 4 * (process // 2) + 4), slice(None)), process % 2
    )


def test_chunker_slices_replicas_and_data_axes():
    # ('replica', 'data', 'model') = (2, 2, 2); process 2r + d holds the model pair.
    mesh = host_mesh(*SLICES)
    rules = [("batch", ("replica", "data"))]
    for process in range(4):
        partitioner = eqshard.t5x.Partitioner(mesh=mesh, axis_rules=rules)
        assert partitioner.data_partition_spec == P(("replica", "data"))
        assert partitioner.data_mesh_size == 4
        layout = partitioner.data_layout(process_index=process)
        assert layout == eqshard.t5x.DataLayout(4, process, 4, True)
        chunker = eqshard.t5x.LocalChunker(mesh, process_index=process)
        assert (
            chunker.get_shard_id(("data", "replica"))
            == 2 * (process % 2) + process // 2
        )
        assert chunker.get_replica_id({"model"}) == process


CASES = [
    (ROWS, (8, 6), P("data", "model")),
    (ROWS, (8, 6), P(None, "model")),
    (HALF_ROWS, (8, 8), P("data", "model")),
    (HALF_ROWS, (8, 8), P("model")),
    (HALF_ROWS, (16,), P(("data", "model"))),
    (COLUMNS, (8, 6), P("data", "model")),
    (COLUMNS, (16,), P(("model", "data"))),
    (COLUMNS, (4, 16), P(None, ("model", "data"))),
    (SLICES, (8, 4), P(("replica", "data"), "model")),
    (SLICES, (8, 4), P("data")),
]


@pytest.mark.parametrize("arrangement, shape, spec", CASES)
def test_local_chunks_match_jax(arrangement, shape, spec):
    owners, names = arrangement
    mesh = host_mesh(owners, names)
    for process in range(4):
        info = eqshard.t5x.LocalChunker(
            mesh, process_index=process
        ).get_local_chunk_info(shape, spec)
        bounds, sharing = _jax_local_slice(owners, names, shape, spec, process)
        assert _bounds(info, shape) == bounds
        assert info.replica_id == sharing.index(process)


def test_local_chunks_by_hand_for_tuples_of_axes():
    # COLUMNS: process p holds column m = p % 2 of rows 2k, 2k + 1 (k = p // 2).
    # Over ('model', 'data') a (16,) array has 8 pieces of 2; device (d, m) holds
    # piece 4m + d, so process p holds elements 8m + 4k to 8m + 4k + 4.
    mesh = host_mesh(*COLUMNS)
    for p in range(4):
        m, k = p % 2, p // 2
        info = eqshard.t5x.LocalChunker(mesh, process_index=p).get_local_chunk_info(
            (16,), (("model", "data"),)
        )
        assert info == eqshard.t5x.LocalChunkInfo(
            (slice(8 * m + 4 * k, 8 * m + 4 * k + 4),), 0
        )
    chunker = eqshard.t5x.LocalChunker(mesh, process_index=1)
    with pytest.raises(
        ValueError, match=r"not one contiguous slice.*\('model', 'data'\)"
    ):
        chunker.get_local_chunk_info((16,), (("data", "model"),))
    # Each process holds a 2x2 block of a 4x4 mesh: part of both axes, so neither
    # order makes one slice, and the message must not suggest one.
    blocks = host_mesh(
        [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]], ("data", "model")
    )
    chunker = eqshard.t5x.LocalChunker(blocks, process_index=0)
    for axes in (("data", "model"), ("model", "data")):
        with pytest.raises(ValueError, match=r"No order of the axes does") as error:
            chunker.get_local_chunk_info((16,), (axes,))
        assert "Order the axes as" not in str(error.value)


def test_chunker_errors():
    mesh = host_mesh(*ROWS)
    chunker = eqshard.t5x.LocalChunker(mesh, process_index=1)
    with pytest.raises(
        ValueError, match=r"'tp' is not an axis of the mesh \{'data': 4"
    ):
        chunker.get_shard_id("tp")
    with pytest.raises(TypeError, match="order is undefined"):
        chunker.get_shard_id({"data", "model"})
    with pytest.raises(ValueError, match=r"dimension 0 \(size 6\).*'data' \(size 4\)"):
        chunker.get_local_chunk_info((6,), ("data",))
    with pytest.raises(ValueError, match="2 entries but the array has rank 1"):
        chunker.get_local_chunk_info((8,), ("data", None))
    with pytest.raises(ValueError, match="shards more than one dimension"):
        chunker.get_local_chunk_info((8, 8), ("data", "data"))
    with pytest.raises(TypeError, match=r"entry 0 of `mesh_axes` is 3 \(a int\)"):
        chunker.get_local_chunk_info((8,), (3,))
    with pytest.raises(TypeError, match=r"mesh axes must be strings, got 3"):
        chunker.get_local_chunk_info((8,), (("data", 3),))
    with pytest.raises(ValueError, match=r"process 7 has no devices.*\[0, 1, 2, 3\]"):
        eqshard.t5x.LocalChunker(mesh, process_index=7)
    scattered = host_mesh([[0, 1], [1, 0]], ("data", "model"))
    with pytest.raises(ValueError, match="do not form a block"):
        eqshard.t5x.LocalChunker(scattered, process_index=0)
    uneven = host_mesh([[0, 0, 0, 1, 1, 2]], ("data", "model"))
    with pytest.raises(ValueError, match="does not tile that axis"):
        eqshard.t5x.LocalChunker(uneven, process_index=1)


def test_real_mesh_default_process(mesh42):
    chunker = eqshard.t5x.LocalChunker(mesh42)
    assert chunker.process_index == 0
    assert dict(chunker.num_chunks) == {"data": 1, "model": 1}
    assert chunker.get_local_chunk_info((8, 4), P("data", "model")) == (
        eqshard.t5x.LocalChunkInfo((slice(0, 8), slice(0, 4)), 0)
    )


# ---------------------------------------------------------------------------------
# Two real processes of 4 devices each.


def _child_two_processes():
    from jax.experimental import multihost_utils

    # On CPU the default mesh is processes x local devices: ('data', 'model').
    partitioner = eqshard.t5x.Partitioner(num_partitions=1)
    mesh = partitioner.mesh
    spec = P("data", "model")
    full = np.arange(64.0).reshape(8, 8)
    x = jax.make_array_from_callback(
        full.shape, NamedSharding(mesh, spec), lambda index: full[index]
    )
    held = [s.index for s in x.addressable_shards]
    bounds = tuple(
        (min(i[d].indices(8)[0] for i in held), max(i[d].indices(8)[1] for i in held))
        for d in range(2)
    )
    info = partitioner.local_chunk_info((8, 8), spec)
    mlp = partitioner.move_to_devices(
        _mlp(jax.random.key(0)),
        eqshard.logical_to_mesh_specs(MLP_AXES, partitioner.axis_rules),
    )
    step = partitioner.partition(
        lambda model, x: (model.activation(x @ model.w1).sum(), x.sum()),
        (MLP_AXES, spec),
        (P(), P()),
    )
    loss, total = step(mlp, x)
    return {
        "mesh": dict(mesh.shape),
        "process": jax.process_index(),
        "layout": partitioner.data_layout(8),
        "shard_id": partitioner.data_shard_id,
        "data_shards": partitioner.data_shards,
        "chunk": _bounds(info, (8, 8)),
        "jax_chunk": bounds,
        "replica_id": info.replica_id,
        "loss": float(loss.addressable_data(0)),
        "total": float(total.addressable_data(0)),
        "all_ids": multihost_utils.process_allgather(
            np.array(partitioner.data_shard_id)
        ),
    }


def test_two_processes():
    from multihost import run_processes

    results = run_processes(
        _child_two_processes, num_processes=2, devices_per_process=4
    )
    model = _mlp(jax.random.key(0))
    x = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    expected_loss = float(jax.nn.gelu(x @ np.asarray(model.w1)).sum())
    for p, result in enumerate(results):
        assert result["mesh"] == {"data": 2, "model": 4}
        assert result["process"] == p
        assert result["layout"] == eqshard.t5x.DataLayout(8, p, 2, True)
        assert (result["shard_id"], result["data_shards"]) == (p, 2)
        assert result["chunk"] == result["jax_chunk"] == ((4 * p, 4 * p + 4), (0, 8))
        assert result["replica_id"] == 0
        np.testing.assert_allclose(result["loss"], expected_loss, rtol=1e-4)
        assert result["total"] == float(x.sum())
        np.testing.assert_array_equal(result["all_ids"], [0, 1])


def test_partitioner_without_rules_on_a_mesh_of_other_axis_names():
    # No 'data'/'model' axes and no rules: PartitionSpecs work; rules are asked for
    # only when a logical name must be resolved, or the data axes are needed.
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    partitioner = eqshard.t5x.Partitioner(mesh=mesh)
    f = partitioner.partition(lambda x: x * 2, P("dp"), P("tp"))
    out = f(jnp.ones(8))
    np.testing.assert_array_equal(out, np.full(8, 2.0))
    assert out.sharding == NamedSharding(mesh, P("tp"))
    moved = partitioner.move_to_devices({"w": jnp.ones(8)}, P("tp"))
    assert moved["w"].sharding == NamedSharding(mesh, P("tp"))
    asks = r"^eqshard.t5x.Partitioner: the default rules .* no axis 'data'. Pass `axis_"
    for needs_rules in (
        lambda: partitioner.partition(lambda x: x, AxisNames("batch"), P()),
        lambda: partitioner.move_to_devices(jnp.ones(8), {"w": AxisNames("embed")}),
        lambda: partitioner.local_chunk_info((8,), AxisNames("batch")),
        lambda: partitioner.data_partition_spec,
        lambda: partitioner.data_layout(8),
    ):
        with pytest.raises(ValueError, match=asks):
            needs_rules()


def test_numpy_integers_where_ints_are_expected(partitioner):
    made = eqshard.t5x.Partitioner(num_partitions=np.int64(2)).mesh
    assert made.shape == eqshard.t5x.Partitioner(num_partitions=2).mesh.shape
    assert partitioner.data_layout(np.int64(8)).batch_size == 8
    info = partitioner.local_chunk_info((np.int64(8),), P("data"))
    assert info.slice == (slice(0, 8),)  # one process holds every row
    f = partitioner.partition(lambda x, n: x * n, P(), P(), static_argnums=np.int64(1))
    np.testing.assert_array_equal(f(jnp.ones(4), 3), np.full(4, 3.0))
