"""Tests for eqshard._mesh: building meshes, mesh strings, current-mesh queries."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fakes import HostDevice, TpuDevice
from jax.sharding import AxisType, Mesh, PartitionSpec as P

import eqshard
from eqshard._mesh._current import require_mesh


def _ids(mesh: Mesh) -> list:
    return np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices).tolist()


@pytest.fixture(scope="session")
def mesh24() -> Mesh:
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)


# create_mesh ---------------------------------------------------------------


def test_create_mesh_default_infers_fsdp():
    mesh = eqshard.create_mesh()
    assert mesh.axis_names == ("dp", "fsdp", "tp", "sp")
    assert dict(mesh.shape) == {"dp": 1, "fsdp": 8, "tp": 1, "sp": 1}
    assert mesh.axis_types == (AxisType.Auto,) * 4


@pytest.mark.parametrize(
    "dims, shape", [((2, -1), (2, 4)), ((-1, 2), (4, 2)), ((8, 1), (8, 1))]
)
def test_create_mesh_matches_jax_make_mesh(dims, shape):
    mesh = eqshard.create_mesh(dims, ("a", "b"))
    expected = jax.make_mesh(shape, ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    assert mesh.devices.shape == shape
    assert _ids(mesh) == _ids(expected)


def test_create_mesh_refuses_to_leave_devices_idle():
    # As jax.make_mesh: sizes using 4 of the 8 devices are most likely a typo.
    for make in (
        lambda: eqshard.create_mesh((2, 2), ("a", "b")),
        lambda: eqshard.create_mesh("2,2", ("a", "b")),
        lambda: eqshard.compat.get_jax_mesh("2,2", ("a", "b")),
    ):
        with pytest.raises(
            ValueError, match=r"^eqshard.[\w.]+: .*multiply to 4, fewer "
        ):
            make()
    with pytest.raises(ValueError, match=r"the 8 devices, which would leave 4 idle"):
        eqshard.create_mesh((4,), ("a",))


def test_create_mesh_uses_first_devices_given_when_product_is_smaller():
    mesh = eqshard.create_mesh((2, 2), ("a", "b"), devices=jax.devices())
    assert _ids(mesh) == [[0, 1], [2, 3]]


def test_create_mesh_explicit_devices_and_axis_types():
    devices = jax.devices()[4:]
    mesh = eqshard.create_mesh(
        (-1,), ("x",), devices=devices, axis_types=(AxisType.Explicit,)
    )
    assert _ids(mesh) == [4, 5, 6, 7]
    assert mesh.axis_types == (AxisType.Explicit,)


def test_create_mesh_backend():
    assert eqshard.create_mesh((-1,), ("x",), backend="cpu").size == 8


@pytest.mark.parametrize(
    "dims, names, match",
    [
        ((-1, -1), ("a", "b"), r"2 sizes are -1"),
        ((2,), ("a", "b"), r"1 size\(s\) for 2 name\(s\)"),
        ((3, -1), ("a", "b"), r"multiply to 3, which does not divide the 8"),
        ((4, 4), ("a", "b"), r"multiply to 16, more than the 8 devices"),
        ((2, 4), ("a", "a"), r"axis name 'a' repeats"),
        ((0, -1), ("a", "b"), r"positive"),
        ((-2, 4), ("a", "b"), r"positive"),
    ],
)
def test_create_mesh_errors(dims, names, match):
    with pytest.raises(ValueError, match=r"eqshard.create_mesh: .*" + match):
        eqshard.create_mesh(dims, names)


def test_create_mesh_bad_arguments():
    with pytest.raises(TypeError, match=r"not the string 'dp'"):
        eqshard.create_mesh((8,), "dp")
    with pytest.raises(ValueError, match=r"1 axis_types for the 2 axes"):
        eqshard.create_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,))
    with pytest.raises(ValueError, match=r"either devices= or backend='cpu'"):
        eqshard.create_mesh((8,), ("a",), devices=jax.devices(), backend="cpu")
    with pytest.raises(ValueError, match=r"devices= is empty"):
        eqshard.create_mesh((-1,), ("a",), devices=[])


def test_create_mesh_from_a_named_string_takes_its_names_and_order():
    mesh = eqshard.create_mesh(" tp:2 , dp:-1")
    expected = jax.make_mesh((2, 4), ("tp", "dp"), axis_types=(AxisType.Auto,) * 2)
    assert mesh.axis_names == ("tp", "dp")
    assert _ids(mesh) == _ids(expected)
    assert mesh.axis_types == (AxisType.Auto,) * 2
    # Given names must all be in the string, which still sets the order.
    mesh = eqshard.create_mesh("tp:2,dp:-1", ("dp", "tp"))
    assert mesh.axis_names == ("tp", "dp")


def test_create_mesh_from_sizes_in_a_string_names_them_as_sizes():
    assert eqshard.create_mesh("1,-1,1,1").axis_names == ("dp", "fsdp", "tp", "sp")
    mesh = eqshard.create_mesh("2,-1", ("a", "b"))
    assert dict(mesh.shape) == {"a": 2, "b": 4}
    devices = jax.devices()[::-1]
    mesh = eqshard.create_mesh("!a:2,b:4", devices=devices)
    assert _ids(mesh) == [[7, 6, 5, 4], [3, 2, 1, 0]]


@pytest.mark.parametrize(
    "text, names, token, problem",
    [
        ("dp:2,:4", None, "':4'", "the axis name is empty"),
        ("dp:2,dp:4", None, "'dp:4'", "'dp' repeats"),
        ("dp:2,4", None, "'4'", "named and positional entries are mixed"),
        ("zz:2,tp:4", ("dp", "tp"), "'zz:2'", r"'zz' is not one of the names"),
        ("2,-1", None, "'2,-1'", r"2 size\(s\) for the 4 names \('dp', 'fsdp'"),
    ],
)
def test_create_mesh_malformed_string(text, names, token, problem):
    with pytest.raises(
        ValueError,
        match=f"^eqshard.create_mesh: .* at {token}: {problem}.*`axis_names`",
    ):
        eqshard.create_mesh(text, names)


def test_create_mesh_string_shape_errors():
    with pytest.raises(ValueError, match=r"eqshard.create_mesh: .*divide the 8"):
        eqshard.create_mesh("dp:3,tp:-1")
    with pytest.raises(ValueError, match=r"eqshard.create_mesh: .*fewer than the 8"):
        eqshard.create_mesh("dp:2,tp:2")


# get_jax_mesh --------------------------------------------------------------


def test_get_jax_mesh_positional():
    mesh = eqshard.compat.get_jax_mesh("2,-1", ("dp", "tp"))
    assert mesh.axis_names == ("dp", "tp")
    assert dict(mesh.shape) == {"dp": 2, "tp": 4}
    assert mesh.axis_types == (AxisType.Auto,) * 2


def test_get_jax_mesh_named_keeps_string_order():
    mesh = eqshard.compat.get_jax_mesh(" tp:2 , dp:-1,sp:1", ("dp", "sp", "tp"))
    assert mesh.axis_names == ("tp", "dp", "sp")
    assert dict(mesh.shape) == {"tp": 2, "dp": 4, "sp": 1}


def test_get_jax_mesh_bang_keeps_device_order():
    devices = jax.devices()[::-1]
    mesh = eqshard.compat.get_jax_mesh("!2,4", ("a", "b"), devices=devices)
    assert _ids(mesh) == [[7, 6, 5, 4], [3, 2, 1, 0]]


@pytest.mark.parametrize(
    "text, token, problem",
    [
        ("2,,4", "''", "empty entry"),
        ("dp:2,4", "'4'", "named and positional entries are mixed"),
        ("2,tp:4", "'tp:4'", "named and positional entries are mixed"),
        ("dp:x,tp:1", "'dp:x'", "'x' is not an integer size"),
        ("2.5,1", "'2.5'", "'2.5' is not an integer size"),
        ("zz:2,tp:4", "'zz:2'", r"'zz' is not one of the names \('dp', 'tp'\)"),
        ("dp:2,dp:4", "'dp:4'", "'dp' repeats"),
        ("dp:2", "'dp:2'", "no size for 'tp'"),
        ("2", "'2'", r"1 size\(s\) for the 2 names"),
    ],
)
def test_get_jax_mesh_malformed(text, token, problem):
    with pytest.raises(ValueError, match=f"at {token}: {problem}"):
        eqshard.compat.get_jax_mesh(text, ("dp", "tp"))


def test_get_jax_mesh_shape_errors_come_from_create_mesh_rules():
    with pytest.raises(
        ValueError, match=r"eqshard.compat.get_jax_mesh: .*divide the 8"
    ):
        eqshard.compat.get_jax_mesh("dp:3,tp:-1", ("dp", "tp"))


# create_hybrid_mesh ---------------------------------------------------------


def test_create_hybrid_mesh_single_process():
    mesh = eqshard.create_hybrid_mesh((2, 4), (1, 1), ("data", "model"))
    assert _ids(mesh) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.axis_types == (AxisType.Auto,) * 2


def test_create_hybrid_mesh_processes_are_units_without_slices():
    # Two processes of three CPU devices; ids as in a real multi-process run.
    devices = [HostDevice(2048 * p + i, p) for p in (1, 0) for i in (2, 0, 1)]
    mesh = eqshard.create_hybrid_mesh((1, 3), (2, 1), ("a", "b"), devices=devices)
    # CPU granules keep the given order; processes are stacked by index.
    assert _ids(mesh) == [[2, 0, 1], [2048 + 2, 2048, 2048 + 1]]
    mesh = eqshard.create_hybrid_mesh((3, 1), (1, 2), ("a", "b"), devices=devices)
    assert _ids(mesh) == [[2, 2050], [0, 2048], [1, 2049]]


def test_create_hybrid_mesh_slices_are_units():
    # Two slices of 2x2x1 v4 chips, one process per slice. Inside a slice the
    # ICI shape (1, 2, 2) maps its last axis (size 2) to the first physical
    # axis pair whose product is 2 (x and the size-1 z), and the middle axis to
    # y, so position [0, y, x] holds chip (x, y). The DCN shape (2, 1, 1)
    # stacks the slices along axis 0.
    devices = [
        TpuDevice(4 * s + 2 * y + x, s, (x, y, 0), 0, "TPU v4", s)
        for s in range(2)
        for y in range(2)
        for x in range(2)
    ]
    mesh = eqshard.create_hybrid_mesh(
        (1, 2, 2), (2, 1, 1), ("replica", "data", "model"), devices=devices
    )
    assert mesh.devices.shape == (2, 2, 2)
    for s in range(2):
        for y in range(2):
            for x in range(2):
                d = mesh.devices[s, y, x]
                assert (d.slice_index, d.coords) == (s, (x, y, 0))


def test_create_hybrid_mesh_errors():
    names = ("a", "b")
    with pytest.raises(ValueError, match=r"asks for 2 slices or processes.*1 slice"):
        eqshard.create_hybrid_mesh((2, 2), (2, 1), names)
    with pytest.raises(ValueError, match=r"needs 4 devices per process.*\{0: 8\}"):
        eqshard.create_hybrid_mesh((2, 2), (1, 1), names)
    with pytest.raises(ValueError, match=r"1 size\(s\) for 2 name\(s\)"):
        eqshard.create_hybrid_mesh((8,), (1, 1), names)
    with pytest.raises(ValueError, match=r"sizes must be positive"):
        eqshard.create_hybrid_mesh((8, 1), (1, -1), names)
    with pytest.raises(ValueError, match=r"axis name 'a' repeats"):
        eqshard.create_hybrid_mesh((8, 1), (1, 1), ("a", "a"))


# current mesh and axis queries ----------------------------------------------


def test_current_mesh_outside_and_inside_jit(mesh24):
    assert eqshard.current_mesh() is None
    seen = []

    @jax.jit
    def f(x):
        seen.append(eqshard.current_mesh())
        return x

    with jax.set_mesh(mesh24):
        assert eqshard.current_mesh() == mesh24
        f(1.0)
    assert seen[0] == mesh24.abstract_mesh
    f(2.0)  # retrace outside the mesh
    assert seen[1] is None


def test_deprecated_with_mesh_is_not_seen(mesh24):
    # Documented in current_mesh: `with mesh:` does not set jax.set_mesh's mesh.
    with pytest.warns(DeprecationWarning, match="jax.set_mesh"):
        with mesh24:
            assert eqshard.current_mesh() is None


def test_require_mesh(mesh24):
    assert require_mesh(mesh24, caller="shard") is mesh24
    with pytest.raises(ValueError, match=r"eqshard.shard: no mesh given and none"):
        require_mesh(None, caller="shard")
    with jax.set_mesh(mesh24):
        assert require_mesh(None, caller="shard") == mesh24


def test_names_in_current_mesh(mesh24):
    assert not eqshard.compat.names_in_current_mesh("dp")
    with jax.set_mesh(mesh24):
        assert eqshard.compat.names_in_current_mesh("dp", "tp")
        assert eqshard.compat.names_in_current_mesh()
        assert not eqshard.compat.names_in_current_mesh("dp", "sp")


def test_mesh_axis_size_and_names(mesh24):
    assert eqshard.mesh_axis_size("tp", mesh24) == 4
    assert eqshard.mesh_axis_size(("dp", "tp"), mesh24) == 8
    assert eqshard.mesh_axis_size((), mesh24) == 1
    assert eqshard.mesh_axis_size("dp", mesh24.abstract_mesh) == 2
    assert eqshard.compat.get_mesh_axis_names(mesh24) == ("dp", "tp")
    with jax.set_mesh(mesh24):
        assert eqshard.mesh_axis_size(["tp", "dp"]) == 8
        assert eqshard.compat.get_mesh_axis_names() == ("dp", "tp")
    with pytest.raises(ValueError, match=r"mesh_axis_size: mesh axis 'sp' not in"):
        eqshard.mesh_axis_size(("dp", "sp"), mesh24)
    with pytest.raises(ValueError, match=r"get_mesh_axis_names: no mesh given"):
        eqshard.compat.get_mesh_axis_names()


def test_axis_size_and_index_inside_shard_map(mesh24):
    def body(x):
        inside = eqshard.current_mesh()
        assert inside is not None
        assert inside.axis_types == (AxisType.Manual, AxisType.Manual)
        sizes = (eqshard.axis_size("dp"), eqshard.axis_size(("tp", "dp")))
        assert sizes == (2, 8)
        assert eqshard.axis_size(()) == 1
        return x + 10 * eqshard.axis_index(("tp", "dp")) + eqshard.axis_index("tp")

    spec = P(("dp", "tp"))
    f = jax.shard_map(body, mesh=mesh24, in_specs=spec, out_specs=spec)
    out = np.asarray(f(jnp.zeros(8, jnp.int32)))
    # Block 4 * dp + tp holds 10 * (2 * tp + dp) + tp.
    expected = [10 * (2 * tp + dp) + tp for dp in range(2) for tp in range(4)]
    assert out.tolist() == expected


def test_axis_size_and_index_outside_shard_map():
    with pytest.raises(ValueError, match=r"axis_size: axis \('dp',\) is not bound"):
        eqshard.axis_size("dp")
    with pytest.raises(ValueError, match=r"axis_index: axis \('a', 'b'\) is not"):
        eqshard.axis_index(("a", "b"))


def test_numpy_integers_are_sizes():
    sizes = (np.int64(2), np.int32(4))
    assert dict(eqshard.create_mesh(sizes, ("a", "b")).shape) == {"a": 2, "b": 4}
    mesh = eqshard.create_hybrid_mesh((np.int64(8),), (np.int64(1),), ("a",))
    assert dict(mesh.shape) == {"a": 8}


def _calls(mesh):
    tree = {"w": np.zeros((8, 4), np.float32)}
    return {
        "shard": lambda: eqshard.shard(tree, P("dp"), mesh),
        "with_sharding_constraint": lambda: eqshard.with_sharding_constraint(
            tree, P("dp"), mesh=mesh
        ),
        "check_layout": lambda: eqshard.check_layout(tree, P("dp"), mesh),
        "init_sharded": lambda: eqshard.init_sharded(
            lambda key: tree, jax.random.key(0), specs=P(), mesh=mesh
        ),
        "match_partition_rules": lambda: eqshard.match_partition_rules(
            [(".*", P())], tree, mesh=mesh
        ),
        "analyze_sharding_strategy": lambda: eqshard.analyze_sharding_strategy(
            tree, P(), mesh
        ),
        "plan_training": lambda: eqshard.plan_training(tree, P(), mesh),
        "restrict_specs": lambda: eqshard.restrict_specs(P("dp"), mesh),
        "corrected_spec": lambda: eqshard.corrected_spec((8,), P("dp"), mesh),
    }


@pytest.mark.parametrize("name", sorted(_calls(None)))
@pytest.mark.parametrize("bad", ["dp", (2, 4), {"dp": 2}])
def test_a_mesh_argument_that_is_not_a_mesh_is_eqshards_type_error(name, bad):
    message = f"eqshard.{name}: `mesh` is {bad!r} ({type(bad).__name__}), not a mesh"
    with pytest.raises(TypeError, match="^" + re.escape(message)):
        _calls(bad)[name]()
