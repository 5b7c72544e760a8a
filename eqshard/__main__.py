"""`python -m eqshard`: eqshard end to end on virtual CPU devices, and a planner.

With no arguments, on 8 virtual CPU devices: build a small Equinox transformer,
derive its specs from regex rules, print the sharding plan, shard the model, run a
few `eqx.filter_jit` training steps that constrain the model and the batch, gather
the model to host, serialise it, load and reshard it, check that nothing changed
(bit for bit), and print a summary with timings.

`--size 70B` plans an abstract model of about that many parameters instead (made
with `eqx.filter_eval_shape`, so nothing is allocated) and prints the plan only.
Run `python -m eqshard --help` for the options.
"""

import argparse
import dataclasses
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, TextIO

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

import eqshard

from ._fit import (
    data_axes,
    load_model,
    make_optimizer,
    OPTIMIZERS,
    propose_rules,
    rules_text,
)
from ._inspect import format_bytes
from ._plan import parse_bytes


_PROG = "python -m eqshard"

# The demo's own rules, in the `--rules FILE` format. They name the axes `dp`
# (data), `fsdp` (data, and the other dimension of the weights) and `tp` (tensor
# parallel); entries naming an axis the mesh lacks are dropped.
BUILTIN_RULES = """\
# regex                    spec
embed/weight               tp,fsdp
attn/(q|k|v)/weight        tp,fsdp
attn/(q|k|v)/bias          tp
attn/o/weight              fsdp,tp
mlp/up/weight              tp,fsdp
mlp/up/bias                tp
mlp/down/weight            fsdp,tp
head/weight                tp,fsdp
.*                         ()
"""

_DATA_AXES = ("dp", "fsdp")
_DEFAULT_NAMES = {
    1: ("dp",),
    2: ("dp", "tp"),
    3: ("dp", "fsdp", "tp"),
    4: ("dp", "fsdp", "tp", "sp"),
}
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_MIN_SIZE = 10**6


# ---------------------------------------------------------------------------------
# Options.
# ---------------------------------------------------------------------------------


