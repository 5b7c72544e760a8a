"""A training step as a user writes it, for `python -m eqshard --target ...
--step target_step.py:train_step --args target_step.py:example_args`
(`tests/test_targets.py`)."""

import equinox as eqx
import jax
import jax.numpy as jnp


def loss(model, x):
    for layer in model:
        x = jnp.tanh(jax.vmap(layer)(x))
    return jnp.mean(x**2)


@eqx.filter_jit
def train_step(model, x):
    grads = eqx.filter_grad(loss)(model, x)
    return eqx.apply_updates(model, jax.tree.map(lambda g: -1e-3 * g, grads))


def example_args():
    keys = jax.random.split(jax.random.key(0), 2)
    return [eqx.nn.Linear(256, 256, key=k) for k in keys], jnp.ones((64, 256))
