# eqshard.search_layout: candidates compiled for a training step and ranked. A
# model whose parameters fit but whose activations do not; a stacked model whose
# layer axis no candidate splits; the rules read back; determinism; your
# candidates ranked with the built-in ones; bandwidths; budgets; errors. Models
# are small MLPs that compile in well under a second per candidate.

import dataclasses
import gc
import io
import json
import os
import pty
import re
import sys
import threading
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P
from probes import Compiles

import eqshard
from eqshard._cli._rules_file import parse_rules
from eqshard._spectree._select import select


D = 32


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    activation: Callable  # a leaf that is not an array

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(D, 4 * D, key=k1)
        self.down = eqx.nn.Linear(4 * D, D, key=k2)
        self.activation = jax.nn.relu

    def __call__(self, x):
        return x + self.down(self.activation(self.up(x)))


class Unrolled(eqx.Module):
    blocks: list

    def __init__(self, key):
        self.blocks = [Block(k) for k in jax.random.split(key, 2)]

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Stacked(eqx.Module):
    blocks: Block  # every array with a leading layer axis

    def __init__(self, key):
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(key, 2))

    def __call__(self, x):
        arrays, static = eqx.partition(self.blocks, eqx.is_array)
        layer = lambda x, block: (eqx.combine(block, static)(x), None)  # noqa: E731
        return jax.lax.scan(layer, x, arrays)[0]


OPTIMIZER = optax.adamw(1e-3)


def step(params, opt_state, x):
    loss, grads = eqx.filter_value_and_grad(
        lambda model, x: jnp.mean(jax.vmap(model)(x) ** 2)
    )(params, x)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return eqx.apply_updates(params, updates), opt_state, loss


def arguments(model_type, mesh, batch, spec):
    """The step's arguments, abstract: the model, AdamW's state, a batch."""
    params = eqx.filter_eval_shape(model_type, jax.random.key(0))
    state = jax.eval_shape(OPTIMIZER.init, eqx.filter(params, eqshard.is_array))
    x = eqshard.abstract(jax.ShapeDtypeStruct((batch, D), jnp.float32), spec, mesh)
    return params, state, x


TP = [
    ("up/weight", P("tp", None)),
    ("up/bias", P("tp")),
    ("down/weight", P(None, "tp")),
    (".*", P()),
]
TP_WRONG = [(r, P("tp", None) if r == "down/weight" else s) for r, s in TP]
BUDGET = 3 * 2**19  # 1.5 MiB


@pytest.fixture(scope="module")
def line_mesh():
    return jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))


@pytest.fixture(scope="module")
def activations(mesh):
    """A search on a model whose parameters fit replicated but whose activations
    (a batch of 2048) do not, with two candidates of yours."""
    args = arguments(Unrolled, mesh, 2048, P("dp"))
    gc.collect()  # other tests' garbage, which a collection in the search would free
    before = len(jax.live_arrays())
    with Compiles() as compiles:
        result = eqshard.search_layout(
            step,
            *args,
            mesh=mesh,
            device_memory="1.5MiB",
            candidates={"mine": TP, "wrong": TP_WRONG},
        )
    assert len(jax.live_arrays()) == before  # nothing allocated
    assert compiles.count == len(result.candidates)  # one compile a layout
    return args, result


@pytest.fixture(scope="module")
def stacked(mesh):
    # The step under eqx.filter_jit, as users write it.
    args = arguments(Stacked, mesh, 64, P("dp"))
    return args, eqshard.search_layout(
        eqx.filter_jit(step), *args, mesh=mesh, device_memory="1GiB"
    )


def by_name(result):
    return {c.name: c for c in result.candidates}


def normalized(spec):
    entries = [(e,) if isinstance(e, str) else tuple(e or ()) for e in spec]
    while entries and not entries[-1]:
        entries.pop()
    return tuple(entries)


def flat_specs(specs):
    return [
        normalized(s)
        for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
        if isinstance(s, P)
    ]


