import gc
import weakref
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
from probes import aligned, Compiles

import eqshard


class Block(eqx.Module):
    weight: jax.Array
    bias: jax.Array
    scale: np.ndarray
    act: Callable
    missing: None
    name: str = eqx.field(static=True)


def _block():
    return Block(
        weight=jnp.arange(64.0).reshape(8, 8),
        bias=jnp.arange(8.0),
        scale=np.ones(4, np.float32),
        act=jax.nn.gelu,
        missing=None,
        name="block",
    )


def _block_specs():
    # A spec tree: a Block with specs, or None, where its fields' values are.
    return Block(P("dp", "tp"), P("tp"), P(), None, None, "block")  # pyright: ignore[reportArgumentType]


def test_shard_module_keeps_everything_but_arrays(mesh):
    block = _block()
    out = eqshard.shard(block, _block_specs(), mesh)
    assert type(out) is Block
    assert out.act is jax.nn.gelu and out.name == "block" and out.missing is None
    assert out.weight.sharding == NamedSharding(mesh, P("dp", "tp"))
    assert out.bias.sharding == NamedSharding(mesh, P("tp"))
    # NumPy arrays are arrays too: they move.
    assert isinstance(out.scale, jax.Array)
    assert out.scale.sharding == NamedSharding(mesh, P())
    for a, b in zip(
        jtu.tree_leaves(eqx.filter(out, eqx.is_array)),
        [block.weight, block.bias, block.scale],
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_shard_prefix_spec_and_none_subtree(mesh):
    tree = {"a": {"x": jnp.ones((8, 4)), "n": 3}, "b": np.zeros((2, 2))}
    out = eqshard.shard(tree, {"a": P("tp"), "b": None}, mesh)
    assert out["a"]["x"].sharding == NamedSharding(mesh, P("tp"))
    assert out["a"]["n"] == 3
    assert out["b"] is tree["b"]  # `None` leaves the subtree where it is


def test_shard_named_shardings_need_no_mesh(mesh):
    out = eqshard.shard([jnp.ones(8)], [NamedSharding(mesh, P("dp"))])
    assert out[0].sharding == NamedSharding(mesh, P("dp"))


def test_shard_uses_current_mesh(mesh):
    with jax.set_mesh(mesh):
        out = eqshard.shard(jnp.ones((4, 8)), P(None, "tp"))
    assert out.sharding == NamedSharding(mesh, P(None, "tp"))


@pytest.mark.parametrize(
    "value",
    [
        np.array([1.5, -2.25, 3.0, 4.0], dtype=jnp.bfloat16),
        np.array([-128, 0, 5, 127], dtype=np.int8),
        np.array([True, False, True, True]),
        np.array(3.5, dtype=np.float32),
        np.zeros((0, 4), dtype=np.float32),
    ],
    ids=["bf16", "int8", "bool", "0-d", "size-0"],
)
def test_shard_gather_round_trip_is_bit_exact(mesh, value):
    spec = P() if value.ndim == 0 else P(*([None] * (value.ndim - 1)), "tp")
    placed = eqshard.shard({"v": value}, {"v": spec}, mesh)["v"]
    assert placed.sharding == NamedSharding(mesh, spec)
    back = eqshard.gather({"v": placed, "s": "static"})
    assert back["s"] == "static"
    assert isinstance(back["v"], np.ndarray) and back["v"].dtype == value.dtype
    assert back["v"].tobytes() == value.tobytes()


def test_shard_and_gather_dtype_casts_only_floats(mesh):
    tree = {
        "f": np.linspace(0, 1, 8, dtype=np.float32),
        "i": np.arange(8, dtype=np.int8),
    }
    out = eqshard.shard(tree, P("dp"), mesh, dtype=jnp.bfloat16)
    assert out["f"].dtype == jnp.bfloat16 and out["i"].dtype == np.int8
    np.testing.assert_array_equal(np.asarray(out["f"]), tree["f"].astype(jnp.bfloat16))
    host = eqshard.gather(out, dtype=np.float32)
    assert host["f"].dtype == np.float32 and host["i"].dtype == np.int8


def test_shard_reports_every_bad_leaf(mesh):
    tree = {
        "layers": [{"w": jnp.ones((3, 8))}, {"w": jnp.ones((8, 8))}],
        "b": jnp.ones(8),
        "c": jnp.ones((8, 8)),
        "ok": jnp.ones((2, 4)),
    }
    specs = {
        "layers": [{"w": P("dp", "tp")}, {"w": P("dp", "sp")}],
        "b": P("dp", None),
        "c": P("tp", "tp"),
        "ok": P("dp", "tp"),
    }
    with pytest.raises(ValueError) as info:
        eqshard.shard(tree, specs, mesh)
    message = str(info.value)
    assert "4 leaves" in message and "{'dp': 2, 'tp': 4}" in message
    assert "'layers/0/w' (shape (3, 8))" in message
    assert "dimension 0 (size 3) is not divisible by 'dp' (size 2)" in message
    assert "Use P(None, 'tp')" in message
    assert "'layers/1/w'" in message and "'sp' is not a mesh axis" in message
    assert "'b'" in message and "2 entries but the array has rank 1" in message
    assert "'c'" in message and "'tp' is used twice" in message
    assert "'ok'" not in message


@pytest.mark.parametrize(
    "tree, specs, error, match",
    [
        (
            {"a": jnp.ones(3)},
            {"b": P()},
            ValueError,
            r"at '<root>'.*keys 'b'.*keys 'a'",
        ),
        ({"a": [jnp.ones(3)]}, {"a": (P(),)}, ValueError, r"at 'a'.*tuple.*list"),
        ({"a": jnp.ones(3)}, {"a": ("dp",)}, ValueError, r"at 'a'.*`P\(...\)`"),
        ({"a": jnp.ones(3)}, {"a": "dp"}, TypeError, r"'dp' at 'a'"),
        (
            {"a": np.zeros(4, jnp.bfloat16).view("V2")},
            P(),
            TypeError,
            r"'a' \(\|V2\).*view\(jnp.bfloat16\)",
        ),
        (  # `jax.grad(..., allow_int=True)` of an integer array: not raw bytes
            jax.grad(lambda t: 0.0, allow_int=True)({"i": jnp.arange(4)}),
            P(),
            TypeError,
            r"'i' .*float0, the gradient of an integer.*eqx.filter_grad",
        ),
        (
            {"a": jax.ShapeDtypeStruct((8,), jnp.float32)},
            P(),
            TypeError,
            r"ShapeDtypeStruct.*'a'",
        ),
        (  # as `extract_sharding_structure` gives for `eqx.filter_eval_shape` trees
            {"a": [jnp.ones(8)], "b": 1},
            NamedSharding(AbstractMesh((2, 4), ("dp", "tp")), P("dp")),
            TypeError,
            r"on an abstract mesh at 'a/0'.*extract_shardings",
        ),
    ],
)
def test_shard_structure_and_type_errors(mesh, tree, specs, error, match):
    with pytest.raises(error, match=match):
        eqshard.shard(tree, specs, mesh)


def test_shard_without_mesh_raises():
    with pytest.raises(ValueError, match="no mesh given and none set.*jax.set_mesh"):
        eqshard.shard({"a": jnp.ones(4)}, P())


def test_gather_leaves_non_arrays_and_numpy_alone(mesh):
    block = eqshard.shard(_block(), _block_specs(), mesh)
    host = eqshard.gather(block)
    assert type(host) is Block and host.act is jax.nn.gelu and host.name == "block"
    assert all(isinstance(x, np.ndarray) for x in (host.weight, host.bias, host.scale))
    np.testing.assert_array_equal(host.weight, np.arange(64.0).reshape(8, 8))


def test_iter_gather_yields_paths_one_leaf_at_a_time(mesh):
    tree = {"m": eqshard.shard(_block(), _block_specs(), mesh), "n": 1}
    items = eqshard.iter_gather(tree)
    first = next(items)
    assert first[0] == "m/weight" and isinstance(first[1], np.ndarray)
    rest = dict(items)
    assert list(rest) == ["m/bias", "m/scale"]
    np.testing.assert_array_equal(rest["m/bias"], np.arange(8.0))
    assert [p for p, _ in eqshard.iter_gather(tree, sep=".")][0] == "m.weight"


def test_iter_gather_paths_must_be_unique():
    tree = {"a/b": jnp.ones(2), "a": {"b": np.zeros(2)}, "c/d": 1, "c": {"d": 2}}
    with pytest.raises(ValueError, match=r"iter_gather: .*same name 'a/b'.*`sep`"):
        eqshard.iter_gather(tree)
    assert [path for path, _ in eqshard.iter_gather(tree, sep=".")] == ["a.b", "a/b"]


def test_gathered_copies_are_not_kept_alive_by_the_device_arrays(mesh):
    # `jax.device_get` caches its host copy on the array it copies; gather must
    # not leave a hidden host copy of the model behind.
    placed = eqshard.shard({"w": np.ones((8, 8), np.float32)}, P("dp", "tp"), mesh)
    host = weakref.ref(eqshard.gather(placed)["w"])
    _, leaf = next(eqshard.iter_gather(placed))
    one = weakref.ref(leaf)
    del leaf
    gc.collect()
    assert host() is None and one() is None


def test_iter_gather_rejects_abstract_trees_eagerly():
    with pytest.raises(TypeError, match="'w'"):
        eqshard.iter_gather({"w": jax.ShapeDtypeStruct((2,), jnp.float32)})


def test_named_shardings(mesh):
    specs = {"a": P("dp"), "b": None, "c": NamedSharding(mesh, P())}
    out = eqshard.named_shardings(specs, mesh)
    assert out == {"a": NamedSharding(mesh, P("dp")), "b": None, "c": specs["c"]}
    with pytest.raises(ValueError, match=r"at 'a' is P\('x',\), which names 'x', not"):
        eqshard.named_shardings({"a": P("x")}, mesh)
    with pytest.raises(TypeError, match="at 'a'"):
        eqshard.named_shardings({"a": 3}, mesh)
    with pytest.raises(
        ValueError, match=r"at 'b/0' is P\('tp', 'tp'\), which names 'tp' more"
    ):
        eqshard.named_shardings({"b": [P("tp", "tp")]}, mesh)


def test_make_shard_and_gather_fns_match_shard(mesh):
    block, specs = _block(), _block_specs()
    shard_fns, gather_fns = eqshard.compat.make_shard_and_gather_fns(specs, mesh)
    placed = eqshard.tree_apply(shard_fns, block)
    expected = eqshard.shard(block, specs, mesh)
    for a, b in zip(jtu.tree_leaves(placed), jtu.tree_leaves(expected)):
        if isinstance(b, jax.Array):
            assert a.sharding == b.sharding
    assert placed.weight.sharding == NamedSharding(mesh, P("dp", "tp"))
    assert placed.scale.sharding == NamedSharding(mesh, P())
    host = eqshard.tree_apply(gather_fns, placed)
    assert isinstance(host.weight, np.ndarray) and host.act is jax.nn.gelu
    np.testing.assert_array_equal(host.weight, np.arange(64.0).reshape(8, 8))


def test_make_shard_and_gather_fns_cast_floats(mesh):
    shard_fns, gather_fns = eqshard.compat.make_shard_and_gather_fns(
        {"f": P("dp"), "i": P()}, mesh, dtype=jnp.bfloat16
    )
    tree = {
        "f": np.linspace(0, 1, 8, dtype=np.float32),
        "i": np.arange(3, dtype=np.int8),
    }
    placed = eqshard.tree_apply(shard_fns, tree)
    assert placed["f"].dtype == jnp.bfloat16 and placed["i"].dtype == tree["i"].dtype
    assert placed["f"].sharding == NamedSharding(mesh, P("dp"))
    host = eqshard.tree_apply(gather_fns, placed)
    assert host["f"].tobytes() == tree["f"].astype(jnp.bfloat16).tobytes()


def test_abstract_trees_are_refused_everywhere_data_moves(mesh):
    tree = {"layers": [jnp.ones(2), jax.ShapeDtypeStruct((2,), jnp.float32)]}
    for fn in (
        eqshard.gather,
        lambda t: eqshard.with_sharding_constraint(t, P(), mesh=mesh),
    ):
        with pytest.raises(TypeError, match=r"ShapeDtypeStruct.*'layers/1'"):
            fn(tree)


def test_shard_inside_jit_points_to_the_moves_inside_programs(mesh):
    expected = r"traced arrays at 'x'.*jit.*with_sharding_constraint.*reshard"
    with jax.set_mesh(mesh), pytest.raises(TypeError, match=expected):
        jax.jit(lambda x: eqshard.shard({"x": x}, P("dp")))(jnp.ones(8))
    with pytest.raises(TypeError, match=expected):  # a concrete mesh given
        jax.jit(lambda x: eqshard.shard({"x": x}, P("dp"), mesh))(jnp.ones(8))


def test_make_shard_fns_errors_name_the_full_path(mesh):
    shard_fns, _ = eqshard.compat.make_shard_and_gather_fns(
        {"enc": {"w": P("dp")}}, mesh
    )
    with pytest.raises(ValueError, match=r"'enc/w' \(shape \(3,\)\)"):
        eqshard.tree_apply(shard_fns, {"enc": {"w": jnp.ones(3)}})


_dims = st.sampled_from([1, 2, 4, 8, 3])
_arrays = st.builds(
    lambda shape, dtype: (
        (np.arange(int(np.prod(shape))) % 7).astype(dtype).reshape(shape)
    ),
    st.lists(_dims, max_size=3).map(tuple),
    st.sampled_from([np.float32, np.int8, jnp.bfloat16, np.bool_]),
)
_trees = st.recursive(
    _arrays,
    lambda c: st.one_of(
        st.lists(c, max_size=3),
        st.dictionaries(st.text("xyz", min_size=1, max_size=2), c, max_size=3),
    ),
    max_leaves=6,
)


@settings(deadline=None, max_examples=25)
@given(_trees)
def test_round_trip_property(mesh, tree):
    # Each array is sharded over 'tp' on its first dimension divisible by 4.
    def spec(x):
        for i, d in enumerate(x.shape):
            if d % 4 == 0:
                return P(*([None] * i), "tp")
        return P()

    specs = jtu.tree_map(spec, tree)
    placed = eqshard.shard(tree, specs, mesh)
    for x, s in zip(
        jtu.tree_leaves(placed),
        jtu.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P)),
    ):
        assert x.sharding == NamedSharding(mesh, s)
    back = eqshard.gather(placed)
    assert jtu.tree_structure(back) == jtu.tree_structure(tree)
    for a, b in zip(jtu.tree_leaves(back), jtu.tree_leaves(tree)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


# Host offload: a `NamedSharding`'s memory kind is kept (the CPU backend has
# "pinned_host" and "unpinned_host" memories besides "device").


def _pinned(mesh, spec):
    return NamedSharding(mesh, spec, memory_kind="pinned_host")


def test_memory_kind_kept_by_shard_move_to_devices_and_shard_fns(mesh):
    host = {"w": np.arange(32, dtype=np.float32).reshape(8, 4), "b": np.ones(4)}
    specs = {"w": _pinned(mesh, P("dp", "tp")), "b": NamedSharding(mesh, P())}
    placed = [
        eqshard.shard(host, specs),
        eqshard.t5x.Partitioner(
            mesh=mesh, axis_rules=[("batch", "dp")]
        ).move_to_devices(host, specs),
        eqshard.tree_apply(eqshard.compat.make_shard_and_gather_fns(specs)[0], host),
    ]
    for out in placed:
        assert out["w"].sharding == _pinned(mesh, P("dp", "tp"))
        assert out["w"].sharding.memory_kind == "pinned_host"
        assert out["b"].sharding.memory_kind == "device"
        np.testing.assert_array_equal(eqshard.gather(out)["w"], host["w"])


# NumPy data: nothing lost, nothing shared with the caller's buffer.


def test_64_bit_arrays_that_would_lose_values_are_refused_naming_them(mesh):
    tree = {
        "ids": np.full((8,), 2**40 + 7, np.int64),
        "x": np.array([1e300] + [1.0] * 7),
        "ok": np.arange(8, dtype=np.int64),
    }
    with pytest.raises(ValueError, match=r"'ids' \(int64.*int32.*\n.*'x' \(float64"):
        eqshard.shard(tree, P(), mesh)
    with pytest.raises(ValueError, match="jax_enable_x64"):
        eqshard.shard(tree, P(), mesh)
    # Values that survive the narrowing are placed, as JAX would place them.
    out = eqshard.shard({"ok": tree["ok"], "y": np.linspace(0, 1, 8)}, P(), mesh)
    assert out["ok"].dtype == np.int32 and out["y"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(out["ok"]), np.arange(8))
    np.testing.assert_array_equal(
        np.asarray(out["y"]), np.linspace(0, 1, 8).astype(np.float32)
    )


def test_plans_report_the_dtype_placed(mesh):
    (row,) = eqshard.analyze_sharding_strategy(
        {"x": np.zeros((8, 4))}, P("dp"), mesh
    ).rows
    assert row.dtype == "float32" and row.nbytes == 8 * 4 * 4


# Replicated, split into dense runs of rows, and into strided blocks (which
# `device_put` always copies).
@pytest.mark.parametrize("spec", [P(), P("dp"), P("dp", "tp")])
@pytest.mark.parametrize("shape", [(8, 64), (1024, 512)])  # copied before, after
def test_placed_arrays_do_not_share_the_callers_buffer(mesh, spec, shape):
    buffer = aligned(shape, np.float32)
    out = eqshard.shard({"x": buffer}, spec, mesh)
    moved = eqshard.t5x.Partitioner(
        mesh=mesh, axis_rules=[("batch", "dp")]
    ).move_to_devices({"x": buffer}, spec)
    buffer[:] = 5.0  # a data loader reusing its buffer
    for tree in (out, moved):
        np.testing.assert_array_equal(np.asarray(tree["x"]), np.zeros(shape))


@pytest.mark.parametrize(
    "dtype",
    ["U3", "S3", "datetime64[s]", "timedelta64[s]", np.longdouble, object],
)
def test_numpy_dtypes_no_device_holds_are_refused_naming_the_path(mesh, dtype):
    tree = {"a": {"b": np.zeros((8,), dtype)}, "ok": np.ones(8, np.float32)}
    with pytest.raises(TypeError, match=r"'a/b' \("):
        eqshard.shard(tree, P(), mesh)


def test_numpy_strings_of_stringdtype_are_refused(mesh):
    strings = np.array(["a"] * 8, dtype=np.dtypes.StringDType())
    with pytest.raises(TypeError, match="'s'.*text or bytes"):
        eqshard.shard({"s": strings}, P(), mesh)


def test_big_endian_arrays_are_converted_losslessly(mesh):
    values = np.arange(8, dtype=">f4") * 1.5
    out = eqshard.shard({"x": values}, P("dp"), mesh)
    assert out["x"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(out["x"]), values.astype("<f4"))


def test_deleted_arrays_are_refused_before_anything_moves(mesh):
    dead = jax.device_put(np.ones(8, np.float32))
    dead.delete()
    tree = {"a": {"dead": dead}, "ok": np.ones(8, np.float32)}
    for call in (
        lambda: eqshard.shard(tree, P(), mesh),
        lambda: eqshard.gather(tree),
        lambda: eqshard.iter_gather(tree),  # before the first `next`
    ):
        with pytest.raises(ValueError, match="'a/dead'.*deleted"):
            call()


@pytest.mark.parametrize("dtype", [jnp.int8, np.uint16, bool])
def test_dtype_casts_to_non_floating_types_are_refused(mesh, dtype):
    tree = {"x": np.full((8,), 300.0, np.float32)}
    with pytest.raises(ValueError, match="floating"):
        eqshard.shard(tree, P(), mesh, dtype=dtype)
    with pytest.raises(ValueError, match="floating"):
        eqshard.gather(tree, dtype=dtype)


def test_dtype_casts_that_overflow_are_refused_naming_the_path(mesh):
    tree = {"big": np.full((8,), 1e5, np.float32), "ok": np.ones(8, np.float32)}
    with pytest.raises(ValueError, match=r"'big' \(float32; `dtype=` casts it"):
        eqshard.shard(tree, P(), mesh, dtype=jnp.float16)
    with pytest.raises(ValueError, match="(?s)copying these arrays to host.*'big'"):
        eqshard.gather(tree, dtype=jnp.float16)
    out = eqshard.shard(tree, P(), mesh, dtype=jnp.bfloat16)  # float32's range
    assert out["big"].dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("resident", [False, True])
def test_dtype_casts_at_the_edge_of_the_range(mesh, dtype, resident):
    # Values up to the largest finite value (and just past it, rounding down to
    # it) cast; twice it (or float32's largest) does not.
    largest = float(jnp.finfo(dtype).max)
    edge = np.array([largest, -largest, largest * (1 + 2**-13), 0.0], np.float32)
    beyond = min(largest * 2, float(np.finfo(np.float32).max))
    over = np.array([beyond, 1.0, 1.0, 1.0], np.float32)
    tree = {"edge": np.tile(edge, (8, 1)), "over": np.tile(over, (8, 1))}
    source = jax.device_put(tree, jax.devices()[0]) if resident else tree
    with pytest.raises(ValueError, match=r"'over'.*become inf or nan"):
        eqshard.shard(source, P("dp"), mesh, dtype=dtype)
    out = eqshard.shard({"edge": source["edge"]}, P("dp"), mesh, dtype=dtype)
    want = tree["edge"].astype(dtype)
    assert np.all(np.isfinite(want.astype(np.float32)))
    assert np.asarray(out["edge"]).tobytes() == want.tobytes()


@pytest.mark.parametrize(
    "source, dtype", [(np.float16, jnp.float32), (jnp.bfloat16, np.float32)]
)
def test_dtype_casts_to_a_wider_float_are_exact_and_quiet(mesh, source, dtype):
    # Every warning is an error here: range checks that brought float32's
    # largest value down to float16 warned that it overflowed (with inf or nan
    # among the values, a second check ran).
    values = [-65504.0, 1.5, 0.0, 65504.0, np.inf, -np.inf, np.nan, 2.0]
    host = np.array([values] * 8).astype(source)
    out = eqshard.shard(host, P("dp"), mesh, dtype=dtype)
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out), host.astype(np.float32))


