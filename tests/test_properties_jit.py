# The property suite, extended to `filter_jit` (issue 33): random sequences of
# calls of one `filter_jit` function (shapes, dtypes, specs chosen from the shape,
# meshes of the 8 devices in random orders set with `jax.set_mesh`, host or placed
# arguments, donation on or off), each checked against `jax.jit` with the explicit
# `in_shardings`/`out_shardings` the specs ask for: the same values, the same
# output sharding, or, where the spec cannot apply, an error of eqshard's own.
# A donated array (deleted) given again is refused with eqshard's error (never a crash).
#
# Each call compiles, so the examples are few and small.

import jax
import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import eqshard


_SHAPES = [(8, 4), (4, 8), (2, 8), (3, 4)]
_SPECS = [P(), P("dp"), P(None, "tp"), P("dp", "tp"), P("tp")]
_DTYPES = [np.float32, np.int32]


def _step(x):
    return x * 2 + 1


@st.composite
def _calls(draw):
    """One `filter_jit` configuration and the calls made with it."""
    table = {shape: draw(st.sampled_from(_SPECS)) for shape in _SHAPES}
    out = draw(st.sampled_from([0, P(), P("dp")]))
    donate = draw(st.booleans())
    calls = draw(
        st.lists(
            st.tuples(
                st.sampled_from(_SHAPES),
                st.sampled_from(_DTYPES),
                st.permutations(range(8)),
                st.booleans(),  # placed with its spec before the call
            ),
            min_size=1,
            max_size=3,
        )
    )
    return table, out, donate, calls


def _fits(shape, spec, mesh):
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    return all(
        axis is None or size % sizes[axis] == 0
        for size, axis in zip(shape, (*spec, None, None), strict=False)
    )


@settings(max_examples=12)
@given(_calls())
def test_filter_jit_calls_match_jax_jit_with_explicit_shardings(case):
    table, out_spec, donate, calls = case
    step = eqshard.filter_jit(
        _step,
        in_specs=lambda args: (table[args[0].shape],),
        out_specs=out_spec,
        donate="all" if donate else "none",
    )
    for shape, dtype, order, placed in calls:
        devices = np.array(jax.devices())[list(order)].reshape(2, 4)
        mesh = Mesh(devices, ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
        spec = table[shape]
        value = np.arange(np.prod(shape), dtype=dtype).reshape(shape)
        fits = _fits(shape, spec, mesh) and (
            out_spec == 0 or _fits(shape, out_spec, mesh)
        )
        if not fits:
            event("spec cannot apply: eqshard's error")
            with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"^eqshard\."):
                step(value)
            continue
        in_sharding = NamedSharding(mesh, spec)
        out_sharding = in_sharding if out_spec == 0 else NamedSharding(mesh, out_spec)
        x = jax.device_put(value, in_sharding) if placed else value
        expected = jax.jit(_step, in_shardings=in_sharding, out_shardings=out_sharding)(
            value
        )
        with jax.set_mesh(mesh):
            got = step(x)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
        assert got.dtype == expected.dtype
        assert got.sharding == expected.sharding == out_sharding
        # (JAX keeps a donated buffer that no output can reuse.)
        if donate and placed and x.is_deleted():
            event("donated array given again: refused")
            with jax.set_mesh(mesh), pytest.raises(ValueError, match="deleted"):
                step(x)
