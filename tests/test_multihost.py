# eqshard across real processes: each test starts JAX processes on localhost with
# `run_processes` (see multihost.py), which run a `_child_*` function of this file
# and return what it saw; the test asserts on that in this (parent) process, against
# values worked out by hand or with NumPy here. A launch costs ~2 s, so each one
# checks many things.

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from multihost import run_processes
from probes import aligned, RUN_TIMEOUT

import eqshard


def _mesh(shape, names):
    """A mesh whose row p holds process p's devices in id order (by hand, so the
    shards every device gets are known here)."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.array(devices, dtype=object).reshape(shape)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def _key(index, shape):
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _shards(x):
    """(position of the device among this process's devices, index, data) for
    each shard of `x` on this process."""
    local = sorted(jax.local_devices(), key=lambda d: d.id)
    return sorted(
        (local.index(s.device), _key(s.index, x.shape), np.asarray(s.data))
        for s in x.addressable_shards
    )


class _Spy:
    """Counts the data callbacks of `jax.make_array_from_callback` and records the
    largest shard per device of every array `jax.device_put` makes."""

    def __init__(self):
        self.callbacks, self.put_bytes = [], []
        real_callback, real_put = jax.make_array_from_callback, jax.device_put

        def make_array_from_callback(shape, sharding, callback, *args, **kwargs):
            def counted(index):
                self.callbacks.append((tuple(shape), _key(index, shape)))
                return callback(index)

            return real_callback(shape, sharding, counted, *args, **kwargs)

        def device_put(x, *args, **kwargs):
            out = real_put(x, *args, **kwargs)
            for y in jax.tree.leaves(out):
                self.put_bytes.append(max(s.data.nbytes for s in y.addressable_shards))
            return out

        jax.make_array_from_callback = make_array_from_callback
        jax.device_put = device_put

    def take(self):
        out = (self.callbacks, self.put_bytes)
        self.callbacks, self.put_bytes = [], []
        return out


def _error(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except ValueError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------
# shard, gather and iter_gather, and the mistakes they catch: 2 processes x 4.
# ---------------------------------------------------------------------------------

W = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
B = (np.arange(8) - 4).astype(np.int8)
H = np.linspace(-2, 2, 12).astype(jnp.bfloat16).reshape(3, 4)
FLAGS = np.array([True, False, True, True])
SPECS = {
    "w": P("dp", "tp"),  # split over both processes and their devices
    "b": P("tp"),  # whole on each process, split across its devices
    "h": P(None, "tp"),
    "flags": P(),  # replicated everywhere
    "d": P("dp"),  # a JAX array on this process's devices, as input
    "keep": None,  # left where it is
    "name": None,
}


def _tree():
    return {
        "w": W,
        "b": B,
        "h": H,
        "flags": FLAGS,
        "d": jnp.arange(6.0).reshape(2, 3),
        "keep": jnp.ones(3),
        "name": "block",
    }


def _child_shard_and_gather():
    p = jax.process_index()
    mesh = _mesh((2, 4), ("dp", "tp"))
    spy = _Spy()
    out = {}

    # Full copies on every process -> global arrays.
    tree = _tree()
    placed = eqshard.shard(tree, SPECS, mesh)
    out["callbacks"], _ = spy.take()
    out["kept"] = placed["keep"] is tree["keep"]
    out["placed"] = {
        k: (
            v.shape,
            v.is_fully_addressable,
            v.sharding == NamedSharding(mesh, SPECS[k]),
        )
        for k, v in placed.items()
        if k not in ("keep", "name")
    }
    out["name"] = placed["name"]
    out["shards"] = {
        k: _shards(v) for k, v in placed.items() if k not in ("keep", "name")
    }
    # A cast while placing, and a global array resharded.
    out["cast"] = str(eqshard.shard(W, P("dp"), mesh, dtype=jnp.bfloat16).dtype)
    out["resharded"] = _shards(eqshard.shard(placed["w"], P("tp", "dp"), mesh))
    spy.take()

    # Global arrays -> the full value on every process.
    out["gathered"] = eqshard.gather(placed)
    _, out["gather_put_bytes"] = spy.take()
    items = eqshard.iter_gather(placed)
    out["first"] = [next(items), next(items)]
    _, out["first_put_bytes"] = spy.take()  # lazily: 'w' has not moved yet
    out["rest"] = list(items)
    empty = eqshard.shard(np.zeros((0, 4), np.float32), P("dp"), mesh)
    out["empty"] = eqshard.gather(empty).shape
    shard_fns, gather_fns = eqshard.compat.make_shard_and_gather_fns(
        {"w": P(None, "dp")}, mesh
    )
    out["fns"] = eqshard.tree_apply(
        gather_fns, eqshard.tree_apply(shard_fns, {"w": W})
    )["w"]

    # A mesh of process 1's devices only: process 0 takes part too, and gets an
    # array with no shard on it.
    devices = [d for d in jax.devices() if d.process_index == 1]
    stage = Mesh(np.array(devices), ("tp",), axis_types=(AxisType.Auto,))
    on_one = eqshard.shard({"x": B}, P("tp"), stage)["x"]
    out["one_process"] = (on_one.shape, str(on_one.dtype), _shards(on_one))
    # Only process 1 can gather it, and it needs no other process for that.
    out["one_process_gathered"] = _error(eqshard.gather, {"stage": {"x": on_one}})
    if p == 1:
        out["one_process_gathered"] = eqshard.gather(on_one)
    out["one_process_iter"] = _error(eqshard.iter_gather, [on_one])

    # Mistakes: every process raises the same error, and none is left waiting.
    tree = _tree()
    if p == 1:
        tree["w"] = W[:, :7]  # its spec would not even fit here
        tree["h"] = H.astype(np.float32)
    out["err_shapes"] = _error(eqshard.shard, tree, SPECS, mesh)
    tree = {"layers": [{"w": W}] * (2 + p)}
    out["err_structure"] = _error(eqshard.shard, tree, P(), mesh)
    # Each process's own rows, given to `shard`, which wants full copies.
    out["err_values"] = _error(eqshard.shard, {"x": W[8 * p : 8 * p + 8]}, P(), mesh)
    specs = {"w": P("dp"), "b": P()} if p == 0 else {"w": P(), "b": P()}
    out["err_specs"] = _error(eqshard.shard, {"w": W, "b": B}, specs, mesh)
    # Still in step after all that.
    out["after"] = eqshard.gather(eqshard.shard({"w": W}, P("dp", "tp"), mesh))["w"]
    return out


@pytest.mark.slow
def test_shard_and_gather_across_two_processes():
    results = run_processes(_child_shard_and_gather)
    d = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    full = {
        "w": W,
        "b": B,
        "h": H,
        "flags": FLAGS,
        "d": d,
        "keep": np.ones(3, np.float32),
    }
    # Hand-derived: process p holds mesh row p; its j-th device is column j.
    for p, r in enumerate(results):
        expected_index = {
            "w": lambda j: ((8 * p, 8 * p + 8), (2 * j, 2 * j + 2)),
            "b": lambda j: ((2 * j, 2 * j + 2),),
            "h": lambda j: ((0, 3), (j, j + 1)),
            "flags": lambda j: ((0, 4),),
            "d": lambda j: ((p, p + 1), (0, 3)),
        }
        for k, index in expected_index.items():
            assert r["placed"][k] == (full[k].shape, False, True), k
            shards = r["shards"][k]
            assert [j for j, _, _ in shards] == [0, 1, 2, 3], k
            for j, got_index, data in shards:
                assert got_index == index(j), (k, j)
                rows = tuple(slice(*i) for i in got_index)
                np.testing.assert_array_equal(data, full[k][rows])
                assert data.dtype == full[k].dtype
        assert r["name"] == "block" and r["kept"]
        # Only this process's shards were copied from the host copies: one callback
        # per local device and array, for that device's shard (JAX reads a fully
        # replicated array, 'flags', once). The digests of the tree that the
        # processes compare go through the distributed client, not through arrays.
        expected_callbacks = [
            (full[k].shape, index(j))
            for k, index in expected_index.items()
            for j in range(1 if k == "flags" else 4)
        ]
        assert sorted(r["callbacks"]) == sorted(expected_callbacks)
        assert r["cast"] == "bfloat16"
        # P('tp', 'dp'): rows by local device j, columns by process p.
        for j, index, data in r["resharded"]:
            assert index == ((4 * j, 4 * j + 4), (4 * p, 4 * p + 4))
            np.testing.assert_array_equal(data, W[4 * j : 4 * j + 4, 4 * p : 4 * p + 4])

        # Every process gets every value, bit-exact, with its dtype.
        gathered = r["gathered"]
        assert gathered["name"] == "block"
        for k, value in full.items():
            assert type(gathered[k]) is np.ndarray and gathered[k].dtype == value.dtype
            np.testing.assert_array_equal(gathered[k], value)
        # Only 'd' and 'w' are split between the processes; the others are whole on
        # each process and need no communication. On the way to host each device
        # holds a quarter of 'w' (4 of 16 rows: 128 of its 512 bytes), where
        # process_allgather would put all 512 bytes on every device. 'd' (2 x 3
        # float32) only splits 2 ways (1 row, 12 bytes), the other 2 devices
        # holding copies.
        assert r["gather_put_bytes"] == [12, 128]
        # iter_gather: in tree_leaves order, each leaf moved only when asked for.
        items = r["first"] + r["rest"]
        assert [name for name, _ in items] == ["b", "d", "flags", "h", "keep", "w"]
        for name, value in items:
            np.testing.assert_array_equal(value, full[name])
        assert r["first_put_bytes"] == [12]
        assert r["empty"] == (0, 4)
        np.testing.assert_array_equal(r["fns"], W)
        shape, dtype, shards = r["one_process"]
        assert (shape, dtype) == ((8,), "int8")
        assert [(j, index) for j, index, _ in shards] == (
            [] if p == 0 else [(j, ((2 * j, 2 * j + 2),)) for j in range(4)]
        )
        for j, _, data in shards:
            np.testing.assert_array_equal(data, B[2 * j : 2 * j + 2])
        if p == 1:
            np.testing.assert_array_equal(r["one_process_gathered"], B)
            assert r["one_process_iter"] is None
        np.testing.assert_array_equal(r["after"], W)

    # Process 0 holds no shard of it: an error naming it, not uninitialised memory.
    message = results[0]["one_process_gathered"]
    assert "eqshard.gather: process 0 holds no shard" in message
    assert "'stage/x' (on processes [1])" in message
    assert "'0' (on processes [1])" in results[0]["one_process_iter"]

    # Errors: the same message on both processes, naming each leaf that differs.
    for key in ("err_shapes", "err_structure", "err_values", "err_specs"):
        assert results[0][key] is not None and results[0][key] == results[1][key], key
    message = results[0]["err_shapes"]
    assert "eqshard.shard: the processes passed different inputs" in message
    assert (
        "'w': shape (16, 8) float32 on process 0; shape (16, 7) float32 on process 1"
        in message
    )
    assert (
        "'h': shape (3, 4) bfloat16 on process 0; shape (3, 4) float32 on process 1"
        in message
    )
    assert "'b'" not in message and "'flags'" not in message
    message = results[0]["err_structure"]
    assert (
        "trees differ at array 2: no more arrays on process 0; 'layers/2/w'" in message
    )
    message = results[0]["err_values"]
    assert "'x': values with sample hash" in message
    assert "host_local=True" in message
    message = results[0]["err_specs"]
    assert "'w': spec P('dp',) on process 0; spec P() on process 1" in message
    assert "'b'" not in message


# ---------------------------------------------------------------------------------
# The partitioner: data layout, host-local batches and a training step.
# ---------------------------------------------------------------------------------

PARAM_SPECS = {"w": P(None, "model"), "b": P("model")}
LEARNING_RATE = 0.1
STEPS = 3


def _problem():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    y = rng.normal(size=(16, 4)).astype(np.float32)
    w = rng.normal(size=(8, 4)).astype(np.float32)
    b = np.zeros(4, np.float32)
    return x, y, w, b


def _loss(params, batch):
    prediction = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((prediction - batch["y"]) ** 2)


def _train_step(params, batch):
    loss, grads = jax.value_and_grad(_loss)(params, batch)
    params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return params, loss


def _expected_training(x, y, w, b):
    """The losses and final parameters of `STEPS` steps, in float64 NumPy."""
    x, y, w, b = (a.astype(np.float64) for a in (x, y, w, b))
    losses = []
    for _ in range(STEPS):
        residual = x @ w + b - y
        losses.append(np.mean(residual**2))
        d_prediction = 2 * residual / residual.size
        w, b = (
            w - LEARNING_RATE * x.T @ d_prediction,
            b - LEARNING_RATE * d_prediction.sum(0),
        )
    return losses, w, b


def _train(partitioner, x, y, w, b):
    """`STEPS` steps with a host-local batch: each process passes the rows its data
    layout gives it."""
    layout = partitioner.data_layout(16)
    rows = 16 // layout.num_shards
    start = layout.shard_id * rows
    batch = partitioner.move_to_devices(
        {"x": x[start : start + rows], "y": y[start : start + rows]},
        partitioner.data_partition_spec,
        host_local=True,
    )
    params = partitioner.move_to_devices({"w": w, "b": b}, PARAM_SPECS)
    step = partitioner.partition(
        _train_step,
        in_specs=(PARAM_SPECS, partitioner.data_partition_spec),
        out_specs=(PARAM_SPECS, P()),
    )
    losses = []
    for _ in range(STEPS):
        params, loss = step(params, batch)
        losses.append(float(eqshard.gather(loss)))
    return {
        "batch_shape": batch["x"].shape,
        "batch": eqshard.gather(batch),
        "losses": losses,
        "params": eqshard.gather(params),
    }


def _chunk_view(partitioner, process_index):
    chunker = eqshard.t5x.LocalChunker(partitioner.mesh, process_index=process_index)
    axes = partitioner.mesh.axis_names
    return {
        "num_chunks": dict(chunker.num_chunks),
        "chunk_ids": dict(chunker.chunk_ids),
        "replica_ids": {a: chunker.get_replica_id(a) for a in axes},
        "shard_ids": {a: chunker.get_shard_id(a) for a in axes},
        "layout": partitioner.data_layout(16, process_index=process_index),
    }


def _child_partitioner(x, y, w, b):
    p = jax.process_index()
    # On CPU, t5x's default mesh is processes x local devices, ('data', 'model').
    partitioner = eqshard.t5x.Partitioner(num_partitions=4)
    mesh = partitioner.mesh
    out = {
        "axes": dict(mesh.shape),
        "owners": [[d.process_index for d in row] for row in mesh.devices],
        "data_shard_id": partitioner.data_shard_id,
        "data_shards": partitioner.data_shards,
        "data_mesh_size": partitioner.data_mesh_size,
        "views": [_chunk_view(partitioner, q) for q in (p, 1 - p)],
    }
    for name, spec in (("data", P("data", None)), ("model", P(None, "model"))):
        info = partitioner.local_chunk_info((16, 8), spec)
        out[f"chunk_{name}"] = (_key(info.slice, (16, 8)), info.replica_id)
    out.update(_train(partitioner, x, y, w, b))
    # The same on a hybrid mesh built by hand: 'data' across the processes (DCN).
    hybrid = eqshard.create_hybrid_mesh((1, 4), (2, 1), ("data", "model"))
    out["hybrid_owners"] = [[d.process_index for d in row] for row in hybrid.devices]
    placed = eqshard.shard(W, P("data", "model"), hybrid)
    out["hybrid_shards"] = _shards(placed)
    out["hybrid_gathered"] = eqshard.gather(placed)
    return out


@pytest.mark.slow
def test_partitioner_across_two_processes():
    x, y, w, b = _problem()
    results = run_processes(_child_partitioner, args=(x, y, w, b))
    losses, w_end, b_end = _expected_training(x, y, w, b)
    for p, r in enumerate(results):
        assert r["axes"] == {"data": 2, "model": 4}
        assert r["owners"] == [[0] * 4, [1] * 4]
        assert (r["data_shard_id"], r["data_shards"], r["data_mesh_size"]) == (p, 2, 2)
        # Each process's view, and the other's, computed on this process.
        for q, view in zip((p, 1 - p), r["views"]):
            assert view["num_chunks"] == {"data": 2, "model": 1}
            assert view["chunk_ids"] == {"data": q, "model": 0}
            # Sharding over 'data' replicates over 'model': one chunk, id 0; and
            # the other way round, the processes are replicas q of each other.
            assert view["replica_ids"] == {"data": 0, "model": q}
            assert view["shard_ids"] == {"data": q, "model": 0}
            assert view["layout"] == eqshard.t5x.DataLayout(16, q, 2, True)
        assert r["chunk_data"] == (((8 * p, 8 * p + 8), (0, 8)), 0)
        assert r["chunk_model"] == (((0, 16), (0, 8)), p)
        # 8 rows per process make the global batch of 16.
        assert r["batch_shape"] == (16, 8)
        np.testing.assert_array_equal(r["batch"]["x"], x)
        np.testing.assert_array_equal(r["batch"]["y"], y)
        np.testing.assert_allclose(r["losses"], losses, rtol=1e-5)
        np.testing.assert_allclose(r["params"]["w"], w_end, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["params"]["b"], b_end, rtol=1e-5, atol=1e-6)
        assert r["hybrid_owners"] == [[0] * 4, [1] * 4]
        for j, index, data in r["hybrid_shards"]:
            assert index == ((8 * p, 8 * p + 8), (2 * j, 2 * j + 2))
            np.testing.assert_array_equal(data, W[8 * p : 8 * p + 8, 2 * j : 2 * j + 2])
        np.testing.assert_array_equal(r["hybrid_gathered"], W)


# ---------------------------------------------------------------------------------
# Four processes of 2 devices: a multi-slice mesh, host-local blocks, mistakes.
# ---------------------------------------------------------------------------------


def _child_four_processes(x, y, w, b):
    p = jax.process_index()
    # ('replica', 'data', 'model') = (2, 2, 2), the processes tiling the first two
    # axes; the rules then split batches over ('replica', 'data').
    partitioner = eqshard.t5x.Partitioner(
        num_partitions=2, ici_mesh_shape=(1, 1, 2), dcn_mesh_shape=(2, 2, 1)
    )
    mesh = partitioner.mesh
    out = {
        "axes": dict(mesh.shape),
        "owners": np.vectorize(lambda d: d.process_index)(mesh.devices).tolist(),
        "data_spec": partitioner.data_partition_spec,
        "view": _chunk_view(partitioner, p),
    }
    out.update(_train(partitioner, x, y, w, b))

    # Full copies: rows split over both process axes, columns over local devices.
    placed = eqshard.shard(W, P(("replica", "data"), "model"), mesh)
    out["shards"] = _shards(placed)
    out["gathered"] = eqshard.gather(placed)
    # Host-local blocks: every process's (4, 8) block of rows.
    block = W[4 * p : 4 * p + 4]
    from_blocks = partitioner.move_to_devices(
        block, P(("replica", "data"), "model"), host_local=True
    )
    out["from_blocks"] = eqshard.gather(from_blocks)
    # 'model' first puts blocks p % 2 and 2 + p % 2 of 4 rows on process p.
    out["err_slices"] = _error(
        partitioner.move_to_devices,
        {"layer": {"w": block}},
        P(("model", "data")),
        host_local=True,
    )
    # A block whose spec does not split it across processes must be whole.
    out["err_whole"] = _error(
        partitioner.move_to_devices, {"x": block}, P(None, "model"), host_local=True
    )
    # One process of four passes another shape.
    tree = {"a": W, "b": W[:4] if p == 2 else W[:8]}
    out["err_shape"] = _error(eqshard.shard, tree, P(), mesh)
    return out


@pytest.mark.slow
def test_four_processes_of_two_devices():
    x, y, w, b = _problem()
    results = run_processes(
        _child_four_processes, num_processes=4, devices_per_process=2, args=(x, y, w, b)
    )
    losses, w_end, b_end = _expected_training(x, y, w, b)
    for p, r in enumerate(results):
        assert r["axes"] == {"replica": 2, "data": 2, "model": 2}
        # Process p holds the two 'model' devices at replica p // 2, data p % 2.
        assert r["owners"] == [[[0, 0], [1, 1]], [[2, 2], [3, 3]]]
        assert r["data_spec"] == P(("replica", "data"))
        view = r["view"]
        assert view["num_chunks"] == {"replica": 2, "data": 2, "model": 1}
        assert view["chunk_ids"] == {"replica": p // 2, "data": p % 2, "model": 0}
        # The chunk ids along the other axes read as one number (model: 1 chunk).
        assert view["replica_ids"] == {
            "replica": p % 2,  # (data, model): (p % 2) * 1 + 0
            "data": p // 2,  # (replica, model)
            "model": p,  # (replica, data): 2 * (p // 2) + p % 2
        }
        assert view["shard_ids"] == {"replica": p // 2, "data": p % 2, "model": 0}
        # Shard id along ('replica', 'data') = 2 * (p // 2) + p % 2 = p.
        assert view["layout"] == eqshard.t5x.DataLayout(16, p, 4, True)
        assert r["batch_shape"] == (16, 8)
        np.testing.assert_array_equal(r["batch"]["x"], x)
        np.testing.assert_allclose(r["losses"], losses, rtol=1e-5)
        np.testing.assert_allclose(r["params"]["w"], w_end, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["params"]["b"], b_end, rtol=1e-5, atol=1e-6)
        for j, index, data in r["shards"]:
            assert index == ((4 * p, 4 * p + 4), (4 * j, 4 * j + 4))
            np.testing.assert_array_equal(data, W[4 * p : 4 * p + 4, 4 * j : 4 * j + 4])
        np.testing.assert_array_equal(r["gathered"], W)
        np.testing.assert_array_equal(r["from_blocks"], W)

    for key in ("err_slices", "err_whole", "err_shape"):
        assert all(r[key] == results[0][key] for r in results), key
    message = results[0]["err_slices"]
    assert "eqshard.t5x.Partitioner.move_to_devices: 1 leaf has a spec" in message
    assert "'layer/w' (shape (4, 8))" in message
    assert "process 0's devices hold blocks [0, 2] of 4" in message
    assert "Use P(('data', 'model'),)" in message
    message = results[0]["err_whole"]
    assert "'x': values with sample hash" in message
    assert "mesh axis that spans processes ('replica', 'data')" in message
    message = results[0]["err_shape"]
    assert (
        "'b': shape (8, 8) float32 on processes 0, 1, 3; "
        "shape (4, 8) float32 on process 2"
    ) in message
    assert "'a'" not in message


# ---------------------------------------------------------------------------------
# A process that gathers alone raises instead of waiting forever: 2 processes x 4.
# ---------------------------------------------------------------------------------


def _child_gather_alone():
    from jax.experimental import multihost_utils

    p = jax.process_index()
    mesh = _mesh((2, 4), ("dp", "tp"))
    placed = eqshard.shard({"w": W}, {"w": P("dp", "tp")}, mesh)
    out = {"together": eqshard.gather(placed, timeout=60)["w"]}
    # Only process 0 gathers: it waits 1 s for process 1 at the barrier, then raises.
    if p == 0:
        out["alone"] = _error(eqshard.gather, {"stage": placed}, timeout=1)
    multihost_utils.sync_global_devices("eqshard test: after the lone gather")
    # Process 1 makes the call late, when process 0 has given up: it raises too.
    if p == 1:
        out["late"] = _error(eqshard.gather, {"stage": placed}, timeout=1)
    multihost_utils.sync_global_devices("eqshard test: after the late gather")
    # Both made the same calls, so the next gather meets again.
    out["again"] = eqshard.gather(placed, timeout=60)["w"]
    out["bad_timeout"] = _error(eqshard.gather, placed, timeout=0)

    # shard's agreement check posts its digest and waits `timeout=` seconds for
    # the others': a process alone raises, and so does one that comes after it
    # gave up, each within the bound.
    batch = {"x": np.arange(2 * 1024 * 256, dtype=np.float32).reshape(512, 1024)}

    def shard_alone():
        start = time.monotonic()
        error = _error(eqshard.shard, batch, P("dp"), mesh, timeout=1)
        return error, time.monotonic() - start

    if p == 0:
        out["shard alone"], out["alone took"] = shard_alone()
    multihost_utils.sync_global_devices("eqshard test: after the lone shard")
    if p == 1:
        out["shard late"], out["late took"] = shard_alone()
    multihost_utils.sync_global_devices("eqshard test: after the late shard")
    # Both made the same calls, so the next shard meets again; its host buffer
    # is the caller's as soon as it returns (written at once, nothing changes).
    expected = batch["x"].copy()
    placed_batch = eqshard.shard(batch, P("dp"), mesh, timeout=60)
    batch["x"][...] = -1.0
    out["batch shards"] = _shards(placed_batch["x"])
    out["expected"] = expected
    out["shard bad_timeout"] = _error(eqshard.shard, batch, P(), mesh, timeout=0)
    return out


@pytest.mark.slow
def test_gather_or_shard_alone_raises_instead_of_hanging():
    results = run_processes(_child_gather_alone, timeout=RUN_TIMEOUT)
    for r in results:
        np.testing.assert_array_equal(r["together"], W)
        np.testing.assert_array_equal(r["again"], W)
        assert r["bad_timeout"].startswith("eqshard.gather: timeout must be")
    for p, key in ((0, "alone"), (1, "late")):
        message = results[p][key]
        assert message is not None, f"process {p} did not raise"
        assert message.startswith(
            f"eqshard.gather: on process {p}, processes [0, 1] did not all make "
            "this call within 1 s, so the arrays at 'stage/w' cannot be gathered"
        )
        assert "must make the same call" in message
        message = results[p][f"shard {key}"]
        assert message is not None, f"process {p} did not raise"
        assert message.startswith(
            f"eqshard.shard: on process {p}, processes [0, 1] did not all make "
            "this call within 1 s, so they cannot compare their trees"
        )
        assert "raise `timeout=`" in message
        assert results[p][f"{key} took"] < 30  # not a day
    for p, r in enumerate(results):
        assert r["shard bad_timeout"].startswith("eqshard.shard: timeout must be")
        rows = r["expected"][p * 256 : (p + 1) * 256]
        for _, index, data in r["batch shards"]:
            assert index[0] == (p * 256, (p + 1) * 256)
            np.testing.assert_array_equal(data, rows)


# ---------------------------------------------------------------------------------
# check_values="full" finds copies that differ only where the sample does not look.
# ---------------------------------------------------------------------------------


def _child_full_value_check():
    p = jax.process_index()
    mesh = _mesh((2, 4), ("dp", "tp"))
    x = np.arange(1000, dtype=np.float32)
    if p == 1:
        x[1] = -1.0  # element 1 is not among the 64 the sample compares
    out = {}
    out["sampled"] = _error(eqshard.shard, {"x": x}, P(), mesh)
    out["full"] = _error(eqshard.shard, {"x": x}, P(), mesh, check_values="full")
    y = np.arange(1000, dtype=np.float32)
    placed = eqshard.shard({"y": y}, P("dp"), mesh, check_values="full")
    out["y"] = _shards(placed["y"])
    return out


@pytest.mark.slow
def test_full_value_check_finds_what_the_sample_misses():
    results = run_processes(_child_full_value_check)
    for p, r in enumerate(results):
        # The sample does not look at element 1: that is what "full" is for.
        assert r["sampled"] is None
        message = r["full"]
        assert message.startswith(
            "eqshard.shard: the processes passed different inputs:"
        )
        assert "'x': values with full hash" in message
        assert "compared on every byte" in message
        # Split over 'dp' (the two processes): each device of process p holds
        # elements [500p, 500p + 500).
        assert [position for position, _, _ in r["y"]] == [0, 1, 2, 3]
        for _, key, data in r["y"]:
            assert key == ((p * 500, p * 500 + 500),)
            np.testing.assert_array_equal(
                data, np.arange(p * 500, p * 500 + 500, dtype=np.float32)
            )
    assert results[0]["full"] == results[1]["full"]


# ---------------------------------------------------------------------------------
# Typed PRNG keys and the caller's buffers, across two processes.
# ---------------------------------------------------------------------------------


def _child_keys_and_buffers():
    import io

    import equinox as eqx

    p = jax.process_index()
    mesh = _mesh((2, 4), ("dp", "tp"))
    out = {}
    # Keys: shard -> gather -> serialise -> load -> shard, on every process.
    keys = jax.random.split(jax.random.key(0), 8)
    tree = {"k": keys, "w": W}
    specs = {"k": P("dp"), "w": P("dp", "tp")}
    placed = eqshard.shard(tree, specs, mesh)
    out["key_sharding"] = placed["k"].sharding == NamedSharding(mesh, P("dp"))
    out["key_is_key"] = jnp.issubdtype(placed["k"].dtype, jax.dtypes.prng_key)
    gathered = eqshard.gather(placed)
    # A key comes to host as an eqshard.HostKey of its data.
    out["gathered_key_data"] = gathered["k"].data
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, gathered)
    buffer.seek(0)
    like = {"k": eqshard.HostKey(np.zeros((8, 2), np.uint32), "threefry2x32"), "w": W}
    loaded = eqx.tree_deserialise_leaves(buffer, like)
    again = eqshard.shard(loaded, specs, mesh)
    out["again_sharding"] = again["k"].sharding == NamedSharding(mesh, P("dp"))
    out["again_key_data"] = eqshard.gather(again)["k"].data
    out["again_w"] = eqshard.gather(again)["w"]
    out["key_shards"] = [
        (i, data) for i, _, data in _shards(jax.random.key_data(placed["k"]))
    ]
    # The caller's buffers, 64-byte aligned (which raw JAX uses in place): a data
    # loader that refills them after placing must not change what is on the mesh.
    # Full copies, replicated and split, below and above the size from which
    # `shard` copies only if it must; and host-local blocks.
    for shape in ((16, 8), (1024, 512)):
        full = aligned(shape, np.float32)
        block = aligned((shape[0] // 2, shape[1]), np.float32)
        block[:] = p
        partitioner = eqshard.t5x.Partitioner(mesh=mesh, axis_rules=None)
        placed = {
            "replicated": eqshard.shard(full, P(), mesh),
            "split": eqshard.shard(full, P("dp", "tp"), mesh),
            "local": partitioner.move_to_devices(block, P("dp", "tp"), host_local=True),
        }
        full[:] = -1.0
        block[:] = -1.0
        out[shape] = eqshard.gather(placed)
    return out


@pytest.mark.slow
def test_keys_and_buffers_across_two_processes():
    results = run_processes(_child_keys_and_buffers)
    expected_keys = np.asarray(
        jax.random.key_data(jax.random.split(jax.random.key(0), 8))
    )
    for p, r in enumerate(results):
        assert r["key_sharding"] and r["key_is_key"] and r["again_sharding"]
        np.testing.assert_array_equal(r["gathered_key_data"], expected_keys)
        np.testing.assert_array_equal(r["again_key_data"], expected_keys)
        np.testing.assert_array_equal(r["again_w"], W)
        # 'dp' splits the 8 keys over the processes: 4 each, one copy per device.
        assert [i for i, _ in r["key_shards"]] == [0, 1, 2, 3]
        for _, data in r["key_shards"]:
            np.testing.assert_array_equal(data, expected_keys[4 * p : 4 * p + 4])
        for shape in ((16, 8), (1024, 512)):
            np.testing.assert_array_equal(r[shape]["replicated"], np.zeros(shape))
            np.testing.assert_array_equal(r[shape]["split"], np.zeros(shape))
            half = (shape[0] // 2, shape[1])
            expected = np.concatenate([np.zeros(half), np.ones(half)])
            np.testing.assert_array_equal(r[shape]["local"], expected)


# ---------------------------------------------------------------------------------
# save_safetensors: no process left waiting, no file left half-written.
# ---------------------------------------------------------------------------------


def _child_save_safetensors(directory):
    import contextlib
    import json
    import os
    import struct

    import safetensors.numpy
    from jax.experimental import multihost_utils
    from probes import file_size_limit

    p = jax.process_index()
    mesh = _mesh((2, 4), ("dp", "tp"))
    # 'k', 'w' and 'x' are gathered by both processes together, 'h' is on both.
    keys = jax.random.split(jax.random.key(0), 8)
    specs = {"w": P("dp", "tp"), "h": P(), "k": P("dp"), "x": P("dp")}
    placed = eqshard.shard({"w": W, "h": H, "k": keys, "x": -W}, specs, mesh)
    path = os.path.join(directory, "m.safetensors")
    out = {}

    def sync(name):
        multihost_utils.sync_global_devices(f"eqshard test: {name}")
        out[f"files after {name}"] = sorted(os.listdir(directory))

    def read():
        with open(path, "rb") as f:
            return f.read()

    # Together: every process returns once the file is complete, and reads it.
    eqshard.save_safetensors(path, placed, timeout=60)
    out["files at return"] = sorted(os.listdir(directory))
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), placed)
    specs = {"w": P("tp"), "h": P(None, "dp"), "k": P("tp"), "x": P(None, "dp")}
    loaded = eqshard.load_safetensors(path, like, specs, mesh)
    out["key_sharding"] = loaded["k"].sharding == NamedSharding(mesh, P("tp"))
    out["loaded"] = eqshard.gather(loaded)
    saved = read()
    (length,) = struct.unpack("<Q", saved[:8])
    w_starts = 8 + length + json.loads(saved[8 : 8 + length])["w"]["data_offsets"][0]
    sync("together")
    # Only process 0 saves: it raises after 1 s, and leaves nothing behind.
    other = os.path.join(directory, "other.safetensors")
    if p == 0:
        out["alone"] = _error(eqshard.save_safetensors, other, placed, timeout=1)
    sync("alone")
    # Process 1 makes the call late, when process 0 has given up: it raises too.
    if p == 1:
        out["late"] = _error(eqshard.save_safetensors, other, placed, timeout=1)
    sync("late")
    # Process 0 cannot write (no such directory): both raise, without waiting.
    missing = os.path.join(directory, "no", "m.safetensors")
    out["missing"] = _error(eqshard.save_safetensors, missing, placed, timeout=60)
    sync("missing")
    # Process 0's disk fills up in the middle of the file (in 'w'): it still takes
    # part in gathering 'x', then both raise, and the file saved before is intact.
    full = file_size_limit(w_starts + 100) if p == 0 else contextlib.nullcontext()
    with full:
        out["full"] = _error(
            eqshard.save_safetensors, path, placed, overwrite=True, timeout=60
        )
    sync("full")
    out["intact"] = read() == saved
    # All made the same calls, so the next one meets again.
    eqshard.save_safetensors(path, placed, overwrite=True, timeout=60)
    out["again"] = read() == saved
    out["bad_timeout"] = _error(eqshard.save_safetensors, path, placed, timeout=-1)
    # An int64 tensor whose rows 4-7, read by process 1 only (the 'dp' half of its
    # devices), do not fit int32 with x64 off: process 1 refuses, and process 0,
    # whose rows fit, must not go on with an array that is half read.
    wide = os.path.join(directory, "wide.safetensors")
    if p == 0:
        big = np.arange(8, dtype=np.int64) + np.where(np.arange(8) < 4, 0, 2**40)
        safetensors.numpy.save_file({"n": big}, wide)
    sync("wide")
    like = {"n": jax.ShapeDtypeStruct((8,), np.int32)}
    out["lossy"] = _error(eqshard.load_safetensors, wide, like, P("dp"), mesh)
    return out


@pytest.mark.slow
def test_save_safetensors_alone_or_failing_raises_everywhere(tmp_path):
    results = run_processes(
        _child_save_safetensors, args=(str(tmp_path),), timeout=RUN_TIMEOUT
    )
    path = str(tmp_path / "m.safetensors")
    for p, r in enumerate(results):
        assert r["files at return"] == ["m.safetensors"]
        np.testing.assert_array_equal(r["loaded"]["w"], W)
        np.testing.assert_array_equal(r["loaded"]["x"], -W)
        want = jax.random.key_data(jax.random.split(jax.random.key(0), 8))
        np.testing.assert_array_equal(r["loaded"]["k"].data, want)
        assert r["loaded"]["k"].impl == "threefry2x32" and r["key_sharding"]
        assert r["loaded"]["h"].tobytes() == H.tobytes()
        for step in ("together", "alone", "late", "missing", "full"):
            assert r[f"files after {step}"] == ["m.safetensors"], (p, step)
        assert r["intact"] and r["again"]
        assert r["bad_timeout"].startswith("eqshard.save_safetensors: timeout must")
        # Both raise: process 1 its own refusal, process 0 quoting it.
        said = (
            ""
            if p
            else "process 1 failed, so the safetensors files are not loaded "
            "on any process. It said: "
        )
        assert r["lossy"] is not None, f"process {p} returned a half-read array"
        assert r["lossy"].startswith(f"eqshard.load_safetensors: {said}"), r["lossy"]
        assert "'n'" in r["lossy"] and "int32" in r["lossy"], r["lossy"]
        # Process 0's own error; process 1 quotes it as process 0's.
        quoted = "process 0 failed, so {!r} is not written on any process. It said: "
        missing = str(tmp_path / "no" / "m.safetensors")
        said = quoted.format(missing) if p else ""
        assert r["missing"].startswith(
            f"eqshard.save_safetensors: {said}cannot write {missing!r}: there is no "
            f"directory {str(tmp_path / 'no')!r}"
        ), r["missing"]
        said = quoted.format(path) if p else ""
        assert r["full"].startswith(
            f"eqshard.save_safetensors: {said}could not write {path!r}: File too large"
        ), r["full"]
    for p, key in ((0, "alone"), (1, "late")):
        message = results[p][key]
        assert message is not None, f"process {p} did not raise"
        assert message.startswith(
            f"eqshard.save_safetensors: on process {p}, processes [0, 1] did not all "
            "make this call within 1 s, so the arrays at 'h', 'k', 'w', 'x' cannot be "
            "gathered"
        ), message
