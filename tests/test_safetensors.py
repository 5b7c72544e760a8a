import json
import os
import pathlib
import pickle
import struct

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from probes import file_size_limit

import eqshard


def _mesh(shape, names):
    grid = np.array(jax.devices(), dtype=object).reshape(shape)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def _tensors():
    """Hugging Face style names, made with NumPy (the expected values)."""
    rng = np.random.default_rng(0)
    return {
        "model.layers.0.weight": rng.standard_normal((8, 16)).astype(np.float32),
        "model.layers.0.bias": rng.standard_normal(16).astype(ml_dtypes.bfloat16),
        "model.layers.1.weight": rng.standard_normal((16, 4)).astype(np.float16),
        "model.ids": rng.integers(-9, 9, (4, 8), dtype=np.int32),
        "model.mask": np.array([True, False, True, True, False, True, False, False]),
    }


def _like():
    """The tree the tensors load into: lists, dicts, a Python int (not loaded)."""
    return {
        "layers": [
            {
                "weight": jax.ShapeDtypeStruct((8, 16), jnp.float32),
                "bias": jax.ShapeDtypeStruct((16,), jnp.bfloat16),
            },
            {"weight": jax.ShapeDtypeStruct((16, 4), jnp.float16)},
        ],
        "ids": jax.ShapeDtypeStruct((4, 8), jnp.int32),
        "mask": jax.ShapeDtypeStruct((8,), jnp.bool_),
        "step": 3,
    }


_SPECS = {
    "layers": [{"weight": P("dp", "tp"), "bias": P("tp")}, {"weight": P(None, "tp")}],
    "ids": P(None, ("dp", "tp")),
    "mask": P(),
    "step": None,
}


def _strip(name):
    return name.removeprefix("model.")


@pytest.mark.parametrize("split", [False, True])
def test_load_one_file_or_an_index_bit_exact(tmp_path, split):
    tensors = _tensors()
    mesh = _mesh((2, 4), ("dp", "tp"))
    if split:  # two files and a Hugging Face index
        names = sorted(tensors)
        weight_map = {}
        for k, part in enumerate((names[:2], names[2:])):
            file = f"model-{k + 1:05d}-of-00002.safetensors"
            safetensors.numpy.save_file(
                {n: tensors[n] for n in part}, str(tmp_path / file)
            )
            weight_map.update({n: file for n in part})
        files = tmp_path / "model.safetensors.index.json"
        files.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        files = tmp_path / "model.safetensors"
        safetensors.numpy.save_file(tensors, str(files))
    out = eqshard.load_safetensors(files, _like(), _SPECS, mesh, rename=_strip)
    assert out["step"] == 3
    got = {"model." + k: v for k, v in eqshard.flatten_tree(out, sep=".").items()}
    assert got.pop("model.step") == 3
    for name, want in tensors.items():
        value = np.asarray(got[name])
        assert value.dtype == want.dtype and value.tobytes() == want.tobytes()
    weight = out["layers"][0]["weight"]
    assert weight.sharding == NamedSharding(mesh, P("dp", "tp"))
    assert out["ids"].sharding == NamedSharding(mesh, P(None, ("dp", "tp")))
    # Each device holds its block of the file's tensor.
    for shard in weight.addressable_shards:
        want = tensors["model.layers.0.weight"][shard.index]
        assert np.asarray(shard.data).tobytes() == want.tobytes()


