# eqshard.analyze_step on small Equinox models, unrolled and `scan`-stacked, on
# (2, 4) and (8,) meshes: the rows against an independent count of the compiled
# program's collectives (a regex over `as_text()`), trip counts, faults seeded
# into the layout and named by leaf path, memory against the arrays' shards, the
# function kinds it accepts, its errors, caching, JSON and diff.

import io
import json
import math
import os
import re
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from probes import Compiles

import eqshard


# ---------------------------------------------------------------------------------
# Models and steps.
# ---------------------------------------------------------------------------------


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key, dim=16):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(dim, 4 * dim, key=k1)
        self.down = eqx.nn.Linear(4 * dim, dim, key=k2)

    def __call__(self, x):
        return x + self.down(jax.nn.relu(self.up(x)))


class Unrolled(eqx.Module):
    blocks: list

    def __init__(self, key, layers=2):
        self.blocks = [Block(k) for k in jax.random.split(key, layers)]

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Stacked(eqx.Module):
    blocks: Block  # each array with a leading layer axis

    def __init__(self, key, layers=2):
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(key, layers))

    def __call__(self, x):
        arrays, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(x, block):
            return eqx.combine(block, static)(x), None

        return jax.lax.scan(layer, x, arrays)[0]


def loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


def sgd(model, x):
    value, grads = eqx.filter_value_and_grad(loss)(model, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, model, grads), value


# Tensor parallel on (2, 4): `up` split on its output, `down` on its input.
TP = [
    ("up/weight", P("tp", None)),
    ("up/bias", P("tp")),
    ("down/weight", P(None, "tp")),
    (".*", P()),
]
# The same with the second matrix of the pair split on the wrong dimension.
TP_WRONG = [(r, P("tp", None) if r == "down/weight" else s) for r, s in TP]
# FSDP on (8,).
FSDP = [("up/weight", P("fsdp", None)), ("down/weight", P("fsdp", None)), (".*", P())]


def stacked(rules):
    """The rules for a stack of layers: the leading layer axis left whole."""
    return [(r, P(None, *s) if r != ".*" else s) for r, s in rules]


@pytest.fixture(scope="module")
def line_mesh():
    return jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))


def placed(model_type, rules, mesh, layers=2, batch_axis="dp"):
    model = model_type(jax.random.key(0), layers)
    specs = eqshard.match_partition_rules(rules, model)
    x = eqshard.shard(np.ones((8, 16), np.float32), P(batch_axis), mesh)
    return eqshard.shard(model, specs, mesh), x


# ---------------------------------------------------------------------------------
# An independent count of the program's collectives.
# ---------------------------------------------------------------------------------

_COLLECTIVE = re.compile(
    r"= (\(.*?\)|\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\("
)
_ARRAY = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1}


def counted(text):
    """(kind, bytes per run) of each collective instruction of `text`."""
    found = []
    for shape, kind in _COLLECTIVE.findall(text):
        nbytes = sum(
            math.prod(int(d) for d in dims.split(",") if d) * _BYTES[dtype]
            for dtype, dims in _ARRAY.findall(shape)
        )
        found.append((kind, nbytes))
    return sorted(found)


def reported(report):
    return sorted((row.kind, row.bytes) for row in report.collectives)


@pytest.mark.parametrize(
    "model_type, rules, which",
    [
        (Unrolled, TP, "mesh"),
        (Stacked, stacked(TP), "mesh"),
        (Unrolled, FSDP, "line"),
        (Stacked, stacked(FSDP), "line"),
    ],
)
def test_rows_match_an_independent_count(model_type, rules, which, mesh, line_mesh):
    mesh = mesh if which == "mesh" else line_mesh
    model, x = placed(model_type, rules, mesh, batch_axis=mesh.axis_names[0])
    report = eqshard.analyze_step(sgd, model, x)
    text = jax.jit(sgd).lower(model, x).compile().as_text()
    assert report.collectives and reported(report) == counted(text)
    assert report.mesh_shape == dict(mesh.shape)
    for row in report.collectives:
        assert set(row.axes) <= set(mesh.axis_names) and row.axes


