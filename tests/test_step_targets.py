# The step reader on programs compiled for real TPUs and GPUs: TPU v5e-8 and 8
# H100s, compiled on this CPU machine with compile-only devices. The programs of
# tests/fixtures/hlo/ (written by its regenerate.py, with the mesh, leaves and
# memory figures beside each) test the reader without libtpu or the CUDA plugin;
# the tests at the end compile small steps for the real targets (the plugins are
# installed here and in CI). Expected values come from the text itself, read by
# the small regular expressions below (not by the reader), or from the leaves'
# own bytes.

import collections
import dataclasses
import functools
import importlib.util
import json
import pathlib
import re
import types
import warnings

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import eqshard
from eqshard._step._hlo._flow import Program
from eqshard._step._hlo._text import HloTextError
from eqshard._step._records import CollectiveRow, StepLeaf
from eqshard._step._report import StepReport
from eqshard._step._rows import collective_row, memory
from tests.fakes import host_mesh, TpuDevice


FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hlo"
_spec = importlib.util.spec_from_file_location("regenerate", FIXTURES / "regenerate.py")
assert _spec is not None and _spec.loader is not None
regenerate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regenerate)

FSDP_TP = ["tpu_fsdp_tp_4", "tpu_fsdp_tp_8", "gpu_fsdp_tp_4", "gpu_fsdp_tp_8"]


# ---------------------------------------------------------------------------------
# An independent census of a program's collectives.
# ---------------------------------------------------------------------------------

_OP = re.compile(
    r"^\s*(?:ROOT )?%(\S+) = .*? (all-gather|all-reduce|reduce-scatter|all-to-all|"
    r"ragged-all-to-all|collective-permute)(-start)?\(.*?channel_id=(\d+)"
)
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) ")


@dataclasses.dataclass
class Census:
    """The collectives of a program's text: one per channel id (an async pair,
    and TPU's clones of an async collective, share one), with its kind."""

    kinds: dict[str, str]  # channel id -> kind
    sync: set[str]  # names of starts marked `"is_sync":true`
    in_loops: set[str]  # channel ids of collectives in a computation a `while` runs


def census(text: str) -> Census:
    kinds: dict[str, str] = {}
    sync: set[str] = set()
    where: dict[str, str] = {}  # channel id -> computation
    computation = ""
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header is not None:
            computation = header[1]
        found = _OP.match(line)
        if found is None:
            continue
        name, kind, start, channel = found.groups()
        if computation.startswith("all-reduce-scatter"):
            kind = "reduce-scatter"  # TPU's fusion: all-reduce, then a block
        kinds.setdefault(channel, kind)
        where.setdefault(channel, computation)
        if start and '"is_sync":true' in line:
            sync.add(name)
    bodies = set(re.findall(r"body=%([\w.\-]+)", text))
    # A collective is in a loop when its computation is a body, or a fusion a
    # body calls (one level, as these programs have it).
    called_by_bodies = set()
    for body in bodies:
        block = re.search(rf"^%{re.escape(body)} .*?^}}", text, re.S | re.M)
        assert block is not None
        called_by_bodies |= set(re.findall(r"calls=%([\w.\-]+)", block[0]))
    looped = bodies | called_by_bodies
    in_loops = {c for c, comp in where.items() if comp in looped}
    return Census(kinds, sync, in_loops)


# ---------------------------------------------------------------------------------
# A fixture's report, read without the plugins.
# ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Fixture:
    text: str
    meta: dict
    program: Program
    report: StepReport
    warned: list[str]  # the warnings reading it gave


def _leaf(data: dict) -> StepLeaf:
    return StepLeaf(**{**data, "shape": tuple(data["shape"])})


