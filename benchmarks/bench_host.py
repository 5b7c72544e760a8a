"""Times what `shard` does to host data and what `gather` does per leaf, against raw
JAX, on 8 virtual CPU devices and a (2, 4) ('dp', 'tp') mesh with Auto axes.

- **No aliasing.** `eqshard.shard` copies each NumPy array once into a private,
  64-byte aligned buffer (so placed arrays never share the caller's buffer),
  against raw `jax.device_put`, which on CPU uses an aligned buffer in place
  (sharing it) and copies an unaligned one once per device that holds it. A
  64 MiB float32 array, aligned and unaligned, replicated and split 8 ways.
- **Many small leaves.** `eqshard.gather` of `--leaves` arrays of shape (8,)
  split over 'dp', against `jax.device_get` of the same list (fresh arrays each
  run: JAX caches host copies on arrays).

Each row runs eqshard and raw JAX in turn `--runs` times with the garbage
collector fixed (`benchmarks/_timing.py`), and prints the min and median of each
and their ratios. Run with
`python benchmarks/bench_host.py` (about a minute; `--leaves 100000` is the
issue's case).
"""

import argparse
from collections.abc import Callable

import jax


jax.config.update("jax_num_cpu_devices", 8)

import numpy as np
from _timing import add_json_option, interleaved, table, write_json
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqshard


def aligned(shape: tuple[int, ...]) -> np.ndarray:
    nbytes = int(np.prod(shape)) * 4
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start : start + nbytes].view(np.float32).reshape(shape)
    out[:] = 1.0
    return out


def unaligned(shape: tuple[int, ...]) -> np.ndarray:
    return aligned((int(np.prod(shape)) + 1,))[1:].reshape(shape)


def row(name: str, ours: Callable, raw: Callable, setup: Callable, runs: int):
    times = interleaved({"ours": ours, "raw": raw}, runs, setup=setup, warmup=False)
    return (name, times["ours"], times["raw"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--leaves", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    add_json_option(parser)
    args = parser.parse_args()
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    rows = []
    shape = (16384, 1024)  # 64 MiB of float32
    for spec in (P(), P("dp", "tp")):
        sharding = NamedSharding(mesh, spec)
        for kind, make in (("aligned", aligned), ("unaligned", unaligned)):
            host = make(shape)
            rows.append(
                row(
                    f"shard 64 MiB {kind} {spec}",
                    lambda x, s=sharding: eqshard.shard(x, s),
                    lambda x, s=sharding: jax.device_put(x, s),
                    lambda h=host: h,
                    args.runs,
                )
            )
    n = args.leaves
    sharding = NamedSharding(mesh, P("dp"))
    leaves = [np.full((8,), i, np.float32) for i in range(n)]

    def fresh() -> list[jax.Array]:
        return jax.block_until_ready(jax.device_put(leaves, [sharding] * n))

    rows.append(
        row(
            f"gather {n} leaves of (8,)",
            eqshard.gather,
            jax.device_get,
            fresh,
            max(5, args.runs // 2),
        )
    )
    main_table = table(rows, unit="ms", theirs="raw JAX")
    write_json(__file__, {"main": main_table}, path=args.json)


if __name__ == "__main__":
    main()
