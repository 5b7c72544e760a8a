# `ShardingReport.table()` groups repeated layers: arrays whose paths differ only
# in sequence indices and whose cells are equal share a row. Expected rows are
# written out by hand from the shapes, specs and the (dp 2, tp 4) mesh.

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import eqshard


def _blocks(specs_w):
    """Five layers of w (8, 4) and b (4,) float32, and a head (4, 2)."""
    params = {
        "blocks": [
            {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32),
             "b": jax.ShapeDtypeStruct((4,), jnp.float32)}
            for _ in range(5)
        ],
        "head": jax.ShapeDtypeStruct((4, 2), jnp.float32),
    }  # fmt: skip
    specs = {
        "blocks": [{"w": spec, "b": P()} for spec in specs_w],
        "head": P(),
    }
    return params, specs


def _body(table: str) -> list[list[str]]:
    """The rows under the rule, up to the totals line, split on 2+ spaces."""
    lines = table.splitlines()
    body = lines[2 : next(i for i, ln in enumerate(lines) if ln.startswith("total"))]
    return [[cell for cell in line.split("  ") if cell.strip()] for line in body]


def test_repeated_layers_share_a_row(mesh):
    params, specs = _blocks([P("tp")] * 5)
    report = eqshard.analyze_sharding_strategy(params, specs, mesh)
    table = report.table()
    assert table == str(report)
    header = table.splitlines()[0]
    assert "x" in header.split()[1] and "size each" in header
    rows = _body(table)
    # dict keys sorted: blocks/N/b, blocks/N/w, then head.
    assert [r[0].strip() for r in rows] == ["blocks/*/b", "blocks/*/w", "head"]
    assert [r[1].strip() for r in rows] == ["x5", "x5", "(4, 2)"]
    # w (8, 4) float32 = 128 B, split 4 ways over tp: 32 B each, per array.
    assert [c.strip() for c in rows[1][2:]] == ["(8, 4)", "float32", str(P("tp")),
                                               "128 B", "32 B"]  # fmt: skip
    # The totals still count every array.
    assert "total: 11 arrays" in table


def test_full_table_lists_every_array(mesh):
    params, specs = _blocks([P("tp")] * 5)
    table = eqshard.analyze_sharding_strategy(params, specs, mesh).table(group=False)
    paths = [r[0].strip() for r in _body(table)]
    expected = [f"blocks/{i}/{n}" for i in range(5) for n in "bw"] + ["head"]
    assert paths == expected
    assert table.splitlines()[0].split()[:6] == [
        "path", "shape", "dtype", "spec", "size", "per",
    ]  # fmt: skip


def test_one_differing_array_breaks_its_group(mesh):
    # Layer 2's w is replicated: it keeps its own row, and the others' label
    # names their indices, not `*`.
    params, specs = _blocks([P("tp"), P("tp"), P(), P("tp"), P("tp")])
    rows = _body(eqshard.analyze_sharding_strategy(params, specs, mesh).table())
    labels = [" ".join(c.strip() for c in r[:2]) for r in rows]
    assert labels == [
        "blocks/*/b x5",
        "blocks/[0-1,3-4]/w x4",
        "blocks/2/w (8, 4)",
        "head (4, 2)",
    ]
    assert rows[2][-1].strip() == "replicated" and rows[2][-2].strip() == "128 B"
