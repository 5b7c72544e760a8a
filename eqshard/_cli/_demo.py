"""The demo of `python -m eqshard`: a small Equinox transformer, its built-in rules,
the size solver of `--size`, a few training steps and the round trip
(gather -> serialise -> load -> shard) checked bit for bit; with the progress bar
and the phase timer that the command's summary prints.

The command (`_main.py`) reads the options and dispatches; the plans it prints
are `_fit.py`'s.
"""

import dataclasses
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

import eqshard


_DATA_AXES = ("dp", "fsdp")

# The demo's own rules (as a `--rules FILE` would give them: `tp,fsdp` is
# P("tp", "fsdp")). They name the axes `dp` (data), `fsdp` (data, and the other
# dimension of the weights) and `tp` (tensor parallel); `builtin_rules` drops the
# entries naming an axis the mesh lacks.
BUILTIN_RULES: list[tuple[str, P]] = [
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


# ---------------------------------------------------------------------------------
# The model: a small pre-norm transformer.
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int
    dim: int
    heads: int
    layers: int
    seq: int = 16

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

    def __init__(self, dim: int, heads: int, *, key: PRNGKeyArray):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.q = eqx.nn.Linear(dim, dim, key=kq)
        self.k = eqx.nn.Linear(dim, dim, key=kk)
        self.v = eqx.nn.Linear(dim, dim, key=kv)
        self.o = eqx.nn.Linear(dim, dim, key=ko)
        self.heads = heads

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        seq, dim = x.shape
        q, k, v = (jax.vmap(f)(x).reshape(seq, self.heads, -1) for f in self.qkv)
        scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim // self.heads)
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        out = jnp.einsum("hqk,khd->qhd", weights, v).reshape(seq, dim)
        return jax.vmap(self.o)(out)

    @property
    def qkv(self) -> tuple[eqx.nn.Linear, eqx.nn.Linear, eqx.nn.Linear]:
        return self.q, self.k, self.v


class MLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    activation: Callable[[Array], Array]  # a leaf that is not an array

    def __init__(self, dim: int, *, key: PRNGKeyArray):
        ku, kd = jax.random.split(key)
        self.up = eqx.nn.Linear(dim, 4 * dim, key=ku)
        self.down = eqx.nn.Linear(4 * dim, dim, key=kd)
        self.activation = jax.nn.gelu

    def __call__(self, x: Float[Array, " dim"]) -> Float[Array, " dim"]:
        return self.down(self.activation(self.up(x)))


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: Attention
    norm2: eqx.nn.LayerNorm
    mlp: MLP

    def __init__(self, dim: int, heads: int, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, key=ka)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = MLP(dim, key=km)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
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

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def loss_fn(model: Transformer, tokens: Int[Array, "batch seq"]) -> Float[Array, ""]:
    """Next-token cross-entropy."""
    logits = jax.vmap(model)(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
    return -jnp.mean(target)


def axis_product(mesh: Mesh, axes: Sequence[str]) -> int:
    return math.prod(mesh.shape[a] for a in axes if a in mesh.shape)


def demo_config(mesh: Mesh) -> Config:
    """The demo's small model, sized so that its dimensions divide the mesh."""
    unit = math.lcm(axis_product(mesh, ("tp",)), axis_product(mesh, ("fsdp",)))
    heads = eqshard.compat.round_up_to_multiple(4, unit)
    vocab = eqshard.compat.round_up_to_multiple(256, unit)
    return Config(vocab=vocab, dim=16 * heads, heads=heads, layers=2)


def config_for_size(target: int, mesh: Mesh) -> Config:
    """A transformer config with about `target` parameters (and a width of about
    100 per layer, like GPT-3 and LLaMA), whose dimensions divide the mesh."""
    unit = 64 * math.lcm(axis_product(mesh, ("tp",)), axis_product(mesh, ("fsdp",)))
    vocab = eqshard.compat.round_up_to_multiple(
        32000 if target >= 5 * 10**7 else 1024, unit
    )

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

    return min(candidates(), key=score)  # the first of equal scores, as before


def builtin_rules(mesh: Mesh) -> list[tuple[str, P]]:
    """The built-in rules, without the mesh axes that `mesh` lacks (the rules
    name every axis a mesh of the command may have, so dropping is expected)."""
    return [
        (regex, eqshard.restrict_specs(spec, mesh, on_invalid="ignore"))
        for regex, spec in BUILTIN_RULES
    ]


# ---------------------------------------------------------------------------------
# Output.
# ---------------------------------------------------------------------------------


class Progress:
    """A text progress bar: redrawn in place on a terminal, one line per update
    otherwise (so that logs stay readable)."""

    def __init__(self, total: int, stream: TextIO, label: str = "train"):
        self.total, self.stream, self.label = total, stream, label
        self.tty = stream.isatty()
        self.width = 0

    def update(self, done: int, note: str) -> None:
        filled = 24 * done // max(self.total, 1)
        line = f"{self.label} [{'#' * filled}{'.' * (24 - filled)}] "
        line += f"{done}/{self.total}  {note}"
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.width:
            self.stream.write("\n")
            self.stream.flush()


class Timer:
    """Named phases with their durations, for the summary."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, float, str]] = []

    def __call__(self, name: str, seconds: float, note: str = "") -> None:
        self.phases.append((name, seconds, note))

    def summary(self, total: float) -> str:
        width = max(len(name) for name, _, _ in self.phases) + 2
        lines = ["summary"]
        for name, seconds, note in self.phases:
            lines.append(f"  {name:<{width}}{seconds:7.3f} s  {note}".rstrip())
        lines.append(f"  {'total':<{width}}{total:7.3f} s  (after imports)")
        return "\n".join(lines)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


# ---------------------------------------------------------------------------------
# Training and the round trip.
# ---------------------------------------------------------------------------------


def _bit_exact(a: PyTree, b: PyTree) -> int:
    """The number of NumPy arrays in `a`, after checking that `b` has the same
    structure, the same arrays bit for bit, and the same other leaves."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        raise AssertionError("the reloaded model has another structure")
    count = 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if isinstance(x, np.ndarray):
            same = x.dtype == y.dtype and x.shape == y.shape
            if not (same and x.tobytes() == y.tobytes()):
                raise AssertionError("an array changed in the round trip")
            count += 1
        elif x is not y and x != y:
            raise AssertionError(f"a leaf changed in the round trip: {x!r} -> {y!r}")
    return count


def _same_shardings(a: PyTree, b: PyTree) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if isinstance(x, jax.Array) and not x.sharding.is_equivalent_to(
            y.sharding, x.ndim
        ):
            raise AssertionError(f"a sharding changed: {x.sharding} -> {y.sharding}")


# ---------------------------------------------------------------------------------
# The command.
# ---------------------------------------------------------------------------------


def train(
    model: Transformer,
    specs: PyTree,
    mesh: Mesh,
    steps: int,
    timer: Timer,
) -> Transformer:
    """A few SGD steps under `eqx.filter_jit`, with a progress bar on stderr."""
    config = model.config
    data_axes = tuple(a for a in _DATA_AXES if a in mesh.axis_names)
    batch_spec = P(data_axes or None)
    batch = eqshard.compat.round_up_to_multiple(8, axis_product(mesh, data_axes))
    tokens = np.random.default_rng(0).integers(
        0, config.vocab, (batch, config.seq + 1), dtype=np.int32
    )
    tokens = eqshard.shard(tokens, batch_spec, mesh)

    @eqx.filter_jit
    def train_step(
        model: Transformer, tokens: Int[Array, "batch seq"]
    ) -> tuple[Transformer, Float[Array, ""]]:
        tokens = eqshard.with_sharding_constraint(tokens, batch_spec)
        model = eqshard.with_sharding_constraint(model, specs)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
        model = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))
        return eqshard.with_sharding_constraint(model, specs), loss

    losses: list[float] = []
    times: list[float] = []
    sys.stdout.flush()  # before the progress bar, which is on stderr
    progress = Progress(steps, sys.stderr)
    with jax.set_mesh(mesh):
        for step in range(steps):
            (model, loss), seconds = timed(
                lambda: jax.block_until_ready(train_step(model, tokens))
            )
            losses.append(float(loss))
            times.append(seconds)
            progress.update(step + 1, f"loss {losses[-1]:.4f}  {seconds:.3f} s")
    progress.close()
    if steps:
        note = f"first {times[0]:.3f} s (compiling)"
        if steps > 1:
            note += f", then {sum(times[1:]) / (steps - 1):.4f} s/step"
        timer(f"train ({steps} steps)", sum(times), note)
        print(
            f"trained: {steps} steps of eqx.filter_jit with sharding constraints, "
            f"batch {batch} over {batch_spec}, loss {losses[0]:.4f} -> "
            f"{losses[-1]:.4f}"
        )
    step_report(train_step, model, tokens, mesh, timer)
    return model


