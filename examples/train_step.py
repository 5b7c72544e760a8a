"""An `eqx.filter_jit` training step on a sharded Equinox transformer.

This example shows the everyday use of eqshard with Equinox:

1. `eqshard.match_partition_rules` turns regex rules over parameter paths
   (`blocks/0/attn_q/weight`, ...) into a spec tree for the model.
2. `eqshard.shard(model, specs, mesh)` places the model on a (2, 4) ('dp', 'tp')
   mesh. It comes back as the same Equinox module type, with its static fields and
   its activation function (a callable leaf) untouched.
3. The training step is an ordinary `eqx.filter_jit` function that constrains
   the batch (data parallel over 'dp') and the model and gradients (tensor
   parallel over 'tp') with `eqshard.with_sharding_constraint`.

It checks that the sharded step gives the same loss and gradients as the same
step on one device, that the outputs are sharded as the specs say, and exits with
a non-zero status if anything differs. Run it with `python examples/train_step.py`.
"""

import jax


jax.config.update("jax_num_cpu_devices", 8)  # 8 virtual CPU devices; before any JAX

import sys
from collections.abc import Callable

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P

import eqshard


VOCAB, D_MODEL, D_MLP, HEADS, LAYERS = 64, 32, 64, 4, 2
BATCH, SEQ = 8, 16


class Block(eqx.Module):
    """A pre-norm transformer block with causal multi-head attention."""

    ln_attn: eqx.nn.LayerNorm
    attn_q: eqx.nn.Linear
    attn_k: eqx.nn.Linear
    attn_v: eqx.nn.Linear
    attn_o: eqx.nn.Linear
    ln_mlp: eqx.nn.LayerNorm
    mlp_up: eqx.nn.Linear
    mlp_down: eqx.nn.Linear
    activation: Callable[[jax.Array], jax.Array]  # a callable leaf, not an array
    num_heads: int = eqx.field(static=True)

    def __init__(self, key: jax.Array):
        keys = jax.random.split(key, 6)
        self.ln_attn = eqx.nn.LayerNorm(D_MODEL)
        self.attn_q, self.attn_k, self.attn_v, self.attn_o = (
            eqx.nn.Linear(D_MODEL, D_MODEL, key=k) for k in keys[:4]
        )
        self.ln_mlp = eqx.nn.LayerNorm(D_MODEL)
        self.mlp_up = eqx.nn.Linear(D_MODEL, D_MLP, key=keys[4])
        self.mlp_down = eqx.nn.Linear(D_MLP, D_MODEL, key=keys[5])
        self.activation = jax.nn.gelu
        self.num_heads = HEADS

    def __call__(self, x: jax.Array) -> jax.Array:  # x: (seq, d_model)
        seq = x.shape[0]
        h = jax.vmap(self.ln_attn)(x)

        def heads(linear: eqx.nn.Linear) -> jax.Array:
            return jax.vmap(linear)(h).reshape(seq, self.num_heads, -1)

        q, k, v = heads(self.attn_q), heads(self.attn_k), heads(self.attn_v)
        scores = jnp.einsum("qhd,khd->hqk", q, k) / jnp.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        attended = jnp.einsum("hqk,khd->qhd", weights, v).reshape(seq, -1)
        x = x + jax.vmap(self.attn_o)(attended)
        h = jax.vmap(self.ln_mlp)(x)
        return x + jax.vmap(self.mlp_down)(self.activation(jax.vmap(self.mlp_up)(h)))


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list[Block]
    ln_final: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear
    name: str = eqx.field(static=True)

    def __init__(self, key: jax.Array):
        keys = jax.random.split(key, LAYERS + 2)
        self.embed = eqx.nn.Embedding(VOCAB, D_MODEL, key=keys[0])
        self.blocks = [Block(k) for k in keys[1:-1]]
        self.ln_final = eqx.nn.LayerNorm(D_MODEL)
        self.unembed = eqx.nn.Linear(D_MODEL, VOCAB, use_bias=False, key=keys[-1])
        self.name = "tiny-transformer"

    def __call__(self, tokens: jax.Array) -> jax.Array:  # tokens: (seq,) -> logits
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.unembed)(jax.vmap(self.ln_final)(x))


