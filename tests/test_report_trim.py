# Readable reports: the largest rows first with a count of the rest, an optimizer
# state's leaves listed with their parameter's, sources named from the user's
# project, and `stacked` rules written as text that reads back. Expected values
# are worked out by hand.

import dataclasses
import json
import os
import site

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqshard
from eqshard._cli._fit import fsdp_rules
from eqshard._cli._load import UsageError
from eqshard._cli._rules_file import parse_rules
from eqshard._spectree._rules_syntax import parse_value, value_text
from eqshard._step._records import (
    CollectivePart,
    CollectiveRow,
    MovedInput,
    StepLeaf,
    StepMemory,
)
from eqshard._step._report import StepReport
from eqshard._step._rows import relative_source
from eqshard._tree import grouped_paths


def _names(paths, keys=None):
    return [group.name(paths) for group in grouped_paths(paths, keys)]


# ---------------------------------------------------------------- grouping paths


def test_an_optimizer_states_paths_follow_their_parameters():
    paths = [
        "out/0/blocks/0/w",
        "out/1/0/mu/blocks/0/w",
        "out/1/0/nu/blocks/0/w",
        "out/0/blocks/1/w",
        "out/1/0/mu/blocks/1/w",
        "out/1/0/count",
    ]
    assert _names(paths) == [
        "out/0/blocks/0/w (+ mu, nu)",
        "out/0/blocks/1/w (+ mu)",
        "out/1/0/count",
    ]
    # Arguments named by the signature, and a state tuple `(model, opt_state)`.
    assert _names(["params/w", "opt_state/0/mu/w"]) == ["params/w (+ mu)"]
    assert _names(["0/a/w", "1/0/mu/a/w", "1/0/nu/a/w"]) == ["0/a/w (+ mu, nu)"]


def test_paths_that_only_share_an_end_stand_alone():
    # Layers of one tree, a nested copy in the same item, two encoders of one
    # argument, an updated parameter beside its input, and an index in front.
    for paths in (
        ["params/blocks/0/w", "params/blocks/1/w"],
        ["params/w", "params/sub/w"],
        ["params/vision/w", "params/text/model/w"],
        ["params/w", "out/0/w"],
        ["out/0/w", "params/enc/l/0/w"],
    ):
        assert _names(paths) == paths
    # With keys (shapes, what a message says), only equal keys share a line.
    paths = ["out/0/w", "out/1/0/mu/w"]
    assert _names(paths, [(4,), (2,)]) == paths
    assert _names(paths, [(4,), (4,)]) == ["out/0/w (+ mu)"]


# ---------------------------------------------------------------- step reports


