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
