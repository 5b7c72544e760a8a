# A data pipeline's batch, sharded again with the plan `shard` kept for it: the
# check runs once per (structure, specs, mesh, shapes, dtypes), and everything
# the plan does not cover is still checked on every call. Whether a call checked
# is seen by counting the calls of the check itself (`_shard.leaves_of`).

import threading

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqshard
from eqshard._move import _shard


@pytest.fixture
def checks(monkeypatch):
    """The number of trees `shard` has checked since the test began."""
    eqshard.clear_caches()
    count = [0]
    check = _shard.leaves_of

    def counted(*args, **kwargs):
        count[0] += 1
        return check(*args, **kwargs)

    monkeypatch.setattr(_shard, "leaves_of", counted)
    return count


def _batch(step, rows=8):
    return {
        "tokens": np.arange(rows * 16, dtype=np.int32).reshape(rows, 16) + step,
        "mask": np.ones((rows, 16), np.bool_),
    }


def _assert_placed(out, batch, mesh, spec):
    for name, value in batch.items():
        assert out[name].sharding == NamedSharding(mesh, spec), name
        np.testing.assert_array_equal(np.asarray(out[name]), value)


def test_a_batch_is_checked_once_and_placed_right_every_step(mesh, checks):
    for step in range(3):
        batch = _batch(step)
        _assert_placed(eqshard.shard(batch, P("dp"), mesh), batch, mesh, P("dp"))
    assert checks[0] == 1
    batch = _batch(0, rows=16)  # another shape: checked again
    _assert_placed(eqshard.shard(batch, P("dp"), mesh), batch, mesh, P("dp"))
    assert checks[0] == 2


def test_a_shape_the_spec_cannot_split_is_refused_after_a_plan(mesh, checks):
    eqshard.shard(_batch(0), P("dp", "tp"), mesh)
    with pytest.raises(ValueError, match="tokens"):
        eqshard.shard(_batch(0, rows=3), P("dp", "tp"), mesh)


def test_the_mesh_set_by_jax_set_mesh_is_part_of_the_plan(mesh, checks):
    other = jax.make_mesh(
        (4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()
    )
    batch = _batch(0)
    for current in (mesh, other, mesh):
        with jax.set_mesh(current):
            out = eqshard.shard(batch, P("dp", "tp"))
        _assert_placed(out, batch, current, P("dp", "tp"))
    assert checks[0] == 2


def test_a_spec_tree_and_leaves_left_on_host(mesh, checks):
    specs = {"tokens": P("dp"), "mask": None}
    for step in range(2):
        batch = _batch(step)
        out = eqshard.shard(batch, specs, mesh)
        assert out["mask"] is batch["mask"]
        np.testing.assert_array_equal(np.asarray(out["tokens"]), batch["tokens"])
        assert out["tokens"].sharding == NamedSharding(mesh, P("dp"))
    assert checks[0] == 1


def test_values_a_cast_loses_are_refused_on_every_call(mesh, checks):
    # float64 becomes float32 while `jax_enable_x64` is off: no plan is kept, and
    # the values are checked each time.
    fine = np.ones((8, 4), np.float64)
    assert eqshard.shard(fine, P("dp"), mesh).dtype == np.float32
    with pytest.raises(ValueError, match="float32"):
        eqshard.shard(np.full((8, 4), 1e300), P("dp"), mesh)
    assert checks[0] == 2


def test_a_cast_asked_for_is_made_on_every_call(mesh, checks):
    # `np.dtype("float64") == None` holds in NumPy: the cast must not be taken
    # for no cast at all.
    with jax.enable_x64(True):
        for _ in range(2):
            out = eqshard.shard(_batch(0), P("dp"), mesh, dtype=np.dtype("float64"))
            assert out["tokens"].dtype == np.int32  # only floats are cast
            out = eqshard.shard(
                np.ones((8, 4), np.float32), P("dp"), mesh, dtype=np.dtype("float64")
            )
            assert out.dtype == np.float64
    assert checks[0] == 4


def test_one_array_at_two_leaves_stays_one(mesh, checks):
    for _ in range(2):
        x = np.arange(32, dtype=np.float32).reshape(8, 4)
        out = eqshard.shard({"a": x, "b": x}, P("dp"), mesh)
        assert out["a"] is out["b"]
    y = np.arange(32, dtype=np.float32).reshape(8, 4)
    out = eqshard.shard({"a": y, "b": y + 1}, P("dp"), mesh)  # same key, untied
    assert out["a"] is not out["b"]
    np.testing.assert_array_equal(np.asarray(out["b"]), y + 1)


def test_clear_caches_and_the_plain_route_check_again(mesh, checks, monkeypatch):
    batch = _batch(0)
    eqshard.shard(batch, P("dp"), mesh)
    eqshard.clear_caches()
    eqshard.shard(batch, P("dp"), mesh)
    assert checks[0] == 2
    monkeypatch.setenv("EQSHARD_PLAIN_ROUTES", "copies")
    _assert_placed(eqshard.shard(batch, P("dp"), mesh), batch, mesh, P("dp"))
    assert checks[0] == 3


class _Named(eqx.Module):
    x: np.ndarray
    names: list = eqx.field(static=True)


def test_a_static_field_is_part_of_the_structure(mesh, checks):
    for names in (["x"], ["x"], ["y"]):
        module = _Named(np.full((8, 4), len(names), np.float32), names)
        out = eqshard.shard(module, P("dp"), mesh)
        assert out.names == names
        np.testing.assert_array_equal(np.asarray(out.x), module.x)
    assert checks[0] == 2


class _Ambiguous:
    """A static field that cannot say whether it equals another, as a NumPy
    array cannot."""

    def __eq__(self, other):
        raise ValueError("ambiguous")

    __hash__ = object.__hash__


class _Holds(eqx.Module):
    x: np.ndarray
    table: _Ambiguous = eqx.field(static=True)


def test_a_static_field_that_cannot_be_compared_is_checked_every_call(mesh, checks):
    for step in range(3):
        module = _Holds(np.full((8, 4), step, np.float32), _Ambiguous())
        out = eqshard.shard(module, P("dp"), mesh)
        np.testing.assert_array_equal(np.asarray(out.x), module.x)
    assert checks[0] == 3


def test_batches_sharded_from_two_threads_at_once(mesh):
    # A prefetching loader shards from a thread of its own while the main thread
    # shards too: each thread's batches land whole, with their own plans.
    def run(rows, spec, results):
        for step in range(20):
            batch = _batch(step, rows)
            out = eqshard.shard(batch, spec, mesh)
            results.append((batch, out, spec))

    results_a, results_b = [], []
    # 5 MiB replicated batches: private copies split over the cores meanwhile.
    other = threading.Thread(target=run, args=(1 << 16, P(), results_b))
    other.start()
    run(8, P("dp"), results_a)
    other.join(timeout=60)
    assert not other.is_alive()
    assert len(results_a) == len(results_b) == 20
    for batch, out, spec in results_a + results_b:
        _assert_placed(out, batch, mesh, spec)
