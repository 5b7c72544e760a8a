import copy

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import eqshard


def _put(x, mesh, spec, memory_kind=None):
    return jax.device_put(x, NamedSharding(mesh, spec, memory_kind=memory_kind))


@pytest.fixture(scope="module")
def reversed_mesh(mesh):
    devices = np.array(list(mesh.devices.flat)[::-1]).reshape(2, 4)
    return Mesh(devices, ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)


def test_a_tree_laid_out_as_asked_passes(mesh):
    model = eqx.nn.Linear(4, 8, key=jax.random.key(0))
    specs = eqx.tree_at(lambda m: (m.weight, m.bias), model, (P("tp", None), P()))
    placed = eqshard.shard(model, specs, mesh)
    report = eqshard.check_layout(placed, specs, mesh)
    assert report.ok and report.checked == 2 and report.mismatches == ()
    assert str(report) == "2 arrays checked: all laid out as asked."
    # The same placement written otherwise, NamedShardings, and the set mesh.
    same = eqx.tree_at(lambda m: (m.weight, m.bias), specs, (P("tp"), P(None)))
    eqshard.check_layout(placed, same, mesh)
    eqshard.check_layout(placed, eqshard.named_shardings(specs, mesh))
    with jax.set_mesh(mesh):
        eqshard.check_layout(placed, specs)


def test_every_misplaced_array_is_listed_in_one_error(mesh, reversed_mesh):
    tree = {
        "good": _put(jnp.zeros((8, 4)), mesh, P("dp", "tp")),
        "single": jnp.zeros((8, 4)),
        "wrong_spec": _put(jnp.zeros((8, 4)), mesh, P("dp")),
        "other_mesh": _put(jnp.zeros((8, 4)), reversed_mesh, P("dp", "tp")),
        "host": _put(jnp.zeros((8, 4)), mesh, P("dp", "tp"), "pinned_host"),
        "numpy": np.zeros((8, 4)),
        "unchecked": jnp.zeros(3),
        "n": 3,
    }
    specs = {name: P("dp", "tp") for name in tree} | {"unchecked": None, "n": None}
    with pytest.raises(ValueError, match="5 arrays are not laid out") as info:
        eqshard.check_layout(tree, specs, mesh)
    lines = {
        line.split("'")[1]: line
        for line in str(info.value).splitlines()
        if line.startswith("  - ")
    }
    assert set(lines) == {"single", "wrong_spec", "other_mesh", "host", "numpy"}
    assert "single device" in lines["single"]
    assert "has spec P('dp',)" in lines["wrong_spec"]
    assert "another mesh" in lines["other_mesh"]
    assert "'pinned_host' memory, not 'device'" in lines["host"]
    assert "NumPy" in lines["numpy"]


def test_a_single_device_array_is_not_replicated(mesh):
    state = {"mu": jnp.zeros(4)}
    with pytest.raises(ValueError, match="'mu'.*single device"):
        eqshard.check_layout(state, P(), mesh)
    replicated = {"mu": _put(jnp.zeros(4), mesh, P())}
    eqshard.check_layout(replicated, P(), mesh)


def test_host_memory_asked_for_is_checked(mesh):
    host = NamedSharding(mesh, P("dp"), memory_kind="pinned_host")
    x = {"w": jax.device_put(jnp.zeros(8), host)}
    eqshard.check_layout(x, host)
    with pytest.raises(ValueError, match="'w'.*'device' memory, not 'pinned_host'"):
        eqshard.check_layout({"w": _put(jnp.zeros(8), mesh, P("dp"))}, {"w": host})


def test_abstract_arrays_are_checked_by_the_sharding_they_carry(mesh):
    abstract = mesh.abstract_mesh
    tree = {
        "a": jax.ShapeDtypeStruct(
            (8,), jnp.float32, sharding=NamedSharding(abstract, P("dp"))
        ),
        "b": jax.ShapeDtypeStruct((8,), jnp.float32),
    }
    eqshard.check_layout(tree, {"a": P("dp"), "b": None}, abstract)
    with pytest.raises(ValueError, match="'b'.*no sharding"):
        eqshard.check_layout(tree, P("dp"), abstract)


def test_partition_specs_need_a_mesh():
    with pytest.raises(ValueError, match="'w'.*no mesh"):
        eqshard.check_layout({"w": jnp.zeros(2)}, P())


def test_specs_that_are_not_a_prefix_name_the_path(mesh):
    with pytest.raises(ValueError, match="w"):
        eqshard.check_layout({"w": jnp.zeros(2)}, {"v": P()}, mesh)


def test_a_deleted_array_is_reported(mesh):
    donated = _put(jnp.zeros((8, 4)), mesh, P("dp"))
    donated.delete()  # as donating it to a jitted call does
    with pytest.raises(ValueError, match=r"(?s)1 array is not.*'opt/mu'.*deleted"):
        eqshard.check_layout({"opt": {"mu": donated}}, P("dp"), mesh)


def test_a_spec_longer_than_the_rank_is_reported(mesh):
    # `shard` refuses it: the spec cannot apply, whatever the array's sharding.
    tree = {"b": _put(jnp.zeros(8), mesh, P("dp"))}
    with pytest.raises(ValueError, match="(?s)eqshard.shard: .*'b'"):
        eqshard.shard({"b": np.zeros(8)}, P("dp", "tp"), mesh)
    with pytest.raises(
        ValueError, match=r"(?s)eqshard.check_layout: .*'b'.*cannot apply.*rank"
    ):
        eqshard.check_layout(tree, P("dp", "tp"), mesh)


def test_many_mismatches_show_the_first_and_keep_all_on_the_error(mesh):
    single = jnp.zeros(2)  # on one device, not on the mesh
    tree = {"layers": [single] * 1000}
    with pytest.raises(eqshard.LayoutError) as info:
        eqshard.check_layout(tree, P(), mesh)
    message = str(info.value)
    listed = [line for line in message.splitlines() if line.startswith("  - ")]
    assert len(listed) == 20 and "'layers/0'" in listed[0]
    assert "1000 arrays are not laid out as asked" in message
    assert "980 more" in message and len(message) < 4000
    mismatches = info.value.mismatches
    assert [m.path for m in mismatches] == [f"layers/{i}" for i in range(1000)]
    assert all("single device" in m.problem for m in mismatches)
    last = mismatches[999]
    assert last.shape == (2,) and last.spec == P() and last.mesh == mesh
    assert copy.copy(info.value).mismatches == mismatches  # kept by copies
    assert info.value.report == eqshard.check_layout(
        tree, P(), mesh, on_invalid="ignore"
    )
    with pytest.warns(UserWarning, match="1000 arrays are not laid out") as caught:
        report = eqshard.check_layout(tree, P(), mesh, on_invalid="warn")
    assert str(caught[0].message) == message == str(report)
    assert report.mismatches == mismatches and not report.ok
