"""Times warm calls of `eqshard.init_sharded` and of an eager
`eqshard.filter_shard_map`, which keep their traces, against the hand-written
route, on 8 virtual CPU devices.

Rows (each warm: the first call, untimed, traced and compiled):

- `init_sharded` of 16 float32 (1024, 4096) normal draws (256 MiB, `P("dp",
  "tp")` on a (2, 4) mesh) with a new key each call, against one
  `jax.jit(make, out_shardings=...)` (target: at most 1.2x);
- an eager `filter_shard_map(lambda x: x * 2)` of 16 floats split over 8
  devices, against `jax.jit(jax.shard_map(...))` of the same function (target:
  at most 2x), `--calls` calls per timing;
- the same with the function adding the sum of an array it closes over,
  replaced before every call (a new array: nothing is compiled again), against
  the jitted map taking that array as an argument.

Both routes run in turn `--runs` times (`benchmarks/_timing.py`), and each row
also gives the CPU time (user + sys) per call of each route, measured over
the same number of calls right after, and its ratio: on a machine whose cores
other work shares, the CPU ratio is the steadier one. Writes JSON (`--json
PATH`, by default `benchmarks/results/bench_kept.json`). Run with `python
benchmarks/bench_kept.py` (about a minute).
"""

import argparse
import time

import jax


jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
from _timing import add_json_option, interleaved, table, write_json
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqshard


def cpu_per_call(fn, calls: int) -> float:
    """CPU seconds (user + sys, every thread) per call of `fn`, blocked on."""
    start = time.process_time()
    for _ in range(calls):
        jax.block_until_ready(fn())
    return (time.process_time() - start) / calls


def row(case, times, fns, calls):
    cpu = {name: cpu_per_call(fn, calls) for name, fn in fns.items()}
    ratio = cpu["eqshard"] / cpu["hand"]
    mine, hand = times["eqshard"], times["hand"]
    return (
        case,
        mine,
        hand,
        f"{cpu['eqshard'] * 1e3:.3f}",
        f"{cpu['hand'] * 1e3:.3f}",
        f"{ratio:.2f}",
    )


def init_row(mesh, runs):
    names = [f"w{i}" for i in range(16)]

    def make(key):
        keys = jax.random.split(key, len(names))
        return {n: jax.random.normal(k, (1024, 4096)) for n, k in zip(names, keys)}

    sharding = NamedSharding(mesh, P("dp", "tp"))
    by_hand = jax.jit(make, out_shardings={n: sharding for n in names})
    keys = iter(jax.random.split(jax.random.key(0), 10 * runs + 20))
    fns = {
        "eqshard": lambda: eqshard.init_sharded(
            make, next(keys), specs=P("dp", "tp"), mesh=mesh
        ),
        "hand": lambda: by_hand(next(keys)),
    }
    times = interleaved(fns, runs)
    return row("init_sharded 256 MiB (16 leaves), warm", times, fns, runs)


def map_rows(mesh, runs, calls):
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("dp")))
    eager = eqshard.filter_shard_map(lambda x: x * 2, out_specs=P("dp"), mesh=mesh)
    jitted = jax.jit(
        jax.shard_map(lambda x: x * 2, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    )
    fns = {"eqshard": lambda: eager(x), "hand": lambda: jitted(x)}
    times = interleaved(fns, runs, calls=calls)
    rows = [row("eager filter_shard_map x * 2, warm", times, fns, calls)]

    fresh = [jnp.full(4, float(i), jnp.float32) for i in range(8)]
    bias = fresh[0]

    def add(x):
        return x + bias.sum()

    eager_add = eqshard.filter_shard_map(add, out_specs=P("dp"), mesh=mesh)
    jitted_add = jax.jit(
        jax.shard_map(
            lambda x, b: x + b.sum(),
            mesh=mesh,
            in_specs=(P("dp"), P()),
            out_specs=P("dp"),
        )
    )
    turn = iter(range(10**9))

    def eager_call():
        nonlocal bias
        bias = fresh[next(turn) % 8]
        return eager_add(x)

    def jitted_call():
        return jitted_add(x, fresh[next(turn) % 8])

    fns = {"eqshard": eager_call, "hand": jitted_call}
    times = interleaved(fns, runs, calls=calls)
    rows.append(
        row("eager map, closed-over array replaced each call", times, fns, calls)
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    add_json_option(parser)
    args = parser.parse_args()
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    rows = [init_row(mesh, args.runs), *map_rows(mesh, args.runs, args.calls)]
    result = table(
        rows,
        unit="ms",
        theirs="by hand",
        columns=("CPU ms eqshard", "CPU ms by hand", "x CPU"),
    )
    write_json(__file__, {"main": result}, path=args.json)


if __name__ == "__main__":
    main()
