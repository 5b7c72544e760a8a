# A state moved across two real processes (4 devices each): between two layouts
# of the same 8 devices (JAX's cross-process `device_put`), and onto 4 of them, two
# per process (through the hosts, where JAX's move refuses another set of devices).
# The expected values are the host data placed, made here.

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec as P
from multihost import run_processes

import eqshard


W = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
B = np.arange(8, dtype=np.int32) * 3
KEYS = np.arange(16, dtype=np.uint32).reshape(8, 2)
SPECS = {"w": P("dp", "tp"), "b": P("tp"), "key": P("dp")}


def _mesh(shape, devices):
    grid = np.array(devices, dtype=object).reshape(shape)
    return Mesh(grid, ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)


def _child_reshard():
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    state = {"w": W, "b": B, "key": eqshard.HostKey(KEYS, "threefry2x32")}
    state = eqshard.shard(state, SPECS, _mesh((2, 4), devices))
    out = {}
    other = _mesh((4, 2), devices)
    plan = eqshard.shard_plan(state, SPECS, other)
    out["same_devices_routes"] = sorted({row.route for row in plan.rows})
    old = state["w"]
    state = eqshard.shard(state, SPECS, other, donate=True)
    out["old_deleted"] = old.is_deleted()
    out["after_other"] = eqshard.gather(
        {"w": state["w"], "b": state["b"], "key": jax.random.key_data(state["key"])}
    )
    # Two devices of each process: another device count, spanning both.
    subset = _mesh((2, 2), devices[0:2] + devices[4:6])
    plan = eqshard.shard_plan(state, SPECS, subset, donate=True, max_inflight_bytes=128)
    out["subset_routes"] = sorted({row.route for row in plan.rows})
    state = eqshard.shard(state, SPECS, subset, donate=True, max_inflight_bytes=128)
    out["subset_devices"] = sorted(
        (d.process_index, devices.index(d)) for d in state["w"].sharding.device_set
    )
    out["after_subset"] = eqshard.gather(
        {"w": state["w"], "b": state["b"], "key": jax.random.key_data(state["key"])}
    )
    eqshard.check_layout(state, SPECS, subset)
    return out


@pytest.mark.slow
def test_a_state_moves_across_two_processes():
    results = run_processes(_child_reshard)
    want = {"w": W, "b": B, "key": KEYS}
    for r in results:
        assert r["same_devices_routes"] == ["device to device"]
        assert r["old_deleted"]
        assert r["subset_routes"] == ["through the host"]
        assert r["subset_devices"] == [(0, 0), (0, 1), (1, 4), (1, 5)]
        for name in want:
            np.testing.assert_array_equal(r["after_other"][name], want[name])
            np.testing.assert_array_equal(r["after_subset"][name], want[name])