@functools.cache
def fixture(name: str) -> Fixture:
    """The report of a kept program, built as `analyze_step` builds it, on a mesh
    of CPU devices of the same shape (the program's device ids are positions in
    the mesh, whichever its devices)."""
    text = (FIXTURES / f"{name}.hlo.txt").read_text()
    meta = json.loads((FIXTURES / f"{name}.json").read_text())
    axes = [axis for axis, _ in meta["mesh"]]
    sizes = tuple(size for _, size in meta["mesh"])
    if np.prod(sizes) <= len(jax.devices()):
        auto = (AxisType.Auto,) * len(axes)
        mesh = jax.make_mesh(sizes, tuple(axes), axis_types=auto)
    elif "device_ids" in meta and meta["platform"] == "tpu":
        mesh = slices_mesh(meta)
    else:  # more devices than this process has: stand-ins of the same shape
        mesh = host_mesh(np.zeros(sizes, int).tolist(), tuple(axes))
    arguments = tuple(map(_leaf, meta["arguments"]))
    outputs = tuple(map(_leaf, meta["outputs"]))
    program = Program(text, caller="analyze_step", num_devices=mesh.size)
    paths = [leaf.path for leaf in arguments]
    out_paths = [leaf.path for leaf in outputs]
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        rows = tuple(
            collective_row(c, paths, out_paths, mesh) for c in program.collectives()
        )
    report = StepReport(
        function=name,
        mesh=tuple((axis, size) for axis, size in meta["mesh"]),
        arguments=arguments,
        outputs=outputs,
        memory=memory(types.SimpleNamespace(**meta["memory_analysis"]), []),
        collectives=rows,
    )
    return Fixture(text, meta, program, report, [str(w.message) for w in warned])


def slices_mesh(meta: dict) -> jax.sharding.Mesh:
    """Stand-ins for a multi-slice TPU program's devices, in mesh order: the
    compile-only device `100000 * (s + 1) + k` is device `k` of slice `s`, at
    torus coordinates `(k % 2, k // 2)` of its v5e:2x4 slice."""
    devices = [
        TpuDevice(
            i,
            i // 100000 - 1,
            (i % 100000 % 2, i % 100000 // 2, 0),
            0,
            meta["device_kind"],
            slice_index=i // 100000 - 1,
        )
        for i in meta["device_ids"]
    ]
    axes = tuple(axis for axis, _ in meta["mesh"])
    shape = tuple(size for _, size in meta["mesh"])
    array = np.array(devices, dtype=object).reshape(shape)
    return jax.sharding.Mesh(array, axes, axis_types=(AxisType.Auto,) * len(axes))


def _loop_rows(report: StepReport, layers: int) -> list[CollectiveRow]:
    return [row for row in report.collectives if row.count == layers]


# ---------------------------------------------------------------------------------
# Show it: an L-layer scanned FSDP x TP step on TPU v5e-8 and on 8 H100s.
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FSDP_TP)
def test_rows_are_the_census_of_the_text(name):
    found = fixture(name)
    counted = census(found.text)
    assert len(found.report.collectives) == len(counted.kinds)
    kinds = collections.Counter(row.kind for row in found.report.collectives)
    assert kinds == collections.Counter(counted.kinds.values())
    assert {"all-gather", "reduce-scatter", "all-reduce"} <= set(kinds)


@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_the_layer_loop_runs_once_per_layer(target):
    four, eight = (fixture(f"{target}_fsdp_tp_{n}") for n in (4, 8))
    if target == "tpu":  # TPU's text states no trip count: read from the loop
        assert "known_trip_count" not in four.text
    for found, layers in ((four, 4), (eight, 8)):
        rows = found.report.collectives
        assert not any(row.unknown_trip_count or row.conditional for row in rows)
        assert {row.count for row in rows} == {1, layers}
        # Every collective of a loop body runs once per layer, and only those.
        looped = census(found.text).in_loops
        assert len(_loop_rows(found.report, layers)) == len(looped) > 0
    # The loop's rows move the same bytes per run for 4 and 8 layers, and twice
    # as much per step for 8.
    runs4, runs8 = (
        sorted((row.kind, row.bytes) for row in _loop_rows(found.report, n))
        for found, n in ((four, 4), (eight, 8))
    )
    assert runs4 == runs8
    total4, total8 = (
        sum(row.total_bytes for row in _loop_rows(found.report, n))
        for found, n in ((four, 4), (eight, 8))
    )
    assert total8 == 2 * total4