@pytest.mark.parametrize("resident", [False, True])
def test_dtype_casts_to_types_without_inf_or_without_sign_are_checked(mesh, resident):
    # float4_e2m1fn has no inf or nan: 100 became its largest, 6, silently.
    # float8_e8m0fnu holds neither 0 nor negatives: they became nan silently.
    values = np.array([1.0, 100.0, -3.0, 0.0, 2.0, 4.0, 6.5, -6.9], np.float32)
    source = jax.device_put(values, jax.devices()[0]) if resident else values
    with pytest.raises(ValueError, match=r"'x'.*1 of its values.*float4"):
        eqshard.shard({"x": source}, P("tp"), mesh, dtype=jnp.float4_e2m1fn)
    with pytest.raises(ValueError, match=r"'x'.*3 of its finite values.*e8m0"):
        eqshard.shard({"x": source}, P("tp"), mesh, dtype=jnp.float8_e8m0fnu)
    with pytest.raises(ValueError, match=r"'x'.*beyond the range of float4"):
        eqshard.gather({"x": source}, dtype=jnp.float4_e2m1fn)
    # Nor has it room for inf and nan: NumPy's cast gives 6 and -0 for them.
    odd = np.array([np.inf, np.nan, 1.0, 2.0] * 2, np.float32)
    odd = jax.device_put(odd, jax.devices()[0]) if resident else odd
    with pytest.raises(ValueError, match=r"'x'.*4 of its values.*neither inf nor"):
        eqshard.shard({"x": odd}, P("tp"), mesh, dtype=jnp.float4_e2m1fn)
    # In range, values round as NumPy's cast rounds them (6.5 and -6.9 to 6).
    fits = np.where(values == 100.0, 5.0, values).astype(np.float32)
    out = eqshard.shard({"x": fits}, P("tp"), mesh, dtype=jnp.float4_e2m1fn)
    want = fits.astype(jnp.float4_e2m1fn)
    assert np.asarray(out["x"]).tobytes() == want.tobytes()


