"""What pipelining costs, read from compiled programs: per-device peak memory and
collective bytes of PP x DP x TP layouts of the GPT-style blocks against FSDP x
TP, on 8 CPU devices.

The model is `models.py`'s `Block` (pre-norm attention and MLP `eqx.nn.Linear`s)
stacked `--layers` times with `eqx.filter_vmap`; the step is the gradient of a
loss of the blocks' output with respect to them (forward and backward, no
optimizer), for abstract arguments (`eqshard.abstract`: nothing is allocated),
compiled by `eqshard.analyze_step`. Layouts, each with the matrices split over
'fsdp' and 'tp' as `models.RULES` splits them:

1. `fsdp4 x tp2`: the blocks run by `jax.lax.scan`, no pipeline;
2. `pp2 x fsdp2 x tp2`, GPipe, `--microbatches` microbatches, the stack laid out
   `eqshard.stacked(spec, stages="pp")`;
3. the same mesh, circular with 2 repeats, the stack in `eqshard.stage_view`'s
   view, `P(None, "pp")`;
4. `pp4 x tp2`, GPipe;
5. and 6. a mixture-of-experts stack (`Experts`: top-1 routing over 4 experts,
   computed densely) whose loss adds its load-balancing aux
   (`pipeline(..., has_aux=True)`: summed over the layers, averaged over the
   microbatches), unpipelined (`fsdp4 x tp2`, the scan run per microbatch so
   the aux is the same) and pipelined (`pp2 x fsdp2 x tp2`, circular).

A second table: the GPT-style blocks on `pp2 x fsdp4`, circular R=4, with
`pipeline(fsdp_gather=...)` `"per_step"`, `"once"` and `"per_repeat"`: the
all-gathered bytes per device per step, their ratio to `"per_step"`'s beside
the expected one (a chunk gathered at each of the `R·M + S - 1` steps of both
loops, against the stage's R chunks once, or 2 chunks per repeat in each loop),
and the
compiled peak and temporary bytes.

For each: the compiled peak bytes per device (`report.memory.peak_bytes`), the
collective bytes per device per step in all and over 'pp', the stage-to-stage
permutes' runs per step, and the bubble computed from them, `(S-1)/runs` (the
forward loop runs `R·M + S - 1` steps), beside the formula. CPU compiles: no
wall-time claims.

    python benchmarks/bench_pipeline.py                       # 8 layers, width 256
    python benchmarks/bench_pipeline.py --layers 16 --dim 512 --microbatches 8
"""

import argparse

import jax


jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp
from _timing import add_json_option, as_table, write_json
from jax.sharding import AxisType, PartitionSpec as P
from models import Block

import eqshard


# One layer's specs (`models.RULES` for a block), written to their full rank.
LAYER_RULES = [
    ("attn/(q|k|v)/weight", P("tp", "fsdp")),
    ("attn/(q|k|v)/bias", P("tp")),
    ("attn/o/weight", P("fsdp", "tp")),
    ("mlp/up/weight", P("tp", "fsdp")),
    ("mlp/up/bias", P("tp")),
    ("mlp/down/weight", P("fsdp", "tp")),
    (".*", P(None)),
]


def rules(
    stages: str | None, names: tuple[str, ...], moe: bool = False
) -> list[tuple[str, object]]:
    """The layer rules for a mesh of axes `names` (those it lacks left out)."""
    only = lambda spec: P(*(a if a in names else None for a in spec))  # noqa: E731
    table = MOE_RULES if moe else LAYER_RULES
    return [(p, eqshard.stacked(only(s), stages=stages)) for p, s in table]


def scan_aux(fn, dyn, static, x):
    """`jax.lax.scan` over the layers, their aux's "balance" summed."""

    def step(carry, d):
        h, aux = fn(eqx.combine(d, static), carry[0])
        return (h, carry[1] + aux["balance"]), None

    return jax.lax.scan(step, (x, jnp.zeros(())), dyn)[0]


def layer(block, h):
    return jax.vmap(block)(h)


