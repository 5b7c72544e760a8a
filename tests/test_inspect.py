import dataclasses
import io
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

import eqshard
from eqshard._readers._inspect import format_bytes


f32, bf16 = jnp.float32, jnp.bfloat16


def sds(shape, dtype=f32, sharding=None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


@pytest.fixture(scope="module")
def stage_mesh(mesh):
    """A 4-device mesh made of the first 4 devices of `mesh`, as one pipeline stage."""
    devices = np.array(list(mesh.devices.flat)[:4])
    return Mesh(devices, ("tp",), axis_types=(AxisType.Auto,))


# ---------------------------------------------------------------------------------
# get_partition_spec, extract_sharding_structure, extract_shardings
# ---------------------------------------------------------------------------------


def test_get_partition_spec_of_each_kind_of_leaf(mesh):
    sharded = jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh, P("dp", "tp")))
    replicated = jax.device_put(jnp.zeros(3), NamedSharding(mesh, P()))
    abstract = sds((8,), sharding=NamedSharding(mesh.abstract_mesh, P("tp")))
    tree = {
        "sharded": sharded,
        "replicated": replicated,
        "single_device": jnp.zeros(3),
        "numpy": np.ones(3),
        "numpy_scalar": np.float32(1.0),
        "struct": sds((2, 2)),
        "abstract": abstract,
        "int": 3,
        "float": 0.5,
        "string": "relu",
        "none": None,
        "fn": jnp.tanh,
    }
    assert eqshard.get_partition_spec(tree) == {
        "sharded": sharded.sharding.spec,
        "replicated": P(),
        "single_device": None,  # on no mesh: not the same as replicated
        "numpy": P(),
        "numpy_scalar": P(),
        "struct": P(),
        "abstract": P("tp"),
        "int": None,
        "float": None,
        "string": None,
        "none": None,
        "fn": None,
    }


def test_get_partition_spec_of_a_module_round_trips_through_shard(mesh):
    model = eqx.nn.Linear(4, 8, key=jax.random.key(0))
    specs = eqx.tree_at(lambda m: (m.weight, m.bias), model, (P("tp", None), P("dp")))
    placed = eqshard.shard(model, specs, mesh)
    got = eqshard.get_partition_spec(placed)
    assert type(got) is eqx.nn.Linear
    assert (got.weight, got.bias) == (P("tp", None), P("dp"))
    assert got.in_features == 4  # static fields untouched
    again = eqshard.shard(model, got, mesh)
    assert again.weight.sharding == placed.weight.sharding


class _TiledSharding(jax.sharding.Sharding):
    """A partitioned sharding that is not a NamedSharding."""

    def __init__(self, devices):
        self._devices = tuple(devices)

    @property
    def device_set(self):
        return set(self._devices)

    @property
    def is_fully_replicated(self):
        return False

    @property
    def is_fully_addressable(self):
        return True

    @property
    def memory_kind(self):
        return None

    @property
    def num_devices(self):
        return len(self._devices)

    @property
    def _device_assignment(self):
        return self._devices

    def with_memory_kind(self, kind):
        return self

    def _to_xla_hlo_sharding(self, num_dimensions):
        raise NotImplementedError

    def devices_indices_map(self, global_shape):
        raise NotImplementedError

    def shard_shape(self, global_shape):
        return global_shape

    def check_compatible_aval(self, shape):
        pass


def test_get_partition_spec_rejects_other_partitioned_shardings():
    leaf = sds((8,), sharding=_TiledSharding(jax.devices()))
    with pytest.raises(TypeError, match="'layers/1'.*_TiledSharding"):
        eqshard.get_partition_spec({"layers": [sds((8,)), leaf]})
    # extract_sharding_structure just reports that there is no NamedSharding
    assert eqshard.compat.extract_sharding_structure({"x": leaf}) == {"x": None}


@pytest.mark.parametrize(
    "fn",
    [
        eqshard.get_partition_spec,
        eqshard.compat.extract_sharding_structure,
        eqshard.extract_shardings,
    ],
)
def test_readers_reject_tracers_naming_the_path(fn):
    @jax.jit
    def f(x):
        return fn({"a": [1, x]})

    with pytest.raises(TypeError, match="'a/1' is traced inside `jax.jit`"):
        f(jnp.zeros(2))