# ---------------------------------------------------------------------------------
# What fits is decided by the compiled step.
# ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_layout_whose_activations_do_not_fit_is_rejected(activations, mesh):
    (params, _, _), result = activations
    replicated = by_name(result)["replicated"]
    # The parameter-only plan of the replicated layout fits...
    plan = eqshard.plan_training(
        params,
        eqshard.match_partition_rules([(".*", P())], params),
        mesh,
        optimizer=OPTIMIZER,
        device_memory=BUDGET,
    )
    assert plan.fits and plan.max_bytes_per_device < BUDGET / 4
    # ...but its compiled step does not, and the search says by how much.
    assert not replicated.fits and replicated.memory.peak_bytes > BUDGET
    over = eqshard._readers._inspect.format_bytes(replicated.memory.peak_bytes - BUDGET)
    assert f"over the budget of 1.5 MiB by {over}" in replicated.why
    best = result.best
    assert best is not None and best.fits and best.memory.peak_bytes <= BUDGET
    assert best.report.memory.fits(BUDGET)
    # Tensor parallelism splits the hidden activations: the pair is split.
    specs = best.specs.blocks[0]
    assert normalized(specs.up.weight) == (("tp",),)
    assert normalized(specs.down.weight) == ((), ("tp",))
    assert str(result).index("replicated") > str(result).index(best.name)


@pytest.mark.slow
def test_your_candidates_are_ranked_with_the_built_in_ones(activations):
    _, result = activations
    found = by_name(result)
    assert found["mine"].origin == "given" and found["wrong"].origin == "given"
    # The built-in tensor-parallel layout is yours: it is compiled once, as yours.
    assert "tp(tp)" not in found and "fsdp(dp)" in found
    assert found["fsdp(dp)"].origin == "built-in"
    # The second matrix on the wrong dimension gathers activations: more bytes.
    assert found["wrong"].total_bytes > found["mine"].total_bytes
    assert found["wrong"].cost > found["mine"].cost
    fitting = [c for c in result.candidates if c.fits]
    rejected = [c for c in result.candidates if not c.fits]
    assert result.candidates == tuple(fitting + rejected) and fitting and rejected
    assert [c.cost for c in fitting] == sorted(c.cost for c in fitting)
    peaks = [c.memory.peak_bytes for c in rejected]
    assert peaks == sorted(peaks)


@pytest.mark.slow
def test_the_step_is_compiled_as_a_training_step(activations):
    _, result = activations
    best = result.best
    assert best is not None
    specs = eqshard.flatten_tree(best.specs, sep="/")
    arguments = {row.path: row for row in best.report.arguments}
    outputs = {row.path: row for row in best.report.outputs}
    for path, spec in specs.items():
        # The parameters and their AdamW moments are laid out by the candidate,
        # the updated ones too, and the old ones are donated.
        want = str(spec)
        assert arguments[f"params/{path}"].spec == want
        assert arguments[f"params/{path}"].donated
        assert arguments[f"opt_state/0/mu/{path}"].spec == want
        assert outputs[f"out/0/{path}"].spec == want
        assert outputs[f"out/1/0/nu/{path}"].spec == want
    assert arguments["x"].spec == str(P("dp")) and not arguments["x"].donated
    assert best.memory.alias_bytes > 0
    assert result.data_axes == ("dp",)


@pytest.mark.slow
def test_the_result_reads_as_the_other_reports(activations):
    _, result = activations
    text = str(result)
    assert text.startswith("layout search for step 'step' on mesh {'dp': 2, 'tp': 4}")
    assert f"best: {result.best.name}" in text
    assert "rules of " in text and "\n  .*  P()" in text
    assert "\n" not in repr(result) and repr(result).startswith("LayoutSearch(")
    assert "0x" not in text
    shown = io.StringIO()
    result.show(file=shown)
    assert all(c.name in shown.getvalue() for c in result.candidates)
    data = json.loads(result.to_json())
    assert result.to_json() == json.dumps(data, sort_keys=True, indent=1)
    assert [c["name"] for c in data["candidates"]] == [
        c.name for c in result.candidates
    ]
    assert data["best"] == result.best.name
    assert data["best_report"] == json.loads(result.best.report.to_json())
    candidate = result.candidates[0]
    assert str(candidate).startswith(f"{candidate.name} ({candidate.origin}): fits")
    assert "\n" not in repr(candidate)


