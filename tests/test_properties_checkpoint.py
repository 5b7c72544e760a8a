# The property suite for checkpoints: over random pytrees, dtypes, meshes and specs
# (the strategies of test_properties.py), `save -> restore` onto another mesh gives
# back every array bit for bit, placed as asked, or raises an eqshard
# `ValueError`/`TypeError` whose message starts with `eqshard.` and names a path.
# And a save that fails, early or late, leaves the checkpoint that was there as it
# was; damaged files are eqshard's error naming the checkpoint.
#
# Runs in CI with the derandomised "ci" profile of conftest.py; for a longer search
# run `HYPOTHESIS_PROFILE=long python -m pytest -q tests/test_properties_checkpoint.py`.

import contextlib
import glob
import json
import os
import resource
import signal
import tempfile

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from test_properties import (
    _check_same,
    _expected,
    _is_key,
    _paths,
    MESHES,
    spec_trees,
    trees,
)

import eqshard


pytest.importorskip("orbax.checkpoint")

# A save and a restore take ~0.1 s each: a fifth of the profile's examples.
EXAMPLES = max(20, settings().max_examples // 5)


def _refused(error: Exception, tree) -> str:
    message = str(error)
    assert isinstance(error, ValueError | TypeError), repr(error)
    assert message.startswith("eqshard."), message
    assert any(f"'{p}'" in message for p in _paths(tree)), message
    return message


def _flat_specs(specs, tree):
    """The spec of each leaf of `tree`, from a spec tree that is a prefix of it."""
    is_spec = lambda x: x is None or isinstance(x, P | NamedSharding)  # noqa: E731
    leaves, treedef = jtu.tree_flatten(specs, is_leaf=is_spec)
    return [
        spec
        for spec, sub in zip(leaves, treedef.flatten_up_to(tree), strict=True)
        for _ in jtu.tree_leaves(sub)
    ]


# ---------------------------------------------------------------------------------
# save -> restore onto another mesh.


def _specs(tree, mesh):
    """Random specs (test_properties.py's: valid and invalid), or specs that fit."""
    return st.one_of(spec_trees(tree, mesh), _fitting(tree, mesh))


@st.composite
def _fitting(draw, tree, mesh):
    """Specs that fit: each array split over axes that divide it, or whole."""

    def spec(x):
        if not eqshard.is_array(x):
            return None
        shape = x.shape
        entries = []
        for n in shape[: draw(st.integers(0, len(shape)))]:
            axes = [a for a in mesh.axis_names if n % mesh.shape[a] == 0]
            axes = [a for a in axes if a not in entries]
            entries.append(draw(st.sampled_from([None, *axes])))
        return P(*entries)

    return jtu.tree_map(spec, tree, is_leaf=lambda x: x is None)


@settings(deadline=None, max_examples=EXAMPLES)
@given(data=st.data(), tree=trees(), meshes=st.permutations(MESHES))
def test_save_then_restore_elsewhere_is_exact(data, tree, meshes):
    saved_on, restored_on = meshes[0], meshes[1]
    try:
        placed = eqshard.shard(tree, data.draw(_specs(tree, saved_on)), saved_on)
    except (ValueError, TypeError):
        placed = tree  # saved as it is: NumPy data and arrays on one device
    with tempfile.TemporaryDirectory() as tmp:
        directory = os.path.join(tmp, "c")
        try:
            eqshard.save(directory, placed)
        except Exception as error:
            event(f"save refused: {_refused(error, tree)[:50]}")
            assert not os.listdir(tmp)  # nothing written
            return
        specs = data.draw(_specs(tree, restored_on))
        like = eqshard.abstract(tree)
        try:
            # Specs that do not fit are refused here (by default they are
            # adapted to the mesh, with a warning: tested in test_checkpoint).
            out = eqshard.restore(
                directory, like, specs, restored_on, on_invalid="raise"
            )
        except Exception as error:
            event(f"restore refused: {_refused(error, tree)[:50]}")
            return
    event("restored")
    leaves = jtu.tree_leaves(tree)
    flat = _flat_specs(specs, tree)
    for x, spec, got in zip(leaves, flat, jtu.tree_leaves(out), strict=True):
        if not eqshard.is_array(x):
            assert got is x
            continue
        where = f"{x.dtype}{x.shape} spec {spec}"
        assert isinstance(got, jax.Array), where
        if not isinstance(spec, NamedSharding):
            spec = NamedSharding(restored_on, spec)
        assert got.sharding.is_equivalent_to(spec, got.ndim), where
        value = jax.random.key_data(got) if _is_key(got) else got
        _check_same(np.asarray(value), _expected(x, placed=True), where)


# ---------------------------------------------------------------------------------
# Faults: the old checkpoint stays, and the error names the path.

_OLD = {
    "w": np.linspace(-1, 1, 64 * 8, dtype=np.float32).reshape(64, 8),
    "ids": np.arange(8, dtype=np.int32),
    "h": np.linspace(0, 1, 8).astype(jnp.bfloat16),
}


@contextlib.contextmanager
def _files_at_most(size):
    """Writes of files past `size` bytes fail in this process, as on a full disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def _unsavable(kind):
    if kind == "deleted":
        x = jnp.ones(3)
        x.delete()
        return x
    if kind == "struct":
        return jax.ShapeDtypeStruct((3,), jnp.float32)
    return np.array(["text"])


def _restores_old(directory, mesh):
    like = eqshard.abstract(_OLD, P(), mesh)
    out = eqshard.gather(eqshard.restore(directory, like))
    for name, want in _OLD.items():
        _check_same(out[name], want, name)


@settings(deadline=None, max_examples=EXAMPLES)
@given(
    tree=trees(),
    fault=st.sampled_from(["deleted", "struct", "text", "late"]),
    mesh=st.sampled_from(MESHES),
)
def test_a_failed_save_leaves_the_old_checkpoint(tree, fault, mesh):
    with tempfile.TemporaryDirectory() as tmp:
        directory = os.path.join(tmp, "c")
        eqshard.save(directory, _OLD)
        if fault == "late":  # orbax fails while writing, as on a full disk
            # One array alone: when one of several writes fails, orbax abandons the
            # others' futures, which Python would report later, from any test.
            noise = np.random.default_rng(0).standard_normal(1 << 18)
            with _files_at_most(1 << 19), pytest.raises(ValueError) as caught:
                eqshard.save(directory, noise.astype(np.float32), overwrite=True)
            assert str(caught.value).startswith(
                f"eqshard.save: writing the checkpoint at '{directory}'"
            )
        else:
            new = {"tree": tree, "bad": _unsavable(fault)}
            with pytest.raises((ValueError, TypeError)) as caught:
                eqshard.save(directory, new, overwrite=True)
            assert "'bad'" in _refused(caught.value, new)
        assert os.listdir(tmp) == ["c"]  # nothing new left beside it
        _restores_old(directory, mesh)


def _truncate_data(directory):
    data = max(
        glob.glob(os.path.join(directory, "ocdbt.process_0", "d", "*")),
        key=os.path.getsize,
    )
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)


def _damage(name):
    def damage(directory):
        with open(os.path.join(directory, name), "r+b") as f:
            f.truncate(5)

    return damage


_ONE_DEVICE = jax.make_mesh(
    (1,), ("dp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1]
)


@settings(deadline=None, max_examples=EXAMPLES)
@given(
    damage=st.sampled_from(
        [_truncate_data, _damage("_METADATA"), _damage("eqshard.json")]
    ),
    spec=st.sampled_from([P(), P("dp"), None]),
)
def test_damaged_files_are_an_eqshard_error_naming_them(damage, spec):
    # One array on one device: when one of several reads fails, orbax abandons the
    # others' coroutines, which Python would report later, from any test.
    with tempfile.TemporaryDirectory() as tmp:
        directory = os.path.join(tmp, "c")
        one = {"w": _OLD["w"]}
        eqshard.save(directory, one)
        damage(directory)
        like = eqshard.abstract(one, P(), _ONE_DEVICE)
        with pytest.raises(ValueError) as caught:
            eqshard.restore(directory, like, spec, _ONE_DEVICE)
        message = str(caught.value)
        assert message.startswith("eqshard.restore: "), message
        assert directory in message and "damaged" in message, message


# ---------------------------------------------------------------------------------
# A hostile eqshard.json: random bytes, random JSON, and fields that lie.

_HONEST = {
    "w": np.arange(8, dtype=np.float32),
    "empty": np.zeros((0, 3), np.int8),
    "bits": np.arange(8).astype(jnp.uint4),
    "ids": np.arange(4, dtype=np.int32).reshape(2, 2),
}
_DTYPE_NAMES = ["float32", "int8", "int4", "uint4", "uint8", "int16", "bool"]
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 10)
    | st.sampled_from(_DTYPE_NAMES + ["object", "<f4", "", "w"]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["shape", "dtype", "saved_as", "x"]), inner)
    ),
    max_leaves=8,
)
_FIELDS = [
    "version",
    "orbax",
    "generation",
    "stage_views",
    "arrays",
    *(f"arrays/{n}" for n in ("empty", "bits", "w", "new")),
    *(
        f"arrays/{n}/{k}"
        for n in ("empty", "bits")
        for k in ("shape", "dtype", "saved_as")
    ),
]


@st.composite
def _hostile(draw, truth):
    """The bytes of a hostile eqshard.json, and the field it changes (if one)."""
    kind = draw(st.sampled_from(["bytes", "json", "field", "field", "field"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64)), None
    if kind == "json":
        return json.dumps(draw(_JSON)).encode(), None
    field = draw(st.sampled_from(_FIELDS))
    own = json.loads(json.dumps(truth))
    *parents, key = field.split("/")
    node = own
    for part in parents:
        node = node.setdefault(part, {}) if isinstance(node, dict) else node
    if draw(st.booleans()) and key in node:
        del node[key]
    else:
        node[key] = draw(_JSON)
    return json.dumps(own).encode(), field


@pytest.fixture(scope="module")
def honest_checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("hostile") / "c")
    eqshard.save(directory, _HONEST)
    with open(os.path.join(directory, "eqshard.json")) as f:
        return directory, json.load(f)


@settings(deadline=None)  # ~10 ms an example: the profile's count
@given(data=st.data())
def test_a_hostile_eqshard_json_is_refused_naming_the_field(data, honest_checkpoint):
    directory, truth = honest_checkpoint
    raw, field = data.draw(_hostile(truth))
    file = os.path.join(directory, "eqshard.json")
    with open(file, "wb") as f:
        f.write(raw)
    like = eqshard.abstract(_HONEST, P(), _ONE_DEVICE)
    try:
        out = eqshard.restore(directory, like)
    except ValueError as error:
        message = str(error)
        assert message.startswith("eqshard.restore: "), message
        if f"{file!r} is damaged" in message:
            event("eqshard.json refused")
            named = message.split("its field '")[1].split("'")[0] if field else None
            if field and named:  # the field changed, or one it must agree with
                assert named.split("/")[:2] == field.split("/")[:2] or (
                    named in ("orbax", "arrays") or field in ("orbax", "arrays")
                ), (field, message)
        else:  # it agrees with itself, and not with `like`: named by path
            event("differs from like")
            assert "does not match" in message, message
    else:
        event("restored")
        got = eqshard.gather(out)
        for name, want in _HONEST.items():
            _check_same(got[name], want, name)
