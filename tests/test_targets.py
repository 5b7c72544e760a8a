"""Tests for compile-only target meshes (`create_mesh(target=...)`): real TPU
(libtpu) and GPU (JAX's CUDA plugin) compilers, on this CPU machine."""

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from probes import RUN_TIMEOUT

import eqshard
from eqshard._step._options import TPU_ASYNC_OPTIONS


_GiB = 1 << 30


def _step(w, x):
    """A small step whose compile gathers `w` and reduces over `dp`."""
    loss = lambda w: jnp.mean(jnp.tanh(x @ w) ** 2)
    return w - 0.1 * jax.grad(loss)(w)


def _abstract(mesh, dtype=jnp.float32):
    w = jax.ShapeDtypeStruct((256, 256), dtype, sharding=NamedSharding(mesh, P("tp")))
    x = jax.ShapeDtypeStruct((64, 256), dtype, sharding=NamedSharding(mesh, P("dp")))
    return w, x


# Names: Cloud TPU's accelerator types, as the table gives them.


@pytest.mark.parametrize(
    "target, devices, kind",
    [
        ("v4-128", 64, "TPU v4"),  # 128 TensorCores: 64 megacore chips
        ("v5p-1024", 512, "TPU v5"),
        ("v5litepod-256", 256, "TPU v5 lite"),
        ("v5e-256", 256, "TPU v5 lite"),
        ("v6e-256", 256, "TPU v6 lite"),
        ("v5e:2x4", 8, "TPU v5 lite"),
        ("v5p:2x2x2", 8, "TPU v5"),
    ],
)
def test_tpu_names_give_the_cloud_tpu_device_counts(target, devices, kind):
    mesh = eqshard.create_mesh((-1,), ("fsdp",), target=target)
    assert mesh.devices.size == devices
    assert {d.platform for d in mesh.devices.flat} == {"tpu"}
    assert {d.device_kind for d in mesh.devices.flat} == {kind}
    assert jax.default_backend() == "cpu"  # the process's backend is unchanged


def test_v4_128_is_the_4x4x4_topology_and_splits_its_axes():
    mesh = eqshard.create_mesh((8, 8), ("fsdp", "tp"), target="v4-128")
    coords = np.array([d.coords for d in mesh.devices.flat])
    assert coords.max(axis=0).tolist() == [3, 3, 3]


# Every shipped GPU name compiles a step; its memory is the spec's.


@pytest.mark.parametrize(
    "target, kind, memory",
    [
        ("h100", "NVIDIA H100 80GB HBM3", 84942979072),
        ("h200", "NVIDIA H200 141GB HBM3e", 151397597184),
        ("a100-40g", "NVIDIA A100-SXM4-40GB", 42331013120),
        ("a100-80g", "NVIDIA A100-SXM4-80GB", 85100068864),
        ("b200", "NVIDIA B200", 191514411008),
    ],
)
def test_every_gpu_name_compiles_a_step(target, kind, memory):
    mesh = eqshard.create_mesh((2, 4), ("dp", "tp"), target=target)
    assert {d.device_kind for d in mesh.devices.flat} == {kind}
    report = eqshard.analyze_step(_step, *_abstract(mesh, jnp.bfloat16))
    assert report.memory.platform == "gpu"
    assert report.memory.peak_bytes == report.memory.xla_peak_bytes > 0
    assert report.device_memory == int(memory * 0.75)
    assert ("jax-cuda12-plugin", jax.__version__) in report.versions


def test_gpu_hosts_are_processes_and_the_dcn_units_of_a_hybrid_mesh():
    mesh = eqshard.create_mesh((8, 8), ("dp", "tp"), target="h100:8x8")
    assert len({d.process_index for d in mesh.devices.flat}) == 8
    hybrid = eqshard.create_hybrid_mesh((1, 8), (8, 1), ("dp", "tp"), target="h100:8x8")
    for row in hybrid.devices:  # each dp row is one host's 8 GPUs
        assert len({d.process_index for d in row}) == 1


