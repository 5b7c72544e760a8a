"""A Llama-2-shaped decoder, to plan with `python -m eqshard --model`.

The functions `llama_7b`, `llama_70b` and `tiny` take no arguments and return the
model; the command calls them under `eqx.filter_eval_shape`, so even the 70B one
is never allocated:

    python -m eqshard --model examples/llama.py:llama_7b --mesh fsdp:8 \\
        --device-memory 80GiB

Only the parameters matter to a memory plan, so the modules hold them and leave
the forward pass out. Run as a script, it plans `llama_7b` with AdamW on 8
(abstract) devices and checks the numbers by hand.
"""

import equinox as eqx
import jax
import jax.numpy as jnp


class RMSNorm(eqx.Module):
    weight: jax.Array

    def __init__(self, dim: int):
        self.weight = jnp.ones(dim)


class Attention(eqx.Module):
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear

    def __init__(self, dim: int, kv_dim: int, key: jax.Array):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.q = eqx.nn.Linear(dim, dim, use_bias=False, key=kq)
        self.k = eqx.nn.Linear(dim, kv_dim, use_bias=False, key=kk)
        self.v = eqx.nn.Linear(dim, kv_dim, use_bias=False, key=kv)
        self.o = eqx.nn.Linear(dim, dim, use_bias=False, key=ko)


class MLP(eqx.Module):
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, dim: int, hidden: int, key: jax.Array):
        kg, ku, kd = jax.random.split(key, 3)
        self.gate = eqx.nn.Linear(dim, hidden, use_bias=False, key=kg)
        self.up = eqx.nn.Linear(dim, hidden, use_bias=False, key=ku)
        self.down = eqx.nn.Linear(hidden, dim, use_bias=False, key=kd)


class Block(eqx.Module):
    attn_norm: RMSNorm
    attn: Attention
    mlp_norm: RMSNorm
    mlp: MLP

    def __init__(self, dim: int, kv_dim: int, hidden: int, key: jax.Array):
        ka, km = jax.random.split(key)
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, kv_dim, ka)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = MLP(dim, hidden, km)


class Llama(eqx.Module):
    embed: eqx.nn.Embedding
    layers: list[Block]
    norm: RMSNorm
    head: eqx.nn.Linear

    def __init__(
        self, *, dim: int, layers: int, hidden: int, kv_dim: int, vocab: int = 32000
    ):
        keys = jax.random.split(jax.random.key(0), layers + 2)
        self.embed = eqx.nn.Embedding(vocab, dim, key=keys[0])
        self.layers = [Block(dim, kv_dim, hidden, k) for k in keys[2:]]
        self.norm = RMSNorm(dim)
        self.head = eqx.nn.Linear(dim, vocab, use_bias=False, key=keys[1])


def llama_7b() -> Llama:
    """Llama-2-7B: 32 layers, width 4096, MLP 11008, 6.7B parameters."""
    return Llama(dim=4096, layers=32, hidden=11008, kv_dim=4096)


def llama_70b() -> Llama:
    """Llama-2-70B: 80 layers, width 8192, MLP 28672, 8 key/value heads."""
    return Llama(dim=8192, layers=80, hidden=28672, kv_dim=1024)


def tiny() -> Llama:
    """A 2-layer model of the same shape, small enough to allocate."""
    return Llama(dim=64, layers=2, hidden=128, kv_dim=32, vocab=256)


def main() -> None:
    import optax

    import eqshard

    shapes = eqx.filter_eval_shape(llama_7b)
    mesh = jax.sharding.AbstractMesh((8,), ("fsdp",))
    rules = [(".*", eqshard.auto_fsdp("fsdp", mesh=mesh))]
    specs = eqshard.match_partition_rules(rules, shapes)
    plan = eqshard.plan_training(
        shapes,
        specs,
        mesh,
        optimizer=optax.adamw(1e-4),
        param_dtype=jnp.bfloat16,
        state_dtype=jnp.float32,
        device_memory="80GiB",
    )
    print(plan)
    params = plan.params.total_parameters
    # Per parameter: 2 bytes of bf16 weights, 2 of gradients, 8 of f32 AdamW
    # moments. The 65 RMSNorm weights (4096 each) are below auto_fsdp's min_size
    # and stay whole on every device; the rest splits 8 ways. Plus AdamW's count.
    norms = 65 * 4096
    expected = (params - norms) * 12 // 8 + norms * 12 + 4
    if params != 6_738_415_616 or plan.max_bytes_per_device != expected:
        raise SystemExit("llama example FAILED: the plan is not what it should be")
    print("llama example: OK")


if __name__ == "__main__":
    main()
