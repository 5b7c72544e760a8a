"""What the step-time estimate costs: CPU time (user + sys, `resource.getrusage`)
of `eqshard.analyze_step` (which reads the compiled program and estimates
`StepReport.time`) and of `python -m eqshard --size 70B --target v5p-1024
--batch 256 --seq 4096`, each against the compile alone of the same step.

- **analyze_step against the compile alone**: `bench_targets.py`'s 50 B,
  80-layer scan step (`models.scan_step`, bf16, FSDP x TP by `scan_rules()`)
  on `v5p-1024` (mesh fsdp:64 x tp:8); with `--h100`, on `h100:8x8`
  (fsdp:8 x tp:8) alone, written to `results/bench_estimate_cpu_h100.json`.
  CPU time of the call alone, in a fresh process each run. Target (issue
  43): at most 1.2x, medians.
- **the command against the compile alone**: the whole process's CPU time of
  the command, against a process that builds the command's step from public
  APIs (its built-in model written again: `models.command_step`, on the mesh
  the command chooses for `--batch 256`) and compiles it with
  `jax.jit(...).lower(...).compile()`. The model and mesh the command prints
  are checked against that step's, so the same step is compared. Target: at
  most 1.3x, medians.

Runs are fresh processes, interleaved (`--runs` rounds of every variant in
turn), so JAX's and eqshard's caches start cold and load from other
processes hits every variant alike. All figures are deviceless compiles on
this machine's CPU cores (a loaded 2-core machine when recorded). Run with
`python benchmarks/bench_estimate_cpu.py [--runs 2] [--h100]` (minutes per
run, mostly the TPU compiler).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys


os.environ.setdefault("JAX_PLATFORMS", "cpu")

from _timing import add_json_option, as_table, RESULTS, write_json
from models import CommandShape


TARGETS = {"v5p-1024": "fsdp:64,tp:8", "h100:8x8": "fsdp:8,tp:8"}
COMMAND = ["--size", "70B", "--target", "v5p-1024", "--batch", "256", "--seq", "4096"]
# The model and mesh the command builds for `COMMAND` (it prints them; checked).
COMMAND_SHAPE = CommandShape(vocab=32768, dim=8192, layers=86)
COMMAND_MESH = "fsdp:256,tp:2"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _child_step(mode: str, target: str) -> float:
    """CPU seconds of `analyze_step` or of the compile alone, in this process."""
    import jax
    from bench_targets import _abstract_step
    from models import scan_step

    import eqshard

    params, tokens = _abstract_step(target, TARGETS[target])
    step = jax.jit(scan_step, donate_argnums=0)
    start = _cpu()
    if mode == "analyze":
        report = eqshard.analyze_step(step, params, tokens)
        if report.time is None:
            raise SystemExit(f"no time estimate on {target}: {report.time_note}")
    else:
        step.lower(params, tokens).compile()
    return _cpu() - start


def _child_command_compile() -> str:
    """The command's step, compiled alone (the whole process is timed); what
    the command would print of its model and mesh."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from models import command_state, command_step

    import eqshard

    shape = COMMAND_SHAPE
    mesh = eqshard.create_mesh(COMMAND_MESH, target="v5p-1024")
    params, state = command_state(shape, mesh)
    sharding = NamedSharding(mesh, P("fsdp"))
    tokens = jax.ShapeDtypeStruct((256, 4097), jnp.int32, sharding=sharding)
    command_step(shape, mesh).lower(params, state, tokens).compile()
    return _described(shape, str(dict(mesh.shape)))


def _described(shape: CommandShape, mesh: str) -> str:
    """The command's lines naming its mesh and model, as it prints them."""
    return (
        f"mesh for --batch 256: {mesh}\n({shape.layers} layers scanned and "
        f"rematerialised, width {shape.dim}, {shape.heads} heads, MLP "
        f"{shape.hidden}, vocabulary {shape.vocab})"
    )


