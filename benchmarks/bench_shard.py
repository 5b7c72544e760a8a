"""Times eqshard's shard and gather against raw JAX on 8 virtual CPU devices.

A ~1 GiB float32 transformer-like parameter dict (embeddings, per-layer q/k/v/o
and MLP weights, layernorm scales and biases), held as host NumPy arrays, is
placed on a (2, 4) ('dp', 'tp') mesh with Auto axes and copied back:

- `eqshard.shard` against one raw `jax.device_put(leaves, shardings)` with the
  same `NamedSharding`s;
- `eqshard.gather` against raw `jax.device_get`;
- `eqshard.compat.make_shard_and_gather_fns` + `eqshard.tree_apply` against
  `jax.device_put` and `jax.device_get` called per leaf (no compilation allowed:
  every backend compile is counted);
- the peak resident memory of `gather`, raw `device_get` and `iter_gather`, each
  in a fresh subprocess (peak from /proc/self/status VmHWM, reset after setup);
- for contrast, on a small tree of 200 leaves, the fjformer approach of one
  `jax.jit(lambda x: x, out_shardings=s)` per leaf against `eqshard.shard`.

Each timing is the min and median of 5 runs (eqshard and raw JAX interleaved,
the garbage collector fixed: `benchmarks/_timing.py`), after one warm-up run;
arrays are deleted between runs. Run with
`python benchmarks/bench_shard.py` (about 1-2 minutes); `--layers` scales the tree
(16 layers is ~1 GiB). Exits non-zero if a target is missed.
"""

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jax


jax.config.update("jax_num_cpu_devices", 8)

import numpy as np
from _timing import (
    add_json_option,
    as_table,
    interleaved,
    once,
    Table,
    table,
    Times,
    write_json,
)
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqshard


MiB = 2**20
RUNS = 5
D_MODEL, D_MLP, VOCAB = 1024, 4096, 32768


# --------------------------------------------------------------------- the tree