@pytest.mark.slow
def test_layouts_compiled_unoptimised_report_what_analyze_step_reports(
    activations, stacked, mesh, monkeypatch
):
    # The search compiles at XLA's backend optimisation level 0, which changes
    # the machine code only: the reports are those of the default compile.
    from eqshard._search import _compile

    for fn, ((params, state, x), result) in (
        (step, activations),
        (eqx.filter_jit(step), stacked),
    ):
        best = result.best
        assert best is not None
        monkeypatch.setattr(_compile, "_OPTIONS", None)
        args = (params, state, x)
        selection = select(args, 0, caller="search_layout")
        default = _compile.Step(fn, args, selection, mesh).report(best.specs)
        # Each report records the options it was compiled with; all else is equal.
        assert best.report.compiler_options == (
            ("xla_backend_optimization_level", "0"),
        )
        unoptimised = dataclasses.replace(best.report, compiler_options=())
        assert default.to_json() == unoptimised.to_json()


# ---------------------------------------------------------------------------------
# Stacked layers, and the rules read back.
# ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_no_candidate_splits_the_layer_axis_of_a_stacked_model(stacked):
    _, result = stacked
    assert len(result.candidates) >= 4
    split = set()
    for candidate in result.candidates:
        flat = eqshard.flatten_tree(candidate.specs, sep="/")
        for path, spec in flat.items():
            assert path.startswith("blocks/")
            entries = normalized(spec)
            assert not entries or entries[0] == (), (candidate.name, path, spec)
            if len(entries) > 1:
                split.add(path)
    # The candidates do split the stacked arrays, past the layer axis.
    assert {"blocks/up/weight", "blocks/down/weight"} <= split
    # Named by the step's signature through eqx.filter_jit.
    paths = [row.path for row in result.candidates[0].report.arguments]
    assert "params/blocks/up/weight" in paths and "x" in paths


def _read_back(candidate, params, mesh):
    # The rules as they are, and as a rules file the command reads.
    specs = eqshard.match_partition_rules(candidate.rules, params, mesh=mesh)
    report = eqshard.explain_partition_rules(candidate.rules, params, mesh=mesh)
    parsed = parse_rules(candidate.rules_text(), "search.rules")
    from_file = eqshard.match_partition_rules(parsed, params, mesh=mesh)
    file_report = eqshard.explain_partition_rules(parsed, params, mesh=mesh)
    return specs, report, from_file, file_report


@pytest.mark.slow
def test_the_rules_read_back_with_no_dead_rule(stacked, activations, mesh):
    for (params, _, _), result in (stacked, activations):
        for candidate in result.candidates:
            specs, report, from_file, file_report = _read_back(candidate, params, mesh)
            assert report.dead_rules == () and not report.problems, candidate.name
            assert file_report.dead_rules == () and not file_report.problems
            want = flat_specs(candidate.specs)
            assert flat_specs(specs) == want and flat_specs(from_file) == want
            # A stable text: no object addresses.
            assert "0x" not in str(candidate.rules)
            assert not re.search(r"at 0x|object at", candidate.rules_text())


@pytest.mark.slow
def test_the_search_is_repeatable_and_says_when_nothing_fits(line_mesh):
    args = arguments(Unrolled, line_mesh, 64, P("x"))
    first, second = (
        eqshard.search_layout(step, *args, mesh=line_mesh, device_memory="1KiB")
        for _ in range(2)
    )
    assert [str(c.rules) for c in first.candidates] == [
        str(c.rules) for c in second.candidates
    ]
    assert first.to_json() == second.to_json() and str(first) == str(second)
    assert sorted(c.name for c in first.candidates) == [
        "fsdp(x)",
        "replicated",
        "tp(x)",
    ]
    assert first.data_axes == ("x",)
    # Nothing fits in 1 KiB: the smallest peak, and how far over it is.
    assert first.best is None and not any(c.fits for c in first.candidates)
    smallest = first.candidates[0]
    peak = smallest.memory.peak_bytes
    assert peak == min(c.memory.peak_bytes for c in first.candidates)
    fmt = eqshard._readers._inspect.format_bytes
    assert (
        f"nothing fits: the smallest peak is {fmt(peak)} ({smallest.name}), "
        f"{fmt(peak - 1024)} over the budget" in str(first)
    )
    assert json.loads(first.to_json())["best"] is None


# ---------------------------------------------------------------------------------
# Options.
# ---------------------------------------------------------------------------------


