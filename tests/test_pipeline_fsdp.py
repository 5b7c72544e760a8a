"""`eqshard.pipeline(fsdp_gather=...)`: stage weights split over a data axis
gathered once per step or per circular repeat give what gathering them at every
loop step gives, values and gradients, with fewer all-gathered bytes; the
warning when nothing is split over a data axis; the errors."""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P


Gather = Literal["per_step", "once", "per_repeat"]


D, F = 8, 16
SPEC = P(None, "pp", None, "fsdp")  # the stages' view (R, S, K, ...), FSDP rows


class MLP(eqx.Module):
    w1: jax.Array
    w2: jax.Array

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (D, F)) / 3
        self.w2 = jax.random.normal(k2, (F, D)) / 4


def layer(block, h):
    return h + jnp.tanh(h @ block.w1) @ block.w2


def setup(explicit=False):
    import eqshard

    kind = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((2, 4), ("pp", "fsdp"), axis_types=(kind, kind))
    stack = eqx.filter_vmap(MLP)(jax.random.split(jax.random.key(0), 4))
    view = eqshard.stage_view(stack, stages=2, repeats=2)
    x = jax.random.normal(jax.random.key(1), (16, D))
    return mesh, view, x


def gathered_bytes(report):
    return sum(c.count * c.bytes for c in report.collectives if c.kind == "all-gather")


@pytest.mark.slow
def test_once_and_per_repeat_equal_per_step_with_fewer_gathers():
    """pp2 x fsdp4, circular R=2, M=4 (9 loop steps), in a jitted step on Auto
    axes (the data axes and specs named): the same loss and gradients as the
    default, and at most half its all-gathered bytes (read from the compiled
    step); the expected values are the default's, itself checked against
    `lax.scan` in tests/test_pipeline.py."""
    import eqshard

    mesh, view, x = setup()
    results = {}
    with jax.set_mesh(mesh):
        placed = eqshard.shard(view, SPEC, mesh)
        xs = eqshard.shard(x, P("fsdp"), mesh)
        gathers: tuple[Gather, ...] = ("per_step", "once", "per_repeat")
        for gather in gathers:

            def loss(stack, x, gather: Gather = gather):
                y = eqshard.pipeline(
                    layer, stack, x, microbatches=4, schedule="circular",
                    repeats=2, staged=True, fsdp_gather=gather,
                    fsdp_axes=("fsdp",), stack_specs=SPEC,
                )  # fmt: skip
                return jnp.mean(y**2)

            step = jax.jit(jax.value_and_grad(loss))
            report = eqshard.analyze_step(step, placed, xs)
            results[gather] = (step(placed, xs), gathered_bytes(report))
    (want, want_grads), per_step = results["per_step"]
    for gather in ("once", "per_repeat"):
        (got, grads), gathered = results[gather]
        np.testing.assert_allclose(got, want, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert 0 < gathered <= per_step / 2, (gather, gathered, per_step)


def test_reads_the_layout_on_explicit_axes_and_warns_when_nothing_is_split():
    """On Explicit axes the stack's and `x`'s types carry their layouts: weights
    split over the data axis trace quietly; weights not split over it warn,
    naming the leaves, and the result's type is unchanged."""
    import eqshard

    mesh, view, x = setup(explicit=True)
    with jax.set_mesh(mesh):
        xs = eqshard.shard(x, P("fsdp"), mesh)

        def trace(stack):
            return jax.eval_shape(
                lambda s, x: eqshard.pipeline(
                    layer, s, x, microbatches=2, schedule="circular", repeats=2,
                    staged=True, fsdp_gather="once",
                ),
                stack, xs,
            )  # fmt: skip

        out = trace(eqshard.shard(view, SPEC, mesh))
        with pytest.warns(UserWarning, match=r"'w1', 'w2'.*not split over a data"):
            unsplit = trace(eqshard.shard(view, P(None, "pp"), mesh))
    assert (unsplit.shape, unsplit.sharding.spec) == (out.shape, out.sharding.spec)


def test_fsdp_gather_errors():
    import eqshard

    mesh, view, x = setup()
    with jax.set_mesh(mesh):

        def call(**kw):
            jax.eval_shape(
                lambda s, x: eqshard.pipeline(
                    layer, s, x, microbatches=2, schedule="circular", repeats=2,
                    staged=True, **kw,
                ),
                view, x,
            )  # fmt: skip

        with pytest.raises(ValueError, match=r"`fsdp_gather` is 'twice'.*'once'"):
            call(fsdp_gather="twice")
        with pytest.raises(ValueError, match=r"data axes .*`x` is traced.*fsdp_axes="):
            call(fsdp_gather="once")
        with pytest.raises(
            ValueError, match=r"layout, but the leaf at .w1. .*stack_specs="
        ):
            call(fsdp_gather="once", fsdp_axes="fsdp")
        with pytest.raises(ValueError, match=r"`fsdp_axes` is 'pp'"):
            call(fsdp_gather="once", fsdp_axes="pp")


def test_plan_counts_the_weights_each_option_holds():
    """`plan_training(pipeline=)` with `fsdp_gather`, `layers` and `layer_bytes`
    adds the gathered stage weights: L=16 over S=2, R=2 is K=4 layers a chunk,
    so 4, 8 (the stage's R·K) and 8 (two chunks) layers of 1 KiB; the command's
    text says the same."""
    import eqshard
    from eqshard._readers._plan_pipeline import pipeline_from_text

    mesh = jax.sharding.AbstractMesh((2, 4), ("pp", "fsdp"))
    params = {"w": jax.ShapeDtypeStruct((16, D, F), jnp.float32)}
    rules = [(".*", eqshard.stacked(P(None, "fsdp"), stages="pp"))]
    text = "microbatches=4,activation=4x8,schedule=circular,repeats=2"
    held = {}
    for gather in ("per_step", "once", "per_repeat"):
        schedule = pipeline_from_text(
            f"{text},fsdp_gather={gather},layers=16,layer_bytes=1024",
            {"float32": jnp.float32},
        )
        plan = eqshard.plan_training(params, rules, mesh, pipeline=schedule)
        assert plan.pipeline is not None
        held[gather] = plan.pipeline.gathered
        base = plan.pipeline.kept + plan.pipeline.buffers + plan.pipeline.in_flight
        assert plan.pipeline.total == base + held[gather]
    assert held == {"per_step": 4 * 1024, "once": 8 * 1024, "per_repeat": 8 * 1024}
    with pytest.raises(ValueError, match=r"fsdp_gather='twice'"):
        eqshard.plan_training(
            params, rules, mesh, pipeline={**schedule, "fsdp_gather": "twice"}
        )
    with pytest.raises(ValueError, match=r"layers=6 .* multiple of S·R = 4"):
        eqshard.plan_training(params, rules, mesh, pipeline={**schedule, "layers": 6})
