"""Times `eqshard.analyze_step` against compiling the same step with raw JAX, and
measures what the report holds, on 8 CPU devices.

The model is a GPT-style Equinox transformer (embedding, pre-norm blocks of
q/k/v/o and MLP `eqx.nn.Linear`s, layer norms, a head; the shape of
`bench_init.py`'s model), sized by `--layers` and `--dim`, on a (2, 4)
('fsdp', 'tp') mesh with Auto axes and the demo's kind of rules (every matrix
split over both axes). The step is an AdamW training step under `jax.jit`, its
parameters and optimizer state donated and laid out by `out_shardings`, for
abstract arguments (`eqshard.abstract`: nothing is allocated).

1. raw JAX: `jax.jit(step, ...).lower(*arguments).compile()`, cold
   (`jax.clear_caches()` first);
2. `eqshard.analyze_step(step, *arguments)`, cold (a new `jax.jit` object, so
   that its own report cache is missed too): tracing, compiling, reading the
   program text and the memory analysis;
3. the same call again: the cached report (target: no compile).

Rows are interleaved within a run, with the garbage collector fixed
(`benchmarks/_timing.py`); XLA compilations are counted with `jax.monitoring`. The
first run checks the report against the raw program: every collective
instruction (counted by a regex over `as_text()`) is a row, with the same kind
and bytes. Then a 1,000-leaf model (500 layers of a weight and a bias) laid out
two ways: `diff` of the two reports and the JSON round trip
(`to_json` + `StepReport.from_json`), an absolute target of 1 s.

    python benchmarks/bench_step.py                 # 4 layers of width 256, 3 runs
    python benchmarks/bench_step.py --layers 12 --dim 768 --runs 2

Exits with status 1 if a target is missed: analyze_step within 1.2x of the raw
compile (medians), the report holding every collective, at least 90% of the
bytes attributed to a leaf, diff and JSON round trip under 1 s.
"""

import argparse
import math
import re
import statistics
import sys
from collections.abc import Callable
from typing import Any

import jax


jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp
import optax
from _timing import add_json_option, once, table, Times, write_json
from jax.sharding import AxisType, PartitionSpec as P
from models import Block, RULES

import eqshard


_compiles = [0]


def _listen(event: str, duration: float, **kwargs: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_listen)


