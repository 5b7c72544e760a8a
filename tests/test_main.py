# `python -m eqshard`, run as users run it: in a subprocess. The default run is the
# slow one (it compiles a training step), so it runs once for several tests.
# Expected sizes are worked out by hand from the demo model (dim 64, vocab 256,
# MLP width 256, float32) and the mesh.

import pathlib
import re
import subprocess
import sys
import types

import pytest
from jax.sharding import PartitionSpec as P

import eqshard


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eqshard", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _row(stdout: str, path: str) -> str:
    """The plan table's line for the array at `path`."""
    (line,) = [line for line in stdout.splitlines() if line.startswith(path + " ")]
    return line


def _total_parameters(stdout: str) -> int:
    match = re.search(r"^total: \d+ arrays, ([\d,]+) parameters", stdout, re.M)
    assert match is not None, stdout
    return int(match[1].replace(",", ""))


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("python -m eqshard: error: ")
    return lines[0]


@pytest.fixture(scope="module")
def default_run() -> subprocess.CompletedProcess:
    return _run()


def test_default_run_prints_the_plan(default_run):
    out = default_run.stdout
    assert default_run.returncode == 0, default_run.stderr
    assert "on 8 virtual CPU devices, mesh {'dp': 2, 'tp': 4}" in out
    assert re.search(r"^path +shape +dtype +spec +size +per device$", out, re.M)
    # q projection (64, 64) float32: 16 KiB, split 4 ways over tp.
    q = _row(out, "blocks/0/attn/q/weight")
    assert str(P("tp")) in q and re.search(r"16\.0 KiB +4\.0 KiB$", q)
    # LayerNorm weights are replicated: 64 float32 on every device.
    assert re.search(r"P\(\) +256 B +256 B +replicated$", _row(out, "norm/weight"))
    # embed + head 2 * 256 * 64, per block 12 * 64^2 + 13 * 64, final norm 2 * 64.
    assert _total_parameters(out) == 2 * 256 * 64 + 2 * (12 * 64**2 + 13 * 64) + 128


def test_default_run_trains_round_trips_and_summarises(default_run):
    out, err = default_run.stdout, default_run.stderr
    assert default_run.returncode == 0, err
    assert "Traceback" not in err
    # The progress bar: one line per step when stderr is not a terminal.
    steps = re.findall(r"^train \[[#.]{24}\] (\d)/5  loss ([\d.]+)", err, re.M)
    assert [int(step) for step, _ in steps] == [1, 2, 3, 4, 5]
    losses = [float(loss) for _, loss in steps]
    assert losses[-1] < losses[0]
    assert re.search(r"^verified: all 36 arrays bit-exact", out, re.M)
    summary = out[out.index("\nsummary\n") :]
    for phase in ("shard", "train (5 steps)", "gather", "serialise", "reshard"):
        assert re.search(rf"^  {re.escape(phase)} +\d+\.\d{{3}} s", summary, re.M)
    assert re.search(r"^  total +\d+\.\d{3} s", summary, re.M)


@pytest.mark.parametrize(
    "mesh, shape, q_per_device",
    [
        ("dp:2,tp:4", "{'dp': 2, 'tp': 4}", r"4\.0 KiB"),
        ("tp:2,dp:4", "{'tp': 2, 'dp': 4}", r"8\.0 KiB"),
    ],
)
def test_plan_only_with_mesh(mesh, shape, q_per_device):
    result = _run("--plan-only", "--mesh", mesh)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"mesh {shape}" in out and "eqx.filter_eval_shape" in out
    q = _row(out, "blocks/0/attn/q/weight")
    assert re.search(rf"16\.0 KiB +{q_per_device}$", q)  # 16 KiB over tp
    # Nothing moved: no training, no round trip.
    assert "train [" not in result.stderr and "verified" not in out


def test_size_plans_an_abstract_model():
    result = _run("--size", "1B", "--plan-only")
    assert result.returncode == 0, result.stderr
    assert abs(_total_parameters(result.stdout) - 10**9) <= 0.1 * 10**9
    assert "abstract" in result.stdout and "train [" not in result.stderr


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
    assert str(P(None, "tp")) in _row(out, "blocks/1/attn/v/weight")
    # (256, 64) float32 = 64 KiB, split over tp and fsdp: 16 KiB per device.
    up = _row(out, "blocks/0/mlp/up/weight")
    assert str(P(("tp", "fsdp"))) in up and re.search(r"64\.0 KiB +16\.0 KiB$", up)
    assert re.search(
        r"P\(\) +64\.0 KiB +64\.0 KiB +replicated$", _row(out, "embed/weight")
    )
    assert "note: 1 of the 4 rules matched no array" in out
    assert out.rstrip().endswith(": 2 'embed/wieght'")


def test_rules_file_arrow_between_regex_and_spec():
    # Parsed in this process: no need for a subprocess to read a text format.
    from eqshard.__main__ import parse_rules, UsageError

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
def test_malformed_rules_file(tmp_path, text, line):
    rules = tmp_path / "rules.txt"
    rules.write_text(text)
    error = _one_line_error(_run("--rules", str(rules)))
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
def test_bad_options(args, match):
    result = _run(*args)
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
    assert child.stdout.readline().startswith("eqshard ")
    child.stdout.close()
    stderr = child.communicate(timeout=300)[1]
    assert child.returncode == 1 and "Traceback" not in stderr, stderr


# The README's promises: its test command is CI's, its example runs, and every
# public name has an entry in the API reference.

REPO = pathlib.Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_readme_commands():
    block = README.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert commands[0] == "pip install -e . && python -m eqshard"
    assert commands[1] == ci[-1]
    assert "set -euo pipefail" in ci


def test_readme_example_runs(tmp_path):
    example = re.search(r"^```python\n(.*?)^```", README, re.M | re.S)[1]
    result = subprocess.run(
        [sys.executable, "-c", example],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(P("tp", None))


def test_every_public_name_has_an_api_entry():
    # Modules are not API: under the test run's jaxtyping import hook, eqshard's
    # namespace holds `jaxtyping` too.
    public = {
        name
        for name, value in vars(eqshard).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    pages = "\n".join(p.read_text() for p in (REPO / "docs" / "api").glob("*.md"))
    documented = set(re.findall(r"^::: eqshard\.(\w+)$", pages, re.M))
    assert len(public) > 50
    assert sorted(public - documented) == []