def step_report(
    train_step: Any, model: Transformer, tokens: Any, mesh: Mesh, timer: Timer
) -> None:
    """Prints what the training step's compiled program holds and communicates,
    each collective named by the leaves it belongs to."""
    with jax.set_mesh(mesh):
        report, seconds = timed(lambda: eqshard.analyze_step(train_step, model, tokens))
    timer("step report", seconds, "eqshard.analyze_step: compiled, not run")
    print()
    print("the training step, compiled (eqshard.analyze_step):")
    print(report.table())


def round_trip(
    model: Transformer, specs: PyTree, mesh: Mesh, *, key: PRNGKeyArray, timer: Timer
) -> None:
    """Gathers the sharded `model`, serialises it, loads it into a skeleton,
    reshards it, and checks that nothing changed (bit for bit, same shardings)."""
    host, seconds = timed(lambda: eqshard.gather(model))
    timer("gather", seconds, "eqshard.gather: to NumPy, straight from the shards")
    with tempfile.TemporaryDirectory(prefix="eqshard-") as directory:
        path = os.path.join(directory, "model.eqx")
        _, seconds = timed(lambda: eqx.tree_serialise_leaves(path, host))
        nbytes = os.path.getsize(path)
        timer("serialise", seconds, f"eqx.tree_serialise_leaves, {nbytes:,} bytes")
        skeleton = eqx.filter_eval_shape(Transformer, model.config, key=key)
        loaded, seconds = timed(lambda: eqx.tree_deserialise_leaves(path, skeleton))
        timer("load", seconds, "into an eqx.filter_eval_shape skeleton")
    resharded, seconds = timed(
        lambda: jax.block_until_ready(eqshard.shard(loaded, specs, mesh))
    )
    timer("reshard", seconds, "eqshard.shard")
    print(f"round trip: gather -> serialise ({nbytes:,} bytes) -> load -> shard")

    def verify() -> int:
        count = _bit_exact(host, eqshard.gather(resharded))
        _same_shardings(model, resharded)
        return count

    count, seconds = timed(verify)
    timer("verify", seconds)
    print(
        f"verified: all {count} arrays bit-exact after the round trip, with the same "
        "shardings; the static field and the activation function unchanged"
    )
