import glob
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from multihost import run_processes

import eqshard


def _mesh(shape, names, devices=None):
    devices = jax.devices() if devices is None else devices
    grid = np.array(devices, dtype=object).reshape(shape)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def _host_tree():
    """Host values of several dtypes, made with NumPy (the expected values)."""
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((8, 16)).astype(np.float32),
        "h": rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
        "ids": rng.integers(-128, 127, (8, 4), dtype=np.int8),
        "mask": rng.integers(0, 2, (8,)).astype(bool),
        "n": np.uint32(7),
        "layers": [{"b": rng.standard_normal(8).astype(np.float16)}],
    }


_SPECS = {
    "w": P("dp", "tp"),
    "h": P("tp"),
    "ids": P(("dp", "tp")),
    "mask": P("dp"),
    "n": P(),
    "layers": [{"b": P("tp")}],
}


def _assert_same(tree, host):
    got = [x for x in jax.tree.leaves(eqshard.gather(tree)) if eqshard.is_array(x)]
    want = [x for x in jax.tree.leaves(host) if eqshard.is_array(x)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.tobytes() == w.tobytes()  # bit for bit


def test_round_trip_over_meshes_is_bit_exact(tmp_path):
    host = _host_tree()
    meshes = [
        (_mesh((2, 4), ("dp", "tp")), None),
        (_mesh((4, 2), ("dp", "tp")), None),
        (_mesh((8,), ("fsdp",)), {"dp": "fsdp", "tp": None}),
        (_mesh((1,), ("fsdp",), jax.devices()[:1]), None),
    ]
    tree = eqshard.shard(host, _SPECS, meshes[0][0])
    like = eqshard.abstract(host)  # no shardings, no data
    specs = _SPECS
    for step, (mesh, rename) in enumerate(meshes[1:]):
        eqshard.save(tmp_path / str(step), tree)
        specs = eqshard.restrict_specs(specs, mesh, rename=rename, on_change="ignore")
        tree = eqshard.restore(tmp_path / str(step), like, specs, mesh)
        _assert_same(tree, host)
        assert tree["w"].sharding == NamedSharding(mesh, specs["w"])
        assert tree["layers"][0]["b"].sharding.mesh == mesh
    assert specs["w"] == P("fsdp") and specs["ids"] == P("fsdp")


def _model_and_state(mesh):
    model = eqx.nn.MLP(8, 4, 16, 2, activation=jax.nn.gelu, key=jax.random.key(0))
    params = eqx.filter(model, eqx.is_inexact_array)
    rules = [("weight", P("tp", "dp")), ("bias", P("tp"))]
    specs = eqshard.match_partition_rules(rules, params)
    optimizer = optax.adamw(1e-2)
    state = optimizer.init(params)
    opt_specs = eqshard.derive_specs(state, params, specs)
    # One step, so that the moments are not zeros.
    grads = jax.tree.map(jnp.ones_like, params)
    updates, state = optimizer.update(grads, state, params)
    model = eqx.apply_updates(model, updates)
    return (model, state), (specs, opt_specs)


def test_module_with_callables_and_optax_state(tmp_path):
    big, small = _mesh((2, 4), ("dp", "tp")), _mesh((4, 2), ("tp", "dp"))
    (model, state), (specs, opt_specs) = _model_and_state(big)
    host = eqshard.gather((model, state))
    tree = eqshard.shard((model, state), (specs, opt_specs), big)
    eqshard.save(tmp_path / "ckpt", tree)

    def skeleton():
        return _model_and_state(big)[0]

    like = eqx.filter_eval_shape(skeleton)
    out = eqshard.restore(tmp_path / "ckpt", like, (specs, opt_specs), small)
    _assert_same(out, host)
    restored_model, restored_state = out
    assert restored_model.activation is jax.nn.gelu
    assert restored_model.depth == 2 and restored_model.width_size == 16
    weight = restored_model.layers[0].weight
    assert weight.sharding == NamedSharding(small, P("tp", "dp"))
    mu = restored_state[0].mu.layers[0].weight
    assert mu.sharding == NamedSharding(small, P("tp", "dp"))
    # The restored pair trains on.
    grads = jax.tree.map(jnp.ones_like, eqx.filter(restored_model, eqx.is_array))
    optax.adamw(1e-2).update(grads, restored_state, restored_model)


def test_specs_none_keeps_like_shardings_and_dtype_casts(tmp_path):
    mesh = _mesh((2, 4), ("dp", "tp"))
    host = _host_tree()
    eqshard.save(tmp_path / "c", eqshard.shard(host, _SPECS, mesh))
    like = eqshard.abstract(host, _SPECS, mesh)
    out = eqshard.restore(tmp_path / "c", like, dtype=jnp.bfloat16)
    assert out["ids"].sharding == NamedSharding(mesh, P(("dp", "tp")))
    assert out["w"].dtype == jnp.bfloat16 and out["ids"].dtype == jnp.int8
    want = host["w"].astype(ml_dtypes.bfloat16)
    assert np.asarray(out["w"]).tobytes() == want.tobytes()
    assert np.array_equal(np.asarray(out["ids"]), host["ids"])
    # A `None` spec keeps the leaf's own sharding; a concrete `like` works too.
    concrete = eqshard.shard(host, _SPECS, mesh)
    out = eqshard.restore(
        tmp_path / "c", concrete, {**_SPECS, "w": None, "h": P()}, mesh
    )
    assert out["w"].sharding == concrete["w"].sharding
    assert out["h"].sharding == NamedSharding(mesh, P())


def test_save_refuses_existing_directory_unless_overwrite(tmp_path):
    eqshard.save(tmp_path / "c", {"a": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="overwrite=True"):
        eqshard.save(tmp_path / "c", {"a": np.ones(2, np.float32)})
    eqshard.save(tmp_path / "c", {"a": np.ones(2, np.float32)}, overwrite=True)
    mesh = _mesh((2, 4), ("dp", "tp"))
    out = eqshard.restore(tmp_path / "c", {"a": np.zeros(2, np.float32)}, P(), mesh)
    assert np.array_equal(np.asarray(out["a"]), np.ones(2, np.float32))
    with pytest.raises(TypeError, match="'a'"):
        eqshard.save(tmp_path / "d", {"a": jax.ShapeDtypeStruct((2,), jnp.float32)})


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda t: {**t, "extra": np.zeros(3, np.float32)},
            r"in `like`, not there: 'extra'",
        ),
        (
            lambda t: {k: v for k, v in t.items() if k != "w"},
            r"there, not in `like`: 'w'",
        ),
        (
            lambda t: {**t, "w": np.zeros((8, 8), np.float32)},
            r"'w': shape \(8, 16\) there, \(8, 8\) in `like`",
        ),
        (
            lambda t: {**t, "ids": np.zeros((8, 4), np.int32)},
            r"'ids': int8 there, int32 in `like`",
        ),
        (lambda t: {**t, "layers": [{"b": np.zeros(4, np.float16)}]}, r"'layers/0/b'"),
    ],
)
def test_restore_names_differences(tmp_path, change, match):
    mesh = _mesh((2, 4), ("dp", "tp"))
    host = _host_tree()
    eqshard.save(tmp_path / "c", host)
    like = change(host)
    before = jax.tree.map(np.copy, like)
    with pytest.raises(ValueError, match=match):
        eqshard.restore(tmp_path / "c", like, P(), mesh)
    # The caller's tree is untouched.
    assert jax.tree.structure(like) == jax.tree.structure(before)
    for a, b in zip(jax.tree.leaves(like), jax.tree.leaves(before)):
        assert a.tobytes() == b.tobytes()


