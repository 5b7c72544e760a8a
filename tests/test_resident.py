# The "program" route of `_resident.py` (GPU and TPU) runs on CPU devices too, so
# it is tested here by calling it directly; `shard` takes the host route on CPU
# (tests/test_shard.py).

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from probes import Compiles

from eqshard._resident import move_in_programs, route


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
    assert lost == [(0, 4, 1e6)]


def test_route(mesh):
    placed = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("dp")))
    same = NamedSharding(mesh, P("dp"))
    assert route(np.ones(4), same, None) is None  # NumPy: `device_put`'s own path
    assert route(placed, same, None) is None  # already as asked
    assert route(placed, NamedSharding(mesh, P("tp")), None) == "host"  # on CPU
    assert route(placed, same, np.dtype(jnp.bfloat16)) == "host"
    key = jax.device_put(jax.random.key(0))
    assert route(key, NamedSharding(mesh, P()), None) is None  # keys: device_put
