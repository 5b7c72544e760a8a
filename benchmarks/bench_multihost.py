"""Times the multi-process agreement check of `eqshard.shard`, in two JAX processes
on this machine (4 virtual CPU devices each, gloo collectives, a (2, 4)
('dp', 'tp') mesh whose 'dp' spans the processes).

Every process holds a full copy of a tree of `--leaves` float32 arrays (`--mib`
MiB in all) and places it with the spec P('dp', 'tp'):

- **raw JAX**: `jax.make_array_from_callback` per leaf, reading each device's
  block from the host copy, with no check that the copies agree (what one writes
  by hand).
- **shard, sample** (the default): the processes first compare paths, shapes,
  dtypes, specs and a hash of 64 elements of each array, in one 16-byte
  all-gather.
- **shard, full** (`check_values="full"`): the same, hashing every byte.

Each row runs `--runs` times with the garbage collector fixed
(`benchmarks/_timing.py`); process 0 prints the min and median, in ms, and the
ratios to raw JAX. The processes are started by the
tests' harness (`tests/multihost.py`), which gives them a free port, a timeout and
a clean exit. Run with `python benchmarks/bench_multihost.py` (about a minute).
"""

import argparse
import pathlib
import sys

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from _timing import interleaved, table, Times  # noqa: E402
from multihost import run_processes  # noqa: E402

import eqshard  # noqa: E402


def _child(leaves: int, mib: int, runs: int) -> dict[str, list[float]]:
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(
        np.array(devices).reshape(2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2
    )
    sharding = NamedSharding(mesh, P("dp", "tp"))
    rows = mib * 2**20 // (4 * 1024 * leaves)
    rng = np.random.default_rng(0)  # the same copy on every process
    tree = [rng.standard_normal((rows, 1024), np.float32) for _ in range(leaves)]

    def raw():
        return [
            jax.make_array_from_callback(x.shape, sharding, lambda i, x=x: x[i])
            for x in tree
        ]

    cases = {
        "raw": raw,
        "sample": lambda: eqshard.shard(tree, sharding),
        "full": lambda: eqshard.shard(tree, sharding, check_values="full"),
    }
    times = interleaved(cases, runs, warmup=False)
    return {name: list(t.seconds) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--leaves", type=int, default=16)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    # The children load `_child` from this file by path: name it as a module's
    # function, not `__main__`'s.
    import bench_multihost

    times = run_processes(
        bench_multihost._child, args=(args.leaves, args.mib, args.runs), timeout=600.0
    )[0]
    raw = times["raw"]
    print(
        f"{args.mib} MiB in {args.leaves} float32 arrays, full copies on 2 "
        f"processes, P('dp', 'tp'); ms, min / median over {args.runs} runs"
    )
    table(
        [
            (label, Times(tuple(times[name])), Times(tuple(raw)))
            for name, label in (
                ("sample", "shard (sample check)"),
                ("full", 'shard (check_values="full")'),
            )
        ],
        unit="ms",
        theirs="make_array_from_callback",
    )


if __name__ == "__main__":
    main()