class UsageError(Exception):
    """A bad option: reported as one line on stderr, with exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block: `--help` has the usage.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=_PROG,
        description=(
            "eqshard end to end on virtual CPU devices: build an Equinox "
            "transformer, derive its specs from regex rules, print the plan, shard, "
            "train a few steps under eqx.filter_jit, gather, serialise, reload, "
            "reshard, and check that nothing changed. With --size, plan an "
            "abstract model of that many parameters instead; with --model, plan "
            "your own model: parameters, gradients and optimizer state per "
            "device, against --device-memory (exit status 1 if it does not "
            "fit), and with --fit, rules that make it fit."
        ),
        epilog=(
            "Rules files have one rule a line, 'REGEX SPEC' or 'REGEX -> SPEC': the "
            "SPEC is the last field, mesh axis names or None separated by ',' "
            "(dp,tp  None,tp), "
            "'dp+fsdp' for one dimension over two axes, '()' for replicated. "
            "Lines starting with # are comments. The first matching rule wins."
        ),
    )
    parser.add_argument(
        "--mesh",
        metavar="SPEC",
        help=(
            "mesh axes as name:size pairs, e.g. 'dp:2,tp:4' or 'fsdp:-1' (-1 takes "
            "the remaining devices); 1 to 4 sizes alone name the axes dp / dp,tp / "
            "dp,fsdp,tp / dp,fsdp,tp,sp. Default: dp:2,tp:4 on 8 devices."
        ),
    )
    parser.add_argument(
        "--size",
        metavar="N",
        help=(
            "plan an abstract transformer of about N parameters (125M, 1B, 70B) "
            "instead of running the demo; implies --plan-only"
        ),
    )
    parser.add_argument(
        "--model",
        metavar="MODULE:CALLABLE",
        help=(
            "plan your own model: CALLABLE() returns it (an Equinox module or any "
            "pytree, or an abstract one); it is called under eqx.filter_eval_shape, "
            "so nothing is allocated. MODULE is a module name (mypkg.models) or a "
            "file (models.py). Implies --plan-only; the default rules replicate "
            "everything"
        ),
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help=(
            "the optax optimizer whose state the plan counts, with the gradients "
            "(default adamw; sgd has no state; none plans the parameters alone)"
        ),
    )
    parser.add_argument(
        "--param-dtype",
        metavar="DTYPE",
        help=(
            "dtype of the floating-point parameters and their gradients: float32, "
            "bfloat16 or float16 (default: the model's own)"
        ),
    )
    parser.add_argument(
        "--state-dtype",
        metavar="DTYPE",
        help=(
            "dtype of the optimizer state's floating-point arrays, e.g. float32 "
            "moments with --param-dtype bfloat16 (default: what optax makes)"
        ),
    )
    parser.add_argument(
        "--device-memory",
        metavar="BYTES",
        help=(
            "memory of one device, e.g. 80GiB, 16GB: the plan says whether it fits "
            "and the exit status is 1 if it does not"
        ),
    )
    parser.add_argument(
        "--fit",
        action="store_true",
        help=(
            "propose rules that fit --device-memory: the --rules given (or "
            "replicated) plus automatic FSDP over the mesh's data axes (dp, fsdp); "
            "print them and their plan"
        ),
    )
    parser.add_argument(
        "--save-rules",
        metavar="FILE",
        help="with --fit, also write the proposed rules to FILE (a --rules file)",
    )
    parser.add_argument(
        "--table",
        action="store_true",
        help="with --model, also print the plan's table of every array",
    )
    parser.add_argument(
        "--rules",
        metavar="FILE",
        help="partition rules, one 'REGEX SPEC' a line (default: the built-in ones)",
    )
    parser.add_argument(
        "--plan-only", action="store_true", help="print the plan, move nothing"
    )
    parser.add_argument(
        "--steps", type=int, default=5, metavar="N", help="training steps (5)"
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=8,
        metavar="N",
        help="number of virtual CPU devices (8)",
    )
    return parser


def parse_size(text: str) -> int:
    """A parameter count such as `125M`, `1.5B` or `70B`."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMBGT]?)\s*", text, re.I)
    if match is None:
        raise UsageError(
            f"--size {text!r} is not a parameter count; write a number with an "
            "optional K, M, B or T suffix, e.g. 125M, 1B, 70B"
        )
    size = round(float(match[1]) * _UNITS[match[2].upper()])
    if size < _MIN_SIZE:
        raise UsageError(
            f"--size {text!r} is below the planner's minimum of 1M parameters; "
            "smaller models run for real without --size"
        )
    return size


def _rules_error(path: str, number: int, line: str, problem: str) -> UsageError:
    return UsageError(f"--rules {path}, line {number}: {problem}: {line.strip()!r}")


def _parse_spec(text: str) -> P:
    """A spec such as `dp,tp`, `None,tp`, `dp+fsdp,tp` or `()`."""
    if text in ("()", "P()"):
        return P()
    entries: list[str | tuple[str, ...] | None] = []
    for entry in text.split(","):
        if entry == "None":
            entries.append(None)
            continue
        names = entry.split("+")
        if not all(name.isidentifier() for name in names):
            where = "" if entry == text else f" in the spec {text!r}"
            raise ValueError(
                f"{entry!r}{where} is not a mesh axis name, None, or axis names "
                "joined by '+' (a spec is entries separated by ',' without spaces, "
                "e.g. dp,tp or None,tp; '()' replicates)"
            )
        entries.append(names[0] if len(names) == 1 else tuple(names))
    return P(*entries)


def parse_rules(text: str, path: str) -> list[tuple[str, P]]:
    """The rules of a rules file: one `REGEX SPEC` (or `REGEX -> SPEC`) a line,
    `#` comment lines."""
    rules = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        fields = stripped.split()
        if len(fields) < 2:
            raise _rules_error(
                path, number, line, "expected a regex, then a spec such as dp,tp"
            )
        # `REGEX -> SPEC` reads as well: without this, the arrow would silently
        # become part of a regex that matches nothing.
        regex = stripped[: -len(fields[-1])].strip().removesuffix("->").rstrip()
        if not regex:
            raise _rules_error(path, number, line, "expected a regex before the spec")
        try:
            re.compile(regex)
        except re.error as error:
            raise _rules_error(
                path, number, line, f"invalid regex {regex!r} ({error})"
            ) from None
        try:
            spec = _parse_spec(fields[-1])
        except ValueError as error:
            raise _rules_error(path, number, line, str(error)) from None
        rules.append((regex, spec))
    if not rules:
        raise UsageError(f"--rules {path}: the file has no rules")
    return rules