def loss_fn(model: Transformer, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy over a batch of sequences."""
    logits = jax.vmap(model)(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    targets = tokens[:, 1:, None]
    return -jnp.mean(jnp.take_along_axis(logp, targets, axis=-1))


# Megatron-style rules: Linear weights are (out, in); q/k/v/up split their outputs
# over 'tp', o/down their inputs. The first rule whose regex matches wins.
RULES = [
    (r"^embed/weight$", P("tp", None)),  # vocab over 'tp'
    (r"^unembed/weight$", P("tp", None)),
    (r"(attn_[qkv]|mlp_up)/weight$", P("tp", None)),
    (r"(attn_[qkv]|mlp_up)/bias$", P("tp")),
    (r"(attn_o|mlp_down)/weight$", P(None, "tp")),
    (r".*", P()),  # layer norms and the remaining biases are replicated
]
BATCH_SPEC = P("dp")  # sequences split over 'dp'


def make_step(
    specs: object, *, constrain: bool
) -> Callable[[Transformer, jax.Array], tuple[jax.Array, Transformer, Transformer]]:
    @eqx.filter_jit
    def step(model: Transformer, tokens: jax.Array):
        if constrain:
            model = eqshard.with_sharding_constraint(model, specs)
            tokens = eqshard.with_sharding_constraint(tokens, BATCH_SPEC)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
        if constrain:
            grads = eqshard.with_sharding_constraint(grads, specs)
        updates = jax.tree.map(lambda g: -0.1 * g, grads)
        model = eqx.apply_updates(model, updates)
        if constrain:
            model = eqshard.with_sharding_constraint(model, specs)
        return loss, grads, model

    return step


def check(ok: bool, what: str) -> None:
    if not ok:
        sys.exit(f"train_step example FAILED: {what}")
    print(f"  ok: {what}")


def check_sharded(
    tree: object, specs: object, mesh: jax.sharding.Mesh, what: str
) -> None:
    # One error listing every array laid out otherwise than `specs` asks (another
    # spec, another mesh, a single device, host memory), or nothing.
    try:
        eqshard.check_layout(tree, specs, mesh)
    except ValueError as error:
        check(False, f"{what}: {error}")
    count = len(jax.tree.leaves(eqx.filter(tree, eqx.is_array)))
    check(True, f"{what}: all {count} arrays sharded as specified")


def main() -> None:
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    model = Transformer(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, VOCAB)
    specs = eqshard.match_partition_rules(RULES, model)

    # Reference: the same step, unsharded, on one device.
    ref_loss, ref_grads, ref_model = make_step(specs, constrain=False)(model, tokens)

    with jax.set_mesh(mesh):
        sharded = eqshard.shard(model, specs, mesh)
        check(type(sharded) is Transformer, "shard keeps the module type")
        check(
            jax.tree.structure(sharded) == jax.tree.structure(model),
            "shard keeps the tree structure (static fields included)",
        )
        check(
            sharded.name == model.name
            and all(b.num_heads == HEADS for b in sharded.blocks),
            "static fields are unchanged",
        )
        check(
            all(
                s.activation is m.activation
                for s, m in zip(sharded.blocks, model.blocks)
            ),
            "the activation callable is the very same object",
        )
        check_sharded(sharded, specs, mesh, "sharded model")

        batch = eqshard.shard(tokens, BATCH_SPEC, mesh)
        loss, grads, new_model = make_step(specs, constrain=True)(sharded, batch)

    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    check(True, f"loss matches the unsharded step ({float(loss):.6f})")
    for got, want in zip(
        jax.tree.leaves(eqshard.gather(eqx.filter(grads, eqx.is_array))),
        jax.tree.leaves(eqx.filter(ref_grads, eqx.is_array)),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    check(True, "gradients match the unsharded step")
    for got, want in zip(
        jax.tree.leaves(eqx.filter(new_model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(ref_model, eqx.is_array)),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    check(True, "updated parameters match the unsharded step")
    check_sharded(grads, specs, mesh, "gradients")
    check_sharded(new_model, specs, mesh, "updated model")
    check(
        new_model.blocks[0].activation is jax.nn.gelu,
        "the step returns a model with the same activation",
    )
    print("train_step example: OK")


if __name__ == "__main__":
    main()
