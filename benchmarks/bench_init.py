"""Times `eqshard.init_sharded` against eager init + `shard`, and both against raw
JAX, on 8 CPU devices; with the bytes each device holds at the peak.

The model is the GPT-style transformer of `benchmarks/models.py` (the parameters
of `python -m eqshard`'s demo: embedding, pre-norm blocks of q/k/v/o and MLP
`eqx.nn.Linear`s, layer norms, a head), sized by `--mib` (512 MiB of float32 is
GPT-2 small: 12 layers of width 768, a 32,000-token vocabulary), on a (2, 4)
('fsdp', 'tp') mesh with Auto axes. Its rules split every matrix over both axes;
biases and norms are small. Four ways to get it onto the mesh:

1. raw JAX, eager: `Transformer(config, key=key)` (everything on device 0), then
   one batched `jax.device_put(arrays, shardings)`;
2. eager, then `eqshard.shard(model, specs, mesh)`;
3. `eqshard.init_sharded(Transformer, config, key=key, specs=rules, mesh=mesh)`;
4. raw JAX under `jit`: `jax.jit(build, out_shardings=shardings)(key)`, where
   `build` returns the array part of the model, combined with the static part from
   `eqx.filter_eval_shape`; the same program as (3), written by hand.

The raw rows get their `NamedSharding` tree and (2) its spec tree ready-made (as
if written by hand); `init_sharded` matches the rules inside the timing. Each run
times every row cold (`jax.clear_caches()` and `eqshard.clear_caches()`
first: a model is made once, so compilation counts), then warm (the same call
again), with the garbage collector run and then disabled while timing
(`_timing.once`); rows are interleaved within a run. XLA
compilations are counted with `jax.monitoring`. The first run checks that all
four give the same values bit for bit, the same shardings and the same tree.

Bytes per device at the peak: for the eager rows, the largest total any one
device holds when both the eager model and its sharded copy are alive (read from
the arrays' shards: device 0 holds the whole model plus its own shards); for the
`jit` rows, the compiled program's `memory_analysis()` (output plus temporary
bytes per device; for (3), `init_sharded` traced inside `jax.jit`, which compiles
the same program). CPU devices report no memory statistics, so eager
temporaries (one array's random bits at a time) are not counted.

    python benchmarks/bench_init.py             # 512 MiB, 3 runs, ~4 minutes
    python benchmarks/bench_init.py --mib 64 --runs 5

`--depths 1,6,12,24,48` instead times how the cold build grows with the number
of blocks (width 512, 8 heads, a 4,096-token vocabulary: 12 blocks are 160 MiB),
each route once per fresh process (the time from the call to the arrays being
ready, the garbage collector run then disabled; importing and making the mesh
are not counted), round-robin over the
routes and depths for `--runs` rounds: (2) eager + `eqshard.shard`, (3)
`init_sharded` and (4) one `jax.jit` with `out_shardings`, with the ratios of
the medians to (2).

    python benchmarks/bench_init.py --depths 1,6,12,24,48 --runs 5
"""

import argparse
import collections
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax


jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.tree_util as jtu
import numpy as np
from _timing import add_json_option, as_table, once, RESULTS, Table, write_json
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from models import Config, config_for_size, RULES, Transformer

import eqshard


MiB = 1 << 20
_compiles = [0]


def _count_compiles(event: str, duration: float, **kwargs: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def timed(fn: Callable[[], Any], *, cold: bool = True) -> tuple[float, int, Any]:
    """Seconds and compilations of one call of `fn` (`_timing.once`), and its
    result; cold (JAX's caches and `init_sharded`'s cleared first) unless
    `cold=False`."""
    if cold:
        jax.clear_caches()
        eqshard.clear_caches()
    before = _compiles[0]
    seconds, out = once(fn)
    return seconds, _compiles[0] - before, out


def per_device_bytes(*trees: Any) -> dict[Any, int]:
    """Bytes of the arrays of `trees` on each device, read from their shards."""
    held: collections.Counter = collections.Counter()
    for leaf in jtu.tree_leaves(eqx.filter(trees, eqx.is_array)):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return dict(held)


def program_bytes(jitted: Any, *inputs: Any) -> tuple[int, int]:
    """Output and temporary bytes per device of the compiled `jitted(*inputs)`."""
    stats = jitted.lower(*inputs).compile().memory_analysis()
    return stats.output_size_in_bytes, stats.temp_size_in_bytes


def check(out: Any, want: Any) -> None:
    """`out` is `want`: the same tree, shardings and values, bit for bit."""
    assert jtu.tree_structure(out) == jtu.tree_structure(want)
    for a, b in zip(jtu.tree_leaves(out), jtu.tree_leaves(want), strict=True):
        if eqx.is_array(a):
            assert a.sharding == b.sharding, (a.sharding, b.sharding)
            assert np.array_equal(
                np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)
            )
        else:
            assert a == b, (a, b)