def test_dtype_tree_casts_only_where_it_says(mesh):
    tree = {
        "attn": {"w": np.ones((8, 4), np.float32)},
        "norm": {"scale": np.ones(8, np.float32)},
        "step": np.zeros(8, np.int32),
    }
    dtypes = {"attn": jnp.bfloat16, "norm": None, "step": jnp.bfloat16}
    out = eqshard.shard(tree, P(), mesh, dtype=dtypes)
    assert out["attn"]["w"].dtype == jnp.bfloat16
    assert out["norm"]["scale"].dtype == np.float32
    assert out["step"].dtype == np.int32  # only floating arrays are cast
    host = eqshard.gather(out, dtype={"attn": np.float32, "norm": None, "step": None})
    assert host["attn"]["w"].dtype == np.float32
    with pytest.raises(ValueError, match="dtype"):
        eqshard.shard(tree, P(), mesh, dtype={"attn": jnp.bfloat16})


def test_an_array_at_two_leaves_comes_back_as_one_array(mesh):
    embedding = np.arange(32, dtype=np.float32).reshape(8, 4)
    device = jax.device_put(embedding)
    for tied in (embedding, device):
        tree = {"embed": tied, "head": tied, "other": np.ones(4, np.float32)}
        out = eqshard.shard(tree, P("dp"), mesh)
        assert out["embed"] is out["head"]
        np.testing.assert_array_equal(np.asarray(out["head"]), embedding)
    # With different shardings they must be two arrays.
    out = eqshard.shard(
        {"a": embedding, "b": embedding}, {"a": P("dp"), "b": P()}, mesh
    )
    assert out["a"] is not out["b"]