def test_bandwidth_weights_the_axes_a_collective_crosses(mesh):
    args = arguments(Unrolled, mesh, 256, P("dp"))
    ranked = []
    for bandwidth in ({"dp": 0.01}, {"tp": 0.01}):
        result = eqshard.search_layout(
            step,
            *args,
            mesh=mesh,
            device_memory="1GiB",
            candidates={"replicated": [(".*", P())], "tp": TP},
            builtin=False,
            bandwidth=bandwidth,
        )
        ranked.append([c.name for c in result.candidates])
        for candidate in result.candidates:
            # A collective's bytes sent count over the slowest axis it crosses.
            sent = sum(
                row.link_bytes
                * row.count
                / min(bandwidth.get(axis, 1.0) for axis in row.axes)
                for row in candidate.report.collectives
            )
            assert candidate.cost == pytest.approx(sent)
    # Over a slow dp, tensor parallelism wins (it reduces fewer gradients over
    # dp); over a slow tp, data parallelism (it communicates over dp alone).
    assert ranked == [["tp", "replicated"], ["replicated", "tp"]]


def test_max_candidates_time_budget_and_a_batch_without_shardings(mesh):
    params, state, _ = arguments(Unrolled, mesh, 64, P("dp"))
    batch = np.ones((64, D), np.float32)
    result = eqshard.search_layout(
        step, params, state, batch, mesh=mesh, device_memory="1GiB", max_candidates=2
    )
    assert [c.name for c in result.candidates] != [] and len(result.candidates) == 2
    assert {why for _, why in result.skipped} == {"max_candidates"}
    # No argument splits its leading dimension: every axis is a data axis.
    assert result.data_axes == ("dp", "tp")
    arguments_ = {row.path: row for row in result.candidates[0].report.arguments}
    assert arguments_["x"].spec == str(P())
    timed = eqshard.search_layout(
        step, params, state, batch, mesh=mesh, device_memory="1GiB", time_budget=1e-9
    )
    assert len(timed.candidates) == 1
    assert timed.skipped and {why for _, why in timed.skipped} == {"time budget"}


def test_the_progress_bar_draws_on_a_terminal_only(monkeypatch):
    from eqshard._search._search import _Progress

    def drawn(enabled):
        # A real pseudo-terminal, drained while the bar draws on it.
        master, slave = pty.openpty()
        stream = os.fdopen(slave, "w")
        chunks = []

        def drain():
            while True:
                try:
                    data = os.read(master, 4096)
                except OSError:  # the terminal closed
                    return
                if not data:
                    return
                chunks.append(data)

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        bar = _Progress(2, enabled, stream)
        for name in ("fsdp(dp)", "tp(tp)"):
            bar.update(name)
        bar.close()
        stream.close()
        reader.join(timeout=10)
        os.close(master)
        return b"".join(chunks).decode(errors="replace")

    assert "tp(tp)" in drawn(True)  # rich's bar
    assert drawn(False) == ""
    monkeypatch.setitem(sys.modules, "rich.progress", None)  # as without rich
    assert "layouts [########################] 2/2  tp(tp)" in drawn(True)
    # Not a terminal (a log, a pipe): nothing is drawn.
    log = io.StringIO()
    bar = _Progress(2, True, log)
    bar.update("tp(tp)")
    bar.close()
    assert log.getvalue() == ""


# ---------------------------------------------------------------------------------
# Errors, before anything compiles.
# ---------------------------------------------------------------------------------


