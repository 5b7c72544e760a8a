# `python -m eqshard --size N --target T --batch B --seq S`: the built-in
# model's training step compiled for a target, and its estimated seconds.

import re
import subprocess
import sys

import pytest

from eqshard._cli._estimate import shape_for_size
from eqshard._cli._main import main


@pytest.mark.parametrize(
    "args, match",
    [
        (["--batch", "8"], r"--batch and --seq go together"),
        (["--batch", "8", "--seq", "64"], r"give --size and --target too"),
        (["--size", "1B", "--batch", "8", "--seq", "64"], r"--size and --target"),
        (
            ["--size", "1B", "--target", "v5e:2x4", "--batch", "0", "--seq", "64"],
            r"--batch 0 --seq 64: give at least 1 sequence",
        ),
    ],
)
def test_bad_estimate_options(args, match, capsys):
    assert main(args) == 2
    assert re.search(match, capsys.readouterr().err)


def test_the_built_in_shape_has_about_the_size_asked():
    # 12 d^2 + 2 d a layer, untied embedding and head, a final norm.
    shape = shape_for_size(70 * 10**9)
    d, v = shape.dim, shape.vocab
    assert shape.parameters == shape.layers * (12 * d * d + 2 * d) + 2 * v * d + d
    assert abs(shape.parameters - 70e9) < 0.1 * 70e9


@pytest.mark.slow
def test_the_command_times_a_step_on_a_target():
    args = ["--size", "30M", "--target", "v5e:2x4", "--batch", "8", "--seq", "64"]
    result = subprocess.run(
        [sys.executable, "-m", "eqshard", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "for --target v5e:2x4: 8 TPU v5 lite (compile-only)" in out
    assert re.search(r"compiled for --target v5e:2x4 \(.*libtpu", out)
    assert re.search(r"peak per device .* of 15\.8 GiB: fits", out)
    found = re.search(r"step ([\d.e-]+) s: ([\d,]+) tokens per second, MFU ", out)
    assert found is not None, out
    seconds, tokens = float(found[1]), int(found[2].replace(",", ""))
    assert tokens == pytest.approx(8 * 64 / seconds, rel=0.01)
    assert len(out.splitlines()) < 120
    assert "all-gather" in out and "params/blocks/mlp/up" in out