def test_tpu_slices_run_over_the_first_axis_that_they_divide():
    mesh = eqshard.create_mesh((4, 4), ("dp", "tp"), target="v5e:2x4", num_slices=2)
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    assert slices[:, 0].tolist() == [0, 0, 1, 1]
    assert (slices == slices[:, :1]).all()  # tp stays inside a slice
    hybrid = eqshard.create_hybrid_mesh((2, 4), (2, 1), ("dp", "tp"), target="v5e-8")
    assert sorted({d.slice_index for d in hybrid.devices.flat}) == [0, 1]


def test_device_memory_follows_the_preallocation_fraction(monkeypatch):
    mesh = eqshard.create_mesh((8,), ("dp",), target="a100-40g")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5")
    w = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P()))
    report = eqshard.analyze_step(lambda w: w * 2, w)
    assert report.device_memory == 42331013120 // 2


@pytest.mark.parametrize("text", ["abc", "-0.5", "7", "0", "nan", ""])
def test_a_preallocation_fraction_that_is_none_is_refused(monkeypatch, text):
    from eqshard._mesh._targets import device_memory

    mesh = eqshard.create_mesh((8,), ("dp",), target="a100-40g")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", text)
    with pytest.raises(ValueError, match="above 0 and at most 1") as error:
        device_memory(list(mesh.devices.flat))
    assert f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r}" in str(error.value)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1")
    assert device_memory(list(mesh.devices.flat)) == 42331013120  # the whole card


def test_the_gpu_route_says_to_set_the_platform_before_importing_jax(monkeypatch):
    from jax.experimental import topologies

    def off(**kwargs):  # the CUDA plugin, switched off by JAX's start-up
        raise NotImplementedError

    monkeypatch.setattr(topologies, "get_topology_desc", off)
    with pytest.raises(ValueError, match="JAX_PLATFORMS=cpu") as error:
        eqshard.create_mesh((8,), ("dp",), target="h100")
    said = str(error.value)
    assert "before `import jax`" in said and "first JAX call" not in said
    assert "os.environ['JAX_PLATFORMS'] = 'cpu'" in said


# The report on a target: peak, budget, JSON.


def test_tpu_report_decides_by_xla_peak_and_the_chips_memory():
    mesh = eqshard.create_mesh((2, 4), ("dp", "tp"), target="v5e:2x4")
    w, x = _abstract(mesh)
    report = eqshard.analyze_step(_step, w, x, compiler_options={})
    # A TPU target compiles with the async-collective options by default.
    options = dict(TPU_ASYNC_OPTIONS)
    assert report.compiler_options == tuple((k, "True") for k in sorted(options))
    compiled = jax.jit(_step).lower(w, x).compile(options).memory_analysis()
    assert compiled is not None
    assert report.memory.peak_bytes == compiled.peak_memory_in_bytes
    assert report.memory.platform == "tpu"
    assert report.device_memory == int(15.75 * _GiB)  # libtpu's, measured
    assert report.memory.fits() and report.memory.headroom() > 15 * _GiB
    assert not report.memory.fits(report.memory.peak_bytes - 1)
    assert dict(report.versions)["libtpu"]
    again = eqshard.StepReport.from_json(report.to_json())
    assert again == report and again.device_memory == int(15.75 * _GiB)


@pytest.mark.parametrize("target", ["v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
def test_tpu_device_memory_is_what_the_compiler_allows(target):
    mesh = eqshard.create_mesh((4,), ("dp",), target=target)
    huge = jax.ShapeDtypeStruct(
        (4, 40 << 30), jnp.float32, sharding=NamedSharding(mesh, P("dp"))
    )  # 160 GiB on each chip
    with pytest.raises(Exception, match=r"exceeds available HBM") as refused:
        jax.jit(lambda x: x * 2).lower(huge).compile()
    available = re.search(r"available HBM \(([0-9.]+)G\)", str(refused.value))
    assert available is not None
    memory = eqshard.plan_training(huge, P("dp"), mesh).device_memory
    assert memory is not None
    assert abs(memory / _GiB - float(available[1])) < 0.005


def test_fits_without_a_budget_names_the_argument():
    mesh = eqshard.create_mesh((8,), ("dp",))
    w = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P()))
    report = eqshard.analyze_step(lambda w: w + 1, w)
    assert report.device_memory is None and report.memory.platform == "cpu"
    with pytest.raises(ValueError, match=r"StepMemory.fits: device_memory is None"):
        report.memory.fits()
    data = json.loads(report.to_json())
    assert data["format"] == 4
    # A format-1 report (before this release) reads, with the new fields' defaults.
    for field in ("host_argument_bytes", "host_output_bytes", "host_temp_bytes"):
        del data["memory"][field]
    del data["memory"]["platform"], data["memory"]["device_memory"]
    del data["versions"], data["compiler_options"]
    data["format"] = 1
    old = eqshard.StepReport.from_json(json.dumps(data))
    assert old.memory == report.memory and old.versions == ()
    data["format"] = 4
    with pytest.raises(ValueError, match=r"at 'memory/platform': expected a string"):
        eqshard.StepReport.from_json(json.dumps(data))