@pytest.mark.slow
def test_scan_trip_counts_multiply(mesh):
    totals, looped = [], []
    for layers in (2, 4, 6):
        model, x = placed(Stacked, stacked(TP), mesh, layers=layers)
        report = eqshard.analyze_step(sgd, model, x)
        inside = [row for row in report.collectives if "while" in row.op_name]
        assert inside and {row.count for row in inside} == {layers}
        looped.append(sum(row.total_bytes for row in inside))
        totals.append(report.total_bytes)
    # Per layer, the same communication: linear in the number of layers.
    assert looped[1] - looped[0] == looped[2] - looped[1] == looped[0] > 0
    assert totals[1] - totals[0] == totals[2] - totals[1] > 0


# ---------------------------------------------------------------------------------
# Faults seeded into the layout, named by leaf path.
# ---------------------------------------------------------------------------------


def test_tensor_parallel_pair_with_the_second_spec_on_the_wrong_dimension(mesh):
    right = eqshard.analyze_step(sgd, *placed(Unrolled, TP, mesh))
    wrong = eqshard.analyze_step(sgd, *placed(Unrolled, TP_WRONG, mesh))
    assert wrong.total_bytes > right.total_bytes
    # The new gathers belong to the misplaced matrices, and to nothing else.
    new = [row for row in wrong.collectives if row.kind == "all-gather"]
    assert not [row for row in right.collectives if row.kind == "all-gather"]
    downs = {f"model/blocks/{i}/down/weight" for i in range(2)}
    assert downs <= {p for row in new for p in row.paths}
    assert all(
        p in downs or p.startswith("out/0/blocks/") or p == "x"
        for row in new
        for p in row.paths
    )
    changed = right.diff(wrong).paths
    assert downs <= set(changed)
    assert not any("up" in path for path in changed)