class Experts(eqx.Module):
    """A mixture-of-experts MLP (top-1 routing over `E` experts, computed
    densely, Switch-style), its load-balancing loss the layer's aux."""

    router: jax.Array
    up: jax.Array
    down: jax.Array

    def __init__(self, dim: int, experts: int, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.router = jax.random.normal(k1, (dim, experts)) / dim**0.5
        self.up = jax.random.normal(k2, (experts, dim, 2 * dim)) / dim**0.5
        self.down = jax.random.normal(k3, (experts, 2 * dim, dim)) / dim**0.5


def moe_layer(block, h):
    """`(h, {"balance": ...})` for `h` (batch, seq, dim)."""
    experts = block.router.shape[1]
    probs = jax.nn.softmax(h @ block.router)
    choice = jax.nn.one_hot(jnp.argmax(probs, -1), experts)
    hidden = jnp.tanh(jnp.einsum("bsd,edf->ebsf", h, block.up))
    out = jnp.einsum("ebsf,efd->bsd", hidden * jnp.moveaxis(choice * probs, -1, 0)[
        ..., None], block.down)  # fmt: skip
    balance = experts * jnp.sum(choice.mean((0, 1)) * probs.mean((0, 1)))
    return h + out, {"balance": balance}


MOE_RULES = [
    ("router", P(None, None)),
    ("up", P(None, "fsdp", "tp")),
    ("down", P(None, "tp", "fsdp")),
]


def measure(args, name, sizes, names, schedule, repeats, moe=False):
    """The report of the gradient step on this layout, and its row."""
    mesh = jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(sizes))
    keys = jax.random.split(jax.random.key(0), args.layers)
    make = (
        (lambda k: Experts(args.dim, 4, k))
        if moe
        else (lambda k: Block(args.dim, args.dim // 64, key=k))
    )
    stack = eqx.filter_eval_shape(eqx.filter_vmap(make), keys)
    pipelined = "pp" in names
    staged = schedule == "circular"
    if staged:
        stack = eqshard.stage_view(stack, stages=mesh.shape["pp"], repeats=repeats)
    data = tuple(a for a in ("fsdp",) if a in names) or None
    x = jax.ShapeDtypeStruct((args.batch, args.seq, args.dim), jnp.float32)
    stack = eqshard.abstract(
        stack, rules("pp" if pipelined else None, names, moe), mesh
    )
    x = eqshard.abstract(x, P(data), mesh)
    is_struct = lambda a: isinstance(a, jax.ShapeDtypeStruct)  # noqa: E731
    static = eqx.filter(stack, is_struct, inverse=True)

    m = args.microbatches

    def forward(dyn, x):
        """The blocks' output and their aux (0 for the GPT-style blocks)."""
        blocks = eqx.combine(dyn, static)
        if not pipelined and not moe:
            step = lambda h, d: (layer(eqx.combine(d, static), h), None)  # noqa: E731
            return jax.lax.scan(step, x, dyn)[0], 0.0
        if not pipelined:  # the scan per microbatch: the pipeline's aux
            parts = [scan_aux(moe_layer, dyn, static, x[i::m]) for i in range(m)]
            y = jnp.stack([p[0] for p in parts], 1).reshape(x.shape)
            return y, sum(p[1] for p in parts) / m
        out = eqshard.pipeline(
            moe_layer if moe else layer, blocks, x, microbatches=m,
            schedule=schedule, repeats=repeats, staged=staged, has_aux=moe,
        )  # fmt: skip
        return (out[0], out[1]["balance"]) if moe else (out, 0.0)

    @jax.jit
    def grad_step(dyn, x):
        def loss(d):
            y, balance = forward(d, x)
            return jnp.mean(y**2) + 0.01 * balance

        return jax.grad(loss)(dyn)

    with jax.set_mesh(mesh):
        report = eqshard.analyze_step(
            grad_step, eqx.filter(stack, is_struct), x, capture_warnings=False
        )
    over_pp = sum(c.total_bytes for c in report.collectives if "pp" in c.axes)
    permutes = [
        c.count
        for c in report.collectives
        if c.kind == "collective-permute" and c.axes == ("pp",)
    ]
    stages = mesh.shape.get("pp", 1)
    runs = max(permutes, default=0)
    bubble = f"{(stages - 1) / runs:.3f}" if runs else "-"
    formula = (
        f"{(stages - 1) / (repeats * args.microbatches + stages - 1):.3f}"
        if pipelined
        else "-"
    )
    return [
        name,
        f"{report.memory.peak_bytes / 2**20:.2f}",
        f"{report.total_bytes / 2**20:.2f}",
        f"{over_pp / 2**20:.3f}",
        runs or "-",
        bubble,
        formula,
    ]


def measure_gather(args, gather, per_step_bytes=None):
    """The gradient step of the blocks on `pp2 x fsdp4`, circular R=4, with the
    stage weights gathered over 'fsdp' as `gather` says, and its row."""
    mesh = jax.make_mesh((2, 4), ("pp", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    keys = jax.random.split(jax.random.key(0), args.layers)
    stack = eqx.filter_eval_shape(
        eqx.filter_vmap(lambda k: Block(args.dim, args.dim // 64, key=k)), keys
    )
    stack = eqshard.stage_view(stack, stages=2, repeats=4)
    stack = eqshard.abstract(stack, rules("pp", ("pp", "fsdp")), mesh)
    x = eqshard.abstract(
        jax.ShapeDtypeStruct((args.batch, args.seq, args.dim), jnp.float32),
        P("fsdp"),
        mesh,
    )
    is_struct = lambda a: isinstance(a, jax.ShapeDtypeStruct)  # noqa: E731
    dyn, static = eqx.partition(stack, is_struct)
    # In a jitted step on Auto axes the layouts are not visible: name them.
    specs = jax.tree.map(lambda a: a.sharding.spec, dyn)

    @jax.jit
    def grad_step(dyn, x):
        def loss(d):
            y = eqshard.pipeline(
                layer, eqx.combine(d, static), x, microbatches=args.microbatches,
                schedule="circular", repeats=4, staged=True, fsdp_gather=gather,
                fsdp_axes=("fsdp",), stack_specs=specs,
            )  # fmt: skip
            return jnp.mean(y**2)

        return jax.grad(loss)(dyn)

    with jax.set_mesh(mesh):
        report = eqshard.analyze_step(grad_step, dyn, x, capture_warnings=False)
    gathered = sum(c.total_bytes for c in report.collectives if c.kind == "all-gather")
    # "per_step" gathers a chunk (K layers) at each of the R·M + S - 1 steps of
    # the forward loop and of the backward loop; "once" the R chunks once,
    # "per_repeat" 2 chunks per window of M steps, R windows, in each loop.
    steps = 2 * (4 * args.microbatches + 2 - 1)
    expected = {"per_step": 1.0, "once": 4 / steps, "per_repeat": 16 / steps}[gather]
    ratio = gathered / per_step_bytes if per_step_bytes else 1.0
    row = [
        gather,
        f"{gathered / 2**20:.3f}",
        f"{ratio:.3f}",
        f"{expected:.3f}",
        f"{report.memory.peak_bytes / 2**20:.2f}",
        f"{report.memory.temp_bytes / 2**20:.2f}",
    ]
    return row, gathered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    add_json_option(parser)
    args = parser.parse_args()
    layouts = [
        ("fsdp4 x tp2 (scan)", (4, 2), ("fsdp", "tp"), "gpipe", 1),
        ("pp2 x fsdp2 x tp2, GPipe", (2, 2, 2), ("pp", "fsdp", "tp"), "gpipe", 1),
        ("pp2 x fsdp2 x tp2, circular R=2", (2, 2, 2), ("pp", "fsdp", "tp"),
         "circular", 2),
        ("pp4 x tp2, GPipe", (4, 2), ("pp", "tp"), "gpipe", 1),
        ("MoE+aux fsdp4 x tp2 (scan)", (4, 2), ("fsdp", "tp"), "gpipe", 1, True),
        ("MoE+aux pp2 x fsdp2 x tp2, circular R=2", (2, 2, 2), ("pp", "fsdp", "tp"),
         "circular", 2, True),
    ]  # fmt: skip
    rows = [measure(args, *layout) for layout in layouts]
    columns = [
        "layout", "peak MiB/device", "collective MiB/device/step", "over pp MiB",
        "permute runs", "bubble (report)", "bubble (formula)",
    ]  # fmt: skip
    widths = [max(len(str(r[i])) for r in [columns, *rows]) for i in range(7)]
    for row in [columns, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
    title = (
        f"gradient step of {args.layers} GPT-style blocks (width {args.dim}, "
        f"seq {args.seq}, batch {args.batch}, {args.microbatches} microbatches), "
        "compiled for 8 CPU devices"
    )
    gather_rows, per_step = [], None
    for gather in ("per_step", "once", "per_repeat"):
        row, gathered = measure_gather(args, gather, per_step)
        per_step = per_step or gathered
        gather_rows.append(row)
    gather_columns = [
        "fsdp_gather", "all-gather MiB/device/step", "vs per_step",
        "expected", "peak MiB/device", "temp MiB/device",
    ]  # fmt: skip
    print()
    for row in [gather_columns, *gather_rows]:
        print("  ".join(str(c).ljust(26 if i == 1 else 16) for i, c in enumerate(row)))
    gather_title = (
        f"the same blocks on pp2 x fsdp4, circular R=4, {args.microbatches} "
        "microbatches, stage weights gathered over 'fsdp' per loop step, once, "
        "or per repeat; compiled for 8 CPU devices"
    )
    write_json(
        __file__,
        {
            "layouts": as_table(columns, rows, title=title),
            "fsdp_gather": as_table(gather_columns, gather_rows, title=gather_title),
        },
        path=args.json,
    )


if __name__ == "__main__":
    main()
