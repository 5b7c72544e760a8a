"""Per-call dispatch overhead of `eqshard.t5x.PartitionedFn`.

Compares a partitioned function against `jax.jit` with the same shardings and
against `eqx.filter_jit`, on 8 virtual CPU devices:

- **matmul**: a small sharded matmul whose arguments are two arrays.
- **module**: a 200-array-leaf Equinox module (100 linear layers with activation
  functions as non-array leaves) and an array. `jax.jit` cannot take the module
  itself, so its row calls it on the module's arrays alone (`eqx.partition`
  done once, outside the timing): the floor any filtering wrapper is measured
  against.

Every variant is warmed up, then timed in `--runs` rounds of `--calls` calls,
the variants round-robin in rotating order (so load on the machine hits all of
them alike), with the garbage collector fixed (`benchmarks/_timing.py`). Each
call is timed from the call to its return, without waiting for the computation;
the result is waited for outside the timing, so the queue of work never grows.
The table gives the min and median over the rounds of the microseconds per call,
and the ratios to `jax.jit`. `eqx.filter_jit` waits for a
marker output on every call, so its time includes running the computation; that
is part of its overhead.

Targets: within 1.05x of `jax.jit` for arrays; at or below `eqx.filter_jit` for
modules.

    python benchmarks/bench_partitioner.py [--calls 400] [--runs 5]
"""

import argparse
from functools import partial

import jax


jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from _timing import add_json_option, interleaved, table, write_json
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqshard


class Stack(eqx.Module):
    layers: list[eqx.nn.Linear]
    activations: list

    def __call__(self, x):
        for layer, activation in zip(self.layers, self.activations):
            x = activation(layer(x))
        return x


def _matmul(mesh, partitioner):
    x_sharding = NamedSharding(mesh, P("data", None))
    w_sharding = NamedSharding(mesh, P(None, "model"))
    out_sharding = NamedSharding(mesh, P("data", "model"))
    x = jax.device_put(np.ones((16, 8), np.float32), x_sharding)
    w = jax.device_put(np.ones((8, 8), np.float32), w_sharding)

    def matmul(x, w):
        return x @ w

    raw = jax.jit(
        matmul, in_shardings=(x_sharding, w_sharding), out_shardings=out_sharding
    )
    partitioned = partitioner.partition(
        matmul, (P("data", None), P(None, "model")), P("data", "model")
    )
    filtered = eqx.filter_jit(matmul)
    return {
        "jax.jit": (raw, (x, w)),
        "PartitionedFn": (partitioned, (x, w)),
        "eqx.filter_jit": (filtered, (x, w)),
    }


def _module(mesh, partitioner):
    keys = jax.random.split(jax.random.key(0), 100)
    model = Stack(
        [eqx.nn.Linear(8, 8, key=k) for k in keys],
        [jax.nn.relu if i % 2 else jnp.tanh for i in range(100)],
    )
    assert len(jax.tree.leaves(eqx.filter(model, eqx.is_array))) == 200
    replicated = NamedSharding(mesh, P())
    x_sharding = NamedSharding(mesh, P("data", None))
    model = eqshard.shard(model, P(), mesh)
    x = jax.device_put(np.ones((16, 8), np.float32), x_sharding)

    def apply(model, x):
        return jax.vmap(model)(x)

    arrays, static = eqx.partition(model, eqx.is_array)

    def apply_arrays(arrays, x):
        return apply(eqx.combine(arrays, static), x)

    raw = jax.jit(
        apply_arrays,
        in_shardings=(replicated, x_sharding),
        out_shardings=x_sharding,
    )
    partitioned = partitioner.partition(apply, (P(), P("data", None)), P("data"))
    filtered = eqx.filter_jit(apply)
    return {
        "jax.jit": (raw, (arrays, x)),
        "PartitionedFn": (partitioned, (model, x)),
        "eqx.filter_jit": (filtered, (model, x)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--runs", type=int, default=5)
    add_json_option(parser)
    options = parser.parse_args()
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    partitioner = eqshard.t5x.Partitioner(mesh=mesh)
    print(
        f"{jax.device_count()} {jax.devices()[0].platform} devices, mesh "
        f"{dict(mesh.shape)}, {options.runs} rounds of {options.calls} calls"
    )
    rows = []
    for case, build in (("matmul", _matmul), ("module", _module)):
        variants = build(mesh, partitioner)
        times = interleaved(
            {name: partial(fn, *args) for name, (fn, args) in variants.items()},
            options.runs,
            calls=options.calls,
            block=False,
        )
        base = times.pop("jax.jit")
        rows += [(f"{case}: {name}", t, base) for name, t in times.items()]
    main_table = table(rows, unit="us", ours="variant", theirs="jax.jit")
    write_json(__file__, {"main": main_table}, path=options.json)


if __name__ == "__main__":
    main()
