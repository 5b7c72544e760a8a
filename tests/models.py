"""Small Equinox models of the structures that third-party models have, for the
lifecycle tests (tests/test_lifecycle.py) and the search's candidates
(tests/test_candidates.py), with the third-party names and shapes: a scan-stacked
encoder (as ESM2: `query_proj`/`key_proj`/`value_proj`/`output_proj`,
`fc1`/`fc2`), a vision transformer (as timm's: a fused `qkv` with `proj`), a
bf16/fp32 language model with a tied head (Megalodon's attention: `wz` for the
queries and keys, `wv`/`wr` with `wh2`; a gated MLP `fc1`/`fc3` with `fc2`), a
ResNet with `eqx.nn.BatchNorm` state, a model holding `eqx.nn.StateIndex` caches
in twice-stacked layers, a Llama-style decoder (grouped-query attention with
per-head 3-D `W_Q`/`W_K`/`W_V`/`W_O`, rotary embeddings, SwiGLU `w1`/`w3` with
`w2`) and a UNet (convolutions with `eqx.nn.GroupNorm`, skip connections). Each
has a `make(key)` returning what a training script builds, `(model, opt_state)`
(or `(model, state, opt_state)`), a `train_step(batch, state)` returning the
updated tree and the loss, a `batch`, and `big(key)`: the model in a larger
configuration, for plans. `ATTENTION` names, per model, the weights a person
splits for tensor parallelism (q, k and v on their output, the output
projection on its input). Sizes are tiny, so that each compiles in about a
second."""

import dataclasses
import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax


OPTIMIZER = optax.adamw(1e-2)
BATCH, SEQ, VOCAB = 8, 8, 64


def _is_index(x: Any) -> bool:
    return isinstance(x, eqx.nn.StateIndex)


def _params(model: Any) -> Any:
    """What is trained: the floating-point arrays, not the initial values held by
    `eqx.nn.StateIndex` (Equinox's idiom: the index as one leaf)."""
    return eqx.filter(model, eqx.is_inexact_array, is_leaf=_is_index)


def trainable(model: Any) -> Any:
    """`_params`' choice as a filter tree, for `plan_training(trainable=...)`."""
    return jax.tree.map(lambda x: not _is_index(x), model, is_leaf=_is_index)


def _value_and_grad(loss_fn: Callable[..., Any], model: Any, *args: Any) -> Any:
    """`loss_fn(model, *args)` and its gradient with respect to `_params(model)`."""
    params, static = eqx.partition(model, eqx.is_inexact_array, is_leaf=_is_index)

    def of_params(params, *args):
        return loss_fn(eqx.combine(params, static), *args)

    return eqx.filter_value_and_grad(of_params, has_aux=True)(params, *args)


def _update(model: Any, grads: Any, opt_state: Any) -> tuple[Any, Any]:
    updates, opt_state = OPTIMIZER.update(grads, opt_state, _params(model))
    return eqx.apply_updates(model, updates), opt_state


def _tokens(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (BATCH, SEQ + 1), np.int32)


HEADS = 4


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, causal=False) -> jax.Array:
    """Attention of `(seq, heads, head_dim)` queries, keys and values."""
    scores = jnp.einsum("qhd,khd->hqk", q, k) / jnp.sqrt(q.shape[-1])
    if causal:
        mask = jnp.tril(jnp.ones(scores.shape[1:], bool))
        scores = jnp.where(mask, scores, -1e9)
    weights = jax.nn.softmax(scores.astype(jnp.float32)).astype(v.dtype)
    return jnp.einsum("hqk,khd->qhd", weights, v)


def _heads(x: jax.Array, heads: int) -> jax.Array:
    return x.reshape(x.shape[0], heads, -1)


