"""Reading what is placed or planned: layouts, reports and plans.

`get_partition_spec` and `extract_shardings` (`_inspect.py`) read the shardings
of a placed tree into specs; `analyze_sharding_strategy` (`_strategy.py`) works
out from them, or from specs, what each device holds, as a `ShardingReport`
(`_inspect.py`);
`check_layout` (`_layout.py`) compares a tree with the layout asked for;
`plan_training` (`_plan.py`) adds up parameters, gradients and optimizer state per
device against a budget, from the abstract tree and its specs (no data moves),
with a pipeline's buffers (`_plan_pipeline.py`) and context-parallel attention's
(`_plan_context.py`).
Each returns a `Report` (`eqshard._report`).
"""
