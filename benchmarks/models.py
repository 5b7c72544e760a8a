"""Models shared by the benchmark scripts, built from public APIs only.

`Transformer` is a GPT-style model (embedding, pre-norm blocks of q/k/v/o and MLP
`eqx.nn.Linear`s, layer norms, a head), the same parameters as the demo of
`python -m eqshard`; only its construction is timed (`bench_init.py`), so it has
no forward pass. Its `Block`s (and their `Attention` and `MLP`) do: the step
benchmarks (`bench_step.py`, `bench_search.py`) build their models from them.
`config_for_size` sizes it, and `RULES` shard every matrix over both axes of an
('fsdp', 'tp') mesh. `scan_step` is a scan-stacked step for targets, and
`command_step` the step `python -m eqshard --size ... --batch ... --seq ...`
compiles, written again from public APIs (`bench_estimate_cpu.py` checks its
shape against the command's).
"""

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, PRNGKeyArray


RULES: list[tuple[str, P]] = [
    ("embed/weight", P("tp", "fsdp")),
    ("attn/(q|k|v)/weight", P("tp", "fsdp")),
    ("attn/(q|k|v)/bias", P("tp")),
    ("attn/o/weight", P("fsdp", "tp")),
    ("mlp/up/weight", P("tp", "fsdp")),
    ("mlp/up/bias", P("tp")),
    ("mlp/down/weight", P("fsdp", "tp")),
    ("head/weight", P("tp", "fsdp")),
    (".*", P()),
]


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int
    dim: int
    heads: int
    layers: int

    @property
    def parameters(self) -> int:
        d, v = self.dim, self.vocab
        return self.layers * (12 * d * d + 13 * d) + 2 * v * d + 2 * d


class Attention(eqx.Module):
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)

    def __init__(self, dim: int, heads: int, *, causal: bool = True, key: PRNGKeyArray):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.q = eqx.nn.Linear(dim, dim, key=kq)
        self.k = eqx.nn.Linear(dim, dim, key=kk)
        self.v = eqx.nn.Linear(dim, dim, key=kv)
        self.o = eqx.nn.Linear(dim, dim, key=ko)
        self.heads, self.causal = heads, causal

    def __call__(self, x: Array) -> Array:
        seq, dim = x.shape
        q, k, v = (
            jax.vmap(f)(x).reshape(seq, self.heads, -1)
            for f in (self.q, self.k, self.v)
        )
        scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim // self.heads)
        if self.causal:
            scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -jnp.inf)
        out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v)
        return jax.vmap(self.o)(out.reshape(seq, dim))


class MLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    activation: Callable[[Array], Array]  # a leaf that is not an array

    def __init__(self, dim: int, *, key: PRNGKeyArray):
        ku, kd = jax.random.split(key)
        self.up = eqx.nn.Linear(dim, 4 * dim, key=ku)
        self.down = eqx.nn.Linear(4 * dim, dim, key=kd)
        self.activation = jax.nn.gelu

    def __call__(self, x: Array) -> Array:
        return self.down(self.activation(self.up(x)))


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: Attention
    norm2: eqx.nn.LayerNorm
    mlp: MLP

    def __init__(self, dim: int, heads: int, *, causal: bool = True, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, causal=causal, key=ka)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = MLP(dim, key=km)

    def __call__(self, x: Array) -> Array:
        x = x + self.attn(jax.vmap(self.norm1)(x))
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list[Block]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    config: Config = eqx.field(static=True)

    def __init__(self, config: Config, *, key: PRNGKeyArray):
        ke, kh, *kb = jax.random.split(key, 2 + config.layers)
        self.embed = eqx.nn.Embedding(config.vocab, config.dim, key=ke)
        self.blocks = [Block(config.dim, config.heads, key=k) for k in kb]
        self.norm = eqx.nn.LayerNorm(config.dim)
        self.head = eqx.nn.Linear(config.dim, config.vocab, use_bias=False, key=kh)
        self.config = config