def test_compiler_options_are_recorded():
    mesh = eqshard.create_mesh((8,), ("dp",))
    w = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P()))
    options = {"xla_backend_optimization_level": 0}
    report = eqshard.analyze_step(lambda w: w + 1, w, compiler_options=options)
    assert report.compiler_options == (("xla_backend_optimization_level", "0"),)


# Nothing runs on a target.


def test_data_cannot_be_placed_or_run_on_a_target_mesh():
    mesh = eqshard.create_mesh((2, 4), ("dp", "tp"), target="v5e:2x4")
    message = r"compile-only devices \(TPU v5 lite"
    with pytest.raises(ValueError, match=r"eqshard.shard: .*" + message):
        eqshard.shard({"w": np.ones((8, 8), np.float32)}, P("dp"), mesh)
    with pytest.raises(ValueError, match=r"eqshard.init_sharded: .*" + message):
        eqshard.init_sharded(lambda: {"w": jnp.ones((8, 8))}, specs=P("dp"), mesh=mesh)
    step = eqshard.filter_jit(lambda w: w * 2, in_specs=P("dp"), mesh=mesh)
    step.lower(eqshard.abstract(jnp.ones((8, 8)), P("dp"), mesh)).compile()
    with pytest.raises(ValueError, match=r"eqshard.filter_jit: .*" + message):
        step(np.ones((8, 8), np.float32))


# Bad names and arguments.


@pytest.mark.parametrize(
    "target, kwargs, message",
    [
        ("a100", {}, r"'a100-40g' or 'a100-80g'"),
        ("tpu-v9", {}, r"unknown name\. Known: .*'v5p-1024'.*'h100', 'h200'"),
        ("v5p-1000", {}, r"counts TensorCores \(two per chip\); N=1000"),
        ("h100:0x8", {}, r"'h100:HOSTSxGPUS'"),
        ("v5e:2x4", {"devices": jax.devices()}, r"either devices= or target="),
        ("v5e:3x3", {}, r"libtpu cannot make the topology 'v5e:3x3'"),
        ("h100", {"num_slices": 2}, r"num_slices=2 is for TPU slices.*'h100:2x8'"),
        ("v5e:2x2x2", {}, r"v5e slice is a 2-D topology, not 3-D.*'v5e:2x4'"),
        ("v4:2x2", {}, r"v4 slice is a 3-D topology, not 2-D"),
        ("h100:100000x8", {}, r"800000 devices, more than the 8192"),
        ("v5e:0x4", {}, r"sizes of 1 or more"),
        ("v5p-8", {"num_slices": 100_000}, r"num_slices=100000 of 4 chips"),
    ],
)
def test_bad_targets_say_what_to_write(target, kwargs, message):
    with pytest.raises(ValueError, match=message):
        eqshard.create_mesh((-1,), ("dp",), target=target, **kwargs)


@pytest.mark.parametrize(
    "target, kind", [("v5e-1", "TPU v5 lite"), ("v6e-1", "TPU v6 lite")]
)
def test_single_chip_cloud_tpus_are_built(target, kind):
    mesh = eqshard.create_mesh((1,), ("dp",), target=target)
    assert [d.device_kind for d in mesh.devices.flat] == [kind]


def test_a_hybrid_mesh_reads_a_gpu_name_in_any_case():
    # Upper case is still a GPU name: its two hosts are the DCN units.
    mesh = eqshard.create_hybrid_mesh((1, 8), (2, 1), ("dp", "tp"), target="H100:2x8")
    assert mesh.devices.flat[0].device_kind == "NVIDIA H100 80GB HBM3"
    assert [{d.process_index for d in row} for row in mesh.devices] == [{0}, {1}]


