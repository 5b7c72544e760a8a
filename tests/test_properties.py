# The property suite: over random pytrees, specs, meshes and dtypes, `shard ->
# gather` gives back every array bit for bit, placed as asked, or raises an eqshard
# `ValueError`/`TypeError` whose message starts with `eqshard.` and names a path.
# Nothing else may escape: no JAX, NumPy or type-checker error, no crash, no silent
# change of a value.
#
# A second property: a partitioned function given static values that compare
# equal but differ in type compiles one program per type.
#
# Runs in CI with the derandomised "ci" profile of conftest.py; for a longer search
# run `HYPOTHESIS_PROFILE=long python -m pytest -q tests/test_properties.py` (see
# CONTRIBUTING.md).

import math
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from hypothesis import event, given, strategies as st
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqshard


# ---------------------------------------------------------------------------------
# Meshes: Auto, Explicit and mixed axes, and axes of size 1.


def _mesh(shape, names, *types):
    types = types if len(types) == len(shape) else types * len(shape)
    return jax.make_mesh(shape, names, axis_types=types)


MESHES = [
    _mesh((2, 4), ("dp", "tp"), AxisType.Auto),
    _mesh((2, 4), ("dp", "tp"), AxisType.Explicit),
    _mesh((8,), ("dp",), AxisType.Auto),
    _mesh((1, 2, 4), ("pp", "dp", "tp"), AxisType.Auto),
    _mesh((4, 1, 2), ("dp", "pp", "tp"), AxisType.Explicit),
    _mesh((2, 4), ("dp", "tp"), AxisType.Auto, AxisType.Explicit),
]
AXES = ("dp", "tp", "pp")


# ---------------------------------------------------------------------------------
# Arrays: every JAX dtype (sub-byte and 8-bit floats, bool, 64-bit, complex), as
# NumPy or JAX arrays, of any rank including 0-d and size 0; and typed PRNG keys.

DTYPES = [
    np.dtype(d)
    for d in (
        jnp.bool_,
        jnp.int8,
        jnp.int16,
        jnp.int32,
        jnp.int64,
        jnp.uint8,
        jnp.uint16,
        jnp.uint32,
        jnp.uint64,
        jnp.float16,
        jnp.float32,
        jnp.float64,
        jnp.bfloat16,
        jnp.complex64,
        jnp.complex128,
        jnp.float8_e4m3fn,
        jnp.float8_e5m2,
        jnp.float8_e4m3b11fnuz,
        jnp.float8_e4m3fnuz,
        jnp.float8_e5m2fnuz,
        jnp.float8_e3m4,
        jnp.float8_e4m3,
        jnp.float8_e8m0fnu,
        jnp.float4_e2m1fn,
        jnp.int4,
        jnp.uint4,
        jnp.int2,
        jnp.uint2,
    )
]


# NumPy data no device holds as it is: big-endian (converted), and dtypes JAX has
# no counterpart for (refused).
ODD_DTYPES = [
    np.dtype(d)
    for d in (">f4", ">i2", "<U3", "S2", "M8[s]", "m8[s]", np.longdouble, "O")
]


def _odd_array(dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    values = np.arange(math.prod(shape)).reshape(shape)
    if dtype.kind in "Mm":
        return values.astype(np.int64).astype(dtype)
    return values.astype(dtype)


def _bits(dtype: np.dtype) -> int:
    if dtype == np.bool_:
        return 1
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return 8 * dtype.itemsize
    return jnp.finfo(dtype).bits


def _host_array(dtype: np.dtype, shape: tuple[int, ...], raw: bytes) -> np.ndarray:
    """An array of any bit patterns (NaNs, infinities, extremes) of `dtype`."""
    size = math.prod(shape)
    data = np.frombuffer(raw, np.uint8, count=size * dtype.itemsize)
    bits = _bits(dtype)
    if dtype == np.bool_:
        return (data & 1).astype(np.bool_).reshape(shape)
    if bits < 8:  # canonical values of sub-byte types
        small = (data & ((1 << bits) - 1)).astype(np.int32)
        if jnp.issubdtype(dtype, jnp.signedinteger):
            small = small - (1 << (bits - 1))
            return small.astype(dtype).reshape(shape)
        if jnp.issubdtype(dtype, jnp.integer):
            return small.astype(dtype).reshape(shape)
        return small.astype(np.uint8).view(dtype).astype(np.float32).astype(dtype)
    return data.view(dtype).reshape(shape).copy()


class ArrayLeaf(NamedTuple):
    """How an array leaf was made, kept beside the tree to work out what `gather`
    must give back."""

    value: Any


@st.composite
def arrays(draw) -> Any:
    shape = tuple(draw(st.lists(st.integers(0, 8), max_size=3)))
    size = math.prod(shape)
    if draw(st.integers(0, 9)) == 0:  # a typed PRNG key array
        keys = jax.random.split(jax.random.key(draw(st.integers(0, 99))), size)
        return keys.reshape(shape)
    if draw(st.integers(0, 14)) == 0:
        return _odd_array(draw(st.sampled_from(ODD_DTYPES)), shape)
    dtype = draw(st.sampled_from(DTYPES))
    raw = draw(
        st.binary(min_size=size * dtype.itemsize, max_size=size * dtype.itemsize)
    )
    host = _host_array(dtype, shape, raw)
    if draw(st.booleans()) or dtype != jax.dtypes.canonicalize_dtype(dtype):
        return host  # 64-bit data with x64 off is only ever NumPy data
    device = jax.device_put(host)
    kind = draw(st.integers(0, 19))
    if kind == 0:  # no data: refused
        return jax.ShapeDtypeStruct(device.shape, device.dtype)
    return device


class Pair(NamedTuple):
    a: Any
    b: Any


class Module(eqx.Module):
    a: Any
    b: Any
    tag: str = eqx.field(static=True)


_OTHER_LEAVES = st.sampled_from([None, 3, 0.5, "name", jnp.tanh, True])


def trees() -> st.SearchStrategy:
    leaves = st.one_of(arrays(), arrays(), _OTHER_LEAVES)
    keys = st.sampled_from(["a", "b", "w", "0"])
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.dictionaries(keys, children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.lists(children, max_size=3),
            st.builds(Pair, children, children),
            st.builds(Module, children, children, st.sampled_from(["s", "t"])),
        ),
        max_leaves=6,
    )


