# `python -m eqshard`, run as users run it: in a subprocess. The default run is the
# slow one (it compiles a training step), so it runs once for several tests. The
# bad options, each a message and status 2 before anything is planned, run what
# the child would, `sys.exit(main(args))`, in this process (`_run_here`), and
# so do the plans (`--plan-only`, `--model`, `--step`) on the command's default
# 8 devices: a child costs two seconds of starting JAX, and the runs left in a
# subprocess show the command's own devices and exit status reaching the shell.
# Expected sizes are worked out by hand from the demo model (dim 64, vocab 256,
# MLP width 256, float32) and the mesh.

import math
import pathlib
import re
import subprocess
import sys
import tomllib
import types

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from probes import RUN_TIMEOUT

import eqshard
from eqshard._readers._inspect import format_bytes


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eqshard", *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )


def _run_here(capfd, *args: str) -> subprocess.CompletedProcess:
    """`python -m eqshard ARGS` in this process: what `eqshard/__main__.py` runs,
    `sys.exit(main(ARGS))`, its status and its output by file descriptor (as
    a child's pipes would take it)."""
    from eqshard._cli._main import main

    capfd.readouterr()
    try:
        status = main(list(args))
    except SystemExit as exit:  # argparse's errors
        assert isinstance(exit.code, int), exit.code
        status = exit.code
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(
        ["python", "-m", "eqshard", *args], status, out, err
    )


def _row(stdout: str, path: str) -> str:
    """The plan table's line for the array at `path`."""
    (line,) = [line for line in stdout.splitlines() if line.startswith(path + " ")]
    return line


def _total_parameters(stdout: str) -> int:
    match = re.search(r"^total: \d+ arrays, ([\d,]+) parameters", stdout, re.M)
    assert match is not None, stdout
    return int(match[1].replace(",", ""))


# What JAX's CUDA plugin and libtpu log on a machine without their chips (the
# `gpu` and `tpu` extras): absl's log lines, never eqshard's.
_PLUGIN_LINE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are "
    r"written to STDERR|[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\] .*)$"
)


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [
        line
        for line in result.stderr.strip().splitlines()
        if not _PLUGIN_LINE.match(line)
    ]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("python -m eqshard: error: ")
    return lines[0]


@pytest.fixture(scope="module")
def default_run() -> subprocess.CompletedProcess:
    return _run()


@pytest.mark.slow
def test_default_run_prints_the_plan(default_run):
    out = default_run.stdout
    assert default_run.returncode == 0, default_run.stderr
    assert "on 8 virtual CPU devices, mesh {'dp': 2, 'tp': 4}" in out
    # The 2 blocks' arrays share rows, sizes per array.
    header = (
        r"^path \(xN: N arrays alike\) +shape +dtype +spec +size each +per device each$"
    )
    assert re.search(header, out, re.M)
    # q projection (64, 64) float32: 16 KiB, split 4 ways over tp.
    q = _row(out, "blocks/*/attn/q/weight")
    assert q.split()[1] == "x2"
    assert str(P("tp")) in q and re.search(r"16\.0 KiB +4\.0 KiB$", q)
    # LayerNorm weights are replicated: 64 float32 on every device.
    assert re.search(r"P\(\) +256 B +256 B +replicated$", _row(out, "norm/weight"))
    # embed + head 2 * 256 * 64, per block 12 * 64^2 + 13 * 64, final norm 2 * 64.
    assert _total_parameters(out) == 2 * 256 * 64 + 2 * (12 * 64**2 + 13 * 64) + 128


