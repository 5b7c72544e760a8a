"""Checks eqshard's deviceless GPU route against a real NVIDIA GPU, and times
eqshard's data movement on it. Run on a machine with an NVIDIA GPU and JAX's
CUDA build: `python benchmarks/gpu_check.py`. Without a GPU it says so and
exits 0.

1. **Deviceless against the device.** A small scan-stacked decoder step
   (`benchmarks/models.py`'s `scan_step`, bf16, one GPU) is compiled three
   ways: on the GPU; deviceless, for the target config the real GPU reports (as
   JAX's own `test_cross_compile_with_real_gpu` takes it); and deviceless, for
   eqshard's shipped spec of that GPU (`create_mesh(target=...)`). It prints
   each one's collective rows and memory, whether the rows are equal, and the
   temporaries' difference (target: within 5 %). The same step is compiled for
   8 GPUs deviceless from both configs, whose rows must be equal too.
2. **The compiled peak against the device's.** The step runs once on the GPU;
   `report.memory.peak_bytes` is compared with the device's
   `memory_stats()["peak_bytes_in_use"]`.
3. **The estimate against the device's time.** `report.time.step_s` of the
   same 1-GPU step, compiled deviceless for eqshard's spec of the GPU (and on
   the device itself), against the median of `--runs` timed steps on the GPU
   (after two warm-up steps); the closing note gives the ratio estimate /
   measured (the bar: between 0.95 and 2).
4. **Data movement on the GPU.** `shard`, `gather`, `init_sharded` and
   `restore` against the hand-written route (`jax.device_put`,
   `jax.device_get`, `jax.jit(..., out_shardings=...)`, orbax's
   `StandardCheckpointer` with a target built by hand), interleaved, `--runs`
   times, min and median.

Figures are from a real device; the results JSON records which.
"""

import argparse
import os
import shutil
import sys
import tempfile
import traceback


def _rows(report) -> list[tuple[str, int, int]]:
    return [(row.kind, row.bytes, row.count) for row in report.collectives]


def _print_report(name: str, report) -> None:
    m = report.memory
    print(
        f"{name}: arguments {m.argument_bytes}, outputs {m.output_bytes}, "
        f"temporaries {m.temp_bytes}, aliased {m.alias_bytes}, peak "
        f"{m.peak_bytes} (XLA {m.xla_peak_bytes}); {len(report.collectives)} "
        f"collective rows"
    )
    for row in _rows(report):
        print(f"    {row}")


def _shipped(kind: str) -> str | None:
    """eqshard's target name for the GPU of `device_kind` `kind`, if any."""
    import eqshard

    for name in ("h100", "h200", "a100-40g", "a100-80g", "b200"):
        one = eqshard.create_mesh((1,), ("x",), target=f"{name}:1x1")
        if one.devices.flat[0].device_kind == kind:
            return name
    return None


def _random_inputs(config, shardings):
    """The scanned model's parameters, drawn on the device in `shardings`, and a
    batch of token ids."""
    import jax
    from models import scan_params, scan_tokens

    params = jax.jit(
        lambda key: jax.tree.map(
            lambda s: (0.02 * jax.random.normal(key, s.shape)).astype(s.dtype),
            scan_params(config),
        ),
        out_shardings=shardings,
    )(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), scan_tokens(config).shape, 0, 100)
    return params, tokens


