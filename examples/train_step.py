"""An `eqx.filter_jit` training step on a sharded Equinox transformer.

This example shows the everyday use of eqshard with Equinox:

1. `eqshard.match_partition_rules` turns regex rules over parameter paths
   (`blocks/0/attn_q/weight`, ...) into a spec tree for the model.
2. `eqshard.shard(model, specs, mesh)` places the model on a (2, 4) ('dp', 'tp')
   mesh. It comes back as the same Equinox module type, with its static fields and
   its activation function (a callable leaf) untouched.
3. The optimizer is optax's AdamW. Its state (a step count and the moments `mu`
   and `nu`) has paths such as `0/mu/blocks/0/attn_q/weight`, which the rules
   anchored to parameter paths do not match: `eqshard.derive_specs` gives each
   moment the spec of the parameter it follows instead, and `eqshard.shard`
   places the state made on one device.
4. The training step is an ordinary `eqx.filter_jit` function that constrains
   the batch (data parallel over 'dp') and the model, gradients and optimizer
   state (tensor parallel over 'tp') with `eqshard.with_sharding_constraint`.

It checks that the sharded step gives the same loss, gradients and parameters as
the same step on one device, that every output (optimizer state included) is
sharded as the specs say, and exits with a non-zero status if anything differs.
Run it with `python examples/train_step.py`.
"""

import jax


jax.config.update("jax_num_cpu_devices", 8)  # 8 virtual CPU devices; before any JAX

import sys
from collections.abc import Callable

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax
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
OPTIMIZER = optax.adamw(1e-2, weight_decay=0.1)

Step = Callable[
    [Transformer, optax.OptState, jax.Array],
    tuple[jax.Array, Transformer, Transformer, optax.OptState],
]


def make_step(specs: object, state_specs: object, *, constrain: bool) -> Step:
    @eqx.filter_jit
    def step(model: Transformer, state: optax.OptState, tokens: jax.Array):
        if constrain:
            model = eqshard.with_sharding_constraint(model, specs)
            tokens = eqshard.with_sharding_constraint(tokens, BATCH_SPEC)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
        if constrain:
            grads = eqshard.with_sharding_constraint(grads, specs)
        params = eqx.filter(model, eqx.is_array)
        updates, state = OPTIMIZER.update(grads, state, params)
        model = eqx.apply_updates(model, updates)
        if constrain:
            model = eqshard.with_sharding_constraint(model, specs)
            state = eqshard.with_sharding_constraint(state, state_specs)
        return loss, grads, model, state

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
    params = eqx.filter(model, eqx.is_array)
    state = OPTIMIZER.init(params)
    # Each moment gets the spec of the parameter it follows; the count is replicated.
    state_specs = eqshard.derive_specs(state, params, specs)
    adam_specs = state_specs[0]  # adamw = chain(scale_by_adam, decay, lr)
    check(
        adam_specs.mu.unembed.weight == adam_specs.nu.unembed.weight == P("tp", None),
        "Adam's moments of the head follow its spec, P('tp', None)",
    )

    # Reference: the same step, unsharded, on one device.
    ref_loss, ref_grads, _, _ = make_step(specs, state_specs, constrain=False)(
        model, state, tokens
    )

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
        sharded_state = eqshard.shard(state, state_specs, mesh)
        check_sharded(sharded_state, state_specs, mesh, "optimizer state")

        batch = eqshard.shard(tokens, BATCH_SPEC, mesh)
        step = make_step(specs, state_specs, constrain=True)
        loss, grads, new_model, new_state = step(sharded, sharded_state, batch)

    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    check(True, f"loss matches the unsharded step ({float(loss):.6f})")
    host_grads = eqshard.gather(eqx.filter(grads, eqx.is_array))
    for got, want in zip(
        jax.tree.leaves(host_grads),
        jax.tree.leaves(eqx.filter(ref_grads, eqx.is_array)),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    check(True, "gradients match the unsharded step")
    # Adam divides by the root of the second moment, so gradients equal to 1e-6
    # can give updates that differ by a good part of the learning rate. The update
    # is checked against AdamW applied on one device to the step's own gradients.
    ref_updates, ref_state = jax.jit(OPTIMIZER.update)(host_grads, state, params)
    ref_model = eqx.filter_jit(eqx.apply_updates)(model, ref_updates)
    for got, want in zip(
        jax.tree.leaves(eqx.filter(new_model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(ref_model, eqx.is_array)),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    check(True, "updated parameters match AdamW applied on one device")
    for got, want in zip(
        jax.tree.leaves(eqshard.gather(new_state)), jax.tree.leaves(ref_state)
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    check(True, "the optimizer state matches AdamW applied on one device")
    check_sharded(grads, specs, mesh, "gradients")
    check_sharded(new_model, specs, mesh, "updated model")
    check_sharded(new_state, state_specs, mesh, "updated optimizer state")
    check(
        new_model.blocks[0].activation is jax.nn.gelu,
        "the step returns a model with the same activation",
    )
    print("train_step example: OK")


if __name__ == "__main__":
    main()