def test_save_streams_a_file_safetensors_reads(tmp_path):
    mesh = _mesh((2, 4), ("dp", "tp"))
    model = eqx.nn.MLP(8, 4, 16, 1, key=jax.random.key(0))
    assert model.layers[0].bias is not None
    model = eqx.tree_at(
        lambda m: m.layers[0].bias, model, model.layers[0].bias.astype(jnp.bfloat16)
    )
    specs = eqshard.match_partition_rules([("weight", P("tp")), (".*", P())], model)
    sharded = eqshard.shard(model, specs, mesh)
    eqshard.save_safetensors(tmp_path / "m.safetensors", sharded)
    read = safetensors.numpy.load_file(str(tmp_path / "m.safetensors"))
    host = eqshard.flatten_tree(
        eqx.filter(eqshard.gather(model), eqx.is_array), sep="."
    )
    assert sorted(read) == sorted(host)
    for name, want in host.items():
        assert read[name].dtype == want.dtype and read[name].tobytes() == want.tobytes()
    assert read["layers.0.bias"].dtype == ml_dtypes.bfloat16
    # And back onto another mesh, cast to bfloat16 on the way.
    other = _mesh((4, 2), ("tp", "dp"))
    like = eqx.filter_eval_shape(lambda: model)
    out = eqshard.load_safetensors(
        tmp_path / "m.safetensors", like, specs, other, dtype=jnp.bfloat16
    )
    assert out.activation is model.activation
    assert out.layers[1].weight.dtype == jnp.bfloat16
    want = host["layers.1.weight"].astype(ml_dtypes.bfloat16)
    assert np.asarray(out.layers[1].weight).tobytes() == want.tobytes()
    assert out.layers[1].weight.sharding == NamedSharding(other, P("tp"))


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda t: {k: v for k, v in t.items() if k != "model.ids"},
            r"in `like`, not there: 'ids'",
        ),
        (
            lambda t: {**t, "model.extra": np.zeros(2, np.float32)},
            r"there, not in `like`: 'extra \(tensor 'model.extra'",
        ),
        (
            lambda t: {**t, "model.ids": np.zeros((8, 4), np.int32)},
            r"'ids' \(tensor 'model.ids' of m.safetensors\): shape \(8, 4\)",
        ),
        (
            lambda t: {**t, "model.mask": np.zeros(8, np.uint8)},
            r"'mask' .*: uint8 there, bool in `like`",
        ),
    ],
)
def test_load_names_differences(tmp_path, change, match):
    safetensors.numpy.save_file(change(_tensors()), str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match=match):
        eqshard.load_safetensors(
            tmp_path / "m.safetensors",
            _like(),
            _SPECS,
            _mesh((2, 4), ("dp", "tp")),
            rename=_strip,
        )


def test_load_errors(tmp_path):
    mesh = _mesh((2, 4), ("dp", "tp"))
    safetensors.numpy.save_file(_tensors(), str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match="no file"):
        eqshard.load_safetensors(tmp_path / "none.safetensors", _like(), _SPECS, mesh)
    with pytest.raises(ValueError, match="two tensors are named 'ids'"):
        eqshard.load_safetensors(
            tmp_path / "m.safetensors",
            _like(),
            _SPECS,
            mesh,
            rename=lambda n: "ids" if n.endswith(("ids", "mask")) else _strip(n),
        )
    # `rename` may skip a tensor; the skipped array is then missing.
    with pytest.raises(ValueError, match="not there: 'mask'"):
        eqshard.load_safetensors(
            tmp_path / "m.safetensors",
            _like(),
            _SPECS,
            mesh,
            rename=lambda n: None if n.endswith("mask") else _strip(n),
        )
    with pytest.raises(ValueError, match=r"'ids', 'layers.0.bias'"):
        eqshard.load_safetensors(tmp_path / "m.safetensors", _like(), rename=_strip)
    # Specs that cannot apply are load_safetensors' error, naming the path.
    with pytest.raises(ValueError, match=r"(?s)^eqshard.load_safetensors: .*'ids'"):
        eqshard.load_safetensors(
            tmp_path / "m.safetensors",
            _like(),
            {**_SPECS, "ids": P("nope")},
            mesh,
            rename=_strip,
        )


def test_save_refuses_dtypes_without_a_name(tmp_path):
    with pytest.raises(TypeError, match="'a.b'"):
        eqshard.save_safetensors(
            tmp_path / "x.safetensors", {"a": {"b": np.zeros(2, np.complex128)}}
        )
    assert not list(tmp_path.iterdir())


def test_save_refuses_the_reserved_name_metadata_and_keeps_the_old_file(tmp_path):
    # A tensor named '__metadata__' made a file no reader could open.
    path = tmp_path / "x.safetensors"
    eqshard.save_safetensors(path, {"w": np.ones(2, np.float32)})
    for tree, sep in [
        ({"__metadata__": np.zeros(2, np.float32)}, "."),
        ({"__meta": {"data__": np.zeros(2, np.float32)}}, ""),
    ]:
        with pytest.raises(ValueError, match="would be named '__metadata__'"):
            eqshard.save_safetensors(path, tree, sep=sep, overwrite=True)
        assert list(safetensors.numpy.load_file(str(path))) == ["w"]
    # A path that only starts with it is another name, and reads back.
    eqshard.save_safetensors(
        path, {"__metadata__": {"x": np.zeros(2, np.float32)}}, overwrite=True
    )
    assert list(safetensors.numpy.load_file(str(path))) == ["__metadata__.x"]


