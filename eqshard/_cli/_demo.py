"""The demo of `python -m eqshard`: a small Equinox transformer, its built-in rules,
the size solver of `--size`, and the model's life as the README shows it: built
with its optimizer state by `init_sharded`, trained by `filter_jit`, checked by
`check_layout`, saved by `save` and restored onto another mesh by `restore`,
checked bit for bit; with the progress bar and the phase timer that the
command's summary prints (compile times said as such).

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
# The model's life: built, trained, checked, saved and restored.
# ---------------------------------------------------------------------------------


def make_state(config: Config, key: PRNGKeyArray) -> tuple[Transformer, PyTree]:
    """The model and its optimizer state (SGD's momentum, one array per
    floating-point parameter), built together as `init_sharded` builds them."""
    model = Transformer(config, key=key)
    momentum = jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_inexact_array))
    return model, {"momentum": momentum}


def build(config: Config, specs: PyTree, mesh: Mesh, timer: Timer) -> PyTree:
    """The state built straight into its shardings by `eqshard.init_sharded`,
    timed twice: the first call compiles the constructor, the second only runs
    it."""
    key = jax.random.key(0)

    def made() -> PyTree:
        return jax.block_until_ready(
            eqshard.init_sharded(make_state, config, key, specs=specs, mesh=mesh)
        )

    _, first = timed(made)
    state, running = timed(made)  # the program is kept: this only runs it
    compiling = max(first - running, 0.0)
    timer(
        "build model",
        first,
        f"eqshard.init_sharded: compiling the constructor {compiling:.3f} s, "
        f"then each device makes its shards in {running:.3f} s",
    )
    arrays = len(jax.tree.leaves(eqx.filter(state, eqx.is_array)))
    print(
        f"built sharded with eqshard.init_sharded: {arrays} arrays (model and "
        f"momentum) in {first:.3f} s, of which {compiling:.3f} s compiling"
    )
    return state


def _bit_exact(a: PyTree, b: PyTree) -> int:
    """The number of NumPy arrays in `a`, after checking that `b` has the same
    structure, the same arrays bit for bit, and the same other leaves."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        raise AssertionError("the restored state has another structure")
    count = 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if isinstance(x, np.ndarray):
            same = x.dtype == y.dtype and x.shape == y.shape
            if not (same and x.tobytes() == y.tobytes()):
                raise AssertionError("an array changed in the checkpoint")
            count += 1
        elif x is not y and x != y:
            raise AssertionError(f"a leaf changed in the checkpoint: {x!r} -> {y!r}")
    return count


def train_step(
    tokens: Int[Array, "batch seq"], state: tuple[Transformer, PyTree]
) -> tuple[tuple[Transformer, PyTree], Float[Array, ""]]:
    """One SGD step with momentum: the step as the user writes it, with no
    sharding in it."""
    model, opt_state = state
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
    momentum = jax.tree.map(lambda m, g: 0.9 * m + g, opt_state["momentum"], grads)
    model = eqx.apply_updates(model, jax.tree.map(lambda m: -0.05 * m, momentum))
    return (model, {"momentum": momentum}), loss


def train(state: PyTree, specs: PyTree, mesh: Mesh, steps: int, timer: Timer) -> PyTree:
    """A few steps of `eqshard.filter_jit`, which keeps the state in its layout
    (donated: updated in place), with a progress bar on stderr; then the layout
    checked and the compiled step's report."""
    config = state[0].config
    data_axes = tuple(a for a in _DATA_AXES if a in mesh.axis_names)
    batch_spec = P(data_axes or None)
    batch = eqshard.compat.round_up_to_multiple(8, axis_product(mesh, data_axes))
    tokens = np.random.default_rng(0).integers(
        0, config.vocab, (batch, config.seq + 1), dtype=np.int32
    )
    tokens = eqshard.shard(tokens, batch_spec, mesh)
    step_fn = eqshard.filter_jit(
        train_step,
        in_specs=(batch_spec, specs),
        out_specs=(1, P()),  # the state as it came in, the loss replicated
        donate="all-except-first",
        mesh=mesh,
    )
    losses: list[float] = []
    times: list[float] = []
    sys.stdout.flush()  # before the progress bar, which is on stderr
    progress = Progress(steps, sys.stderr)
    for step in range(steps):
        (state, loss), seconds = timed(
            lambda: jax.block_until_ready(step_fn(tokens, state))
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
            f"trained: {steps} steps of eqshard.filter_jit (batch {batch} over "
            f"{batch_spec}, the state donated and kept in its layout), loss "
            f"{losses[0]:.4f} -> {losses[-1]:.4f}"
        )
    report, seconds = timed(lambda: eqshard.check_layout(state, specs, mesh))
    timer("check layout", seconds, "eqshard.check_layout: nothing moved")
    print(f"checked with eqshard.check_layout: all {report.checked} arrays as asked")
    step_report(step_fn, tokens, state, timer)
    return state


def step_report(train_step: Any, tokens: Any, state: PyTree, timer: Timer) -> None:
    """Prints what the training step's compiled program holds and communicates,
    each collective named by the leaves it belongs to."""
    report, seconds = timed(lambda: eqshard.analyze_step(train_step, tokens, state))
    timer("step report", seconds, "eqshard.analyze_step: compiled, not run")
    print()
    print("the training step, compiled (eqshard.analyze_step):")
    print(report.table(top=8))
    print()  # the checkpoint's lines are not the report's


def other_mesh(mesh: Mesh, shapes: PyTree, specs: PyTree) -> Mesh:
    """Another mesh for the restore: the axis sizes in reverse order where every
    spec applies on it, else the same sizes over the devices in reverse order."""
    names, sizes = tuple(mesh.axis_names), tuple(mesh.devices.shape)
    devices = list(mesh.devices.flat)[::-1]
    reversed_sizes = eqshard.create_mesh(sizes[::-1], names, devices=devices)
    if not eqshard.analyze_sharding_strategy(shapes, specs, reversed_sizes).problems:
        return reversed_sizes
    return eqshard.create_mesh(sizes, names, devices=devices)


def checkpoint(
    state: PyTree, specs: PyTree, mesh: Mesh, *, config: Config, timer: Timer
) -> None:
    """Saves the state with `eqshard.save`, restores it onto another mesh with
    `eqshard.restore`, and checks that nothing changed (bit for bit, laid out
    as asked there)."""
    key = jax.random.key(0)
    like = eqx.filter_eval_shape(make_state, config, key)
    other = other_mesh(mesh, like, specs)
    with tempfile.TemporaryDirectory(prefix="eqshard-") as directory:
        path = os.path.join(directory, "step_5")
        try:
            _, seconds = timed(lambda: eqshard.save(path, state))
        except ImportError as error:
            print(f"checkpoint: skipped ({error})")
            return
        timer("save", seconds, "eqshard.save: each device writes its shards")
        restored, seconds = timed(
            lambda: jax.block_until_ready(eqshard.restore(path, like, specs, other))
        )
        timer("restore", seconds, f"eqshard.restore onto {mesh_text(other)}")
    print(
        f"checkpoint: eqshard.save, then eqshard.restore onto mesh {mesh_text(other)}"
    )

    def verify() -> int:
        count = _bit_exact(eqshard.gather(state), eqshard.gather(restored))
        eqshard.check_layout(restored, specs, other)
        return count

    count, seconds = timed(verify)
    timer("verify", seconds)
    print(
        f"verified: all {count} arrays bit-exact after the restore, laid out as "
        "asked on the other mesh; the static field and the activation function "
        "unchanged"
    )


def mesh_text(mesh: Mesh) -> str:
    return str(dict(mesh.shape))
