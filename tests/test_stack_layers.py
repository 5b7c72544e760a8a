"""`eqshard.stack_layers` / `unstack_layers`: a list of layers as a model wrote
them, stacked for `jax.lax.scan` and `eqshard.pipeline`, and back bit for bit;
per-layer static fields carried; what cannot be stacked named."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P
from models import Decoder, VOCAB


def same(got, want):
    """Bit for bit: one structure (static fields included), equal arrays."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if eqx.is_array(w):
            assert (g.dtype, g.shape) == (w.dtype, w.shape)
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        else:
            assert g == w


@pytest.mark.slow
def test_pipeline_a_list_of_layers():
    """The Llama-style decoder of `models.py`, its layers a list: stacked, then
    pipelined (pp4 x dp2), its output is the model's own; unstacked, the layers
    are the model's, bit for bit."""
    import eqshard

    model = Decoder(jax.random.key(0), depth=4)
    tokens = jax.random.randint(jax.random.key(1), (8, 6), 0, VOCAB)
    want = eqx.filter_jit(lambda m, t: jax.vmap(m)(t))(model, tokens)

    stack = eqshard.stack_layers(model.layers)
    assert stack.attention.W_Q.shape == (4, *model.layers[0].attention.W_Q.shape)
    stacked = eqx.tree_at(lambda m: m.layers, model, stack)

    def forward(m, tokens):
        h = jax.vmap(jax.vmap(m.embed))(tokens)
        h = eqshard.pipeline(lambda b, h: jax.vmap(b)(h), m.layers, h,
                             microbatches=4)  # fmt: skip
        return jax.vmap(jax.vmap(lambda t: m.head(m.norm(t))))(h)

    mesh = jax.make_mesh((4, 2), ("pp", "dp"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        placed = eqshard.shard(stacked, [("layers/.*", P("pp")), (".*", P())], mesh)
        got = jax.jit(forward)(placed, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    same(eqshard.unstack_layers(placed.layers), model.layers)


class Hooked(eqx.Module):
    linear: eqx.nn.Linear
    scale: float
    name: str = eqx.field(static=True)
    index: int = eqx.field(static=True)
    act: str = eqx.field(static=True, default="tanh")


def hooked(i, key, out=8):
    return Hooked(eqx.nn.Linear(8, out, key=key), 0.5 + i, f"layers.{i}", i)


def test_static_fields_carried_and_round_trip():
    """Per-layer static fields (a hook name, an index) are carried as a
    `PerLayer` tuple, equal ones kept; differing Python numbers become data; the
    stack scans and pipelines; unstacked, each layer has its own values back."""
    import eqshard

    keys = jax.random.split(jax.random.key(0), 4)
    layers = [hooked(i, k) for i, k in enumerate(keys)]
    stack = eqshard.stack_layers(layers)
    assert stack.linear.weight.shape == (4, 8, 8) and stack.act == "tanh"
    assert stack.name.values == ("layers.0", "layers.1", "layers.2", "layers.3")
    assert stack.index.values == (0, 1, 2, 3)
    np.testing.assert_array_equal(stack.scale, [0.5, 1.5, 2.5, 3.5])
    back = eqshard.unstack_layers(stack)
    for got, want in zip(back, layers, strict=True):
        assert (got.name, got.index, float(got.scale)) == (
            want.name, want.index, want.scale,
        )  # fmt: skip
        same(got.linear, want.linear)

    def layer(block, h):
        return jnp.tanh(jax.vmap(block.linear)(h)) * block.scale

    x = jnp.ones((8, 8))
    dyn, static = eqx.partition(stack, eqx.is_array)
    want = jax.lax.scan(lambda h, d: (layer(eqx.combine(d, static), h), None), x, dyn)
    mesh = jax.make_mesh((4, 2), ("pp", "dp"), axis_types=(AxisType.Auto,) * 2)
    got = jax.eval_shape(
        lambda: eqshard.pipeline(layer, stack, x, microbatches=4, mesh=mesh)
    )
    assert got == jax.ShapeDtypeStruct(want[0].shape, want[0].dtype)


def test_what_cannot_be_stacked():
    """Arrays of other shapes, layers of other types or structures, values that
    differ and are neither static nor numbers: eqshard's error naming the path
    and the layers."""
    import eqshard

    keys = jax.random.split(jax.random.key(0), 3)
    with pytest.raises(
        ValueError, match=r"at 'linear/weight' the layers' arrays differ: layer 0 "
        r"has 'float32\[8, 8\]', layer 2 has 'float32\[4, 8\]'"
    ):  # fmt: skip
        eqshard.stack_layers([hooked(0, keys[0]), hooked(1, keys[1]),
                              hooked(2, keys[2], out=4)])  # fmt: skip
    with pytest.raises(ValueError, match="at '<root>' the layers are of differ"):
        eqshard.stack_layers([hooked(0, keys[0]), eqx.nn.Linear(8, 8, key=keys[1])])
    with pytest.raises(ValueError, match="at '<root>' the layers' structures"):
        eqshard.stack_layers([{"a": jnp.zeros(2)}, {"b": jnp.zeros(2)}])
    with pytest.raises(ValueError, match="at 'f' the layers differ: layer 0 has"):
        eqshard.stack_layers([{"f": "gelu"}, {"f": "relu"}])
    with pytest.raises(ValueError, match="give a non-empty list"):
        eqshard.stack_layers([])
    with pytest.raises(ValueError, match="leading axes \\[2, 3\\]"):
        eqshard.unstack_layers({"a": jnp.zeros((2, 4)), "b": jnp.zeros((3, 4))})