def test_round_trip_of_scalars_and_empty_arrays(tmp_path):
    mesh = _mesh((2, 4), ("dp", "tp"))
    tree = {"s": np.array(2.5, np.float32), "e": np.zeros((0, 4), np.int8)}
    eqshard.save_safetensors(tmp_path / "x.safetensors", tree)
    read = safetensors.numpy.load_file(str(tmp_path / "x.safetensors"))
    assert read["s"].shape == () and read["s"] == np.float32(2.5)
    assert read["e"].shape == (0, 4) and read["e"].dtype == np.int8
    out = eqshard.load_safetensors(
        tmp_path / "x.safetensors", tree, {"s": P(), "e": P(None, "tp")}, mesh
    )
    assert np.asarray(out["s"]) == np.float32(2.5)
    assert out["e"].shape == (0, 4) and out["e"].dtype == jnp.int8


def test_each_device_owns_its_block_and_the_file_can_change(tmp_path):
    # Blocks of whole rows (one run of the file), blocks that split rows
    # (strided), a leading axis one wide, and blocks several or all devices
    # hold.
    rng = np.random.default_rng(1)
    tensors = {
        "rows": rng.standard_normal((8, 6)).astype(np.float32),
        "cols": rng.standard_normal((4, 8)).astype(np.float32),
        "thin": rng.standard_normal((1, 8, 3)).astype(np.float16),
        "deep": rng.standard_normal((2, 8, 3)).astype(np.float16),
        "vec": rng.integers(-9, 9, 8, dtype=np.int32),
        "all": rng.standard_normal((3, 5)).astype(np.float32),
    }
    specs = {
        "rows": P("dp"),
        "cols": P(None, "tp"),
        "thin": P(None, "tp"),
        "deep": P(None, ("dp", "tp")),
        "vec": P("tp"),
        "all": P(),
    }
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(tensors, str(path))
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in tensors.items()}
    mesh = _mesh((2, 4), ("dp", "tp"))
    out = eqshard.load_safetensors(path, like, specs, mesh)
    with open(path, "r+b") as f:  # the same file, its data overwritten
        (length,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + length)
        f.write(bytes(os.path.getsize(path) - 8 - length))
    for name, want in tensors.items():
        array = out[name]
        assert array.sharding == NamedSharding(mesh, specs[name])
        addresses = set()
        for shard in array.addressable_shards:
            assert np.asarray(shard.data).tobytes() == want[shard.index].tobytes()
            addresses.add(shard.data.unsafe_buffer_pointer())
        assert len(addresses) == 8  # no two devices share a buffer


# ---------------------------------------------------------------------------------
# Every dtype eqshard can write round-trips bit for bit; the others are refused
# before anything is written.