@pytest.mark.slow
def test_default_run_lives_the_readmes_life_and_summarises(default_run):
    out, err = default_run.stdout, default_run.stderr
    assert default_run.returncode == 0, err
    assert "Traceback" not in err
    # The progress bar: one line per step when stderr is not a terminal.
    steps = re.findall(r"^train \[[#.]{24}\] (\d)/5  loss ([\d.]+)", err, re.M)
    assert [int(step) for step, _ in steps] == [1, 2, 3, 4, 5]
    losses = [float(loss) for _, loss in steps]
    assert losses[-1] < losses[0]
    # The model's 36 arrays and a momentum for each: init_sharded, filter_jit,
    # check_layout, save, restore onto the mesh with its sizes swapped.
    assert re.search(
        r"^built sharded with eqshard.init_sharded: 72 arrays \(model and momentum\) "
        r"in \d+\.\d{3} s, of which \d+\.\d{3} s compiling$",
        out,
        re.M,
    )
    assert re.search(r"^trained: 5 steps of eqshard.filter_jit ", out, re.M)
    assert "checked with eqshard.check_layout: all 72 arrays as asked" in out
    assert "eqshard.restore onto mesh {'dp': 4, 'tp': 2}" in out
    assert re.search(r"^verified: all 72 arrays bit-exact after the restore", out, re.M)
    summary = out[out.index("\nsummary\n") :]
    for phase in ("build model", "train (5 steps)", "check layout", "save", "restore"):
        assert re.search(rf"^  {re.escape(phase)} +\d+\.\d{{3}} s", summary, re.M)
    # Compile time is said to be compile time.
    assert re.search(r"^  build model .*compiling the constructor \d", summary, re.M)
    assert re.search(r"^  train \(5 steps\) .*\(compiling\)", summary, re.M)
    assert re.search(r"^  total +\d+\.\d{3} s", summary, re.M)


@pytest.mark.slow
def test_default_run_reports_its_training_step(default_run):
    out = default_run.stdout
    report = out[out.index("the training step, compiled (eqshard.analyze_step):") :]
    assert report.splitlines()[1] == "step 'train_step' on mesh {'dp': 2, 'tp': 4}"
    found = re.search(
        r"^collectives: (\d+) instructions, \d+ runs, .*; ([\d.]+)% of the bytes "
        r"belong to a leaf$",
        report,
        re.M,
    )
    assert found is not None and float(found[2]) >= 90
    # The 8 largest collectives, each over the mesh's axes, most named by a leaf,
    # and how many more.
    rows = re.findall(
        r"^(all-reduce|all-gather|all-to-all|collective-permute) ", report, re.M
    )
    assert len(rows) == min(8, int(found[1])) > 0
    if int(found[1]) > 8:
        assert f"... and {int(found[1]) - 8} more collectives" in report
    # The momentum is listed with its parameter.
    assert "out/0/0/embed/weight (+ momentum)" in report
    assert "state/0/" in report
    assert re.search(r"^  step report +\d+\.\d{3} s", out, re.M)


@pytest.mark.parametrize(
    "mesh, shape, q_per_device, table",
    [
        ("dp:2,tp:4", "{'dp': 2, 'tp': 4}", r"4\.0 KiB", False),
        ("tp:2,dp:4", "{'tp': 2, 'dp': 4}", r"8\.0 KiB", True),
    ],
)
def test_plan_only_with_mesh(mesh, shape, q_per_device, table, capfd):
    args = ("--plan-only", "--mesh", mesh, *(["--table"] if table else []))
    result = _run_here(capfd, *args)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"mesh {shape}" in out and "eqx.filter_eval_shape" in out
    # --table lists every array; without it the 2 blocks share rows.
    for block in ("0", "1") if table else ("*",):
        q = _row(out, f"blocks/{block}/attn/q/weight")
        assert re.search(rf"16\.0 KiB +{q_per_device}$", q)  # 16 KiB over tp
    assert ("blocks/*/" in out) is not table and (" x2 " in out) is not table
    # Nothing moved: no training, no round trip.
    assert "train [" not in result.stderr and "verified" not in out


def test_size_plans_an_abstract_model(capfd):
    result = _run_here(capfd, "--size", "1B", "--plan-only")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert abs(_total_parameters(out) - 10**9) <= 0.1 * 10**9
    assert "abstract" in out and "train [" not in result.stderr
    # A row per kind of array, not per layer: `blocks/*/...  xN`, N the layers.
    found = re.search(r"^model: (\d+) blocks", out, re.M)
    assert found is not None, out
    layers = int(found[1])
    assert _row(out, "blocks/*/attn/q/weight").split()[1] == f"x{layers}"
    assert len(re.findall(rf"^blocks/\*/\S+ +x{layers} ", out, re.M)) == 16
    assert "blocks/0/" not in out.split("training memory")[0]
    assert len(out.splitlines()) < 60


