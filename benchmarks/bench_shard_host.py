"""Times `eqshard.shard` of NumPy data against the safe hand-written route, on 8
virtual CPU devices and a (2, 4) ('dp', 'tp') mesh with Auto axes.

`shard` returns only once the devices have finished reading the caller's buffer,
and never leaves a device buffer in it, so the caller may write the buffer at
once. By hand, the same promise takes a private copy and a wait:
`jax.device_put(np.array(x, copy=True), sharding)` then
`jax.block_until_ready`. Raw `jax.device_put(x, sharding)` is not compared: it
returns before its transfers are done, and on CPU may keep a replicated source
as the device buffer itself.

Cases: `P("dp")`, `P("dp", "tp")` and `P()` at 16 and 64 MiB of float32, from an
array NumPy allocated (as a loader's is). Each case runs both routes in turn
`--runs` times with the garbage collector fixed (`benchmarks/_timing.py`; both
are blocked on before the clock stops), and prints the min and median of each
and their ratios (target: a median ratio at or under 1.1), and writes them as
JSON (`--json PATH`, by default `benchmarks/results/bench_shard_host.json`). Run with
`python benchmarks/bench_shard_host.py` (under a minute).

The hand route's cost depends on where the C allocator puts `np.array`'s copy:
on a 64-byte boundary, the CPU devices take it in place; elsewhere `device_put`
copies it again for each device that holds a block (9 copies for `P()`). Which
happens varies from round to round (recycled or fresh memory), so each case is
split into the rounds where the hand copy was aligned and those where it was
not, each row with its count; the aligned rows are the hand route at its best.
"""

import argparse

import jax


jax.config.update("jax_num_cpu_devices", 8)

import numpy as np
from _timing import add_json_option, interleaved, table, Times, write_json
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqshard


def by_hand(x: np.ndarray, sharding: NamedSharding, aligned: list[bool]) -> jax.Array:
    copy = np.array(x, copy=True)
    aligned.append(copy.ctypes.data % 64 == 0)  # XLA:CPU then uses it in place
    return jax.block_until_ready(jax.device_put(copy, sharding))


def by_state(case: str, times: dict[str, Times], aligned: list[bool]) -> list[tuple]:
    """One row per state of the hand route's copy (aligned or not) that occurred,
    from the rounds in that state (each round runs both routes)."""
    rows = []
    for state, name in ((True, "aligned"), (False, "unaligned")):
        rounds = [i for i, a in enumerate(aligned) if a is state]
        if rounds:
            pick = lambda t: Times(tuple(t.seconds[i] for i in rounds))  # noqa: E731
            label = f"{case}, hand copy {name} ({len(rounds)} of {len(aligned)})"
            rows.append((label, pick(times["eqshard"]), pick(times["by hand"])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64], help="MiB")
    add_json_option(parser)
    args = parser.parse_args()
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    rows = []
    for mib in args.sizes:
        host = np.arange(mib << 18, dtype=np.float32).reshape(-1, 1024)
        for spec in (P("dp"), P("dp", "tp"), P()):
            sharding = NamedSharding(mesh, spec)

            def check(name: str, out: jax.Array, host: np.ndarray = host) -> None:
                first = out.addressable_shards[0]
                assert out.sharding == sharding, name
                np.testing.assert_array_equal(np.asarray(first.data), host[first.index])

            aligned: list[bool] = []
            times = interleaved(
                {
                    "eqshard": lambda x, s=sharding: eqshard.shard(x, s),
                    "by hand": lambda x, s=sharding, a=aligned: by_hand(x, s, a),
                },
                args.runs,
                setup=lambda h=host: h,
                check=check,
            )
            rows += by_state(f"shard {mib} MiB {spec}", times, aligned[1:])
    result = table(rows, unit="ms", theirs="copy+put+block")
    write_json(__file__, {"main": result}, path=args.json)


if __name__ == "__main__":
    main()