def config_for_size(target: int, mesh: Mesh) -> Config:
    """A config with about `target` parameters (and a width of about 100 per
    layer, like GPT-3 and LLaMA), whose dimensions divide the 'fsdp' and 'tp'
    axes of `mesh`."""
    sizes = [mesh.shape.get(axis, 1) for axis in ("tp", "fsdp")]
    unit = 64 * math.lcm(*sizes)
    vocab = -(-(32000 if target >= 5 * 10**7 else 1024) // unit) * unit

    def candidates() -> Iterator[Config]:
        for layers in range(1, 257):
            a, b = 12 * layers, 13 * layers + 2 * vocab + 2
            root = (-b + math.sqrt(b * b + 4 * a * target)) / (2 * a)
            below = max(unit, math.floor(root / unit) * unit)
            for dim in sorted({below, math.ceil(root / unit) * unit}):
                yield Config(vocab=vocab, dim=dim, heads=dim // 64, layers=layers)

    def score(config: Config) -> float:
        error = abs(config.parameters - target) / target
        return error + 0.02 * abs(math.log(config.dim / config.layers / 100))

    return min(candidates(), key=score)


# A scan-stacked decoder step, as large models are written for TPU and GPU pods:
# every layer's weights stacked on a leading axis, the layers a `jax.lax.scan`
# with each layer rematerialised. `bench_targets.py` compiles it for targets
# (50 B parameters, 80 layers) and `gpu_check.py` on a real GPU (small).


@dataclasses.dataclass(frozen=True)
class ScanConfig:
    vocab: int
    dim: int
    hidden: int
    layers: int
    batch: int
    seq: int
    dtype: str = "bfloat16"

    @property
    def parameters(self) -> int:
        d, f = self.dim, self.hidden
        return self.layers * (4 * d * d + 2 * d * f) + 2 * self.vocab * d


def scan_rules() -> list[tuple[str, object]]:
    """FSDP x TP rules for `scan_params`: q/k/v and the MLP's first matrix split
    on their output over `tp`, o and the second on their input."""
    import eqshard

    return [
        ("embed", P("tp", "fsdp")),
        ("blocks/w(q|k|v|1)", eqshard.stacked(P("fsdp", "tp"))),
        ("blocks/w(o|2)", eqshard.stacked(P("tp", "fsdp"))),
        ("head", P("fsdp", "tp")),
        (".*", P()),
    ]


def scan_params(config: ScanConfig) -> dict:
    """The step's parameters, abstract (`jax.ShapeDtypeStruct`s)."""
    d, f, n, t = config.dim, config.hidden, config.layers, config.dtype
    square = jax.ShapeDtypeStruct((n, d, d), t)
    return {
        "embed": jax.ShapeDtypeStruct((config.vocab, d), t),
        "blocks": {
            "wq": square,
            "wk": square,
            "wv": square,
            "wo": square,
            "w1": jax.ShapeDtypeStruct((n, d, f), t),
            "w2": jax.ShapeDtypeStruct((n, f, d), t),
        },
        "head": jax.ShapeDtypeStruct((d, config.vocab), t),
    }


def scan_tokens(config: ScanConfig) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((config.batch, config.seq), jnp.int32)


def _layer(h: Array, w: dict) -> tuple[Array, None]:
    """One causal attention (64-wide heads) and MLP layer on `h` (batch, seq, dim)."""
    b, s, d = h.shape
    heads = lambda x: x.reshape(b, s, d // 64, 64)
    q, k, v = (heads(h @ w[name]) for name in ("wq", "wk", "wv"))
    scores = jnp.einsum("bqhc,bkhc->bhqk", q, k).astype(jnp.float32) / 8.0
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
    mixed = jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(scores).astype(h.dtype), v)
    h = h + mixed.reshape(b, s, d) @ w["wo"]
    return h + jax.nn.gelu(h @ w["w1"]) @ w["w2"], None


def scan_step(params: dict, tokens: Array) -> tuple[dict, Array]:
    """One SGD step of next-token cross-entropy; returns the new parameters and
    the loss."""

    def loss(p: dict) -> Array:
        h = p["embed"][tokens]
        h, _ = jax.lax.scan(jax.checkpoint(_layer), h, p["blocks"])
        logits = (h @ p["head"]).astype(jnp.float32)[:, :-1]
        targets = tokens[:, 1:]
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), value


# The step `python -m eqshard --size N --target T --batch B --seq S` compiles (its
# built-in model), written again here from public APIs: a decoder of
# `layers` x (4 attention matrices and a 4x MLP), its layers stacked, scanned and
# rematerialised, f32 parameters with bf16 compute, RMS norms, 128-wide heads,
# AdamW in f32; FSDP over `fsdp` x tensor parallelism over `tp`.


@dataclasses.dataclass(frozen=True)
class CommandShape:
    vocab: int
    dim: int
    layers: int

    @property
    def hidden(self) -> int:
        return 4 * self.dim

    @property
    def heads(self) -> int:
        return self.dim // 128


def _laid_out(mesh: Mesh, *axes: object) -> NamedSharding:
    import eqshard

    return NamedSharding(
        mesh, eqshard.restrict_specs(P(*axes), mesh, on_invalid="ignore")
    )


def command_state(shape: CommandShape, mesh: Mesh) -> tuple[dict, dict]:
    """The parameters (f32) and AdamW's state, abstract, laid out."""
    L, D, F, V = shape.layers, shape.dim, shape.hidden, shape.vocab

    def array(dims: tuple[int, ...], *axes: object) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(dims, jnp.float32, sharding=_laid_out(mesh, *axes))

    wide, narrow = (None, "fsdp", "tp"), (None, "tp", "fsdp")
    attn = {n: array((L, D, D), *wide) for n in "qkv"} | {
        "o": array((L, D, D), *narrow)
    }
    params = {
        "embed": array((V, D), "tp", "fsdp"),
        "blocks": {
            "attn": attn,
            "mlp": {"up": array((L, D, F), *wide), "down": array((L, F, D), *narrow)},
            "norm1": array((L, D), None, None),
            "norm2": array((L, D), None, None),
        },
        "norm": array((D,), None),
        "head": array((D, V), "fsdp", "tp"),
    }
    count = jax.ShapeDtypeStruct((), jnp.int32, sharding=_laid_out(mesh))
    return params, {"mu": params, "nu": params, "count": count}


def _rms(x: Array, scale: Array) -> Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
    return (x32 * scale).astype(jnp.bfloat16)


def _command_layer(heads: int, batch: NamedSharding) -> Callable:
    def layer(x: Array, w: dict) -> tuple[Array, None]:
        x = jax.lax.with_sharding_constraint(x, batch)
        bf = {k: v.astype(jnp.bfloat16) for k, v in w["attn"].items()}
        b, s, d = x.shape
        h = _rms(x, w["norm1"])
        q, k, v = ((h @ bf[n]).reshape(b, s, heads, -1) for n in "qkv")
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        scores = scores / math.sqrt(d // heads)
        causal = jnp.tril(jnp.ones((s, s), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), -1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(jnp.bfloat16), v)
        x = x + out.reshape(b, s, d) @ bf["o"]
        h = _rms(x, w["norm2"])
        up = jax.nn.gelu(h @ w["mlp"]["up"].astype(jnp.bfloat16))
        return x + up @ w["mlp"]["down"].astype(jnp.bfloat16), None

    return jax.checkpoint(layer)


def command_step(shape: CommandShape, mesh: Mesh) -> Any:
    """One AdamW step of the model on tokens of `(batch, seq + 1)`, jitted with
    the parameters and state donated: `step(params, state, tokens)`."""

    def loss(params: dict, tokens: Array) -> Array:
        x = params["embed"].astype(jnp.bfloat16)[tokens[:, :-1]]
        batch = _laid_out(mesh, "fsdp", None, None)
        x, _ = jax.lax.scan(_command_layer(shape.heads, batch), x, params["blocks"])
        normed = _rms(x, params["norm"])
        logits = (normed @ params["head"].astype(jnp.bfloat16)).astype(jnp.float32)
        gold = jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - gold)

    def step(params: dict, state: dict, tokens: Array) -> tuple[dict, dict, Array]:
        value, grads = jax.value_and_grad(loss)(params, tokens)
        count = state["count"] + 1
        mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["mu"], grads)
        nu = jax.tree.map(lambda n, g: 0.999 * n + 0.001 * g * g, state["nu"], grads)
        c = count.astype(jnp.float32)

        def update(p: Array, m: Array, n: Array) -> Array:
            m_hat, n_hat = m / (1 - 0.9**c), n / (1 - 0.999**c)
            return p - 1e-4 * (m_hat / (jnp.sqrt(n_hat) + 1e-8) + 0.1 * p)

        params = jax.tree.map(update, params, mu, nu)
        return params, {"mu": mu, "nu": nu, "count": count}, value

    return jax.jit(step, donate_argnums=(0, 1))