DEPTH_ROUTES = ("eager + shard", "init_sharded", "jit(out_shardings)")


def one_cold_build(route: str, layers: int) -> float:
    """Seconds of one build of a `layers`-block model by `route`, in this (fresh)
    process."""
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    config = Config(vocab=4096, dim=512, heads=8, layers=layers)
    key = jax.random.key(0)
    if route == "eager + shard":
        specs = eqshard.match_partition_rules(
            RULES, eqx.filter_eval_shape(Transformer, config, key=key)
        )

        def build() -> Any:
            return eqshard.shard(Transformer(config, key=key), specs, mesh)

    elif route == "init_sharded":

        def build() -> Any:
            return eqshard.init_sharded(
                Transformer, config, key=key, specs=RULES, mesh=mesh
            )

    else:
        shapes = eqx.filter_eval_shape(Transformer, config, key=key)
        arrays, static = eqx.partition(shapes, eqx.is_array)
        shardings = jtu.tree_map(
            lambda spec: NamedSharding(mesh, spec),
            eqshard.match_partition_rules(RULES, arrays),
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )
        jitted = jax.jit(
            lambda key: eqx.filter(Transformer(config, key=key), eqx.is_array),
            out_shardings=shardings,
        )

        def build() -> Any:
            return eqx.combine(jitted(key), static)

    return once(build)[0]


