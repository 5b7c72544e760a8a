# The door's reads of traced programs (eqshard/_internals/jaxpr.py and
# equations.py, followed by eqshard/_search/_flow.py): what they find in JAX's
# own programs, and `Unrecognised` where a known primitive's parameters are not
# laid out as they expect (the programs below are JAX's, with one equation's
# parameters taken away, as a new JAX might lay them out).
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import ClosedJaxpr

from eqshard._internals import jaxpr as jaxprs
from eqshard._internals.routes import Unrecognised
from eqshard._search import _flow as flow


def _without(closed, name, *params):
    """`closed` with the first `name` equation's `params` taken away."""
    eqns = list(closed.jaxpr.eqns)
    n = next(i for i, e in enumerate(eqns) if e.primitive.name == name)
    kept = {k: v for k, v in eqns[n].params.items() if k not in params}
    eqns[n] = eqns[n].replace(params=kept)
    return ClosedJaxpr(closed.jaxpr.replace(eqns=eqns), closed.consts)


def _stacked_step(layers, embed, tokens):
    x = embed[tokens]

    def body(x, w):
        return jnp.tanh(x @ w.T), None

    return jax.lax.scan(body, x, layers)[0].sum()


def _step_program():
    args = (jnp.ones((3, 8, 8)), jnp.ones((16, 8)), jnp.zeros(4, jnp.int32))
    return jax.make_jaxpr(jax.grad(_stacked_step, argnums=(0, 1)))(*args)


def test_parameter_uses_of_a_stacked_step():
    uses = flow.parameter_uses(_step_program(), 2)
    # `x @ w.T` contracts the layer's dimension 1 (dimension 2 of the stack, whose
    # leading dimension the scan iterates over) and keeps its dimension 1 (whose
    # product nothing reduces before the last matrix's use); the embedding is
    # indexed on 0.
    assert uses == [
        flow.Use("dot", (2,), 1, out=(1,), local=True),
        flow.Use("gather", (0,), 0),
    ]


@pytest.mark.parametrize(
    "name, params",
    [
        ("scan", ("num_consts",)),
        ("scan", ("jaxpr",)),
        ("gather", ("dimension_numbers",)),
    ],
)
def test_parameter_uses_refuse_what_they_do_not_recognise(name, params):
    with pytest.raises(Unrecognised, match=f"'{name}'.*'{params[0]}'"):
        flow.parameter_uses(_without(_step_program(), name, *params), 2)


def test_a_dot_without_its_dimension_numbers_is_unrecognised():
    closed = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((2, 3)), jnp.ones((3, 4)))
    with pytest.raises(Unrecognised, match="dimension_numbers"):
        flow.parameter_uses(_without(closed, "dot_general", "dimension_numbers"), 2)


def test_a_convolution_uses_its_kernel_on_its_features():
    # OIHW: the kernel's input features (1) are contracted, its outputs (0) kept.
    def conv(w, x):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")

    closed = jax.make_jaxpr(conv)(jnp.ones((4, 3, 3, 3)), jnp.ones((1, 3, 8, 8)))
    assert flow.parameter_uses(closed, 1) == [
        flow.Use("conv", (1,), 0, out=(0,), local=True)
    ]
    with pytest.raises(Unrecognised, match="dimension_numbers"):
        flow.parameter_uses(
            _without(closed, "conv_general_dilated", "dimension_numbers"), 1
        )


def test_search_reads_an_unrecognised_step_as_other_uses_once():
    from eqshard._search._uses import parameter_uses

    broken = _without(_step_program(), "scan", "num_carry")
    with pytest.warns(RuntimeWarning, match="search_layout.*num_carry") as record:
        uses = parameter_uses(broken, 2)
        assert parameter_uses(broken, 2) == uses
    assert len(record) == 1
    assert uses == [flow.Use("other", (), 0)] * 2


def _traced():
    inner = jax.jit(lambda x, y: (x * 2, y), donate_argnums=1)
    return jax.jit(lambda x, y: inner(x, y)).trace(jnp.ones(8), jnp.ones(8))


def test_boundary_of_a_jit():
    found = jaxprs.boundary_of(_traced(), 2, 2)
    assert found is not None and found.donated == [False, True]
    traced = jax.jit(lambda x: x * 2).trace(jnp.ones(8))
    assert jaxprs.boundary_of(traced, 1, 1) is None  # no `jit` inside


def test_an_unrecognised_boundary_is_read_without_it():
    from eqshard._step._step import _boundary

    traced = _traced()
    broken = types.SimpleNamespace(
        jaxpr=_without(traced.jaxpr, "jit", "donated_invars")
    )
    with pytest.raises(Unrecognised, match="donated_invars"):
        jaxprs.boundary_of(broken, 2, 2)
    with pytest.warns(RuntimeWarning, match="analyze_step.*donated_invars"):
        assert _boundary(broken, 2, 2) is None
    assert _boundary(traced, 2, 2) is not None


def test_a_slice_of_keys_without_its_indices_is_unrecognised():
    closed = jax.make_jaxpr(lambda k: jax.random.split(k, 4)[2])(jax.random.key(0))
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "slice"]
    keys = jax.random.split(jax.random.key(0), 4)
    # Read as the same dynamic slice: the same key.
    (got,) = jaxprs.key_step(eqn)([keys])
    assert jnp.array_equal(jax.random.key_data(got), jax.random.key_data(keys[2:3]))
    broken = _without(closed, "slice", "start_indices")
    with pytest.raises(Unrecognised, match="start_indices"):
        jaxprs.cut(broken, is_fed=lambda c: False)


def test_nested_consts_reach_into_nested_programs():
    data = jnp.arange(3.0)

    @eqx.filter_jit
    def inner(x):
        return x + data

    closed = jax.make_jaxpr(lambda x: inner(x) * 2)(jnp.ones(3))
    assert any(c is data for c in jaxprs.nested_consts(closed))
