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

Each row runs eqshard and raw JAX back to back `--runs` times with the garbage
collector off, and prints the min and median of each and of the ratio. Run with
`python benchmarks/bench_host.py` (about a minute; `--leaves 100000` is the
issue's case).
"""

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


jax.config.update("jax_num_cpu_devices", 8)

import numpy as np
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


def timed(fn: Callable[[], Any], setup: Callable[[], Any]) -> float:
    arg = setup()
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        jax.block_until_ready(fn(arg))
        return time.perf_counter() - start
    finally:
        gc.enable()


def row(name: str, ours: Callable, raw: Callable, setup: Callable, runs: int):
    times: list[tuple[float, float]] = []
    for _ in range(runs):
        times.append((timed(ours, setup), timed(raw, setup)))
    o = [t[0] for t in times]
    r = [t[1] for t in times]
    ratios = [a / b for a, b in times]
    print(
        f"{name:<34} {min(o) * 1e3:9.1f} {statistics.median(o) * 1e3:9.1f} "
        f"{min(r) * 1e3:9.1f} {statistics.median(r) * 1e3:9.1f} "
        f"{min(ratios):7.2f} {statistics.median(ratios):7.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--leaves", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    print(
        f"{'case':<34} {'ours min':>9} {'ours med':>9} {'raw min':>9} "
        f"{'raw med':>9} {'x min':>7} {'x med':>7}   (ms; x = ours / raw)"
    )
    shape = (16384, 1024)  # 64 MiB of float32
    for spec in (P(), P("dp", "tp")):
        sharding = NamedSharding(mesh, spec)
        for kind, make in (("aligned", aligned), ("unaligned", unaligned)):
            host = make(shape)
            row(
                f"shard 64 MiB {kind} {spec}",
                lambda x, s=sharding: eqshard.shard(x, s),
                lambda x, s=sharding: jax.device_put(x, s),
                lambda h=host: h,
                args.runs,
            )
    n = args.leaves
    sharding = NamedSharding(mesh, P("dp"))
    leaves = [np.full((8,), i, np.float32) for i in range(n)]

    def fresh() -> list[jax.Array]:
        return jax.block_until_ready(jax.device_put(leaves, [sharding] * n))

    row(
        f"gather {n} leaves of (8,)",
        eqshard.gather,
        jax.device_get,
        fresh,
        max(3, args.runs // 2),
    )


if __name__ == "__main__":
    main()