def _adam_step(mesh, state_rules):
    model = Unrolled(jax.random.key(0))
    params = eqx.filter(model, eqx.is_array)
    specs = eqshard.match_partition_rules(TP, params)
    optimizer = optax.adam(1e-3)
    state = jax.eval_shape(optimizer.init, params)
    state_specs = state_rules(state, params, specs)

    def step(params, opt_state, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    shardings = (
        eqshard.named_shardings(specs, mesh),
        eqshard.named_shardings(state_specs, mesh),
        None,
    )
    jitted = jax.jit(step, out_shardings=shardings, donate_argnums=(0, 1))
    return eqshard.analyze_step(
        jitted,
        eqshard.abstract(params, specs, mesh),
        eqshard.abstract(state, state_specs, mesh),
        eqshard.abstract(np.ones((8, 16), np.float32), P("dp"), mesh),
    )


def test_optimizer_state_replicated_while_its_parameters_are_sharded(mesh):
    right = _adam_step(mesh, eqshard.derive_specs)
    wrong = _adam_step(
        mesh, lambda state, params, specs: jax.tree.map(lambda _: P(), state)
    )
    assert wrong.total_bytes > right.total_bytes
    # New gathers, each feeding a replicated moment (and the update of the
    # parameter it belongs to).
    gathered = {c.path for c in right.diff(wrong).changes if c.what == "all-gather"}
    assert "out/1/0/mu/blocks/0/up/weight" in gathered
    assert "out/1/0/nu/blocks/1/down/weight" in gathered
    assert all(p.startswith(("out/0/", "out/1/0/mu/", "out/1/0/nu/")) for p in gathered)
    # Donated and aliased: the state's bytes are counted once.
    assert all(
        leaf.donated for leaf in wrong.arguments if leaf.path.startswith("params")
    )
    assert wrong.memory.alias_bytes > 0


def test_stacked_layer_axis_sharded(mesh):
    # The layer axis of the stack (4 layers) split over 'tp'.
    rules = [("weight", P("tp", None, None)), (".*", P())]
    model, x = placed(Stacked, rules, mesh, layers=4)
    report = eqshard.analyze_step(sgd, model, x)
    for name in ("up", "down"):
        path = f"model/blocks/{name}/weight"
        rows = [row for row in report.collectives if path in row.paths]
        assert rows and all(row.kind == "all-gather" for row in rows)
        whole = model.blocks.up.weight.nbytes  # both matrices hold 4 x 16 x 64
        assert sum(row.total_bytes for row in rows) >= whole


def test_a_numpy_batch_is_moved_at_every_call(mesh):
    model, _ = placed(Unrolled, TP, mesh)
    report = eqshard.analyze_step(sgd, model, np.ones((8, 16), np.float32))
    (moved,) = report.moved
    assert moved.path == "x" and moved.have == "host (NumPy)" and moved.shape == (8, 16)
    assert moved.want == report.arguments[-1].spec
    assert "inputs moved at every call:\n  x: host (NumPy)" in str(report)
    # So is an array JAX placed on its default device, uncommitted.
    (moved,) = eqshard.analyze_step(sgd, model, jnp.ones((8, 16))).moved
    assert moved.path == "x" and moved.have.startswith("uncommitted, single device")
    # The placed arguments are not moved.
    model, x = placed(Unrolled, TP, mesh)
    assert eqshard.analyze_step(sgd, model, x).moved == ()


# ---------------------------------------------------------------------------------
# Memory, abstract arguments, caching.
# ---------------------------------------------------------------------------------


def test_argument_bytes_are_the_shards_on_each_device(mesh, line_mesh):
    for m, rules in ((mesh, TP), (line_mesh, FSDP)):
        model, x = placed(Unrolled, rules, m, batch_axis=m.axis_names[0])
        report = eqshard.analyze_step(sgd, model, x)
        held = {device: 0 for device in m.devices.flat}
        for leaf in jax.tree.leaves(eqx.filter((model, x), eqx.is_array)):
            for shard in leaf.addressable_shards:
                held[shard.device] += shard.data.nbytes
        assert set(held.values()) == {report.memory.argument_bytes}
        assert sum(a.bytes_per_device for a in report.arguments) == max(held.values())
        m_ = report.memory
        assert m_.peak_bytes == (
            m_.argument_bytes + m_.output_bytes + m_.temp_bytes - m_.alias_bytes
        )
        assert m_.fits(m_.peak_bytes) and not m_.fits(m_.peak_bytes - 1)
        assert m_.headroom("1MiB") == 2**20 - m_.peak_bytes


def test_abstract_arguments_allocate_nothing_and_report_the_same(mesh):
    model, x = placed(Unrolled, TP, mesh)
    concrete = eqshard.analyze_step(jax.jit(sgd), model, x)
    specs = eqshard.match_partition_rules(TP, model)
    shapes = eqshard.abstract(model, specs, mesh)
    batch = eqshard.abstract(x, P("dp"), mesh)
    before = len(jax.live_arrays())
    abstract = eqshard.analyze_step(jax.jit(sgd), shapes, batch)
    assert len(jax.live_arrays()) == before
    assert abstract.to_json() == concrete.to_json()


def test_a_second_identical_call_compiles_nothing(mesh):
    model, x = placed(Unrolled, TP, mesh)
    step = eqx.filter_jit(sgd)
    first = eqshard.analyze_step(step, model, x)
    with Compiles() as again:
        second = eqshard.analyze_step(step, model, x)
        step(model, x)  # jax.jit compiles once for this call, as it would anyway
    assert second is first and again.count == 1
    with Compiles() as raw:
        step(model, x)
    assert raw.count == 0


def _rematerializing_step():
    """A step whose compile makes XLA log a rematerialization warning, and its
    argument."""
    mesh_xy = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)

    def f(t):
        return jnp.reshape(t, (6, 16)) * 2

    fn = jax.jit(f, out_shardings=NamedSharding(mesh_xy, P(None, "y")))
    t = jax.ShapeDtypeStruct(
        (16, 6), jnp.float32, sharding=NamedSharding(mesh_xy, P("y", None))
    )
    return fn, t