def test_errors(mesh):
    args = arguments(Unrolled, mesh, 64, P("dp"))
    with pytest.raises(ValueError, match=r"^eqshard.search_layout: .*AbstractMesh"):
        eqshard.search_layout(
            step, *args, mesh=AbstractMesh((2, 4), ("dp", "tp")), device_memory="1GiB"
        )
    bad = [("up/weight", P("tp", "tp")), (".*", P())]
    with pytest.raises(ValueError, match=r"candidate 'bad'(.|\n)*blocks/0/up/weight"):
        eqshard.search_layout(
            step, *args, mesh=mesh, device_memory="1GiB", candidates={"bad": bad}
        )
    with pytest.raises(ValueError, match=r"candidate 1(.|\n)*blocks/0/up/weight"):
        eqshard.search_layout(
            step, *args, mesh=mesh, device_memory="1GiB", candidates=[[]]
        )
    with pytest.raises(ValueError, match="'pp', which is not an axis"):
        eqshard.search_layout(
            step, *args, mesh=mesh, device_memory="1GiB", bandwidth={"pp": 0.1}
        )
    with pytest.raises(ValueError, match="nothing to compile"):
        eqshard.search_layout(
            step, *args, mesh=mesh, device_memory="1GiB", builtin=False
        )
    other = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    x = jax.ShapeDtypeStruct((64, D), jnp.float32, sharding=NamedSharding(other, P()))
    with pytest.raises(ValueError, match="argument at 'x' is laid out on the mesh"):
        eqshard.search_layout(step, *args[:2], x, mesh=mesh, device_memory="1GiB")
    with pytest.raises(ValueError, match="not an amount of memory"):
        eqshard.search_layout(step, *args, mesh=mesh, device_memory="lots")
    with pytest.raises(TypeError, match="`candidates` is"):
        eqshard.search_layout(
            step, *args, mesh=mesh, device_memory="1GiB", candidates="tp"
        )


def test_on_explicit_axes_a_layout_jax_cannot_type_is_skipped_and_named(
    explicit_mesh,
):
    # Equinox's Linear names no output sharding: on Explicit axes, JAX cannot
    # type its matmul with the weight split, so only `replicated` compiles.
    args = arguments(Unrolled, explicit_mesh, 64, P("dp"))
    result = eqshard.search_layout(
        step, *args, mesh=explicit_mesh, device_memory="1GiB", progress=False
    )
    assert [c.name for c in result.candidates] == ["replicated"]
    untyped = dict(result.skipped)
    assert {"fsdp(dp)", "tp(tp)"} <= set(untyped)
    assert "JAX cannot type the step with this layout" in untyped["tp(tp)"]
    assert "'blocks/0/down'" in untyped["tp(tp)"]  # the layer where it failed
    assert "not compiled: fsdp(dp) (JAX cannot type" in result.table()
    # None JAX can type: an error naming them, and how to fix it.
    with pytest.raises(ValueError, match=r"no candidate could be compiled") as e:
        eqshard.search_layout(
            step,
            *args,
            mesh=explicit_mesh,
            device_memory="1GiB",
            candidates={"tp": TP},
            builtin=False,
        )
    assert "'tp'" in str(e.value) and "auto_axes" in str(e.value)


def test_numbers_are_ints_or_floats(mesh):
    args = arguments(Unrolled, mesh, 64, P("dp"))
    result = eqshard.search_layout(
        step,
        *args,
        mesh=mesh,
        candidates={"tp": TP},
        builtin=False,
        bandwidth={"dp": 1, "tp": np.float32(0.5)},
        device_memory=1e9,
        time_budget=60,
    )
    assert result.device_memory == 10**9
    assert dict(result.bandwidth) == {"dp": 1.0, "tp": 0.5}
    for bad, match in (
        ({"device_memory": float("inf")}, r"`device_memory` is inf; give"),
        ({"device_memory": True}, r"`device_memory` is True; give"),
        ({"device_memory": -1.0}, r"the memory must be positive"),
        ({"bandwidth": {"dp": float("nan")}}, r"`bandwidth\['dp'\]` is nan"),
        ({"bandwidth": {"dp": True}}, r"`bandwidth\['dp'\]` is True"),
    ):
        options = {"device_memory": "1GiB", **bad}
        with pytest.raises(ValueError, match=rf"^eqshard.search_layout: {match}"):
            eqshard.search_layout(step, *args, mesh=mesh, **options)


def test_two_candidates_of_one_name(mesh):
    args = arguments(Unrolled, mesh, 64, P("dp"))
    with pytest.raises(ValueError, match=r"two candidates are named '1'"):
        eqshard.search_layout(
            step, *args, mesh=mesh, device_memory="1GiB", candidates={1: TP, "1": TP}
        )
    # Yours and a built-in strategy of another layout.
    mine = {"tp(tp)": [(".*", P())]}
    with pytest.raises(ValueError, match=r"two candidates are named 'tp\(tp\)'"):
        eqshard.search_layout(
            step, *args, mesh=mesh, device_memory="1GiB", candidates=mine
        )
