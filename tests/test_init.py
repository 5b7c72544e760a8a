import collections
import importlib.util
import math
import pathlib
import sys
from collections.abc import Callable

import beartype
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import jaxtyping
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from models import Block, CASES
from probes import Compiles

import eqshard
from eqshard._build._init import sharded_init
from eqshard._build._init_pieces import Plan


class Model(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    embed: eqx.nn.Embedding
    act: Callable
    scale: float
    name: str = eqx.field(static=True)

    def __init__(self, dim: int, vocab: int, *, key: jax.Array):
        kl, ke = jax.random.split(key)
        self.linear = eqx.nn.Linear(dim, 2 * dim, key=kl)
        self.norm = eqx.nn.LayerNorm(2 * dim)
        self.embed = eqx.nn.Embedding(vocab, dim, key=ke)
        self.act = jax.nn.gelu
        self.scale = 0.5
        self.name = "tiny"


RULES = [
    ("linear/weight", P("tp", "dp")),
    ("linear/bias", P("tp")),
    ("embed/weight", P(None, "tp")),
    (".*", P()),
]


def _spec_tree(model):
    """The spec tree of `RULES`, written out by hand."""
    specs = jtu.tree_map(lambda _: P(), model)
    return eqx.tree_at(
        lambda m: (m.linear.weight, m.linear.bias, m.embed.weight),
        specs,
        (P("tp", "dp"), P("tp"), P(None, "tp")),
    )


def _bits(x):
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


@pytest.mark.parametrize("form", ["tree", "rules", "callable"])
def test_equals_eager_then_shard(mesh, form):
    key = jax.random.key(3)
    eager = Model(8, 32, key=key)
    expected = eqshard.shard(eager, _spec_tree(eager), mesh)
    specs = {"tree": _spec_tree(eager), "rules": RULES, "callable": _spec_tree}[form]
    model = eqshard.init_sharded(Model, 8, 32, key=key, specs=specs, mesh=mesh)
    assert jtu.tree_structure(model) == jtu.tree_structure(eager)
    assert model.name == "tiny" and model.scale == 0.5 and model.act is jax.nn.gelu
    leaves = jtu.tree_leaves(model)
    assert len(leaves) == len(jtu.tree_leaves(eager))
    arrays = 0
    for got, want in zip(leaves, jtu.tree_leaves(expected), strict=True):
        if isinstance(want, jax.Array):
            arrays += 1
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(_bits(got), _bits(want))
            assert got.sharding == want.sharding
        else:
            assert got is want or got == want
    assert arrays == 5
    assert model.linear.weight.sharding == NamedSharding(mesh, P("tp", "dp"))
    assert model.embed.weight.sharding == NamedSharding(mesh, P(None, "tp"))
    assert model.norm.weight.sharding == NamedSharding(mesh, P())


def test_threefry_partitionable_is_the_default():
    # init_sharded's memory claim relies on it (see the next test).
    assert jax.threefry_partitionable.value is True


def _shard_bytes(leaf):
    shape = leaf.sharding.shard_shape(leaf.shape)
    return math.prod(shape) * leaf.dtype.itemsize


@pytest.mark.parametrize("partitionable", [True, False])
def test_no_device_holds_a_whole_sharded_array(mesh, partitionable):
    dim = 256
    with jax.threefry_partitionable(partitionable):
        parts = sharded_init(
            eqx.nn.Linear,
            (dim, dim),
            {"key": jax.random.key(0)},
            specs=[("weight", P("tp", "dp")), ("bias", P("tp"))],
            mesh=mesh,
        )
        stats = parts.jitted.lower(*parts.inputs).compile().memory_analysis()
    leaves = [
        x for x in jtu.tree_leaves(parts.shapes) if isinstance(x, jax.ShapeDtypeStruct)
    ]
    whole = 4 * dim * dim
    # Each device's outputs are its shards (weight 64 x 128 on 8 devices, bias
    # 64), plus the program's table of 8-byte output pointers.
    shards = 4 * (dim * dim // 8 + dim // 4)
    assert sum(map(_shard_bytes, leaves)) == shards
    assert stats.output_size_in_bytes == shards + 8 * len(leaves)
    if partitionable:
        # Temporaries are a few shards; a budget of 0.6 of the model, which the
        # whole model exceeds, holds a device's outputs and temporaries.
        budget = 0.6 * (whole + 4 * dim)
        assert stats.output_size_in_bytes + stats.temp_size_in_bytes < budget
        assert stats.temp_size_in_bytes < whole / 2
    else:
        # Without partitionable threefry, every device generates the whole array.
        assert stats.temp_size_in_bytes >= whole


def test_bad_spec_names_the_path(mesh):
    key = jax.random.key(0)
    bad = [("linear/weight", P("tp", "nope")), (".*", P())]
    with pytest.raises(
        ValueError, match=r"(?s)eqshard.init_sharded: .*'linear/weight'"
    ):
        eqshard.init_sharded(Model, 8, 32, key=key, specs=bad, mesh=mesh)
    # 8 x 3 does not divide over 'tp' (4).
    with pytest.raises(ValueError, match=r"(?s)eqshard.init_sharded: .*'embed/weight'"):
        eqshard.init_sharded(
            Model,
            8,
            3,
            key=key,
            specs=[("embed/weight", P("tp")), (".*", P())],
            mesh=mesh,
        )
    with pytest.raises(TypeError, match=r"(?s)eqshard.init_sharded: .*'norm.*weight'"):
        eqshard.init_sharded(
            Model,
            8,
            32,
            key=key,
            specs=lambda m: eqx.tree_at(lambda t: t.norm.weight, _spec_tree(m), "tp"),
            mesh=mesh,
        )


def test_mesh_from_set_mesh(mesh):
    with jax.set_mesh(mesh):
        linear = eqshard.init_sharded(
            eqx.nn.Linear, 4, 8, key=jax.random.key(0), specs=P("tp")
        )
    assert linear.weight.sharding == NamedSharding(mesh, P("tp"))
    with pytest.raises(ValueError, match="eqshard.init_sharded: no mesh"):
        eqshard.init_sharded(eqx.nn.Linear, 4, 8, key=jax.random.key(0), specs=P("tp"))


def test_building_again_compiles_nothing(mesh):
    key = jax.random.key(0)
    eqshard.init_sharded(Model, 8, 16, key=key, specs=RULES, mesh=mesh)
    with Compiles() as compiles:
        again = eqshard.init_sharded(
            Model, 8, 16, key=jax.random.key(1), specs=RULES, mesh=mesh
        )
    assert compiles.count == 0
    eager = Model(8, 16, key=jax.random.key(1))
    expected = eqshard.shard(eager, _spec_tree(eager), mesh)
    for a, b in zip(jtu.tree_leaves(again), jtu.tree_leaves(expected), strict=True):
        if eqx.is_array(a):
            np.testing.assert_array_equal(_bits(a), _bits(b))
            assert a.sharding == b.sharding
    # Other sizes, specs or argument types are other programs, never a stale one.
    wider = eqshard.init_sharded(Model, 16, 16, key=key, specs=RULES, mesh=mesh)
    assert wider.linear.weight.shape == (32, 16)
    replicated = eqshard.init_sharded(Model, 8, 16, key=key, specs=P(), mesh=mesh)
    assert replicated.linear.weight.sharding == NamedSharding(mesh, P())
    as_float = eqshard.init_sharded(
        eqx.nn.Linear, 8, 16, use_bias=1.0, key=key, specs=P(), mesh=mesh
    )
    as_bool = eqshard.init_sharded(
        eqx.nn.Linear, 8, 16, use_bias=True, key=key, specs=P(), mesh=mesh
    )
    assert as_float.use_bias == 1.0 and type(as_float.use_bias) is float
    assert as_bool.use_bias is True


def _filled(key, value):
    return {"w": jax.random.normal(key, (8,)) * 0 + value}


def test_a_closure_captured_value_is_not_kept(mesh):
    # The kept program is keyed on what was traced, not on `fn`'s identity.
    scale = 1.0

    def build(key):
        return _filled(key, scale)

    first = eqshard.init_sharded(build, jax.random.key(0), specs=P("tp"), mesh=mesh)
    scale = 5.0
    second = eqshard.init_sharded(build, jax.random.key(0), specs=P("tp"), mesh=mesh)
    np.testing.assert_array_equal(first["w"], np.full(8, 1.0, np.float32))
    np.testing.assert_array_equal(second["w"], np.full(8, 5.0, np.float32))
    assert second["w"].sharding == NamedSharding(mesh, P("tp"))


class _Config:
    def __init__(self, width):
        self.width = width


def test_a_mutated_config_object_is_not_kept(mesh):
    config = _Config(8)

    def build(config, *, key):
        return {"w": jax.random.normal(key, (4,)) * 0 + config.width}

    key = jax.random.key(0)
    first = eqshard.init_sharded(build, config, key=key, specs=P(), mesh=mesh)
    config.width = 9
    second = eqshard.init_sharded(build, config, key=key, specs=P(), mesh=mesh)
    np.testing.assert_array_equal(first["w"], np.full(4, 8.0, np.float32))
    np.testing.assert_array_equal(second["w"], np.full(4, 9.0, np.float32))


@pytest.mark.parametrize("kind", ["numpy", "jax"])
def test_arrays_captured_by_an_inner_program_are_read_again(mesh, kind):
    # Constants of a nested jaxpr (here an inner `jax.jit`) are part of the key.
    table = np.arange(8.0, dtype=np.float32)
    if kind == "jax":
        table = jnp.asarray(table)

    def build(key):
        noise = jax.random.normal(key, (8,)) * 0
        return {"inner": jax.jit(lambda x: x + table)(noise)}

    key = jax.random.key(0)
    first = eqshard.init_sharded(build, key, specs=P("tp"), mesh=mesh)
    if kind == "numpy":
        table *= 2
    else:
        table = table * 2
    second = eqshard.init_sharded(build, key, specs=P("tp"), mesh=mesh)
    np.testing.assert_array_equal(first["inner"], np.arange(8.0))
    np.testing.assert_array_equal(second["inner"], 2 * np.arange(8.0))


def test_a_captured_top_level_array_is_an_input_not_a_new_program(mesh):
    table = np.arange(8.0, dtype=np.float32)

    def build(key):
        return {"w": jax.random.normal(key, (8,)) * 0 + table}

    eqshard.init_sharded(build, jax.random.key(0), specs=P(), mesh=mesh)
    table[:] = 7.0
    with Compiles() as compiles:
        again = eqshard.init_sharded(build, jax.random.key(1), specs=P(), mesh=mesh)
    assert compiles.count == 0
    np.testing.assert_array_equal(again["w"], np.full(8, 7.0, np.float32))


def test_clear_caches_forgets_init_programs(mesh):
    def build(key):
        return _filled(key, 3.0)

    eqshard.init_sharded(build, jax.random.key(0), specs=P(), mesh=mesh)
    eqshard.clear_caches()
    with Compiles() as compiles:
        again = eqshard.init_sharded(build, jax.random.key(1), specs=P(), mesh=mesh)
    assert compiles.count > 0
    np.testing.assert_array_equal(again["w"], np.full(8, 3.0, np.float32))


@jax.custom_vjp
def _doubled(x):
    return 2 * x


_doubled.defvjp(lambda x: (_doubled(x), None), lambda _, g: (2 * g,))


def test_custom_derivatives_and_nested_programs_are_kept(mesh):
    # Their differentiation rules are new objects on every trace, and never run.
    def build(key):
        noise = jax.random.normal(key, (8,))
        branch = jax.lax.cond(noise[0] > 0, lambda: noise + 1, lambda: noise - 1)
        return {"a": jax.nn.relu(noise) + _doubled(noise), "b": branch}

    eqshard.init_sharded(build, jax.random.key(0), specs=P("tp"), mesh=mesh)
    with Compiles() as compiles:
        again = eqshard.init_sharded(build, jax.random.key(1), specs=P("tp"), mesh=mesh)
    assert compiles.count == 0
    want = jax.jit(build)(jax.random.key(1))
    for name in "ab":
        np.testing.assert_array_equal(_bits(again[name]), _bits(want[name]))


def test_specs_on_several_meshes_name_a_path_on_each(mesh, explicit_mesh):
    # The same devices and axes, other axis types: another mesh to JAX.
    specs = {"a": NamedSharding(mesh, P()), "b": NamedSharding(explicit_mesh, P())}

    def build(key):
        return {"a": jax.random.normal(key, (4,)), "b": jax.random.normal(key, (4,))}

    with pytest.raises(
        ValueError, match=r"(?s)eqshard.init_sharded: .* 2 different meshes.*'a'.*'b'"
    ):
        eqshard.init_sharded(build, jax.random.key(0), specs=specs)


def test_a_captured_array_on_one_device_is_a_constant(mesh):
    # Not an input: a jitted program's inputs must be on its devices.
    table = jax.device_put(jnp.arange(8.0), jax.devices()[3])

    def build(key):
        return {"w": jax.random.normal(key, (8,)) * 0 + table}

    built = eqshard.init_sharded(build, jax.random.key(0), specs=P("dp"), mesh=mesh)
    np.testing.assert_array_equal(built["w"], np.arange(8.0))
    assert built["w"].sharding == NamedSharding(mesh, P("dp"))
    with Compiles() as compiles:
        eqshard.init_sharded(build, jax.random.key(1), specs=P("dp"), mesh=mesh)
    assert compiles.count == 0
    table = table + 1  # another array: another program
    again = eqshard.init_sharded(build, jax.random.key(0), specs=P("dp"), mesh=mesh)
    np.testing.assert_array_equal(again["w"], np.arange(8.0) + 1)


def test_an_unconstrained_spec_is_refused_naming_the_path(mesh):
    # A built array needs a layout, as `shard` says: not JAX's out_shardings error.
    def build(key):
        return {"a": jax.random.normal(key, (8,))}

    with pytest.raises(
        ValueError, match=r"(?s)eqshard.init_sharded: .*'a'.*UNCONSTRAINED"
    ):
        eqshard.init_sharded(
            build, jax.random.key(0), specs={"a": P(P.UNCONSTRAINED)}, mesh=mesh
        )


def test_constant_outputs_of_the_program(mesh):
    # A scalar that is a constant of the jaxpr (a literal output, which the
    # program returns as NumPy data while tracing) is built too.
    def build(key):
        return {"flag": jnp.full((), 2.0, jnp.bool_)}

    built = eqshard.init_sharded(build, jax.random.key(0), specs=P(), mesh=mesh)
    assert built["flag"].dtype == jnp.bool_ and bool(built["flag"]) is True
    assert built["flag"].sharding == NamedSharding(mesh, P())


class _Scaled(eqx.Module):
    """A constructor that computes with its draws, as scaled initialisations do."""

    weights: list

    def __init__(self, key):
        keys = jax.random.split(key, 8)
        self.weights = [jax.random.normal(k, (16, 24)) * 0.2 for k in keys]


def test_equals_the_jitted_constructor_bit_for_bit(mesh):
    key = jax.random.key(11)
    model = eqshard.init_sharded(_Scaled, key, specs=P(None, "tp"), mesh=mesh)
    jitted = eqx.filter_jit(_Scaled)(key)
    for got, want in zip(model.weights, jitted.weights, strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(want))
        assert got.sharding == NamedSharding(mesh, P(None, "tp"))


def test_may_differ_from_eager_construction_by_a_few_ulp(mesh):
    # Eager construction multiplies the drawn array by 0.2 as its own op; the
    # program fuses the draw and the product, which XLA rounds differently (by up
    # to 2 ulp here, on CPU).
    key = jax.random.key(11)
    model = eqshard.init_sharded(_Scaled, key, specs=P(None, "tp"), mesh=mesh)
    eager = _Scaled(key)
    for got, want in zip(model.weights, eager.weights, strict=True):
        np.testing.assert_array_max_ulp(np.asarray(got), np.asarray(want), maxulp=4)


# ---------------------------------------------------------------- in pieces


def _bench_models():
    """benchmarks/models.py (its GPT-style `Transformer`), beside tests/models.py."""
    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "models.py"
    spec = importlib.util.spec_from_file_location("bench_models", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_models"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _first_axis_spec(x):
    return P("tp") if x.ndim and x.shape[0] % 4 == 0 else P()


def _split_first_axis(tree):
    """Specs splitting each array's first axis over 'tp' where it divides."""
    return jtu.tree_map(
        lambda x: _first_axis_spec(x) if isinstance(x, jax.ShapeDtypeStruct) else None,
        tree,
    )


def _assert_same_build(got, want):
    """`got` is `want` (the jitted constructor) bit for bit, in the specs of
    `_split_first_axis`."""
    # Not the treedefs: some models hold static objects made anew on every call.
    for (path, a), b in zip(
        jtu.tree_leaves_with_path(got), jtu.tree_leaves(want), strict=True
    ):
        if eqx.is_array(b):
            assert a.dtype == b.dtype and a.shape == b.shape, path
            np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=str(path))
            assert a.sharding.spec == _first_axis_spec(b), path
        else:
            assert type(a) is type(b)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, impl",
    [("gpt", "threefry2x32"), ("esm2", "threefry2x32"), ("mixed_lm", "rbg")],
)
def test_in_pieces_equals_the_jitted_constructor(mesh, name, impl):
    # Lists of blocks (the GPT of benchmarks/models.py, MixedLM) are built in
    # pieces, each distinct piece compiled once and run per block with its own
    # keys; stacked layers (ESM2's, one batched draw) are one piece. The values
    # are the jitted constructor's, bit for bit, in their shardings.
    if name == "gpt":
        bench = _bench_models()
        config = bench.Config(vocab=64, dim=16, heads=2, layers=3)

        def make_gpt(key):
            return bench.Transformer(config, key=key)

        make = make_gpt
    else:
        make = CASES[name].make
    key = jax.random.key(0, impl=impl)
    run = sharded_init(make, (key,), {}, specs=_split_first_axis, mesh=mesh).run
    # (With their optimizer states, whose zeros repeat, all three are.)
    assert isinstance(getattr(run, "__self__", None), Plan)
    built = eqshard.init_sharded(make, key, specs=_split_first_axis, mesh=mesh)
    _assert_same_build(built, eqx.filter_jit(make)(key))


def _blocks(depth, width):
    def make(key):
        keys = jax.random.split(key, depth)
        return [eqx.nn.Linear(width, width, key=k) for k in keys]

    return make


@pytest.mark.slow
def test_in_pieces_compiles_as_much_for_any_depth(mesh):
    # Each distinct piece compiles once, however many blocks use it: at any depth,
    # a build compiles the plan's programs (its keys' operations are compiled by
    # the first build, of another width), and building again compiles nothing.
    counts = []
    for depth in (3, 8):
        eqshard.init_sharded(
            _blocks(depth, 8), jax.random.key(0), specs=P("tp"), mesh=mesh
        )
        make = _blocks(depth, 16)
        with Compiles() as compiles:
            built = eqshard.init_sharded(
                make, jax.random.key(0), specs=P("tp"), mesh=mesh
            )
        parts = sharded_init(make, (jax.random.key(0),), {}, specs=P("tp"), mesh=mesh)
        plan = getattr(parts.run, "__self__", None)
        assert isinstance(plan, Plan)  # built in pieces
        assert compiles.count == len({id(call.jitted) for call in plan._calls})
        counts.append(compiles.count)
        _assert_same_build(built, eqx.filter_jit(make)(jax.random.key(0)))
        with Compiles() as compiles:
            again = eqshard.init_sharded(
                make, jax.random.key(1), specs=P("tp"), mesh=mesh
            )
        assert compiles.count == 0
        _assert_same_build(again, eqx.filter_jit(make)(jax.random.key(1)))
    assert counts[0] == counts[1] <= 2


def test_in_pieces_no_device_holds_a_whole_sharded_array(mesh):
    dim, depth = 256, 4
    parts = sharded_init(
        _blocks(depth, dim),
        (jax.random.key(0),),
        {},
        specs=[("weight", P("tp", "dp")), ("bias", P("tp"))],
        mesh=mesh,
    )
    plan = getattr(parts.run, "__self__", None)
    assert isinstance(plan, Plan)  # built in pieces
    consts, flat = parts.inputs
    values = [*consts, *flat, *plan._keys(*consts, *flat)]
    programs = {id(c.jitted): (c.jitted, c.inputs) for c in plan._calls}
    whole = 4 * dim * dim
    for jitted, inputs in programs.values():
        compiled = jitted.lower(*(values[i] for i in inputs)).compile()
        stats = compiled.memory_analysis()
        shards = sum(
            math.prod(s.shard_shape(o.shape)) * o.dtype.itemsize
            for s, o in zip(compiled.output_shardings, compiled.out_info, strict=True)
        )
        assert stats.output_size_in_bytes == shards + 8 * len(compiled.out_info)
        assert stats.temp_size_in_bytes < whole / 2


# ------------------------------------------------- 64-bit NumPy data, x64 off

_BEYOND_INT32 = np.array([2**40 + 7, 1], np.int64)


def test_64_bit_numpy_data_that_would_change_is_refused(mesh):
    # JAX narrows it to 32 bits while tracing (2**40 + 7 became 7, 1e300 inf).
    def from_argument(table, *, scale):
        return {"t": jax.tree.map(lambda x: x * 1, table), "s": scale * 1}

    fits = np.array([1.5], np.float64)
    with pytest.raises(ValueError, match=r"(?s)init_sharded: .*'args\[0\]/big'.*int32"):
        eqshard.init_sharded(
            from_argument, {"big": _BEYOND_INT32}, scale=fits, specs=P(), mesh=mesh
        )
    with pytest.raises(ValueError, match=r"(?s)'scale' \(float64.*inf.*jax_enable_x64"):
        eqshard.init_sharded(
            from_argument, {"big": fits}, scale=np.array([1e300]), specs=P(), mesh=mesh
        )

    def closing_over(key):
        return {"t": _BEYOND_INT32 + jax.random.randint(key, (2,), 0, 1)}

    with pytest.raises(ValueError, match=r"'_BEYOND_INT32 \(read by .*closing_over\)'"):
        eqshard.init_sharded(closing_over, jax.random.key(0), specs=P(), mesh=mesh)
    # Data that fits is narrowed as JAX narrows it.
    built = eqshard.init_sharded(
        from_argument,
        {"big": np.array([5, -6], np.int64)},
        scale=fits,
        specs=P(),
        mesh=mesh,
    )
    assert built["t"]["big"].dtype == np.int32 and built["s"].dtype == np.float32
    np.testing.assert_array_equal(built["t"]["big"], [5, -6])
    np.testing.assert_array_equal(built["s"], [1.5])


# Dicts JAX cannot flatten (keys of several types): read, but not data.
_MIXED_KEYS = {1: "one", "two": 2}
_MIXED_DEFAULT = collections.defaultdict(int, {1: 1, "two": 2})


def test_64_bit_check_skips_dicts_jax_cannot_flatten(mesh):
    def reads_mixed(key):
        assert _MIXED_KEYS and _MIXED_DEFAULT  # read, not traced
        return {"t": _BEYOND_INT32 + jax.random.randint(key, (2,), 0, 1)}

    with pytest.raises(ValueError, match=r"'_BEYOND_INT32 \(read by .*reads_mixed\)'"):
        eqshard.init_sharded(reads_mixed, jax.random.key(0), specs=P(), mesh=mesh)


class _Maker(eqx.Module):
    table: np.ndarray

    def __call__(self, key):
        return {"t": self.table + jax.random.randint(key, (2,), 0, 1)}


def test_64_bit_numpy_data_of_a_callable_constructor_is_refused(mesh):
    # A callable module's own data is read as its closure's: JAX would narrow
    # 2**40 + 7 to 7 while tracing, out of sight.
    with pytest.raises(ValueError, match=r"'the called _Maker/table' \(int64"):
        eqshard.init_sharded(
            _Maker(_BEYOND_INT32), jax.random.key(0), specs=P(), mesh=mesh
        )


# ------------------------------------------------- constructors as written


@jaxtyping.jaxtyped(typechecker=beartype.beartype)
def _checked_normal(key: jax.Array, rows: int) -> jaxtyping.Float[jax.Array, "n 8"]:
    return jax.random.normal(key, (rows, 8))


@beartype.beartype
def _checked_table() -> np.ndarray:
    return _BEYOND_INT32


def test_beartype_checked_code_in_the_constructor(mesh):
    # Equinox's recommended `jaxtyped(typechecker=beartype)`: the check for NumPy
    # data looks only at what the trace captured, never into beartype's caches.
    class Checked(eqx.Module):
        w: jax.Array

        def __init__(self, key):
            self.w = _checked_normal(key, 16) * 2

    key = jax.random.key(3)
    built = eqshard.init_sharded(Checked, key, specs=P("dp", "tp"), mesh=mesh)
    want = eqx.filter_jit(Checked)(key)
    np.testing.assert_array_equal(_bits(built.w), _bits(want.w))
    assert built.w.sharding.spec == P("dp", "tp")

    # Captured NumPy data that would change is still refused, found by its value
    # among what `fn` reads, with a `@beartype` helper among them.
    def captures(key):
        return _checked_table() + jax.random.randint(key, (2,), 0, 1)

    with pytest.raises(ValueError, match=r"'_BEYOND_INT32 \(read by _checked_table"):
        eqshard.init_sharded(captures, jax.random.key(0), specs=P(), mesh=mesh)


def test_in_pieces_with_closed_over_jax_arrays(mesh):
    # Repeated blocks (built in pieces) reading JAX arrays they close over: an
    # offset added to every block, and the key itself, split inside.
    offset = jnp.arange(8.0)
    key = jax.random.key(5)

    class Block(eqx.Module):
        w: jax.Array

        def __init__(self, key):
            self.w = jax.random.normal(key, (8, 8)) + offset

    def blocks():
        return [Block(k) for k in jax.random.split(key, 6)]

    run = sharded_init(blocks, (), {}, specs=P("dp", "tp"), mesh=mesh).run
    assert isinstance(getattr(run, "__self__", None), Plan)
    built = eqshard.init_sharded(blocks, specs=P("dp", "tp"), mesh=mesh)
    want = eqx.filter_jit(blocks)()
    for got, expected in zip(built, want, strict=True):
        np.testing.assert_array_equal(_bits(got.w), _bits(expected.w))
        assert got.w.sharding == NamedSharding(mesh, P("dp", "tp"))


# Where the jitted constructor's values hold bit for bit, and where to a tolerance.


def _centred(key):
    w = jax.random.normal(key, (64, 512))
    return {"w": w * 0.5 + 1.0, "centred": w - w.mean(0)}


def test_bit_for_bit_but_for_reductions_over_a_split_axis(mesh):
    key = jax.random.key(0)
    built = eqshard.init_sharded(_centred, key, specs=P("dp", "tp"), mesh=mesh)
    want = eqx.filter_jit(_centred)(key)
    # Draws and elementwise operations on them: exact, whatever the shardings.
    np.testing.assert_array_equal(_bits(built["w"]), _bits(want["w"]))
    # A mean over dimension 0, which P('dp', 'tp') splits: each device sums its
    # rows, then the partial sums are added, in another order than one device's
    # sum. Within the stated bound, 2 (n - 1) eps sum(|x|) for each sum of n
    # terms (divided by n for the mean), and the rounding of the difference.
    w = np.asarray(jax.random.normal(key, (64, 512)))
    eps, n = np.finfo(np.float32).eps, w.shape[0]
    bound = 2 * (n - 1) * eps * np.abs(w).sum(0) / n + eps * np.abs(w - w.mean(0))
    got, expected = np.asarray(built["centred"]), np.asarray(want["centred"])
    assert (np.abs(got - expected) <= bound).all()


# ------------------------------- the fast path (pieces) and its plain route


def _mlp(key):
    return eqx.nn.MLP(4, 4, 8, depth=11, key=key)


def _gpt(key):
    # A GPT-like model of tests/models.py's transformer blocks.
    ke, kb, kh = jax.random.split(key, 3)
    return {
        "embed": eqx.nn.Embedding(32, 8, key=ke),
        "blocks": [Block(8, k) for k in jax.random.split(kb, 3)],
        "head": eqx.nn.Linear(8, 32, use_bias=False, key=kh),
    }


def _routes(make, specs, mesh, monkeypatch):
    """`make` built by the fast path (in pieces) and by the plain route (one
    `jax.jit` of the whole program, `EQSHARD_PLAIN_ROUTES=init`)."""
    key = jax.random.key(3)
    parts = sharded_init(make, (key,), {}, specs=specs, mesh=mesh)
    assert isinstance(getattr(parts.run, "__self__", None), Plan)  # in pieces
    fast = eqshard.init_sharded(make, key, specs=specs, mesh=mesh)
    with monkeypatch.context() as patch:
        patch.setenv("EQSHARD_PLAIN_ROUTES", "init")
        parts = sharded_init(make, (key,), {}, specs=specs, mesh=mesh)
        assert parts.run is parts.jitted  # the whole program
        plain = eqshard.init_sharded(make, key, specs=specs, mesh=mesh)
    return fast, plain


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(_mlp, id="mlp"),
        pytest.param(_blocks(4, 16), id="blocks"),
        pytest.param(_gpt, id="gpt", marks=pytest.mark.slow),
    ],
)
def test_the_fast_path_equals_its_plain_route_bit_for_bit(mesh, make, monkeypatch):
    # Random draws and elementwise work on them: the same bits by both routes,
    # in the same shardings (the plain route is the jitted constructor's program:
    # `test_in_pieces_equals_the_jitted_constructor` compares with it).
    fast, plain = _routes(make, _split_first_axis, mesh, monkeypatch)
    _assert_same_build(fast, plain)