def test_extract_sharding_structure(mesh):
    x = jax.device_put(jnp.zeros(8), NamedSharding(mesh, P("dp")))
    abstract = NamedSharding(mesh.abstract_mesh, P("tp"))
    tree = [x, jnp.zeros(3), np.zeros(3), sds((4,)), sds((4,), sharding=abstract), 2]
    got = eqshard.compat.extract_sharding_structure(tree)
    assert got == [x.sharding, None, None, None, abstract, None]
    assert got[0] is x.sharding


def test_extract_shardings_binds_abstract_shardings(mesh):
    x = jax.device_put(jnp.zeros(8), NamedSharding(mesh, P("dp")))
    abstract = NamedSharding(mesh.abstract_mesh, P("tp", None))
    tree = {"x": x, "y": sds((4, 2), sharding=abstract), "z": jnp.zeros(2), "n": 1}
    expected = {
        "x": x.sharding,
        "y": NamedSharding(mesh, P("tp", None)),
        "z": None,
        "n": None,
    }
    assert eqshard.extract_shardings(tree, mesh) == expected
    with jax.set_mesh(mesh):
        assert eqshard.extract_shardings(tree) == expected
    out = jax.device_put(np.zeros((4, 2)), eqshard.extract_shardings(tree, mesh)["y"])
    assert out.sharding.spec == P("tp", None)


def test_extract_shardings_needs_no_mesh_without_abstract_shardings(mesh):
    x = jax.device_put(jnp.zeros(8), NamedSharding(mesh, P("dp")))
    assert eqshard.extract_shardings([x, np.zeros(1)]) == [x.sharding, None]


def test_extract_shardings_errors(mesh):
    tree = {
        "a": [sds((8,)), sds((8,), sharding=NamedSharding(mesh.abstract_mesh, P()))]
    }
    with pytest.raises(ValueError, match="'a/1' is on an abstract mesh.*mesh=") as info:
        eqshard.extract_shardings(tree)
    assert "set_mesh" in str(info.value)
    other = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    with pytest.raises(ValueError, match="'a/1'.*differ.*'dp': 4, 'tp': 2"):
        eqshard.extract_shardings(tree, other)


# ---------------------------------------------------------------------------------
# analyze_sharding_strategy: numbers worked out by hand.
# ---------------------------------------------------------------------------------


def _plan():
    tree = {
        "w": sds((8, 16)),  # P('dp', 'tp'): 8*16*4 / 8 = 64 bytes on every device
        "b": sds((16,), bf16),  # P(): 16*2 = 32 bytes on every device
        "v": sds((6, 8)),  # P(None, 'tp'): 6*8*4 / 4 = 48 bytes, replicated over dp
        "n": 3,  # not an array: no memory
        "act": "gelu",
    }
    specs = {"w": P("dp", "tp"), "b": P(), "v": P(None, "tp"), "n": P(), "act": None}
    return tree, specs


def test_analyze_hand_computed(mesh):
    tree, specs = _plan()
    report = eqshard.analyze_sharding_strategy(tree, specs, mesh)
    assert report.bytes_per_device == (64 + 32 + 48,) * 8
    assert report.max_bytes_per_device == report.min_bytes_per_device == 144
    assert report.balance_score == 1.0
    assert report.total_parameters == 8 * 16 + 16 + 6 * 8
    assert report.sharded_parameters == 8 * 16 + 6 * 8
    assert report.total_bytes == 8 * 16 * 4 + 16 * 2 + 6 * 8 * 4
    assert report.replicated_bytes == 32
    assert report.unplaced_bytes == 0
    assert report.problems == ()
    assert report.mesh_shape == {"dp": 2, "tp": 4}
    assert [r.path for r in report.rows] == ["b", "v", "w"]  # tree_leaves order
    b, v, w = report.rows
    assert (w.shape, w.dtype, w.spec, w.nbytes) == (
        (8, 16),
        "float32",
        P("dp", "tp"),
        512,
    )
    assert (w.bytes_per_device, w.num_shards, w.num_devices) == (64, 8, 8)
    assert (v.bytes_per_device, v.num_shards, v.sharded) == (48, 4, True)
    assert (b.dtype, b.bytes_per_device, b.num_shards, b.replicated) == (
        "bfloat16",
        32,
        1,
        True,
    )
    assert w.size == 128 and w.valid and not w.replicated


