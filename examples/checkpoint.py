"""Checkpoint round trips of a sharded Equinox model, bit for bit.

This example saves a model whose arrays live on a (2, 4) ('dp', 'tp') mesh and
loads it back onto the mesh, two ways:

1. Whole tree: `eqshard.gather` copies every array to host as NumPy,
   `eqx.tree_serialise_leaves` writes them, `eqx.tree_deserialise_leaves` reads
   them into a skeleton from `eqx.filter_eval_shape` (no memory spent on the
   skeleton), and `eqshard.shard` puts them back on the mesh.
2. One leaf at a time, for models too large for host memory twice:
   `eqshard.iter_gather` yields `(path, array)` pairs, each written with `np.save`;
   reading back, `eqshard.unflatten_tree` rebuilds the arrays by path.

The model mixes float32, bfloat16 and int8 arrays with a static field and a
callable. The restored values must equal the originals bit for bit, keep their
dtypes and their shardings; the script exits with a non-zero status otherwise.
Run it with `python examples/checkpoint.py`.
"""

import jax


jax.config.update("jax_num_cpu_devices", 8)  # 8 virtual CPU devices; before any JAX

import pathlib
import sys
import tempfile
from collections.abc import Callable

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P

import eqshard


class QuantizedMLP(eqx.Module):
    """A float32 layer, then an int8 layer with bfloat16 per-row scales."""

    dense: eqx.nn.Linear  # float32 weight (64, 32) and bias (64,)
    codes: jax.Array  # int8 (32, 64)
    scales: jax.Array  # bfloat16 (32,)
    activation: Callable[[jax.Array], jax.Array]
    bits: int = eqx.field(static=True)

    def __init__(self, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.dense = eqx.nn.Linear(32, 64, key=k1)
        self.codes = jax.random.randint(k2, (32, 64), -128, 128, jnp.int8)
        self.scales = jax.random.uniform(k3, (32,), jnp.bfloat16, 1e-3, 1e-1)
        self.activation = jax.nn.relu
        self.bits = 8

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.activation(self.dense(x))
        weight = self.codes.astype(jnp.float32) * self.scales[:, None]
        return weight @ h


RULES = [
    (r"dense/weight", P("tp", "dp")),
    (r"dense/bias", P("tp")),
    (r"codes", P("dp", "tp")),
    (r"scales", P()),
]


def check(ok: bool, what: str) -> None:
    if not ok:
        sys.exit(f"checkpoint example FAILED: {what}")
    print(f"  ok: {what}")


def arrays(tree: object) -> list[object]:
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def eqshard_is_array(x: object) -> bool:
    """Arrays as eqshard sees them: `eqx.is_array` does not count the
    `jax.ShapeDtypeStruct`s of an `eqx.filter_eval_shape` skeleton."""
    return isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct)


def check_restored(
    restored: QuantizedMLP, original: QuantizedMLP, model: QuantizedMLP, how: str
) -> None:
    """`restored` must hold the values of `original` bit for bit, and have the
    structure and shardings of the sharded `model`."""
    check(
        jax.tree.structure(restored) == jax.tree.structure(model)
        and restored.activation is model.activation
        and restored.bits == model.bits,
        f"{how}: same structure, static field and callable",
    )
    for got, want, sharded in zip(arrays(restored), arrays(original), arrays(model)):
        got_host, want_host = jax.device_get(got), np.asarray(want)  # raw JAX
        if got_host.dtype != want_host.dtype or got_host.shape != want_host.shape:
            check(
                False,
                f"{how}: {got_host.dtype} {got_host.shape} != "
                f"{want_host.dtype} {want_host.shape}",
            )
        if got_host.tobytes() != want_host.tobytes():
            check(False, f"{how}: a {want_host.dtype} array differs")
        if got.sharding != sharded.sharding:
            check(False, f"{how}: {got.sharding} != {sharded.sharding}")
    dtypes = sorted({str(x.dtype) for x in arrays(original)})
    check(True, f"{how}: bit-exact, same dtypes ({', '.join(dtypes)}) and shardings")


def main() -> None:
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    key = jax.random.key(0)
    original = QuantizedMLP(key)  # on one device
    specs = eqshard.match_partition_rules(RULES, original)
    model = eqshard.shard(original, specs, mesh)

    with tempfile.TemporaryDirectory() as tmp:
        # 1. The whole tree: gather -> serialise -> deserialise -> shard.
        file = pathlib.Path(tmp) / "model.eqx"
        host = eqshard.gather(model)
        check(
            all(isinstance(x, np.ndarray) for x in arrays(host)),
            "gather gives NumPy arrays",
        )
        eqx.tree_serialise_leaves(file, host)
        like = eqx.filter_eval_shape(QuantizedMLP, key)  # shapes only, no memory
        loaded = eqx.tree_deserialise_leaves(file, like)
        check_restored(eqshard.shard(loaded, specs, mesh), original, model, "serialise")

        # 2. One leaf at a time: iter_gather -> np.save per leaf -> np.load -> shard.
        folder = pathlib.Path(tmp) / "leaves"
        folder.mkdir()
        for path, leaf in eqshard.iter_gather(model):
            np.save(folder / f"{path.replace('/', '.')}.npy", leaf)
        dynamic, static = eqx.partition(like, eqshard_is_array)
        flat = {}
        for name, struct in eqshard.flatten_tree(dynamic, sep="/").items():
            value = np.load(folder / f"{name.replace('/', '.')}.npy")
            # np.save stores bfloat16 as raw 2-byte records; view them as bfloat16
            flat[name] = value.view(struct.dtype)
        loaded = eqx.combine(eqshard.unflatten_tree(flat, dynamic, sep="/"), static)
        check_restored(
            eqshard.shard(loaded, specs, mesh), original, model, "iter_gather"
        )
    print("checkpoint example: OK")


if __name__ == "__main__":
    main()