def test_restore_needs_shardings(tmp_path):
    host = {"a": np.zeros(2, np.float32), "b": {"c": np.zeros(2, np.float32)}}
    eqshard.save(tmp_path / "c", host)
    with pytest.raises(ValueError, match=r"'a', 'b/c'.*specs"):
        eqshard.restore(tmp_path / "c", host)


def _data_file(directory):
    """The largest data file of an orbax checkpoint (the arrays' chunks)."""
    files = glob.glob(os.path.join(directory, "ocdbt.process_0", "d", "*"))
    return max(files, key=os.path.getsize)


def _truncate(directory):
    data = _data_file(directory)
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)


def _damage_metadata(directory):
    with open(os.path.join(directory, "_METADATA"), "r+b") as f:
        f.truncate(10)


@pytest.mark.parametrize("damage", [_truncate, _damage_metadata])
def test_damaged_checkpoint_is_eqshards_error(tmp_path, damage):
    # One device: when one of several shard reads fails, orbax abandons the
    # others' coroutines, which Python reports later, from whichever test runs.
    mesh = _mesh((1,), ("dp",), jax.devices()[:1])
    host = {"w": np.arange(64 * 8, dtype=np.float32).reshape(64, 8)}
    eqshard.save(tmp_path / "c", host)
    damage(str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"eqshard.restore: .*damaged"):
        eqshard.restore(tmp_path / "c", host, P("dp"), mesh)
    with pytest.raises(ValueError, match="no checkpoint"):
        eqshard.restore(tmp_path / "missing", host, P("dp"), mesh)