def _row(i: int, nbytes: int, count: int = 1, paths=()) -> CollectiveRow:
    part = CollectivePart((nbytes // 4,), "f32", nbytes, tuple(paths))
    return CollectiveRow(f"ar.{i}", "all-reduce", (part,), count, ("dp",), 2, "", "")


def _report(rows, outputs=()) -> StepReport:
    return StepReport(
        function="step",
        mesh=(("dp", 2),),
        arguments=(),
        outputs=tuple(outputs),
        memory=StepMemory(0, 0, 0, 0, 0),
        collectives=tuple(rows),
    )


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("all-reduce")]


def test_table_shows_the_largest_collectives_first_and_counts_the_rest():
    # 25 rows of 1, 2, ..., 25 KiB; row 3 runs 100 times (300 KiB per step).
    rows = [_row(i, 1024 * (i + 1), count=100 if i == 2 else 1) for i in range(25)]
    report = _report(rows)
    top = _table_rows(report.table(top=3))
    assert [line.split()[1] for line in top] == ["(768,)", "(6400,)", "(6144,)"]
    # The rest: 22 rows, 1 + 2 + ... + 25 KiB without 3, 24 and 25: 273 KiB.
    assert "... and 22 more collectives, 273.0 KiB per device per step" in (
        report.table(top=3)
    )
    assert len(_table_rows(str(report))) == 20 and "and 5 more" in str(report)
    assert len(_table_rows(report.table(top=None))) == 25
    assert "more collectives" not in report.table(top=None)
    with pytest.raises(ValueError, match="`top` must be 0 or more"):
        report.table(top=-1)


def test_table_lists_an_optimizer_state_with_its_parameter():
    outs = ["out/0/w", "out/1/0/mu/w", "out/1/0/nu/w", "out/0/b", "out/1/0/mu/b"]
    leaves = [StepLeaf(p, (8,), "float32", "P()", 32) for p in outs]
    report = _report([_row(0, 160, paths=outs)], outputs=leaves)
    (line,) = _table_rows(report.table())
    assert line.endswith("out/0/w (+ mu, nu), out/0/b (+ mu)")


def test_moved_inputs_list_an_optimizer_state_with_its_parameter():
    paths = ["state/0/w", "state/1/0/mu/w", "state/1/0/nu/w", "x"]
    moved = [MovedInput(p, (8,), "float32", "host (NumPy)", "P()") for p in paths]
    report = dataclasses.replace(_report([]), moved=tuple(moved))
    lines = report.table().splitlines()
    start = lines.index("inputs moved at every call:")
    assert lines[start + 1 :] == [
        "  state/0/w (+ mu, nu): host (NumPy) -> P()",
        "  x: host (NumPy) -> P()",
    ]
    assert report.table(top=1).splitlines()[-1] == "  ... and 1 more"


def test_sources_in_installed_packages_are_named_from_the_package():
    root = site.getsitepackages()[0]
    linear = os.path.join(root, "equinox", "nn", "_linear.py")
    assert relative_source(f"{linear}:97") == "equinox/nn/_linear.py:97"
    assert relative_source("/usr/lib/python3/dist-packages/jax/a.py:3") == "jax/a.py:3"
    here = os.path.join(os.getcwd(), "train.py")
    assert relative_source(f"{here}:5") == "train.py:5"
    assert relative_source("/elsewhere/train.py:5") == "/elsewhere/train.py:5"


# ---------------------------------------------------------------- errors and plans


@pytest.fixture(scope="module")
def mesh():
    return eqshard.create_mesh((2, 4), ("dp", "tp"))


def _adam_state():
    params = {"blocks": [{"w": jnp.ones((8, 8))} for _ in range(2)], "b": jnp.ones(8)}
    return params, optax.adam(1e-3).init(params)


def test_check_layout_lists_an_optimizer_state_on_its_parameters_line(mesh):
    state = jax.device_put(_adam_state(), NamedSharding(mesh, P()))
    rules = [("w", P("tp")), (".*", P())]
    with pytest.raises(ValueError) as raised:
        eqshard.check_layout(state, rules, mesh)
    message = str(raised.value)
    # Two weights and their two Adam moments each: 6 arrays on 2 lines.
    assert "6 arrays are not laid out as asked" in message
    items = [line for line in message.splitlines() if line.startswith("  - ")]
    assert [line.split(" (shape")[0] for line in items] == [
        "  - '0/blocks/0/w' (+ mu, nu)",
        "  - '0/blocks/1/w' (+ mu, nu)",
    ]


def test_a_follower_with_another_mismatch_keeps_its_own_line(mesh):
    params, opt_state = _adam_state()
    replicated = NamedSharding(mesh, P())
    state = jax.device_put((params, opt_state), replicated)
    specs = eqshard.match_partition_rules([("w", P("tp")), (".*", P())], state)
    # mu of blocks/0 is asked for another spec than its parameter's.
    specs[1][0].mu["blocks"][0]["w"] = P("dp")
    report = eqshard.check_layout(state, specs, mesh, on_invalid="ignore")
    text = str(report)
    assert "'0/blocks/0/w' (+ nu) (shape" in text
    assert "'1/0/mu/blocks/0/w' (shape (8, 8)): asked P('dp',)" in text


def test_spec_errors_list_an_optimizer_state_on_its_parameters_line(mesh):
    params = {"w": jnp.ones((6, 8)), "b": jnp.ones(6)}
    state = (params, optax.adam(1e-3).init(params))
    specs = eqshard.match_partition_rules([("w", P("tp")), (".*", P())], state)
    with pytest.raises(ValueError, match="3 leaves have specs") as raised:
        eqshard.shard(state, specs, mesh)
    items = [l for l in str(raised.value).splitlines() if l.startswith("  - ")]
    assert len(items) == 1 and items[0].startswith("  - '0/w' (+ mu, nu) (shape")


def test_restore_lists_an_optimizer_state_on_its_parameters_line(tmp_path):
    def make(width):
        params = {"w": jnp.ones((width, 8)), "b": jnp.ones(8)}
        return params, optax.adam(1e-3).init(params)

    eqshard.save(tmp_path / "c", make(4))
    with pytest.raises(ValueError, match="does not match `like`") as raised:
        eqshard.restore(tmp_path / "c", make(6))
    items = [l for l in str(raised.value).splitlines() if l.startswith("  - ")]
    assert items == ["  - '0/w' (+ mu, nu): shape (4, 8) there, (6, 8) in `like`."]


def test_plan_lists_an_optimizer_state_with_its_parameter(mesh):
    params = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)}
    plan = eqshard.plan_training(params, P(), mesh, optimizer=optax.adam(1e-3))
    # The parameter, its gradient and both moments: 4 * 256 KiB.
    assert "1.0 MiB  parameters: w (+ grad, mu, nu) (256, 256) float32" in str(plan)


