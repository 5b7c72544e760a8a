# The "program" route of `_resident.py` (GPU and TPU) runs on CPU devices too, so
# it is tested here by calling it directly; `shard` takes the "blocks" route on CPU
# (here and in tests/test_shard.py).

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from probes import Compiles

from eqshard._move._host import Lost
from eqshard._move._resident import move_blocks, move_in_programs, route


_VALUES = [
    np.arange(8 * 12, dtype=np.float32).reshape(8, 12) / 7,
    np.linspace(-3, 3, 16 * 4, dtype=np.float32).reshape(16, 4),
    np.arange(8, dtype=np.int32),
    np.float32(1.25),
]
_SPECS = [P("dp", "tp"), P("tp", "dp"), P("dp"), P()]


@pytest.mark.parametrize("cast", [None, jnp.bfloat16])
@pytest.mark.parametrize("source", ["one device", "(2, 4) mesh"])
def test_one_program_places_every_array_bit_exact(mesh, source, cast):
    # (2, 4) -> (4, 2) over the same devices in the same order: the restore case.
    target = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    if source == "one device":
        arrays = [jax.device_put(v, jax.devices()[5]) for v in _VALUES]
    else:
        arrays = [jax.device_put(v, NamedSharding(mesh, P())) for v in _VALUES]
        arrays[0] = jax.device_put(arrays[0], NamedSharding(mesh, P("dp", "tp")))
    shardings = [NamedSharding(target, s) for s in _SPECS]
    casts = [
        None if cast is None or v.dtype != np.float32 else np.dtype(cast)
        for v in _VALUES
    ]
    with Compiles() as compiles:
        out, lost = move_in_programs(arrays, shardings, casts)
    assert compiles.count <= 1 and lost == []
    for array, value, sharding, c in zip(out, _VALUES, shardings, casts):
        want = value if c is None else value.astype(c)
        assert array.sharding == sharding and array.dtype == want.dtype
        assert np.asarray(array).tobytes() == want.tobytes()
    with Compiles() as compiles:  # the same tree again: nothing compiles
        move_in_programs(arrays, shardings, casts)
    assert compiles.count == 0


def test_casts_that_overflow_are_counted(mesh):
    values = [np.array([1e6, -3e5, 1.0, 2.0] * 2, np.float32), np.ones(8, np.float32)]
    arrays = [jax.device_put(v, jax.devices()[0]) for v in values]
    shardings = [NamedSharding(mesh, P("dp"))] * 2
    _, lost = move_in_programs(arrays, shardings, [np.dtype(np.float16)] * 2)
    assert lost == [(0, Lost(np.dtype(np.float16), 4, 1e6))]


def test_route(mesh):
    placed = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("dp")))
    same = NamedSharding(mesh, P("dp"))
    assert route(np.ones(4), same, None) is None  # NumPy: `device_put`'s own path
    assert route(placed, same, None) is None  # already as asked
    assert route(placed, NamedSharding(mesh, P("tp")), None) == "blocks"  # on CPU
    assert route(placed, same, np.dtype(jnp.bfloat16)) == "blocks"  # casts too
    key = jax.device_put(jax.random.key(0))
    assert route(key, NamedSharding(mesh, P()), None) is None  # keys: device_put


def _buffers(array):
    return [
        (a.unsafe_buffer_pointer(), a.unsafe_buffer_pointer() + a.nbytes)
        for a in (array.addressable_data(k) for k in range(len(array.devices())))
    ]


def test_blocks_route_copies_every_block_once_bit_exact(mesh):
    # Sources and targets whose blocks line up, nest, overlap several source
    # blocks, or repeat (replicated), on the same devices in another order too.
    permuted = np.array(jax.devices())[[6, 1, 4, 3, 2, 5, 0, 7]].reshape(4, 2)
    other = jax.sharding.Mesh(permuted, ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    value = np.arange(8 * 12, dtype=np.float32).reshape(8, 12) / 7
    cases = [
        (jax.devices()[3], P("dp", "tp")),
        (NamedSharding(other, P("tp", "dp")), P("dp", "tp")),
        (NamedSharding(other, P("dp", "tp")), P("dp", "tp")),
        (NamedSharding(mesh, P("tp", None)), P(None, "dp")),
        (NamedSharding(mesh, P()), P("tp", "dp")),
        (NamedSharding(mesh, P("dp", "tp")), P()),
        (NamedSharding(mesh, P("dp")), P(("dp", "tp"))),
    ]
    sources = [jax.device_put(value, where) for where, _ in cases]
    sources.append(jax.device_put(np.arange(8, dtype=jnp.bfloat16), jax.devices()[0]))
    sources.append(jax.device_put(np.int32(7), NamedSharding(other, P())))
    sources.append(jax.device_put(np.zeros((0, 4), np.int8), jax.devices()[1]))
    specs = [spec for _, spec in cases] + [P("tp"), P(), P(None, "tp")]
    shardings = [NamedSharding(mesh, spec) for spec in specs]
    # Every float32 array again, cast to bfloat16 as it is copied.
    sources += sources[: len(cases)]
    shardings += shardings[: len(cases)]
    casts = [None] * (len(sources) - len(cases)) + [np.dtype(jnp.bfloat16)] * len(cases)
    wants = [
        np.asarray(x).astype(c if c is not None else x.dtype)
        for x, c in zip(sources, casts)
    ]
    with Compiles() as compiles:
        out, lost = move_blocks(sources, shardings, casts)
    assert compiles.count == 0 and lost == []
    for array, source, want, sharding in zip(out, sources, wants, shardings):
        assert array.sharding == sharding and array.dtype == want.dtype
        # Copies: no block of the result lies in the source's buffers.
        for start, _ in _buffers(array):
            assert not any(lo <= start < hi for lo, hi in _buffers(source))
        assert np.asarray(array).tobytes() == want.tobytes()


def test_blocks_route_counts_what_a_cast_loses_once_per_value(mesh):
    # Replicated on the target: each block is on two devices, counted once.
    value = np.array([[1e6, -3e5, 1.0, 2.0]] * 8, np.float32)
    source = jax.device_put(value, NamedSharding(mesh, P("dp", "tp")))
    target = NamedSharding(mesh, P("tp"))
    _, lost = move_blocks([source], [target], [np.dtype(np.float16)])
    ((position, found),) = lost
    assert (position, found.number, found.extreme) == (0, 16, 1e6)
    assert found.dtype == np.float16