def test_analyze_matches_the_shards_jax_makes(mesh):
    # The oracle: place real arrays, and add up the bytes of each device's shards.
    tree = {
        "w": jnp.zeros((8, 16)),
        "b": jnp.zeros(16, bf16),
        "v": jnp.zeros((6, 8)),
        "i": jnp.zeros(4, jnp.int8),
        "k": jnp.zeros((2, 8, 4), bool),
    }
    specs = {
        "w": P("dp", "tp"),
        "b": P(),
        "v": P(None, "tp"),
        "i": P("dp"),
        "k": P(None, ("dp", "tp")),
    }
    placed = jax.device_put(tree, eqshard.named_shardings(specs, mesh))
    held = {d.id: 0 for d in mesh.devices.flat}
    for leaf in jax.tree.leaves(placed):
        for piece in leaf.addressable_shards:
            held[piece.device.id] += piece.data.nbytes
    expected = tuple(held[d.id] for d in mesh.devices.flat)
    # specs read back from the placed arrays, on concrete arrays and on their shapes
    for t in (placed, eqx.filter_eval_shape(lambda t: t, placed), tree):
        report = eqshard.analyze_sharding_strategy(
            t, eqshard.get_partition_spec(placed), mesh
        )
        assert report.bytes_per_device == expected


def test_analyze_sub_mesh_is_uneven(mesh, stage_mesh):
    tree = {"a": sds((8, 16)), "stage": sds((8,))}
    specs = {"a": P("dp", "tp"), "stage": NamedSharding(stage_mesh, P("tp"))}
    report = eqshard.analyze_sharding_strategy(tree, specs, mesh)
    # 'a': 64 bytes everywhere; 'stage': 8*4/4 = 8 bytes on the stage's 4 devices only,
    # which are the first 4 of mesh.devices.flat.
    assert report.bytes_per_device == (72,) * 4 + (64,) * 4
    assert report.balance_score == 64 / 72
    assert report.rows[1].num_devices == 4
    # The stage mesh alone: NamedSharding on devices outside it.
    with pytest.raises(
        ValueError, match="'a'.*neither the analysed mesh.*nor made of its devices"
    ):
        eqshard.analyze_sharding_strategy(
            tree, {"a": NamedSharding(mesh, P()), "stage": P()}, stage_mesh
        )


def test_analyze_abstract_and_concrete_shardings_mix(mesh):
    tree = {"w": sds((8, 16))}
    abstract = {"w": NamedSharding(mesh.abstract_mesh, P("dp", "tp"))}
    concrete = {"w": NamedSharding(mesh, P("dp", "tp"))}
    for specs, on in [(abstract, mesh), (concrete, mesh.abstract_mesh)]:
        report = eqshard.analyze_sharding_strategy(tree, specs, on)
        assert report.bytes_per_device == (64,) * 8
    other = AbstractMesh((4, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match="'w' is on mesh.*'dp': 2, 'tp': 4"):
        eqshard.analyze_sharding_strategy(tree, abstract, other)


def test_analyze_mesh_defaults(mesh):
    tree, specs = _plan()
    with jax.set_mesh(mesh):
        assert (
            eqshard.analyze_sharding_strategy(tree, specs).bytes_per_device
            == (144,) * 8
        )
    named = jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
    )
    report = eqshard.analyze_sharding_strategy(tree, named)
    assert report.mesh == mesh and report.bytes_per_device == (144,) * 8
    with pytest.raises(ValueError, match="no mesh given and none set"):
        eqshard.analyze_sharding_strategy(tree, specs)


def test_analyze_prefix_specs_and_unplaced(mesh):
    tree, _ = _plan()
    report = eqshard.analyze_sharding_strategy(tree, P(), mesh)
    assert report.bytes_per_device == (512 + 32 + 192,) * 8
    assert report.replicated_bytes == report.total_bytes == 736
    assert report.sharded_parameters == 0
    report = eqshard.analyze_sharding_strategy(tree, {**_plan()[1], "w": None}, mesh)
    w = report.rows[2]
    assert (w.spec, w.placed, w.bytes_per_device, w.replicated) == (
        None,
        False,
        0,
        False,
    )
    assert report.bytes_per_device == (32 + 48,) * 8
    assert report.unplaced_bytes == 512
    assert report.total_bytes == 736


