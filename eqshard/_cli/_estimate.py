"""The command's answer to the pod question: `python -m eqshard --size 70B
--target v5p-1024 --batch 256 --seq 4096` compiles the training step of a
built-in decoder transformer of about that size (its layers stacked and
scanned, rematerialised, AdamW in f32, bf16 compute, FSDP over `fsdp` x
tensor parallelism over `tp`) for the target, with `eqshard.analyze_step`, and
prints the compiled peak per device against the chip's memory, the step's
estimated seconds, tokens per second, MFU (`transformer_flops`) and the
largest collectives. Without `--mesh` the mesh is `fsdp` over as many devices
as divide the batch and `tp` over the rest.
"""

import argparse
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqshard

from .._mesh._current import mesh_repr
from .._report import format_bytes
from .._spectree._derive import restrict_specs
from ._demo import timed
from ._load import UsageError


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder transformer's shape: `12 * dim**2` parameters a layer (4
    attention matrices and a 4x MLP), embedding and head untied."""

    vocab: int
    dim: int
    layers: int

    @property
    def hidden(self) -> int:
        return 4 * self.dim

    @property
    def heads(self) -> int:
        return self.dim // 128

    @property
    def parameters(self) -> int:
        d = self.dim
        return self.layers * (12 * d * d + 2 * d) + 2 * self.vocab * d + d


def shape_for_size(size: int) -> Shape:
    """About `size` parameters, about 100 of width per layer (as GPT-3 and
    LLaMA), the width a multiple of 1024."""
    vocab = 32768 if size >= 10**9 else 4096

    def made(layers: int) -> Shape:
        root = math.sqrt(max(size - 2 * vocab * 1024, 1) / (12 * layers))
        dim = max(1024, round(root / 1024) * 1024)
        return Shape(vocab, dim, layers)

    shapes = [made(layers) for layers in range(2, 161, 2)]
    return min(
        shapes,
        key=lambda s: (
            abs(s.parameters - size) / size
            + 0.02 * abs(math.log(s.dim / s.layers / 100))
        ),
    )


def add_estimate_options(parser: argparse.ArgumentParser) -> None:
    """`--batch` and `--seq`."""
    parser.add_argument(
        "--batch",
        type=int,
        metavar="N",
        help=(
            "with --size and --target, compile the built-in model's training step "
            "for N sequences of --seq tokens and print its estimated seconds, "
            "tokens per second and MFU on the target"
        ),
    )
    parser.add_argument(
        "--seq", type=int, metavar="N", help="with --batch, the sequence length"
    )


def check_estimate_options(args: argparse.Namespace) -> None:
    """`--batch` and `--seq` come together, with `--size` and `--target`."""
    if args.batch is None and args.seq is None:
        return
    if args.batch is None or args.seq is None:
        raise UsageError("--batch and --seq go together: give both")
    if args.size is None or args.target is None:
        raise UsageError(
            "--batch and --seq time the built-in model's step on a target: give "
            "--size and --target too, e.g. --size 70B --target v5p-1024"
        )
    if args.batch < 1 or args.seq < 2:
        raise UsageError(
            f"--batch {args.batch} --seq {args.seq}: give at least 1 sequence of "
            "at least 2 tokens"
        )


def estimate_mesh(args: argparse.Namespace, devices: int) -> str:
    """`--mesh`, or `fsdp` over the devices that divide the batch and `tp`
    over the rest."""
    if args.mesh is not None:
        return args.mesh
    fsdp = math.gcd(args.batch, devices)
    tp = devices // fsdp
    if tp > 16:
        raise UsageError(
            f"--batch {args.batch} splits over at most {fsdp} of the "
            f"{devices} devices, leaving {tp}-way tensor parallelism: give a "
            "larger --batch, or a --mesh"
        )
    return f"fsdp:{fsdp},tp:{tp}" if tp > 1 else f"fsdp:{fsdp}"


def _spec(mesh: Mesh, *axes: Any) -> NamedSharding:
    spec = restrict_specs(P(*axes), mesh, on_invalid="ignore")
    return NamedSharding(mesh, spec)


def abstract_state(shape: Shape, mesh: Mesh) -> tuple[Any, Any]:
    """The parameters (f32) and AdamW's state, abstract, laid out."""
    L, D, F, V = shape.layers, shape.dim, shape.hidden, shape.vocab

    def array(dims: tuple[int, ...], *axes: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(dims, jnp.float32, sharding=_spec(mesh, *axes))

    wide, narrow = (None, "fsdp", "tp"), (None, "tp", "fsdp")
    params = {
        "embed": array((V, D), "tp", "fsdp"),
        "blocks": {
            "attn": {
                "q": array((L, D, D), *wide),
                "k": array((L, D, D), *wide),
                "v": array((L, D, D), *wide),
                "o": array((L, D, D), *narrow),
            },
            "mlp": {"up": array((L, D, F), *wide), "down": array((L, F, D), *narrow)},
            "norm1": array((L, D), None, None),
            "norm2": array((L, D), None, None),
        },
        "norm": array((D,), None),
        "head": array((D, V), "fsdp", "tp"),
    }
    count = jax.ShapeDtypeStruct((), jnp.int32, sharding=_spec(mesh))
    return params, {"mu": params, "nu": params, "count": count}


def _norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
    return (x32 * scale).astype(jnp.bfloat16)


def _layer(heads: int, batch: NamedSharding) -> Any:
    def layer(x: jax.Array, w: Any) -> tuple[jax.Array, None]:
        # The batch stays split over `fsdp`: the weights are gathered (FSDP).
        x = jax.lax.with_sharding_constraint(x, batch)
        bf = {k: v.astype(jnp.bfloat16) for k, v in w["attn"].items()}
        b, s, d = x.shape
        h = _norm(x, w["norm1"])
        q, k, v = ((h @ bf[n]).reshape(b, s, heads, -1) for n in "qkv")
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        scores = scores / math.sqrt(d // heads)
        causal = jnp.tril(jnp.ones((s, s), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), -1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(jnp.bfloat16), v)
        x = x + out.reshape(b, s, d) @ bf["o"]
        h = _norm(x, w["norm2"])
        up = jax.nn.gelu(h @ w["mlp"]["up"].astype(jnp.bfloat16))
        return x + up @ w["mlp"]["down"].astype(jnp.bfloat16), None

    return jax.checkpoint(layer)


def train_step(shape: Shape, mesh: Mesh) -> Any:
    """One AdamW step of the model on `tokens` of `(batch, seq + 1)`."""

    def loss(params: Any, tokens: jax.Array) -> jax.Array:
        x = params["embed"].astype(jnp.bfloat16)[tokens[:, :-1]]
        batch = _spec(mesh, "fsdp", None, None)
        x, _ = jax.lax.scan(_layer(shape.heads, batch), x, params["blocks"])
        logits = (
            _norm(x, params["norm"]) @ params["head"].astype(jnp.bfloat16)
        ).astype(jnp.float32)
        gold = jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - gold)

    def step(params: Any, state: Any, tokens: jax.Array) -> Any:
        value, grads = jax.value_and_grad(loss)(params, tokens)
        count = state["count"] + 1
        mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["mu"], grads)
        nu = jax.tree.map(lambda n, g: 0.999 * n + 0.001 * g * g, state["nu"], grads)
        c = count.astype(jnp.float32)

        def update(p: jax.Array, m: jax.Array, n: jax.Array) -> jax.Array:
            m_hat, n_hat = m / (1 - 0.9**c), n / (1 - 0.999**c)
            return p - 1e-4 * (m_hat / (jnp.sqrt(n_hat) + 1e-8) + 0.1 * p)

        params = jax.tree.map(update, params, mu, nu)
        return params, {"mu": mu, "nu": nu, "count": count}, value

    return jax.jit(step, donate_argnums=(0, 1))


