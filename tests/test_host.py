# NumPy data handed to eqshard is the caller's again as soon as the call returns:
# a data loader writes its buffer at once, and nothing on the mesh changes.
# `jax.device_put` returns before its transfers are done (and on CPU may keep a
# NumPy source as a device buffer), so each route is tried 20 times with an array
# over 1 MiB, written right after each call.

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from probes import aligned

import eqshard


_CALLS = 20
_SHAPE = (512, 1024)  # 2 MiB of float32


def _changed_after_write(place, busy=None, *, in_place=False):
    """Elements that changed on the mesh when the buffer was written right after
    each of `_CALLS` calls of `place(buffer)`, against a copy made before. With
    `in_place`, the buffers are 64-byte aligned, which XLA's CPU client may read
    in place; with `busy`, the devices are first given work of their own (so a
    program that reads the buffer runs only after `place` returned)."""
    changed = 0
    for step in range(_CALLS):
        start = np.arange(np.prod(_SHAPE), dtype=np.float32).reshape(_SHAPE) + step
        buffer = aligned(_SHAPE, np.float32) if in_place else start
        buffer[...] = start
        expected = buffer.copy()
        if busy is not None:
            busy()
        placed = place(buffer)
        buffer[...] = -1.0  # the loader's next batch
        changed += int(np.count_nonzero(np.asarray(placed) != expected))
    return changed


@pytest.mark.parametrize(
    "spec",
    [P("dp"), P("tp"), P(None, "tp"), P(), P("dp", "tp"), P(("dp", "tp")), "one"],
    ids=str,
)
def test_shard_reads_no_host_buffer_after_it_returns(mesh, spec):
    if spec == "one":  # one device
        one = Mesh(np.array(jax.devices()[:1]), ("x",))
        spec = NamedSharding(one, P())
    assert _changed_after_write(lambda b: eqshard.shard(b, spec, mesh)) == 0


def test_shard_reads_no_host_buffer_in_a_tree(mesh):
    specs = {"a": P("dp"), "b": P("tp"), "c": P()}

    def place(buffer):
        out = eqshard.shard(
            {"a": buffer, "b": buffer[:, ::2], "c": buffer}, specs, mesh
        )
        return np.concatenate([np.asarray(out["a"]), np.asarray(out["c"])])

    changed = 0
    for step in range(_CALLS):
        buffer = aligned(_SHAPE, np.float32)
        buffer[...] = np.arange(buffer.size, dtype=np.float32).reshape(_SHAPE) + step
        expected = np.concatenate([buffer, buffer])
        placed = place(buffer)
        buffer[...] = -1.0
        changed += int(np.count_nonzero(placed != expected))
    assert changed == 0


@pytest.fixture(scope="module")
def busy(mesh):
    """Gives every device of `mesh` a few milliseconds of work, asynchronously:
    the programs called next wait for it."""
    square = jax.jit(
        lambda a: jax.lax.fori_loop(0, 8, lambda _, a: a @ a * 1e-3, a),
        out_shardings=NamedSharding(mesh, P()),
    )
    start = jax.device_put(np.eye(128, dtype=np.float32), NamedSharding(mesh, P()))
    return lambda: square(start)


def test_filter_jit_reads_no_host_buffer_after_it_returns(mesh, busy):
    flat = eqshard.filter_jit(lambda x: x * 2.0, in_specs=(P("dp"),), mesh=mesh)
    tree = eqshard.filter_jit(
        lambda t: t["x"] * 2.0, in_specs=({"x": P("tp")},), mesh=mesh
    )
    assert _changed_after_write(lambda b: flat(b) / 2.0, busy, in_place=True) == 0
    assert (
        _changed_after_write(lambda b: tree({"x": b}) / 2.0, busy, in_place=True) == 0
    )


def test_init_sharded_reads_no_host_buffer_after_it_returns(mesh, busy):
    def build(x):
        return {"w": x * 2.0}

    def place(buffer):
        built = eqshard.init_sharded(build, buffer, specs={"w": P("dp")}, mesh=mesh)
        return built["w"] / 2.0

    assert _changed_after_write(place, busy) == 0


def test_eager_shard_map_reads_no_host_buffer_after_it_returns(mesh, busy):
    doubled = eqshard.filter_shard_map(
        lambda x: x * 2.0, mesh=mesh, in_specs=P("dp"), out_specs=P("dp")
    )
    assert _changed_after_write(lambda b: doubled(b) / 2.0, busy, in_place=True) == 0


def test_host_private_copies_plain_numpy_only():
    from eqshard._move._host import host_private

    masked = np.ma.masked_array([1.0, 2.0], mask=[False, True])
    plain = np.ones(3, np.float32)
    tree = {"m": masked, "p": plain, "s": np.float32(1.0), "j": jax.numpy.ones(2)}
    out = host_private(tree)
    assert out["m"] is masked  # JAX refuses masked arrays itself
    assert out["s"] is tree["s"] and out["j"] is tree["j"]
    assert not np.shares_memory(out["p"], plain)
    np.testing.assert_array_equal(out["p"], plain)
    no_numpy = {"j": jax.numpy.ones(2)}
    assert host_private(no_numpy) is no_numpy


def test_big_endian_arguments_are_read_in_native_order(mesh):
    # `jax.jit` refuses big-endian NumPy arrays ("Error interpreting argument");
    # `shard` converts them, and so do the calls that hand JAX a private copy.
    x = np.arange(32, dtype=">f4").reshape(8, 4)
    jitted = eqshard.filter_jit(lambda a: a * 2, in_specs=(P("dp"),), mesh=mesh)
    mapped = eqshard.filter_shard_map(
        lambda a: a * 2, in_specs=(P("dp"),), out_specs=P("dp"), mesh=mesh
    )
    for out in (jitted(x), mapped(x)):
        assert out.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(out), x * 2)