def _read_rules(path: str) -> list[tuple[str, P]]:
    try:
        with open(path) as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise UsageError(f"--rules {path}: cannot read the file ({reason})") from None
    return parse_rules(text, path)


def _default_mesh_string(devices: int) -> str:
    tp = next(size for size in (4, 2, 1) if devices % size == 0)
    return f"dp:{devices // tp},tp:{tp}"


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def build_mesh(text: str) -> Mesh:
    """A mesh from `--mesh`, through `eqshard.get_jax_mesh`."""
    body = text.strip().removeprefix("!")
    if ":" in body:
        names = tuple(token.split(":")[0].strip() for token in body.split(","))
    else:
        names = _DEFAULT_NAMES.get(len(body.split(",")), ())
        if not names:
            raise UsageError(
                f"--mesh {text!r}: give at most 4 sizes without names, or name the "
                "axes, e.g. dp:2,tp:4"
            )
    try:
        return eqshard.get_jax_mesh(text, names)
    except (ValueError, TypeError) as error:
        raise UsageError(f"--mesh {text!r}: {_one_line(error)}") from None


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


def _axis_product(mesh: Mesh, axes: Sequence[str]) -> int:
    return math.prod(mesh.shape[a] for a in axes if a in mesh.shape)


def demo_config(mesh: Mesh) -> Config:
    """The demo's small model, sized so that its dimensions divide the mesh."""
    unit = math.lcm(_axis_product(mesh, ("tp",)), _axis_product(mesh, ("fsdp",)))
    heads = eqshard.round_up_to_multiple(4, unit)
    vocab = eqshard.round_up_to_multiple(256, unit)
    return Config(vocab=vocab, dim=16 * heads, heads=heads, layers=2)


def config_for_size(target: int, mesh: Mesh) -> Config:
    """A transformer config with about `target` parameters (and a width of about
    100 per layer, like GPT-3 and LLaMA), whose dimensions divide the mesh."""
    unit = 64 * math.lcm(_axis_product(mesh, ("tp",)), _axis_product(mesh, ("fsdp",)))
    vocab = eqshard.round_up_to_multiple(32000 if target >= 5 * 10**7 else 1024, unit)

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
        (regex, eqshard.restrict_specs(spec, mesh, on_change="ignore"))
        for regex, spec in parse_rules(BUILTIN_RULES, "<built-in>")
    ]


def _match(rules: list[tuple[str, P]], tree: PyTree, origin: str) -> PyTree:
    try:
        return eqshard.match_partition_rules(rules, tree)
    except (ValueError, TypeError) as error:
        lines = str(error).splitlines()
        hint = ""
        if "no rule matches" in str(error):
            hint = " (a last rule '.*  ()' replicates the rest)"
        summary = " ".join(line.strip() for line in lines[:2])
        raise UsageError(f"{origin}: {summary}{hint}") from None


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


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _check_plan(report: eqshard.ShardingReport) -> None:
    if report.problems:
        first = report.problems[0]
        count = len(report.problems)
        raise UsageError(
            f"{count} {'array has a spec' if count == 1 else 'arrays have specs'} "
            f"that cannot apply on mesh "
            f"{report.mesh_shape} (listed under the plan), e.g. '{first.path}' "
            f"{first.spec}: {first.reasons[0]}; fix the rules or the mesh"
        )