def test_analyze_invalid_specs_are_reported(mesh):
    tree = {"ok": sds((8, 16)), "odd": sds((3, 16)), "bad": {"w": sds((4, 4))}}
    specs = {
        "ok": P("dp", "tp"),
        "odd": P("dp", "tp"),
        "bad": {"w": P("sp", "tp", "dp")},
    }
    report = eqshard.analyze_sharding_strategy(tree, specs, mesh)
    assert [p.path for p in report.problems] == ["bad/w", "odd"]
    bad, odd = report.problems
    assert odd.suggestion == eqshard.corrected_spec((3, 16), P("dp", "tp"), mesh)
    assert odd.suggestion == P(None, "tp")
    assert "not divisible" in odd.reasons[0] and odd.shape == (3, 16)
    assert bad.suggestion == P(None, "tp")
    # counted with the suggestion: 'odd' 3*16*4/4 = 48, 'bad/w' 4*4*4/4 = 16
    assert report.bytes_per_device == (64 + 48 + 16,) * 8
    assert [r.valid for r in report.rows] == [False, False, True]
    assert (
        "invalid" in report.table() and "Using P(None, 'tp') instead" in report.table()
    )


def test_analyze_invalid_specs_raise_or_warn_on_request(mesh):
    tree = {"layers": [sds((8,)), sds((3, 16))]}
    specs = {"layers": [P("dp"), P("dp", "tp")]}
    where = r"'layers/1' \(shape \(3, 16\)\).*not divisible"
    with pytest.raises(ValueError, match=where):
        eqshard.analyze_sharding_strategy(tree, specs, mesh, on_invalid="raise")
    with pytest.warns(UserWarning, match=where + r".*Using P\(None, 'tp'\) instead"):
        report = eqshard.analyze_sharding_strategy(tree, specs, mesh, on_invalid="warn")
    assert report == eqshard.analyze_sharding_strategy(tree, specs, mesh)


def test_analyze_spec_tree_errors(mesh):
    tree, _ = _plan()
    with pytest.raises(ValueError, match="analyze_sharding_strategy.*'v'"):
        eqshard.analyze_sharding_strategy(
            tree, {"w": P(), "b": P(), "v": [P()], "n": None, "act": None}, mesh
        )
    with pytest.raises(TypeError, match="analyze_sharding_strategy.*'v'"):
        eqshard.analyze_sharding_strategy(
            tree, {"w": P(), "b": P(), "v": "tp", "n": None, "act": None}, mesh
        )


