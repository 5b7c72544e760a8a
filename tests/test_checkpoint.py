import contextlib
import glob
import json
import os
import resource
import signal
import socket
import subprocess
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from multihost import run_processes
from probes import Compiles, RUN_TIMEOUT

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
        specs = eqshard.restrict_specs(specs, mesh, rename=rename, on_invalid="ignore")
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


@pytest.mark.parametrize("dtype", [jnp.float4_e2m1fn, jnp.float8_e8m0fnu])
def test_restore_refuses_casts_its_read_cannot_check(tmp_path, dtype):
    # Read by tensorstore, float4_e2m1fn saturated 100 to 6 and float8_e8m0fnu
    # gave 1.0 as 5e-20, both silently.
    mesh = _mesh((8,), ("dp",))
    host = {"x": np.array([1.0, 100.0, -2.0, 4.0] * 2, np.float32)}
    eqshard.save(tmp_path / "c", host)
    with pytest.raises(ValueError, match=r"casts the arrays at 'x' to float"):
        eqshard.restore(tmp_path / "c", host, P("dp"), mesh, dtype=dtype)
    # Restored uncast, `shard` casts and refuses what the cast would lose.
    out = eqshard.restore(tmp_path / "c", host, P("dp"), mesh)
    assert np.asarray(out["x"]).tobytes() == host["x"].tobytes()
    with pytest.raises(ValueError, match="'x'"):
        eqshard.shard(out, P("dp"), mesh, dtype=dtype)


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


def _error(fn, *args, **kwargs):
    """The message of the eqshard error `fn` raises (`None` if it returns)."""
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError) as error:
        return str(error)
    return None


