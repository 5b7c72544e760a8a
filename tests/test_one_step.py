# One step, every tool: the training step a user writes for eqshard.filter_jit,
# `train_step(batch, (model, opt_state))` (tests/models.py), goes unchanged into
# filter_jit, analyze_step, search_layout (params=lambda args: args[1][0]) and
# the command (--step, --args, --params 1.0), with no adapter (such steps run
# in tests/test_lifecycle.py; a small one runs here). The search's
# figure for a layout is the real step's: the same memory and collectives as
# analyze_step reads from the filter_jit step with those rules. Then the
# `params=` selector's errors, and plan_training given the whole state.

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P
from models import CASES, OPTIMIZER

import eqshard
from eqshard._spectree._select import select


# Rules that read no name (the models' names change with the third-party models
# they copy): every array of 64 elements or more split on a dimension over 'tp'.
RULES = [(".*", eqshard.auto_fsdp("tp", min_size=64))]
# The step objects, made once, as a training script makes its step: the batch
# over 'dp', the state by the rules and back as it came, donated.
STEPS = {
    name: eqshard.filter_jit(
        case.train_step,
        in_specs=(P("dp"), RULES),
        out_specs=(1, P()),
        donate="all-except-first",
    )
    for name, case in CASES.items()
}


def arguments(name):
    """The step's arguments as a script has them: the batch, and the state
    (abstract: `eqx.filter_eval_shape` of the model's maker)."""
    case = CASES[name]
    return case.batch, eqx.filter_eval_shape(case.make, jax.random.key(0))


def _collectives(report):
    return sorted(
        (row.kind, str(row.shape), row.count, row.axes, row.link_bytes)
        for row in report.collectives
    )


