"""What context-parallel attention costs, read from compiled programs: per-device
temporaries and collective bytes of `eqshard.dot_product_attention`'s strategies
against `jax.nn.dot_product_attention` on the same sequence-split inputs, on 8
CPU devices (a `dp` 2 x `cp` 4 mesh).

The inputs are abstract (`eqshard.abstract`: nothing is allocated), laid out
`P("dp", "cp")`: queries `[B, T, N, H]`, keys and values `[B, T, K, H]`, causal,
float32. Each route is compiled twice by `eqshard.analyze_step`: the forward
(the attention's output) and the gradient of a loss of it with respect to the
query, keys and values. For each:

- `temp MiB/device`: XLA's temporaries (`report.memory.temp_bytes`), and its
  ratio to JAX's function on the same inputs (the whole-score route: XLA
  gathers the keys and holds `T/N x S` scores per head);
- `over cp MiB/device`: what each device sends over 'cp' per call (the
  collectives' `link_bytes` times their runs), beside the formula: ring and
  all-gather `(n-1)/n · 2·B·S·K·H·4` (keys and values, B the batch per device;
  the ring also moves the keys' positions, `1/(2·K·H)` of that), Ulysses
  `(n-1)/n² · (2·B·T·N·H + 2·B·S·K·H)·4` (query, output, keys, values once).

CPU compiles: the figures are the compiler's, no wall-time claims.

`--llama` (deviceless, `eqshard.create_mesh("cp:8", target="h100:1x8")`, JAX's
CUDA plugin compiling for 8 H100 here): the gradient of a Llama-3-8B-shaped
step (32 layers of d=4096, GQA 32/8 heads of 128, SwiGLU 14336, vocab 128256;
bfloat16 weights sharded over 'cp' as FSDP; the layers scanned and
rematerialised with `jax.checkpoint`; no rotary embedding, an elementwise op)
on one sequence split over the 8 GPUs, for the ring and all-gather: XLA's peak
per device (`report.memory.peak_bytes`) against 80 GB, beside
`plan_training(context=)`'s count of the attention's buffers. `--fit` then
bisects, in steps of 8192 tokens, the longest sequence whose compiled step fits.

    python benchmarks/bench_context.py                  # T=2048, N=8, K=4, H=64
    python benchmarks/bench_context.py --seq 4096 --heads 16 --kv-heads 8
    python benchmarks/bench_context.py --llama --fit    # deviceless, minutes
"""

import argparse
import functools as ft
import os


os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin, compile-only

import jax


jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
from _timing import add_json_option, as_table, RESULTS, write_json
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqshard


def route(strategy: str | None):
    if strategy is None:
        return ft.partial(jax.nn.dot_product_attention, is_causal=True)
    return ft.partial(
        eqshard.dot_product_attention,
        is_causal=True,
        axis="cp",
        strategy=strategy,
        batch_axes="dp",
    )


def measure(args, mesh, strategy, grad):
    shape_q = (args.batch, args.seq, args.heads, args.head_dim)
    shape_kv = (args.batch, args.seq, args.kv_heads, args.head_dim)
    q, k, v = (
        eqshard.abstract(jax.ShapeDtypeStruct(s, jnp.float32), P("dp", "cp"), mesh)
        for s in (shape_q, shape_kv, shape_kv)
    )
    attend = route(strategy)
    if grad:
        step = jax.jit(
            jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) ** 2), argnums=(0, 1, 2))
        )
    else:
        step = jax.jit(attend)
    with jax.set_mesh(mesh):
        report = eqshard.analyze_step(step, q, k, v, capture_warnings=False)
    over_cp = sum(c.link_bytes * c.count for c in report.collectives if "cp" in c.axes)
    kinds = sorted({c.kind for c in report.collectives if "cp" in c.axes})
    return report.memory.temp_bytes, over_cp, kinds


def formula(args, strategy: str | None, n: int) -> float | None:
    b = args.batch // 2  # per device: the batch is over 'dp' (2)
    kv = 2 * b * args.seq * args.kv_heads * args.head_dim * 4
    if strategy in ("ring", "all_gather"):
        return (n - 1) / n * kv
    if strategy == "ulysses":
        qo = 2 * b * args.seq * args.heads * args.head_dim * 4
        return (n - 1) / n**2 * (qo + kv)
    return None