def test_xla_warnings_are_captured_tied_to_paths_and_kept(mesh):
    fn, t = _rematerializing_step()
    report = eqshard.analyze_step(fn, t)
    (warning,) = [w for w in report.warnings if "rematerialization" in w.message]
    # From the argument reshaped, to the result it becomes.
    assert warning.paths == ("t", "out") and "test_step.py:" in warning.source
    assert "rematerialization" in str(report)
    with Compiles() as again:
        assert eqshard.analyze_step(fn, t).warnings == report.warnings
    assert again.count == 0


def test_capture_warnings_false_leaves_stderr_alone(mesh, capfd, monkeypatch):
    fn, t = _rematerializing_step()
    redirected = []
    dup2 = os.dup2
    monkeypatch.setattr(os, "dup2", lambda a, b: redirected.append(b) or dup2(a, b))
    off = eqshard.analyze_step(fn, t, capture_warnings=False)
    assert off.warnings == () and redirected == []
    # XLA logged its warning straight to standard error, once.
    assert capfd.readouterr().err.count("rematerialization") == 1
    # Kept apart from the report with warnings: this call compiles and captures.
    on = eqshard.analyze_step(fn, t)
    assert [w for w in on.warnings if "rematerialization" in w.message]
    assert 2 in redirected
    # Captured, and written on to standard error.
    assert capfd.readouterr().err.count("rematerialization") == 1
    assert eqshard.analyze_step(fn, t, capture_warnings=False) is off


def test_clear_caches_forgets_the_reports(mesh):
    model, x = placed(Unrolled, TP, mesh)
    step = jax.jit(sgd)
    first = eqshard.analyze_step(step, model, x)
    eqshard.clear_caches()
    with Compiles() as again:
        second = eqshard.analyze_step(step, model, x)
    assert second is not first and second == first and again.count == 1


# ---------------------------------------------------------------------------------
# Kinds of functions, and errors.
# ---------------------------------------------------------------------------------


def test_function_kinds_compile_with_their_own_shardings(mesh):
    model, x = placed(Unrolled, TP, mesh)
    host = np.ones((8, 16), np.float32)
    specs = eqshard.match_partition_rules(TP, model)
    shardings = eqshard.named_shardings(specs, mesh)
    batch = NamedSharding(mesh, P("dp"))
    plain = eqshard.analyze_step(sgd, model, x)
    jitted = eqshard.analyze_step(
        jax.jit(sgd, in_shardings=(shardings, batch), donate_argnums=(0,)), model, host
    )
    # The program wants the batch split over 'dp', as `in_shardings` says.
    assert [(m.path, m.want) for m in jitted.moved] == [("x", str(P("dp")))]
    assert reported(jitted) == reported(plain)
    assert any(a.donated for a in jitted.arguments) and jitted.memory.alias_bytes > 0
    filtered = eqshard.analyze_step(eqx.filter_jit(sgd), model, x)
    assert reported(filtered) == reported(plain)
    partitioner = eqshard.t5x.Partitioner(mesh=mesh)
    partitioned = partitioner.partition(sgd, (specs, P("dp")), (specs, P()))
    report = eqshard.analyze_step(partitioned, model, host)
    assert [m.path for m in report.moved] == ["x"]
    assert report.arguments[0].path == "model/blocks/0/up/weight"
    assert [leaf.path for leaf in report.outputs][-1] == "out/1"


def test_a_committed_argument_against_in_shardings_is_an_error_naming_it(mesh):
    model, x = placed(Unrolled, TP, mesh)
    specs = eqshard.match_partition_rules(TP_WRONG, model)
    fn = jax.jit(sgd, in_shardings=(eqshard.named_shardings(specs, mesh), None))
    with pytest.raises(ValueError, match="'model/blocks/1/down/weight'") as e:
        eqshard.analyze_step(fn, model, x)
    assert str(e.value).startswith("eqshard.analyze_step:")
    assert "'model/blocks/0/up/weight'" not in str(e.value)
    with pytest.raises(ValueError):  # as JAX raises when it is called
        fn(model, x)
    # An argument committed to one device, the others on the mesh.
    on_one = jax.device_put(np.ones((8, 16), np.float32), jax.devices()[0])
    with pytest.raises(ValueError, match=r"'x': on devices \[0\]"):
        eqshard.analyze_step(sgd, model, on_one)
    with pytest.raises(ValueError, match="incompatible devices"):
        jax.jit(sgd)(model, on_one)


