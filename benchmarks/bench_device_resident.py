"""Times `eqshard.shard` of trees already on devices against raw JAX, on 8 CPU devices.

60 float32 arrays of 60 distinct shapes (~65 MiB) are placed on a (2, 4)
('dp', 'tp') mesh with Auto axes, each split over both axes, from:

- **one device**: every array on device 0, as an eager model is made;
- **(4, 2) mesh**: every array on a (4, 2) mesh whose devices are in another
  order (as a mesh built for other hardware, or a restore, can be), split the
  other way;
- **cast to bf16**: the arrays already on the (2, 4) mesh, cast with `dtype=`;
- **replicated**: the arrays whole on every device of the (2, 4) mesh;
- **NumPy**: the same arrays as host NumPy data (eqshard's fast path, which must
  stay at raw `device_put` speed).

Each variant is compared with raw JAX in the same run: one batched
`jax.device_put(leaves, shardings)` (for the cast: `astype` per leaf, then
`device_put`), and, for device-resident data, the two ways around it: a host
round trip by hand (`jax.device_put(jax.device_get(leaves), shardings)`, with
`astype` on host for the cast) and one batched `jax.jit` identity with
`out_shardings` over the whole tree (possible only where inputs and outputs share
their devices, in the same order). Every run starts cold (`jax.clear_caches()`: a
model is sharded once, so the first call is the one that counts) on fresh source
arrays (`jax.device_get` caches its host copy on the arrays it reads, which would
spare later runs of the round trip its first copy), with the garbage collector
fixed (`benchmarks/_timing.py`); runs of the variants are interleaved. XLA backend
compilations are counted with `jax.monitoring`. Prints, for each hand-written
route, the min and median seconds of eqshard and of the route, their ratios, and
eqshard's compile count in the last run.

    python benchmarks/bench_device_resident.py            # 5 runs, ~3-4 minutes
    python benchmarks/bench_device_resident.py --runs 3    # quicker

Exits non-zero if a target is missed: eqshard >= 20x faster than raw `device_put`
from one device with at most one compilation, and within 1.5x of it on NumPy.
"""

import argparse
import sys
from collections.abc import Callable
from typing import Any

import jax


jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
import numpy as np
from _timing import add_json_option, interleaved, table, write_json
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import eqshard


MiB = 2**20
_compiles = [0]


def _listen(event: str, duration: float, **kwargs: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_listen)


def make_values(count: int = 60) -> list[np.ndarray]:
    """`count` float32 arrays of distinct shapes, each divisible by (2, 4)."""
    rng = np.random.default_rng(0)
    shapes = [(8 * (30 + i), 8 * (65 + (7 * i) % 20)) for i in range(count)]
    return [rng.standard_normal(s, dtype=np.float32) for s in shapes]


def counted(fn: Callable[[Any], Any], compiles: dict[str, int], name: str):
    """`fn`, recording in `compiles[name]` the compilations of its last call."""

    def run(sources: Any) -> Any:
        before = _compiles[0]
        out = fn(sources)
        compiles[name] = _compiles[0] - before
        return out

    return run