# Llama-3-8B's shape (`--llama`): width, query and key/value heads, head size,
# MLP width, vocabulary, layers.
D, NQ, NK, HD, F, V, L = 4096, 32, 8, 128, 14336, 128256, 32


def llama_params(mesh):
    """The abstract parameters, bfloat16, FSDP over 'cp' (the layer axis first)."""
    fsdp = P(None, "cp", None)
    shapes = {
        "embed": ((V, D), P(None, "cp")), "head": ((D, V), P("cp", None)),
        "wq": ((L, D, NQ * HD), fsdp), "wk": ((L, D, NK * HD), fsdp),
        "wv": ((L, D, NK * HD), fsdp), "wo": ((L, NQ * HD, D), fsdp),
        "w1": ((L, D, F), fsdp), "w3": ((L, D, F), fsdp), "w2": ((L, F, D), fsdp),
        "n1": ((L, D), P()), "n2": ((L, D), P()),
    }  # fmt: skip
    return {
        name: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, s))
        for name, (shape, s) in shapes.items()
    }


def _rms(x, w):
    x32 = x.astype(jnp.float32)
    norm = x32 * jax.lax.rsqrt((x32**2).mean(-1, keepdims=True) + 1e-5)
    return (norm * w).astype(x.dtype)


def llama_grad(strategy: str):
    """The jitted gradient of the next-token loss, attention over 'cp'."""

    def layer(h, w):
        b, t, _ = h.shape
        h = jax.lax.with_sharding_constraint(h, P(None, "cp", None))
        x = _rms(h, w["n1"])
        q = (x @ w["wq"]).reshape(b, t, NQ, HD)
        k = (x @ w["wk"]).reshape(b, t, NK, HD)
        v = (x @ w["wv"]).reshape(b, t, NK, HD)
        a = eqshard.dot_product_attention(
            q, k, v, is_causal=True, axis="cp", strategy=strategy
        )
        h = h + a.reshape(b, t, NQ * HD) @ w["wo"]
        x = _rms(h, w["n2"])
        return h + (jax.nn.silu(x @ w["w1"]) * (x @ w["w3"])) @ w["w2"], None

    def loss(params, tokens):
        stack = {k: v for k, v in params.items() if k not in ("embed", "head")}
        h, _ = jax.lax.scan(jax.checkpoint(layer), params["embed"][tokens], stack)
        logp = jax.nn.log_softmax((h @ params["head"]).astype(jnp.float32)[:, :-1])
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()

    return jax.jit(jax.grad(loss))


@ft.cache
def llama_peak(mesh, seq: int, strategy: str) -> int:
    tokens = jax.ShapeDtypeStruct(
        (1, seq), jnp.int32, sharding=NamedSharding(mesh, P(None, "cp"))
    )
    with jax.set_mesh(mesh):
        report = eqshard.analyze_step(
            llama_grad(strategy), llama_params(mesh), tokens, capture_warnings=False
        )
    return report.memory.peak_bytes


# One H100 80GB HBM3's memory, as eqshard's target spec gives it (79.1 GiB).
# `analyze_step` compares with what JAX's allocator takes of it by default (75 %).
H100 = 84_942_979_072


def allocator_memory(mesh) -> int:
    """What JAX's allocator takes of one device by default, from a small
    compiled step's report (`report.memory.device_memory`)."""
    x = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P("cp")))
    with jax.set_mesh(mesh):
        memory = eqshard.analyze_step(jax.jit(lambda x: x * 2), x).memory
    assert memory.device_memory is not None
    return memory.device_memory


def llama_planned(mesh, seq: int, strategy: str) -> int:
    """`plan_training`'s count of one layer's attention buffers."""
    query = jax.ShapeDtypeStruct((1, seq, NQ, HD), jnp.bfloat16)
    context = {"query": query, "kv_heads": NK, "strategy": strategy, "axis": "cp"}
    plan = eqshard.plan_training({}, mesh=mesh, context=context)
    assert plan.context is not None
    return plan.context.total


