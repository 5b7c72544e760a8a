"""Times `eqshard.search_layout` and compares the layout it chooses with a
hand-written FSDP + tensor-parallel baseline, on 8 CPU devices.

Three model families, each trained by an AdamW step under `eqx.filter_jit`-style
filtering (the model is the first argument, AdamW's state the second, the batch
the third, abstract: nothing is allocated):

- an MLP: residual blocks of `Linear(d, 4d)` and `Linear(4d, d)` (d = 1024);
- a GPT-style decoder: embedding, pre-norm blocks of q/k/v/o attention and MLP,
  a head (vocabulary 8192, d = 512, 4 blocks, 128 tokens);
- a ViT: 4x4 patches of 32x32 images through a linear patch embedding,
  position embeddings, pre-norm encoder blocks, mean pooling and a head (d =
  384, 4 blocks, 100 classes).

The MLP's blocks are a Python list; the GPT's and the ViT's are stacked (made by
`eqx.filter_vmap`, run by `lax.scan`, as MaxText runs its layers), which also
keeps their compile times (and so the search's) independent of depth.

Two meshes: (2, 4) with axes ('data', 'model') and (8,) with axis 'data'; the
batch is split over 'data' (the search reads its data axes from the batch, not
from the names). The baseline is written by hand, as one writes t5x or MaxText
rules: on (2, 4), Megatron pairs split over 'model' (first matrices on their
output, second on their input) with FSDP over 'data' on their other dimension,
the embedding and head split over both, the norms over 'model' (as MaxText's
rules put them); on (8,), the pairs' matrices split over
'data' (their biases replicated) and the embedding and head split on their model
dimension. The script checks that it is none of the built-in layouts. It is
compiled the same way the candidates are (`search_layout(..., candidates=
{"baseline": rules}, builtin=False)`), and the budget is its compiled peak plus
10%: the layouts that fit hold about as much as the hand-written one.

For each case the search compiles at most 12 built-in layouts. Targets: each
search within 60 s (absolute, on this machine); the chosen layout never over
budget; its communication (the bytes each device sends per step, the cost the
search ranks by) at most the baseline's in at least 5 of the 6 cases.

A second table times the search of every built-in layout (no budget to stop
one early: 16 GiB) on two steps as their users write them, passed unchanged
(`search_layout(step, *args, params=...)`), on the (2, 4) mesh with a batch of
8 split over 'data': `tests/models.py`'s `ViT(key, dim=384, depth=12,
image=64)` (a Python list of 12 blocks, so every layer is compiled) by its
`train_step(batch, (model, opt_state))` with `params=lambda args: args[1][0]`,
and the GPT above by `step(model, opt_state, tokens)`. Target: at most 60 s
each, the median of `--repeat` runs (3) on a quiet 2-core machine.

    python benchmarks/bench_search.py               # both tables
    python benchmarks/bench_search.py --target-only --repeat 1
"""

import argparse
import importlib.util
import math
import pathlib
import statistics
import sys
from collections.abc import Callable
from typing import Any

import jax


jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp
import optax
from _timing import add_json_option, as_table, once, RESULTS, write_json
from jax.sharding import AxisType, PartitionSpec as P
from models import Block, MLP

import eqshard


# ---------------------------------------------------------------------------------
# The models.
# ---------------------------------------------------------------------------------


def stacked_blocks(
    layers: int, dim: int, heads: int, causal: bool, key: jax.Array
) -> Block:
    """`layers` blocks as one, each array with a leading layer axis."""
    keys = jax.random.split(key, layers)
    return eqx.filter_vmap(lambda k: Block(dim, heads, causal=causal, key=k))(keys)


