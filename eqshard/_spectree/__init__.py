"""What a layout is: spec trees, logical axis names and partition rules.

Every function that takes `specs=` hands it to `_spec_args.resolve_specs`, which
turns whatever was given (a spec tree or a prefix of one, partition rules, or a
function of the abstract tree) into one `PartitionSpec` per array leaf:

1. **Names.** `AxisNames` and the logical rules context (`_logical.py`) resolve
   logical names to mesh axes (`logical_to_spec`).
2. **Rules.** Regex partition rules are matched against each leaf's path
   (`_rules.py`, with the rule value `stacked` and `auto_fsdp` from `_auto.py`,
   which picks a spec from a leaf's shape); `explain_partition_rules` says which
   rule gave each spec.
3. **Check.** Each spec is checked against its leaf's shape and the mesh
   (`_specs.py`: `check_spec`, the one message for bad specs).
4. **Derive.** Spec trees for other trees (`_derive.py`: optimizer states and
   gradients that follow the parameters, as `_follow.py` decides; stacked layers;
   another mesh) and abstract trees with their shardings.

Nothing here moves data; the movers and transforms read the specs made here.
"""