def test_an_abstract_mesh_cannot_be_compiled(mesh):
    model = Unrolled(jax.random.key(0))
    specs = eqshard.match_partition_rules(TP, model)
    shapes = jax.tree.map(
        lambda leaf, spec: jax.ShapeDtypeStruct(
            leaf.shape, leaf.dtype, sharding=NamedSharding(mesh.abstract_mesh, spec)
        ),
        eqx.filter(model, eqx.is_array),
        specs,
    )
    with pytest.raises(ValueError, match="jax_num_cpu_devices") as e:
        eqshard.analyze_step(sgd, shapes, np.ones((8, 16), np.float32))
    assert "'model/blocks/0/up/weight'" in str(e.value)


# ---------------------------------------------------------------------------------
# Keeping and showing.
# ---------------------------------------------------------------------------------


def test_json_is_byte_stable_and_reads_back(mesh):
    model, x = placed(Unrolled, TP_WRONG, mesh)
    # Two function objects: two analyses, two compiles.
    first = eqshard.analyze_step(jax.jit(sgd), model, x)
    second = eqshard.analyze_step(jax.jit(sgd), model, x)
    assert first is not second
    text = first.to_json()
    assert isinstance(text, str) and text == second.to_json()
    data = json.loads(text)
    assert list(data) == sorted(data)
    back = eqshard.StepReport.from_json(text)
    assert back == first and back.to_json() == text
    assert not first.diff(back)
    with pytest.raises(ValueError, match="StepReport.from_json"):
        eqshard.StepReport.from_json('{"format": 99}')


@pytest.fixture(scope="module")
def report_json(mesh):
    report = eqshard.analyze_step(sgd, *placed(Unrolled, TP_WRONG, mesh))
    assert report.collectives
    return report.to_json()


def _edited(text, path, value):
    """The report's JSON with the value at `path` (keys and indices) replaced."""
    data = json.loads(text)
    *parents, last = path
    where = data
    for key in parents:
        where = where[key]
    where[last] = value
    return json.dumps(data)


@pytest.mark.parametrize(
    "edit, where, expected",
    [
        # Before: AttributeError ('list' object has no attribute 'pop').
        (lambda text: "[]", "the top level", "an object"),
        # Before: RecursionError.
        (lambda text: "[" * 100_000, "the top level", "JSON nested at most"),
        # Before: accepted, then ZeroDivisionError in `link_bytes`.
        (
            lambda text: _edited(text, ("collectives", 0, "group_size"), 0),
            "'collectives/0/group_size'",
            "an integer of at least 1",
        ),
        # Before: accepted as the shape ('1', '6'), then wrong everywhere.
        (
            lambda text: _edited(text, ("arguments", 0, "shape"), "16"),
            "'arguments/0/shape'",
            "a list",
        ),
        # Before: accepted, then TypeError in `total_bytes`.
        (
            lambda text: _edited(text, ("collectives", 0, "count"), "3"),
            "'collectives/0/count'",
            "an integer",
        ),
        (
            lambda text: _edited(text, ("collectives", 0, "parts", 0, "bytes"), -8),
            "'collectives/0/parts/0/bytes'",
            "an integer of at least 0",
        ),
        (
            lambda text: _edited(text, ("memory", "temp_bytes"), 1.5),
            "'memory/temp_bytes'",
            "an integer",
        ),
        (
            lambda text: _edited(text, ("format",), True),
            "'format'",
            "a format version 1 or 2 or 3",
        ),
        (
            lambda text: _edited(text, ("arguments", 0, "typo"), 1),
            "'arguments/0/typo'",
            "no field here",
        ),
        # Before: KeyError (the name shortened, then looked up).
        (
            lambda text: _edited(text, ("arguments", 0, "a" * 50), 1),
            f"'arguments/0/{'a' * 37}...'",
            "no field here",
        ),
    ],
)
def test_json_that_is_not_a_report_names_the_field(report_json, edit, where, expected):
    with pytest.raises(ValueError, match="StepReport.from_json") as e:
        eqshard.StepReport.from_json(edit(report_json))
    assert f"at {where}: expected {expected}" in str(e.value)