def test_gather_assembles_blocks_on_a_mesh_of_permuted_devices():
    devices = np.array(jax.devices())[[6, 1, 4, 3, 2, 5, 0, 7]].reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("dp", "tp"))
    value = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    specs = [P("tp", "dp"), P("dp"), P(None, "tp"), P()]
    placed = [jax.device_put(value, NamedSharding(mesh, s)) for s in specs]
    for host in eqshard.gather(placed) + [v for _, v in eqshard.iter_gather(placed)]:
        np.testing.assert_array_equal(host, value)


# Typed PRNG keys: shard -> gather -> serialise -> load -> shard, equal.


def test_key_arrays_round_trip_through_gather_and_serialisation(mesh, tmp_path):
    tree = {
        "keys": jax.random.split(jax.random.key(1), 8),
        "rbg": jax.random.key(2, impl="rbg"),
        "w": np.ones((8, 4), np.float32),
    }
    specs = {"keys": P("dp"), "rbg": P(), "w": P("dp")}
    host = eqshard.gather(eqshard.shard(tree, specs, mesh))
    assert isinstance(host["keys"], eqshard.HostKey)
    assert host["keys"].impl == "threefry2x32" and host["rbg"].impl == "rbg"
    np.testing.assert_array_equal(
        host["keys"].data, np.asarray(jax.random.key_data(tree["keys"]))
    )
    path = tmp_path / "tree.eqx"
    eqx.tree_serialise_leaves(path, host)
    back = eqshard.shard(eqx.tree_deserialise_leaves(path, host), specs, mesh)
    for name in ("keys", "rbg"):
        assert back[name].dtype == tree[name].dtype
        assert jax.random.key_impl(back[name]) == jax.random.key_impl(tree[name])
        np.testing.assert_array_equal(
            np.asarray(jax.random.key_data(back[name])),
            np.asarray(jax.random.key_data(tree[name])),
        )
    assert back["keys"].sharding == NamedSharding(mesh, P("dp"))
    (name, data), _ = list(eqshard.iter_gather({"k": tree["keys"], "w": tree["w"]}))
    assert name == "k" and data.dtype == np.uint32 and data.shape == (8, 2)