def depths_table(depths: list[int], runs: int) -> Table:
    """Cold times by depth, each in a fresh process (see the module's docstring)."""
    seconds: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for _ in range(runs):
        for layers in depths:
            for route in DEPTH_ROUTES:
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        route,
                        "--layers",
                        str(layers),
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                    env=env,
                )
                seconds[route, layers].append(float(out.stdout.split()[-1]))
    print(
        f"cold build, fresh process per build, {runs} runs (min / median s); ratio "
        "= median of (2) eager + shard / median of this\n"
    )
    header = f"{'blocks':>6} {'MiB':>5}" + "".join(
        f" {route + ' min/med s':>30} {'ratio':>6}" for route in DEPTH_ROUTES
    )
    print(header)
    print("-" * len(header))
    cells = []
    for layers in depths:
        config = Config(vocab=4096, dim=512, heads=8, layers=layers)
        base = statistics.median(seconds[DEPTH_ROUTES[0], layers])
        row = f"{layers:>6} {config.parameters * 4 / MiB:>5.0f}"
        cells.append([layers, f"{config.parameters * 4 / MiB:.0f}"])
        for route in DEPTH_ROUTES:
            times = seconds[route, layers]
            median = statistics.median(times)
            row += f" {min(times):>14.2f} {median:>15.2f} {base / median:>5.2f}x"
            cells[-1] += [f"{min(times):.2f} / {median:.2f}", f"{base / median:.2f}x"]
        print(row)
    columns = ["blocks", "MiB"]
    for route in DEPTH_ROUTES:
        columns += [f"{route} min / median", "ratio"]
    return as_table(columns, cells, unit="s")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=512, help="model size, float32")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--depths", help="comma-separated block counts")
    parser.add_argument("--child", choices=DEPTH_ROUTES, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    add_json_option(parser)  # with --depths, by default results/bench_init_depths.json
    args = parser.parse_args()
    if args.child is not None:
        print(one_cold_build(args.child, args.layers))
        return 0
    if args.depths is not None:
        depths = depths_table([int(d) for d in args.depths.split(",")], args.runs)
        path = args.json or RESULTS / "bench_init_depths.json"
        write_json(__file__, {"depths": depths}, path=path)
        return 0

    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    config = config_for_size(args.mib * MiB // 4, mesh)
    rules = RULES
    key = jax.random.key(0)

    # What raw JAX is given ready-made: the shardings, and the program of (4).
    shapes = eqx.filter_eval_shape(Transformer, config, key=key)
    specs = eqshard.match_partition_rules(rules, shapes)
    shardings = jtu.tree_map(
        lambda spec: NamedSharding(mesh, spec),
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )

    def build(key: jax.Array) -> Any:
        return eqx.filter(Transformer(config, key=key), eqx.is_array)

    raw_jit = jax.jit(build, out_shardings=shardings)

    def eager_device_put() -> Any:
        arrays, static = eqx.partition(Transformer(config, key=key), eqx.is_array)
        return eqx.combine(jax.device_put(arrays, shardings), static)

    def eager_shard() -> Any:
        return eqshard.shard(Transformer(config, key=key), specs, mesh)

    def init_sharded() -> Any:
        return eqshard.init_sharded(
            Transformer, config, key=key, specs=rules, mesh=mesh
        )

    def jit_out_shardings() -> Any:
        static = eqx.filter(
            eqx.filter_eval_shape(Transformer, config, key=key),
            lambda leaf: isinstance(leaf, jax.ShapeDtypeStruct),
            inverse=True,
        )
        return eqx.combine(raw_jit(key), static)

    # (name, fn, index of the raw JAX row it is compared with)
    rows: list[tuple[str, Callable[[], Any], int]] = [
        ("(1) raw: eager + device_put", eager_device_put, 0),
        ("(2) eager + eqshard.shard", eager_shard, 0),
        ("(3) eqshard.init_sharded", init_sharded, 3),
        ("(4) raw: jit(out_shardings)", jit_out_shardings, 3),
    ]

    # Bytes per device at the peak.
    eager = Transformer(config, key=key)
    placed = eqshard.shard(eager, specs, mesh)
    eager_peak = max(per_device_bytes(eager, placed).values())
    total = sum(per_device_bytes(eager).values())
    own = max(per_device_bytes(placed).values())
    largest = max(
        leaf.nbytes for leaf in jtu.tree_leaves(eqx.filter(eager, eqx.is_array))
    )
    del eager, placed
    traced = jax.jit(
        lambda key: eqx.filter(
            eqshard.init_sharded(Transformer, config, key=key, specs=rules, mesh=mesh),
            eqx.is_array,
        )
    )
    programs = [program_bytes(traced, key), program_bytes(raw_jit, key)]
    peak = [eager_peak, eager_peak] + [sum(p) for p in programs]
    del traced

    cold: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    warm: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    compiles: dict[str, tuple[int, int]] = {}
    for run in range(args.runs):
        reference = None
        for name, fn, _ in rows:
            seconds, count, out = timed(fn)
            cold[name].append(seconds)
            seconds, again, out = timed(fn, cold=False)
            warm[name].append(seconds)
            compiles[name] = (count, again)
            if run == 0:
                if reference is None:
                    reference = out
                else:
                    check(out, reference)
            del out
        del reference

    print(
        f"GPT-style model: {config}, {total / MiB:.0f} MiB float32 "
        f"({len(jtu.tree_leaves(shapes))} arrays); (2, 4) ('fsdp', 'tp') mesh, "
        f"{own / MiB:.1f} MiB of shards per device at most; {args.runs} runs, "
        "cold then warm\n"
    )
    header = (
        f"{'route':<30} {'cold min/median s':>18} {'raw/this':>8} "
        f"{'warm min/median s':>18} {'raw/this':>8} {'compiles':>8} "
        f"{'peak MiB/device':>15}"
    )
    print(header)
    print("-" * len(header))
    cells = []
    for (name, _, ref), bytes_ in zip(rows, peak, strict=True):
        base = rows[ref][0]
        c, w = cold[name], warm[name]
        cells.append(
            (
                name,
                f"{min(c):.3f} / {statistics.median(c):.3f}",
                f"{statistics.median(cold[base]) / statistics.median(c):.2f}x",
                f"{min(w):.3f} / {statistics.median(w):.3f}",
                f"{statistics.median(warm[base]) / statistics.median(w):.2f}x",
                "{} / {}".format(*compiles[name]),
                f"{bytes_ / MiB:.1f}",
            )
        )
        print(
            f"{name:<30} {min(c):>8.3f} {statistics.median(c):>9.3f} "
            f"{statistics.median(cold[base]) / statistics.median(c):>7.2f}x "
            f"{min(w):>8.3f} {statistics.median(w):>9.3f} "
            f"{statistics.median(warm[base]) / statistics.median(w):>7.2f}x "
            f"{'{} / {}'.format(*compiles[name]):>8} {bytes_ / MiB:>15.1f}"
        )
    ours, raw = rows[2][0], rows[0][0]
    print(
        f"\ninit_sharded against raw eager + device_put: "
        f"{statistics.median(cold[raw]) / statistics.median(cold[ours]):.2f}x cold, "
        f"{statistics.median(warm[raw]) / statistics.median(warm[ours]):.2f}x warm "
        f"(medians), {peak[0] / peak[2]:.1f}x fewer bytes on the fullest device"
    )
    for name, (output, temp) in zip(("(3)", "(4)"), programs, strict=True):
        print(
            f"{name}: {output / MiB:.1f} MiB output + {temp / MiB:.1f} MiB "
            "temporaries per device"
        )
    print(
        f"eager: device 0 holds the whole model ({total / MiB:.1f} MiB) and its "
        f"shards; largest array {largest / MiB:.1f} MiB"
    )
    columns = (
        "route",
        "cold min / median",
        "raw / this",
        "warm min / median",
        "raw / this",
        "compiles cold / warm",
        "peak MiB per device",
    )
    routes = as_table(columns, cells, unit="s")
    write_json(__file__, {"routes": routes}, path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