# ---------------------------------------------------------------------------------
# Specs: valid and invalid entries, specs longer than the rank, leaves that are not
# specs, and prefixes of the tree.

_ENTRY = st.one_of(
    st.none(),
    st.sampled_from(AXES),
    st.tuples(st.sampled_from(AXES), st.sampled_from(AXES)),
    st.sampled_from(["nope", 1, P.UNCONSTRAINED]),
)


@st.composite
def spec_leaves(draw, mesh) -> Any:
    kind = draw(st.integers(0, 19))
    if kind == 0:
        return None
    if kind == 1:
        return draw(st.sampled_from(["dp", 1, ("dp",)]))  # not a spec
    if kind == 2:
        return NamedSharding(mesh, P())
    if kind == 3:  # a spec on another mesh
        return NamedSharding(draw(st.sampled_from(MESHES)), P())
    entries = draw(st.lists(_ENTRY, max_size=3))
    if kind < 12:  # mostly mesh axes of this mesh, each once
        entries = [e for e in entries if e in mesh.axis_names or e is None]
        seen = set()
        entries = [
            e if e is None or e not in seen and not seen.add(e) else None
            for e in entries
        ]
    return P(*entries)


@st.composite
def spec_trees(draw, tree, mesh) -> Any:
    def go(node: Any) -> Any:
        if draw(st.integers(0, 6)) == 0:  # a prefix: one spec for the subtree
            return draw(spec_leaves(mesh))
        if isinstance(node, dict):
            return {k: go(v) for k, v in node.items()}
        if isinstance(node, Pair):
            return Pair(go(node.a), go(node.b))
        if isinstance(node, tuple):
            return tuple(go(v) for v in node)
        if isinstance(node, list):
            return [go(v) for v in node]
        if isinstance(node, Module):
            return Module(go(node.a), go(node.b), node.tag)
        if node is None:
            return None
        return draw(spec_leaves(mesh))

    return go(tree)


# ---------------------------------------------------------------------------------
# The property.


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, P | NamedSharding)


def _paths(tree: Any) -> set[str]:
    """Every path of `tree` (leaves and the nodes above them), as eqshard names
    them, and `<root>`."""
    out = {"<root>"}

    def ends(x: Any) -> bool:  # None and empty containers have paths too
        return x is None or (isinstance(x, dict | list | tuple) and not x)

    for path, _ in jtu.tree_flatten_with_path(tree, is_leaf=ends)[0]:
        for k in range(1, len(path) + 1):
            name = eqshard.tree_path_to_string(path[:k], sep="/")
            assert isinstance(name, str)  # a separator gives a string
            out.add(name)
    return out


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _expected(x: Any, placed: bool) -> np.ndarray:
    """What gathering `x` gives, placed on a mesh or left where it was, by raw JAX
    (64-bit NumPy data is narrowed, with x64 off, if placed)."""
    if _is_key(x):
        return np.asarray(jax.random.key_data(x))
    if isinstance(x, np.ndarray) and not placed:
        return x
    if isinstance(x, np.ndarray) and not x.dtype.isnative:  # converted losslessly
        x = x.astype(x.dtype.newbyteorder("="))
    return np.asarray(jax.device_get(jax.device_put(x)))


def _check_same(got: Any, want: np.ndarray, where: str) -> None:
    if isinstance(got, eqshard.HostKey):
        got = got.data
    assert isinstance(got, np.ndarray), (where, type(got))
    assert got.dtype == want.dtype and got.shape == want.shape, (where, got, want)
    assert got.tobytes() == want.tobytes(), (where, got, want)