STEP_MODULE = """
import test_one_step as tests

step = tests.STEPS[{name!r}]


def arguments():
    return tests.arguments({name!r})
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_one_step_through_every_tool(name, mesh, tmp_path, monkeypatch, capsys):
    step = STEPS[name]  # made by filter_jit (tests/test_lifecycle.py runs such steps)
    # analyze_step: the same object, abstract arguments laid out as it lays them.
    batch, shapes = arguments(name)
    laid = eqshard.abstract(shapes, RULES, mesh)
    with jax.set_mesh(mesh):  # the step's mesh, as when it runs
        real = eqshard.analyze_step(step, eqshard.abstract(batch, P("dp"), mesh), laid)
    # search_layout: the same object and arguments, the model picked by params=.
    result = eqshard.search_layout(
        step,
        batch,
        shapes,
        params=lambda args: args[1][0],
        mesh=mesh,
        device_memory="1GiB",
        candidates={"rules": RULES},
        builtin=False,
        progress=False,
    )
    (candidate,) = result.candidates
    # The search's figure is the real step's: memory and collectives.
    assert candidate.report.memory == real.memory
    assert _collectives(candidate.report) == _collectives(real)
    assert result.data_axes == ("dp",)
    # The command: the same object, by name, with the layout's rules as a file.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stepmod.py").write_text(STEP_MODULE.format(name=name))
    (tmp_path / "layout.rules").write_text(candidate.rules_text())
    from eqshard._cli._main import main

    capsys.readouterr()
    command = ["--step", "stepmod.py:step", "--args", "stepmod.py:arguments"]
    command += ["--params", "1.0", "--rules", "layout.rules"]
    assert main(command) == 0
    out = capsys.readouterr().out
    # The same figures (the rows' source files read relative to the directory).
    summary = candidate.report.table().split("\n\n")[0]
    assert summary.count("\n") >= 2 and summary in out
    assert re.search(r"argument 0: .*, split over dp", out)


# ---------------------------------------------------------------------------------
# The params= selector: what it picks, and its errors.
# ---------------------------------------------------------------------------------


class _Half(eqx.Module):
    weight: jax.Array

    def __call__(self, x):
        return x @ self.weight


def _step(batch, state):
    model, opt_state = state
    loss, grads = eqx.filter_value_and_grad(lambda m: (m(batch) ** 2).mean())(model)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, model)
    return (eqx.apply_updates(model, updates), opt_state), loss


def _model():
    return eqx.filter_eval_shape(lambda: _Half(jnp.zeros((16, 64))))


def _tiny(mesh):
    model = _model()
    opt_state = jax.eval_shape(OPTIMIZER.init, model)
    batch = eqshard.abstract(jax.ShapeDtypeStruct((8, 16), np.float32), P("dp"), mesh)
    return batch, (model, opt_state)


def test_the_selector_picks_the_model_and_the_optimizer_state_follows(mesh):
    args = _tiny(mesh)
    rules = {"split": [("weight", P(None, "tp"))]}
    result = eqshard.search_layout(
        _step,
        *args,
        params=lambda args: args[1][0],
        mesh=mesh,
        device_memory="1GiB",
        candidates=rules,
        builtin=False,
        progress=False,
    )
    (candidate,) = result.candidates
    rows = {row.path: row for row in candidate.report.arguments}
    # The model and Adam's moments are laid out by the candidate, the batch kept.
    for path in ("state/0/weight", "state/1/0/mu/weight", "state/1/0/nu/weight"):
        assert rows[path].spec == "P(None, 'tp')"
        assert rows[path].donated
    assert rows["batch"].spec == "P('dp',)" and not rows["batch"].donated
    outputs = {row.path: row for row in candidate.report.outputs}
    assert outputs["out/0/0/weight"].spec == "P(None, 'tp')"


def test_selector_errors(mesh):
    args = _tiny(mesh)

    def search(**kwargs):
        eqshard.search_layout(
            _step, *args, mesh=mesh, device_memory="1GiB", progress=False, **kwargs
        )

    # The state tuple where only the model belongs: the selector to use.
    with pytest.raises(ValueError, match=re.escape("`params=lambda args: args[1][0]`")):
        search(params=1)
    with pytest.raises(ValueError, match="'1/0/mu/weight' follows '0/weight'"):
        search(params=lambda args: args[1])
    with pytest.raises(ValueError, match="holds no leaf of the step's arguments"):
        search(params=lambda args: None)
    with pytest.raises(ValueError, match="selector raised IndexError"):
        search(params=lambda args: args[1][5])
    with pytest.raises(ValueError, match="selects argument 2, but the step is given 2"):
        search(params=2)
    with pytest.raises(TypeError, match="give the index of the argument"):
        search(params="1.0")
    with pytest.raises(ValueError, match="give `device_memory`"):
        eqshard.search_layout(_step, *args, params=lambda a: a[1][0], mesh=mesh)


def test_a_step_that_returns_no_state_is_searched(mesh):
    # An evaluation or serving step (`loss = step(batch, state)`) compiles as
    # it is, its inputs laid out by each candidate: its figure is the step's.
    def evaluate(batch, state):
        return _step(batch, state)[1]

    batch, state = _tiny(mesh)
    rules = [("weight", P(None, "tp")), (".*", P())]
    result = eqshard.search_layout(
        evaluate,
        batch,
        state,
        params=lambda args: args[1][0],
        mesh=mesh,
        device_memory="1GiB",
        candidates={"split": rules, "whole": [(".*", P())]},
        builtin=False,
        progress=False,
    )
    assert result.best is not None and len(result.candidates) == 2
    split = next(c for c in result.candidates if c.name == "split")
    with jax.set_mesh(mesh):
        real = eqshard.analyze_step(
            evaluate, batch, eqshard.abstract(state, rules, mesh)
        )
    assert split.report.memory == real.memory
    assert _collectives(split.report) == _collectives(real)
    rows = {row.path: row for row in split.report.arguments}
    assert rows["state/0/weight"].spec == rows["state/1/0/mu/weight"].spec
    assert rows["state/0/weight"].spec == "P(None, 'tp')"
    assert not any(row.donated for row in split.report.arguments)


def test_plan_training_takes_the_whole_state():
    model = _model()
    state = (model, jax.eval_shape(OPTIMIZER.init, model))
    mesh = AbstractMesh((2, 4), ("dp", "tp"))
    rules = [("weight", P(None, "tp"))]
    alone = eqshard.plan_training(model, rules, mesh, optimizer=OPTIMIZER)
    for params in (0, lambda state: state[0]):
        whole = eqshard.plan_training(state, rules, mesh, params=params)
        assert whole.bytes_per_device == alone.bytes_per_device
        assert whole.opt_state is not None and alone.opt_state is not None
        assert whole.opt_state.bytes_per_device == alone.opt_state.bytes_per_device
    # 16 x 64 float32 split 4 ways: 1 KiB for the weight, its gradient and its
    # two moments each, and Adam's step count (4 bytes).
    assert alone.bytes_per_device == (4 * 16 * 64 * 4 // 4 + 4,) * 8
    with pytest.raises(ValueError, match=re.escape("`params=0`")):
        eqshard.plan_training(state, rules, mesh, params=lambda state: state)
    with pytest.raises(ValueError, match="`optimizer` is given too"):
        eqshard.plan_training(state, rules, mesh, params=0, optimizer=OPTIMIZER)


def test_a_layout_whose_arguments_alone_do_not_fit_is_not_compiled(mesh):
    from eqshard._search._compile import Step
    from eqshard._spectree._select import select

    args = _tiny(mesh)
    rules = {"whole": [(".*", P())], "split": [("weight", P(None, "tp"))]}

    def search(budget):
        return eqshard.search_layout(
            _step,
            *args,
            params=lambda args: args[1][0],
            mesh=mesh,
            device_memory=budget,
            candidates=rules,
            builtin=False,
            progress=False,
        )

    # The floor of a layout's peak is its arguments' bytes, as XLA counts them.
    both = search("1GiB")
    step = Step(_step, args, select(args, lambda a: a[1][0], caller="test"), mesh)
    for candidate in both.candidates:
        floor = step.argument_floor(candidate.specs)
        assert floor == candidate.memory.argument_bytes
    whole = next(c for c in both.candidates if c.name == "whole")
    split = next(c for c in both.candidates if c.name == "split")
    assert split.memory.peak_bytes < 8 * 2**10 < whole.memory.argument_bytes
    # In 8 KiB, 'whole' cannot win once 'split' fits: it is not compiled.
    result = search("8KiB")
    assert [c.name for c in result.candidates] == ["split"]
    ((name, why),) = result.skipped
    assert name == "whole" and why.startswith("cannot fit: its arguments alone are")
    # When none fits, every layout is compiled, to rank them by peak.
    assert {c.name for c in search("1KiB").candidates} == {"whole", "split"}


def test_analyze_step_reads_a_step_made_without_a_mesh(mesh):
    # A filter_jit without `mesh=` resolves its specs on the mesh set, which is
    # abstract while traced: analyze_step compiles them on the concrete one.
    rules = [("weight", P(None, "tp")), (".*", P())]
    step = eqshard.filter_jit(
        _step, in_specs=(P("dp"), rules), out_specs=(1, P()), donate="all-except-first"
    )
    batch, state = _tiny(mesh)
    with jax.set_mesh(mesh):
        report = eqshard.analyze_step(step, batch, state)
        # The same object runs, and keeps the layout it was analysed with.
        model = _Half(jnp.ones((16, 64)))
        opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
        real = eqshard.shard((model, opt_state), rules, mesh)
        real, loss = step(np.ones((8, 16), np.float32), real)
    assert np.isfinite(float(loss))
    eqshard.check_layout(real, rules, mesh)
    rows = {row.path: row for row in report.arguments}
    assert rows["state/0/weight"].spec == "P(None, 'tp')"
    assert rows["state/1/0/mu/weight"].spec == "P(None, 'tp')"
    assert rows["state/0/weight"].donated and not rows["batch"].donated
    outputs = {row.path: row for row in report.outputs}
    assert outputs["out/0/0/weight"].spec == "P(None, 'tp')"


def test_the_selector_index_may_be_a_numpy_or_jax_integer(mesh):
    # An index read from a config or a shape: a NumPy or JAX integer.
    batch, (model, opt_state) = _tiny(mesh)

    def step(model, opt_state, batch):
        (model, opt_state), loss = _step(batch, (model, opt_state))
        return model, opt_state, loss

    result = eqshard.search_layout(
        step,
        model,
        opt_state,
        batch,
        params=np.int64(0),
        mesh=mesh,
        device_memory="1GiB",
        candidates={"split": [("weight", P(None, "tp"))]},
        builtin=False,
        progress=False,
    )
    rows = {row.path: row for row in result.candidates[0].report.arguments}
    assert rows["model/weight"].spec == rows["opt_state/0/mu/weight"].spec
    assert rows["model/weight"].spec == "P(None, 'tp')"
    args = (batch, (model, opt_state))
    for index in (np.int32(1), jnp.int32(1), np.array(1)):
        assert select(args, index, caller="test").tree is args[1]
    state = (model, opt_state)
    rules = [("weight", P(None, "tp"))]
    plans = [
        eqshard.plan_training(state, rules, mesh, params=i) for i in (np.int64(0), 0)
    ]
    assert plans[0].bytes_per_device == plans[1].bytes_per_device
    with pytest.raises(TypeError, match="`params` is True; give the index"):
        select(args, True, caller="search_layout")


class _Mlp(eqx.Module):
    up: jax.Array
    down: jax.Array

    def __call__(self, x):
        return x + jax.nn.relu(x @ self.up) @ self.down


class _Blocks(eqx.Module):
    blocks: list

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.slow
def test_the_rules_found_drop_into_the_step_searched(mesh):
    # The built-in layouts' rules name the parameters' paths; the step's
    # `in_specs` lay out its state `(model, opt_state)` with them: each layout
    # is the search's, optimizer state included, with the search's peak.
    model = eqx.filter_eval_shape(
        lambda: _Blocks([_Mlp(jnp.zeros((16, 64)), jnp.zeros((64, 16)))] * 2)
    )
    state = (model, jax.eval_shape(OPTIMIZER.init, model))
    batch = eqshard.abstract(jax.ShapeDtypeStruct((8, 16), np.float32), P("dp"), mesh)
    result = eqshard.search_layout(
        _step,
        batch,
        state,
        params=lambda args: args[1][0],
        mesh=mesh,
        device_memory="1GiB",
        max_candidates=4,  # replicated, two FSDPs (rules `.*`), tensor parallel
        progress=False,
    )
    (candidate,) = [c for c in result.candidates if c.name == "tp(tp)"]
    assert any(pattern.startswith("(^|/)blocks/") for pattern, _ in candidate.rules)
    step = eqshard.filter_jit(
        _step,
        in_specs=(P("dp"), candidate.rules),
        out_specs=(1, P()),
        donate="all-except-first",
    )
    with jax.set_mesh(mesh):
        real = eqshard.analyze_step(
            step, batch, eqshard.abstract(state, candidate.rules, mesh)
        )
    searched = {row.path: row.spec for row in candidate.report.arguments}
    assert {row.path: row.spec for row in real.arguments} == searched
    for path in ("state/0/blocks/1/down", "state/1/0/mu/blocks/1/down"):
        assert searched[path] == "P('tp',)"
    assert real.memory.peak_bytes == candidate.memory.peak_bytes
