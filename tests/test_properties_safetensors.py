# The property suite for safetensors files (see tests/test_properties.py for the
# strategies): over random pytrees, dtypes, meshes and specs, `save_safetensors ->
# load_safetensors` onto another mesh gives back every array bit for bit, placed as
# asked, or raises an eqshard `ValueError`/`TypeError` that names a path; and a
# damaged file (truncated, extended, or with a header that lies about offsets,
# shapes or dtypes) or an interrupted save (a full disk) raises an eqshard error
# naming the file, leaves no partial file behind and the old file as it was.
#
# 64-bit arrays are saved and loaded with `jax_enable_x64` on: what loading does to
# them with it off is the dtype-narrowing policy's concern, not the format's.
#
# Runs in CI with the derandomised "ci" profile of conftest.py; for a longer search
# run
# `HYPOTHESIS_PROFILE=long python -m pytest -q tests/test_properties_safetensors.py`.

import json
import os
import struct
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import safetensors.numpy
from hypothesis import event, given, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P
from probes import file_size_limit
from test_properties import MESHES, spec_trees, trees

import eqshard


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct)


def _paths(tree: Any) -> set[str]:
    """Every path of `tree` (leaves and the nodes above them, `None`s and empty
    containers included), as eqshard names them (with `/` and with `.`), and
    `<root>`."""

    def ends(x: Any) -> bool:
        return x is None or (isinstance(x, dict | list | tuple) and not x)

    out = {"<root>"}
    for path, _ in jtu.tree_flatten_with_path(tree, is_leaf=ends)[0]:
        for k in range(1, len(path) + 1):
            for sep in ("/", "."):
                name = eqshard.tree_path_to_string(path[:k], sep=sep)
                assert isinstance(name, str)  # a separator gives a string
                out.add(name)
    return out


def _assert_names_a_path(error: Exception, tree: Any) -> None:
    message = str(error)
    assert message.startswith("eqshard."), message
    assert any(f"'{p}'" in message for p in _paths(tree)), message


def _stored(x: Any) -> np.ndarray:
    """What the file holds for an array leaf, by raw JAX and NumPy: a key's data,
    any other array in native byte order."""
    if _is_key(x):
        return np.asarray(jax.random.key_data(x))
    x = np.asarray(x)
    return x.astype(x.dtype.newbyteorder("="))


def _like(x: Any) -> Any:
    """A struct of an array leaf, with the sharding of a JAX array."""
    if not _is_array(x):
        return x
    dtype = np.dtype(x.dtype).newbyteorder("=") if not _is_key(x) else x.dtype
    return jax.ShapeDtypeStruct(x.shape, dtype, sharding=getattr(x, "sharding", None))


def _file(directory: str, name: str = "m.safetensors") -> str:
    return os.path.join(directory, name)


@given(data=st.data(), tree=trees(), mesh=st.sampled_from(MESHES))
def test_save_then_load_is_exact_or_an_eqshard_error(data, tree, mesh):
    with tempfile.TemporaryDirectory() as directory, jax.enable_x64(True):
        path = _file(directory)
        try:
            eqshard.save_safetensors(path, tree)
        except (ValueError, TypeError) as error:
            event(f"save refused: {str(error)[26:76]}")
            assert str(error).startswith("eqshard.save_safetensors: ")
            _assert_names_a_path(error, tree)
            assert os.listdir(directory) == []  # nothing written
            return
        assert os.listdir(directory) == ["m.safetensors"]
        like = jtu.tree_map(_like, tree)
        specs = data.draw(spec_trees(tree, mesh))
        try:
            out = eqshard.load_safetensors(path, like, specs, mesh)
        except (ValueError, TypeError) as error:
            event(f"load refused: {str(error)[26:76]}")
            assert str(error).startswith("eqshard.load_safetensors: ")
            _assert_names_a_path(error, tree)
            return
        event("loaded")
        spec_leaves, spec_def = jtu.tree_flatten(
            specs, is_leaf=lambda x: x is None or isinstance(x, P | NamedSharding)
        )
        flat_specs = [
            spec
            for spec, sub in zip(spec_leaves, spec_def.flatten_up_to(tree), strict=True)
            for _ in jtu.tree_leaves(sub)
        ]
        for x, spec, got in zip(
            jtu.tree_leaves(tree), flat_specs, jtu.tree_leaves(out), strict=True
        ):
            if not _is_array(x):
                assert got is x
                continue
            where = f"{x.dtype}{x.shape} spec {spec}"
            if spec is None:
                sharding = x.sharding
            elif isinstance(spec, NamedSharding):
                sharding = spec
            else:
                sharding = NamedSharding(mesh, spec)
            assert got.sharding.is_equivalent_to(sharding, got.ndim), where
            if _is_key(x):
                assert _is_key(got), where
                assert str(jax.random.key_impl(got)) == str(jax.random.key_impl(x))
                got = jax.random.key_data(got)
            want, got = _stored(x), np.asarray(got)
            assert got.dtype == want.dtype and got.shape == want.shape, where
            assert got.tobytes() == want.tobytes(), where


