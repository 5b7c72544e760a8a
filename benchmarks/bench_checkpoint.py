"""Times checkpoint reads against the raw libraries, on 8 virtual CPU devices.

- **orbax restore onto another mesh.** A tree of `--mib` MiB (float32 leaves of
  `--leaf-mib` MiB) is saved with `eqshard.save` from a (4, 2) ('dp', 'tp') mesh
  and restored onto a (2, 4) one: `eqshard.restore(dir, like, specs, mesh)`
  against `orbax.checkpoint.StandardCheckpointer().restore(dir, target)` with a
  target of `jax.ShapeDtypeStruct`s built by hand. Both run back to back in one
  process, `--runs` times each, the garbage collector fixed
  (`benchmarks/_timing.py`).
- **safetensors into a sharded tree.** The same tree in one `.safetensors` file:
  `eqshard.load_safetensors(file, like, specs, mesh)` against
  `safetensors.numpy.load_file(file)` then `eqshard.shard`. Each run is a fresh
  subprocess, which reports its time and its memory above the baseline taken
  after imports: the peak of the resident set (`VmHWM`) and the peak of its
  anonymous part (sampled every 2 ms; file pages mapped by safetensors are page
  cache the kernel can drop), and what stays resident after the load (the
  sharded result itself lives in host memory on CPU devices). "Transient" is the
  anonymous peak minus what stays: the host memory the load needs beyond its
  result. The children run with `MALLOC_MMAP_THRESHOLD_=131072`, so that freed
  blocks return to the OS and "resident after" is the result itself. Each
  child first touches and frees twice the file's bytes (`_touch`: on a virtual
  machine that returns freed memory to its host, a first touch costs ~10x), so
  that both routes read the file warm in the page cache into memory backed
  alike. The rate (GB/s), CPU time (user + sys, every thread) and the cores
  this process may run on are printed with the times.

Prints min and median of each and their ratios. Run with
`python benchmarks/bench_checkpoint.py` (a few minutes; `--mib 256` for a quick
look). Files go to a temporary directory that is removed at the end.
"""

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _timing import (
    add_json_option,
    as_table,
    interleaved,
    once,
    table,
    Times,
    write_json,
)


def _setup_jax() -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)


def _mesh(shape: tuple[int, ...]):
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    grid = np.array(jax.devices(), dtype=object).reshape(shape)
    return Mesh(grid, ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)


