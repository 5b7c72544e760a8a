# Following the data of XLA's compiled programs (eqshard/_step/_hlo/_flow.py), checked
# on programs compiled here for the 8 virtual CPU devices: trip counts and
# conditionals against the program's structure, data flow against what each
# program does.

import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from eqshard._step._hlo._flow import Program


def _compile(fn, *structs, out=None) -> str:
    text = jax.jit(fn, out_shardings=out).lower(*structs).compile().as_text()
    assert text is not None  # typed `str | None`: None where a backend has no text
    return text


def _struct(mesh, shape, *spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))


def test_scan_counts_its_trip_count_and_follows_the_stacked_weight(mesh):
    # A stack of layers sharded on 'tp' within each layer, under `lax.scan`: the
    # collectives in the loop body run once per layer, and the dots next to them
    # take the stacked argument (parameter 0) through the loop. The activations
    # carried by the loop are the input `x` only at the first iteration, so the
    # collectives are not attributed to it.
    def forward(ws, x):
        def body(h, w):
            return jnp.tanh(h @ w), None

        return jax.lax.scan(body, x, ws)[0]

    for layers in (2, 5):
        text = _compile(
            forward,
            _struct(mesh, (layers, 16, 16), None, None, "tp"),
            _struct(mesh, (8, 16), "dp", None),
            out=NamedSharding(mesh, P()),
        )
        program = Program(text, caller="test", num_devices=8)
        looped = [c for c in program.collectives() if "while" in c.op_name]
        assert looped and {c.count for c in looped} == {layers}
        for part in (part for c in looped for part in c.parts):
            assert 0 in part.producers | part.consumers
            assert 1 not in part.arguments


def test_conditional_branches_count_once_and_are_marked(mesh):
    def f(w, x, p):
        return jax.lax.cond(p > 0, lambda: (x @ w).sum(), lambda: x.sum())

    text = _compile(
        f,
        _struct(mesh, (16, 16), "tp", None),
        _struct(mesh, (8, 16), "dp", None),
        _struct(mesh, ()),
        out=NamedSharding(mesh, P()),
    )
    collectives = Program(text, caller="test", num_devices=8).collectives()
    inside = [c for c in collectives if "cond" in c.op_name]
    assert inside and all(c.conditional and c.count == 1 for c in inside)
    assert not any(c.conditional for c in collectives if c not in inside)


def test_permute_and_all_to_all(mesh):
    roll = _compile(
        lambda t: jnp.roll(t, 1, axis=0),
        _struct(mesh, (16, 16), "tp", None),
        out=NamedSharding(mesh, P("tp", None)),
    )
    (permute,) = Program(roll, caller="test", num_devices=8).collectives()
    assert permute.kind == "collective-permute"
    # Each device sends to the next along 'tp', within its row of the mesh.
    ids = np.arange(8).reshape(2, 4)
    want = {(int(a), int(b)) for row in ids for a, b in zip(row, np.roll(row, -1))}
    assert set(permute.groups) == want
    moved = _compile(
        lambda t: t * 2,
        _struct(mesh, (16, 16), "tp", None),
        out=NamedSharding(mesh, P(None, "tp")),
    )
    (exchange,) = Program(moved, caller="test", num_devices=8).collectives()
    assert exchange.kind == "all-to-all"
    # 16 x 16 float32 split four ways: each device holds a quarter, 256 bytes.
    assert sum(part.shape.nbytes for part in exchange.parts) == 16 * 16 * 4 // 4


def test_gradient_reduction_reaches_the_updated_weight(mesh):
    # Data parallel: the weight's gradient is summed over 'dp' and flows,
    # through the update, into the result; the activations' reductions do not.
    def step(w, x):
        g = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * g

    text = _compile(step, _struct(mesh, (16, 16)), _struct(mesh, (8, 16), "dp", None))
    collectives = Program(text, caller="test", num_devices=8).collectives()
    reaching = [c for c in collectives for part in c.parts if part.results == {0}]
    assert reaching and all(c.kind == "all-reduce" for c in reaching)


def test_sources_name_this_file(mesh):
    def f(a):
        return a.sum(1)

    line = inspect.getsourcelines(f)[1] + 1
    text = _compile(f, _struct(mesh, (8, 8), None, "tp"), out=NamedSharding(mesh, P()))
    (collective,) = Program(text, caller="test", num_devices=8).collectives()
    assert collective.source == f"{__file__}:{line}"
    assert collective.op_name.endswith("reduce_sum")


# XLA's CPU backend never makes asynchronous collectives, so this program is
# written by hand in the spelling of XLA's GPU programs: start/done pairs, and
# an `async-start` wrapping a collective in its own computation.
ASYNC = """HloModule m, is_scheduled=true, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%scatter (x: f32[16]) -> f32[4] {
  %x = f32[16]{0} parameter(0)
  ROOT %rs = f32[4]{0} reduce-scatter(%x), channel_id=3, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
}

ENTRY %main (p0: f32[4,8], p1: f32[16]) -> (f32[16,8], f32[16], f32[4], f32[4,8]) {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[16]{0} parameter(1)
  %ags = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%p0), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  %agd = f32[16,8]{1,0} all-gather-done(%ags)
  %ars = f32[16]{0} all-reduce-start(%p1), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%add
  %ard = f32[16]{0} all-reduce-done(%ars)
  %as = ((f32[16]{0}), f32[4]{0}, u32[]) async-start(%p1), calls=%scatter
  %ad = f32[4]{0} async-done(%as)
  %cps = (f32[4,8]{1,0}, f32[4,8]{1,0}, u32[], u32[]) collective-permute-start(%p0), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cpd = f32[4,8]{1,0} collective-permute-done(%cps)
  ROOT %t = (f32[16,8]{1,0}, f32[16]{0}, f32[4]{0}, f32[4,8]{1,0}) tuple(%agd, %ard, %ad, %cpd)
}
"""  # noqa: E501


def test_async_collectives_count_once_and_flow_through():
    collectives = Program(ASYNC, caller="test", num_devices=4).collectives()
    found = {
        c.kind: (c.count, [(p.shape.nbytes, p.arguments, p.results) for p in c.parts])
        for c in collectives
    }
    assert found == {
        "all-gather": (1, [(512, {0}, {0})]),
        "all-reduce": (1, [(64, {1}, {1})]),
        "reduce-scatter": (1, [(16, {1}, {2})]),
        "collective-permute": (1, [(128, {0}, {3})]),
    }