@given(data=st.data(), tree=trees(), mesh=st.sampled_from(MESHES))
def test_shard_then_gather_is_exact_or_an_eqshard_error(data, tree, mesh):
    specs = data.draw(spec_trees(tree, mesh))
    abstract = data.draw(st.integers(0, 19)) == 0  # no devices: refused
    try:
        placed = eqshard.shard(tree, specs, mesh.abstract_mesh if abstract else mesh)
    except (ValueError, TypeError) as error:
        message = str(error)
        event(f"refused: {message[:60]}")
        assert message.startswith("eqshard."), message
        named = any(f"'{p}'" in message for p in _paths(tree))
        # With no devices, the error may be about the mesh rather than a leaf.
        assert named or (abstract and "AbstractMesh" in message), message
        return
    # Placed as asked: each array leaf with its spec's sharding, or left as it was.
    event("placed")
    spec_leaves_, spec_def = jtu.tree_flatten(specs, is_leaf=_is_spec)
    flat_specs = [
        spec
        for spec, sub in zip(spec_leaves_, spec_def.flatten_up_to(tree), strict=True)
        for _ in jtu.tree_leaves(sub)
    ]
    originals = jtu.tree_leaves(tree)
    gathered = eqshard.gather(placed)
    gathered_leaves = jtu.tree_leaves(
        gathered, is_leaf=lambda x: isinstance(x, eqshard.HostKey)
    )
    for x, spec, out, back in zip(
        originals, flat_specs, jtu.tree_leaves(placed), gathered_leaves, strict=True
    ):
        assert not isinstance(x, jax.ShapeDtypeStruct) and not (
            isinstance(x, jax.Array) and x.is_deleted()
        ), "placed without data"
        if not isinstance(x, jax.Array | np.ndarray):
            assert out is x and back is x
            continue
        where = f"{x.dtype}{x.shape} spec {spec}"
        if spec is None:
            assert out is x, where
        else:
            # A NamedSharding brings its own mesh; a PartitionSpec needs `mesh`.
            assert isinstance(spec, NamedSharding) or not abstract, where
            sharding = (
                spec if isinstance(spec, NamedSharding) else NamedSharding(mesh, spec)
            )
            assert isinstance(out, jax.Array), where
            assert out.sharding.is_equivalent_to(sharding, out.ndim), where
        _check_same(back, _expected(x, spec is not None), where)


# ---------------------------------------------------------------------------------
# Partitioned functions: static values that compare equal but differ in type
# (True == 1 == 1.0) each get their own program, as jax.jit's static arguments do.

_STATICS = st.sampled_from([True, False, 0, 1, 2, 0.0, 1.0, (1,), (True,), (1.0,)])


def _fill(x, s):
    return jnp.full(x.shape, jtu.tree_leaves(s)[0])


@given(values=st.lists(_STATICS, min_size=2, max_size=3), as_leaf=st.booleans())
def test_partitioned_static_values_keep_their_types(values, as_leaf):
    partitioner = eqshard.t5x.Partitioner(mesh=MESHES[0])
    if as_leaf:  # a non-array leaf of a pytree argument
        f = partitioner.partition(lambda t: _fill(*t), P(), P())
    else:
        f = partitioner.partition(_fill, P(), P(), static_argnums=1)
    x = jnp.ones(8)
    for value in values:
        got = f((x, value)) if as_leaf else f(x, value)
        want = jnp.asarray(jtu.tree_leaves(value)[0]).dtype
        assert got.dtype == want, (value, got.dtype)
        np.testing.assert_array_equal(got, np.full(8, jtu.tree_leaves(value)[0]))


# ---------------------------------------------------------------------------------
# with_sharding_constraint moves no value: outside `jit` every array comes back
# equal (corrected specs allowed, as `on_invalid="ignore"` asks), or eqshard's own
# error names a path.


@given(data=st.data(), tree=trees(), mesh=st.sampled_from(MESHES))
def test_constraint_keeps_values_or_is_an_eqshard_error(data, tree, mesh):
    # Open problem, left out here: NumPy leaves. `with_sharding_constraint` hands
    # them to JAX as they are, so float64 data with x64 off is narrowed silently
    # (1e300 -> inf) and a big-endian array raises JAX's TypeError without a path;
    # `shard` refuses or converts both (`_host.py`), the constraint does not yet.
    tree = jtu.tree_map(lambda x: None if isinstance(x, np.ndarray) else x, tree)
    specs = data.draw(spec_trees(tree, mesh))
    try:
        out = eqshard.with_sharding_constraint(
            tree, specs, mesh=mesh, on_invalid="ignore"
        )
    except (ValueError, TypeError) as error:
        message = str(error)
        event(f"refused: {message[:60]}")
        assert message.startswith("eqshard."), message
        assert any(f"'{p}'" in message for p in _paths(tree)), message
        return
    event("constrained")
    for x, y in zip(jtu.tree_leaves(tree), jtu.tree_leaves(out), strict=True):
        if isinstance(x, jax.Array) and not _is_key(x):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