@pytest.mark.parametrize("name", FSDP_TP)
def test_bytes_belong_to_leaves_and_axes_to_the_mesh(name):
    report = fixture(name).report
    assert report.attributed_share >= 0.95
    for row in report.collectives:
        if row.kind == "collective-permute":
            continue
        assert row.axes and set(row.axes) <= {"dp", "tp"}
    # FSDP gathers each layer's weights over 'dp' and scatters their gradients
    # over 'dp'; tensor parallelism sums the layer's outputs over 'tp'.
    for row in _loop_rows(report, int(name[-1])):
        stacked = {p for p in row.paths if "blocks/" in p}
        if row.kind in ("all-gather", "reduce-scatter"):
            assert row.axes == ("dp",) and stacked, row
        if row.kind == "all-reduce":
            assert row.axes == ("tp",), row


def test_combined_gpu_collectives_are_split_into_their_leaves():
    report = fixture("gpu_fsdp_tp_4").report
    combined = [row for row in report.collectives if len(row.parts) > 1]
    assert {row.kind for row in combined} >= {"all-gather", "reduce-scatter"}
    for row in combined:
        leaves = [{p.split("/")[-1] for p in part.paths} for part in row.parts]
        # Each array is one leaf's ('up' or 'down'), and the two differ.
        assert all(len(one) == 1 for one in leaves)
        assert leaves[0] != leaves[1]


def test_the_reduce_scatter_without_op_name_is_attributed():
    found = fixture("gpu_fsdp_tp_4")
    (line,) = [x for x in found.text.splitlines() if "reduce-scatter-start(" in x]
    assert "op_name" not in line
    (row,) = [r for r in found.report.collectives if r.kind == "reduce-scatter"]
    assert {p for part in row.parts for p in part.paths} == {
        "out/0/blocks/down",
        "out/0/blocks/up",
    }


def test_tpu_all_reduce_scatter_fusion_is_one_reduce_scatter_of_its_blocks():
    found = fixture("tpu_fsdp_tp_4")
    (row,) = [r for r in found.report.collectives if r.kind == "reduce-scatter"]
    # The fusion's results are each device's blocks of the stacked weights'
    # gradients: a layer's slice of each leaf's shard.
    shards = {leaf.path: leaf for leaf in found.report.arguments}
    for part in row.parts:
        (path,) = part.paths
        leaf = shards[path.replace("out/0/", "params/")]
        assert part.bytes * 4 == leaf.bytes_per_device  # 4 layers
    fusion = re.search(
        r"= (\(.*?\)) fusion\([^\n]*calls=%all-reduce-scatter", found.text
    )
    assert fusion is not None
    assert len(row.parts) == fusion[1].count("bf16[")


def test_tpu_async_collective_fusions_count_once():
    found = fixture("tpu_fsdp_tp_4")
    text = found.text
    starts = text.count('custom_call_target="AsyncCollectiveStart"')
    assert starts == text.count('custom_call_target="AsyncCollectiveDone"') > 0
    gathers = [r for r in found.report.collectives if r.kind == "all-gather"]
    # Each started gather is one row, besides the gathers XLA left plain.
    plain = len(re.findall(r"all-gather\(.*async_collective_name=", text))
    assert len(gathers) == starts + plain


# Two slices: XLA peels an iteration of the layer loops and reuses the channel
# ids of async gathers for plain gathers and reduce-scatters.

