"""Times the multi-process agreement check of `eqshard.shard`, in two JAX processes
on this machine (4 virtual CPU devices each, gloo collectives, a (2, 4)
('dp', 'tp') mesh whose 'dp' spans the processes).

Every process holds a full copy of a tree of `--leaves` float32 arrays (`--mib`
MiB in all) and places it with the spec P('dp', 'tp'):

- **raw JAX**: `jax.make_array_from_callback` per leaf, reading each device's
  block from the host copy, with no check that the copies agree (what one writes
  by hand).
- **shard, sample** (the default): the processes first compare paths, shapes,
  dtypes, specs and a hash of 64 elements of each array: one 16-byte digest
  each, exchanged through the distributed client's key-value store.
- **shard, full** (`check_values="full"`): the same, hashing every byte.

Each row runs `--runs` times, interleaved, with the garbage collector fixed
(`benchmarks/_timing.py`), every call starting with both processes together (a
barrier of the distributed client, untimed, after the collector ran). Printed:
the min and median, in ms, and the ratios to raw JAX, of process 0's times and of
the slower process's time in each run (a multi-process call is done when every
process is: the check makes the processes wait for each other, so process 0
alone is timed waiting for a process that the shared machine slowed down, and raw
JAX never is). The processes are started by the tests' harness
(`tests/multihost.py`) without its jaxtyping import hook (`typecheck=False`:
eqshard runs as users run it), which gives them a free port, a timeout and a
clean exit.

With `--pin`, each process is pinned to a core of its own (process `i` to core
`i % cores`, every thread of it, those JAX has already started included). On this
2-core machine that made `shard` slower and no steadier (see
docs/notes/benchmarks-history.md), so the processes run free by default. Run
with `python benchmarks/bench_multihost.py` (about 20 s).
"""

import argparse
import itertools
import os
import pathlib
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from _timing import add_json_option, interleaved, table, Times, write_json  # noqa: E402
from multihost import run_processes  # noqa: E402

import eqshard  # noqa: E402


def _pin_to_one_core() -> None:
    """Pins every thread of this process to core `process_index % cores`."""
    core = {jax.process_index() % (os.cpu_count() or 1)}
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), core)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    os.sched_setaffinity(0, core)  # threads started from now on inherit it


def _child(leaves: int, mib: int, runs: int, pin: bool) -> dict[str, list[float]]:
    if pin:
        _pin_to_one_core()
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
    # Every timed call starts with both processes together (a barrier of the
    # distributed client: no XLA program, which here slowed and spread both
    # routes: medians 72-154 ms with `sync_global_devices` against 60-75 ms),
    # after the garbage collector ran (`start`: a collection takes about 60 ms
    # here, a few ms more or less on each process): the check makes them meet,
    # so a process that came early would otherwise be timed waiting for the
    # other to finish its previous call or its collection. JAX 0.10 has no public
    # accessor for the client: this is the attribute `multihost_utils` uses.
    client = multihost_utils.distributed.global_state.client
    barriers = itertools.count()

    def together() -> None:
        client.wait_at_barrier(f"bench_multihost:{next(barriers)}", 600_000)

    times = interleaved(cases, runs, start=together, warmup=False)
    return {name: list(t.seconds) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--leaves", type=int, default=16)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--pin", action="store_true")
    add_json_option(parser)
    args = parser.parse_args()
    # The children load `_child` from this file by path: name it as a module's
    # function, not `__main__`'s.
    import bench_multihost

    per_process = run_processes(
        bench_multihost._child,
        args=(args.leaves, args.mib, args.runs, args.pin),
        timeout=600.0,
        typecheck=False,
    )
    print(
        f"{args.mib} MiB in {args.leaves} float32 arrays, full copies on 2 "
        f"processes, P('dp', 'tp'); ms, min / median over {args.runs} runs; "
        f"{'each process on a core of its own' if args.pin else 'processes free'}"
    )
    tables = {}
    for key, what, pick in (
        ("process_0", "process 0", lambda ts: ts[0]),
        (
            "slower",
            "the slower process of each run (the call is done when both are)",
            max,
        ),
    ):
        times = {
            name: Times(tuple(map(pick, zip(*(p[name] for p in per_process)))))
            for name in per_process[0]
        }
        print(f"\n{what}:")
        tables[key] = table(
            [
                (label, times[name], times["raw"])
                for name, label in (
                    ("sample", "shard (sample check)"),
                    ("full", 'shard (check_values="full")'),
                )
            ],
            unit="ms",
            theirs="make_array_from_callback",
            title=what,
        )
    kind = f"2 processes x 4 cpu devices, {os.cpu_count()} cores"
    write_json(__file__, tables, path=args.json, machine=kind)


if __name__ == "__main__":
    main()