def test_rules_file(tmp_path):
    rules = tmp_path / "rules.txt"
    rules.write_text(
        "# attention is split over tp, the MLP over both axes\n"
        "\n"
        "attn/(q|k|v)/weight   None,tp\n"
        "mlp/.*/weight         tp+fsdp\n"
        "embed/wieght          tp\n"  # a typo: replicates the embedding
        ".*                    ()\n"
    )
    result = _run(
        "--rules", str(rules), "--plan-only", "--devices", "4", "--mesh", "fsdp:2,tp:2"
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "over the 4 devices of mesh {'fsdp': 2, 'tp': 2}" in out
    assert str(P(None, "tp")) in _row(out, "blocks/*/attn/v/weight")
    # (256, 64) float32 = 64 KiB, split over tp and fsdp: 16 KiB per device.
    up = _row(out, "blocks/*/mlp/up/weight")
    assert str(P(("tp", "fsdp"))) in up and re.search(r"64\.0 KiB +16\.0 KiB$", up)
    assert re.search(
        r"P\(\) +64\.0 KiB +64\.0 KiB +replicated$", _row(out, "embed/weight")
    )
    assert "note: 1 of the 4 rules matched no array" in out
    assert re.search(r"^note: .*: 2 'embed/wieght'$", out, re.M)


def test_rules_file_arrow_between_regex_and_spec():
    # Parsed in this process: no need for a subprocess to read a text format.
    from eqshard._cli._load import UsageError
    from eqshard._cli._rules_file import parse_rules

    text = "attn/(q|k)/weight -> tp,fsdp\nmlp/up/bias->  tp\n.*  ()\n"
    assert parse_rules(text, "rules.txt") == [
        ("attn/(q|k)/weight", P("tp", "fsdp")),
        ("mlp/up/bias", P("tp")),
        (".*", P()),
    ]
    with pytest.raises(UsageError, match="rules.txt, line 2: expected a regex"):
        parse_rules("embed  tp\n->  tp\n", "rules.txt")


@pytest.mark.parametrize(
    "text, line",
    [
        ("# comment\nattn/q/weight   tp\nmlp/up  dp;tp\n", "line 3"),
        ("embed/weight\n.* ()\n", "line 1"),
        ("\n.* ()\nembed/(weight  tp\n", "line 3"),
    ],
)
def test_malformed_rules_file(tmp_path, text, line, capfd):
    rules = tmp_path / "rules.txt"
    rules.write_text(text)
    error = _one_line_error(_run_here(capfd, "--rules", str(rules)))
    assert f"--rules {rules}, {line}:" in error


@pytest.mark.parametrize(
    "args, match",
    [
        (("--mesh", "dp:3,tp:4"), r"--mesh 'dp:3,tp:4'.*12, more than the 8 devices"),
        (("--mesh", "dp:2,tp:x"), r"--mesh 'dp:2,tp:x'.*'x' is not an integer"),
        (("--size", "1X"), r"--size '1X' is not a parameter count"),
        (("--size", "10K"), r"--size '10K' is below"),
        (("--steps", "-1"), r"--steps -1"),
        (("--devices", "0"), r"--devices 0: give at least 1 device"),
        (("--mesh", ""), r"--mesh '': .*empty entry"),
        (("--rules", "/no/such/rules.txt"), r"/no/such/rules.txt: cannot read"),
        (("--bogus",), r"unrecognized arguments: --bogus \(see --help\)"),
    ],
)
def test_bad_options(args, match, capfd):
    result = _run_here(capfd, *args)
    assert re.search(match, _one_line_error(result))
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "text, match",
    [
        # A spec that cannot apply: the plan is printed, then one error line.
        ("embed/weight  dp,dp\n.*  ()\n", r"'embed/weight' P\('dp', 'dp'\): .*twice"),
        # Unmatched arrays: the hint for a catch-all rule.
        ("embed/weight  tp\n", r"no rule matches .*a last rule '\.\*  \(\)'"),
    ],
)
def test_rules_that_do_not_fit_the_model(tmp_path, text, match):
    rules = tmp_path / "rules.txt"
    rules.write_text(text)
    result = _run("--rules", str(rules), "--plan-only")
    assert re.search(match, _one_line_error(result))