def _self_attention(dim: int, key: jax.Array, heads: int) -> Any:
    """ESM2's attention as Equinox builds it: `query_proj`, `key_proj`,
    `value_proj` and `output_proj`, with biases, heads by a reshape."""
    return eqx.nn.MultiheadAttention(
        heads,
        dim,
        use_query_bias=True,
        use_key_bias=True,
        use_value_bias=True,
        use_output_bias=True,
        key=key,
    )


class Block(eqx.Module):
    """A pre-norm transformer block on one sequence `(seq, dim)` (ESM2's)."""

    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, dim: int, key: jax.Array, heads: int = HEADS):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(dim)
        self.attn = _self_attention(dim, k1, heads)
        self.ln2 = eqx.nn.LayerNorm(dim)
        self.fc1 = eqx.nn.Linear(dim, 4 * dim, key=k2)
        self.fc2 = eqx.nn.Linear(4 * dim, dim, key=k3)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h)
        h = jax.vmap(self.ln2)(x)
        return x + jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(h)))


def _scan(blocks: Any, x: jax.Array) -> jax.Array:
    """Layers stacked on a leading axis, applied in turn with `jax.lax.scan`."""
    arrays, static = eqx.partition(blocks, eqx.is_array)

    def layer(x, arrays):
        return eqx.combine(arrays, static)(x), None

    return jax.lax.scan(layer, x, arrays)[0]


def _lm_loss(model: Any, tokens: jax.Array) -> tuple[jax.Array, None]:
    logits = jax.vmap(model)(tokens[:, :-1]).astype(jnp.float32)
    labels = tokens[:, 1:]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, None


def _lm_step(batch: Any, state: Any) -> tuple[Any, jax.Array]:
    model, opt_state = state
    (loss, _), grads = _value_and_grad(_lm_loss, model, batch)
    return _update(model, grads, opt_state), loss


# ---------------------------------------------------------------- ESM2-like


class Encoder(eqx.Module):
    """A protein language model's shape (ESM2): embedding, layers stacked by
    `eqx.filter_vmap` and scanned, a final norm and a head."""

    embed: eqx.nn.Embedding
    layers: Block  # stacked: every array has a leading layer axis
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array, dim: int = 32, depth: int = 2, heads=HEADS):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, dim, key=k1)
        keys = jax.random.split(k2, depth)
        self.layers = eqx.filter_vmap(lambda k: Block(dim, k, heads))(keys)
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, VOCAB, key=k3)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = _scan(self.layers, jax.vmap(self.embed)(tokens))
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


# ---------------------------------------------------------------- ViT