def _child_save_restore(directory):
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.array(devices, dtype=object)
    saved_on = Mesh(grid.reshape(2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    # Restored onto another mesh of the same devices: (4, 2), 'dp' of size 4.
    restored_on = Mesh(
        grid.reshape(2, 4).T, ("dp", "tp"), axis_types=(AxisType.Auto,) * 2
    )
    host = {
        "w": np.arange(8 * 16, dtype=np.float32).reshape(8, 16),
        "h": np.arange(16 * 4).astype(ml_dtypes.bfloat16).reshape(16, 4),
    }
    tree = eqshard.shard(host, {"w": P("dp", "tp"), "h": P("tp")}, saved_on)
    eqshard.save(directory, tree)
    out = eqshard.restore(directory, eqshard.abstract(host), P(None, "dp"), restored_on)
    shards = {
        name: [
            (
                tuple(s.index[d].indices(n)[:2] for d, n in enumerate(x.shape)),
                np.asarray(s.data),
            )
            for s in x.addressable_shards
        ]
        for name, x in out.items()
    }
    return {"gathered": eqshard.gather(out), "shards": shards}


def test_multiprocess_save_restore(tmp_path):
    results = run_processes(
        _child_save_restore, args=(str(tmp_path / "c"),), timeout=120
    )
    w = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    h = np.arange(16 * 4).astype(ml_dtypes.bfloat16).reshape(16, 4)
    for result in results:
        assert result["gathered"]["w"].tobytes() == w.tobytes()
        assert result["gathered"]["h"].tobytes() == h.tobytes()
        # Each shard holds a quarter of the columns ('dp' has size 4), its values.
        for name, full in (("w", w), ("h", h)):
            for index, data in result["shards"][name]:
                (r0, r1), (c0, c1) = index
                assert c1 - c0 == full.shape[1] // 4
                assert data.tobytes() == full[r0:r1, c0:c1].tobytes()


def test_typed_prng_keys_round_trip(tmp_path):
    mesh = _mesh((2, 4), ("dp", "tp"))
    keys = jax.random.split(jax.random.key(3), 8)
    eqshard.save(tmp_path / "c", {"keys": eqshard.shard(keys, P("dp"), mesh)})
    like = {"keys": jax.eval_shape(lambda: keys)}
    out = eqshard.restore(tmp_path / "c", like, {"keys": P("tp")}, mesh)
    assert jax.dtypes.issubdtype(out["keys"].dtype, jax.dtypes.prng_key)
    want = np.asarray(jax.random.key_data(keys))
    assert np.array_equal(np.asarray(jax.random.key_data(out["keys"])), want)
    assert out["keys"].sharding == NamedSharding(mesh, P("tp"))
