import json

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

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


def test_save_refuses_dtypes_without_a_name(tmp_path):
    with pytest.raises(TypeError, match="'a.b'"):
        eqshard.save_safetensors(
            tmp_path / "x.safetensors", {"a": {"b": np.zeros(2, np.complex128)}}
        )
    assert not list(tmp_path.iterdir())


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
