"""`eqshard.dot_product_attention` seen in the tools: `analyze_step` names its
collectives by the user's line, and `plan_training(context=)` counts its
buffers per strategy against the compiled program's."""

import inspect

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqshard


@pytest.fixture(scope="module")
def cp_mesh():
    return jax.make_mesh((2, 4), ("dp", "cp"), axis_types=(AxisType.Auto,) * 2)


@pytest.mark.parametrize(
    ("strategy", "kind"),
    [
        ("ring", "collective-permute"),
        ("all_gather", "all-gather"),
        ("ulysses", "all-to-all"),
    ],
)
def test_rows_name_the_users_line(cp_mesh, strategy, kind):
    """The attention's permutes, gathers and all-to-alls are named by the line
    that called it, not by eqshard's own source."""

    def step(q):
        return eqshard.dot_product_attention(q, q, q, axis="cp", strategy=strategy)

    line = inspect.getsourcelines(step)[1] + 1
    q = jax.ShapeDtypeStruct(
        (2, 32, 4, 8), jnp.float32, sharding=NamedSharding(cp_mesh, P("dp", "cp"))
    )
    with jax.set_mesh(cp_mesh):
        report = eqshard.analyze_step(jax.jit(step), q)
    rows = [row for row in report.collectives if row.kind == kind]
    assert rows
    assert all(row.source.endswith(f"test_attention_tools.py:{line}") for row in rows)


def _compiled_temporaries(mesh, strategy, query, key, gradients, block_size=None):
    def forward(q, k, v):
        return eqshard.dot_product_attention(
            q, k, v, is_causal=True, axis="cp", strategy=strategy,
            block_size=block_size,
        )  # fmt: skip

    def step(q, k, v):
        loss = lambda q, k, v: forward(q, k, v).sum()  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    with jax.set_mesh(mesh):
        fn = jax.jit(step if gradients else forward)
        return eqshard.analyze_step(fn, query, key, key).memory.temp_bytes


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, block_size",
    [("ring", None), ("ring", 128), ("all_gather", None), ("ulysses", None)],
)
def test_plan_counts_the_compiled_attention(cp_mesh, strategy, block_size):
    """`plan_training(context=)`'s buffers against XLA's temporaries for the
    attention's gradient (dp 2 x cp 4, GQA 8/4 heads, T = 2048; the ring whole
    and in tiles of 128 of its 512 rows)."""
    split = NamedSharding(cp_mesh, P("dp", "cp"))
    query = jax.ShapeDtypeStruct((2, 2048, 8, 32), jnp.float32, sharding=split)
    key = jax.ShapeDtypeStruct((2, 2048, 4, 32), jnp.float32, sharding=split)
    compiled = _compiled_temporaries(
        cp_mesh, strategy, query, key, gradients=True, block_size=block_size
    )
    context = {"query": query, "kv_heads": 4, "strategy": strategy, "axis": "cp"}
    if block_size is not None:
        context["block_size"] = block_size
    plan = eqshard.plan_training({}, mesh=cp_mesh, context=context)
    assert plan.context is not None
    assert abs(plan.context.total - compiled) <= 0.1 * compiled, (
        plan.context,
        compiled,
    )
    # By hand: one device's float32 score array, batch 1 of 2 over 'dp'.
    one = {"ring": 8 * (block_size or 512) * 512, "all_gather": 8 * 512 * 2048}
    one["ulysses"] = 2 * 2048 * 2048
    assert plan.context.scores % (one[strategy] * 4) == 0