def _check_same_step(printed: str, described: str) -> None:
    """Stops unless the command printed the model and mesh `described` (else the
    command's model changed: update `COMMAND_SHAPE` and `models.command_step`)."""
    mesh, model = described.split("\n")
    if mesh not in printed or model not in printed:
        raise SystemExit(
            f"the command's step is no longer the one compiled alone: it printed\n"
            f"{printed[:2000]}\nexpected {described!r}; update COMMAND_SHAPE, "
            "COMMAND_MESH and models.command_step"
        )


def _process(argv: list[str]) -> tuple[float, float | None, str]:
    """(whole process CPU seconds, the CPU seconds it printed, if any, and what
    it printed)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(argv, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode not in (0, 1):  # the command exits 1 when it does not fit
        raise SystemExit(f"{argv} failed:\n{out.stderr[-3000:]}")
    total = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = out.stdout.strip().splitlines()
    printed = (
        json.loads(lines[-1]).get("cpu") if lines and lines[-1][:1] == "{" else None
    )
    return total, printed, out.stdout


def _row(case: str, ours: list[float], theirs: list[float], target: str) -> tuple:
    mine, hand = statistics.median(ours), statistics.median(theirs)
    return (
        case,
        f"{min(ours):.1f} / {mine:.1f}",
        f"{min(theirs):.1f} / {hand:.1f}",
        f"{mine / hand:.2f}",
        target,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument(
        "--h100", action="store_true", help="time analyze_step on h100:8x8 alone"
    )
    parser.add_argument(
        "--machine", help="what ran it, for the results (e.g. how loaded it was)"
    )
    parser.add_argument(
        "--child", nargs=2, metavar=("MODE", "TARGET"), help=argparse.SUPPRESS
    )
    add_json_option(parser)
    args = parser.parse_args()
    if args.child is not None:
        mode, target = args.child
        if mode == "command-compile":
            print(json.dumps({"described": _child_command_compile()}))
        else:
            print(json.dumps({"cpu": _child_step(mode, target)}))
        return 0
    me = [sys.executable, os.path.abspath(__file__), "--child"]
    targets = ["h100:8x8"] if args.h100 else ["v5p-1024"]
    variants = {}
    for target in targets:
        variants[f"{target} analyze"] = me + ["analyze", target]
        variants[f"{target} compile"] = me + ["compile", target]
    if not args.h100:
        variants["command"] = [sys.executable, "-m", "eqshard", *COMMAND]
        variants["command compile"] = me + ["command-compile", "-"]
    times: dict[str, list[float]] = {name: [] for name in variants}
    outputs: dict[str, str] = {}
    for round_ in range(args.runs):
        for name, argv in variants.items():
            total, printed, outputs[name] = _process(argv)
            seconds = printed if printed is not None else total
            times[name].append(seconds)
            print(f"run {round_ + 1} {name}: {seconds:.1f} s CPU", flush=True)
    if not args.h100:
        described = json.loads(outputs["command compile"].splitlines()[-1])
        _check_same_step(outputs["command"], described["described"])
    rows = [
        _row(
            f"{t} analyze_step with time, 80 layers",
            times[f"{t} analyze"],
            times[f"{t} compile"],
            "1.2",
        )
        for t in targets
    ]
    if not args.h100:
        rows.append(
            _row(
                "python -m eqshard " + " ".join(COMMAND),
                times["command"],
                times["command compile"],
                "1.3",
            )
        )
    columns = ("case", "eqshard min / median", "compile alone min / median",
               "x median", "target")  # fmt: skip
    for row in [columns, *rows]:
        print(" | ".join(row))
    table = as_table(columns, rows, unit="s")
    kind = args.machine or f"deviceless compiles on {os.cpu_count()} CPU cores"
    path = args.json
    if path is None and args.h100:
        path = RESULTS / "bench_estimate_cpu_h100.json"
    write_json(__file__, {"cpu": table}, path=path, machine=kind)
    return 0


if __name__ == "__main__":
    sys.exit(main())
