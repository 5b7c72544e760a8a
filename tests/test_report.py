"""Tests for eqshard._report: every report has one interface, `str`, a one-line
`repr`, `show` (rich when installed, text otherwise) and a byte-stable
`to_json`."""

import io
import json
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import eqshard


def _reports(mesh):
    """One report of each kind, for the same small model (built twice: the JSON
    must not change)."""
    params = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32), "b": jnp.zeros(3)}
    specs = {"w": P("dp", "tp"), "b": P("tp")}  # 'b' cannot be split 4 ways
    rules = [("w", P("dp", "tp")), ("b", P()), ("typo", P("dp"))]
    placed = eqshard.shard({"b": jnp.zeros(3)}, P(), mesh)
    step = eqx.filter_jit(lambda b: b * 2)
    return {
        "ShardingReport": eqshard.analyze_sharding_strategy(params, specs, mesh),
        "TrainingPlan": eqshard.plan_training(
            params, specs, mesh, optimizer=optax.adam(1e-3), device_memory="1MiB"
        ),
        "RulesReport": eqshard.explain_partition_rules(rules, params, mesh=mesh),
        "LayoutReport": eqshard.check_layout(
            placed, {"b": P("dp")}, mesh, on_invalid="ignore"
        ),
        "StepReport": eqshard.analyze_step(step, placed["b"]),
    }


def test_every_report_has_one_interface(mesh, monkeypatch):
    reports = _reports(mesh)
    again = _reports(mesh)
    for name, report in reports.items():
        assert isinstance(report, getattr(eqshard, name))
        assert str(report) == report.table() and report.table()
        line = repr(report)
        assert line.startswith(f"{name}(") and "\n" not in line, line
        text = report.to_json()
        assert isinstance(text, str) and "0x" not in text
        assert json.dumps(json.loads(text), sort_keys=True, indent=1) == text
        assert again[name].to_json() == text, name  # the same bytes every time
        shown = io.StringIO()
        report.show(shown)  # rich, installed for the tests
        assert shown.getvalue().strip(), name
    assert json.loads(reports["ShardingReport"].to_json())["mesh"] == [
        ["dp", 2],
        ["tp", 4],
    ]
    rows = json.loads(reports["RulesReport"].to_json())["rows"]
    assert [row["spec"] for row in rows] == ["P()", "P('dp', 'tp')"]
    # Without rich, `show` prints the table.
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.setitem(sys.modules, "rich.console", None)
    for report in reports.values():
        plain = io.StringIO()
        report.show(plain)
        assert plain.getvalue() == report.table() + "\n"