def estimate_check(config, runs: int) -> list[tuple[str, str]]:
    """Part 3: the estimated seconds of a 1-GPU step against its median time
    on the GPU; returns (what, finding) rows."""
    import statistics
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from models import scan_params, scan_rules, scan_step, scan_tokens

    import eqshard

    specs = eqshard.match_partition_rules(scan_rules(), scan_params(config))
    step = jax.jit(scan_step, donate_argnums=0)

    def report(mesh):
        params = eqshard.abstract(scan_params(config), specs, mesh)
        tokens = jax.ShapeDtypeStruct(
            scan_tokens(config).shape, jnp.int32, sharding=NamedSharding(mesh, P())
        )
        return eqshard.analyze_step(step, params, tokens)

    device_mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    estimates = {"on the device": report(device_mesh)}
    shipped = _shipped(jax.devices()[0].device_kind)
    if shipped is not None:
        target = eqshard.create_mesh((1, 1), ("fsdp", "tp"), target=f"{shipped}:1x1")
        estimates[f"deviceless ({shipped!r} spec)"] = report(target)
    placed = eqshard.abstract(scan_params(config), specs, device_mesh)
    shardings = jax.tree.map(lambda s: s.sharding, placed)
    params, tokens = _random_inputs(config, shardings)
    times = []
    for i in range(runs + 2):
        start = time.perf_counter()
        params, loss = step(params, tokens)
        jax.block_until_ready((params, loss))
        if i >= 2:  # two warm-up steps (the first compiles)
            times.append(time.perf_counter() - start)
    measured = statistics.median(times)
    findings = [("measured step (median, s)", f"{measured:.4g}")]
    for name, found in estimates.items():
        if found.time is None:
            findings.append((f"estimate {name}", f"none: {found.time_note}"))
            continue
        print(f"estimate {name}: {found.time.summary()}")
        findings.append((f"estimate {name} (s)", f"{found.time.step_s:.4g}"))
        findings.append(
            (f"estimate {name} / measured", f"{found.time.step_s / measured:.2f}")
        )
    return findings