def show_plan(
    tree: PyTree,
    config: Config,
    mesh: Mesh,
    rules: list[tuple[str, P]],
    origin: str,
    timer: Timer,
) -> PyTree:
    """Matches the rules, prints the plan of `tree` (concrete or abstract), and
    returns the specs. A plan that cannot apply is a usage error."""
    specs, seconds = _timed(lambda: _match(rules, tree, origin))
    timer("match rules", seconds, f"{len(rules)} rules ({origin})")
    report, seconds = _timed(
        lambda: eqshard.analyze_sharding_strategy(tree, specs, mesh)
    )
    timer("plan", seconds, "analyze_sharding_strategy")
    print(report.table())
    print()
    print(
        f"model: {config.layers} blocks, dim {config.dim}, {config.heads} heads, "
        f"vocab {config.vocab}: {report.total_parameters:,} parameters in "
        f"{len(report.rows)} arrays"
    )
    print(
        f"plan: at most {format_bytes(report.max_bytes_per_device)} per device "
        f"(balance {report.balance_score:.2f}) over the "
        f"{len(report.bytes_per_device)} devices of mesh {report.mesh_shape}"
    )
    _note_dead_rules(rules, tree)
    _check_plan(report)
    return specs


def _note_dead_rules(rules: list[tuple[str, P]], tree: PyTree) -> None:
    dead = eqshard.explain_partition_rules(rules, tree).dead_rules
    if dead:
        listed = ", ".join(f"{i} {rules[i][0]!r}" for i in dead)
        print(
            f"note: {len(dead)} of the {len(rules)} rules matched no array (a typo, "
            f"or shadowed by an earlier rule): {listed}"
        )


# ---------------------------------------------------------------------------------
# Training-memory plans (--size, --model, --plan-only) and --fit.
# ---------------------------------------------------------------------------------


_DTYPES = {
    "float32": jnp.float32,
    "f32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float16": jnp.float16,
    "f16": jnp.float16,
    "fp16": jnp.float16,
}
# The rules of --model when no --rules are given: everything replicated.
_REPLICATED = [(".*", P())]


def _dtype(option: str, text: str | None) -> Any:
    if text is None:
        return None
    try:
        return _DTYPES[text.lower()]
    except KeyError:
        raise UsageError(
            f"{option} {text!r}: choose float32, bfloat16 or float16"
        ) from None


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """The options of a training-memory plan, checked."""

    optimizer: Any
    optimizer_name: str
    param_dtype: Any
    state_dtype: Any
    device_memory: int | None
    fit: bool
    save_rules: str | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "PlanOptions":
        memory = None
        if args.device_memory is not None:
            try:
                memory = parse_bytes(args.device_memory)
            except ValueError:
                raise UsageError(
                    f"--device-memory {args.device_memory!r}: write an amount of "
                    "memory such as 80GiB, 16GB or 512MiB"
                ) from None
        if args.fit and memory is None:
            raise UsageError("--fit needs --device-memory, the budget to fit in")
        if args.save_rules is not None and not args.fit:
            raise UsageError("--save-rules writes the rules that --fit proposes")
        try:
            optimizer = make_optimizer(args.optimizer)
        except ValueError as error:
            raise UsageError(str(error)) from None
        return cls(
            optimizer=optimizer,
            optimizer_name=args.optimizer,
            param_dtype=_dtype("--param-dtype", args.param_dtype),
            state_dtype=_dtype("--state-dtype", args.state_dtype),
            device_memory=memory,
            fit=args.fit,
            save_rules=args.save_rules,
        )


def _plan_for(
    shapes: PyTree, mesh: Mesh, options: PlanOptions
) -> Callable[[PyTree], eqshard.TrainingPlan]:
    def plan(specs: PyTree) -> eqshard.TrainingPlan:
        return eqshard.plan_training(
            shapes,
            specs,
            mesh,
            optimizer=options.optimizer,
            param_dtype=options.param_dtype,
            state_dtype=options.state_dtype,
            device_memory=options.device_memory,
        )

    return plan


def _print_plan(plan: eqshard.TrainingPlan) -> None:
    if sys.stdout.isatty():
        sys.stdout.flush()
        plan.show()  # with rich, if installed
    else:
        print(plan.table())