@pytest.mark.parametrize("spec", [P(P.UNCONSTRAINED), P(1), P(None, 2.5)])
def test_specs_with_entries_that_place_nothing_are_refused_by_path(mesh, spec):
    tree = {"a": {"x": np.ones((8, 4), np.float32)}, "ok": np.ones(4)}
    with pytest.raises(ValueError, match=r"'a/x' \(shape \(8, 4\)\)"):
        eqshard.shard(tree, {"a": spec, "ok": P()}, mesh)


def test_an_abstract_mesh_gets_eqshards_error(mesh):
    tree = {"x": np.ones(8, np.float32)}
    for call in (
        lambda: eqshard.shard(tree, P(), mesh.abstract_mesh),
        lambda: eqshard.named_shardings(P(), mesh.abstract_mesh),
        lambda: eqshard.compat.make_shard_and_gather_fns(P(), mesh.abstract_mesh),
    ):
        with pytest.raises(TypeError, match="eqshard.*`AbstractMesh`.*concrete"):
            call()


def test_named_shardings_reports_every_bad_leaf(mesh):
    specs = {"a": P("x"), "b": P("tp"), "c": P("dp", "dp")}
    with pytest.raises(ValueError, match=r"2 leaves(.|\n)*'a'(.|\n)*'c'"):
        eqshard.named_shardings(specs, mesh)
    with pytest.raises(TypeError, match=r"'a'(.|\n)*'b'"):
        eqshard.named_shardings({"a": "dp", "b": 3}, mesh)