def compare(config, runs: int) -> list[tuple[str, str]]:
    """Part 1 and 2: returns (what, finding) rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from models import scan_params, scan_rules, scan_step, scan_tokens

    import eqshard

    kind = jax.devices()[0].device_kind
    shipped = _shipped(kind)  # eqshard's name for this GPU, if it ships its spec
    # The real GPU's own target config: what JAX's deviceless test uses.
    from jax._src.lib import xla_client

    real_config = xla_client.get_topology_for_devices(jax.devices()).target_config
    specs = eqshard.match_partition_rules(scan_rules(), scan_params(config))

    def abstract(mesh):
        params = eqshard.abstract(scan_params(config), specs, mesh)
        tokens = jax.ShapeDtypeStruct(
            scan_tokens(config).shape, jnp.int32, sharding=NamedSharding(mesh, P())
        )
        return params, tokens

    def deviceless(topology: str, text: str):
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=text, topology=topology
        )
        n = len(topo.devices)
        grid = np.array(topo.devices, dtype=object).reshape(n, 1)
        return Mesh(grid, ("fsdp", "tp"))

    def analyze(mesh):
        return eqshard.analyze_step(
            jax.jit(scan_step, donate_argnums=0), *abstract(mesh)
        )

    findings = []
    device_mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    on_device = analyze(device_mesh)
    real = analyze(deviceless("1x1x1", real_config))
    _print_report(f"on the device ({kind})", on_device)
    _print_report("deviceless, the device's config", real)
    reports = {"deviceless (device's config)": real}
    if shipped is not None:
        ours = analyze(
            eqshard.create_mesh((1, 1), ("fsdp", "tp"), target=f"{shipped}:1x1")
        )
        _print_report(f"deviceless, eqshard's {shipped!r} spec", ours)
        reports[f"deviceless ({shipped!r} spec)"] = ours
    for name, report in reports.items():
        same = _rows(report) == _rows(on_device)
        temp = report.memory.temp_bytes / max(on_device.memory.temp_bytes, 1) - 1
        findings.append((f"{name}: rows equal to the device's", str(same)))
        findings.append((f"{name}: temporaries vs the device's", f"{temp:+.1%}"))
        findings.append((f"{name}: peak", f"{report.memory.peak_bytes}"))
    if shipped is not None:
        eight_real = analyze(deviceless("1x1x8", real_config))
        eight_ours = analyze(
            eqshard.create_mesh((8, 1), ("fsdp", "tp"), target=shipped)
        )
        _print_report("8 GPUs deviceless, the device's config", eight_real)
        _print_report(f"8 GPUs deviceless, eqshard's {shipped!r} spec", eight_ours)
        findings.append(
            ("8 GPUs: rows equal, device's config vs spec",
             str(_rows(eight_real) == _rows(eight_ours)))
        )  # fmt: skip

    # Part 2: run the step once; the device's peak against the compiled one.
    device = jax.devices()[0]
    before = device.memory_stats() or {}
    shardings = jax.tree.map(lambda s: s.sharding, abstract(device_mesh)[0])
    params, tokens = _random_inputs(config, shardings)
    jax.block_until_ready(params)
    step = jax.jit(scan_step, donate_argnums=0)
    jax.block_until_ready(step(params, tokens))
    after = device.memory_stats() or {}
    peak = after.get("peak_bytes_in_use")
    print(f"memory_stats before: {before.get('peak_bytes_in_use')}, after: {peak}")
    findings.append(("compiled peak (on the device)", str(on_device.memory.peak_bytes)))
    findings.append(("device peak_bytes_in_use after one step", str(peak)))
    if peak:
        ratio = on_device.memory.peak_bytes / peak
        findings.append(("compiled peak / device peak", f"{ratio:.3f}"))
    return findings


def movement(runs: int) -> list:
    """Part 4: (case, eqshard Times, hand-written Times) rows."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from _timing import interleaved
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import eqshard

    mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
    rng = np.random.default_rng(0)
    host = {
        f"w{i:02d}": rng.standard_normal((1024, 4096), np.float32) for i in range(16)
    }
    specs = {k: P() for k in host}
    shardings = {k: NamedSharding(mesh, P()) for k in host}
    rows = []
    times = interleaved(
        {
            "eqshard": lambda: eqshard.shard(host, specs, mesh),
            "hand": lambda: jax.device_put(host, shardings),
        },
        runs,
    )
    rows.append(("shard 256 MiB (16 leaves)", times["eqshard"], times["hand"]))
    # Fresh arrays for every call: JAX keeps an array's host copy once made, so
    # a second `device_get` of the same array copies nothing.
    times = interleaved(
        {
            "eqshard": lambda placed: eqshard.gather(placed),
            "hand": lambda placed: jax.tree.map(np.array, jax.device_get(placed)),
        },
        runs,
        setup=lambda: jax.block_until_ready(jax.device_put(host, shardings)),
    )
    placed = jax.device_put(host, shardings)
    rows.append(("gather 256 MiB (16 leaves)", times["eqshard"], times["hand"]))

    def make(key):
        keys = jax.random.split(key, len(host))
        return {k: jax.random.normal(s, (1024, 4096)) for k, s in zip(host, keys)}

    key = jax.random.key(0)
    by_hand = jax.jit(make, out_shardings=shardings)
    times = interleaved(
        {
            "eqshard": lambda: eqshard.init_sharded(make, key, specs=specs, mesh=mesh),
            "hand": lambda: by_hand(key),
        },
        runs,
    )
    rows.append(("init_sharded 256 MiB (16 leaves)", times["eqshard"], times["hand"]))
    work = tempfile.mkdtemp()
    try:
        path = os.path.join(work, "ckpt")
        eqshard.save(path, placed)
        like = eqshard.abstract(host)
        target = {
            k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[k])
            for k, x in host.items()
        }

        def by_orbax():
            checkpointer = ocp.StandardCheckpointer()
            try:
                return checkpointer.restore(path, target)
            finally:
                checkpointer.close()

        times = interleaved(
            {
                "eqshard": lambda: eqshard.restore(path, like, specs, mesh),
                "hand": by_orbax,
            },  # fmt: skip
            runs,
        )
        rows.append(("restore 256 MiB (16 leaves)", times["eqshard"], times["hand"]))
    finally:
        shutil.rmtree(work)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="where to write the results")
    args = parser.parse_args()
    import jax

    if not any(d.platform == "gpu" for d in jax.devices()):
        print(f"no NVIDIA GPU here (JAX's backend is {jax.default_backend()}): "
              "nothing to check.")  # fmt: skip
        return 0
    from _timing import as_table, table, write_json
    from models import ScanConfig

    config = ScanConfig(vocab=8192, dim=1024, hidden=4096, layers=8, batch=8, seq=512)
    tables = {}
    # Each part on its own: a failure is printed and the other parts still run.
    try:
        findings = compare(config, args.runs)
    except Exception:  # noqa: BLE001 (report it, go on)
        traceback.print_exc()
    else:
        for what, finding in findings:
            print(f"{what}: {finding}")
        tables["compare"] = as_table(("check", "finding"), findings)
    try:
        findings = estimate_check(config, args.runs)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    else:
        for what, finding in findings:
            print(f"{what}: {finding}")
        tables["estimate"] = as_table(("check", "finding"), findings)
    try:
        tables["movement"] = table(movement(args.runs), unit="ms")
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    machine = f"1 {jax.devices()[0].device_kind}, JAX {jax.__version__} (a real device)"
    write_json(__file__, tables, path=args.json, machine=machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