# ---------------------------------------------------------------------------------
# The model.
# ---------------------------------------------------------------------------------


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list[Block]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, vocab: int, dim: int, layers: int, *, key: jax.Array):
        ke, kh, *kb = jax.random.split(key, 2 + layers)
        self.embed = eqx.nn.Embedding(vocab, dim, key=ke)
        self.blocks = [Block(dim, dim // 64, key=k) for k in kb]
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, vocab, use_bias=False, key=kh)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def gpt_step(layers: int, dim: int, mesh: Any) -> tuple[Callable[[], Any], tuple]:
    """A maker of the `jax.jit` training step (a new object at each call) and its
    abstract arguments."""
    shapes = eqx.filter_eval_shape(GPT, 1024, dim, layers, key=jax.random.key(0))
    params, static = eqx.partition(
        shapes, lambda x: isinstance(x, jax.ShapeDtypeStruct)
    )
    specs = eqshard.match_partition_rules(RULES, params)
    optimizer = optax.adamw(1e-3)
    state = jax.eval_shape(optimizer.init, params)
    state_specs = eqshard.derive_specs(state, params, specs)
    batch = jax.ShapeDtypeStruct((16, 65), jnp.int32)

    def loss(params: Any, tokens: jax.Array) -> jax.Array:
        logits = jax.vmap(eqx.combine(params, static))(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    def step(params: Any, opt_state: Any, tokens: jax.Array) -> tuple:
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    out = (
        eqshard.named_shardings(specs, mesh),
        eqshard.named_shardings(state_specs, mesh),
        None,
    )
    arguments = (
        eqshard.abstract(params, specs, mesh),
        eqshard.abstract(state, state_specs, mesh),
        eqshard.abstract(batch, P("fsdp"), mesh),
    )

    def make() -> Any:
        return jax.jit(step, out_shardings=out, donate_argnums=(0, 1))

    return make, arguments


def thousand_leaves(mesh: Any) -> tuple[Any, Any]:
    """Two reports of a 1,000-leaf step, the second with two weights moved."""
    params = {
        f"layer{i:03d}": {
            "w": jax.ShapeDtypeStruct((16, 8), jnp.float32),
            "b": jax.ShapeDtypeStruct((8,), jnp.float32),
        }
        for i in range(500)
    }

    def layout(moved: tuple[str, ...]) -> Any:
        return {
            name: {
                "w": P("tp", None) if name in moved else P("fsdp", "tp"),
                "b": P("tp"),
            }
            for name in params
        }

    def step(params: Any) -> Any:
        return jax.tree.map(lambda p: p - 0.1 * jnp.tanh(p), params)

    out = eqshard.named_shardings(layout(()), mesh)
    return tuple(
        eqshard.analyze_step(
            jax.jit(step, out_shardings=out),
            eqshard.abstract(params, layout(moved), mesh),
        )
        for moved in ((), ("layer007", "layer321"))
    )


# ---------------------------------------------------------------------------------
# Timing and checking.
# ---------------------------------------------------------------------------------


def timed(fn: Callable[[], Any], *, cold: bool) -> tuple[float, int, Any]:
    """Seconds and compilations of one call of `fn`, and its result."""
    if cold:
        jax.clear_caches()
    before = _compiles[0]
    seconds, out = once(fn)
    return seconds, _compiles[0] - before, out


_COLLECTIVE = re.compile(
    r"= (\(.*?\)|\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\("
)
_ARRAY = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1}


def counted(text: str) -> list[tuple[str, int]]:
    """(kind, bytes per run) of each collective instruction of the text, by a
    regex: independent of eqshard's reader."""
    return sorted(
        (
            kind,
            sum(
                math.prod(int(d) for d in dims.split(",") if d) * _BYTES[dtype]
                for dtype, dims in _ARRAY.findall(shape)
            ),
        )
        for shape, kind in _COLLECTIVE.findall(text)
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    add_json_option(parser)
    args = parser.parse_args()

    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    make, arguments = gpt_step(args.layers, args.dim, mesh)
    raw: list[float] = []
    ours: list[float] = []
    warm: list[float] = []
    compiles: dict[str, int] = {}
    report = None
    for run in range(args.runs):
        seconds, count, compiled = timed(
            lambda: make().lower(*arguments).compile(), cold=True
        )
        raw.append(seconds)
        compiles["raw"] = count
        step = make()
        seconds, count, report = timed(
            lambda: eqshard.analyze_step(step, *arguments), cold=True
        )
        ours.append(seconds)
        compiles["analyze_step"] = count
        seconds, count, again = timed(
            lambda: eqshard.analyze_step(step, *arguments), cold=False
        )
        warm.append(seconds)
        compiles["again"] = count
        assert again is report
        if run == 0:
            text = compiled.as_text()
            rows = sorted((row.kind, row.bytes) for row in report.collectives)
            every = rows == counted(text)
    assert report is not None

    pair = thousand_leaves(mesh)
    timings: dict[str, list[float]] = {"diff": [], "json": []}
    for _ in range(max(args.runs, 5)):
        timings["diff"].append(timed(lambda: pair[0].diff(pair[1]), cold=False)[0])
        seconds, _, back = timed(
            lambda: eqshard.StepReport.from_json(pair[1].to_json()), cold=False
        )
        timings["json"].append(seconds)
        assert back == pair[1]
    changed = pair[0].diff(pair[1]).paths

    n_params = sum(
        math.prod(leaf.shape)
        for leaf in report.arguments
        if leaf.path.startswith("params/")
    )
    print(
        f"GPT-style model: {args.layers} blocks of width {args.dim}, vocabulary "
        f"1024, {n_params / 1e6:.1f}M parameters ({len(report.arguments)} argument "
        f"arrays with the AdamW state); (2, 4) ('fsdp', 'tp') mesh; {args.runs} runs\n"
    )
    main_table = table(
        [
            ("(2) eqshard.analyze_step, cold", Times(tuple(ours)), Times(tuple(raw)))
            + (compiles["analyze_step"],),
            (
                "(3) eqshard.analyze_step, again (cached)",
                Times(tuple(warm)),
                Times(tuple(raw)),
                compiles["again"],
            ),
            ("diff, 1,000 leaves", Times(tuple(timings["diff"])), None, 0),
            (
                "to_json + from_json, 1,000 leaves",
                Times(tuple(timings["json"])),
                None,
                0,
            ),
        ],
        theirs="raw compile",
        columns=("compiles",),
    )
    print(f"(raw: jit(...).lower().compile() compiled {compiles['raw']} times)")
    share = report.attributed_share
    print(
        f"\ncollectives: {len(report.collectives)} instructions, every one in the "
        f"report (kind and bytes, against a regex count of as_text()): {every}; "
        f"{report.total_bytes / 2**20:.1f} MiB per device per step, "
        f"{share:.1%} of it attributed to a leaf"
    )
    print(f"by kind: {report.bytes_by_kind}; by axes: {report.bytes_by_axes}")
    print(f"diff of the 1,000-leaf layouts names: {list(changed)}")
    ok = (
        statistics.median(ours) <= 1.2 * statistics.median(raw)
        and every
        and share >= 0.9
        and compiles["again"] == 0
        and max(statistics.median(v) for v in timings.values()) < 1.0
    )
    print("targets met" if ok else "TARGET MISSED")
    write_json(__file__, {"main": main_table}, path=args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
