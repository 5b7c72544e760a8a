"""Small Equinox models of the structures that third-party models have, for the
lifecycle tests (tests/test_lifecycle.py): a scan-stacked encoder (as ESM2), a
vision transformer, a bf16/fp32 language model with a tied head, a ResNet with
`eqx.nn.BatchNorm` state, and a model holding `eqx.nn.StateIndex` caches in
twice-stacked layers. Each has a `make(key)` returning what a training script
builds, `(model, opt_state)` (or `(model, state, opt_state)`), a `train_step(batch,
state)` returning the updated tree and the loss, a `batch`, and `big(key)`: the
model in a larger configuration, for plans. Sizes are tiny, so that each
compiles in about a second."""

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


class Block(eqx.Module):
    """A pre-norm transformer block on one sequence `(seq, dim)`."""

    ln1: eqx.nn.LayerNorm
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, dim: int, key: jax.Array):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.ln1 = eqx.nn.LayerNorm(dim, use_bias=False)
        self.qkv = eqx.nn.Linear(dim, 3 * dim, use_bias=False, key=k1)
        self.out = eqx.nn.Linear(dim, dim, use_bias=False, key=k2)
        self.ln2 = eqx.nn.LayerNorm(dim, use_bias=False)
        self.up = eqx.nn.Linear(dim, 4 * dim, key=k3)
        self.down = eqx.nn.Linear(4 * dim, dim, use_bias=False, key=k4)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = jnp.split(jax.vmap(self.qkv)(jax.vmap(self.ln1)(x)), 3, axis=-1)
        attn = jax.nn.softmax(q @ k.T / jnp.sqrt(q.shape[-1]))
        x = x + jax.vmap(self.out)(attn @ v)
        h = jax.vmap(self.ln2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))


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

    def __init__(self, key: jax.Array, dim: int = 32, depth: int = 2):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, dim, key=k1)
        keys = jax.random.split(k2, depth)
        self.layers = eqx.filter_vmap(lambda k: Block(dim, k))(keys)
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, VOCAB, key=k3)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = _scan(self.layers, jax.vmap(self.embed)(tokens))
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


# ---------------------------------------------------------------- ViT


class ViT(eqx.Module):
    """A vision transformer: patches by a strided convolution, a class token,
    position embeddings, a list of blocks, a classifier."""

    patch: eqx.nn.Conv2d
    cls: jax.Array
    pos: jax.Array
    blocks: list[Block]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array, dim: int = 32, depth: int = 1, image=16):
        keys = jax.random.split(key, depth + 4)
        self.patch = eqx.nn.Conv2d(3, dim, 4, stride=4, use_bias=False, key=keys[0])
        self.cls = jax.random.normal(keys[1], (dim,)) * 0.02
        self.pos = jax.random.normal(keys[2], ((image // 4) ** 2 + 1, dim)) * 0.02
        self.blocks = [Block(dim, k) for k in keys[4:]]
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


class _Layer(eqx.Module):
    norm: jax.Array  # fp32 RMS norm scale
    wq: _Dense
    wk: _Dense
    wv: _Dense
    wo: _Dense
    up: _Dense
    down: _Dense

    def __init__(self, dim: int, key: jax.Array):
        keys = jax.random.split(key, 6)
        self.norm = jnp.ones(dim, jnp.float32)
        self.wq, self.wk, self.wv, self.wo = (_Dense(dim, dim, k) for k in keys[:4])
        self.up = _Dense(dim, 2 * dim, keys[4])
        self.down = _Dense(2 * dim, dim, keys[5])

    def __call__(self, x: jax.Array) -> jax.Array:  # (seq, dim) bf16
        xf = x.astype(jnp.float32)
        h = (xf * jax.lax.rsqrt((xf**2).mean(-1, keepdims=True) + 1e-6)) * self.norm
        h = h.astype(jnp.bfloat16)
        q, k, v = (jax.vmap(w)(h) for w in (self.wq, self.wk, self.wv))
        scores = (q @ k.T).astype(jnp.float32) / jnp.sqrt(q.shape[-1])
        mask = jnp.tril(jnp.ones(scores.shape, bool))
        attn = jax.nn.softmax(jnp.where(mask, scores, -1e9)).astype(jnp.bfloat16)
        x = x + jax.vmap(self.wo)(attn @ v)
        return x + jax.vmap(self.down)(jax.nn.silu(jax.vmap(self.up)(x)))


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
    """An attention layer with a key/value cache for sampling: the cache's
    initial value is held by an `eqx.nn.StateIndex`."""

    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    cache: eqx.nn.StateIndex

    def __init__(self, dim: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.qkv = eqx.nn.Linear(dim, 3 * dim, key=k1)
        self.out = eqx.nn.Linear(dim, dim, use_bias=False, key=k2)
        self.cache = eqx.nn.StateIndex(jnp.zeros((2, SEQ, dim)))

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = jnp.split(jax.vmap(self.qkv)(x), 3, axis=-1)
        attn = jax.nn.softmax(q @ k.T / jnp.sqrt(q.shape[-1]))
        return x + jax.vmap(self.out)(attn @ v)


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


# ---------------------------------------------------------------- the five


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
}