def _file_header(path):
    """The header of a safetensors file, read with the standard library."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def _bit_patterns(dtype, shape, seed=0):
    """Every kind of value of `dtype` (NaNs, infinities, extremes), from random
    bytes; bool as 0/1."""
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = rng.integers(0, 256, size, dtype=np.uint8)
    if dtype == np.bool_:
        return (raw & 1).astype(np.bool_).reshape(shape)
    return raw.view(dtype).reshape(shape)


_WRITABLE = [
    (np.bool_, "BOOL"),
    (np.int8, "I8"),
    (np.uint8, "U8"),
    (np.int16, "I16"),
    (np.uint16, "U16"),
    (np.int32, "I32"),
    (np.uint32, "U32"),
    (np.int64, "I64"),
    (np.uint64, "U64"),
    (np.float16, "F16"),
    (ml_dtypes.bfloat16, "BF16"),
    (np.float32, "F32"),
    (np.float64, "F64"),
    (np.complex64, "C64"),
    (ml_dtypes.float8_e4m3fn, "F8_E4M3"),
    (ml_dtypes.float8_e5m2, "F8_E5M2"),
    (ml_dtypes.float8_e8m0fnu, "F8_E8M0"),
    (ml_dtypes.float8_e4m3fnuz, "F8_E4M3FNUZ"),
    (ml_dtypes.float8_e5m2fnuz, "F8_E5M2FNUZ"),
]


@pytest.mark.parametrize("dtype, name", _WRITABLE, ids=lambda x: str(x))
def test_every_dtype_round_trips_bit_exact(tmp_path, dtype, name):
    dtype = np.dtype(dtype)
    want = _bit_patterns(dtype, (8, 4))
    mesh, other = _mesh((2, 4), ("dp", "tp")), _mesh((4, 2), ("tp", "dp"))
    path = tmp_path / "x.safetensors"
    with jax.enable_x64(dtype.itemsize == 8):
        tree = {"a": eqshard.shard(want, P("dp", "tp"), mesh), "host": want}
        eqshard.save_safetensors(path, tree)
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
        out = eqshard.load_safetensors(path, like, {"a": P("tp"), "host": P()}, other)
    header = _file_header(path)
    assert header["a"] == {
        "dtype": name,
        "shape": [8, 4],
        "data_offsets": [0, 32 * dtype.itemsize],
    }
    for key in ("a", "host"):
        assert out[key].dtype == dtype
        assert np.asarray(out[key]).tobytes() == want.tobytes()
    assert out["a"].sharding == NamedSharding(other, P("tp"))
    if (
        hasattr(np, dtype.name) or dtype == ml_dtypes.bfloat16
    ):  # what safetensors' NumPy reader knows
        read = safetensors.numpy.load_file(str(path))
        assert read["a"].tobytes() == want.tobytes()


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_keys_round_trip(tmp_path, impl):
    mesh, other = _mesh((2, 4), ("dp", "tp")), _mesh((8,), ("fsdp",))
    keys = jax.random.split(jax.random.key(3, impl=impl), 8)
    tree = {
        "k": eqshard.shard(keys, P("dp"), mesh),
        "one": jax.random.key(5, impl=impl),
    }
    eqshard.save_safetensors(tmp_path / "k.safetensors", tree)
    header = _file_header(tmp_path / "k.safetensors")
    width = jax.random.key_data(keys).shape[-1]
    assert header["k"]["dtype"] == "U32" and header["k"]["shape"] == [8, width]
    like = eqx.filter_eval_shape(lambda: tree)
    out = eqshard.load_safetensors(
        tmp_path / "k.safetensors", like, {"k": P("fsdp"), "one": P()}, other
    )
    for name in ("k", "one"):
        assert jnp.issubdtype(out[name].dtype, jax.dtypes.prng_key)
        assert str(jax.random.key_impl(out[name])) == impl
        want = np.asarray(jax.random.key_data(tree[name]))
        assert np.asarray(jax.random.key_data(out[name])).tobytes() == want.tobytes()
    assert out["k"].sharding == NamedSharding(other, P("fsdp"))
    # A key loads into a key `like` only: its data is no key.
    with pytest.raises(ValueError, match=rf"'k'.*shape \(8, {width}\) there, \(8,\)"):
        eqshard.load_safetensors(
            tmp_path / "k.safetensors",
            {"k": jax.ShapeDtypeStruct((8,), jnp.uint32), "one": like["one"]},
            P(),
            other,
        )


@pytest.mark.parametrize(
    "dtype",
    [
        jnp.int4,
        jnp.uint4,
        jnp.int2,
        jnp.uint2,
        jnp.float4_e2m1fn,
        jnp.float8_e4m3,  # IEEE-style, not safetensors' F8_E4M3 (e4m3fn)
        jnp.float8_e3m4,
        jnp.float8_e4m3b11fnuz,
        jnp.complex128,
    ],
)
def test_save_refuses_dtypes_it_cannot_write_before_writing(tmp_path, dtype):
    (tmp_path / "x.safetensors").write_bytes(b"old")
    tree = {"ok": np.zeros(2, np.float32), "a": {"b": np.zeros(4, dtype)}}
    with pytest.raises(
        TypeError, match=rf"eqshard.save_safetensors: .*'a.b' \({np.dtype(dtype)}\)"
    ):
        eqshard.save_safetensors(tmp_path / "x.safetensors", tree)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]
    assert (tmp_path / "x.safetensors").read_bytes() == b"old"


def _raw_file(path, header, data):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("dtype", ["F4", "F6_E2M3", "F6_E3M2"])
def test_load_refuses_sub_byte_floats_naming_the_tensor(tmp_path, dtype):
    bits = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}[dtype]
    _raw_file(
        tmp_path / "q.safetensors",
        {"w": {"dtype": dtype, "shape": [8], "data_offsets": [0, bits]}},
        b"\0" * bits,
    )
    like = {"w": jax.ShapeDtypeStruct((8,), jnp.float4_e2m1fn)}
    with pytest.raises(
        TypeError,
        match=rf"eqshard.load_safetensors: .*'w' of .*q.safetensors.*{dtype}",
    ):
        eqshard.load_safetensors(
            tmp_path / "q.safetensors", like, P(), _mesh((8,), ("x",))
        )


# ---------------------------------------------------------------------------------
# Zero-size arrays and trees without arrays.


def test_zero_size_arrays_and_trees_without_arrays_round_trip(tmp_path):
    mesh = _mesh((2, 4), ("dp", "tp"))
    tree = {
        "e": eqshard.shard(
            np.zeros((0, 4), ml_dtypes.float8_e5m2), P(None, "tp"), mesh
        ),
        "keys": jax.random.split(jax.random.key(0), 0),
        "n": 3,
    }
    eqshard.save_safetensors(tmp_path / "e.safetensors", tree)
    header = _file_header(tmp_path / "e.safetensors")
    assert header["e"] == {"dtype": "F8_E5M2", "shape": [0, 4], "data_offsets": [0, 0]}
    out = eqshard.load_safetensors(
        tmp_path / "e.safetensors", eqx.filter_eval_shape(lambda: tree), P(), mesh
    )
    assert out["e"].shape == (0, 4) and out["e"].dtype == jnp.float8_e5m2
    assert out["keys"].shape == (0,) and out["n"] == 3
    assert jnp.issubdtype(out["keys"].dtype, jax.dtypes.prng_key)
    for empty in ({}, {"n": 3, "f": jnp.tanh}, None):
        eqshard.save_safetensors(tmp_path / "none.safetensors", empty, overwrite=True)
        assert safetensors.numpy.load_file(str(tmp_path / "none.safetensors")) == {}
        assert _file_header(tmp_path / "none.safetensors") == {}
        assert eqshard.load_safetensors(tmp_path / "none.safetensors", empty) == empty
    # And a file without tensors against a `like` with arrays names them.
    with pytest.raises(ValueError, match="not there: 'e'"):
        eqshard.load_safetensors(tmp_path / "none.safetensors", tree)


# ---------------------------------------------------------------------------------
# Damaged and lying files: eqshard's error, naming the file (and the tensor).


def _good_file(path):
    """Two float32 tensors, 'a' (2,) then 'b' (3,), written by safetensors."""
    a, b = np.arange(2, dtype=np.float32), np.arange(3, dtype=np.float32)
    safetensors.numpy.save_file({"a": a, "b": b}, str(path))
    return {
        "a": jax.ShapeDtypeStruct((2,), jnp.float32),
        "b": jax.ShapeDtypeStruct((3,), jnp.float32),
    }


def _lying(size=20, entry=None, **fields):
    """A file of _good_file's data (`size` bytes) whose header lies about 'b':
    its `entry`, or its `fields` changed."""
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": entry or {"dtype": "F32", "shape": [3], "data_offsets": [8, 20], **fields},
    }
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\1" * size


@pytest.mark.parametrize(
    "damage, tensor",
    [
        (lambda raw: raw[:-4], "b"),  # truncated data
        (lambda raw: raw[:30], None),  # truncated header
        (lambda raw: raw[:5], None),  # not even a header length
        (lambda raw: b"", None),
        (lambda raw: raw + b"\0" * 4, None),  # bytes no tensor owns
        (lambda raw: struct.pack("<Q", 10**9) + raw[8:], None),  # header length
        (lambda raw: struct.pack("<Q", 7) + b"not json" + raw[16:], None),
        (lambda _: _lying(data_offsets=[8, 40]), "b"),  # past the end
        (lambda _: _lying(shape=[4]), "b"),  # more bytes than its offsets hold
        (lambda _: _lying(dtype="F64"), "b"),
        (lambda _: _lying(16, data_offsets=[4, 16]), "b"),  # overlapping 'a'
        (lambda _: _lying(shape=[-3]), None),
        (lambda _: _lying(shape=[2**62, 4]), "b"),
        (lambda _: _lying(dtype="NOPE"), None),
        (lambda _: _lying(entry="nothing"), None),
        (lambda _: pickle.dumps({"a": np.zeros(2, np.float32)}), None),  # a pickle
    ],
)
def test_damaged_and_lying_files_are_eqshard_errors_naming_them(
    tmp_path, damage, tensor
):
    path = tmp_path / "m.safetensors"
    like = _good_file(path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match="eqshard.load_safetensors: ") as error:
        eqshard.load_safetensors(path, like, P(), _mesh((8,), ("x",)))
    assert repr(str(path)) in str(error.value)
    if tensor is not None:
        assert f"at the tensor {tensor!r}" in str(error.value)


# ---------------------------------------------------------------------------------
# Indexes: malformed ones, and no file read from outside the index's directory.


def _index(path, weight_map):
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "is not JSON"),
        (b"\xff\xfe\x00garbage", "is not JSON"),
        ("[" * 100_000 + "]" * 100_000, "is not JSON"),
        ("[1, 2]", "holds list, not an object"),
        ('"weights"', "holds str, not an object"),
        ('{"metadata": {}}', "has no `weight_map`"),
        ('{"weight_map": ["a.safetensors"]}', "`weight_map` of type list"),
        ('{"weight_map": null}', "has no `weight_map`"),
        (
            '{"weight_map": {"a": 3}}',
            "maps 'a' to 3, not a file",
        ),
        ('{"weight_map": {"a": "m\\u0000.safetensors"}}', "not a file"),
        (
            '{"weight_map": {"a": ["m.safetensors"]}}',
            r"maps 'a' to \['m.safetensors'\]",
        ),
        (
            '{"weight_map": {"a": "gone.safetensors"}}',
            "maps 'a' to 'gone.safetensors', which is not there",
        ),
    ],
    ids=lambda x: x[:30] if isinstance(x, str) else None,
)
def test_malformed_index_is_an_eqshard_error_naming_it(tmp_path, content, match):
    _good_file(tmp_path / "m.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    if isinstance(content, bytes):
        index.write_bytes(content)
    else:
        index.write_text(content)
    with pytest.raises(ValueError, match=match) as error:
        eqshard.load_safetensors(
            index, {"a": np.zeros(2, np.float32)}, P(), _mesh((8,), ("x",))
        )
    assert str(error.value).startswith(
        f"eqshard.load_safetensors: the index {str(index)!r} "
    )


def test_index_reads_nothing_outside_its_directory(tmp_path):
    mesh = _mesh((8,), ("x",))
    inside, outside = tmp_path / "repo", tmp_path / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    like = _good_file(outside / "x.safetensors")
    _good_file(inside / "m.safetensors")
    (inside / "link.safetensors").symlink_to(outside / "x.safetensors")
    (inside / "sub").mkdir()
    (inside / "sub" / "up.safetensors").symlink_to(inside / "m.safetensors")
    index = inside / "model.safetensors.index.json"
    for name, points_to in [
        ("../elsewhere/x.safetensors", outside / "x.safetensors"),
        (str(outside / "x.safetensors"), outside / "x.safetensors"),
        ("/etc/passwd", "/etc/passwd"),
        ("link.safetensors", outside / "x.safetensors"),
        ("sub/../../elsewhere/x.safetensors", outside / "x.safetensors"),
    ]:
        _index(index, {"a": "m.safetensors", "b": name})
        with pytest.raises(ValueError, match="outside the index's directory") as error:
            eqshard.load_safetensors(index, like, P(), mesh)
        message = str(error.value)
        assert f"maps 'b' to {name!r}, which is {str(points_to)!r}" in message
    # An index named in an index, itself, a pickle: refused, not followed.
    (inside / "pytorch_model.bin").write_bytes(pickle.dumps({"a": 1}))
    for name in (
        "model.safetensors.index.json",
        "other.index.json",
        "pytorch_model.bin",
    ):
        _index(index, {"a": "m.safetensors", "b": name})
        with pytest.raises(
            ValueError,
            match=f"maps 'b' to {name!r}, which is not a `.safetensors` file",
        ):
            eqshard.load_safetensors(index, like, P(), mesh)
    # Inside (through a subdirectory and a link that stays inside): read.
    _index(index, {"a": "m.safetensors", "b": "sub/up.safetensors"})
    out = eqshard.load_safetensors(index, like, P(), mesh)
    np.testing.assert_array_equal(out["b"], np.arange(3, dtype=np.float32))


def test_index_in_a_hugging_face_cache_layout(tmp_path):
    """The Hugging Face cache keeps files in `blobs/` and links them, and the index,
    from `snapshots/<revision>/`: each link resolves where the index's does."""
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    like = _good_file(repo / "blobs" / "9f2c")
    (snapshot / "model.safetensors").symlink_to("../../blobs/9f2c")
    _index(
        repo / "blobs" / "77e1", {"a": "model.safetensors", "b": "model.safetensors"}
    )
    (snapshot / "model.safetensors.index.json").symlink_to("../../blobs/77e1")
    out = eqshard.load_safetensors(
        snapshot / "model.safetensors.index.json", like, P(), _mesh((8,), ("x",))
    )
    np.testing.assert_array_equal(out["a"], np.arange(2, dtype=np.float32))


