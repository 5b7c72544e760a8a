# How long a step takes on a target's chips (`StepReport.time`): FLOPs read from
# the program's text, collectives timed on their links, the roofline. Programs
# come from tests/fixtures/hlo/ (compiled for TPU v5e-8 and 8 H100s by its
# regenerate.py), from small hand-written HLO texts, and from one compile for a
# single H100. Expected values are counted by hand from the shapes and the
# chips' published figures (eqshard/_mesh/_chips.py cites them).

import dataclasses
import functools
import json
import pathlib
import types

import jax
import jax.numpy as jnp
import pytest
from fakes import HostDevice, TpuDevice
from jax.sharding import NamedSharding, PartitionSpec as P

import eqshard
from eqshard._mesh._chips import CHIPS
from eqshard._step._hlo._flow import Program
from eqshard._step._hlo._text import HloTextError
from eqshard._step._options import step_options
from eqshard._step._report import StepReport
from eqshard._step._rows import collective_row, memory
from eqshard._step._time import estimate_time


FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hlo"
H100 = "NVIDIA H100 80GB HBM3"


def _devices(name: str, meta: dict) -> list:
    """Stand-ins for the fixture's devices in mesh order: v5e:2x4 has device
    `i` at torus coordinates `(i % 2, i // 2)` (of two slices, device
    `100000 * (s + 1) + i` of slice `s`); the H100s are one host."""
    ids = meta["device_ids"]
    if name.startswith("tpu") and min(ids) >= 100000:  # slices of compile-only ids
        return [
            TpuDevice(
                i,
                i // 100000 - 1,
                (i % 2, i % 100000 // 2, 0),
                0,
                "TPU v5 lite",
                slice_index=i // 100000 - 1,
            )
            for i in ids
        ]
    if name.startswith("tpu"):
        return [TpuDevice(i, i // 4, (i % 2, i // 2, 0), 0, "TPU v5 lite") for i in ids]
    return [HostDevice(i, 0, "gpu", H100) for i in ids]


def _report(text: str, devices: list, name: str = "step") -> StepReport:
    """A report of `text` with its time on `devices`, built as analyze_step
    builds one (without arguments)."""
    program = Program(text, caller="analyze_step", num_devices=len(devices))
    found = program.collectives()
    rows = [collective_row(c, ["in"] * 8, ["out"] * 8, None) for c in found]
    time, note, timed = estimate_time(program, found, rows, devices)
    stats = types.SimpleNamespace(
        argument_size_in_bytes=0,
        output_size_in_bytes=0,
        temp_size_in_bytes=0,
        alias_size_in_bytes=0,
    )
    return StepReport(
        function=name,
        mesh=(),
        arguments=(),
        outputs=(),
        memory=memory(stats, devices),
        collectives=timed,
        time=time,
        time_note=note,
    )


@functools.cache
def fixture(name: str) -> StepReport:
    meta = json.loads((FIXTURES / f"{name}.json").read_text())
    text = (FIXTURES / f"{name}.hlo.txt").read_text()
    return _report(text, _devices(name, meta), name)


# The fixtures' step (regenerate.fsdp_tp): batch 1024, width 512, hidden 2048,
# bf16, on a (2, 4) mesh ('dp', 'tp'); per device a layer's two matmuls are
# 2*(B/2)*D*(H/4) FLOPs each, and its backward twice its forward.
B, D, H = 1024, 512, 2048
LAYER = 3 * 2 * (2 * (B // 2) * D * (H // 4))
# Outside the loop: the embedding's forward, replicated over 'tp' (its output
# is laid out ('dp', None)), and its gradient, whose rows are split over 'dp'.
OUTSIDE = 2 * (B // 2) * D * D + 2 * (D // 2) * D * (B // 2)


@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_flops_of_a_scan_are_its_layers_times_one_layers(target):
    for layers in (4, 8):
        time = fixture(f"{target}_fsdp_tp_{layers}").time
        assert time is not None
        assert time.flops == layers * LAYER + OUTSIDE


@pytest.mark.parametrize(
    "name", ["tpu_fsdp_tp_4", "gpu_fsdp_tp_8", "tpu_data_parallel"]
)
def test_step_s_lies_between_the_roofline_and_the_sum(name):
    time = fixture(name).time
    assert time is not None
    low = max(time.compute_s, time.memory_s)
    high = time.compute_s + time.memory_s + time.collective_s
    assert 0 < low <= time.step_s <= high
    assert 0 <= time.exposed_collective_s <= time.collective_s
    assert time.step_s > time.compute_s  # it counts more than the matmuls


def test_an_all_gather_takes_the_ring_formula():
    # TPU v5e: the 4 devices of a 'tp' group are a 2x2 block of the 2x4 slice
    # (no wraparound): a link one way along each of the two axes, 1 hop each;
    # 3/4 of the gathered array through each device at 4.5e10 B/s a link.
    rows = [r for r in fixture("tpu_fsdp_tp_4").collectives if r.kind == "all-gather"]
    four = [r for r in rows if r.group_size == 4]
    assert four
    for row in four:
        assert row.seconds == pytest.approx(0.75 * row.bytes / (2 * 4.5e10) + 2e-6)
    # 8 H100s of one host: NVLink at 4.5e11 B/s one way, a step per device.
    rows = [r for r in fixture("gpu_fsdp_tp_4").collectives if r.kind == "all-gather"]
    assert rows
    for row in rows:
        n = row.group_size
        expected = (n - 1) / n * row.bytes / 4.5e11 + (n - 1) * 2e-6
        assert row.seconds == pytest.approx(expected)


def test_transfers_between_slices_take_the_network():
    # Two v5e-8 slices over DCN at 2.5e10 / 4 B/s a chip, 10 us a hop: a gather
    # between one device of each slice sends half its result; a sum sends its
    # whole buffer, there and back in latency; a permute its bytes.
    report = fixture("tpu_two_slices")
    assert report.time is not None
    dcn = [r for r in report.collectives if r.dcn]
    assert {r.kind for r in dcn} == {"all-gather", "all-reduce", "collective-permute"}
    for row in dcn:
        assert row.seconds is not None
        if row.kind == "all-gather":
            expected = 0.5 * row.bytes / 6.25e9 + 1e-5
        elif row.kind == "all-reduce":
            expected = row.bytes / 6.25e9 + 2e-5
        else:
            expected = row.bytes / 6.25e9 + 1e-5
        assert row.seconds == pytest.approx(expected)
    total = sum(r.seconds * r.count for r in report.collectives if r.seconds)
    assert report.time.collective_s == pytest.approx(total)


# Transfers between slices as libtpu writes them (shapes of a psum_scatter over
# four slices, and of an all_to_all whose groups span two slices of two devices).
_MEGASCALE = (
    "is_host_transfer=true, frontend_attributes={{_xla_host_transfer_handler_name="
    '"xla_megascale_runtime",_xla_host_transfer_rendezvous="{key}",'
    '_xla_megascale_target={target},_xla_megascale_transfer_type="{kind}"}}'
)
_TRANSFERS = """HloModule m

ENTRY %main (p: f32[8,1,128], q: f32[4,4,64]) -> (f32[2,1,128], f32[4,4,64]) {{
  %p = f32[8,1,128]{{2,1,0}} parameter(0)
  %q = f32[4,4,64]{{2,1,0}} parameter(1)
  %a = token[] after-all()
  %s = (f32[8,1,128]{{2,1,0}}, u32[], token[]) send(%p, %a), channel_id=1, {rs}
  %r = (f32[2,1,128]{{2,1,0}}, u32[], token[]) recv(%a), channel_id=2, {rs}
  %b = token[] after-all()
  %s2 = (f32[4,4,64]{{2,1,0}}, u32[], token[]) send(%q, %b), channel_id=3, {a2a}
  %r2 = (f32[4,4,64]{{2,1,0}}, u32[], token[]) recv(%b), channel_id=4, {a2a}
  %sd = token[] send-done(%s), channel_id=1, is_host_transfer=true
  %rd = (f32[2,1,128]{{2,1,0}}, token[]) recv-done(%r), channel_id=2
  %sd2 = token[] send-done(%s2), channel_id=3, is_host_transfer=true
  %rd2 = (f32[4,4,64]{{2,1,0}}, token[]) recv-done(%r2), channel_id=4
  %x = f32[2,1,128]{{2,1,0}} get-tuple-element(%rd), index=0
  %y = f32[4,4,64]{{2,1,0}} get-tuple-element(%rd2), index=0
  ROOT %t = (f32[2,1,128]{{2,1,0}}, f32[4,4,64]{{2,1,0}}) tuple(%x, %y)
}}
"""


def _transfers(kind: str = "REDUCE_SCATTER") -> str:
    rs = _MEGASCALE.format(
        key="reduce-scatter.1_0", target='"{1,2,3,4}x{0:1}"', kind=kind
    )
    a2a = _MEGASCALE.format(
        key="all-to-all.2_0", target="{{0,1,4,5},{2,3,6,7}}", kind="ALL_TO_ALL"
    )
    return _TRANSFERS.format(rs=rs, a2a=a2a)


def test_transfers_between_slices_are_read_from_their_attributes():
    # Devices 2s and 2s+1 are slice s, a pair of chips side by side.
    devices = [
        TpuDevice(i, i // 2, (i % 2, 0, 0), 0, "TPU v5 lite", slice_index=i // 2)
        for i in range(8)
    ]
    report = _report(_transfers(), devices)
    scatter, a2a = report.collectives
    assert (scatter.name, scatter.kind, scatter.dcn) == (
        "reduce-scatter.1_0",
        "reduce-scatter",
        True,
    )
    # One device in each of 4 slices: each keeps a quarter (2 x 128 f32) of
    # the 8 x 128 it sends, and sends the other three quarters.
    assert (scatter.bytes, scatter.group_size, scatter.link_bytes) == (1024, 4, 3072)
    assert scatter.paths == ("in", "out") and scatter.overlapped is False
    assert scatter.seconds == pytest.approx(3072 / 6.25e9 + 3e-5)
    # Groups of device ids: two devices in each of two slices. Inside a slice,
    # a quarter of an all-gather of the array, over one ICI link and one hop
    # (1 us); between them, half of each device's half, over DCN.
    assert (a2a.kind, a2a.bytes, a2a.group_size) == ("all-to-all", 4096, 4)
    local = 0.5 * 4096 / 4 / 4.5e10 + 1e-6
    assert a2a.seconds == pytest.approx(local + 0.5 * 4096 / 2 / 6.25e9 + 1e-5)
    with pytest.raises(HloTextError, match="unknown type 'BROADCAST'"):
        Program(_transfers("BROADCAST"), caller="analyze_step", num_devices=8)


def test_collective_s_sums_the_rows_seconds_times_their_runs():
    report = fixture("tpu_fsdp_tp_8")
    assert report.time is not None
    total = sum(r.seconds * r.count for r in report.collectives if r.seconds)
    assert report.time.collective_s == pytest.approx(total)


_DOT = """HloModule m

ENTRY %main (p0: {t}[256,512], p1: {t}[512,128]) -> f32[256,128] {{
  %p0 = {t}[256,512]{{1,0}} parameter(0)
  %p1 = {t}[512,128]{{1,0}} parameter(1)
  ROOT %dot = f32[256,128]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, \
rhs_contracting_dims={{0}}{precision}
}}
"""
FLOPS = 2 * 256 * 128 * 512


def _dot(dtype: str, precision: str = "") -> str:
    extra = f", operand_precision={{{precision},{precision}}}" if precision else ""
    return _DOT.format(t=dtype, precision=extra)


def test_f32_dots_are_timed_by_their_precision():
    tpu = [TpuDevice(0, 0, (0, 0, 0), 0, "TPU v5 lite")]
    gpu = [HostDevice(0, 0, "gpu", H100)]
    cases = [
        (tpu, "", 197e12),  # DEFAULT: one bf16 pass
        (tpu, "highest", 197e12 / 6),  # HIGHEST: six
        (gpu, "", 494.7e12),  # TF32 Tensor Cores
        (gpu, "highest", 66.9e12),  # FP32
    ]
    for devices, precision, rate in cases:
        time = _report(_dot("f32", precision), devices).time
        assert time is not None and time.flops == FLOPS
        assert time.compute_s == pytest.approx(FLOPS / rate)


def test_a_dtype_without_a_peak_is_refused_with_a_message():
    v4 = [TpuDevice(0, 0, (0, 0, 0), 0, "TPU v4")]
    report = _report(_dot("f8e4m3fn"), v4)
    assert report.time is None
    assert "no peak for fp8 operands is known for TPU v4" in report.time_note
    h100 = _report(_dot("f8e4m3fn"), [HostDevice(0, 0, "gpu", H100)]).time
    assert h100 is not None
    assert h100.compute_s == pytest.approx(FLOPS / 1978.9e12)
    with pytest.raises(ValueError, match="no peak for fp8"):
        next(c for c in CHIPS if c.name == "TPU v4").peak("fp8")


_GATHER = """HloModule m

ENTRY %main (p0: f32[128]) -> f32[384] {
  %p0 = f32[128]{0} parameter(0)
  ROOT %ag = f32[384]{0} all-gather(%p0), replica_groups={{0,1,2},{3,4,5}}, \
dimensions={0}
}
"""


def test_a_group_that_is_no_block_of_the_torus_has_unknown_links():
    # Devices 0, 1, 2 at (0, 0), (1, 0), (0, 1): an L, no block of the torus.
    coords = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 2, 0), (1, 2, 0)]
    devices = [TpuDevice(i, 0, c, 0, "TPU v5 lite") for i, c in enumerate(coords)]
    report = _report(_GATHER, devices)
    assert report.time is None
    assert "no block of the torus" in report.time_note
    assert "create_mesh" in report.time_note and "another order" in report.time_note
    # In a line of six, each group of three is a block: its ring is known.
    line = [TpuDevice(i, 0, (0, i, 0), 0, "TPU v5 lite") for i in range(6)]
    gathered = _report(_GATHER, line).collectives[0]
    assert gathered.seconds == pytest.approx(2 / 3 * 384 * 4 / 4.5e10 + 2e-6)


def test_an_unknown_chip_or_cpu_has_no_time_and_says_why(mesh):
    odd = _report(_dot("bf16"), [HostDevice(0, 0, "gpu", "NVIDIA RTX 4090")])
    assert odd.time is None and "'NVIDIA RTX 4090'" in odd.time_note
    sharding = NamedSharding(mesh, P("dp"))
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=sharding)
    report = eqshard.analyze_step(lambda x: (x @ x.T).sum(), x)
    assert report.time is None and "CPU devices" in report.time_note
    assert all(row.seconds is None for row in report.collectives)


def test_the_time_round_trips_json_and_old_reports_load():
    report = fixture("gpu_fsdp_tp_4")
    assert StepReport.from_json(report.to_json()) == report
    data = json.loads(report.to_json())
    data["format"] = 2
    del data["time"], data["time_note"]
    for row in data["collectives"]:
        del row["seconds"]
    old = StepReport.from_json(json.dumps(data))
    assert old.time is None and old.collectives[0].seconds is None
    data = json.loads(report.to_json())
    data["time"]["step_s"] = "fast"
    with pytest.raises(ValueError, match="time/step_s': expected a number"):
        StepReport.from_json(json.dumps(data))


def test_mfu_and_the_transformer_count():
    time = fixture("tpu_fsdp_tp_4").time
    assert time is not None
    assert time.mfu(8 * time.flops) == pytest.approx(
        time.flops / (time.step_s * 197e12)
    )
    # PaLM's count: 6 N per token plus 12 L d T, halved when causal.
    flops = eqshard.transformer_flops(
        params=1000, tokens=10, layers=2, seq=8, dim=4, causal=False
    )
    assert flops == 10 * (6 * 1000 + 12 * 2 * 4 * 8)
    causal = eqshard.transformer_flops(params=1000, tokens=10, layers=2, seq=8, dim=4)
    assert causal == 10 * (6 * 1000 + 6 * 2 * 4 * 8)
    with pytest.raises(ValueError, match="tokens must be positive"):
        eqshard.transformer_flops(params=1, tokens=0, layers=1, seq=1, dim=1)


def test_a_bf16_matmul_chain_runs_at_the_chips_peak():
    mesh = eqshard.create_mesh((1,), ("dp",), target="h100:1x1")
    sharding = NamedSharding(mesh, P())
    n = 4096
    x = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=sharding)

    def chain(x, ws):
        for w in ws:
            x = x @ w
        return x

    time = eqshard.analyze_step(chain, x, [x] * 4).time
    assert time is not None and time.devices == 1
    assert time.flops == 4 * 2 * n**3
    at_peak = time.flops / 989.4e12
    assert time.compute_s == pytest.approx(at_peak)
    assert at_peak <= time.step_s <= 1.1 * at_peak
    assert dataclasses.asdict(time)["chip"] == "H100 SXM"


@dataclasses.dataclass(frozen=True)
class _Client:
    runtime_type: str = "compile_only_runtime"


@dataclasses.dataclass(frozen=True)
class _TargetTpu:
    """A TPU target's device, as `is_compile_only` tells one."""

    platform: str = "tpu"
    client: _Client = _Client()


def test_tpu_targets_compile_with_the_async_collective_options(monkeypatch):
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    names = {
        "xla_tpu_enable_async_collective_fusion",
        "xla_tpu_enable_async_collective_fusion_fuse_all_gather",
        "xla_tpu_enable_async_collective_fusion_multiple_steps",
        "xla_tpu_overlap_compute_collective_tc",
        "xla_enable_async_all_gather",
        "xla_enable_async_collective_permute",
    }
    target = [_TargetTpu()]
    assert step_options(target, None) == dict.fromkeys(names, True)
    mine = step_options(target, {"xla_enable_async_all_gather": False, "x": 1})
    assert mine == {
        **dict.fromkeys(names, True),
        "xla_enable_async_all_gather": False,
        "x": 1,
    }
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_enable_async_all_gather=false")
    assert step_options(target, None) == dict.fromkeys(
        names - {"xla_enable_async_all_gather"}, True
    )
    # Elsewhere (a GPU target, CPU devices) the options are the user's.
    gpu = [_TargetTpu(platform="gpu")]
    assert step_options(gpu, None) is None
    assert step_options([HostDevice(0, 0)], {"x": 1}) == {"x": 1}


_BATCHED = """HloModule m

ENTRY %main (p0: bf16[8,32,1], p1: bf16[4,16,32,1]) -> bf16[8,4,16] {
  %p0 = bf16[8,32,1]{2,1,0} parameter(0)
  %p1 = bf16[4,16,32,1]{3,2,1,0} parameter(1)
  ROOT %c = bf16[8,4,16]{2,1,0} convolution(%p0, %p1), \
window={size=4 pad=3_3 rhs_reversal=1}, dim_labels=bf0_0oi->b0f
}
"""


def test_a_convolution_over_a_padded_input_counts_the_taps_that_meet_it():
    # TPU's batched matmul: 4 heads as a window of 4 over an input of 1, padded
    # by 3 each side; each output meets one tap: 32 products per output.
    devices = [TpuDevice(0, 0, (0, 0, 0), 0, "TPU v5 lite")]
    time = _report(_BATCHED, devices).time
    assert time is not None
    assert time.flops == 2 * (8 * 4 * 16) * 32
