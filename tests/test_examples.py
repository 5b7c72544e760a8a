"""Runs each script in examples/ in a fresh Python process.

Each example configures its own 8 virtual CPU devices before touching JAX, so the
child must not inherit settings that override that (`XLA_FLAGS`, JAX_* variables
such as `JAX_NUM_CPU_DEVICES`); it runs on CPU, from the repository root, with the
repository first on its import path.
"""

import os
import pathlib
import subprocess
import sys

import pytest
from probes import RUN_TIMEOUT


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _child_env() -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("XLA_", "JAX_"))
    }
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    return env


@pytest.mark.parametrize(
    "name, success",
    [
        pytest.param("train_step.py", "train_step example: OK", marks=pytest.mark.slow),
        ("checkpoint.py", "checkpoint example: OK"),
        ("llama.py", "llama example: OK"),
    ],
)
def test_example_runs(name: str, success: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        cwd=ROOT,
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    output = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, output
    assert success in result.stdout.splitlines(), output