class _Payload:
    """Unpickling this makes a directory: the proof that something unpickled it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_nothing_is_ever_unpickled(tmp_path):
    marker = str(tmp_path / "unpickled")
    payload = pickle.dumps(_Payload(marker))
    (tmp_path / "pytorch_model.bin").write_bytes(payload)
    (tmp_path / "disguised.safetensors").write_bytes(payload)
    _index(tmp_path / "model.safetensors.index.json", {"a": "pytorch_model.bin"})
    _index(
        tmp_path / "disguised.safetensors.index.json", {"a": "disguised.safetensors"}
    )
    like = {"a": jax.ShapeDtypeStruct((2,), jnp.float32)}
    for files in (
        "pytorch_model.bin",
        "disguised.safetensors",
        "model.safetensors.index.json",
        "disguised.safetensors.index.json",
    ):
        with pytest.raises(ValueError, match="eqshard.load_safetensors: ") as error:
            eqshard.load_safetensors(tmp_path / files, like, P(), _mesh((8,), ("x",)))
        assert "bin" in str(error.value) or "disguised" in str(error.value)
    assert not os.path.exists(marker)
    # What could unpickle: no module of eqshard imports pickle or calls np.load.
    for module in pathlib.Path(eqshard.__file__).parent.glob("*.py"):
        text = module.read_text()
        for call in ("import pickle", "from pickle", "np.load(", "numpy.load("):
            assert call not in text, (module, call)


# ---------------------------------------------------------------------------------
# Saving: nothing left behind, and the old file kept, on any failure.


def test_save_into_a_missing_directory_names_it(tmp_path):
    missing = tmp_path / "no" / "such"
    with pytest.raises(
        ValueError, match="eqshard.save_safetensors: cannot write"
    ) as error:
        eqshard.save_safetensors(missing / "m.safetensors", {"a": np.zeros(2)})
    assert f"there is no directory {str(missing)!r}" in str(error.value)
    assert ".partial" not in str(error.value)
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(ValueError, match="dir.safetensors' is a directory"):
        eqshard.save_safetensors(tmp_path / "dir.safetensors", {"a": np.zeros(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.safetensors"]


@pytest.mark.parametrize("limit", [4, 100, 5000])
def test_interrupted_save_keeps_the_old_file_and_leaves_nothing(tmp_path, limit):
    mesh = _mesh((2, 4), ("dp", "tp"))
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"old": np.arange(3, dtype=np.int8)}, str(path))
    old = path.read_bytes()
    tree = {"w": eqshard.shard(np.ones((64, 64), np.float32), P("dp", "tp"), mesh)}
    with file_size_limit(limit), pytest.raises(ValueError) as error:  # a full disk
        eqshard.save_safetensors(path, tree, overwrite=True)
    assert str(error.value).startswith(
        f"eqshard.save_safetensors: could not write {str(path)!r}: File too large"
    )
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
    eqshard.save_safetensors(path, tree, overwrite=True)  # and with room, saved
    assert (
        safetensors.numpy.load_file(str(path))["w"].tobytes()
        == np.ones((64, 64), np.float32).tobytes()
    )


def test_save_timeout_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="eqshard.save_safetensors: timeout must be"):
        eqshard.save_safetensors(
            tmp_path / "m.safetensors", {"a": np.zeros(2)}, timeout=0
        )
    assert not list(tmp_path.iterdir())
