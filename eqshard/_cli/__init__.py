"""The program behind `python -m eqshard` (private).

`_main.py` parses the options (a rules file and `--size` read by
`_rules_file.py`) and dispatches: the demo
(`_demo.py`: a small transformer placed with its built-in rules, a few training
steps, and the bit-exact round trip through gather and shard), the plans
(`_fit.py`: `--size`, `--model` loading a user's model, `--fit`'s proposed
rules), the time of the built-in model's step on a target (`_estimate.py`:
`--size` with `--target`, `--batch`, `--seq`), or a user's training step
(`_step.py`: `--step`, its batch placed and its `StepReport` printed, or with
`--fit` a `search_layout`); the user's code is imported by `_load.py`, which also
holds the exit codes and the two kinds of error. It calls eqshard's public
functions, and reads a few of the wings' helpers (rules written as text, a plan's
pieces, the parameters of a step); nothing in eqshard imports it but
`__main__.py`.
"""

from ._main import main as main