def test_sizes_must_use_every_device_of_the_target():
    with pytest.raises(ValueError, match=r"multiply to 4, fewer than the 8 devices"):
        eqshard.create_mesh((2, 2), ("dp", "tp"), target="h100")
    with pytest.raises(ValueError, match=r"num_slices=2 is for a target's slices"):
        eqshard.create_mesh((8,), ("dp",), num_slices=2)


# The process's environment: the GPU route needs JAX_PLATFORMS=cpu from the start;
# libtpu is loaded by several processes at once.

_GPU_SCRIPT = textwrap.dedent(
    """
    import jax
    jax.devices()  # JAX starts here
    import eqshard
    try:
        mesh = eqshard.create_mesh((8,), ("dp",), target="h100")
    except ValueError as error:
        print("ERROR", error)
    else:
        print("OK", mesh.devices.size)
    """
)


def _python(code: str, **env: str) -> subprocess.Popen:
    environment = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env={**environment, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # the plugins' start-up lines
        text=True,
    )


@pytest.mark.slow
def test_gpu_target_needs_jax_platforms_set_before_jax_starts():
    late, early = _python(_GPU_SCRIPT), _python(_GPU_SCRIPT, JAX_PLATFORMS="cpu")
    late_out, _ = late.communicate(timeout=RUN_TIMEOUT)
    early_out, _ = early.communicate(timeout=RUN_TIMEOUT)
    assert early_out.strip() == "OK 8"
    assert late_out.startswith("ERROR eqshard.create_mesh: target='h100': ")
    assert "Set JAX_PLATFORMS=cpu" in late_out