def _child_save_restore(directory):
    from jax.experimental import multihost_utils

    p = jax.process_index()
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
    specs = {"w": P("dp", "tp"), "h": P("tp")}
    tree = eqshard.shard(host, specs, saved_on)
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
    # A process that fails, or does not come: every process raises, none hangs,
    # and the checkpoint on disk stays as it was.
    errors = {}
    other = eqshard.shard({k: v + 1 for k, v in host.items()}, specs, saved_on)
    mine = dict(other)
    if p == 1:
        mine["w"] = jnp.asarray(host["w"])  # on this process's device: no collective
        mine["w"].delete()
    errors["save_fails"] = _error(eqshard.save, directory, mine, overwrite=True)
    differs = dict(other, **({"extra": other["w"]} if p == 1 else {}))
    errors["save_differs"] = _error(eqshard.save, directory, differs, overwrite=True)
    if p == 0:  # process 1 skips the call, then makes it when 0 has given up
        errors["save_alone"] = _error(
            eqshard.save, directory, other, overwrite=True, timeout=1
        )
    multihost_utils.sync_global_devices("eqshard test: after the lone save")
    if p == 1:
        errors["save_late"] = _error(
            eqshard.save, directory, other, overwrite=True, timeout=1
        )
    multihost_utils.sync_global_devices("eqshard test: after the late save")
    # orbax fails on process 1 alone, while writing (its disk is full).
    noise = np.random.default_rng(0).standard_normal((1024, 512)).astype(np.float32)
    placed = eqshard.shard({"noise": noise}, P("dp"), saved_on)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if p == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, limit[1]))
    errors["save_full"] = _error(eqshard.save, directory, placed, overwrite=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    like = eqshard.abstract(host)
    wrong = dict(like, w=jax.ShapeDtypeStruct((8, 8), jnp.float32)) if p else like
    errors["restore_fails"] = _error(eqshard.restore, directory, wrong, P(), saved_on)
    if p == 1:
        errors["restore_alone"] = _error(
            eqshard.restore, directory, like, P(), saved_on, timeout=1
        )
    multihost_utils.sync_global_devices("eqshard test: after the lone restore")
    if p == 0:
        errors["restore_late"] = _error(
            eqshard.restore, directory, like, P(), saved_on, timeout=1
        )
    multihost_utils.sync_global_devices("eqshard test: after the late restore")
    errors["bad_timeout"] = _error(eqshard.save, directory, tree, timeout=0)
    # Values that would be lost are found on every process, from its own shards.
    wide = {
        "ids": np.array([2**40 + 7, 1] * 4, np.int64),
        "x": np.array([1e6, np.inf] * 4, np.float32),
    }
    eqshard.save(directory + "-wide", wide)
    errors["lost"] = _error(
        eqshard.restore, directory + "-wide", wide, P("dp"), saved_on, dtype=np.float16
    )
    kept = eqshard.gather(eqshard.restore(directory, like, specs, saved_on))
    return {
        "gathered": eqshard.gather(out),
        "shards": shards,
        "errors": errors,
        "kept": kept,
        "left": sorted(os.listdir(os.path.dirname(directory))),
    }


def test_multiprocess_save_restore(tmp_path):
    results = run_processes(
        _child_save_restore, args=(str(tmp_path / "c"),), timeout=RUN_TIMEOUT
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
        # Every failed call left the first checkpoint as it was, and nothing else.
        assert result["kept"]["w"].tobytes() == w.tobytes()
        assert result["kept"]["h"].tobytes() == h.tobytes()
        assert result["left"] == ["c", "c-wide"]
        lost = result["errors"]["lost"]
        assert lost.startswith("eqshard.restore: placing these arrays would lose")
        assert "'ids' (int64; JAX narrows it to int32): 4 of its values" in lost
        assert "'x' (float32; `dtype=` casts it to float16): 4 of its finite" in lost
    where = f"the checkpoint at {str(tmp_path / 'c')!r}"
    zero, one = results[0]["errors"], results[1]["errors"]
    # The process that failed raises its own error; the other one quotes it.
    assert one["save_fails"].startswith("eqshard.save: nothing was written")
    assert "'w'" in one["save_fails"] and "deleted" in one["save_fails"]
    assert zero["save_fails"].startswith(
        f"eqshard.save: process 1 failed, so {where} is not written on any process."
    )
    assert "'w'" in zero["save_fails"]
    assert one["save_full"].startswith(f"eqshard.save: writing {where} failed")
    assert "File too large" in one["save_full"]
    assert zero["save_full"].startswith(
        f"eqshard.save: process 1 failed, so {where} is not written on any process."
    )
    assert one["restore_fails"].startswith(f"eqshard.restore: {where} does not match")
    assert zero["restore_fails"].startswith(
        f"eqshard.restore: process 1 failed, so {where} is not read on any process."
    )
    assert "'w': shape (8, 16) there, (8, 8) in `like`" in zero["restore_fails"]
    for errors in (zero, one):
        assert errors["save_differs"].startswith(
            f"eqshard.save: the processes passed different trees, so {where} is "
            "not written:\n  - 'extra': absent on process 0; shape (8, 16) float32 "
            "on process 1\n"
        )
        assert errors["bad_timeout"].startswith("eqshard.save: timeout must be")
    # A process that calls alone waits `timeout`, then raises; so does a late one.
    for errors, key, call, verb in (
        (zero, "save_alone", "save", "written"),
        (one, "save_late", "save", "written"),
        (one, "restore_alone", "restore", "read"),
        (zero, "restore_late", "restore", "read"),
    ):
        message = errors[key]
        assert message is not None, key
        p = 0 if errors is zero else 1
        assert message.startswith(
            f"eqshard.{call}: on process {p}, processes [0, 1] did not all make "
            f"this call within 1 s, so {where} is not {verb}"
        ), message
        assert f"the same `{call}` call" in message


def test_typed_prng_keys_round_trip(tmp_path):
    mesh = _mesh((2, 4), ("dp", "tp"))
    keys = jax.random.split(jax.random.key(3), 8)
    eqshard.save(tmp_path / "c", {"keys": eqshard.shard(keys, P("dp"), mesh)})
    like = {"keys": jax.eval_shape(lambda: keys)}
    out = eqshard.restore(tmp_path / "c", like, {"keys": P("tp")}, mesh)
    assert jnp.issubdtype(out["keys"].dtype, jax.dtypes.prng_key)
    want = np.asarray(jax.random.key_data(keys))
    assert np.array_equal(np.asarray(jax.random.key_data(out["keys"])), want)
    assert out["keys"].sharding == NamedSharding(mesh, P("tp"))


def test_first_save_in_one_process_compiles_nothing(tmp_path):
    # orbax's replica-parallel saving (the plain route) compiles a `slice` per
    # array shape and device to split each replicated shard among its replicas;
    # in one process, `save` writes each shard whole from one replica instead.
    mesh = _mesh((2, 4), ("dp", "tp"))
    specs = [P(), P("dp"), P(None, "tp")]
    host = {
        f"a{i}": np.arange(rows * 12, dtype=np.float32).reshape(rows, 12) + i
        for i, rows in enumerate((72, 88, 104))
    }
    tree = {
        name: jax.device_put(x, NamedSharding(mesh, spec))
        for (name, x), spec in zip(host.items(), specs)
    }
    with Compiles() as fast:
        eqshard.save(tmp_path / "fast", tree)
    with pytest.MonkeyPatch.context() as patch, Compiles() as plain:
        patch.setenv("EQSHARD_PLAIN_ROUTES", "save")
        eqshard.save(tmp_path / "plain", tree)
    assert fast.count == 0
    assert plain.count > 0  # 24 in orbax 0.12: a slice per shape and device
    for route in ("fast", "plain"):
        _assert_same(eqshard.restore(tmp_path / route, tree), host)


# ---------------------------------------------------------------------------------
# A save that fails leaves the checkpoint that was there as it was.


def _listing(directory):
    return sorted(os.listdir(os.path.dirname(directory)))


@contextlib.contextmanager
def _files_at_most(size):
    """Writes of files past `size` bytes fail (EFBIG) in this process, as on a full
    disk: a real failure inside orbax, late in a save."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_failed_save_keeps_the_old_checkpoint(tmp_path):
    mesh = _mesh((2, 4), ("dp", "tp"))
    directory = str(tmp_path / "c")
    host = _host_tree()
    eqshard.save(directory, eqshard.shard(host, _SPECS, mesh))
    like = eqshard.abstract(host, _SPECS, mesh)
    deleted = jnp.ones(4)
    deleted.delete()
    bad = {
        **host,
        "gone": deleted,
        "text": np.array(["a", "b"]),
        "objects": np.array([{}, None], dtype=object),
        "plan": jax.ShapeDtypeStruct((2,), jnp.float32),
    }
    # Every leaf that cannot be saved is named at once, before the disk is touched.
    with pytest.raises(
        TypeError, match="'gone'.*\n.*'objects'.*\n.*'plan'.*\n.*'text'"
    ):
        eqshard.save(directory, bad, overwrite=True)
    with pytest.raises(ValueError, match=r"'gone' \(float32\[4\]\): deleted"):
        eqshard.save(directory, {**host, "gone": deleted}, overwrite=True)
    # A failure inside orbax, after data was written: the new files go. (One array
    # alone: when one of several writes fails, orbax abandons the others' futures,
    # which Python would report later, from any test.)
    noise = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)
    with (
        _files_at_most(1 << 19),
        pytest.raises(
            ValueError, match=f"eqshard.save: writing the checkpoint at '{directory}'"
        ),
    ):
        eqshard.save(directory, {"noise": noise}, overwrite=True)
    assert _listing(directory) == ["c"]
    _assert_same(eqshard.restore(directory, like), host)
    # The same tree saves once the disk has room, and replaces the old one.
    eqshard.save(directory, {"noise": noise}, overwrite=True)
    assert _listing(directory) == ["c"]
    whole = NamedSharding(mesh, P())
    noise_like = jax.ShapeDtypeStruct(noise.shape, noise.dtype, sharding=whole)
    out = eqshard.restore(directory, {"noise": noise_like})
    assert np.asarray(out["noise"]).tobytes() == noise.tobytes()


def test_overwrite_replaces_only_a_checkpoint(tmp_path):
    tree = {"a": np.arange(4, dtype=np.float32)}
    other = tmp_path / "other"
    (other / "data").mkdir(parents=True)
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"is not a checkpoint \(it holds 'data/', "):
        eqshard.save(other, tree, overwrite=True)
    assert (other / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("keep me")
    with pytest.raises(ValueError, match="is a file"):
        eqshard.save(tmp_path / "file", tree, overwrite=True)
    assert (tmp_path / "file").read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    eqshard.save(tmp_path / "empty", tree, overwrite=True)
    # A checkpoint orbax wrote alone may be replaced too.
    ocp = pytest.importorskip("orbax.checkpoint")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "orbax", {"b": np.ones(2, np.int32)})
    checkpointer.wait_until_finished()
    checkpointer.close()
    eqshard.save(tmp_path / "orbax", tree, overwrite=True)
    mesh = _mesh((2, 4), ("dp", "tp"))
    for name in ("empty", "orbax"):
        out = eqshard.restore(tmp_path / name, tree, P(), mesh)
        assert np.asarray(out["a"]).tobytes() == tree["a"].tobytes()


# ---------------------------------------------------------------------------------
# One policy for data coming in: restore and load_safetensors, as shard.


def _restore_from(tmp_path, host, like, mesh, dtype):
    eqshard.save(tmp_path / "c", host)  # `save` makes the directories above
    return eqshard.restore(tmp_path / "c", like, P(), mesh, dtype=dtype)


def _load_from(tmp_path, host, like, mesh, dtype):
    tmp_path.mkdir()
    eqshard.save_safetensors(tmp_path / "c.safetensors", host)
    return eqshard.load_safetensors(
        tmp_path / "c.safetensors", like, P(), mesh, dtype=dtype
    )


_F16_BIG = {"big": jnp.float16, "ids": None, "x": None}


@pytest.mark.parametrize("bring_in", [_restore_from, _load_from])
def test_values_that_would_be_lost_are_refused(tmp_path, bring_in):
    assert not jax.enable_x64.value
    mesh = _mesh((2, 4), ("dp", "tp"))
    host = {
        "ids": np.array([2**40 + 7, 1, -3, 5] * 2, np.int64),
        "big": np.array([1e6, 1.0] * 4, np.float32),
        "x": np.array([1e300] + [1.0] * 7),
    }
    with pytest.raises(ValueError) as caught:
        bring_in(tmp_path / "a", host, host, mesh, _F16_BIG)
    message = str(caught.value)
    assert message.startswith(f"eqshard.{bring_in.__name__[1:-5]}")
    assert "'big' (float32; `dtype=` casts it to float16): 4 of its finite" in message
    assert "'ids' (int64; JAX narrows it to int32): 2 of its values" in message
    # On host the value is exact; restore's check on devices keeps its magnitude.
    reach = "1099511627783" if bring_in is _load_from else "1.09951e+12"
    assert f"int32 (-2147483648 to 2147483647), reaching {reach}" in message
    assert "'x' (float64; JAX narrows it to float32)" in message
    assert "jax_enable_x64" in message and "`None` at their paths" in message
    # What the narrower dtypes hold comes in, rounded as a cast rounds: infinities
    # and nans that were saved stay what they were.
    fits = {
        "ids": np.array([2**31 - 1, -(2**31), 7, 0], np.int64),
        "big": np.array([1e4, np.inf, -np.inf, np.nan, 0.1, 1.0, 2.0, 3.0], np.float32),
        "x": np.array([np.inf, np.nan, 1e30, 0.1]),
    }
    out = bring_in(tmp_path / "b", fits, fits, mesh, _F16_BIG)
    for name, dtype in (("ids", np.int32), ("big", np.float16), ("x", np.float32)):
        with np.errstate(over="ignore"):
            want = fits[name].astype(dtype)
        assert np.asarray(out[name]).tobytes() == want.tobytes(), name


# ---------------------------------------------------------------------------------
# Every dtype eqshard can save, and trees orbax alone cannot hold.

_DTYPES = [
    np.bool_,
    *(jnp.int2, jnp.int4, np.int8, np.int16, np.int32, np.int64),
    *(jnp.uint2, jnp.uint4, np.uint8, np.uint16, np.uint32, np.uint64),
    *(jnp.bfloat16, np.float16, np.float32, np.float64, np.complex64, np.complex128),
    *(jnp.float4_e2m1fn, jnp.float8_e3m4, jnp.float8_e4m3, jnp.float8_e4m3b11fnuz),
    *(jnp.float8_e4m3fn, jnp.float8_e4m3fnuz, jnp.float8_e5m2, jnp.float8_e5m2fnuz),
    jnp.float8_e8m0fnu,
]


def _values(dtype, shape):
    """Small values that every dtype holds, made with NumPy."""
    values = np.arange(int(np.prod(shape))).reshape(shape) % 4
    return values.astype(np.float32).astype(dtype)


def test_every_dtype_round_trips(tmp_path):
    mesh = _mesh((2, 4), ("dp", "tp"))
    host = {np.dtype(d).name: _values(d, (8, 4)) for d in _DTYPES}
    keys = jax.random.split(jax.random.key(1), 8)
    placed = {f"jax/{k}": v for k, v in eqshard.shard(host, P("dp"), mesh).items()}
    tree = {**host, **placed, "keys": keys}
    eqshard.save(tmp_path / "c", tree)
    out = eqshard.restore(tmp_path / "c", eqshard.abstract(tree), P("tp"), mesh)
    for name, x in tree.items():
        if name == "keys":
            got, x = jax.random.key_data(out[name]), jax.random.key_data(x)
        else:
            got = out[name]
        want = np.asarray(jax.device_put(x))  # 64-bit data narrowed, as JAX does
        assert got.dtype == want.dtype, name
        assert np.asarray(got).tobytes() == want.tobytes(), name
        assert out[name].sharding == NamedSharding(mesh, P("tp")), name


def test_arrays_orbax_cannot_hold(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    mesh = _mesh((2, 4), ("dp", "tp"))
    tree = {
        "empty": np.zeros((0, 8), np.float32),
        "empty_bits": np.zeros((8, 0), jnp.uint4),
        "no_keys": jax.random.split(jax.random.key(0), 0),
        "bits": _values(jnp.float8_e4m3, (8,)),
        "w": np.ones((2, 8), np.float32),
        "static": "kept",
    }
    eqshard.save(tmp_path / "c", tree)
    out = eqshard.restore(tmp_path / "c", eqshard.abstract(tree), P("dp"), mesh)
    assert out["static"] == "kept"
    for name in ("empty", "empty_bits", "bits", "w"):
        assert out[name].dtype == tree[name].dtype, name
        assert np.asarray(out[name]).tobytes() == tree[name].tobytes(), name
        assert out[name].sharding == NamedSharding(mesh, P("dp")), name
    assert (
        out["no_keys"].shape == (0,) and out["no_keys"].dtype == tree["no_keys"].dtype
    )
    # orbax alone sees the arrays it holds: the bits of float8_e4m3 as uint8.
    checkpointer = ocp.StandardCheckpointer()
    seen = checkpointer.metadata(tmp_path / "c").item_metadata.tree
    plain = checkpointer.restore(tmp_path / "c")
    checkpointer.close()
    assert sorted(seen) == ["bits", "w"] and np.dtype(seen["bits"].dtype) == np.uint8
    assert np.asarray(plain["w"]).tobytes() == tree["w"].tobytes()
    assert np.asarray(plain["bits"]).tobytes() == tree["bits"].tobytes()
    # A tree without arrays is a checkpoint too, and restores to `like`.
    nothing = {"step": 3, "name": "x", "f": jax.nn.gelu}
    eqshard.save(tmp_path / "none", nothing)
    assert eqshard.restore(tmp_path / "none", nothing) == nothing
    with pytest.raises(ValueError, match="in `like`, not there: 'w'"):
        eqshard.restore(tmp_path / "none", {"w": tree["w"]}, P(), mesh)


@pytest.mark.parametrize("ocdbt", [True, False])
@pytest.mark.parametrize("zarr3", [False, True])
def test_restore_a_nested_orbax_checkpoint(tmp_path, ocdbt, zarr3):
    ocp = pytest.importorskip("orbax.checkpoint")
    host = {
        "params": {
            "dense": {"kernel": np.arange(32.0, dtype=np.float32).reshape(4, 8)}
        },
        "layers": [np.arange(8, dtype=np.int32), np.ones(8, np.float16)],
    }
    # Every layout of files orbax writes: one OCDBT database or a directory per
    # array, zarr v2 or v3.
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3)
    checkpointer = ocp.Checkpointer(handler)
    checkpointer.save(tmp_path / "c", args=ocp.args.PyTreeSave(host))
    checkpointer.close()
    mesh = _mesh((2, 4), ("dp", "tp"))
    out = eqshard.restore(tmp_path / "c", host, P("tp"), mesh)
    _assert_same(out, host)
    kernel = out["params"]["dense"]["kernel"]
    assert kernel.sharding == NamedSharding(mesh, P("tp"))
    with pytest.raises(ValueError, match="there, not in `like`: 'layers/1'"):
        eqshard.restore(
            tmp_path / "c", {**host, "layers": host["layers"][:1]}, P(), mesh
        )


def test_an_orbax_checkpoint_of_two_arrays_under_one_name_is_refused(tmp_path):
    # orbax names `{"a": {"b": x}}` and `{"a.b": y}` both 'a.b' and keeps one
    # array's data: restoring gave it at both paths.
    ocp = pytest.importorskip("orbax.checkpoint")
    host = {"a": {"b": np.zeros(4, np.float32)}, "a.b": np.ones(4, np.float32)}
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    checkpointer.save(tmp_path / "c", args=ocp.args.PyTreeSave(host))
    checkpointer.close()
    mesh = _mesh((8,), ("dp",))
    with pytest.raises(ValueError, match="'a/b' and 'a.b' in one place, as 'a.b'"):
        eqshard.restore(tmp_path / "c", host, P(), mesh)
    # eqshard's own save names them apart.
    eqshard.save(tmp_path / "e", host)
    _assert_same(eqshard.restore(tmp_path / "e", host, P(), mesh), host)


def test_save_refuses_names_tensorstore_reads_as_one(tmp_path):
    # 'a' and 'a/' were written to one place: both restored as one array.
    x, y = np.zeros(4, np.float32), np.ones(4, np.float32)
    with pytest.raises(ValueError, match=r"arrays at 'a' and 'a/' in one place"):
        eqshard.save(tmp_path / "c", {"a": x, "a/": y})
    assert not os.path.exists(tmp_path / "c")
    with pytest.raises(ValueError, match=r"arrays at 'a/b' and 'a/b/' in one place"):
        eqshard.save(tmp_path / "c", {"a": {"b": x, "b/": y}})
    mesh = _mesh((8,), ("dp",))
    for tree in ({"a/": x, "a//": y}, {"a": {"": x}, "b": y}):  # apart
        eqshard.save(tmp_path / "d", tree, overwrite=True)
        _assert_same(eqshard.restore(tmp_path / "d", tree, P(), mesh), tree)


def test_arrays_of_one_size_and_another_shape_are_a_mismatch_not_a_view(tmp_path):
    # A (2, 3, 4) restored into a (4, 3, 2) `like` (and a (2, 3, 4, 5) into a
    # (4, 3, 2, 5)) was reshaped silently, read as another view of stacked layers.
    mesh = _mesh((2, 4), ("dp", "tp"))
    host = {
        "a": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
        "b": np.arange(120, dtype=np.float32).reshape(2, 3, 4, 5),
    }
    eqshard.save(tmp_path / "c", host)
    like = {
        "a": jax.ShapeDtypeStruct((4, 3, 2), jnp.float32),
        "b": jax.ShapeDtypeStruct((4, 3, 2, 5), jnp.float32),
    }
    with pytest.raises(ValueError) as caught:
        eqshard.restore(tmp_path / "c", like, P(), mesh)
    assert "'a': shape (2, 3, 4) there, (4, 3, 2) in `like`" in str(caught.value)
    assert "'b': shape (2, 3, 4, 5) there, (4, 3, 2, 5)" in str(caught.value)


def test_only_arrays_saved_as_a_stage_view_are_read_as_stacked_layers(tmp_path):
    # A (2, 3, 4) restored into a (24,) `like` (and a (2, 3, 4, 5) into a
    # (24, 5)) was reshaped silently, as if saved as a pipeline's staged view.
    mesh = _mesh((2, 4), ("pp", "tp"))
    view = np.arange(48, dtype=np.float32).reshape(2, 2, 2, 6)  # (R, S, K, 6)
    plain = {
        "a": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
        "b": np.arange(120, dtype=np.float32).reshape(2, 3, 4, 5),
    }
    one = np.arange(8, dtype=np.float32).reshape(2, 1, 4)  # S = 1, not over 'pp'
    tree = {"w": view, "one": one, **plain}
    rules = [("w", P(None, "pp")), ("one", P(None, None, "tp")), (".*", P())]
    placed = eqshard.shard(tree, rules, mesh)
    eqshard.save(tmp_path / "c", placed)
    want = np.empty((8, 6), np.float32)  # layer l at [l // 4, (l // 2) % 2, l % 2]
    for layer in range(8):
        want[layer] = view[layer // 4, (layer // 2) % 2, layer % 2]
    like = {
        "w": jax.ShapeDtypeStruct((8, 6), jnp.float32),
        "one": jax.ShapeDtypeStruct((2, 1, 4), jnp.float32),
    }
    got = eqshard.restore(tmp_path / "c", {**like, **plain}, P(), mesh)
    np.testing.assert_array_equal(np.asarray(got["w"]), want)
    flat = {
        "a": jax.ShapeDtypeStruct((24,), jnp.float32),
        "b": jax.ShapeDtypeStruct((24, 5), jnp.float32),
    }
    with pytest.raises(ValueError) as caught:
        eqshard.restore(tmp_path / "c", {**like, **flat}, P(), mesh)
    message = str(caught.value)
    assert "'a': shape (2, 3, 4) there, (24,) in `like`" in message
    assert "'b': shape (2, 3, 4, 5) there, (24, 5) in `like`" in message
    assert "arrays at 'a', 'b' have three leading axes" in message
    assert "'w'" not in message and "eqshard.unstage_view(" in message
    # A checkpoint written before `save` recorded the views: none is a view.
    file = tmp_path / "c" / "eqshard.json"
    own = json.loads(file.read_text())
    assert own.pop("stage_views") == ["w"]
    file.write_text(json.dumps(own))
    with pytest.raises(ValueError, match=r"'w': shape \(2, 2, 2, 6\) there, \(8"):
        eqshard.restore(tmp_path / "c", {**like, **plain}, P(), mesh)
    for lie, what in ((["x"], "names 'x', which"), (["w", 3], "not a list")):
        file.write_text(json.dumps({**own, "stage_views": lie}))
        with pytest.raises(ValueError, match=f"field 'stage_views' .*{what}"):
            eqshard.restore(tmp_path / "c", {**like, **plain}, P(), mesh)


def test_restore_onto_device_and_host_memory(tmp_path):
    # Arrays for a CPU device's own memory are read into it, those for its host
    # memories by orbax: both bit-exact, on the shardings asked for.
    mesh = _mesh((2, 4), ("dp", "tp"))
    host = _host_tree()
    eqshard.save(
        tmp_path / "c", eqshard.shard(host, _SPECS, _mesh((4, 2), ("dp", "tp")))
    )
    pinned = NamedSharding(mesh, P("dp"), memory_kind="pinned_host")
    shardings = {
        **jax.tree.map(lambda spec: NamedSharding(mesh, spec), _SPECS),
        "mask": pinned,
    }
    like = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        host,
        shardings,
    )
    out = eqshard.restore(tmp_path / "c", like)
    _assert_same(out, host)
    assert jax.tree.map(lambda x: x.sharding, out) == shardings


def test_restored_replicas_are_separate_buffers(tmp_path):
    # A block several devices hold is read once, and each device still gets a
    # buffer of its own (XLA's CPU client would share one NumPy block between
    # all the devices it is put on).
    mesh = _mesh((2, 4), ("dp", "tp"))
    host = {"w": np.arange(64.0, dtype=np.float32).reshape(8, 8)}
    eqshard.save(tmp_path / "c", host)
    out = eqshard.restore(tmp_path / "c", host, P("tp"), mesh)
    _assert_same(out, host)
    shards = out["w"].addressable_shards
    pointers = {shard.data.unsafe_buffer_pointer() for shard in shards}
    assert len(pointers) == len(shards) == 8


def test_restore_needs_a_concrete_mesh_and_layout_and_takes_big_endian_like(tmp_path):
    mesh = _mesh((2, 4), ("dp", "tp"))
    host = {"w": np.arange(8, dtype=">f4"), "i": np.arange(8, dtype=">i2")}
    eqshard.save(tmp_path / "c", host)
    with pytest.raises(TypeError, match=r"concrete `Mesh`.*'i', 'w'.*abstract mesh"):
        eqshard.restore(tmp_path / "c", host, P("dp"), mesh.abstract_mesh)
    # An array read now needs a layout, on any mesh: as `shard` says.
    explicit = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    for on in (mesh, explicit):
        with pytest.raises(
            ValueError, match=r"(?s)eqshard.restore: .*'i'.*UNCONSTRAINED"
        ):
            eqshard.restore(
                tmp_path / "c", host, {"i": P(P.UNCONSTRAINED), "w": P()}, on
            )
    out = eqshard.restore(tmp_path / "c", host, P("dp"), mesh)
    for name, x in host.items():
        native = x.astype(x.dtype.newbyteorder("="))
        assert np.asarray(out[name]).tobytes() == native.tobytes()


def test_restore_from_a_constructor_and_rules_adapts_to_the_mesh(tmp_path):
    host = {
        "w": np.arange(48, dtype=np.float32).reshape(6, 8),
        "b": np.ones(8, np.float32),
    }
    saved_on = _mesh((2, 4), ("dp", "tp"))
    rules = [("w", P("dp", "tp")), ("b", P("tp"))]
    specs = eqshard.match_partition_rules(rules, host)
    eqshard.save(tmp_path / "c", eqshard.shard(host, specs, saved_on))
    other = _mesh((4, 2), ("dp", "tp"))  # 6 rows do not split over 'dp' of 4

    def make():
        return jax.tree.map(jnp.asarray, host)

    with pytest.warns(
        UserWarning,
        match=r"(?s)restore: 1 spec changed.*'w': P\('dp', 'tp'\) -> P\(None, 'tp'\)",
    ):
        out = eqshard.restore(tmp_path / "c", make, rules, other)
    _assert_same(out, host)
    assert out["w"].sharding == NamedSharding(other, P(None, "tp"))
    assert out["b"].sharding == NamedSharding(other, P("tp"))
    with pytest.raises(
        ValueError, match=r"(?s)1 spec changed.*'w'.*on_invalid=\"ignore\""
    ):
        eqshard.restore(tmp_path / "c", make, rules, other, on_invalid="raise")
    quiet = eqshard.restore(tmp_path / "c", make, rules, other, on_invalid="ignore")
    assert quiet["w"].sharding == NamedSharding(other, P(None, "tp"))
    with pytest.raises(
        ValueError,
        match=r"(?s)restore: .*'b', 'w'.*`like` is .*takes arguments.*partial",
    ):
        eqshard.restore(tmp_path / "c", lambda key: host, rules, other)


# ---------------------------------------------------------------------------------
# One writer at a time per path; readers never get a mix of two checkpoints.


def _values_tree(value):
    return {k: np.full((64,), value, np.float32) for k in ("a", "b", "c")}


def _values_like(mesh):
    whole = NamedSharding(mesh, P())
    return {
        k: jax.ShapeDtypeStruct((64,), jnp.float32, sharding=whole)
        for k in ("a", "b", "c")
    }


def _rendezvous(sync, name, mode):
    """Waits for the process that opens the FIFO `name` of `sync` the other way."""
    os.close(os.open(os.path.join(sync, name), mode))


def _hold_the_first_save(sync):
    """Makes this process's first save wait, holding `path`'s lock, until the
    other writer has tried its own save (FIFOs "held", then "tried"): one of two
    saves that start together must lose, however fast a save is."""
    from eqshard._checkpoint import _save

    writer = _save._writer
    waited = False

    def held(ocp):
        nonlocal waited
        handler = writer(ocp)
        if not waited:
            waited = True
            save = handler.save

            def waiting(*args, **kwargs):
                _rendezvous(sync, "held", os.O_WRONLY)
                _rendezvous(sync, "tried", os.O_RDONLY)
                return save(*args, **kwargs)

            handler.save = waiting
        return handler

    _save._writer = held


def _child_writers_and_reader(path, sync, saves):
    """Launch index 0 and 1 save `saves` trees each to `path`; index 2 restores
    it until both are done (and once after). Plain processes, no
    `jax.distributed`: they start together when each has opened its end of the
    FIFOs in `sync` (an open waits for the other end); writer 1's first save
    starts while writer 0's first holds the lock."""
    role = int(os.environ["MULTIHOST_PROCESS_ID"])
    ends = {0: [("a", os.O_RDONLY)], 1: [("b", os.O_WRONLY), ("a", os.O_WRONLY)]}
    for name, mode in ends.get(role, [("b", os.O_RDONLY)]):
        _rendezvous(sync, name, mode)
    if role == 0:
        _hold_the_first_save(sync)
    if role < 2:
        said = []
        for j in range(saves):
            value = 100 * (role + 1) + j
            if role == 1 and j == 0:
                _rendezvous(sync, "held", os.O_RDONLY)
            try:
                eqshard.save(path, _values_tree(value), overwrite=True)
                said.append(value)
            except ValueError as error:
                said.append(str(error))
            if role == 1 and j == 0:
                _rendezvous(sync, "tried", os.O_WRONLY)
        with open(os.path.join(sync, f"done-{role}"), "w"):
            pass
        return said
    like = _values_like(_mesh((1,), ("x",), jax.devices()[:1]))
    read, errors, missing = [], [], 0
    done = [os.path.join(sync, f"done-{w}") for w in (0, 1)]
    while len(read) + len(errors) < 300 and not (
        read and all(map(os.path.exists, done))
    ):
        missing += not os.path.isdir(path)
        try:
            out = eqshard.restore(path, like)
        except ValueError as error:
            errors.append(str(error))
            continue
        read.append(sorted({float(v) for x in out.values() for v in np.asarray(x)}))
    return {"read": read, "errors": errors, "missing": missing}


def test_concurrent_writers_and_a_reader(tmp_path):
    path = str(tmp_path / "c")
    sync = tmp_path / "sync"
    sync.mkdir()
    for name in ("a", "b", "held", "tried"):
        os.mkfifo(sync / name)
    eqshard.save(path, _values_tree(0))
    writer0, writer1, reader = run_processes(
        _child_writers_and_reader,
        num_processes=3,
        devices_per_process=1,
        args=(path, str(sync), 4),
        timeout=RUN_TIMEOUT,
        distributed=False,
    )
    saved = {v for v in writer0 + writer1 if isinstance(v, int)}
    lost = [said for said in writer0 + writer1 if isinstance(said, str)]
    assert saved and lost  # writer 1's first save met writer 0's lock
    assert writer1[0] in lost
    for said in lost:  # and is told why, naming the lock
        assert said.startswith(f"eqshard.save: another save is writing {path!r}")
        assert f"holds {path + '.eqshard-lock'!r}" in said
    # The reader never got a mix, and always found a complete checkpoint.
    assert reader["read"], reader["errors"]
    for values in reader["read"]:
        assert len(values) == 1 and values[0] in saved | {0}, values
    assert reader["missing"] == 0
    for message in reader["errors"]:
        assert "finished during the restore" in message, message
    last = eqshard.restore(path, _values_like(_mesh((1,), ("x",), jax.devices()[:1])))
    assert len({float(v) for x in last.values() for v in np.asarray(x)} & saved) == 1
    assert sorted(os.listdir(tmp_path)) == ["c", "sync"]


def _reaped_pid():
    """The id of a process that has ended and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _lock(path, **info):
    with open(path + ".eqshard-lock", "x") as f:
        json.dump(info, f)


def test_a_live_lock_refuses_and_a_dead_ones_is_taken_over(tmp_path):
    path = str(tmp_path / "c")
    eqshard.save(path, _values_tree(1))
    like = _values_like(_mesh((1,), ("x",), jax.devices()[:1]))
    host = socket.gethostname()
    # A writer that is alive (here, this very process) holds the lock: refused.
    staging = path + ".eqshard-new-" + "ab" * 8
    _lock(path, host=host, pid=os.getpid(), staging=staging)
    with pytest.raises(ValueError, match="another save is writing") as error:
        eqshard.save(path, _values_tree(2), overwrite=True)
    assert f"process {os.getpid()} on host {host!r}" in str(error.value)
    assert repr(staging) in str(error.value)
    # So is a lock of another host, whose processes cannot be seen from here.
    os.remove(path + ".eqshard-lock")
    _lock(path, host=host + "-elsewhere", pid=_reaped_pid(), staging=staging)
    with pytest.raises(ValueError, match="another save is writing"):
        eqshard.save(path, _values_tree(2), overwrite=True)
    assert {float(v) for x in eqshard.restore(path, like).values() for v in x} == {1}
    # A lock whose process is gone, on this host: taken over, its staging removed.
    os.remove(path + ".eqshard-lock")
    os.mkdir(staging)
    (tmp_path / os.path.basename(staging) / "half-written").write_text("x")
    dead = _reaped_pid()
    _lock(path, host=host, pid=dead, staging=staging)
    with pytest.warns(UserWarning, match=f"by process {dead} on host .* is gone"):
        eqshard.save(path, _values_tree(2), overwrite=True)
    assert {float(v) for x in eqshard.restore(path, like).values() for v in x} == {2}
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_a_save_during_a_restore_is_refused(tmp_path, monkeypatch):
    from eqshard._checkpoint import _restore

    path = str(tmp_path / "c")
    eqshard.save(path, _values_tree(1))
    like = _values_like(_mesh((1,), ("x",), jax.devices()[:1]))
    read = _restore._read

    def read_then_save(*args, **kwargs):  # a real save, ending during the read
        out = read(*args, **kwargs)
        eqshard.save(path, _values_tree(2), overwrite=True)
        return out

    monkeypatch.setattr(_restore, "_read", read_then_save)
    with pytest.raises(ValueError, match="a save to .* finished during the restore"):
        eqshard.restore(path, like)
    monkeypatch.undo()
    assert {float(v) for x in eqshard.restore(path, like).values() for v in x} == {2}
    # A save in progress (its lock there), while the path is not: said so.
    os.rename(path, path + "-moved")
    _lock(path, host=socket.gethostname(), pid=os.getpid(), staging="s")
    with pytest.raises(ValueError, match="A save to it is in progress") as error:
        eqshard.restore(path, like)
    assert "in progress meanwhile" not in str(error.value)  # said once


def test_overwrite_keeps_what_is_not_the_checkpoints(tmp_path):
    path = str(tmp_path / "c")
    eqshard.save(path, _values_tree(1))
    like = _values_like(_mesh((1,), ("x",), jax.devices()[:1]))
    (tmp_path / "c" / "config.yaml").write_text("lr: 0.1")
    with pytest.raises(ValueError, match=r"also 'config.yaml', which is not part"):
        eqshard.save(path, _values_tree(2), overwrite=True)
    assert (tmp_path / "c" / "config.yaml").read_text() == "lr: 0.1"
    assert {float(v) for x in eqshard.restore(path, like).values() for v in x} == {1}
    os.remove(tmp_path / "c" / "config.yaml")
    # Directories named as eqshard's staging once were are someone else's now.
    for name in ("c.eqshard-new", "c.eqshard-old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text(name)
    eqshard.save(path, _values_tree(2), overwrite=True)
    for name in ("c.eqshard-new", "c.eqshard-old"):
        assert (tmp_path / name / "mine.txt").read_text() == name
    assert sorted(os.listdir(tmp_path)) == ["c", "c.eqshard-new", "c.eqshard-old"]
    assert {float(v) for x in eqshard.restore(path, like).values() for v in x} == {2}
    # A parent that is a file: eqshard's error, naming it.
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"'.*/file' is a file, not a directory"):
        eqshard.save(tmp_path / "file" / "sub" / "c", _values_tree(1))


@pytest.mark.parametrize(
    "damage",
    ["{not json", "[1, 2]", "{}", json.dumps({"tree_metadata": 5}), b"\xff\xfe"],
    ids=["not-json", "a-list", "no-tree", "tree-of-int", "not-utf8"],
)
def test_overwrite_with_damaged_metadata_still_names_what_is_not_the_checkpoints(
    tmp_path, damage
):
    # orbax's reader of the damaged `_METADATA` fails (ValueError, AttributeError,
    # KeyError, ...): the checkpoint's own entries are then not told apart, and
    # the file beside them is still named, not orbax's error.
    path = tmp_path / "c"
    eqshard.save(path, _values_tree(1))
    (path / "config.yaml").write_text("lr: 0.1")
    meta = path / "_METADATA"
    meta.write_bytes(damage) if isinstance(damage, bytes) else meta.write_text(damage)
    with pytest.raises(ValueError, match=r"also 'config.yaml', which is not part"):
        eqshard.save(path, _values_tree(2), overwrite=True)
    assert (path / "config.yaml").read_text() == "lr: 0.1"


def test_a_fifo_named_eqshard_json_is_refused(tmp_path):
    path = tmp_path / "c"
    eqshard.save(path, _values_tree(1))
    like = _values_like(_mesh((1,), ("x",), jax.devices()[:1]))
    own = path / "eqshard.json"
    os.remove(own)
    os.mkfifo(own)
    raised = []

    def call():
        try:
            eqshard.restore(path, like)
        except ValueError as error:
            raised.append(str(error))

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():  # waiting for a writer: give it one, and fail
        os.close(os.open(own, os.O_WRONLY | os.O_NONBLOCK))
        thread.join()
    assert raised and f"{str(own)!r} is damaged" in raised[0], raised
    assert "not a regular file" in raised[0]


def test_eqshard_json_that_lies_is_refused(tmp_path):
    path = tmp_path / "c"
    tree = {"a": np.ones(4, np.float32), "e": np.zeros((0, 2), np.float32)}
    tree["u"] = np.arange(4).astype(ml_dtypes.uint4)
    eqshard.save(path, tree)
    mesh = _mesh((1,), ("x",), jax.devices()[:1])
    with open(path / "eqshard.json") as f:
        truth = json.load(f)

    def restore_with(change, like):
        own = json.loads(json.dumps(truth))
        change(own)
        with open(path / "eqshard.json", "w") as f:
            json.dump(own, f)
        with pytest.raises(ValueError) as error:
            eqshard.restore(path, like, P(), mesh)
        return str(error.value)

    # An array held only in eqshard.json, with a shape that has data: its bytes
    # would be whatever memory held.
    big = {**tree, "e": np.zeros((4, 2), np.float32)}
    message = restore_with(lambda own: own["arrays"]["e"].update(shape=[4, 2]), big)
    assert f"{str(path / 'eqshard.json')!r} is damaged" in message
    assert "'arrays/e/shape' is [4, 2], yet 'saved_as' is null" in message
    # Bits said to be held in a dtype of another width, or another shape.
    wide = lambda own: own["arrays"]["u"].update(saved_as="int16")  # noqa: E731
    assert "'arrays/u/saved_as' is 'int16'" in restore_with(wide, tree)
    longer = {**tree, "u": np.zeros(8, ml_dtypes.uint4)}
    shape = lambda own: own["arrays"]["u"].update(shape=[8])  # noqa: E731
    assert "'arrays/u/shape' is [8], but orbax holds" in restore_with(shape, longer)
    no_orbax = lambda own: own.update(orbax=False)  # noqa: E731
    assert "'orbax'" in restore_with(no_orbax, tree)


def test_save_safetensors_replaces_only_when_asked(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"keep me")
    with pytest.raises(ValueError, match="already exists.*`overwrite=True`"):
        eqshard.save_safetensors(path, {"a": np.zeros(2, np.float32)})
    assert path.read_bytes() == b"keep me"
    eqshard.save_safetensors(path, {"a": np.zeros(2, np.float32)}, overwrite=True)
    assert path.read_bytes() != b"keep me"
    fifo = tmp_path / "f.safetensors"
    os.mkfifo(fifo)
    link = tmp_path / "l.safetensors"
    link.symlink_to(path)
    for target, kind in ((fifo, "not a regular file"), (link, "a symbolic link")):
        with pytest.raises(ValueError, match=kind):
            eqshard.save_safetensors(target, {"a": np.ones(2)}, overwrite=True)
    assert link.is_symlink() and fifo.is_fifo()
    assert sorted(os.listdir(tmp_path)) == sorted([path.name, fifo.name, link.name])


def _shards(tree):
    """Each array's shards: device, index and bytes (bit for bit)."""
    return {
        name: (
            x.dtype,
            x.sharding,
            sorted(
                (s.device.id, str(s.index), np.asarray(s.data).tobytes())
                for s in x.addressable_shards
            ),
        )
        for name, x in tree.items()
    }


@pytest.mark.parametrize("ocdbt", [True, False])
@pytest.mark.parametrize("zarr3", [False, True])
def test_restore_block_reads_match_orbaxs_read(tmp_path, monkeypatch, ocdbt, zarr3):
    # The fast path (tensorstore reads into CPU devices' buffers) and the plain
    # route (orbax's own read, EQSHARD_PLAIN_ROUTES=restore) give the same bits.
    ocp = pytest.importorskip("orbax.checkpoint")
    host = {k: v for k, v in _host_tree().items() if k != "layers"}
    host["b"] = _host_tree()["layers"][0]["b"]
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3)
    checkpointer = ocp.Checkpointer(handler)
    checkpointer.save(tmp_path / "c", args=ocp.args.PyTreeSave(host))
    checkpointer.close()
    specs = {**{k: v for k, v in _SPECS.items() if k != "layers"}, "b": P("tp")}
    cases = [
        (_mesh((2, 4), ("dp", "tp")), specs, None),
        (
            _mesh((4, 2), ("dp", "tp")),
            {k: P(*("tp",)[: v.ndim]) for k, v in host.items()},
            None,
        ),
        (_mesh((8,), ("dp",)), P(), jnp.bfloat16),
    ]
    for mesh, case_specs, dtype in cases:
        fast = eqshard.restore(tmp_path / "c", host, case_specs, mesh, dtype=dtype)
        with monkeypatch.context() as patch:
            patch.setenv("EQSHARD_PLAIN_ROUTES", "restore")

            def never(*args, **kwargs):
                pytest.fail("the plain route reads orbax's type handlers")

            patch.setattr(eqshard._internals.orbax, "read_specs", never)
            plain = eqshard.restore(tmp_path / "c", host, case_specs, mesh, dtype=dtype)
        assert _shards(fast) == _shards(plain)
        if dtype is None:
            _assert_same(fast, host)


def test_restore_takes_orbaxs_read_when_the_door_does_not_recognise(
    tmp_path, monkeypatch
):
    mesh = _mesh((2, 4), ("dp", "tp"))
    host = {**_host_tree(), "big": np.arange(16, dtype=np.int64)}
    eqshard.save(tmp_path / "c", host)
    fast = eqshard.restore(tmp_path / "c", host, _SPECS | {"big": P("tp")}, mesh)

    def unrecognised(*args, **kwargs):
        raise eqshard._internals.routes.Unrecognised("a test's unknown orbax")

    monkeypatch.setattr(eqshard._internals.orbax, "read_specs", unrecognised)
    with pytest.warns(RuntimeWarning, match="a test's unknown orbax") as caught:
        plain = eqshard.restore(tmp_path / "c", host, _SPECS | {"big": P("tp")}, mesh)
    assert len(caught) == 1  # once, though the narrowed int64 is read twice
    assert "'restore'" in str(caught[0].message)
    assert _shards({"w": fast["w"], "big": fast["big"]}) == _shards(
        {"w": plain["w"], "big": plain["big"]}
    )
    _assert_same(plain, jax.device_put(host))