def longest(mesh, strategy: str, peaks: dict[int, int], budget: int) -> int:
    """The longest multiple of 8192 tokens whose step fits, from the peaks
    measured (`{tokens: peak}`): doubling past the longest that fits if none
    measured is over, then bisecting."""
    fits = max([8192] + [t for t, p in peaks.items() if p <= budget])
    over = min([t for t, p in peaks.items() if p > budget], default=None)
    while over is None:
        if llama_peak(mesh, 2 * fits, strategy) <= budget:
            fits *= 2
        else:
            over = 2 * fits
    while over - fits > 8192:
        mid = (fits + over) // 2 // 8192 * 8192
        if llama_peak(mesh, mid, strategy) <= budget:
            fits = mid
        else:
            over = mid
    return fits


def llama(args) -> None:
    mesh = eqshard.create_mesh("cp:8", target="h100:1x8")
    budgets = (H100, allocator_memory(mesh))
    gb = lambda x: f"{x / 2**30:.1f}"  # noqa: E731
    rows = []
    for strategy in ("ring", "all_gather"):
        peaks = {}
        for seq in args.llama_seqs:
            peak = peaks[seq] = llama_peak(mesh, seq, strategy)
            fits = ["yes" if peak <= budget else "no" for budget in budgets]
            planned = gb(llama_planned(mesh, seq, strategy))
            rows.append([strategy, f"{seq:,}", gb(peak), *fits, planned])
            print(*rows[-1], flush=True)
        if args.fit is not None and strategy in (args.fit or [strategy]):
            best = [f"{longest(mesh, strategy, peaks, b):,}" for b in budgets]
            rows.append([strategy, "longest that fits", "-", *best, "-"])
            print(*rows[-1], flush=True)
    columns = [
        "strategy", "tokens (over 8 GPUs)", "compiled peak GiB/device",
        f"fits {gb(budgets[0])} GiB (the H100's)",
        f"fits {gb(budgets[1])} GiB (JAX's default 75 %)",
        "planned attention GiB/device",
    ]  # fmt: skip
    title = (
        "Llama-3-8B-shaped gradient step, deviceless for h100:1x8 (cp 8), "
        "bfloat16, scanned and rematerialised"
    )
    write_json(
        __file__,
        {"llama": as_table(columns, rows, title=title)},
        path=args.json or RESULTS / "bench_context_llama.json",
        machine="deviceless: 8 H100 (h100:1x8) compiled by JAX's CUDA plugin on CPU",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--llama", action="store_true", help="the deviceless step")
    parser.add_argument("--llama-seqs", type=int, nargs="+", default=[131072, 262144])
    parser.add_argument(
        "--fit",
        nargs="*",
        choices=["ring", "all_gather"],
        help="with --llama: the longest that fits, for these strategies (all if none)",
    )
    add_json_option(parser)
    args = parser.parse_args()
    if args.llama:
        return llama(args)
    mesh = jax.make_mesh((2, 4), ("dp", "cp"), axis_types=(AxisType.Auto,) * 2)
    mib = lambda x: f"{x / 2**20:.2f}"  # noqa: E731
    rows = []
    for grad in (False, True):
        base = None
        for strategy in (None, "ring", "all_gather", "ulysses"):
            temp, over_cp, kinds = measure(args, mesh, strategy, grad)
            base = temp if strategy is None else base
            want = formula(args, strategy, 4)
            rows.append([
                "gradient" if grad else "forward",
                strategy or "jax.nn (whole scores)",
                mib(temp),
                f"{temp / base:.2f}" if base else "-",
                mib(over_cp),
                mib(want) if want is not None and not grad else "-",
                ", ".join(kinds) or "-",
            ])  # fmt: skip
    columns = [
        "pass", "route", "temp MiB/device", "temp / jax.nn",
        "over cp MiB/device", "formula MiB (forward)", "collectives over cp",
    ]  # fmt: skip
    widths = [max(len(str(r[i])) for r in [columns, *rows]) for i in range(7)]
    for row in [columns, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
    title = (
        f"causal attention, B={args.batch}, T=S={args.seq}, N={args.heads}, "
        f"K={args.kv_heads}, H={args.head_dim}, float32, dp 2 x cp 4, compiled "
        "for 8 CPU devices"
    )
    write_json(
        __file__, {"routes": as_table(columns, rows, title=title)}, path=args.json
    )


if __name__ == "__main__":
    main()