def check(out: list[jax.Array], want: list[np.ndarray], shardings: list[Any]):
    for array, value, sharding in zip(out, want, shardings, strict=True):
        assert array.sharding == sharding, (array.sharding, sharding)
        assert np.asarray(array).tobytes() == value.tobytes()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    add_json_option(parser)
    args = parser.parse_args()

    auto = (AxisType.Auto,) * 2
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=auto)
    permuted = np.array(jax.devices())[[6, 1, 4, 3, 2, 5, 0, 7]].reshape(4, 2)
    other = Mesh(permuted, ("dp", "tp"), axis_types=auto)
    values = make_values()
    total = sum(v.nbytes for v in values)
    spec = P("dp", "tp")
    target = [NamedSharding(mesh, spec)] * len(values)
    bf16 = [v.astype(jnp.bfloat16) for v in values]

    identity = jax.jit(lambda xs: xs, out_shardings=target)
    cast_identity = jax.jit(
        lambda xs: [x.astype(jnp.bfloat16) for x in xs], out_shardings=target
    )

    def on(where: Any) -> Callable[[], list[jax.Array]]:
        """Fresh arrays for each run: `jax.device_get` caches its host copy on the
        arrays it reads, which would spare later runs of a host round trip."""
        return lambda: jax.device_put(values, [where] * len(values))

    def round_trip(xs: list[jax.Array]) -> list[jax.Array]:
        return jax.device_put(jax.device_get(xs), target)

    def cast_round_trip(xs: list[jax.Array]) -> list[jax.Array]:
        host = [x.astype(jnp.bfloat16) for x in jax.device_get(xs)]
        return jax.device_put(host, target)

    def ours(xs: list[Any]) -> list[jax.Array]:
        return eqshard.shard(xs, spec, mesh)

    # case -> (the sources, [(name, fn of the sources, expected values)]), raw
    # device_put first and eqshard last.
    Variant = tuple[str, Callable[[Any], Any], list[np.ndarray]]
    variants: dict[str, tuple[Callable[[], Any], list[Variant]]] = {
        "one device -> (2, 4)": (
            on(jax.devices()[0]),
            [
                ("raw device_put", lambda xs: jax.device_put(xs, target), values),
                ("host round trip by hand", round_trip, values),
                ("eqshard.shard", ours, values),
            ],
        ),
        "(4, 2) permuted -> (2, 4)": (
            on(NamedSharding(other, P("tp", "dp"))),
            [
                ("raw device_put", lambda xs: jax.device_put(xs, target), values),
                ("host round trip by hand", round_trip, values),
                ("eqshard.shard", ours, values),
            ],
        ),
        "cast to bf16 on (2, 4)": (
            on(target[0]),
            [
                (
                    "raw astype + device_put",
                    lambda xs: jax.device_put(
                        [x.astype(jnp.bfloat16) for x in xs], target
                    ),
                    bf16,
                ),
                ("one jit (cast + out_shardings)", cast_identity, bf16),
                ("host round trip by hand", cast_round_trip, bf16),
                (
                    "eqshard.shard(dtype=)",
                    lambda xs: eqshard.shard(xs, spec, mesh, dtype=jnp.bfloat16),
                    bf16,
                ),
            ],
        ),
        "(2, 4) replicated -> (2, 4) split": (
            on(NamedSharding(mesh, P())),
            [
                ("raw device_put", lambda xs: jax.device_put(xs, target), values),
                ("one jit (out_shardings)", identity, values),
                ("host round trip by hand", round_trip, values),
                ("eqshard.shard", ours, values),
            ],
        ),
        "NumPy -> (2, 4)": (
            lambda: values,
            [
                ("raw device_put", lambda xs: jax.device_put(xs, target), values),
                ("eqshard.shard", ours, values),
            ],
        ),
    }

    print(
        f"{len(values)} float32 arrays of distinct shapes, {total / MiB:.0f} MiB, "
        f"to P('dp', 'tp') on a (2, 4) mesh; {args.runs} cold runs each"
    )
    rows = []
    ratios: dict[str, float] = {}  # case -> raw median / eqshard median
    compiled: dict[str, int] = {}  # case -> eqshard's compilations
    for case, (sources, variants_of_case) in variants.items():
        compiles: dict[str, int] = {}
        wants = {name: want for name, _, want in variants_of_case}
        times = interleaved(
            {name: counted(fn, compiles, name) for name, fn, _ in variants_of_case},
            args.runs,
            setup=sources,
            before=jax.clear_caches,
            check=lambda name, out, wants=wants: check(out, wants[name], target),
            warmup=False,
        )
        *routes, (ours, _, _) = variants_of_case
        for name, _, _ in routes:
            rows.append(
                (f"{case}, vs {name}", times[ours], times[name], compiles[ours])
            )
        ratios[case] = times[routes[0][0]].median / times[ours].median
        compiled[case] = compiles[ours]
    main_table = table(rows, theirs="by hand", columns=("compiles",))
    write_json(__file__, {"main": main_table}, path=args.json)
    failed = []
    if ratios["one device -> (2, 4)"] < 20:
        failed.append("one device: eqshard under 20x faster than raw device_put")
    failed += [f"{c}: eqshard compiled {n} times" for c, n in compiled.items() if n > 1]
    if ratios["NumPy -> (2, 4)"] < 1 / 1.5:
        failed.append("NumPy: eqshard over 1.5x raw device_put")
    for line in failed:
        print(f"target missed: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
