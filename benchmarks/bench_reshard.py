"""Times moving a placed state to another mesh with `eqshard.shard`, on 8 CPU devices.

A state of 16 float32 arrays (`--mib` in all, 256 MiB by default; the issue's
1 GiB with `--mib 1024`) is placed on a (2, 4) ('dp', 'tp') mesh, each array
split over both axes, then moved to:

- **(4, 2)**: the same devices, the other way round;
- **(8,)**: one axis over the 8 devices in reverse order;
- **subset**: a (2, 2) mesh of 4 of the devices.

For each target, in the same run: eqshard's `shard` (no bound), `shard` with
`donate=True` and `max_inflight_bytes` of one array's block, raw JAX (one
batched `jax.device_put(leaves, shardings)`, which has no memory bound), and a
checkpoint round trip (`eqshard.save` then `eqshard.restore` onto the target).
Each run starts from a freshly placed state (untimed); runs of the variants are
interleaved (`benchmarks/_timing.py`). Prints min and median seconds and the
ratios of the medians.

Then, each in a fresh process, the peak resident-memory growth of one move to
(4, 2): read from `/proc/self/status` (`VmHWM`, reset through `clear_refs`
after the state is placed), as a fraction of the state's bytes, with and
without `donate` and the bound.

    python benchmarks/bench_reshard.py               # 256 MiB, 3 runs
    python benchmarks/bench_reshard.py --mib 1024    # the issue's 1 GiB

All figures are CPU figures (8 virtual CPU devices of one host process).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import jax


jax.config.update("jax_num_cpu_devices", 8)

import numpy as np
from _timing import add_json_option, as_table, interleaved, table, write_json
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import eqshard


MiB = 2**20
ARRAYS = 16


def _mesh(shape, names, devices):
    grid = np.array(devices, dtype=object).reshape(shape)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def _meshes():
    devices = jax.devices()
    return {
        "(4, 2)": (_mesh((4, 2), ("dp", "tp"), devices), P("dp", "tp")),
        "(8,)": (_mesh((8,), ("dp",), devices[::-1]), P("dp")),
        "subset": (_mesh((2, 2), ("dp", "tp"), devices[2:6]), P("dp", "tp")),
    }


def _host_state(mib: int) -> list[np.ndarray]:
    rows = mib * MiB // ARRAYS // 4 // 1024
    rng = np.random.default_rng(0)
    return [rng.standard_normal((rows, 1024), np.float32) for _ in range(ARRAYS)]


def _placed(host: list[np.ndarray]) -> list[jax.Array]:
    source = _mesh((2, 4), ("dp", "tp"), jax.devices())
    return eqshard.shard(host, P("dp", "tp"), source)


def _block(host: list[np.ndarray], mesh: Mesh, spec: P) -> int:
    sharding = NamedSharding(mesh, spec)
    return int(np.prod(sharding.shard_shape(host[0].shape))) * 4


def _timings(host: list[np.ndarray], runs: int, directory: str) -> list[tuple]:
    rows = []
    for name, (mesh, spec) in _meshes().items():
        bound = _block(host, mesh, spec)
        shardings = [NamedSharding(mesh, spec)] * len(host)
        path = os.path.join(directory, name.strip("()").replace(", ", "x"))

        def save_restore(state, path=path, mesh=mesh, spec=spec):
            eqshard.save(path, state, overwrite=True)
            return eqshard.restore(path, state, spec, mesh)

        times = interleaved(
            {
                "shard": lambda s, m=mesh, p=spec: eqshard.shard(s, p, m),
                "bounded": lambda s, m=mesh, p=spec, b=bound: eqshard.shard(
                    s, p, m, donate=True, max_inflight_bytes=b
                ),
                "device_put": lambda s, sh=shardings: jax.device_put(s, sh),
                "save+restore": save_restore,
            },
            runs,
            setup=lambda: _placed(host),
        )
        rows.append((f"{name} shard / device_put", times["shard"], times["device_put"]))
        rows.append(
            (f"{name} donate+bound / device_put", times["bounded"], times["device_put"])
        )
        rows.append(
            (f"{name} shard / save+restore", times["shard"], times["save+restore"])
        )
    return rows


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_child(mib: int, bounded: bool) -> None:
    """In a fresh process: the peak RSS growth of one move to (4, 2), printed as
    JSON."""
    host = _host_state(mib)
    state = _placed(host)
    del host
    mesh, spec = _meshes()["(4, 2)"]
    bound = _block([np.empty((mib * MiB // ARRAYS // 4 // 1024, 1024))], mesh, spec)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    before = _status("VmRSS")
    if bounded:
        moved = eqshard.shard(state, spec, mesh, donate=True, max_inflight_bytes=bound)
    else:
        moved = eqshard.shard(state, spec, mesh)
    jax.block_until_ready(moved)
    print(json.dumps({"growth": _status("VmHWM") - before}))


def _peaks(mib: int) -> dict[str, float]:
    out = {}
    for name, bounded in (("plain", False), ("donate+bound", True)):
        result = subprocess.run(
            [sys.executable, __file__, "--peak", str(int(bounded)), "--mib", str(mib)],
            capture_output=True,
            text=True,
            check=True,
        )
        growth = json.loads(result.stdout.strip().splitlines()[-1])["growth"]
        out[name] = growth / (mib * MiB)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--peak", type=int, default=None, help=argparse.SUPPRESS)
    add_json_option(parser)
    args = parser.parse_args()
    if args.peak is not None:
        _peak_child(args.mib, bool(args.peak))
        return
    host = _host_state(args.mib)
    with tempfile.TemporaryDirectory(prefix="bench-reshard-") as directory:
        rows = _timings(host, args.runs, directory)
    print(f"A {args.mib} MiB state of {ARRAYS} arrays from a (2, 4) mesh (CPU):")
    moves = table(rows, theirs="other")
    peaks = _peaks(args.mib)
    print("Peak resident-memory growth of one move to (4, 2), fraction of the state:")
    for name, fraction in peaks.items():
        print(f"  {name:>14}: {fraction:.2f}")
    peak_rows = [(name, f"{fraction:.2f}") for name, fraction in peaks.items()]
    write_json(
        __file__,
        {"moves": moves, "peaks": as_table(("move", "growth / state"), peak_rows)},
        path=args.json,
    )


if __name__ == "__main__":
    main()
