"""`eqshard.ContextParallelAttention` swapped into an Equinox model built on
`eqx.nn.MultiheadAttention`: the same training step with the sequence split
over a context axis as without."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P
from models import Block


DIM, SEQ, BATCH = 16, 32, 2


class _Model(eqx.Module):
    blocks: tuple[Block, Block]
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.blocks = (Block(DIM, k1, heads=4), Block(DIM, k2, heads=4))
        self.head = eqx.nn.Linear(DIM, 1, key=k3)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(x)[:, 0]


@eqx.filter_jit
def _step(model, x, y):
    def loss(model):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    value, grads = eqx.filter_value_and_grad(loss)(model)
    return value, eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))


def test_training_step_equals_whole_attention():
    import eqshard

    model = _Model(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, DIM))
    y = jax.random.normal(jax.random.key(2), (BATCH, SEQ))
    want_loss, want = _step(model, x, y)

    # The user's code: three lines.
    cp = eqx.tree_at(
        lambda m: [b.attn for b in m.blocks],
        model,
        replace_fn=lambda a: eqshard.ContextParallelAttention(
            a, axis="cp", strategy="ring"
        ),
    )
    mesh = jax.make_mesh((2, 4), ("dp", "cp"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        xs, ys = jax.device_put((x, y), (P("dp", "cp"), P("dp", "cp")))
        got_loss, got = _step(cp, xs, ys)
    assert isinstance(got.blocks[0].attn, eqshard.ContextParallelAttention)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    got_leaves = jax.tree.leaves(eqx.filter(got, eqx.is_array))
    want_leaves = jax.tree.leaves(eqx.filter(want, eqx.is_array))
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_dropout_of_weights_refused():
    import eqshard

    attn = eqx.nn.MultiheadAttention(4, DIM, dropout_p=0.1, key=jax.random.key(0))
    cp = eqshard.ContextParallelAttention(attn, axis="cp")
    x = jnp.ones((SEQ, DIM))
    with pytest.raises(ValueError, match="dropout has p=0.1.*inference=True"):
        cp(x, x, x)