def test_plan_context_by_hand():
    """Ring over cp=4, batch over dp=2: query (4, 1024, 8, 64) bfloat16 with 2
    key/value heads, so each device holds b=2, t=256; three layers keep a
    (4, 1024, 512) bfloat16 activation each."""
    mesh = jax.sharding.AbstractMesh((2, 4), ("dp", "cp"))
    context = {
        "query": jax.ShapeDtypeStruct((4, 1024, 8, 64), jnp.bfloat16),
        "kv_heads": 2,
        "activation": jax.ShapeDtypeStruct((4, 1024, 512), jnp.bfloat16),
        "layers": 3,
    }
    params = {"w": jax.ShapeDtypeStruct((16, 16), jnp.float32)}
    plan = eqshard.plan_training(params, P(), mesh, context=context)
    c = plan.context
    assert c is not None and (c.axis, c.size, c.strategy) == ("cp", 4, "ring")
    assert c.scores == 5 * 2 * 8 * 256 * 256 * 4  # five T/4 x T/4 f32 blocks
    assert c.keys_values == 2 * 2 * (2 * 256 * 2 * 64) * 2  # K, V: two blocks each
    assert c.accumulators == 8 * (2 * 256 * 8 * 64) * 4
    assert c.activations == 3 * 2 * 256 * 512 * 2
    assert plan.max_bytes_per_device == 2 * 16 * 16 * 4 + c.total  # w and its grad
    assert "ring over 'cp' of 4: scores 20.0 MiB" in plan.summary()
    forward = eqshard.plan_training(
        params, None, mesh, gradients=False, context=context
    )
    assert forward.context is not None
    assert forward.context.scores == 2 * 2 * 8 * 256 * 256 * 4
    assert forward.context.accumulators == 0
    tiled = eqshard.plan_training(
        params, P(), mesh, context={**context, "block_size": 64}
    ).context
    assert tiled is not None  # four tiles of 64 x 256, six query-sized arrays
    assert tiled.scores == 4 * 2 * 8 * 64 * 256 * 4
    assert tiled.accumulators == 6 * (2 * 256 * 8 * 64) * 4


@pytest.mark.parametrize(
    ("context", "match"),
    [
        ({"query": jax.ShapeDtypeStruct((4, 1024, 8), jnp.float32)}, "not a 4-d"),
        ({"kv_heads": 2}, "lacks 'query'"),
        (
            {"query": jax.ShapeDtypeStruct((4, 1024, 8, 8), jnp.float32), "axis": "x"},
            "names the axis 'x', not in mesh",
        ),
        (
            {
                "query": jax.ShapeDtypeStruct((4, 1024, 6, 8), jnp.float32),
                "strategy": "ulysses",
            },
            "the heads",
        ),
        (
            {
                "query": jax.ShapeDtypeStruct((4, 1024, 8, 8), jnp.float32),
                "kv_heads": 3,
            },
            "kv_heads=3 for 8 query heads",
        ),
        (
            {"query": jax.ShapeDtypeStruct((4, 8, 8, 8), jnp.float32), "strategy": "x"},
            "strategy='x'",
        ),
    ],
)
def test_plan_context_bad_input(context, match):
    mesh = jax.sharding.AbstractMesh((2, 4), ("dp", "cp"))
    with pytest.raises(ValueError, match=match):
        eqshard.plan_training({}, None, mesh, context=context)


@pytest.mark.slow
def test_command_plans_a_context_axis():
    """`python -m eqshard --mesh dp:2,cp:4 --context ...`: all-gather of a
    (2, 1024, 4, 16) float32 query with 2 key/value heads; each device (b=1,
    t=256) holds 4 scores of 4 x 256 x 1024 float32 (16 MiB), the whole K and V
    (2 x 1024 x 2 x 16 x 4 B = 256 KiB) and one query accumulator (64 KiB)."""
    import pathlib
    import subprocess
    import sys

    from probes import RUN_TIMEOUT

    attention = "strategy=all_gather,query=2x1024x4x16,kv_heads=2"
    result = subprocess.run(
        [sys.executable, "-m", "eqshard", "--model", "examples/llama.py:tiny",
         "--mesh", "dp:2,cp:4", "--context", attention],
        capture_output=True, text=True, timeout=RUN_TIMEOUT,
        cwd=pathlib.Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (
        "all_gather over 'cp' of 4: scores 16.0 MiB, keys/values 256.0 KiB, "
        "accumulators 64.0 KiB, activations 0 B)" in result.stdout
    ), result.stdout