_COMPUTATION_HEAD = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%\S+ = .*? (all-gather|all-reduce|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\("
)


def _chain_census(text: str) -> collections.Counter:
    """The kinds of the program's collectives, each once: every collective line
    but the clones, which sit in the fusions that continue a TPU async
    collective (`async_collective_fusion*`) or end it (`AsyncCollectiveDone`),
    and the all-reduce inside an all-reduce-scatter fusion."""
    kinds: collections.Counter = collections.Counter()
    blocks = re.split(r"\n(?=(?:ENTRY )?%[\w.\-]+ .*\{\s*\n)", text)
    for block in blocks:
        head = _COMPUTATION_HEAD.match(block.split("\n", 1)[0])
        if head is None:
            continue
        name = head[1]
        clone = name.startswith("async_collective_fusion") or (
            'custom_call_target="AsyncCollectiveDone"' in block
        )
        if clone or name.startswith("all-reduce-scatter"):
            continue
        for line in block.splitlines():
            found = _COLLECTIVE.match(line)
            if found is not None:
                kinds[found[1]] += 1
    return kinds


def test_two_slice_rows_are_every_collective_whatever_its_channel_id():
    found = fixture("tpu_two_slices")
    rows = [row for row in found.report.collectives if not row.dcn]
    kinds = collections.Counter(row.kind for row in rows)
    assert kinds == _chain_census(found.text)
    # The channel ids the reader must not key on: one of an async gather's is
    # also a plain reduce-scatter's.
    channels = collections.defaultdict(set)
    for kind, number in re.findall(
        r" (all-gather|reduce-scatter)\(.*?channel_id=(\d+)", found.text
    ):
        channels[number].add(kind)
    assert any(len(k) > 1 for k in channels.values())


# Two slices: the parts of the collectives that cross the slices travel over
# DCN as a `send` and a `recv` to the megascale runtime, tied by a rendezvous
# key, each with its `-done`. Their data: `(array, u32[], token[])`.

_TRANSFER = re.compile(
    r"^\s*%\S+ = \((\w+)\[([\d,]*)\]\S*, u32\[\], token\[\]\) (send|recv)\(.*"
    r'_xla_host_transfer_rendezvous="([^"]+)".*_xla_megascale_transfer_type="(\w+)"'
)
_ITEMSIZE = {"bf16": 2, "f32": 4}
# Runs per step of the computations holding transfers, counted by hand: the
# forward scan's body runs its 4 layers; the backward scan's first iteration
# is peeled into the entry, so its body runs 3 times.
_RUNS = {
    "main.6_spmd": 1,
    "wide.region_0.1_spmd.clone.sunk": 4,
    "wide.region_2.3_spmd.clone.clone.sunk": 3,
}


def _transfer_census(text: str) -> dict[str, dict]:
    """Each rendezvous key's transfer type, runs, and the bytes of its send's
    operand and its recv's array, read from the text."""
    found: dict[str, dict] = {}
    computation = ""
    for line in text.splitlines():
        head = _COMPUTATION_HEAD.match(line)
        if head is not None:
            computation = head[1]
        match = _TRANSFER.match(line)
        if match is None:
            continue
        dtype, dims, op, key, kind = match.groups()
        nbytes = _ITEMSIZE[dtype] * int(np.prod([int(d) for d in dims.split(",")]))
        entry = found.setdefault(key, {"type": kind, "runs": _RUNS[computation]})
        entry[op] = nbytes
    return found


def test_two_slice_transfers_over_dcn_are_rows_of_their_bytes_and_runs():
    found = fixture("tpu_two_slices")
    counted = _transfer_census(found.text)
    assert (
        len(counted) == 14 == found.text.count(" send(") == found.text.count(" recv(")
    )
    # The collectives the keys name were split: none is left in the program.
    assert not any(f"%{key.rsplit('_', 1)[0]} " in found.text for key in counted)
    rows = {row.name: row for row in found.report.collectives if row.dcn}
    assert rows.keys() == counted.keys()
    kinds = {"ALL_GATHER": "all-gather", "ALL_REDUCE": "all-reduce"}
    kinds["ONE_TO_ONE"] = "collective-permute"
    for key, row in rows.items():
        expected = counted[key]
        assert row.kind == kinds[expected["type"]]
        assert (row.bytes, row.count) == (expected["recv"], expected["runs"])
        # On two slices a gather receives two pieces and sends one; a
        # reduction or permute sends and receives its whole buffer.
        pieces = 2 if row.kind == "all-gather" else 1
        assert expected["recv"] == pieces * expected["send"] == pieces * row.link_bytes
        # 'dp' runs across the slices; a permute's pairs also differ in 'tp'.
        axes = ("dp", "tp") if row.kind == "collective-permute" else ("dp",)
        assert row.axes == axes and row.paths
    report = found.report
    total = sum(e["recv"] * e["runs"] for e in counted.values())
    sent = sum(e["send"] * e["runs"] for e in counted.values())
    # By hand: 16 gather runs of 256 KiB received (128 KiB sent); reductions
    # of 64 KiB + 2 x 256 KiB + 512 B once and 2 x 256 KiB three times; two
    # permutes of 128 KiB.
    assert (total, sent) == (6_619_648, 4_522_496)
    assert report.dcn_bytes == total
    assert sum(r.link_bytes * r.count for r in rows.values()) == sent
    # Everything else is the 25 collectives the program states as ops.
    assert len(report.collectives) == 25 + 14
    assert report.total_bytes == total + sum(
        r.total_bytes for r in report.collectives if not r.dcn
    )
    assert "between slices over DCN: 6.3 MiB" in report.summary()


# A mixture of experts on TPU v5p: scatters run on the SparseCore.


def test_a_sparsecore_program_is_read_with_its_collectives_by_path():
    found = fixture("tpu_moe_sparsecore")
    assert 'execution_thread="sparsecore"' in found.text
    threads = {c.thread for c in found.program.module.computations.values()}
    assert threads == {"main", "sparsecore"}
    kinds = collections.Counter(row.kind for row in found.report.collectives)
    census = _chain_census(found.text)
    assert {k: v for k, v in kinds.items() if k != "kernel"} == census
    # The experts' weights are gathered over 'dp' for the expert matmuls.
    gathered = {
        path
        for row in found.report.collectives
        if row.kind == "all-gather"
        for part in row.parts
        for path in part.paths
    }
    assert {"params/up", "params/down"} <= gathered


@pytest.mark.parametrize("name", FSDP_TP)
def test_overlap_is_reported(name):
    found = fixture(name)
    report = found.report
    flags = collections.Counter(row.overlapped for row in report.collectives)
    assert flags[True] > 0 and flags[False] > 0
    assert report.exposed_bytes == sum(
        r.total_bytes for r in report.collectives if r.overlapped is False
    )
    assert 0 < report.exposed_bytes < report.total_bytes
    assert "exposed" in report.summary()
    sync = census(found.text).sync
    for row in report.collectives:
        if row.name in sync:
            assert row.overlapped is False


# ---------------------------------------------------------------------------------
# The other forms: data parallelism, ragged all-to-all, kernels.
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_data_parallel_gradients_are_all_reduced_over_all_devices(target):
    report = fixture(f"{target}_data_parallel").report
    grads = [row for row in report.collectives if row.bytes > 1024]
    assert {row.kind for row in grads} == {"all-reduce"}
    assert all(row.axes == ("dp", "tp") for row in grads)
    params = {leaf.path: leaf for leaf in report.arguments if "params" in leaf.path}
    # All the gradients, by the leaves' own bytes (the GPU combines them into
    # one concatenation, the TPU into one tuple).
    assert sum(row.bytes for row in grads) == sum(
        leaf.bytes_per_device for leaf in params.values()
    )
    named = {p.replace("out/0/", "params/") for row in grads for p in row.paths}
    assert named == set(params)


@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_ragged_all_to_all_is_marked(target):
    found = fixture(f"{target}_ragged")
    (row,) = found.report.collectives
    assert row.kind == "ragged-all-to-all"
    # Its bytes: the output buffer on each device, which bounds what it gets.
    out = {leaf.path: leaf for leaf in found.report.arguments}["out"]
    assert row.bytes == out.bytes_per_device
    assert set(row.paths) >= {"x", "out"}


_P2P = re.compile(
    r"^\s*%(\S+?)(?:-fwd|-bwd)?-recv = \(bf16\[(\d+),(\d+)\].*? recv\(.*?"
    r"_xla_send_recv_source_target_pairs=\{(.*?)\}\}",
    re.M,
)


def test_a_permute_split_into_sends_and_recvs_is_one_row_per_permute():
    # XLA:GPU's collective-permute decomposer writes each of the pipeline's
    # cyclic permutes (forward and backward loops) as two send/recv pairs, one
    # per direction of the cycle: no collective op names them.
    found = fixture("gpu_pipeline_p2p")
    assert "collective-permute-start" not in found.text
    recvs = collections.defaultdict(list)  # permute -> [(bytes, pairs)] by half
    for name, rows, cols, pairs in _P2P.findall(found.text):
        recvs[name].append((2 * int(rows) * int(cols), pairs.count("{")))
    assert len(recvs) == 2 and all(len(v) == 2 for v in recvs.values())
    rows = {r.name: r for r in found.report.collectives}
    # Every collective op is a row, and each permute one more.
    assert len(rows) == len(census(found.text).kinds) + len(recvs)
    for name, halves in recvs.items():
        row = rows[name]
        assert row.kind == "collective-permute" and not row.dcn
        # One run per pipeline step (4 microbatches x 2 repeats + 2 stages
        # - 1), each receiving one microbatch's block on a device.
        assert row.count == 9 and {b for b, _ in halves} == {row.bytes} == {512}
        assert row.axes == ("pp",) and row.overlapped is not None
        # Both halves' pairs: each of the 8 devices sends to its other stage.
        assert sum(n for _, n in halves) == 8
        (read,) = [c for c in found.program.collectives() if c.name == name]
        assert len(read.groups) == 8


def test_a_permute_whose_recv_comes_before_its_data_is_attributed():
    # Ring attention's loop passes each device's key and value blocks round
    # the ring; the schedule puts the value's recv before the instruction that
    # gives the data its send sends.
    found = fixture("gpu_ring_attention_p2p")
    lines = found.text.splitlines()

    def at(pattern: str) -> int:
        (k,) = [k for k, line in enumerate(lines) if re.search(pattern, line)]
        return k

    send = re.search(r" send\(%([\w.\-]+),", lines[at(r"%ppermute.13-bwd-send = ")])
    assert send is not None
    assert at(r"%ppermute.13-bwd-recv = ") < at(rf"%{re.escape(send[1])} = ")
    rows = {r.name: r for r in found.report.collectives}
    assert rows["ppermute.12"].paths == ("k",)
    assert rows["ppermute.13"].paths == ("v",)
    # Each device's block of k or v: (2 / 2, 256 / 4, 4, 64) bf16, once per
    # step of the ring of 4.
    for name in ("ppermute.12", "ppermute.13"):
        assert rows[name].bytes == 64 * 4 * 64 * 2 and rows[name].count == 3


def test_a_send_without_its_pairs_raises_naming_the_line():
    text = fixture("gpu_ring_attention_p2p").text.replace(
        "_xla_send_recv_source_target_pairs=", "_other_attribute="
    )
    with pytest.raises(HloTextError, match="_xla_send_recv_source_target_pairs") as e:
        Program(text, caller="analyze_step", num_devices=8).collectives()
    assert "ppermute.12-bwd-recv = " in str(e.value)
    assert "'xla_gpu_enable_pipelined_p2p': False" in str(e.value)


def test_a_pallas_kernel_is_one_opaque_row_with_a_warning():
    found = fixture("tpu_pallas")
    assert found.text.count('custom_call_target="tpu_custom_call"') == 1
    (row,) = [r for r in found.report.collectives if r.kind == "kernel"]
    assert row.bytes == 0 and row.overlapped is None and row.count == 1
    (warned,) = found.warned
    assert row.name in warned and "not counted" in warned
    (reduce,) = [r for r in found.report.collectives if r.kind == "all-reduce"]
    assert reduce.axes == ("dp",)


def test_an_unknown_collective_custom_call_raises_naming_the_line():
    text = fixture("tpu_pallas").text.replace(
        'custom_call_target="tpu_custom_call"', 'custom_call_target="NewAllGather"'
    )
    with pytest.raises(HloTextError, match=re.escape(f"JAX {jax.__version__}")) as e:
        Program(text, caller="analyze_step", num_devices=8).collectives()
    assert "NewAllGather" in str(e.value) and "shard_map" in str(e.value)


# ---------------------------------------------------------------------------------
# Loops without a stated trip count, on CPU programs.
# ---------------------------------------------------------------------------------


def _fori(mesh, layers):
    from jax.sharding import NamedSharding, PartitionSpec as P

    def f(w, x):
        def body(i, h):
            return jax.numpy.tanh(h @ w[i])

        return jax.lax.fori_loop(0, layers, body, x)

    structs = (
        jax.ShapeDtypeStruct(
            (layers, 16, 16), np.float32, sharding=NamedSharding(mesh, P(None, "tp"))
        ),
        jax.ShapeDtypeStruct(
            (8, 16), np.float32, sharding=NamedSharding(mesh, P("dp"))
        ),
    )
    text = jax.jit(f).lower(*structs).compile().as_text()
    assert text is not None
    return text


def test_a_loop_without_a_stated_trip_count_counts_from_its_condition(mesh):
    for layers in (3, 5):
        text = _fori(mesh, layers)
        stated = [c for c in Program(text, caller="t", num_devices=8).collectives()]
        # The same program as TPU writes it: no `known_trip_count`.
        bare = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", text)
        assert bare != text
        read = Program(bare, caller="t", num_devices=8).collectives()
        assert [c.count for c in read] == [c.count for c in stated]
        assert layers in {c.count for c in read}
        assert not any(c.unknown_trips for c in read)


def test_a_loop_whose_condition_is_no_counter_counts_once_and_says_so(mesh):
    from jax.sharding import NamedSharding, PartitionSpec as P

    def f(w, x):
        def cond(h):
            return h.sum() < 100.0

        return jax.lax.while_loop(cond, lambda h: jax.numpy.tanh(h @ w) + 1.0, x)

    structs = (
        jax.ShapeDtypeStruct(
            (16, 16), np.float32, sharding=NamedSharding(mesh, P(None, "tp"))
        ),
        jax.ShapeDtypeStruct(
            (8, 16), np.float32, sharding=NamedSharding(mesh, P("dp"))
        ),
    )
    text = jax.jit(f).lower(*structs).compile().as_text()
    assert text is not None and "known_trip_count" not in text
    looped = [
        c
        for c in Program(text, caller="t", num_devices=8).collectives()
        if "while/body" in c.op_name
    ]
    assert looped and all(c.unknown_trips and c.count == 1 for c in looped)


# ---------------------------------------------------------------------------------
# Overlap in the report's JSON and diff.
# ---------------------------------------------------------------------------------


def test_overlap_round_trips_and_old_reports_read_as_unknown():
    report = fixture("gpu_fsdp_tp_4").report
    back = StepReport.from_json(report.to_json())
    assert back == report
    assert [r.overlapped for r in back.collectives] == [
        r.overlapped for r in report.collectives
    ]
    # A report of format 1, written before rows said whether they overlap.
    data = json.loads(report.to_json())
    data["format"] = 1
    for row in data["collectives"]:
        del row["overlapped"]
    old = StepReport.from_json(json.dumps(data))
    assert all(row.overlapped is None for row in old.collectives)
    assert old.unknown_overlap_bytes == old.total_bytes and old.exposed_bytes == 0
    data["collectives"][0]["overlapped"] = "yes"
    with pytest.raises(ValueError, match="collectives/0/overlapped"):
        StepReport.from_json(json.dumps(data))


def test_diff_shows_the_exposed_bytes():
    report = fixture("gpu_fsdp_tp_4").report
    hidden = dataclasses.replace(
        report,
        collectives=tuple(
            dataclasses.replace(row, overlapped=True) for row in report.collectives
        ),
    )
    changes = {c.what: c for c in report.diff(hidden).changes}
    assert changes["exposed_bytes"].before == report.exposed_bytes
    assert changes["exposed_bytes"].after == 0
    assert "total_bytes" not in changes
    assert not report.diff(hidden).paths  # no leaf's layout or bytes changed


# ---------------------------------------------------------------------------------
# Real target compiles (small steps).
# ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_analyze_step_on_a_real_target(target):
    mesh = regenerate.tpu_mesh() if target == "tpu" else regenerate.gpu_mesh()
    step, args = regenerate.fsdp_tp(mesh, 2, dim=256, batch=256)
    report = eqshard.analyze_step(step, *args)
    text = jax.jit(step, keep_unused=True).lower(*args).compile().as_text()
    assert text is not None
    counted = census(text)
    assert len(report.collectives) == len(counted.kinds)
    assert not any(row.unknown_trip_count for row in report.collectives)
    assert len([r for r in report.collectives if r.count == 2]) == len(counted.in_loops)
    assert report.attributed_share >= 0.95
    assert any(row.overlapped is not None for row in report.collectives)
    assert report.memory.peak_bytes == report.memory.xla_peak_bytes


# ---------------------------------------------------------------------------------
# `async-start ... calls=` wrappers (as XLA writes an async collective it wraps).
# ---------------------------------------------------------------------------------

_WRAPPED = """HloModule wrapped

%wrapped (p: f32[2,8]) -> f32[8,8] {
  %p = f32[2,8]{1,0} parameter(0)
  ROOT %ag = f32[8,8]{1,0} all-gather(%p), channel_id=1, GROUPS
}

%fused (a: f32[2,8]) -> f32[2,8] {
  %a = f32[2,8]{1,0} parameter(0)
  ROOT %e = f32[2,8]{1,0} exponential(%a)
}

ENTRY %main (x: f32[2,8], y: f32[2,8]) -> (f32[8,8], f32[2,8]) {
  %x = f32[2,8]{1,0} parameter(0)
  %y = f32[2,8]{1,0} parameter(1)
  %start = ((f32[2,8]{1,0}), f32[8,8]{1,0}) async-start(%x), calls=%wrapped
  BETWEEN
  %done = f32[8,8]{1,0} async-done(%start)
  %f2 = f32[2,8]{1,0} fusion(%y), kind=kLoop, calls=%fused
  ROOT %t = (f32[8,8]{1,0}, f32[2,8]{1,0}) tuple(%done, %f2)
}
""".replace("GROUPS", "replica_groups=[2,4]<=[8], dimensions={0}")


@pytest.mark.parametrize(
    "between, overlapped",
    [
        ("%f = f32[2,8]{1,0} fusion(%y), kind=kLoop, calls=%fused", True),
        ("%b = f32[2,8]{1,0} bitcast(%y)", False),
    ],
)
def test_an_async_start_wrapper_is_one_collective(between, overlapped):
    program = Program(_WRAPPED.replace("BETWEEN", between), caller="t", num_devices=8)
    (gather,) = program.collectives()
    assert gather.kind == "all-gather" and gather.count == 1
    assert gather.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    (part,) = gather.parts
    assert part.shape.dims == (8, 8) and part.arguments == {0}
    assert part.results == {0}
    assert gather.overlapped is overlapped


@pytest.mark.slow
def test_search_layout_compiles_and_reads_a_sparsecore_step():
    mesh = regenerate.v5p_mesh()
    step, args = regenerate.moe(mesh, dim=128, tokens=256)
    with warnings.catch_warnings():
        # The expert matmuls are Mosaic kernels: their rows say so.
        warnings.filterwarnings("ignore", "eqshard.analyze_step: the step runs")
        result = eqshard.search_layout(
            step, *args, mesh=mesh, max_candidates=1, progress=False
        )
    assert result.best is not None
    assert result.best.report.collectives