def _tree(mib: int, leaf_mib: int):
    import numpy as np

    side = int((leaf_mib * 2**20 // 4) ** 0.5)
    count = max(1, mib // leaf_mib)
    rng = np.random.default_rng(0)
    return {
        f"layer{k:02d}": {
            "weight": rng.standard_normal((side, side), dtype=np.float32),
            "bias": rng.standard_normal((side,), dtype=np.float32),
        }
        for k in range(count)
    }


def _specs(tree):
    from jax.sharding import PartitionSpec as P

    return {k: {"weight": P("dp", "tp"), "bias": P("tp")} for k in tree}


# ---------------------------------------------------------------------------------
# The safetensors cases, each in its own process (for its memory).
# ---------------------------------------------------------------------------------


def _rss() -> tuple[int, int, int]:
    """(VmRSS, VmHWM, RssAnon) of this process, in bytes."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"], fields["RssAnon"]


def _touch(nbytes: int) -> None:
    """Touches `nbytes` of fresh memory and frees it, then restarts the peak of
    the resident set (`VmHWM`). In a virtual machine that hands freed memory
    back to its host (this project's machine: virtio-balloon), memory the host
    has to back again costs ~2 ms per MiB on its first touch, 10x a touch of
    memory freed just before: so both routes start with what they allocate
    backed, rather than paying for it in turn with what ran before them."""
    import numpy as np

    warm = np.ones(nbytes, np.uint8)
    del warm
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set, from here


def _child(case: str, path: str, mib: int, leaf_mib: int) -> None:
    import threading

    _setup_jax()
    import jax
    import safetensors.numpy

    import eqshard

    mesh = _mesh((2, 4))
    like = eqshard.abstract(_tree(1, 1))  # compile nothing; warm the imports
    del like
    tree_like = None
    with open(path, "rb") as f:  # the shapes, from the file's header
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    tree_like = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        layer, leaf = name.split(".")
        tree_like.setdefault(layer, {})[leaf] = jax.ShapeDtypeStruct(
            tuple(info["shape"]), "float32"
        )
    specs = _specs(tree_like)
    _touch(2 * os.path.getsize(path))
    gc.collect()
    base_rss, _, base_anon = _rss()
    peak_anon = [base_anon]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak_anon[0] = max(peak_anon[0], _rss()[2])
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    def load():
        if case == "eqshard":
            return eqshard.load_safetensors(path, tree_like, specs, mesh)
        flat = safetensors.numpy.load_file(path)
        return eqshard.shard(eqshard.unflatten_tree(flat, sep="."), specs, mesh)

    cpu = time.process_time()
    seconds, out = once(load)
    cpu = time.process_time() - cpu
    gc.collect()
    stop.set()
    sampler.join()
    rss, hwm, anon = _rss()
    peak_anon[0] = max(peak_anon[0], anon)
    print(
        json.dumps(
            {
                "seconds": seconds,
                "cpu": cpu,
                "peak": hwm - base_rss,
                "peak_anon": peak_anon[0] - base_anon,
                "after": rss - base_rss,
            }
        )
    )


def _run_child(case: str, path: str, args: argparse.Namespace) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            case,
            path,
            str(args.mib),
            str(args.leaf_mib),
        ],
        check=True,
        capture_output=True,
        text=True,
        # A fixed mmap threshold: freed blocks go back to the OS at once, so what
        # stays resident is the result (glibc's adaptive threshold otherwise
        # keeps ~0.2x of the tree in freed heap after 8 MiB blocks).
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------
# The parent: orbax in process, safetensors in children.
# ---------------------------------------------------------------------------------


def _mib(values: list[float]) -> str:
    return f"{min(values) / 2**20:.0f} / {statistics.median(values) / 2**20:.0f}"


def _transient(run: dict) -> float:
    return run["peak_anon"] - run["after"]


def _row(name: str, values: list[float], unit: str = "s") -> str:
    scale = 1 if unit == "s" else 2**20
    lo, mid = min(values) / scale, statistics.median(values) / scale
    return f"{name:<46} {lo:>10.3f} {mid:>10.3f} {unit}"


def _restore_table(host, specs, work, runs):
    """orbax: saved from (4, 2), restored onto (2, 4), by eqshard and by hand."""
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding

    import eqshard

    saved_on, restored_on = _mesh((4, 2)), _mesh((2, 4))
    ckpt = os.path.join(work, "ckpt")
    eqshard.save(ckpt, eqshard.shard(host, specs, saved_on))
    like = eqshard.abstract(host)
    target = {
        f"{layer}/{leaf}": jax.ShapeDtypeStruct(
            x.shape,
            x.dtype,
            sharding=NamedSharding(restored_on, specs[layer][leaf]),
        )
        for layer, leaves in host.items()
        for leaf, x in leaves.items()
    }

    def by_orbax():
        checkpointer = ocp.StandardCheckpointer()
        try:
            return checkpointer.restore(ckpt, target)
        finally:
            checkpointer.close()

    def by_eqshard():
        return eqshard.restore(ckpt, like, specs, restored_on)

    times = interleaved({"ours": by_eqshard, "orbax": by_orbax}, runs)
    print()
    result = table(
        [
            (
                "restore (4, 2) -> (2, 4) (target <= 1.05)",
                times["ours"],
                times["orbax"],
            )
        ],
        theirs="orbax, target by hand",
    )
    shutil.rmtree(ckpt)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--leaf-mib", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--child", nargs=4)
    parser.add_argument(
        "--only-safetensors", action="store_true", help="skip the orbax restore"
    )
    add_json_option(parser)
    args = parser.parse_args()
    if args.child:
        case, path, mib, leaf_mib = args.child
        _child(case, path, int(mib), int(leaf_mib))
        return

    _setup_jax()
    import jax
    import safetensors.numpy

    work = tempfile.mkdtemp(prefix="bench_checkpoint_")
    try:
        host = _tree(args.mib, args.leaf_mib)
        specs = _specs(host)
        total = sum(x.nbytes for x in jax.tree.leaves(host))
        largest = max(x.nbytes for x in jax.tree.leaves(host))
        print(
            f"tree: {total / 2**20:.0f} MiB in {len(jax.tree.leaves(host))} arrays, "
            f"largest {largest / 2**20:.0f} MiB; {args.runs} runs; min / median"
        )

        tables = {}
        if not args.only_safetensors:
            tables["restore"] = _restore_table(host, specs, work, args.runs)

        # safetensors: one file, read in a fresh process per run.
        file = os.path.join(work, "model.safetensors")
        safetensors.numpy.save_file(
            {f"{l}.{n}": x for l, leaves in host.items() for n, x in leaves.items()},
            file,
        )
        del host
        gc.collect()
        runs: dict[str, list[dict]] = {"eqshard": [], "raw": []}
        for _ in range(args.runs):
            for case in runs:
                runs[case].append(_run_child(case, file, args))
        print("\nsafetensors file -> (2, 4) mesh (each run a fresh process)")
        labels = {
            "eqshard": "eqshard.load_safetensors",
            "raw": "safetensors.numpy.load_file + eqshard.shard",
        }
        print()
        tables["safetensors"] = table(
            [
                (
                    "load_safetensors (target <= 0.8)",
                    Times(tuple(r["seconds"] for r in runs["eqshard"])),
                    Times(tuple(r["seconds"] for r in runs["raw"])),
                )
            ],
            theirs="load_file + shard",
        )
        cores = len(os.sched_getaffinity(0))

        def median(case: str, key: str) -> float:
            return statistics.median(r[key] for r in runs[case])

        def least(case: str, key: str) -> float:
            return min(r[key] for r in runs[case])

        tables["safetensors_rate"] = as_table(
            (
                "route",
                "GB/s (median / best)",
                "CPU s (min / median)",
                "x CPU (min / median)",
                "cores",
            ),
            [
                (
                    labels[case],
                    f"{total / 1e9 / median(case, 'seconds'):.2f} / "
                    f"{total / 1e9 / least(case, 'seconds'):.2f}",
                    f"{least(case, 'cpu'):.3f} / {median(case, 'cpu'):.3f}",
                    f"{least(case, 'cpu') / least('raw', 'cpu'):.2f} / "
                    f"{median(case, 'cpu') / median('raw', 'cpu'):.2f}",
                    str(cores),
                )
                for case in labels
            ],
        )
        for case, label in labels.items():
            print(
                f"{label}: {total / 1e9 / median(case, 'seconds'):.2f} GB/s "
                f"(best {total / 1e9 / least(case, 'seconds'):.2f}), CPU "
                f"{least(case, 'cpu'):.3f} / {median(case, 'cpu'):.3f} s "
                f"(min / median; {cores} cores)"
            )
        for case, label in labels.items():
            got = runs[case]
            print(label)
            print(_row("  peak RSS added (VmHWM)", [r["peak"] for r in got], "MiB"))
            print(
                _row("  peak anonymous RSS added", [r["peak_anon"] for r in got], "MiB")
            )
            print(
                _row("  resident after (the result)", [r["after"] for r in got], "MiB")
            )
            print(
                _row(
                    "  transient (peak anon - result)",
                    [r["peak_anon"] - r["after"] for r in got],
                    "MiB",
                )
            )
        print(f"{'largest leaf + 10% (MiB)':<46} {largest * 1.1 / 2**20:>10.3f}")
        tables["safetensors_memory"] = as_table(
            ("MiB added, min / median", *labels.values()),
            [
                (what, *(_mib([key(r) for r in runs[case]]) for case in labels))
                for what, key in (
                    ("peak RSS (VmHWM)", lambda r: r["peak"]),
                    ("peak anonymous", lambda r: r["peak_anon"]),
                    ("resident after (the result)", lambda r: r["after"]),
                    ("transient (peak anonymous - result)", _transient),
                )
            ],
        )
        write_json(__file__, tables, path=args.json)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