def test_output_cut_short_by_the_reader():
    # `python -m eqshard --size 70B | head`: the plan is longer than a pipe's
    # buffer, so the command writes into a closed pipe; it stops without a traceback.
    child = subprocess.Popen(
        [sys.executable, "-m", "eqshard", "--size", "70B"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline().startswith("eqshard ")
    child.stdout.close()
    stderr = child.communicate(timeout=RUN_TIMEOUT)[1]
    assert child.returncode == 1 and "Traceback" not in stderr, stderr


# The README's promises: its test command is CI's, its example runs, and every
# public name has an entry in the API reference.

REPO = pathlib.Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_readme_commands():
    block = README.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert commands[0] == 'pip install -e ".[examples]" && python -m eqshard'
    # The extra installs what the quick example imports beyond the dependencies.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extra = " ".join(project["optional-dependencies"]["examples"])
    example = re.search(r"^```python\n(.*?)^```", README, re.M | re.S)
    assert example is not None
    assert "import optax" in example[1] and "optax" in extra
    assert "eqshard.save(" in example[1] and "orbax-checkpoint" in extra
    assert commands[1] == ci[-1]
    assert "set -euo pipefail" in ci


@pytest.mark.slow
def test_readme_example_runs(tmp_path):
    found = re.search(r"^```python\n(.*?)^```", README, re.M | re.S)
    assert found is not None
    example = found[1]
    # As run a second time: the checkpoint of an earlier run is there.
    eqshard.save(tmp_path / "ckpt" / "3", {"w": np.zeros(3, np.float32)})
    result = subprocess.run(
        [sys.executable, "-c", example],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=RUN_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(P("tp", None))


@pytest.mark.parametrize("namespace", [eqshard, eqshard.t5x, eqshard.compat])
def test_every_public_name_has_an_api_entry(namespace):
    # Modules are not API: under jaxtyping's import hook (`--jaxtyping-packages`),
    # eqshard's namespace holds `jaxtyping` too. The root's return types are
    # public without being in `__all__`.
    public = {
        name
        for name, value in vars(namespace).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    pages = "\n".join(p.read_text() for p in (REPO / "docs" / "api").glob("*.md"))
    prefix = re.escape(namespace.__name__)
    documented = set(re.findall(rf"^::: {prefix}\.(\w+)$", pages, re.M))
    assert len(public) >= 13 and set(namespace.__all__) <= public
    assert sorted(public - documented) == []


# ---------------------------------------------------------------------------------
# --model, --optimizer, --device-memory, --fit: the user's own model.
# ---------------------------------------------------------------------------------

TINY = "examples/llama.py:tiny"
ROOT = pathlib.Path(__file__).resolve().parent.parent


def _tiny_parameters() -> dict[str, tuple[int, ...]]:
    """By hand: examples/llama.py's tiny() (dim 64, 2 layers, MLP 128, kv 32,
    vocab 256), as eqx.nn.Linear (out, in) weights."""
    shapes = {"embed/weight": (256, 64), "norm/weight": (64,), "head/weight": (256, 64)}
    for i in range(2):
        block = {
            "attn_norm/weight": (64,),
            "attn/q/weight": (64, 64),
            "attn/k/weight": (32, 64),
            "attn/v/weight": (32, 64),
            "attn/o/weight": (64, 64),
            "mlp_norm/weight": (64,),
            "mlp/gate/weight": (128, 64),
            "mlp/up/weight": (128, 64),
            "mlp/down/weight": (64, 128),
        }
        shapes.update({f"layers/{i}/{name}": shape for name, shape in block.items()})
    return shapes


@pytest.fixture
def run_model(capfd, monkeypatch):
    """`python -m eqshard --model TINY ARGS` from the repository's root, run here
    (`_run_here`: the command's own 8 devices are this process's)."""
    monkeypatch.chdir(ROOT)
    return lambda *args: _run_here(capfd, "--model", TINY, *args)


def test_help_shows_the_planning_options(capfd):
    result = _run_here(capfd, "--help")
    assert result.returncode == 0
    for option in (
        "--model MODULE:CALLABLE",
        "--step MODULE:STEP",
        "--args MODULE:CALLABLE",
        "--params SELECTOR",
        "--optimizer {adamw,adam,sgd,lion,adafactor,none}",
        "--param-dtype DTYPE",
        "--device-memory BYTES",
        "--fit",
        "--save-rules FILE",
    ):
        assert option in result.stdout, option


@pytest.mark.parametrize(
    "optimizer, state_factor",
    [("adamw", 2), ("adam", 2), ("lion", 1), ("sgd", 0)],
)
def test_model_plans_parameters_gradients_and_optimizer_state(
    optimizer, state_factor, run_model
):
    result = run_model("--optimizer", optimizer, "--mesh", "dp:8")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    params = sum(math.prod(shape) for shape in _tiny_parameters().values())
    assert f"model {TINY}: {params:,} parameters in 21 arrays" in out
    assert "rules: the default rule '.* ()' (all replicated)" in out
    # All replicated, float32: parameters, gradients, moments, and a step count.
    total = params * 4 * (2 + state_factor) + (4 if state_factor else 0)
    assert re.search(rf"^  total +{re.escape(format_bytes(total))}$", out, re.M)
    assert re.search(r"^  devices 0-7 +[█░]{32} ", out, re.M)


@pytest.mark.slow
def test_model_that_does_not_fit_exits_with_status_1(run_model):
    fits = run_model("--device-memory", "2MiB", "--param-dtype", "bfloat16")
    assert fits.returncode == 0, fits.stderr
    assert re.search(r"of 2\.0 MiB: fits, .* to spare", fits.stdout)
    over = run_model("--device-memory", "1MiB")
    assert over.returncode == 1, over.stderr
    assert re.search(r"of 1\.0 MiB: DOES NOT FIT, .* over", over.stdout)
    assert "over budget" in over.stdout


def _abstract_bytes_per_device(rules_file, mesh_shape, names) -> int:
    """By hand with raw JAX: shard the tiny model abstractly with the rules, and
    add up params + grads + AdamW's two moments (float32) and step count on one
    device (every device holds as much under these rules)."""
    from jax.sharding import AbstractMesh, NamedSharding

    from eqshard._cli._rules_file import parse_rules

    rules = parse_rules(rules_file.read_text(), str(rules_file))
    mesh = AbstractMesh(mesh_shape, names)
    total = 4
    for path, shape in _tiny_parameters().items():
        spec = next(spec for regex, spec in rules if re.search(regex, path))
        piece = NamedSharding(mesh, spec).shard_shape(shape)
        total += 4 * 4 * math.prod(piece)
    return total


@pytest.mark.slow
def test_fit_proposes_rules_that_fit(tmp_path, run_model):
    # Replicated, the tiny model needs 1.6 MiB a device with AdamW: over budget.
    assert run_model("--mesh", "dp:8", "--device-memory", "512KiB").returncode == 1
    saved = tmp_path / "fit.rules"
    result = run_model(
        "--mesh",
        "dp:8",
        "--device-memory",
        "512KiB",
        "--fit",
        "--save-rules",
        str(saved),
    )
    assert result.returncode == 0, result.stderr
    assert "rules that fit (a --rules file):" in result.stdout
    assert saved.read_text() in result.stdout
    assert r"(^|/)layers/\d+/mlp/up/weight$  dp" in saved.read_text()
    per_device = _abstract_bytes_per_device(saved, (8,), ("dp",))
    assert per_device <= 512 * 1024
    assert re.search(
        rf"^  total +{re.escape(format_bytes(per_device))} +of 512\.0 KiB: fits",
        result.stdout,
        re.M,
    )
    # The proposal runs as a rules file, and fits there too.
    again = run_model(
        "--mesh", "dp:8", "--device-memory", "512KiB", "--rules", str(saved)
    )
    assert again.returncode == 0, again.stderr


def test_fit_keeps_the_users_rules_and_adds_the_data_axes(tmp_path, run_model):
    rules = tmp_path / "tp.rules"
    rules.write_text("attn/(q|k|v)/weight  tp\nattn/o/weight  None,tp\n.*  ()\n")
    saved = tmp_path / "fit.rules"
    result = run_model(
        "--mesh",
        "dp:2,tp:4",
        "--rules",
        str(rules),
        "--device-memory",
        "720KiB",
        "--fit",
        "--save-rules",
        str(saved),
    )
    assert result.returncode == 0, result.stderr
    text = saved.read_text()
    assert r"(^|/)layers/\d+/attn/q/weight$  tp,dp" in text
    assert r"(^|/)layers/\d+/attn/o/weight$  dp,tp" in text
    assert _abstract_bytes_per_device(saved, (2, 4), ("dp", "tp")) <= 720 * 1024


def test_fit_that_cannot_fit_says_so_and_exits_1(run_model):
    result = run_model("--mesh", "dp:8", "--device-memory", "64KiB", "--fit")
    assert result.returncode == 1
    assert "no rules fit" in result.stdout and "DOES NOT FIT" in result.stdout


@pytest.mark.slow
def test_missing_optax_is_a_clear_error():
    code = (
        "import sys; sys.modules['optax'] = None; "  # as if optax were not installed
        "from eqshard._cli import main; "
        f"sys.exit(main(['--model', '{TINY}']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT
    )
    assert re.search(r"--optimizer adamw: .*needs optax", _one_line_error(result))
    no_optimizer = code.replace("]))", ", '--optimizer', 'none']))")
    result = subprocess.run(
        [sys.executable, "-c", no_optimizer], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "args, match",
    [
        (
            ("--model", "examples/llama.py"),
            r"--model 'examples/llama.py': write MODULE:CALLABLE",
        ),
        (("--model", "examples/llama.py:nope"), r"has no 'nope'"),
        (("--model", "no_such_module:fn"), r"cannot import 'no_such_module'"),
        (("--model", TINY, "--size", "1B"), r"give one"),
        (("--model", TINY, "--fit"), r"--fit needs --device-memory"),
        (("--model", TINY, "--device-memory", "lots"), r"--device-memory 'lots'"),
        (("--model", TINY, "--param-dtype", "int8"), r"--param-dtype 'int8'"),
        (("--model", TINY, "--save-rules", "x"), r"--save-rules writes"),
        (
            ("--model", TINY, "--mesh", "tp:8", "--device-memory", "1KiB", "--fit"),
            r"no data axis|has none",
        ),
        (("--step", "x.py:step"), r"--step needs its arguments: give --args"),
        (("--args", "x.py:args"), r"--args gives the arguments of --step"),
        (
            ("--step", "x.py:step", "--args", "x.py:a", "--optimizer", "sgd"),
            r"--optimizer plans the parameters without a step",
        ),
        (
            ("--model", TINY, "--step", TINY, "--args", TINY),
            r"--step takes its parameters from --args .* leave --model out",
        ),
        (
            ("--step", TINY, "--args", TINY),
            rf"--args '{TINY}': it returned Llama; return the step's arguments as "
            r"a tuple",
        ),
    ],
)
def test_bad_model_options(args, match, capfd, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert re.search(match, _one_line_error(_run_here(capfd, *args)))


def test_model_from_a_module_name_returning_an_abstract_model(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "import equinox as eqx\n"
        "import jax\n\n\n"
        "def abstract():\n"
        "    key = jax.random.key(0)\n"
        "    return eqx.filter_eval_shape(eqx.nn.Linear, 64, 32, key=key)\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "eqshard",
            "--model",
            "mymodels:abstract",
            "--mesh",
            "dp:8",
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "model mymodels:abstract: 2,080 parameters in 2 arrays" in result.stdout


# ---------------------------------------------------------------------------------
# --step: the user's compiled training step, and --fit by compiling it.
# ---------------------------------------------------------------------------------

STEP_MODULE = """
import equinox as eqx
import jax
import jax.numpy as jnp
import optax


class MLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(32, 128, key=k1)
        self.down = eqx.nn.Linear(128, 32, key=k2)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def model():
    return MLP(jax.random.key(0))


optimizer = optax.adamw(1e-3)


def step(model, opt_state, x):
    loss = lambda model, x: jnp.mean(jax.vmap(model)(x) ** 2)
    value, grads = eqx.filter_value_and_grad(loss)(model, x)
    updates, opt_state = optimizer.update(grads, opt_state, model)
    return eqx.apply_updates(model, updates), opt_state, value


def arguments():
    params = model()
    opt_state = optimizer.init(eqx.filter(params, eqx.is_array))
    return params, opt_state, jax.ShapeDtypeStruct((2048, 32), jnp.float32)
"""


@pytest.mark.slow
def test_fit_compiles_the_step_and_its_rules_read_back(tmp_path, capfd, monkeypatch):
    # Replicated, the parameters and AdamW's state are ~100 KiB a device, but the
    # activations of a batch of 1024 rows a device do not fit in 1 MiB.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mlp.py").write_text(STEP_MODULE)
    saved = tmp_path / "fit.rules"
    command = ["--step", "mlp.py:step", "--args", "mlp.py:arguments"]
    command += ["--device-memory", "1MiB"]
    fit = _run_here(capfd, *command, "--fit", "--save-rules", str(saved))
    assert fit.returncode == 0, fit.stderr
    out = fit.stdout
    assert "argument 2: (2048, 32) float32, split over dp" in out
    assert re.search(r"^-  +replicated  +[\d.]+ MiB +over by ", out, re.M)
    best = re.search(r"^best: (.+), peak ", out, re.M)
    assert best is not None and best[1] != "replicated"
    assert f"rules that fit (a --rules file), {best[1]}:" in out
    assert (
        saved.read_text() in out and "(^|/)down/weight$  None,tp" in saved.read_text()
    )
    assert f"step report of {best[1]}:" in out
    # The rules saved compile to the same step, which fits.
    again = _run_here(capfd, *command, "--rules", str(saved))
    assert again.returncode == 0, again.stderr
    peak = re.search(rf"^best: {re.escape(best[1])}, peak ([\d.]+ \w+),", out, re.M)
    assert peak is not None
    assert f"compiled peak {peak[1]} of 1.0 MiB: fits" in again.stdout
    assert "step 'step' on mesh {'dp': 2, 'tp': 4}" in again.stdout
    assert "model/down/weight [producer]" in again.stdout


# ---------------------------------------------------------------------------------
# In-process runs of the command's `main` (no interpreter to start): --save-rules,
# user files, and the exit code of a model that raises.
# ---------------------------------------------------------------------------------


def _main(*args: str) -> int:
    from eqshard._cli._main import main

    return main(list(args))


def test_save_rules_writes_only_rules_that_fit_and_never_an_input(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(ROOT)
    saved = tmp_path / "fit.rules"
    saved.write_text("# the user's file\n.*  ()\n")
    fit = ("--model", TINY, "--mesh", "dp:8", "--fit", "--save-rules", str(saved))
    # Nothing fits in 64 KiB: the file is kept, and the output says so.
    assert _main(*fit, "--device-memory", "64KiB") == 1
    assert saved.read_text() == "# the user's file\n.*  ()\n"
    out = capsys.readouterr().out
    assert f"not saved to {saved}: --save-rules saves only rules that fit" in out
    assert "the file there is kept" in out
    # The --rules file given is never replaced, fitting or not.
    assert _main(*fit, "--device-memory", "512KiB", "--rules", str(saved)) == 2
    err = capsys.readouterr().err
    assert f"--save-rules {saved}: that is the file of --rules" in err
    assert saved.read_text() == "# the user's file\n.*  ()\n"
    # Rules that fit replace the file, and the output says so.
    assert _main(*fit, "--device-memory", "512KiB") == 0
    out = capsys.readouterr().out
    assert f"saved to {saved}, replacing the file there" in out
    assert saved.read_text() in out and "auto_fsdp" in saved.read_text()
    new = tmp_path / "new.rules"
    assert _main(*fit[:-1], str(new), "--device-memory", "512KiB") == 0
    out = capsys.readouterr().out
    assert f"saved to {new}\n" in out and new.read_text() == saved.read_text()


def test_a_user_file_named_as_a_standard_module_is_the_users(
    tmp_path, monkeypatch, capsys
):
    import typing

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "typing", typing)  # restored, whatever happens
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "typing.py").write_text(
        "import equinox as eqx\nimport jax\n\n\n"
        "def model():\n"
        "    return eqx.nn.Linear(64, 32, key=jax.random.key(0))\n"
    )
    args = ("--model", "sub/typing.py:model", "--mesh", "dp:8", "--optimizer", "none")
    assert _main(*args) == 0
    assert "model sub/typing.py:model: 2,080 parameters" in capsys.readouterr().out
    assert sys.modules["typing"] is typing  # the standard library's, untouched


def test_a_model_or_step_that_raises_exits_3_with_its_traceback(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.py").write_text(
        "def helper():\n    return 1 / 0\n\n\ndef model():\n    return helper()\n"
    )
    fit = ("--mesh", "dp:8", "--device-memory", "1MiB", "--fit")
    assert _main("--model", "bad.py:model", *fit) == 3  # not 1: "does not fit"
    err = capsys.readouterr().err
    assert "--model 'bad.py:model': calling it raised ZeroDivisionError" in err
    assert "bad.py:6 in model: return helper()" in err
    assert "bad.py:2 in helper: return 1 / 0" in err
    # A step that raises when traced, under --fit's search.
    (tmp_path / "mlp.py").write_text(
        STEP_MODULE.replace(
            "    loss = lambda",
            "    raise RuntimeError('no step yet')\n    loss = lambda",
        )
    )
    step = ("--step", "mlp.py:step", "--args", "mlp.py:arguments")
    assert _main(*step, *fit) == 3
    err = capsys.readouterr().err
    assert "--step mlp.py:step: the step raised RuntimeError: no step yet" in err
    assert re.search(r"mlp\.py:\d+ in step: raise RuntimeError", err)
    # A ValueError whose text looks like eqshard's is still the step's own (the
    # command tells them apart by where they were raised, never by their text).
    (tmp_path / "mlp2.py").write_text(
        STEP_MODULE.replace(
            "    loss = lambda",
            "    raise ValueError('eqshard.like: not ours')\n    loss = lambda",
        )
    )
    step = ("--step", "mlp2.py:step", "--args", "mlp2.py:arguments")
    assert _main(*step, *fit) == 3
    assert (
        "the step raised ValueError: eqshard.like: not ours" in capsys.readouterr().err
    )


def test_user_code_that_exits_or_sets_devices(tmp_path, monkeypatch, capsys):
    import jax

    monkeypatch.chdir(tmp_path)
    update = jax.config.update
    # A module as the docs teach it: it asks for its own number of CPU devices
    # first. The command, whose devices are made already, keeps them.
    (tmp_path / "taught.py").write_text(
        "import jax\n\n"
        'jax.config.update("jax_num_cpu_devices", 16)\n\n'
        "import equinox as eqx\n\n\n"
        "def model():\n"
        "    return eqx.nn.Linear(64, 32, key=jax.random.key(0))\n"
    )
    args = ("--model", "taught.py:model", "--mesh", "dp:8", "--optimizer", "none")
    assert _main(*args) == 0
    out, err = capsys.readouterr()
    assert "model taught.py:model: 2,080 parameters" in out
    assert "sets jax_num_cpu_devices to 16; the command keeps its own 8" in err
    assert jax.config.update == update and jax.device_count() == 8
    # sys.exit(0) in the user's code is its error (3), never "fits" (0).
    (tmp_path / "leaves.py").write_text(
        "import sys\n\n\ndef model():\n    sys.exit(0)\n\n\n"
        "def arguments():\n    sys.exit(0)\n"
    )
    (tmp_path / "leaves_early.py").write_text("import sys\n\nsys.exit(0)\n")
    for command, said in [
        (("--model", "leaves.py:model"), "--model 'leaves.py:model': calling it"),
        (("--step", "leaves.py:model", "--args", "leaves.py:arguments"), "--args"),
        (("--model", "leaves_early.py:model"), "importing 'leaves_early.py'"),
    ]:
        assert _main(*command, "--mesh", "dp:8", "--device-memory", "1GiB") == 3
        err = capsys.readouterr().err
        assert said in err and "called sys.exit(0)" in err
        assert "leaves" in err.split("\n")[1]  # the user's line
    # A module, file or callable that is not there is a bad option (2), as
    # the --help and the docs say: the user's code did not run.
    for target in ("no_such_module:fn", "no_such_file.py:fn", "leaves.py:nope"):
        assert _main("--model", target, "--mesh", "dp:8") == 2
        capsys.readouterr()