def test_shard_fns_take_one_floating_dtype(mesh):
    with pytest.raises(ValueError, match="make_shard_and_gather_fns.*floating"):
        eqshard.compat.make_shard_and_gather_fns(P(), mesh, dtype=jnp.int8)
    with pytest.raises(TypeError, match="make_shard_and_gather_fns.*one floating"):
        eqshard.compat.make_shard_and_gather_fns(
            {"a": P()}, mesh, dtype={"a": jnp.bfloat16}
        )
    shard_fns, _ = eqshard.compat.make_shard_and_gather_fns(
        {"a": P()}, mesh, dtype="bfloat16"
    )
    assert shard_fns["a"](np.ones(8, np.float32)).dtype == jnp.bfloat16


# Arrays already on devices move without a compilation per shape (`_resident.py`).


def _distinct_shapes(count, dtype=np.float32):
    rng = np.random.default_rng(count)
    shapes = [(8 * (1 + i), 4 * (1 + (3 * i) % 5)) for i in range(count)]
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


_PERMUTED = [6, 1, 4, 3, 2, 5, 0, 7]


@pytest.mark.parametrize(
    "source",
    ["device 3", "uncommitted", "same mesh", "permuted (4, 2) mesh"],
)
def test_device_resident_arrays_move_bit_exact_without_compiling(mesh, source):
    values = _distinct_shapes(6) + [np.float32(2.5), np.arange(8, dtype=np.int8)]
    permuted = jax.sharding.Mesh(
        np.array(jax.devices())[_PERMUTED].reshape(4, 2), ("a", "b")
    )
    put = {
        "device 3": lambda x: jax.device_put(x, jax.devices()[3]),
        "uncommitted": jnp.asarray,
        "same mesh": lambda x: jax.device_put(x, NamedSharding(mesh, P())),
        "permuted (4, 2) mesh": lambda x: jax.device_put(
            x, NamedSharding(permuted, P("a") if np.ndim(x) else P())
        ),
    }[source]
    tree = [put(v) for v in values]
    specs = [P("dp", "tp"), P("tp"), P(None, "dp"), P(), P("tp", "dp"), P("dp")]
    specs += [P(), P("tp")]
    with Compiles() as compiles:
        out = eqshard.shard(tree, specs, mesh)
    assert compiles.count == 0
    for array, value, spec in zip(out, values, specs):
        assert array.sharding == NamedSharding(mesh, spec)
        assert np.asarray(array).dtype == value.dtype
        assert np.asarray(array).tobytes() == np.asarray(value).tobytes()
    # Nothing moved shares memory with the arrays given: deleting those leaves
    # `out` intact (an array already as asked comes back as it is).
    for x, array in zip(tree, out):
        if x is not array:
            x.delete()
    for array, value in zip(out, values):
        assert np.asarray(array).tobytes() == np.asarray(value).tobytes()