def scan_blocks(blocks: Block, x: jax.Array) -> jax.Array:
    arrays, static = eqx.partition(blocks, eqx.is_array)

    def layer(x: jax.Array, block: Any) -> tuple[jax.Array, None]:
        return eqx.combine(block, static)(x), None

    return jax.lax.scan(layer, x, arrays)[0]


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: Block  # 4 layers, stacked, run by a scan
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, *, key: jax.Array):
        vocab, dim = 8192, 512
        ke, kh, kb = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=ke)
        self.blocks = stacked_blocks(4, dim, 8, True, kb)
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, vocab, use_bias=False, key=kh)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = scan_blocks(self.blocks, jax.vmap(self.embed)(tokens))
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


class ViT(eqx.Module):
    patch: eqx.nn.Linear
    position: jax.Array
    blocks: Block  # 4 layers, stacked, run by a scan
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, *, key: jax.Array):
        dim, patches, classes = 384, 64, 100
        kp, kh, kq, kb = jax.random.split(key, 4)
        self.patch = eqx.nn.Linear(4 * 4 * 3, dim, key=kp)
        self.position = 0.02 * jax.random.normal(kq, (patches, dim))
        self.blocks = stacked_blocks(4, dim, 6, False, kb)
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, classes, key=kh)

    def __call__(self, image: jax.Array) -> jax.Array:
        patches = image.reshape(8, 4, 8, 4, 3).transpose(0, 2, 1, 3, 4)
        x = jax.vmap(self.patch)(patches.reshape(64, 48)) + self.position
        x = scan_blocks(self.blocks, x)
        return self.head(jnp.mean(jax.vmap(self.norm)(x), axis=0))


class Deep(eqx.Module):
    blocks: list[MLP]

    def __init__(self, *, key: jax.Array):
        self.blocks = [MLP(1024, key=k) for k in jax.random.split(key, 4)]

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = x + block(x)
        return x