class _VitAttention(eqx.Module):
    """timm's attention: one fused `qkv` projection, read as `(3, heads,
    head_dim)`, and `proj`."""

    qkv: eqx.nn.Linear
    proj: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, dim: int, key: jax.Array, heads: int = HEADS):
        k1, k2 = jax.random.split(key)
        self.qkv = eqx.nn.Linear(dim, 3 * dim, key=k1)
        self.proj = eqx.nn.Linear(dim, dim, key=k2)
        self.heads = heads

    def __call__(self, x: jax.Array) -> jax.Array:
        n, dim = x.shape
        qkv = jax.vmap(self.qkv)(x).reshape(n, 3, self.heads, dim // self.heads)
        q, k, v = jnp.moveaxis(qkv, 1, 0)
        return jax.vmap(self.proj)(_attend(q, k, v).reshape(n, dim))


class _VitMlp(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, dim: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(dim, 4 * dim, key=k1)
        self.fc2 = eqx.nn.Linear(4 * dim, dim, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(x)))


class _VitBlock(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: _VitAttention
    norm2: eqx.nn.LayerNorm
    mlp: _VitMlp

    def __init__(self, dim: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attn = _VitAttention(dim, k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = _VitMlp(dim, k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(jax.vmap(self.norm1)(x))
        return x + self.mlp(jax.vmap(self.norm2)(x))


class ViT(eqx.Module):
    """A vision transformer (timm's names): patches by a strided convolution, a
    class token, position embeddings, a list of blocks, a classifier."""

    patch: eqx.nn.Conv2d
    cls: jax.Array
    pos: jax.Array
    blocks: list[_VitBlock]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array, dim: int = 32, depth: int = 1, image=16):
        keys = jax.random.split(key, depth + 4)
        self.patch = eqx.nn.Conv2d(3, dim, 4, stride=4, use_bias=False, key=keys[0])
        self.cls = jax.random.normal(keys[1], (dim,)) * 0.02
        self.pos = jax.random.normal(keys[2], ((image // 4) ** 2 + 1, dim)) * 0.02
        self.blocks = [_VitBlock(dim, k) for k in keys[4:]]
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, 10, key=keys[3])

    def __call__(self, image: jax.Array) -> jax.Array:
        patches = self.patch(image)  # (dim, h, w)
        x = patches.reshape(patches.shape[0], -1).T
        x = jnp.concatenate([self.cls[None], x]) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[0]))


def _vit_step(batch: Any, state: Any) -> tuple[Any, jax.Array]:
    model, opt_state = state
    images, labels = batch

    def loss_fn(model):
        logits = jax.vmap(model)(images)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, None

    (loss, _), grads = _value_and_grad(loss_fn, model)
    return _update(model, grads, opt_state), loss


# ---------------------------------------------------------------- bf16 LM, tied


class _Dense(eqx.Module):
    """A bf16 linear layer without bias, initialised by a scaled draw."""

    weight: jax.Array

    def __init__(self, din: int, dout: int, key: jax.Array):
        self.weight = (jax.random.normal(key, (dout, din)) * 0.2).astype(jnp.bfloat16)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.weight @ x


def _rms(x: jax.Array, scale: jax.Array) -> jax.Array:
    """RMS norm in fp32, back to bf16."""
    xf = x.astype(jnp.float32)
    h = xf * jax.lax.rsqrt((xf**2).mean(-1, keepdims=True) + 1e-6) * scale
    return h.astype(jnp.bfloat16)


class _Layer(eqx.Module):
    """Megalodon's layer: a shared `wz` for queries and keys (each scaled per
    dimension), values `wv` and a gate `wr` (both through SiLU), the attention
    gated by `r` into `wh2` beside `wh1` of the input; a SwiGLU `fc1`/`fc3`
    with `fc2`."""

    norm: jax.Array  # fp32 RMS norm scale
    wz: _Dense
    qk_scale: jax.Array  # (2, dim) fp32
    wv: _Dense
    wr: _Dense
    wh1: _Dense
    wh2: _Dense
    ffn_norm: jax.Array
    fc1: _Dense
    fc3: _Dense
    fc2: _Dense

    def __init__(self, dim: int, key: jax.Array):
        keys = jax.random.split(key, 8)
        self.norm = jnp.ones(dim, jnp.float32)
        self.wz, self.wv, self.wr, self.wh1, self.wh2 = (
            _Dense(dim, dim, k) for k in keys[:5]
        )
        self.qk_scale = jnp.ones((2, dim), jnp.float32)
        self.ffn_norm = jnp.ones(dim, jnp.float32)
        self.fc1 = _Dense(dim, 2 * dim, keys[5])
        self.fc3 = _Dense(dim, 2 * dim, keys[6])
        self.fc2 = _Dense(2 * dim, dim, keys[7])

    def __call__(self, x: jax.Array) -> jax.Array:  # (seq, dim) bf16
        h = _rms(x, self.norm)
        z = jax.vmap(self.wz)(h)
        q, k = ((z * s).astype(jnp.bfloat16) for s in self.qk_scale)
        v = jax.nn.silu(jax.vmap(self.wv)(h))
        r = jax.nn.silu(jax.vmap(self.wr)(h))
        attn = _attend(*(_heads(a, HEADS) for a in (q, k, v)), causal=True)
        gated = attn.reshape(x.shape) * r
        x = x + jax.vmap(self.wh1)(h) + jax.vmap(self.wh2)(gated)
        h = _rms(x, self.ffn_norm)
        up = jax.nn.silu(jax.vmap(self.fc1)(h)) * jax.vmap(self.fc3)(h)
        return x + jax.vmap(self.fc2)(up)


def _where(pair: Any) -> Any:
    return pair[1].weight


def _get(pair: Any) -> Any:
    return pair[0].weight


class MixedLM(eqx.Module):
    """A decoder with bf16 weights, fp32 norms and a head tied to the embedding
    (`eqx.nn.Shared`)."""

    tied: eqx.nn.Shared  # (embedding, head): the head's weight is the embedding's
    layers: list[_Layer]
    norm: jax.Array

    def __init__(self, key: jax.Array, dim: int = 32, depth: int = 1):
        keys = jax.random.split(key, depth + 1)
        embed = eqx.nn.Embedding(
            weight=(jax.random.normal(keys[0], (VOCAB, dim)) * 0.2).astype(jnp.bfloat16)
        )
        head = _Dense(dim, VOCAB, keys[0])
        self.tied = eqx.nn.Shared((embed, head), _where, _get)
        self.layers = [_Layer(dim, k) for k in keys[1:]]
        self.norm = jnp.ones(dim, jnp.float32)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed, head = self.tied()
        x = jax.vmap(embed)(tokens)
        for layer in self.layers:
            x = layer(x)
        x = (x.astype(jnp.float32) * self.norm).astype(jnp.bfloat16)
        return jax.vmap(head)(x)


# ---------------------------------------------------------------- ResNet


class _Residual(eqx.Module):
    conv1: eqx.nn.Conv2d
    bn1: eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    bn2: eqx.nn.BatchNorm

    def __init__(self, channels: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        conv = ft.partial(eqx.nn.Conv2d, channels, channels, 3, padding=1)
        self.conv1 = conv(use_bias=False, key=k1)
        self.bn1 = eqx.nn.BatchNorm(channels, "batch", mode="batch")
        self.conv2 = conv(use_bias=False, key=k2)
        self.bn2 = eqx.nn.BatchNorm(channels, "batch", mode="batch")

    def __call__(self, x: jax.Array, state: eqx.nn.State) -> Any:
        h, state = self.bn1(self.conv1(x), state)
        h, state = self.bn2(self.conv2(jax.nn.relu(h)), state)
        return jax.nn.relu(x + h), state


class ResNet(eqx.Module):
    """A ResNet: a stem, residual blocks with `eqx.nn.BatchNorm` (whose running
    statistics live in `eqx.nn.State`), a classifier."""

    stem: eqx.nn.Conv2d
    blocks: list[_Residual]
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array, channels: int = 8, depth: int = 1):
        keys = jax.random.split(key, depth + 2)
        self.stem = eqx.nn.Conv2d(
            3, channels, 3, padding=1, use_bias=False, key=keys[0]
        )
        self.blocks = [_Residual(channels, k) for k in keys[2:]]
        self.head = eqx.nn.Linear(channels, 10, key=keys[1])

    def __call__(self, x: jax.Array, state: eqx.nn.State) -> Any:
        x = self.stem(x)
        for block in self.blocks:
            x, state = block(x, state)
        return self.head(x.mean((1, 2))), state


def _resnet_step(batch: Any, tree: Any) -> tuple[Any, jax.Array]:
    model, state, opt_state = tree
    images, labels = batch

    def loss_fn(model, state):
        batched = jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )
        logits, state = batched(images, state)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, state

    (loss, state), grads = _value_and_grad(loss_fn, model, state)
    model, opt_state = _update(model, grads, opt_state)
    return (model, state, opt_state), loss


def _make_resnet(key: jax.Array) -> Any:
    model, state = eqx.nn.make_with_state(ResNet)(key)
    return model, state, OPTIMIZER.init(_params(model))


# ---------------------------------------------------------------- flows


class _FlowLayer(eqx.Module):
    """An attention layer (transformer-flows' names) with a key/value cache for
    sampling: the cache's initial value is held by an `eqx.nn.StateIndex`."""

    attn: eqx.nn.MultiheadAttention
    cache: eqx.nn.StateIndex

    def __init__(self, dim: int, key: jax.Array):
        self.attn = _self_attention(dim, key, HEADS)
        self.cache = eqx.nn.StateIndex(jnp.zeros((2, SEQ, dim)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.attn(x, x, x)


class Flows(eqx.Module):
    """A normalising-flow transformer's shape (transformer-flows): flows of
    layers, stacked twice by nested `eqx.filter_vmap` and scanned twice."""

    flows: _FlowLayer  # arrays of shape (flows, layers, ...)
    proj: eqx.nn.Linear

    def __init__(self, key: jax.Array, dim: int = 32, flows: int = 2, layers=2):
        k1, k2 = jax.random.split(key)
        make = eqx.filter_vmap(eqx.filter_vmap(lambda k: _FlowLayer(dim, k)))
        self.flows = make(jax.random.split(k1, (flows, layers)))
        self.proj = eqx.nn.Linear(dim, dim, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        arrays, static = eqx.partition(self.flows, eqx.is_array)

        def flow(x, arrays):
            return _scan(eqx.combine(arrays, static), x)[::-1], None

        return jax.vmap(self.proj)(jax.lax.scan(flow, x, arrays)[0])


def _flows_step(batch: Any, state: Any) -> tuple[Any, jax.Array]:
    model, opt_state = state

    def loss_fn(model):
        return jnp.mean(jax.vmap(model)(batch) ** 2), None

    (loss, _), grads = _value_and_grad(loss_fn, model)
    return _update(model, grads, opt_state), loss


# ---------------------------------------------------------------- Llama-style


def _rotary(x: jax.Array) -> jax.Array:
    """Rotary position embeddings on `(seq, heads, head_dim)`."""
    seq, _, size = x.shape
    freqs = 1.0 / 10000 ** (jnp.arange(0, size, 2) / size)
    angles = jnp.arange(seq)[:, None] * freqs[None]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)[:, None]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)[:, None]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], -1) * sin


class _GroupedAttention(eqx.Module):
    """Grouped-query attention with per-head weights (TransformerLens's shapes):
    `W_Q` `(heads, dim, head_dim)`, `W_K`/`W_V` `(kv_heads, dim, head_dim)`,
    `W_O` `(heads, head_dim, dim)`."""

    W_Q: jax.Array
    W_K: jax.Array
    W_V: jax.Array
    W_O: jax.Array

    def __init__(self, dim: int, heads: int, kv_heads: int, key: jax.Array):
        size = dim // heads
        kq, kk, kv, ko = jax.random.split(key, 4)
        scale = dim**-0.5
        self.W_Q = jax.random.normal(kq, (heads, dim, size)) * scale
        self.W_K = jax.random.normal(kk, (kv_heads, dim, size)) * scale
        self.W_V = jax.random.normal(kv, (kv_heads, dim, size)) * scale
        self.W_O = jax.random.normal(ko, (heads, size, dim)) * scale

    def __call__(self, x: jax.Array) -> jax.Array:
        q = _rotary(jnp.einsum("sd,hdk->shk", x, self.W_Q))
        k = _rotary(jnp.einsum("sd,hdk->shk", x, self.W_K))
        v = jnp.einsum("sd,hdk->shk", x, self.W_V)
        group = self.W_Q.shape[0] // self.W_K.shape[0]
        k, v = (jnp.repeat(a, group, axis=1) for a in (k, v))
        return jnp.einsum("shk,hkd->sd", _attend(q, k, v, causal=True), self.W_O)


class _SwiGLU(eqx.Module):
    w1: eqx.nn.Linear  # the gate
    w3: eqx.nn.Linear
    w2: eqx.nn.Linear

    def __init__(self, dim: int, hidden: int, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.w1 = eqx.nn.Linear(dim, hidden, use_bias=False, key=k1)
        self.w3 = eqx.nn.Linear(dim, hidden, use_bias=False, key=k2)
        self.w2 = eqx.nn.Linear(hidden, dim, use_bias=False, key=k3)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.w2(jax.nn.silu(self.w1(x)) * self.w3(x))


class _DecoderLayer(eqx.Module):
    attention_norm: eqx.nn.RMSNorm
    attention: _GroupedAttention
    ffn_norm: eqx.nn.RMSNorm
    feed_forward: _SwiGLU

    def __init__(self, dim: int, heads: int, kv_heads: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.attention_norm = eqx.nn.RMSNorm(dim)
        self.attention = _GroupedAttention(dim, heads, kv_heads, k1)
        self.ffn_norm = eqx.nn.RMSNorm(dim)
        self.feed_forward = _SwiGLU(dim, 3 * dim, k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(jax.vmap(self.attention_norm)(x))
        return x + jax.vmap(self.feed_forward)(jax.vmap(self.ffn_norm)(x))


class Decoder(eqx.Module):
    """A Llama-style decoder: an embedding, layers of grouped-query attention
    and SwiGLU, a final RMS norm and an untied head."""

    embed: eqx.nn.Embedding
    layers: list[_DecoderLayer]
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, key, dim=32, depth=2, heads=2 * HEADS, kv_heads=HEADS):
        keys = jax.random.split(key, depth + 2)
        self.embed = eqx.nn.Embedding(VOCAB, dim, key=keys[0])
        self.layers = [_DecoderLayer(dim, heads, kv_heads, k) for k in keys[2:]]
        self.norm = eqx.nn.RMSNorm(dim)
        self.head = eqx.nn.Linear(dim, VOCAB, use_bias=False, key=keys[1])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jax.vmap(self.embed)(tokens)
        for layer in self.layers:
            x = layer(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


# ---------------------------------------------------------------- UNet


class _ConvBlock(eqx.Module):
    """Two 3x3 convolutions, each followed by a group norm and a SiLU."""

    conv1: eqx.nn.Conv2d
    norm1: eqx.nn.GroupNorm
    conv2: eqx.nn.Conv2d
    norm2: eqx.nn.GroupNorm

    def __init__(self, cin: int, cout: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.conv1 = eqx.nn.Conv2d(cin, cout, 3, padding=1, key=k1)
        self.norm1 = eqx.nn.GroupNorm(HEADS, cout)
        self.conv2 = eqx.nn.Conv2d(cout, cout, 3, padding=1, key=k2)
        self.norm2 = eqx.nn.GroupNorm(HEADS, cout)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.silu(self.norm1(self.conv1(x)))
        return jax.nn.silu(self.norm2(self.conv2(x)))


class UNet(eqx.Module):
    """A UNet: an encoder block, a pooled one below it, a transposed
    convolution up, a decoder block on the skip connection concatenated, and a
    1x1 convolution out."""

    down: _ConvBlock
    bottom: _ConvBlock
    up: eqx.nn.ConvTranspose2d
    decode: _ConvBlock
    out: eqx.nn.Conv2d

    def __init__(self, key: jax.Array, channels: int = 8):
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        self.down = _ConvBlock(3, channels, k1)
        self.bottom = _ConvBlock(channels, 2 * channels, k2)
        self.up = eqx.nn.ConvTranspose2d(2 * channels, channels, 2, stride=2, key=k3)
        self.decode = _ConvBlock(2 * channels, channels, k4)
        self.out = eqx.nn.Conv2d(channels, 3, 1, key=k5)

    def __call__(self, x: jax.Array) -> jax.Array:
        skip = self.down(x)
        c, h, w = skip.shape
        pooled = skip.reshape(c, h // 2, 2, w // 2, 2).mean((2, 4))
        x = self.up(self.bottom(pooled))
        return self.out(self.decode(jnp.concatenate([x, skip])))


def _unet_step(batch: Any, state: Any) -> tuple[Any, jax.Array]:
    model, opt_state = state
    images, targets = batch

    def loss_fn(model):
        return jnp.mean((jax.vmap(model)(images) - targets) ** 2), None

    (loss, _), grads = _value_and_grad(loss_fn, model)
    return _update(model, grads, opt_state), loss


# ---------------------------------------------------------------- the seven


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable[[jax.Array], Any]
    train_step: Callable[[Any, Any], Any]
    batch: Any
    big: Callable[[jax.Array], Any]  # the model alone, in a larger configuration


def _with_optimizer(model_cls: Callable[[jax.Array], Any]) -> Callable[..., Any]:
    def make(key: jax.Array) -> Any:
        model = model_cls(key)
        return model, OPTIMIZER.init(_params(model))

    return make


_RNG = np.random.default_rng(0)
CASES = {
    "esm2": Case(
        _with_optimizer(Encoder),
        _lm_step,
        _tokens(1),
        lambda key: Encoder(key, dim=1280, depth=33),
    ),
    "vit": Case(
        _with_optimizer(ViT),
        _vit_step,
        (
            _RNG.normal(size=(BATCH, 3, 16, 16)).astype(np.float32),
            _RNG.integers(0, 10, BATCH).astype(np.int32),
        ),
        lambda key: ViT(key, dim=384, depth=12, image=224),
    ),
    "mixed_lm": Case(
        _with_optimizer(MixedLM),
        _lm_step,
        _tokens(2),
        lambda key: MixedLM(key, dim=2048, depth=24),
    ),
    "resnet": Case(
        _make_resnet,
        _resnet_step,
        (
            _RNG.normal(size=(BATCH, 3, 8, 8)).astype(np.float32),
            _RNG.integers(0, 10, BATCH).astype(np.int32),
        ),
        lambda key: eqx.nn.make_with_state(ResNet)(key, channels=512, depth=8)[0],
    ),
    "flows": Case(
        _with_optimizer(Flows),
        _flows_step,
        _RNG.normal(size=(BATCH, SEQ, 32)).astype(np.float32),
        lambda key: Flows(key, dim=1024, flows=8, layers=8),
    ),
    "decoder": Case(
        _with_optimizer(Decoder),
        _lm_step,
        _tokens(3),
        lambda key: Decoder(key, dim=2048, depth=16, heads=32, kv_heads=8),
    ),
    "unet": Case(
        _with_optimizer(UNet),
        _unet_step,
        (
            _RNG.normal(size=(BATCH, 3, 8, 8)).astype(np.float32),
            _RNG.normal(size=(BATCH, 3, 8, 8)).astype(np.float32),
        ),
        lambda key: UNet(key, channels=256),
    ),
}

# The weights that tensor parallelism splits in each attention block: q, k and v
# on their output (head) dimension, the output projection on its input, as
# (path regex, dimension) for every model with attention. Stacked layers count
# their leading axes. Megalodon's attention is `wv`/`wr` with `wh2` (and `wz`,
# whose product is the queries and keys).
ATTENTION: dict[str, list[tuple[str, int]]] = {
    "esm2": [
        (r"^layers/attn/(query|key|value)_proj/weight$", 1),
        (r"^layers/attn/output_proj/weight$", 2),
    ],
    "vit": [
        (r"^blocks/\d+/attn/qkv/weight$", 0),
        (r"^blocks/\d+/attn/proj/weight$", 1),
    ],
    "mixed_lm": [
        (r"^layers/\d+/w[zvr]/weight$", 0),
        (r"^layers/\d+/wh2/weight$", 1),
    ],
    "flows": [
        (r"^flows/attn/(query|key|value)_proj/weight$", 2),
        (r"^flows/attn/output_proj/weight$", 3),
    ],
    "decoder": [
        (r"^layers/\d+/attention/W_[QKV]$", 0),
        (r"^layers/\d+/attention/W_O$", 0),
    ],
}