def test_str_repr_and_show(mesh, monkeypatch):
    report = eqshard.analyze_step(sgd, *placed(Unrolled, TP_WRONG, mesh))
    assert "\n" not in repr(report) and repr(report).startswith("StepReport(")
    text = str(report)
    assert "all-gather" in text and "model/blocks/0/down/weight" in text
    shown = io.StringIO()
    report.show(shown)  # rich, installed for the tests
    assert "all-gather" in shown.getvalue() and "─" in shown.getvalue()
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.setitem(sys.modules, "rich.console", None)
    plain = io.StringIO()
    report.show(plain)
    assert plain.getvalue() == text + "\n"


def test_bytes_by_path_kind_and_axes_add_up(mesh):
    report = eqshard.analyze_step(sgd, *placed(Unrolled, TP_WRONG, mesh))
    total = report.total_bytes
    assert total == sum(row.bytes * row.count for row in report.collectives)
    assert sum(report.bytes_by_kind.values()) == total
    assert sum(report.bytes_by_axes.values()) == total
    assert report.attributed_share == report.attributed_bytes / total
    ordered = list(report.by_path().values())
    assert ordered == sorted(ordered, reverse=True)


# ---------------------------------------------------------------------------------
# The demo's training step, as `python -m eqshard` runs it.
# ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_demo_step_is_attributed(mesh):
    # The step of `python -m eqshard`'s demo, with its built-in rules, on the
    # command's default mesh (dp:2, tp:4): every collective in the report, and at
    # least 90% of the bytes attributed (the GPT-style model of
    # benchmarks/bench_step.py is measured there).
    from eqshard._cli._demo import builtin_rules, demo_config, loss_fn, Transformer

    config = demo_config(mesh)
    rules = builtin_rules(mesh)
    model = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
    specs = eqshard.match_partition_rules(rules, model)
    model = eqshard.abstract(model, specs, mesh)
    tokens = jax.ShapeDtypeStruct((8, config.seq + 1), jnp.int32)
    tokens = eqshard.abstract(tokens, P("dp"), mesh)

    def step(model, tokens):
        tokens = eqshard.with_sharding_constraint(tokens, P("dp"))
        model = eqshard.with_sharding_constraint(model, specs)
        value, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
        model = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))
        return eqshard.with_sharding_constraint(model, specs), value

    train_step = eqx.filter_jit(step)

    # The same program by hand, over the arrays of the abstract model.
    arrays, static = eqx.partition(model, eqshard.is_array)

    def by_hand(arrays, tokens):
        out = step(eqx.combine(arrays, static), tokens)
        return eqx.filter(out, eqx.is_array)

    with jax.set_mesh(mesh):
        report = eqshard.analyze_step(train_step, model, tokens)
        text = jax.jit(by_hand).lower(arrays, tokens).compile().as_text()
    assert reported(report) == counted(text)
    assert report.attributed_share >= 0.9
    # Tensor-parallel partial sums belong to the matrices split on the dimension
    # they contract; the gradients' reduction over 'dp' to the updated model.
    assert {row.axes for row in report.collectives} == {("tp",), ("dp",)}
    (grads,) = [row for row in report.collectives if row.axes == ("dp",)]
    assert "out/0/head/weight" in grads.paths
    for row in report.collectives:
        if row.axes == ("tp",) and row.parts[0].paths:
            assert row.parts[0].via == "producer"