_TPU_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import eqshard
    mesh = eqshard.create_mesh((8,), ("dp",), target="v5e:2x4")
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P()))
    print("OK", eqshard.analyze_step(lambda x: x @ x, x).memory.platform)
    """
)


@pytest.mark.slow
def test_two_processes_compile_for_tpus_at_once():
    runs = [_python(_TPU_SCRIPT, JAX_PLATFORMS="cpu") for _ in range(2)]
    outputs = [run.communicate(timeout=RUN_TIMEOUT)[0] for run in runs]
    assert [out.strip() for out in outputs] == ["OK tpu", "OK tpu"]


# The command.

_STEP_FILE = os.path.join(os.path.dirname(__file__), "target_step.py")


def _command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eqshard", *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )


@pytest.mark.slow
def test_command_plans_for_a_pod_it_does_not_have():
    result = _command("--target", "v5p-1024", "--mesh", "fsdp:64,tp:8", "--size", "70B")
    assert result.returncode == 0, result.stderr[-2000:]
    first = result.stdout.splitlines()[0]
    assert first.endswith(
        "for --target v5p-1024: 512 TPU v5 (compile-only), mesh {'fsdp': 64, 'tp': 8}"
    )
    assert "the bar's end is the budget 95.7 GiB" in result.stdout
    step = _command(
        "--target", "v5e-8", "--mesh", "dp:2,tp:4", "--step",
        f"{_STEP_FILE}:train_step", "--args", f"{_STEP_FILE}:example_args",
    )  # fmt: skip
    assert step.returncode == 0, step.stderr[-2000:]
    assert "XLA's peak_memory_in_bytes on tpu" in step.stdout
    assert "device memory 15.8 GiB: fits" in step.stdout
    refused = _command("--target", "h100", "--size", "1B", "--devices", "4")
    assert refused.returncode == 2
    assert "--target h100 brings its own: leave --devices out" in refused.stderr


def test_a_step_the_tpu_compiler_refuses_is_eqshards_error():
    mesh = eqshard.create_mesh((8,), ("dp",), target="v5e:2x4")
    big = jax.ShapeDtypeStruct(
        (1 << 16, 1 << 16), jnp.float32, sharding=NamedSharding(mesh, P())
    )  # 16 GiB on every chip, twice (argument and result): more than its HBM
    with pytest.raises(ValueError, match=r"eqshard.analyze_step: the compiler refused"):
        eqshard.analyze_step(lambda w: w * 2, big)


def test_the_tools_that_take_abstract_trees_work_on_a_target_mesh():
    mesh = eqshard.create_mesh((2, 4), ("dp", "tp"), target="h100")
    shapes = {"w1": jax.ShapeDtypeStruct((256, 512), jnp.float32),
              "w2": jax.ShapeDtypeStruct((512, 256), jnp.float32)}  # fmt: skip
    specs = {"w1": P(None, "tp"), "w2": P("tp", None)}
    params = eqshard.abstract(shapes, specs, mesh)
    assert eqshard.check_layout(params, specs, mesh).ok
    plan = eqshard.plan_training(params, specs, mesh, device_memory="1GiB")
    assert plan.bytes_per_device[0] == (256 * 512 + 512 * 256) * 4 // 4 * 2
    x = jax.ShapeDtypeStruct(
        (64, 256), jnp.float32, sharding=NamedSharding(mesh, P("dp"))
    )

    def step(p, x):
        grads = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"]))(p)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)

    search = eqshard.search_layout(
        step, shapes, x, mesh=mesh,  # device_memory: the target's
        candidates={"tp": [("w1", P(None, "tp")), ("w2", P("tp", None))],
                    "fsdp": [("w1", P("dp", None)), ("w2", P(None, "dp"))],
                    "replicated": [(".*", P())]},
        builtin=False, progress=False,
    )  # fmt: skip
    assert len(search.candidates) == 3
    assert search.device_memory == int(84942979072 * 0.75)
    seconds = []
    for candidate in search.candidates:  # ranked by a step's seconds
        assert candidate.report.memory.platform == "gpu" and candidate.fits
        rows = candidate.report.collectives
        assert candidate.cost == sum(r.link_bytes * r.count for r in rows)
        hidden = [r for r in rows if r.overlapped is True]
        assert candidate.exposed_cost == candidate.cost - sum(
            r.link_bytes * r.count for r in hidden
        )
        time = candidate.report.time
        assert time is not None and candidate.step_s == time.step_s
        seconds.append(time.step_s)
    assert seconds == sorted(seconds)
    assert search.best is search.candidates[0]
    assert "ranked by a step's estimated seconds" in str(search)
    with pytest.raises(ValueError, match="`bandwidth` is refused on a target"):
        eqshard.search_layout(
            step, shapes, x, mesh=mesh, bandwidth={"dp": 0.5}, progress=False
        )


def test_arguments_on_a_target_mesh_and_this_machines_are_named():
    # Both meshes number their devices 0-7: only the platform tells them apart.
    target = eqshard.create_mesh((2, 4), ("dp", "tp"), target="v5e:2x4")
    cpu = eqshard.create_mesh((2, 4), ("dp", "tp"))
    w = eqshard.abstract(jnp.ones((8, 8)), P("dp"), target)
    x = eqshard.shard(np.ones((8, 8), np.float32), P("dp"), cpu)
    with pytest.raises(ValueError) as raised:
        eqshard.analyze_step(lambda p, x: p["w"] @ x, {"w": w}, x)
    message = str(raised.value)
    assert "eqshard.analyze_step: the arguments are on 2 different sets" in message
    assert "'p/w': on the mesh {'dp': 2, 'tp': 4} of 8 TPU v5 lite, compile-only" in (
        message
    )
    assert "'x': on the mesh {'dp': 2, 'tp': 4} of 8 cpu devices" in message


@pytest.mark.slow
def test_every_eager_call_on_a_target_mesh_is_the_compile_only_error(tmp_path):
    mesh = eqshard.create_mesh((2, 4), ("dp", "tp"), target="v5e:2x4")
    cpu = eqshard.create_mesh((2, 4), ("dp", "tp"))
    tree = {"w": np.ones((8, 8), np.float32)}
    eqshard.save(tmp_path / "ck", eqshard.shard(tree, P("dp"), cpu))
    eqshard.save_safetensors(tmp_path / "w.safetensors", tree)
    x = np.ones((8, 8), np.float32)
    stack = {"w": np.ones((4, 8, 8), np.float32)}
    layer = lambda w, h: h @ w["w"]
    calls = {
        "restore": lambda: eqshard.restore(tmp_path / "ck", tree, P("dp"), mesh),
        "load_safetensors": lambda: eqshard.load_safetensors(
            tmp_path / "w.safetensors", tree, P("dp"), mesh
        ),
        "with_sharding_constraint": lambda: eqshard.with_sharding_constraint(
            x, P("dp"), mesh=mesh
        ),
        "filter_shard_map": lambda: eqshard.filter_shard_map(
            lambda x: x * 2, in_specs=P("dp"), out_specs=P("dp"), mesh=mesh
        )(x),
        "pipeline": lambda: eqshard.pipeline(
            layer, stack, x, mesh=mesh, axis="dp", microbatches=2
        ),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"eqshard.{name}: .*compile-only dev"):
            call()
    with pytest.raises(ValueError, match=r"mesh=AbstractMesh .* only traces"):
        eqshard.pipeline(
            layer, stack, x, mesh=mesh.abstract_mesh, axis="dp", microbatches=2
        )
    # Traced for a compile, the same calls are what a target is for.
    traced = jax.jit(
        lambda s, h: eqshard.pipeline(
            layer, s, h, mesh=mesh.abstract_mesh, axis="dp", microbatches=2
        )
    )
    args = [eqshard.abstract(a, P(), mesh) for a in (stack, x)]
    assert traced.lower(*args).compile() is not None


_LIBTPU_LINES = ("unexpected worker hostname", "could not determine TPU")


@pytest.mark.slow
def test_libtpu_start_up_lines_show_only_when_the_target_fails():
    # libtpu writes them to file descriptor 2 the first time it is used.
    code = textwrap.dedent(
        """
        import sys
        import eqshard
        print("eqshard's first line", file=sys.stderr, flush=True)
        try:
            mesh = eqshard.create_mesh((-1,), ("dp",), target=sys.argv[1])
        except ValueError as error:
            print("ERROR", error)
        else:
            print("OK", mesh.devices.size)
        """
    )
    runs = {
        target: subprocess.Popen(
            [sys.executable, "-c", code, target],
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for target in ("v5e:2x4", "v5e:3x3")
    }
    (ok, ok_err), (failed, failed_err) = [p.communicate() for p in runs.values()]
    assert ok == "OK 8\n"
    assert not any(line in ok_err for line in _LIBTPU_LINES)
    assert failed.startswith("ERROR eqshard.create_mesh: target='v5e:3x3'")
    after = failed_err.split("eqshard's first line", 1)[1]
    assert all(line in after for line in _LIBTPU_LINES)


def _xla_host_bytes(mesh, shapes, specs):
    """XLA's host argument bytes per device of `shapes` kept in host memory."""
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s, memory_kind="pinned_host"),
        specs,
        is_leaf=lambda s: isinstance(s, P),
    )
    args = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        shapes,
        shardings,
    )
    compiled = jax.jit(lambda t: t, out_shardings=shardings).lower(args).compile()
    stats = compiled.memory_analysis()
    assert stats is not None
    return stats.host_argument_size_in_bytes