def test_device_resident_arrays_keep_memory_kind_and_tied_arrays(mesh):
    tied = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4))
    tree = {"w": tied, "head": tied, "off": jax.device_put(np.ones(4, np.float32))}
    specs = {"w": P("dp"), "head": P("dp"), "off": _pinned(mesh, P("tp"))}
    out = eqshard.shard(tree, specs, mesh)
    assert out["w"] is out["head"]
    assert out["off"].sharding == _pinned(mesh, P("tp"))
    np.testing.assert_array_equal(eqshard.gather(out)["off"], np.ones(4))


def test_dtype_casts_device_resident_arrays_in_one_pass(mesh):
    values = _distinct_shapes(5) + [np.arange(8, dtype=np.int32)]
    tree = [jax.device_put(v, NamedSharding(mesh, P("dp"))) for v in values]
    with Compiles() as compiles:
        out = eqshard.shard(tree, P("dp"), mesh, dtype=jnp.bfloat16)
    assert compiles.count == 0
    for array, value in zip(out, values):
        want = value.astype(jnp.bfloat16) if value.dtype == np.float32 else value
        assert np.asarray(array).dtype == want.dtype
        assert np.asarray(array).tobytes() == want.tobytes()
        assert array.sharding == NamedSharding(mesh, P("dp"))


