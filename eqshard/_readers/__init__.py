"""Reading what is placed or planned: layouts, reports and plans.

`get_partition_spec` and `extract_shardings` (`_inspect.py`) read the shardings
of a placed tree into specs; `analyze_sharding_strategy` (`_strategy.py`) works
out from them, or from specs, what each device holds, as a `ShardingReport`
(`_inspect.py`, whose table puts repeated layers' arrays in one row by
`_group.py`);
`check_layout` (`_layout.py`) compares a tree with the layout asked for;
`plan_training` (`_plan.py`) adds up parameters, gradients and optimizer state per
device against a budget, from the abstract tree and its specs (no data moves),
with what a pipeline schedule keeps (`_plan_pipeline.py`), context-parallel
attention's buffers (`_plan_context.py`), and what is trained, the optimizer
state's specs and the bytes kept in host memory (`_plan_state.py`).
Each returns a `Report` (`eqshard._report`).
"""
