"""How eqshard's paths grow with the number of leaves and with the bytes.

Two sweeps on a (2, 4) `('dp', 'tp')` mesh of 8 CPU devices, each case timed
through `_timing.interleaved` against the hand-written route where there is one:

- **Leaves** (1k, 10k, 100k float32 leaves of 256 elements, 1 KiB each, so the
  bytes stay small and the per-leaf work shows): `shard` against one
  `jax.device_put` of the leaves, `gather` against `jax.device_get` (fresh
  arrays each run: JAX caches host copies on arrays), `match_partition_rules`
  (10 rules, abstract leaves), `plan_training` with AdamW (abstract), and
  `analyze_step` of a step that scales every leaf (1k and 10k only: it compiles
  the step, and XLA's compile of 100k parameters takes minutes).
- **Bytes** (64 MiB to 2 GiB in 16 leaves, split by rows, each 16 bytes past a
  64-byte boundary as NumPy allocates large arrays, so that raw `device_put`
  copies them too): `shard` and `gather` against `device_put` and
  `device_get`, in seconds per GiB.

Run: `python benchmarks/bench_scaling.py [--runs 3] [--max-gib 2]`.
"""

import argparse
import math

import jax


jax.config.update("jax_num_cpu_devices", 8)

import numpy as np
import optax
from _timing import add_json_option, interleaved, table, write_json
from jax.sharding import NamedSharding, PartitionSpec as P

import eqshard


RULES = [
    (r"attn/q/\d+$", P("tp")),
    (r"attn/k/\d+$", P("tp")),
    (r"attn/v/\d+$", P("tp")),
    (r"attn/o/\d+$", P(None)),
    (r"mlp/up/\d+$", P("tp")),
    (r"mlp/down/\d+$", P("dp")),
    (r"ln/norm/\d+$", P()),
    (r"embed/\d+$", P("dp")),
    (r"head/\d+$", P("tp")),
    (".*", P()),
]
GROUPS = ("attn/q", "attn/k", "attn/v", "attn/o", "mlp/up", "mlp/down", "ln/norm")


def leaves_tree(count: int, size: int) -> dict:
    """`count` host float32 leaves of `size` elements, in groups the rules name."""
    per = math.ceil(count / len(GROUPS))
    rng = np.random.default_rng(0)
    tree: dict = {}
    made = 0
    for group in GROUPS:
        outer, inner = group.split("/")
        n = min(per, count - made)
        block = rng.standard_normal((n, size), dtype=np.float32)
        tree.setdefault(outer, {})[inner] = list(block)
        made += n
    return tree


def abstract(tree: dict) -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def shard_and_gather(host, specs, mesh, runs):
    """`shard` against one `device_put` of the leaves, and `gather` against
    `device_get` of fresh arrays each run (JAX caches host copies on arrays);
    returns both `Times` and the last tree placed."""
    leaves = jax.tree.leaves(host)
    shardings = [
        NamedSharding(mesh, s)
        for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    ]
    placed = [eqshard.shard(host, specs, mesh)]

    def fresh():
        placed[0] = eqshard.shard(host, specs, mesh)

    put = interleaved(
        {
            "eqshard": lambda: eqshard.shard(host, specs, mesh),
            "raw": lambda: jax.device_put(leaves, shardings),
        },
        runs,
    )
    get = interleaved(
        {
            "eqshard": lambda: eqshard.gather(placed[0]),
            "raw": lambda: jax.device_get(jax.tree.leaves(placed[0])),
        },
        runs,
        before=fresh,
        warmup=False,
    )
    return put, get, placed[0]