def _count(n: int) -> str:
    return f"{n / 1e9:.1f} B" if n >= 10**9 else f"{n / 1e6:.0f} M"


def run_estimate(args: argparse.Namespace, size: int, mesh: Mesh) -> int:
    """Compiles the built-in model's step for the target and prints its time."""
    shape = shape_for_size(size)
    if args.mesh is None:  # the batch decides the mesh
        try:
            mesh = eqshard.create_mesh(
                estimate_mesh(args, mesh.devices.size),
                target=args.target,
                num_slices=args.num_slices,
            )
        except ValueError as error:
            raise UsageError(f"--target {args.target}: {error}") from None
        print(f"mesh for --batch {args.batch}: {mesh_repr(mesh)}")
    print(
        f"model: {_count(shape.parameters)} parameters ({shape.layers} layers "
        f"scanned and rematerialised, width {shape.dim}, {shape.heads} heads, MLP "
        f"{shape.hidden}, vocabulary {shape.vocab}), AdamW, bf16 compute; batch "
        f"{args.batch} x seq {args.seq}"
    )
    params, state = abstract_state(shape, mesh)
    tokens = jax.ShapeDtypeStruct(
        (args.batch, args.seq + 1), jnp.int32, sharding=_spec(mesh, "fsdp")
    )
    report, seconds = timed(
        lambda: eqshard.analyze_step(train_step(shape, mesh), params, state, tokens)
    )
    versions = ", ".join(f"{k} {v}" for k, v in report.versions)
    print(f"compiled for --target {args.target} ({versions}) in {seconds:.1f} s")
    return show_estimate(args, report, shape)


def show_estimate(args: argparse.Namespace, report: Any, shape: Shape) -> int:
    """The peak, the time and the top collectives; exit 1 when it does not fit."""
    m = report.memory
    budget = m.device_memory
    fits = budget is None or m.fits()
    verdict = (
        ""
        if budget is None
        else f" of {format_bytes(budget)}: " + ("fits" if fits else "DOES NOT FIT")
    )
    print(f"peak per device {format_bytes(m.peak_bytes)}{verdict}")
    time = report.time
    if time is None:
        print(f"no time estimate: {report.time_note}")
    else:
        tokens = args.batch * args.seq
        flops = eqshard.transformer_flops(
            params=shape.parameters,
            tokens=tokens,
            layers=shape.layers,
            seq=args.seq,
            dim=shape.dim,
        )
        print(time.summary())
        print(
            f"step {time.step_s:.3g} s: {tokens / time.step_s:,.0f} tokens per "
            f"second, MFU {time.mfu(flops):.1%} (6 N per token plus causal "
            "attention, over the chips' bf16 peak)"
        )
    print()
    print(report.table(top=None if args.table else 10))
    return 0 if fits else 1
