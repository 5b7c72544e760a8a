"""Reading what is placed: layouts, reports and plans.

`get_partition_spec`, `extract_shardings` and `analyze_sharding_strategy`
(`_inspect.py`) read the shardings of a placed tree into specs and a report;
`check_layout` (`_layout.py`) compares a tree with the layout asked for;
`plan_training` (`_plan.py`) adds up parameters, gradients and optimizer state per
device against a budget, from the abstract tree and its specs (no data moves).
Each returns a `Report` (`eqshard._report`).
"""