def test_dtype_casts_of_device_arrays_that_overflow_are_refused(mesh):
    tree = {
        "big": jax.device_put(np.full((8,), 1e6, np.float32)),
        "ok": jax.device_put(np.ones(8, np.float32)),
    }
    with pytest.raises(ValueError, match=r"'big' \(float32; `dtype=` casts it"):
        eqshard.shard(tree, P(), mesh, dtype=jnp.float16)
    out = eqshard.shard(tree, P(), mesh, dtype={"big": None, "ok": jnp.float16})
    assert out["big"].dtype == np.float32 and out["ok"].dtype == jnp.float16


def test_move_to_devices_moves_device_resident_arrays_without_compiling(mesh):
    value = np.arange(32, dtype=np.float32).reshape(8, 4)
    tree = {"w": jax.device_put(value), "b": jax.device_put(value[0])}
    partitioner = eqshard.t5x.Partitioner(mesh=mesh, axis_rules=[("x", "dp")])
    with Compiles() as compiles:
        out = partitioner.move_to_devices(tree, {"w": P("dp", "tp"), "b": P("tp")})
    assert compiles.count == 0
    assert out["w"].sharding == NamedSharding(mesh, P("dp", "tp"))
    np.testing.assert_array_equal(np.asarray(out["w"]), value)
    np.testing.assert_array_equal(np.asarray(out["b"]), value[0])


def test_check_values_must_be_sample_or_full(mesh):
    x = np.arange(8.0)
    with pytest.raises(
        ValueError,
        match='eqshard.shard: `check_values` is .all.; use "sample" or "full"',
    ):
        # Wrong on purpose:
        eqshard.shard({"x": x}, P("tp"), mesh, check_values="all")  # pyright: ignore[reportArgumentType]
    # One process: nothing to compare, either way.
    placed = eqshard.shard({"x": x}, P("tp"), mesh, check_values="full")
    np.testing.assert_array_equal(np.asarray(placed["x"]), x)


@pytest.mark.parametrize("kind", ["replicated", "split", "one device", "key"])
def test_gather_gives_writeable_copies_that_own_their_memory(mesh, kind):
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    if kind == "replicated":
        placed = eqshard.shard(jnp.asarray(value), P(), mesh)
    elif kind == "split":
        placed = eqshard.shard(jnp.asarray(value), P("dp", "tp"), mesh)
    elif kind == "one device":
        one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
        placed = eqshard.shard(jnp.asarray(value), NamedSharding(one, P()), mesh)
    else:
        placed = eqshard.shard(jax.random.key(3), P(), mesh)
        value = np.asarray(jax.random.key_data(jax.random.key(3)))
    host = eqshard.gather({"x": placed})["x"]
    if kind == "key":
        host, placed = host.data, jax.random.key_data(placed)
    assert host.flags.writeable and host.flags.owndata
    for shard in placed.addressable_shards:
        assert not np.shares_memory(host, np.asarray(shard.data))
    host[...] = 7  # writing it changes nothing on the mesh
    np.testing.assert_array_equal(np.asarray(placed), value)


def test_unknown_mesh_axis_names_the_leaf_the_axes_and_the_fix(mesh):
    tree = {"layers": [{"w": np.ones((8, 8), np.float32)}]}
    with pytest.raises(ValueError) as info:
        eqshard.shard(tree, {"layers": [{"w": P("dp", "model")}]}, mesh)
    message = str(info.value)
    assert message.startswith("eqshard.shard: ")
    assert "'layers/0/w'" in message and "'model' is not a mesh axis" in message
    assert "on mesh {'dp': 2, 'tp': 4}" in message and "Use P('dp',)" in message
    for on in (mesh, mesh.abstract_mesh):  # named_shardings' one builder, also
        # for `filter_jit` on an abstract mesh (JAX's own error named no path)
        with pytest.raises(ValueError) as info:
            eqshard._spectree._check_spec.named_sharding(
                P(("dp", "model")), on, caller="filter_jit", path=(jtu.DictKey("w"),)
            )
        message = str(info.value)
        assert message.startswith("eqshard.filter_jit: `specs` at 'w' is P(")
        assert "names 'model'" in message and "('dp', 'tp') or None" in message
    with pytest.raises(ValueError) as info:
        eqshard.named_shardings({"a": {"b": P(None, "model")}}, mesh)
    message = str(info.value)
    assert message.startswith("eqshard.named_shardings: `specs` at 'a/b'")
    assert "'model'" in message and "{'dp': 2, 'tp': 4}" in message
    assert "Use the mesh's axis names ('dp', 'tp') or None" in message


def test_filter_jit_on_an_abstract_mesh_names_an_unknown_axis(mesh):
    f = eqshard.filter_jit(
        lambda x: x, in_specs=({"w": P("model")},), mesh=mesh.abstract_mesh
    )
    # An abstract mesh serves a function called inside another jit.
    with pytest.raises(ValueError, match=r"filter_jit: `in_specs` at '0/w'.*'model'"):
        with jax.set_mesh(mesh):
            jax.jit(f)({"w": np.ones((8, 8), np.float32)})