def gpt_loss(model: GPT, tokens: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(jax.vmap(model)(tokens[:, :-1]), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def vit_loss(model: ViT, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    images, labels = batch
    logp = jax.nn.log_softmax(jax.vmap(model)(images), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def mlp_loss(model: Deep, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


OPTIMIZER = optax.adamw(1e-3)


def train_step(loss: Callable[..., jax.Array]) -> Callable[..., Any]:
    def step(model: Any, opt_state: Any, batch: Any) -> tuple:
        value, grads = eqx.filter_value_and_grad(loss)(model, batch)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, value

    return step


def f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def i32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.int32)


# name: (model, loss, batch)
MODELS: dict[str, tuple[Any, Any, Any]] = {
    "MLP": (Deep, mlp_loss, (f32(256, 1024), f32(256, 1024))),
    "GPT": (GPT, gpt_loss, i32(16, 129)),
    "ViT": (ViT, vit_loss, (f32(64, 32, 32, 3), i32(64))),
}


def baseline(name: str, two_axes: bool) -> list[tuple[str, Any]]:
    """The hand-written FSDP + TP rules: on ('data', 'model'), Megatron pairs
    over 'model' with FSDP over 'data' on their other dimension, the embedding
    and head split over both, the norms over 'model' (as MaxText's rules put
    them); on ('data',), the pairs' matrices over 'data' (not their biases) and
    the embedding, patch embedding and head split on their model dimension. The
    stacked blocks of the GPT and the ViT keep their layer axis whole."""
    first = "(attn/(q|k|v)|mlp/up|blocks/\\d+/up)/"
    second = "(attn/o|mlp/down|blocks/\\d+/down)/weight"
    layer = (None,) if name != "MLP" else ()  # the stacked layer axis
    if two_axes:
        rules = [
            (first + "weight", P(*layer, "model", "data")),
            (first + "bias", P(*layer, "model")),
            (second, P(*layer, "data", "model")),
            ("blocks/norm\\d/(weight|bias)", P(*layer, "model")),
            ("(embed|head)/weight", P("model", "data")),
            ("patch/weight", P("model", None)),
            ("norm/(weight|bias)", P("model")),  # MaxText's 'norm' -> tensor
        ]
    else:
        rules = [
            (first + "weight", P(*layer, "data", None)),
            (second, P(*layer, None, "data")),
            ("(embed|head)/weight", P(None, "data")),
            ("patch/weight", P("data", None)),
        ]
    return rules + [(".*", P())]


def layout(specs: Any) -> list[Any]:
    """A spec tree as comparable entries: axis tuples, no trailing `None`s."""
    out = []
    for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)):
        entries = [(e,) if isinstance(e, str) else tuple(e or ()) for e in spec]
        while entries and not entries[-1]:
            entries.pop()
        out.append(tuple(entries))
    return out


# ---------------------------------------------------------------------------------
# The comparison.
# ---------------------------------------------------------------------------------


def fmt(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def case(name: str, mesh: Any) -> dict[str, Any]:
    make, loss, batch = MODELS[name]
    model = eqx.filter_eval_shape(make, key=jax.random.key(0))
    state = jax.eval_shape(OPTIMIZER.init, eqx.filter(model, eqshard.is_array))
    batch = eqshard.abstract(batch, P("data"), mesh)
    step = train_step(loss)
    rules = baseline(name, len(mesh.axis_names) == 2)
    (hand,) = eqshard.search_layout(
        step,
        model,
        state,
        batch,
        mesh=mesh,
        device_memory=2**50,
        candidates={"baseline": rules},
        builtin=False,
        progress=False,
    ).candidates
    budget = math.ceil(1.1 * hand.memory.peak_bytes)
    seconds, result = once(
        lambda: eqshard.search_layout(
            step,
            model,
            state,
            batch,
            mesh=mesh,
            device_memory=budget,
            max_candidates=12,
        )
    )
    # The baseline is none of the built-in layouts.
    assert all(layout(c.specs) != layout(hand.specs) for c in result.candidates)
    best = result.best
    replicated = next((c for c in result.candidates if c.name == "replicated"), None)
    return {
        "name": name,
        "mesh": "x".join(str(n) for n in mesh.devices.shape),
        "compiled": len(result.candidates),
        "seconds": seconds,
        "best": best,
        "budget": budget,
        "hand": hand,
        "replicated": replicated,
        "parameters": sum(
            math.prod(x.shape)
            for x in jax.tree.leaves(eqx.filter(model, eqshard.is_array))
        ),
    }


def _test_models() -> Any:
    """`tests/models.py`, loaded by path (the benchmarks' own `models` is
    another module)."""
    path = pathlib.Path(__file__).resolve().parent.parent / "tests" / "models.py"
    spec = importlib.util.spec_from_file_location("eqshard_test_models", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def target_steps(mesh: Any) -> dict[str, tuple[Any, tuple[Any, ...], Any]]:
    """name: (step, its arguments as the user passes them, `params`)."""
    tm = _test_models()

    def make_vit(key: jax.Array) -> Any:
        model = tm.ViT(key, dim=384, depth=12, image=64)
        return model, tm.OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))

    state = eqx.filter_eval_shape(make_vit, jax.random.key(0))
    images = (f32(8, 3, 64, 64), i32(8))
    vit = (
        tm.CASES["vit"].train_step,
        (eqshard.abstract(images, P("data"), mesh), state),
    )
    model = eqx.filter_eval_shape(GPT, key=jax.random.key(0))
    opt_state = jax.eval_shape(OPTIMIZER.init, eqx.filter(model, eqshard.is_array))
    tokens = eqshard.abstract(i32(8, 129), P("data"), mesh)
    gpt = (train_step(gpt_loss), (model, opt_state, tokens))
    return {
        "ViT-S/12 (tests/models.py), image 64": (*vit, lambda args: args[1][0]),
        "GPT (d 512, 4 stacked blocks)": (*gpt, 0),
    }


def targets(repeat: int) -> tuple[list[tuple[Any, ...]], list[str]]:
    """The 60 s rows: every built-in layout of each step, searched `repeat`
    times; the rows and the names of those over 60 s."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rows, slow = [], []
    for name, (step, arguments, params) in target_steps(mesh).items():
        times = []
        for _ in range(repeat):
            seconds, result = once(
                lambda: eqshard.search_layout(
                    step,
                    *arguments,
                    params=params,
                    mesh=mesh,
                    device_memory="16GiB",
                    progress=False,
                )
            )
            times.append(seconds)
        median = statistics.median(times)
        slow += [name] if median > 60 else []
        best = result.best
        rows.append(
            (
                name,
                len(result.candidates),
                f"{median:.1f}",
                " / ".join(f"{t:.1f}" for t in times),
                "-" if best is None else best.name,
            )
        )
        print(f"{name}: {rows[-1][1]} layouts in {median:.1f} s", file=sys.stderr)
    return rows, slow


TARGET_COLUMNS = ("step", "layouts", "search s (median)", "runs s", "best")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_option(parser)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each target")
    parser.add_argument(
        "--target-only", action="store_true", help="only the 60 s target rows"
    )
    args = parser.parse_args()
    target_rows, target_slow = targets(args.repeat)
    print("| " + " | ".join(TARGET_COLUMNS) + " |")
    print("|---" * len(TARGET_COLUMNS) + "|")
    for row in target_rows:
        print("| " + " | ".join(map(str, row)) + " |")
    print(f"searches over 60 s: {target_slow or 'none'}")
    print()
    target_table = as_table(TARGET_COLUMNS, target_rows)
    if args.target_only:  # a file of their own, beside the full run's
        path = args.json or RESULTS / "bench_search_targets.json"
        write_json(__file__, {"targets": target_table}, path=path)
        return 0 if not target_slow else 1
    meshes = [
        jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2),
        jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,)),
    ]
    rows = []
    for name in MODELS:
        for mesh in meshes:
            rows.append(case(name, mesh))
            row = rows[-1]
            print(
                f"{row['name']} on {row['mesh']}: {row['compiled']} layouts in "
                f"{row['seconds']:.1f} s",
                file=sys.stderr,
            )
    columns = (
        "model",
        "mesh",
        "layouts",
        "search s",
        "chosen",
        "peak / budget",
        "sent / step (baseline)",
        "bytes / step (baseline)",
        "replicated peak",
    )
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    cells = []
    fit = wins = 0
    slow = []
    for row in rows:
        best, hand, replicated = row["best"], row["hand"], row["replicated"]
        if row["seconds"] > 60:
            slow.append(f"{row['name']} {row['mesh']}")
        if best is None:
            chosen = "none fits"
            peak = sent = total = "-"
        else:
            fit += 1
            wins += best.cost <= hand.cost
            chosen = best.name
            peak = f"{fmt(best.memory.peak_bytes)} / {fmt(row['budget'])}"
            sent = f"{fmt(best.cost)} ({fmt(hand.cost)})"
            total = f"{fmt(best.total_bytes)} ({fmt(hand.total_bytes)})"
        rep = "-" if replicated is None else fmt(replicated.memory.peak_bytes)
        cells.append(
            (
                f"{row['name']} ({row['parameters'] / 1e6:.1f}M)",
                row["mesh"],
                row["compiled"],
                f"{row['seconds']:.1f}",
                chosen,
                peak,
                sent,
                total,
                rep,
            )
        )
        print("| " + " | ".join(map(str, cells[-1])) + " |")
    print()
    print(
        f"chosen layout within budget: {fit} of {len(rows)}; sends at most the "
        f"baseline's: {wins} of {len(rows)}; searches over 60 s: {slow or 'none'}"
    )
    ok = fit == len(rows) and wins >= 5 and not slow and not target_slow
    print("targets met" if ok else "TARGET MISSED")
    tables = {"main": as_table(columns, cells), "targets": target_table}
    write_json(__file__, tables, path=args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