def make_params(n_layers: int, seed: int = 0) -> dict[str, Any]:
    """A transformer-like parameter dict of host float32 arrays."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    def layernorm() -> dict[str, np.ndarray]:
        return {"scale": np.ones(D_MODEL, np.float32), "bias": w(D_MODEL)}

    layers = [
        {
            "ln1": layernorm(),
            "attn": {
                "q": w(D_MODEL, D_MODEL),
                "k": w(D_MODEL, D_MODEL),
                "v": w(D_MODEL, D_MODEL),
                "o": w(D_MODEL, D_MODEL),
            },
            "ln2": layernorm(),
            "mlp": {"up": w(D_MODEL, D_MLP), "down": w(D_MLP, D_MODEL)},
        }
        for _ in range(n_layers)
    ]
    return {
        "embed": w(VOCAB, D_MODEL),
        "layers": layers,
        "final_ln": layernorm(),
        "unembed": w(D_MODEL, VOCAB),
    }


def make_specs(params: dict[str, Any]) -> dict[str, Any]:
    """Megatron-like specs: matrices sharded over both axes, vectors replicated."""
    column = P("dp", "tp")  # input dim over dp, output dim over tp
    row = P("tp", "dp")

    def spec(path: Any, leaf: np.ndarray) -> P:
        name = eqshard.tree_path_to_string(path, sep="/")
        if leaf.ndim == 1:
            return P()
        if name.endswith(("attn/o", "mlp/down")) or name == "embed":
            return row
        return column

    return jax.tree_util.tree_map_with_path(spec, params)


def make_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)


def nbytes(tree: Any) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def delete(tree: Any) -> None:
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            x.delete()


# ------------------------------------------------------------------ measuring


COMPILES: list[str] = []


def _count_compiles(event: str, duration: float, **kwargs: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES.append(event)


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def compare(
    ours: Callable[..., Any],
    theirs: Callable[..., Any],
    setup: Callable[[], Any] | None = None,
    runs: int = RUNS,
) -> tuple[Times, Times, int]:
    """The times of `ours` and of `theirs`, interleaved after a warm-up of each,
    results deleted between runs; and the number of backend compiles during the
    timed runs of `ours`."""
    compiles = [0]

    def counted(*args: Any) -> Any:
        before = len(COMPILES)
        out = ours(*args)
        compiles[0] += len(COMPILES) - before
        return out

    for fn in (ours, theirs):  # warm up
        delete(once(fn, setup=setup)[1])
    times = interleaved(
        {"ours": counted, "theirs": theirs},
        runs,
        setup=setup,
        check=lambda name, out: delete(out),
        warmup=False,
    )
    return times["ours"], times["theirs"], compiles[0]


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def memory_child(mode: str, n_layers: int) -> None:
    """Run in a fresh process: shard the tree, drop the host copy, reset the peak,
    gather with `mode`, and print the peak above the baseline as JSON."""
    params = make_params(n_layers)
    tree_mib = nbytes(params) / MiB
    largest_mib = max(x.nbytes for x in jax.tree.leaves(params)) / MiB
    on_mesh = eqshard.shard(params, make_specs(params), make_mesh())
    jax.block_until_ready(on_mesh)
    del params
    gc.collect()
    baseline = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    host = None
    if mode == "gather":
        host = eqshard.gather(on_mesh)
    elif mode == "device_get":
        host = jax.device_get(on_mesh)
    elif mode == "iter_gather":
        for _, leaf in eqshard.iter_gather(on_mesh):
            del leaf  # a checkpoint writer would save it here
    else:
        raise ValueError(mode)
    peak = _status_mib("VmHWM") - baseline
    del host
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap pages back to the OS
    held = _status_mib("VmRSS") - baseline  # still resident with the result dropped
    print(
        json.dumps(
            {
                "peak_mib": peak,
                "held_mib": held,
                "baseline_mib": baseline,
                "tree_mib": tree_mib,
                "largest_mib": largest_mib,
            }
        )
    )


def memory(mode: str, n_layers: int) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--layers", str(n_layers)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        raise RuntimeError(f"memory child {mode} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------- main


Row = tuple[str, float, float | None, float | None, str, bool]


def _number(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() and abs(x) < 1e3 else f"{x:,.1f}"


def print_table(rows: list[Row]) -> Table:
    header = ("operation", "eqshard", "raw JAX", "ratio", "target", "result")
    body = [
        (
            name,
            _number(ours),
            "-" if raw is None else _number(raw),
            "-" if ratio is None else f"{ratio:.2f}x",
            target,
            "pass" if ok else "FAIL",
        )
        for name, ours, raw, ratio, target, ok in rows
    ]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    for i, row in enumerate([header, *body]):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    return as_table(header, body)


def main(n_layers: int, json_path: str | None = None) -> int:
    start = time.perf_counter()
    mesh = make_mesh()
    params = make_params(n_layers)
    specs = make_specs(params)
    leaves = jax.tree.leaves(params)
    shardings = [NamedSharding(mesh, s) for s in jax.tree.leaves(specs)]
    largest = max(x.nbytes for x in leaves) / MiB
    print(
        f"jax {jax.__version__}, {jax.device_count()} CPU devices, "
        f"mesh {dict(mesh.shape)}"
    )
    print(
        f"tree: {nbytes(params) / 2**30:.2f} GiB float32, {len(leaves)} leaves, "
        f"largest leaf {largest:.0f} MiB; {RUNS} runs\n"
    )
    rows: list[Row] = []
    timings: list[tuple[str, Times, Times, str, str]] = []
    compiles = 0

    def timing_row(name: str, limit: float, *args: Any) -> None:
        nonlocal compiles
        ours, raw, n = compare(*args)
        compiles += n
        ok = ours.median <= limit * raw.median
        timings.append((name, ours, raw, f"<= {limit}x", "pass" if ok else "FAIL"))

    def on_mesh() -> Any:  # fresh arrays for each gather: JAX caches host copies
        return jax.block_until_ready(eqshard.shard(params, specs, mesh))

    timing_row(
        "shard vs one device_put",
        1.1,
        lambda: eqshard.shard(params, specs, mesh),
        lambda: jax.device_put(leaves, shardings),
    )
    timing_row("gather vs device_get", 1.1, eqshard.gather, jax.device_get, on_mesh)
    before = len(COMPILES)
    shard_fns, gather_fns = eqshard.compat.make_shard_and_gather_fns(specs, mesh)
    compiles += len(COMPILES) - before
    # Per-leaf functions copy one leaf per call, on one thread: they are compared
    # with the same per-leaf calls by hand, which isolates their own overhead.
    timing_row(
        "tree_apply(shard_fns) vs device_put per leaf",
        1.5,
        lambda: eqshard.tree_apply(shard_fns, params),
        lambda: [jax.device_put(x, s) for x, s in zip(leaves, shardings)],
    )
    timing_row(
        "tree_apply(gather_fns) vs device_get per leaf",
        1.5,
        lambda x: eqshard.tree_apply(gather_fns, x),
        lambda x: [jax.device_get(leaf) for leaf in jax.tree.leaves(x)],
        on_mesh,
    )
    rows.append(
        ("backend compiles in the rows above", compiles, None, None, "0", not compiles)
    )

    # fjformer: a new jax.jit(lambda x: x, out_shardings=s) per leaf, small tree
    small = {f"w{i}": np.full((128, 256), i, np.float32) for i in range(200)}
    cycle = [P("dp", "tp"), P("tp", None), P()]
    small_specs = {k: cycle[i % 3] for i, k in enumerate(small)}
    small_shardings = {k: NamedSharding(mesh, s) for k, s in small_specs.items()}

    def jit_per_leaf() -> dict[str, jax.Array]:
        return {
            k: jax.jit(lambda x: x, out_shardings=small_shardings[k])(x)
            for k, x in small.items()
        }

    before = len(COMPILES)
    ours, raw, _ = compare(
        lambda: eqshard.shard(small, small_specs, mesh), jit_per_leaf
    )
    jit_compiles = len(COMPILES) - before
    ok = ours.median < raw.median
    timings.append(
        (
            "shard vs jit per leaf, 200 leaves",
            ours,
            raw,
            "< 1x",
            "pass" if ok else "FAIL",
        )
    )

    # peak resident memory above the baseline, a fresh process for each
    modes = ("gather", "device_get", "iter_gather")
    mem = {mode: memory(mode, n_layers) for mode in modes}
    peak = {mode: mem[mode]["peak_mib"] for mode in modes}
    tree_mib = mem["gather"]["tree_mib"]
    limit = tree_mib + largest
    rows.append(
        (
            "gather peak RSS over baseline [MiB]",
            peak["gather"],
            peak["device_get"],
            peak["gather"] / peak["device_get"],
            f"<= {limit:,.0f}",
            peak["gather"] <= limit,
        )
    )
    held = {mode: mem[mode]["held_mib"] for mode in modes}
    rows.append(
        (
            "RSS still held after `del host` [MiB]",
            held["gather"],
            held["device_get"],
            None,
            f"<= {largest:,.0f}",
            held["gather"] <= largest,
        )
    )
    rows.append(
        (
            "iter_gather peak RSS over baseline [MiB]",
            peak["iter_gather"],
            None,
            None,
            f"<= {2 * largest:,.0f}",
            peak["iter_gather"] <= 2 * largest,
        )
    )

    times = table(timings, unit="ms", theirs="raw JAX", columns=("target", "result"))
    print()
    others = print_table(rows)
    print(
        f"\nThe jit-per-leaf (fjformer) passes compiled {jit_compiles} times "
        f"({RUNS + 1} passes of 200 leaves).\nRSS baseline (process and the tree "
        f"on the mesh): {mem['gather']['baseline_mib']:,.0f} MiB; gather target = "
        f"tree ({tree_mib:,.0f} MiB) + largest leaf; iter_gather target = 2 x "
        f"largest leaf (one leaf on host at a time). Raw\njax.device_get caches "
        f"its host copy on each jax.Array, so it stays resident while the arrays "
        f"live.\n"
        f"total time {time.perf_counter() - start:.0f} s"
    )
    ok = all(ok for *_, ok in rows) and all(r[-1] == "pass" for r in timings)
    write_json(__file__, {"times": times, "others": others}, path=json_path)
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16, help="16 is ~1 GiB")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    add_json_option(parser)
    args = parser.parse_args()
    if args.child:
        memory_child(args.child, args.layers)
    else:
        sys.exit(main(args.layers, args.json))