# ---------------------------------------------------------------- stacked as text


STACKED = eqshard.stacked(P("tp", None))


def test_stacked_is_written_as_it_reads_back():
    text = value_text(STACKED)
    assert text == "stacked(P('tp', None))"
    assert parse_value(text) == STACKED
    assert eval(text, {"stacked": eqshard.stacked, "P": P}) == STACKED
    named = eqshard.stacked(eqshard.AxisNames("embed", None))
    assert parse_value(value_text(named)) == named
    assert parse_value("stacked(tp,None)") == STACKED


def test_a_rules_report_writes_stacked_rules_that_match_again():
    tree = {"blocks": {"w": jnp.zeros((4, 8, 16))}, "b": jnp.zeros(3)}
    rules = [("blocks/w", STACKED), (".*", P())]
    report = eqshard.explain_partition_rules(rules, tree)
    written = json.loads(report.to_json())["rules"]
    assert written == [["blocks/w", "stacked(P('tp', None))"], [".*", "P()"]]
    assert "stacked(P('tp', None))" in str(report)
    again = [(pattern, parse_value(text)) for pattern, text in written]
    assert eqshard.match_partition_rules(again, tree) == {
        "blocks": {"w": P(None, "tp", None)},
        "b": P(),
    }


def test_a_rules_file_reads_stacked_rules():
    text = (
        "blocks/.*/w  stacked(P('tp', None))\n"
        "blocks/.*/v -> stacked( P('dp', None) )\n"
        "blocks/.*/u  stacked(tp,None)\n"
        ".*  ()\n"
    )
    assert parse_rules(text, "rules.txt") == [
        ("blocks/.*/w", STACKED),
        ("blocks/.*/v", eqshard.stacked(P("dp", None))),
        ("blocks/.*/u", STACKED),
        (".*", P()),
    ]


@pytest.mark.parametrize(
    "line, match",
    [
        (
            "w  stackd(P('tp'))",
            "'stackd' is not a rule value: write a spec, or stacked",
        ),
        ("w  stacked(P('tp'), bogus=1)", "unexpected keyword argument 'bogus'"),
        ("w  stacked(P('tp'), layers=x)", "must be literals"),
    ],
)
def test_a_rules_file_with_an_unknown_value_spelling(line, match):
    with pytest.raises(UsageError, match=rf"rules.txt, line 2: .*{match}"):
        parse_rules(f".*  ()\n{line}\n", "rules.txt")


def test_fit_refuses_stacked_rules_it_cannot_add_fsdp_to(mesh):
    with pytest.raises(ValueError, match="the rule 'w' has stacked"):
        fsdp_rules([("w", STACKED)], mesh, ("dp",), 0)


def test_the_search_writes_stacked_rules_as_text():
    from eqshard._search._report import value_text as search_text

    assert search_text(STACKED) == "stacked(P('tp', None))"
    assert search_text(eqx.nn.Linear) == "Linear"