def test_analyze_abstract_mesh_of_devices_we_do_not_have():
    big = AbstractMesh((16, 16), ("dp", "tp"))
    tree = {"w": sds((4096, 4096), bf16), "b": sds((4096,))}
    report = eqshard.analyze_sharding_strategy(
        tree, {"w": P("dp", "tp"), "b": P()}, big
    )
    assert report.bytes_per_device == (4096 * 4096 * 2 // 256 + 4096 * 4,) * 256
    assert report.rows[1].num_devices == 256


def test_analyze_a_module(mesh):
    shapes = eqx.filter_eval_shape(eqx.nn.Linear, 16, 8, key=jax.random.key(0))
    specs = eqx.tree_at(lambda m: (m.weight, m.bias), shapes, (P("tp", None), P()))
    report = eqshard.analyze_sharding_strategy(shapes, specs, mesh)
    assert [r.path for r in report.rows] == ["weight", "bias"]
    assert report.bytes_per_device == (8 * 16 * 4 // 4 + 8 * 4,) * 8


def test_replicated_and_sufficiently_sharded(mesh):
    tree = {
        "big": sds((256, 256)),
        "mid": sds((64, 64)),
        "small": sds((4,)),
        "split": sds((512, 512)),
    }
    specs = {"big": P(), "mid": P(), "small": P(), "split": P("dp", "tp")}
    report = eqshard.analyze_sharding_strategy(tree, specs, mesh)
    assert [r.path for r in report.largest_replicated(2)] == ["big", "mid"]
    assert [r.path for r in report.largest_replicated()] == ["big", "mid", "small"]
    assert report.largest_replicated(0) == ()
    # 'big' is 256 KiB, 'mid' 16 KiB
    assert not report.is_sufficiently_sharded(min_bytes=16 * 1024)
    assert [r.path for r in report.insufficiently_sharded(16 * 1024)] == ["big", "mid"]
    assert [r.path for r in report.insufficiently_sharded(16 * 1024 + 1)] == ["big"]
    assert report.is_sufficiently_sharded(min_bytes=256 * 1024 + 1)
    assert report.is_sufficiently_sharded()  # default 1 MiB
    with pytest.raises(ValueError, match="`n` must be at least 0; got -1"):
        report.largest_replicated(-1)


def test_report_is_immutable(mesh):
    report = eqshard.analyze_sharding_strategy(*_plan(), mesh)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.total_bytes = 0  # pyright: ignore[reportAttributeAccessIssue]  # on purpose
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.rows[0].nbytes = 0  # pyright: ignore[reportAttributeAccessIssue]  # on purpose
    assert "total_parameters=192" in repr(report)


# ---------------------------------------------------------------------------------
# Tables.
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (64, "64 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (3 * 2**20, "3.0 MiB"),
        (int(2.5 * 2**30), "2.5 GiB"),
        (2**40, "1.0 TiB"),
        (2**60, "1024.0 PiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_table(mesh):
    tree, specs = _plan()
    report = eqshard.analyze_sharding_strategy(tree, specs, mesh)
    text = report.table()
    assert str(report) == text
    lines = text.splitlines()
    assert lines[0].split() == [
        "path",
        "shape",
        "dtype",
        "spec",
        "size",
        "per",
        "device",
    ]
    assert set(lines[1]) == {"-"}
    body = lines[2:5]
    assert [line.split()[0] for line in body] == ["b", "v", "w"]
    # aligned: each column starts at the same place on every line
    for words in (
        ["dtype", "bfloat16", "float32", "float32"],
        ["spec", "P()", "P(None", "P('dp'"],
    ):
        assert len({line.index(w) for line, w in zip([lines[0], *body], words)}) == 1
    ends = {len(line.rstrip(" replicated")) for line in body}
    assert len(ends) == 1  # the right-aligned per-device column ends together
    assert "(16,)" in body[0] and "32 B" in body[0] and "replicated" in body[0]
    assert body[2].split()[-2:] == ["64", "B"]  # w: 64 bytes per device
    totals = lines[5]
    assert totals.startswith("total: 3 arrays, 192 parameters (176 sharded), 736 B")
    assert "max 144 B" in totals and "balance 1.00" in totals and "8 devices" in totals


def test_show_draws_a_rich_table_which_rich_table_gave(mesh):
    from rich.table import Table

    report = eqshard.analyze_sharding_strategy(*_plan(), mesh)
    shown = io.StringIO()
    report.show(shown)
    assert "eqshard sharding plan" in shown.getvalue()
    assert "total: 3 arrays" in shown.getvalue()
    old = r"^eqshard\.ShardingReport\.rich_table\(\) is now `show\(\)`"
    with pytest.warns(DeprecationWarning, match=old):
        table = report.rich_table()
    assert isinstance(table, Table)
    assert table.row_count == 3 and len(table.columns) == 7
    assert isinstance(table.caption, str)
    assert table.caption.startswith("total: 3 arrays")


# ---------------------------------------------------------------------------------
# A 70B-parameter plan, abstract.
# ---------------------------------------------------------------------------------


def test_analyze_70b_plan_without_allocating(mesh):
    vocab, d, ff, kv, layers = 32000, 8192, 28672, 1024, 80
    layer = {
        "attn": {
            "q": sds((d, d), bf16),
            "k": sds((d, kv), bf16),
            "v": sds((d, kv), bf16),
            "o": sds((d, d), bf16),
        },
        "mlp": {
            "gate": sds((d, ff), bf16),
            "up": sds((d, ff), bf16),
            "down": sds((ff, d), bf16),
        },
        "norm1": sds((d,), bf16),
        "norm2": sds((d,), bf16),
    }
    layer_specs = {
        "attn": {
            "q": P("dp", "tp"),
            "k": P("dp", "tp"),
            "v": P("dp", "tp"),
            "o": P("tp", "dp"),
        },
        "mlp": {"gate": P("dp", "tp"), "up": P("dp", "tp"), "down": P("tp", "dp")},
        "norm1": P(),
        "norm2": P(),
    }
    tree = {
        "embed": sds((vocab, d), bf16),
        "layers": [layer] * layers,
        "norm": sds((d,), bf16),
        "lm_head": sds((d, vocab), bf16),
    }
    specs = {
        "embed": P(None, "tp"),
        "layers": [layer_specs] * layers,
        "norm": P(),
        "lm_head": P("dp", "tp"),
    }
    start = time.perf_counter()
    report = eqshard.analyze_sharding_strategy(tree, specs, mesh)
    elapsed = time.perf_counter() - start
    print(f"70B plan: {len(report.rows)} arrays analysed in {elapsed * 1e3:.1f} ms")

    per_layer = 2 * d * d + 2 * d * kv + 3 * d * ff + 2 * d
    total = layers * per_layer + 2 * vocab * d + d
    assert total == 68_976_648_192
    assert report.total_parameters == total
    assert report.total_bytes == 2 * total
    norms = 2 * layers * d + d
    assert report.sharded_parameters == total - norms
    assert report.replicated_bytes == 2 * norms
    per_device = (
        2 * vocab * d // 4  # embed, over tp only
        + 2 * d * vocab // 8  # lm_head
        + layers * 2 * (per_layer - 2 * d) // 8  # the layers' matrices
        + 2 * norms  # norms, whole on every device
    )
    assert report.bytes_per_device == (per_device,) * 8
    assert per_device == 17_312_006_144  # about 16.1 GiB
    assert "16.1 GiB" in report.table().splitlines()[-1]
    assert not report.is_sufficiently_sharded(min_bytes=2 * d)  # the norms
    assert report.is_sufficiently_sharded(min_bytes=2 * d + 1)


def test_analyze_with_no_specs_reads_the_arrays_own_shardings(mesh):
    sharded = jax.device_put(
        jnp.zeros((8, 16), jnp.float32), NamedSharding(mesh, P("dp", "tp"))
    )
    replicated = jax.device_put(jnp.zeros(4, jnp.float32), NamedSharding(mesh, P()))
    one_device = jax.device_put(jnp.zeros(6, jnp.float32), mesh.devices.flat[2])
    tree = {"s": sharded, "r": replicated, "one": one_device, "np": np.ones(5)}
    report = eqshard.analyze_sharding_strategy(tree, None, mesh)
    expected = {d.id: 0 for d in mesh.devices.flat}
    for leaf in (sharded, replicated, one_device):
        for shard in leaf.addressable_shards:
            expected[shard.device.id] += shard.data.nbytes
    assert report.bytes_per_device == tuple(expected[d.id] for d in mesh.devices.flat)
    flags = {row.path: row.single_device for row in report.rows}
    assert flags == {"s": False, "r": False, "one": True, "np": False}
    assert report.single_device_bytes == 24
    assert report.unplaced_bytes == 5 * 8
    assert "single device" in report.table()


def test_memory_kind_reported_by_extract_shardings_and_rows(mesh):
    pinned = NamedSharding(mesh, P("dp"), memory_kind="pinned_host")
    tree = {"x": jax.device_put(np.zeros((8, 4), np.float32), pinned)}
    assert (
        eqshard.compat.extract_sharding_structure(tree)["x"].memory_kind
        == "pinned_host"
    )
    assert eqshard.extract_shardings(tree)["x"].memory_kind == "pinned_host"
    abstract = jax.ShapeDtypeStruct(
        (8, 4), np.float32, sharding=NamedSharding(mesh.abstract_mesh, P("dp"))
    )
    bound = eqshard.extract_shardings({"x": abstract}, mesh)["x"]
    assert bound == NamedSharding(mesh, P("dp"))
    report = eqshard.analyze_sharding_strategy(tree, None)
    (row,) = report.rows
    assert row.memory_kind == "pinned_host"
    assert "pinned_host" in report.table()
    (row,) = eqshard.analyze_sharding_strategy(tree, P("dp"), mesh).rows
    assert row.memory_kind is None


def test_on_invalid_is_checked_by_eqshard(mesh):
    with pytest.raises(ValueError, match="^eqshard.analyze_sharding_strategy: `on_inv"):
        # Wrong on purpose:
        eqshard.analyze_sharding_strategy(np.ones(8), P(), mesh, on_invalid="bogus")  # pyright: ignore[reportArgumentType]
