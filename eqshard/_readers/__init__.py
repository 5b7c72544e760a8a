"""Reading what is placed or planned: layouts, reports and plans.

Nothing here moves data or compiles: each reader takes a tree (placed arrays, or
abstract ones with their specs), reads each leaf's sharding or spec, and returns
a `Report` (`eqshard._report`). `get_partition_spec`, `extract_shardings` and
`analyze_sharding_strategy` (`_inspect.py`) turn the shardings of a placed tree
into specs and a per-leaf report of bytes per device and problems;
`check_layout` (`_layout.py`) compares a tree with the layout asked for, leaf by
leaf; `plan_training` (`_plan.py`) builds on `_inspect.py` to add up parameters,
gradients and optimizer state per device against a budget, from the abstract
tree and its specs.
"""