# ---------------------------------------------------------------------------------
# Fault injection: damaged files and interrupted saves.

_TREES = st.dictionaries(
    st.sampled_from(["a", "b", "c", "d"]),
    st.tuples(
        st.lists(st.integers(0, 4), max_size=2),
        st.sampled_from([np.float32, np.int8, np.float16, np.bool_, np.int64]),
    ).map(lambda s: np.ones(s[0], s[1])),
    min_size=1,
    max_size=4,
)


def _read_header(raw: bytes) -> tuple[dict[str, Any], bytes]:
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _with_header(header: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


_ITEMSIZES = {"F32": 4, "I8": 1, "F16": 2, "BOOL": 1, "I64": 8, "F64": 8, "U16": 2}


@st.composite
def damages(draw, raw: bytes) -> tuple[str, bytes]:
    """A damaged copy of the file `raw`: truncated, extended, or with a header
    whose offsets, shape or dtype do not agree with the data."""
    header, data = _read_header(raw)
    names = sorted(header)
    kind = draw(st.sampled_from(["truncated", "extended", "end", "shape", "dtype"]))
    if kind == "truncated":
        return kind, raw[: draw(st.integers(0, len(raw) - 1))]
    if kind == "extended":
        return kind, raw + draw(st.binary(min_size=1, max_size=16))
    name = draw(st.sampled_from(names))
    entry = dict(header[name])
    begin, end = entry["data_offsets"]
    if kind == "end":  # past the end, or over the next tensor
        entry["data_offsets"] = [begin, end + draw(st.integers(1, 64))]
    elif kind == "shape":  # more or fewer elements than its bytes
        size = (end - begin) // _ITEMSIZES[entry["dtype"]]
        entry["shape"] = [size + draw(st.sampled_from([-1, 1, 2]))]
        if entry["shape"][0] < 0:
            entry["shape"] = [size + 1]
    else:  # another element size
        others = [d for d, n in _ITEMSIZES.items() if n != _ITEMSIZES[entry["dtype"]]]
        entry["dtype"] = draw(st.sampled_from(others))
        if end == begin:  # no bytes: any dtype fits them, so shift the offsets
            entry["data_offsets"] = [begin, end + 1]
    return kind, _with_header({**header, name: entry}, data)


@given(data=st.data(), tree=_TREES)
def test_a_damaged_file_is_an_eqshard_error_naming_it(data, tree):
    with tempfile.TemporaryDirectory() as directory, jax.enable_x64(True):
        path = _file(directory)
        eqshard.save_safetensors(path, tree)
        with open(path, "rb") as f:
            kind, damaged = data.draw(damages(f.read()))
        event(kind)
        with open(path, "wb") as f:
            f.write(damaged)
        mesh = MESHES[0]
        try:
            eqshard.load_safetensors(path, tree, P(), mesh)
        except (ValueError, TypeError) as error:
            message = str(error)
            assert message.startswith("eqshard.load_safetensors: "), message
            assert path in message or "in m.safetensors" in message, message
        else:
            raise AssertionError(f"a {kind} file loaded")


@given(
    old=_TREES,
    new=_TREES,
    limit=st.integers(1, 256),
    sharded=st.booleans(),
)
def test_an_interrupted_save_leaves_the_old_file(old, new, limit, sharded):
    with tempfile.TemporaryDirectory() as directory, jax.enable_x64(True):
        path = _file(directory)
        eqshard.save_safetensors(path, old)
        with open(path, "rb") as f:
            before = f.read()
        if sharded:
            new = eqshard.shard(new, P(), MESHES[2])
        with file_size_limit(limit):  # a disk with `limit` bytes left
            try:
                eqshard.save_safetensors(path, new, overwrite=True)
                saved = True
            except ValueError as error:
                saved = False
                message = str(error)
                assert message.startswith(
                    f"eqshard.save_safetensors: could not write {path!r}: "
                ), message
        assert os.listdir(directory) == ["m.safetensors"]  # no partial file
        with open(path, "rb") as f:
            after = f.read()
        if saved:
            event("saved")
            assert len(after) <= limit
            read = safetensors.numpy.load_file(path)
            assert sorted(read) == sorted(new)
            for name, value in read.items():
                assert value.tobytes() == np.asarray(new[name]).tobytes()
        else:
            event("interrupted")
            assert after == before