def training_memory(
    shapes: PyTree,
    specs: PyTree,
    mesh: Mesh,
    rules: list[tuple[str, P]],
    origin: str,
    options: PlanOptions,
    timer: Timer,
) -> int:
    """Prints the training-memory plan of `specs`, or with --fit the rules
    proposed and their plan; returns the exit status (1 if it does not fit)."""
    what = "parameters and gradients"
    if options.optimizer is not None:
        what += f", {options.optimizer_name} state"
    plan_for = _plan_for(shapes, mesh, options)
    print()
    if not options.fit:
        plan, seconds = _timed(lambda: plan_for(specs))
        timer("training plan", seconds, what)
        _print_plan(plan)
        return 0 if plan.fits else 1
    try:
        (specs, plan, min_size), seconds = _timed(
            lambda: propose_rules(shapes, rules, mesh, plan_for)
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    timer("fit", seconds, f"rules + auto_fsdp, {what}")
    axes = ", ".join(data_axes(mesh))
    header = [
        f"proposed by `{_PROG} --fit` for mesh {dict(mesh.shape)} and "
        f"{format_bytes(options.device_memory or 0)} per device:",
        f"from {origin}, plus FSDP over {axes} for arrays of at least "
        f"{min_size:,} elements (eqshard.auto_fsdp).",
    ]
    text = rules_text(shapes, specs, header=header)
    if plan.fits:
        print("rules that fit (a --rules file):")
    else:
        print(
            "no rules fit: even with FSDP over the data axes on every array, the "
            "plan below is over budget. Use more devices, a larger data axis, or "
            "a smaller --param-dtype / --state-dtype. The closest rules:"
        )
    print(text)
    if options.save_rules is not None:
        try:
            with open(options.save_rules, "w") as file:
                file.write(text)
        except OSError as error:
            raise UsageError(
                f"--save-rules {options.save_rules}: cannot write the file "
                f"({error.strerror or error})"
            ) from None
        print(f"saved to {options.save_rules}")
        print()
    _print_plan(plan)
    return 0 if plan.fits else 1


def run_model(
    args: argparse.Namespace,
    mesh: Mesh,
    rules: list[tuple[str, P]],
    origin: str,
    options: PlanOptions,
    timer: Timer,
) -> int:
    """Plans the user's own model (`--model`); returns the exit status."""
    try:
        shapes, load_seconds = _timed(lambda: load_model(args.model))
    except ValueError as error:
        raise UsageError(str(error)) from None
    timer("load model", load_seconds, "eqx.filter_eval_shape")
    specs, seconds = _timed(lambda: _match(rules, shapes, origin))
    timer("match rules", seconds, f"{len(rules)} rules ({origin})")
    report = eqshard.analyze_sharding_strategy(shapes, specs, mesh)
    if args.table:
        print(report.table())
        print()
    print(
        f"model {args.model}: {report.total_parameters:,} parameters in "
        f"{len(report.rows)} arrays, made abstractly with eqx.filter_eval_shape in "
        f"{load_seconds:.2f} s"
    )
    print(f"rules: {origin}")
    _note_dead_rules(rules, shapes)
    _check_plan(report)
    return training_memory(shapes, specs, mesh, rules, origin, options, timer)


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


def _train(
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
    batch = eqshard.round_up_to_multiple(8, _axis_product(mesh, data_axes))
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
            (model, loss), seconds = _timed(
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
    return model


def run(
    args: argparse.Namespace,
    size: int | None,
    mesh: Mesh,
    rules: list[tuple[str, P]],
    origin: str,
    start: float,
) -> int:
    """Plans (`--size`, `--model`, `--plan-only`), or runs the whole demo; returns
    the exit status."""
    timer = Timer()
    # --model, --size, --fit and --device-memory plan; they imply --plan-only.
    planning = args.plan_only or size is not None or args.model is not None
    planning = planning or args.fit or args.device_memory is not None
    options = PlanOptions.from_args(args) if planning else None
    platform = jax.default_backend()
    kind = "virtual CPU" if platform == "cpu" else platform
    print(
        f"eqshard {eqshard.__version__} on {jax.device_count()} {kind} devices, "
        f"mesh {dict(mesh.shape)}"
    )
    if options is not None and args.model is not None:
        return run_model(args, mesh, rules, origin, options, timer)
    key = jax.random.key(0)
    config = demo_config(mesh) if size is None else config_for_size(size, mesh)
    if options is not None:
        shapes, seconds = _timed(
            lambda: eqx.filter_eval_shape(Transformer, config, key=key)
        )
        print(f"abstract model built with eqx.filter_eval_shape in {seconds:.2f} s")
        print()
        specs = show_plan(shapes, config, mesh, rules, origin, timer)
        return training_memory(shapes, specs, mesh, rules, origin, options, timer)

    model, seconds = _timed(lambda: jax.block_until_ready(Transformer(config, key=key)))
    timer("build model", seconds, "eager init")
    print()
    specs = show_plan(model, config, mesh, rules, origin, timer)
    print()

    model, seconds = _timed(
        lambda: jax.block_until_ready(eqshard.shard(model, specs, mesh))
    )
    timer("shard", seconds, "eqshard.shard: one batched device_put")
    print(f"sharded: {len(jax.tree.leaves(specs))} arrays in {seconds:.3f} s")

    model = _train(model, specs, mesh, args.steps, timer)

    host, seconds = _timed(lambda: eqshard.gather(model))
    timer("gather", seconds, "eqshard.gather: to NumPy, straight from the shards")
    with tempfile.TemporaryDirectory(prefix="eqshard-") as directory:
        path = os.path.join(directory, "model.eqx")
        _, seconds = _timed(lambda: eqx.tree_serialise_leaves(path, host))
        nbytes = os.path.getsize(path)
        timer("serialise", seconds, f"eqx.tree_serialise_leaves, {nbytes:,} bytes")
        skeleton = eqx.filter_eval_shape(Transformer, config, key=key)
        loaded, seconds = _timed(lambda: eqx.tree_deserialise_leaves(path, skeleton))
        timer("load", seconds, "into an eqx.filter_eval_shape skeleton")
    resharded, seconds = _timed(
        lambda: jax.block_until_ready(eqshard.shard(loaded, specs, mesh))
    )
    timer("reshard", seconds, "eqshard.shard")
    print(f"round trip: gather -> serialise ({nbytes:,} bytes) -> load -> shard")

    def verify() -> int:
        count = _bit_exact(host, eqshard.gather(resharded))
        _same_shardings(model, resharded)
        return count

    count, seconds = _timed(verify)
    timer("verify", seconds)
    print(
        f"verified: all {count} arrays bit-exact after the round trip, with the same "
        "shardings; the static field and the activation function unchanged"
    )
    print()
    print(timer.summary(time.perf_counter() - start))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; returns the exit code (2 for a bad option)."""
    start = time.perf_counter()
    args = _parser().parse_args(argv)
    try:
        if args.steps < 0:
            raise UsageError(f"--steps {args.steps}: give 0 or more steps")
        if args.devices < 1:
            raise UsageError(f"--devices {args.devices}: give at least 1 device")
        size = None if args.size is None else parse_size(args.size)
        if args.model is not None and args.size is not None:
            raise UsageError(
                "--model plans your model, --size the built-in one: give one"
            )
        if args.rules is None:
            user_rules, origin = None, "built-in"
        else:
            user_rules, origin = _read_rules(args.rules), f"--rules {args.rules}"
        # Before any JAX computation: the platform and the number of devices.
        if "JAX_PLATFORMS" not in os.environ:
            jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
        # An empty --mesh is an error, not the default.
        if args.mesh is None:
            mesh = build_mesh(_default_mesh_string(jax.device_count()))
        else:
            mesh = build_mesh(args.mesh)
        if user_rules is not None:
            rules = user_rules
        elif args.model is not None:
            rules, origin = _REPLICATED, "the default rule '.* ()' (all replicated)"
        else:
            rules = builtin_rules(mesh)
        status = run(args, size, mesh, rules, origin, start)
    except UsageError as error:
        sys.stdout.flush()
        print(f"{_PROG}: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`python -m eqshard --size 70B | head`): stop
        # quietly, and keep Python from failing again when it flushes stdout.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
