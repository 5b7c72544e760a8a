"""Copies spread over the cores (`eqshard/_threads.py`): the same arrays as one
thread makes, and nothing a thread's JAX configuration would change."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqshard
from eqshard._move._threads import copy, spread, SPREAD_FROM


def _tree(dtype, count=4):
    """`count` leaves of about 2 MiB each (more than `SPREAD_FROM` in all), of
    distinct shapes and values."""
    rows = (2 << 20) // (256 * np.dtype(dtype).itemsize)
    tree = {
        f"w{k}": (np.arange((rows + 8 * k) * 256).reshape(-1, 256) * (k + 1)).astype(
            dtype
        )
        for k in range(count)
    }
    assert sum(v.nbytes for v in tree.values()) > SPREAD_FROM
    return tree


def _with_one_large_leaf(tree):
    """A leaf made of `tree`'s, larger than a core's share (this machine has 2),
    and a small one: gathered block by block."""
    big = np.concatenate(list(tree.values()) * 2)
    return {"big": big, "small": tree["w0"]}


def test_spread_runs_bins_on_threads_and_keeps_order():
    seen: dict[int, str] = {}

    def work(indices):
        for i in indices:
            seen[i] = threading.current_thread().name
        return [i * 10 for i in indices]

    weights = [3 << 20, 1 << 20, 2 << 20, 1 << 20]
    out = spread(work, weights, pinned=[False, True, False, False])
    assert out == [0, 10, 20, 30]
    assert seen[1] == threading.current_thread().name  # pinned: the caller's
    assert len(set(seen.values())) >= 2  # this machine has 2 cores

    seen.clear()
    assert spread(work, [1, 2, 3], pinned=[False] * 3) == [0, 10, 20]
    assert set(seen.values()) == {threading.current_thread().name}  # too small


def test_spread_raises_what_a_thread_raised():
    def work(indices):
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(f"a copying thread failed at {indices}")
        return list(indices)

    with pytest.raises(ValueError, match="a copying thread failed"):
        spread(work, [4 << 20, 4 << 20], pinned=[False, False])


@pytest.mark.parametrize("spec", [P("dp", "tp"), P("dp"), P()])
def test_large_numpy_trees_place_as_device_put_does(mesh, spec):
    tree = _tree(np.float32)
    out = eqshard.shard(tree, spec, mesh)
    for name, value in tree.items():
        want = jax.device_put(value, NamedSharding(mesh, spec))
        assert out[name].sharding == want.sharding
        for got, expected in zip(
            out[name].addressable_shards, want.addressable_shards, strict=True
        ):
            assert got.index == expected.index
            np.testing.assert_array_equal(
                np.asarray(got.data), np.asarray(expected.data)
            )
        value[...] = -1  # the caller's memory is not the devices'
        assert not np.any(np.asarray(out[name]) == -1)


@pytest.mark.parametrize("split", [False, True])
def test_large_device_resident_trees_move_and_gather_bit_exact(mesh, split):
    tree = _tree(np.float32)
    if split:  # gathered block by block
        tree = _with_one_large_leaf(tree)
    on_one = jax.device_put(tree, jax.devices()[0])
    out = eqshard.shard(on_one, P("dp", "tp"), mesh)
    back = eqshard.gather(out)
    for name, value in tree.items():
        assert out[name].sharding == NamedSharding(mesh, P("dp", "tp"))
        assert isinstance(back[name], np.ndarray)
        assert back[name].tobytes() == value.tobytes()


@pytest.mark.parametrize("resident", [False, True])
def test_int64_keeps_the_callers_x64_context(mesh, resident):
    # With x64 off globally and on in this thread's context, a copy made on
    # another thread would narrow int64 to int32 (2**40 * k becomes 0).
    assert not jax.enable_x64.value
    with jax.enable_x64(True):
        tree = {k: v * 2**40 for k, v in _tree(np.int64).items()}
        source = jax.device_put(tree, jax.devices()[0]) if resident else tree
        out = eqshard.shard(source, P("dp"), mesh)
        for name, value in tree.items():
            assert out[name].dtype == jnp.int64
            np.testing.assert_array_equal(np.asarray(out[name]), value)


def test_transfer_guards_see_every_array(mesh, capfd):
    # A guard holds on the calling thread only: with one set, nothing is spread.
    tree = _tree(np.float32)
    capfd.readouterr()
    with jax.transfer_guard_host_to_device("log_explicit"):
        eqshard.shard(tree, P("dp"), mesh)
    logged = capfd.readouterr().err
    for value in tree.values():
        rows, columns = value.shape
        assert f"float32[{rows},{columns}]" in logged


@pytest.mark.parametrize(
    "dtype, shape",
    [
        (np.float32, (SPREAD_FROM // 4 // 7 + 3, 7)),  # rows that do not split evenly
        (jnp.bfloat16, (SPREAD_FROM // 2 // 4, 4)),  # NumPy's loops hold the GIL
        (np.float32, (1, SPREAD_FROM // 4)),  # one row
        (np.int8, (5,)),  # small
    ],
    ids=str,
)
def test_copy_gives_the_source_bit_for_bit(dtype, shape):
    rng = np.random.default_rng(0)
    source = rng.standard_normal(shape).astype(dtype)[..., ::-1]  # strided
    out = np.empty(shape, dtype)
    copy(out, source)
    np.testing.assert_array_equal(out.view(np.uint8), source.copy().view(np.uint8))
