"""The CPU copy engine (`eqshard/_move/_copies.py`) and its plain route
(`EQSHARD_PLAIN_ROUTES=copies`: `jax.device_put`, `jax.device_get`) give the same
arrays, bit for bit, on the same shardings; and a read of XLA:CPU's buffers that
meets something unknown takes the plain route, saying so once."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from probes import aligned

import eqshard
from eqshard._internals import cpu, routes


SPECS = [P("dp", "tp"), P(("dp", "tp")), P(None, "tp"), P("tp"), P()]
DTYPES = [np.float32, ml_dtypes.bfloat16, np.int8]


def _tree(dtype):
    """Leaves of distinct shapes and values, over 4 MiB in all for float32 (so the
    fast route spreads its copies over the cores), one of them aligned (which
    XLA's CPU client may take in place), one a strided view."""
    base = np.arange(520 * 1024, dtype=np.float32).reshape(520, 1024) % 251 - 125
    big = aligned(base.shape, np.dtype(dtype))
    big[...] = base.astype(dtype)
    return {
        "big": big,
        "rows": (base[:512] * 3 % 127).astype(dtype),
        "strided": (base[:, ::2] % 97).astype(dtype),
        "layers": [(base[:64] + k).astype(dtype) for k in range(3)],
    }


# The reads of XLA:CPU's buffers, and the assumptions about them, that the fast
# route rests on and the plain one never makes.
_READS = (
    "device_buffer",
    "buffer_address",
    "aligned_empty",
    "aligned_blocks",
    "has_dense_block",
)


def _both(monkeypatch, run):
    """`run()` on the fast route, then on the plain one (which must not read
    XLA:CPU's buffers)."""
    monkeypatch.delenv(routes.VARIABLE, raising=False)
    fast = run()
    monkeypatch.setenv(routes.VARIABLE, "copies")
    with monkeypatch.context() as patch:
        for name in _READS:
            patch.setattr(cpu, name, _not_on_the_plain_route)
        plain = run()
    monkeypatch.delenv(routes.VARIABLE)
    return fast, plain


def _not_on_the_plain_route(*args, **kwargs):
    raise AssertionError("the plain route read XLA:CPU's buffers")


def _bits(x):
    return np.asarray(x).view(np.uint8)


def _assert_same_arrays(fast, plain):
    """The same leaves, bit for bit, and the same shardings, shard by shard."""
    fast_leaves, fast_def = jax.tree.flatten(fast)
    plain_leaves, plain_def = jax.tree.flatten(plain)
    assert fast_def == plain_def
    for a, b in zip(fast_leaves, plain_leaves, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        if isinstance(a, jax.Array):
            assert a.sharding == b.sharding
            for x, y in zip(a.addressable_shards, b.addressable_shards, strict=True):
                assert x.device == y.device and x.index == y.index
                np.testing.assert_array_equal(_bits(x.data), _bits(y.data))
        np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_shard_same_on_both_routes(mesh, monkeypatch, spec, dtype):
    tree = _tree(dtype)
    expected = jax.tree.map(np.copy, tree)

    def run():
        placed = eqshard.shard(tree, spec, mesh)
        for leaf in jax.tree.leaves(tree):
            leaf[...] = 0  # the caller's next batch: nothing placed changes
        out = jax.tree.map(np.asarray, placed)
        jax.tree.map(lambda x, e: x.__setitem__(..., e), tree, expected)
        return placed, out

    (fast, fast_values), (plain, plain_values) = _both(monkeypatch, run)
    _assert_same_arrays(fast, plain)
    for got in (fast_values, plain_values):
        jax.tree.map(
            lambda x, e: np.testing.assert_array_equal(_bits(x), _bits(e)),
            got,
            expected,
        )
    assert fast["big"].sharding == NamedSharding(mesh, spec)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_gather_same_on_both_routes(mesh, monkeypatch, dtype):
    tree = _tree(dtype)
    specs = {"big": P("dp", "tp"), "rows": P(), "strided": P("tp"), "layers": P("dp")}
    placed = eqshard.shard(tree, specs, mesh)
    fast, plain = _both(monkeypatch, lambda: eqshard.gather(placed))
    _assert_same_arrays(fast, plain)
    for got in (fast, plain):
        for value, leaf in zip(jax.tree.leaves(got), jax.tree.leaves(tree)):
            assert value.flags.writeable and value.flags.owndata
            np.testing.assert_array_equal(_bits(value), _bits(leaf))


@pytest.mark.parametrize("cast", [None, jnp.bfloat16], ids=["same dtype", "bf16"])
@pytest.mark.parametrize(
    ("source", "target"),
    [(P("dp", "tp"), P("tp", "dp")), (P(), P(None, "tp")), (P("tp"), P())],
    ids=str,
)
def test_resident_moves_same_on_both_routes(mesh, monkeypatch, source, target, cast):
    tree = jax.tree.map(jnp.asarray, _tree(np.float32))
    on_source = eqshard.shard(tree, source, mesh)
    fast, plain = _both(
        monkeypatch, lambda: eqshard.shard(on_source, target, mesh, dtype=cast)
    )
    _assert_same_arrays(fast, plain)
    for value, leaf in zip(jax.tree.leaves(fast), jax.tree.leaves(tree)):
        assert value.sharding == NamedSharding(mesh, target)
        want = np.asarray(leaf) if cast is None else np.asarray(leaf).astype(cast)
        np.testing.assert_array_equal(_bits(value), _bits(want))


def test_lossy_cast_refused_on_both_routes(mesh, monkeypatch):
    x = eqshard.shard(jnp.full((64, 64), 1e5, jnp.float32), P("dp"), mesh)
    for plain in (False, True):
        if plain:
            monkeypatch.setenv(routes.VARIABLE, "copies")
        with pytest.raises(ValueError, match="4096 of its finite values"):
            eqshard.shard({"w": x}, P("tp"), mesh, dtype=jnp.float16)


def _unrecognised(*args, **kwargs):
    raise routes.Unrecognised("a test's device buffer")


def test_unrecognised_buffer_takes_the_plain_route_and_warns_once(mesh, monkeypatch):
    monkeypatch.setattr(routes, "_warned", set())
    tree = _tree(np.float32)
    placed = eqshard.shard(tree, P("dp", "tp"), mesh)
    monkeypatch.setattr(cpu, "device_buffer", _unrecognised)
    monkeypatch.setattr(cpu, "buffer_address", _unrecognised)
    with pytest.warns(RuntimeWarning, match="'copies'.*a test's device buffer") as met:
        host = eqshard.gather(placed)  # to host
        moved = eqshard.shard(placed, P("tp", "dp"), mesh)  # between shardings
        again = eqshard.shard(tree, P(("dp", "tp")), mesh)  # addresses compared
        for leaf in jax.tree.leaves(tree):
            leaf[...] = 0
    assert len(met) == 1
    monkeypatch.undo()
    expected = _tree(np.float32)
    for value, want in zip(jax.tree.leaves(host), jax.tree.leaves(expected)):
        assert value.flags.writeable and value.flags.owndata
        np.testing.assert_array_equal(value, want)
    for out, spec in ((moved, P("tp", "dp")), (again, P(("dp", "tp")))):
        for value, want in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
            assert value.sharding == NamedSharding(mesh, spec)
            np.testing.assert_array_equal(np.asarray(value), want)


@pytest.mark.parametrize(
    "shapes",
    [
        [(3, 5), (7,), (2, 2, 3), (1, 1)],  # small: one allocation each
        [(512, 1024), (300, 1024), (7,)],  # 1 MiB on average: one slab
    ],
)
def test_aligned_blocks_are_aligned_separate_and_of_their_shapes(shapes):
    blocks = cpu.aligned_blocks(shapes, np.dtype(np.float32))
    assert [b.shape for b in blocks] == shapes
    spans = []
    for k, block in enumerate(blocks):
        assert block.dtype == np.float32 and block.flags.c_contiguous
        assert block.flags.writeable and block.ctypes.data % 64 == 0
        block[...] = k
        spans.append((block.ctypes.data, block.ctypes.data + block.nbytes))
    for k, block in enumerate(blocks):  # no write reached another block
        assert np.all(block == k)
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