def test_a_tpu_plan_counts_the_bytes_of_the_tiles_xla_lays_out():
    mesh = eqshard.create_mesh((4,), ("dp",), target="v5e:2x2")
    f32, bf16 = jnp.float32, jnp.bfloat16
    cases = [
        # (64, 32) float32 blocks are laid out as (64, 128): twice their bytes.
        ({"w": jax.ShapeDtypeStruct((64, 128), f32)}, {"w": P(None, "dp")}),
        (
            {
                "a": jax.ShapeDtypeStruct((17, 33, 20), f32),
                "b": jax.ShapeDtypeStruct((3, 200), bf16),
                "c": jax.ShapeDtypeStruct((1000,), jnp.int8),
                "d": jax.ShapeDtypeStruct((9, 520), bf16),
            },
            {"a": P(None, None, "dp"), "b": P(), "c": P(), "d": P(None, "dp")},
        ),
    ]
    for shapes, specs in cases:
        host_specs = jax.tree.map(
            eqshard.host, specs, is_leaf=lambda s: isinstance(s, P)
        )
        plan = eqshard.plan_training(shapes, host_specs, mesh, gradients=False)
        xla = _xla_host_bytes(mesh, shapes, specs)
        assert set(plan.host_bytes_per_device) == {xla}
    logical = 64 * 128 * 4 // 4
    assert _xla_host_bytes(mesh, *cases[0]) == 2 * logical
