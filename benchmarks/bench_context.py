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

    python benchmarks/bench_context.py                  # T=2048, N=8, K=4, H=64
    python benchmarks/bench_context.py --seq 4096 --heads 16 --kv-heads 8
"""

import argparse
import functools as ft

import jax


jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
from _timing import add_json_option, as_table, write_json
from jax.sharding import AxisType, PartitionSpec as P

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    add_json_option(parser)
    args = parser.parse_args()
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