def _centred_blocks(key):
    return [_centred(k) for k in jax.random.split(key, 3)]


def test_the_routes_agree_to_the_tolerance_of_a_split_reduction(mesh, monkeypatch):
    fast, plain = _routes(_centred_blocks, P("dp", "tp"), mesh, monkeypatch)
    keys = jax.random.split(jax.random.key(3), 3)
    eps = np.finfo(np.float32).eps
    for got, want, key in zip(fast, plain, keys, strict=True):
        np.testing.assert_array_equal(_bits(got["w"]), _bits(want["w"]))
        w = np.asarray(jax.random.normal(key, (64, 512)))
        n = w.shape[0]
        bound = 2 * (n - 1) * eps * np.abs(w).sum(0) / n + eps * np.abs(w - w.mean(0))
        diff = np.abs(np.asarray(got["centred"]) - np.asarray(want["centred"]))
        assert (diff <= bound).all()


def test_an_unrecognised_program_takes_the_plain_route_once(mesh, monkeypatch):
    from eqshard._internals import jaxpr as jaxprs
    from eqshard._internals.routes import Unrecognised

    def unrecognised(closed, *, is_fed):
        raise Unrecognised("a test's primitive 'frobnicate'")

    make = _blocks(3, 8)
    eqshard.clear_caches()
    monkeypatch.setattr(jaxprs, "cut", unrecognised)
    with pytest.warns(RuntimeWarning, match="'init'.*frobnicate") as record:
        parts = sharded_init(make, (jax.random.key(0),), {}, specs=P("tp"), mesh=mesh)
        built = eqshard.init_sharded(make, jax.random.key(1), specs=P("tp"), mesh=mesh)
    assert parts.run is parts.jitted  # the whole program
    assert len([w for w in record if "frobnicate" in str(w.message)]) == 1
    _assert_same_build(built, eqx.filter_jit(make)(jax.random.key(1)))
    eqshard.clear_caches()


def test_a_size_0_array_split_over_an_axis_is_readable(mesh):
    # JAX's program gives such an output a whole (size-0) array on each device,
    # which `np.asarray` cannot read; found by the lifecycle property suite.
    built = eqshard.init_sharded(
        lambda key: jax.random.normal(key, (2, 0)),
        jax.random.key(0),
        specs=P("dp"),
        mesh=mesh,
    )
    assert built.sharding == NamedSharding(mesh, P("dp"))
    assert {s.data.shape for s in built.addressable_shards} == {(1, 0)}
    np.testing.assert_array_equal(np.asarray(built), np.zeros((2, 0), np.float32))