def leaf_rows(mesh, counts, runs):
    rows = []
    for count in counts:
        host = leaves_tree(count, 256)
        shapes = abstract(host)
        specs = eqshard.match_partition_rules(RULES, shapes)
        put, get, placed = shard_and_gather(host, specs, mesh, runs)
        match = interleaved(
            {"eqshard": lambda: eqshard.match_partition_rules(RULES, shapes)}, runs
        )
        plan = interleaved(
            {
                "eqshard": lambda: eqshard.plan_training(
                    shapes, specs, mesh, optimizer=optax.adamw(1e-3)
                )
            },
            runs,
        )
        per = f"{count // 1000}k leaves"
        rows += [
            (f"shard, {per}", put["eqshard"], put["raw"], _per_leaf(put, count)),
            (f"gather, {per}", get["eqshard"], get["raw"], _per_leaf(get, count)),
            (f"match rules, {per}", match["eqshard"], None, _per_leaf(match, count)),
            (f"plan_training, {per}", plan["eqshard"], None, _per_leaf(plan, count)),
        ]
        if count <= 10_000:
            args = placed

            def step(params):
                return jax.tree.map(lambda x: 2 * x, params)

            report = interleaved(
                {
                    "eqshard": lambda: eqshard.analyze_step(jax.jit(step), args),
                    "raw": lambda: jax.jit(step).lower(args).compile(),
                },
                max(2, runs // 2),
                before=jax.clear_caches,
                warmup=False,
                block=False,
            )
            rows.append(
                (
                    f"analyze_step, {per}",
                    report["eqshard"],
                    report["raw"],
                    _per_leaf(report, count),
                )
            )
    return rows


def _per_leaf(times, count: int) -> str:
    return f"{times['eqshard'].median / count * 1e6:.1f} us"


def byte_rows(mesh, sizes_mib, runs):
    rows = []
    for mib in sizes_mib:
        # 16 leaves of (rows, 1024) float32, sharded over both axes.
        rows_per = mib * 2**20 // (16 * 1024 * 4)
        rng = np.random.default_rng(0)
        first = rng.standard_normal((rows_per, 1024), dtype=np.float32)
        host = [_off_64_bytes(first + i) for i in range(16)]
        specs = [P(("dp", "tp"))] * 16
        put, get, _ = shard_and_gather(host, specs, mesh, runs)
        gib = mib / 1024
        rows += [
            (f"shard, {mib} MiB", put["eqshard"], put["raw"], _per_gib(put, gib)),
            (f"gather, {mib} MiB", get["eqshard"], get["raw"], _per_gib(get, gib)),
        ]
    return rows


def _off_64_bytes(x: np.ndarray) -> np.ndarray:
    """A copy of `x` starting 16 bytes past a 64-byte boundary, as NumPy places
    large arrays (after its allocation header): the same every run. On CPU,
    `device_put` takes a 64-byte aligned array's dense blocks in place, sharing
    the caller's memory, where `shard` copies them; this keeps both copying."""
    raw = np.empty(x.nbytes + 128, np.uint8)
    start = -raw.ctypes.data % 64 + 16
    out = raw[start : start + x.nbytes].view(x.dtype).reshape(x.shape)
    out[...] = x
    return out


def _per_gib(times, gib: float) -> str:
    return f"{times['eqshard'].median / gib:.3f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-gib", type=float, default=2.0)
    add_json_option(parser)
    options = parser.parse_args()
    mesh = eqshard.create_mesh((2, 4), ("dp", "tp"))
    print(f"jax {jax.__version__}, {jax.device_count()} CPU devices, mesh (2, 4)")
    print(f"{options.runs} runs per case; CPU figures (8 virtual devices, 2 cores)\n")
    leaves = table(
        leaf_rows(mesh, (1_000, 10_000, 100_000), options.runs),
        theirs="raw JAX",
        columns=("per leaf",),
    )
    print()
    sizes = [64 * 4**i for i in range(5) if 64 * 4**i <= options.max_gib * 1024]
    rows = byte_rows(mesh, sizes, options.runs)
    nbytes = table(rows, theirs="raw JAX", columns=("per GiB",))
    write_json(__file__, {"leaves": leaves, "bytes": nbytes}, path=options.json)


if __name__ == "__main__":
    main()
