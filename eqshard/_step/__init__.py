"""The compiled step: what a training step does with each leaf's layout.

`analyze_step` (`_step.py`) compiles a step for its arguments (with `fn`'s own
shardings and donations), names its leaves by path and captures XLA's warnings.
The compiled program's text is read by `_hlo.py` (computations, shapes, replica
groups, trip counts) and each collective followed back to the arguments and
results it moves; the rows and totals go into a `StepReport` (`_step_report.py`:
memory, collectives by path, `diff`, JSON).
"""
