import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqshard


@pytest.mark.parametrize(
    "x, expected",
    [
        (jnp.zeros(3), True),
        (np.zeros(3), True),
        (np.float32(1.0), True),
        (jax.ShapeDtypeStruct((3,), jnp.float32), True),
        (1.0, False),
        (None, False),
        ("a", False),
    ],
)
def test_is_array(x, expected):
    assert eqshard.is_array(x) is expected


def test_abstract_without_specs_keeps_non_arrays():
    tree = {"w": jnp.zeros((8, 4), jnp.bfloat16), "n": 3, "f": jnp.tanh, "s": None}
    out = eqshard.abstract(tree)
    assert out["w"] == jax.ShapeDtypeStruct((8, 4), jnp.bfloat16)
    assert out["w"].sharding is None
    assert out["n"] == 3 and out["f"] is jnp.tanh and out["s"] is None


def test_abstract_with_specs(mesh):
    model = eqx.nn.Linear(8, 4, key=jax.random.key(0))
    skeleton = eqx.filter_eval_shape(eqx.nn.Linear, 8, 4, key=jax.random.key(0))
    specs = eqx.nn.Linear(8, 4, key=jax.random.key(0))
    specs = jax.tree.map(lambda _: None, specs)
    specs = eqx.tree_at(
        lambda m: (m.weight, m.bias),
        specs,
        (P("tp", "dp"), P()),
        is_leaf=lambda x: x is None,
    )
    for tree in (model, skeleton):
        out = eqshard.abstract(tree, specs, mesh)
        assert out.weight.shape == (4, 8)
        assert out.weight.sharding == NamedSharding(mesh, P("tp", "dp"))
        assert out.bias.sharding == NamedSharding(mesh, P())
        assert out.in_features == 8


def test_abstract_with_current_mesh_and_prefix(mesh):
    with jax.set_mesh(mesh):
        out = eqshard.abstract({"a": jnp.zeros((8,)), "b": np.zeros((4, 2))}, P("tp"))
    assert out["a"].sharding == NamedSharding(mesh, P("tp"))
    assert out["b"].sharding == NamedSharding(mesh, P("tp"))


def test_abstract_structs_lower_with_their_shardings(mesh):
    target = eqshard.abstract({"w": jnp.zeros((8, 4))}, {"w": P("dp", "tp")}, mesh)
    compiled = (
        jax.jit(lambda t: jax.tree.map(lambda x: x * 2, t)).lower(target).compile()
    )
    assert compiled.input_shardings[0][0]["w"] == NamedSharding(mesh, P("dp", "tp"))


def test_abstract_errors(mesh):
    with pytest.raises(
        ValueError, match=r"(?s)eqshard.abstract: .*'w' \(shape \(6, 4\)\)"
    ):
        eqshard.abstract({"w": jnp.zeros((6, 4))}, {"w": P("tp")}, mesh)
    with pytest.raises(ValueError, match=r"(?s)eqshard.abstract: .*'b'"):
        eqshard.abstract({"w": jnp.zeros((8,))}, {"b": P("tp")}, mesh)
    with pytest.raises(ValueError, match=r"eqshard.abstract: no mesh"):
        eqshard.abstract({"w": jnp.zeros((8,))}, P("tp"))
