"""What a layout is: spec trees, logical axis names and partition rules.

Every function that takes `specs=` hands it to `resolve_specs`
(`_resolve.py`), which
turns whatever was given (a spec tree or a prefix of one, partition rules, or a
function of the abstract tree) into one `PartitionSpec` per array leaf:

1. **Names.** `AxisNames` and the logical rules context (`_logical.py`) resolve
   logical names to mesh axes (`logical_to_spec`, the one resolver);
   `_logical_convert.py` applies it to whole trees (`logical_to_mesh_specs`) and
   builds rule tables (`composite_axis_rules`, t5x's standard ones, the names a
   model declares in its fields).
2. **Rules.** Regex partition rules are matched against each leaf's path
   (`_rules.py`, its messages in `_rules_messages.py`), their values a spec,
   logical names, `stacked` (`_stacked.py`: a spec for one layer of stacked
   layers), `auto_fsdp` (`_auto.py`: a spec
   picked from the shape) or `host` (`_memory.py`: a layout kept in host
   memory, which a spec tree may hold too, bound to `"pinned_host"` where it
   meets a mesh); `_rules_syntax.py` reads specs and rules written as
   text, and `explain_partition_rules` (`_rules_report.py`) says which rule gave
   each spec.
3. **Check.** Each spec is checked against its leaf's shape and the mesh
   (`_check_spec.py`: `check_spec`, the one message for bad specs).
4. **Derive.** Spec trees for other trees (`_derive.py`: optimizer states and
   gradients that follow the parameters, as `_follow.py` decides; stacked layers;
   another mesh) and abstract trees with their shardings.
5. **Select.** `_select.py` finds the parameters among a step's arguments (the
   `params=` selector of `search_layout` and `plan_training`).

The layout an array already carries (a placed array's `NamedSharding`, a traced
array's type's along Explicit axes) has one reader, `_carried.py`, which every
wing asks. Nothing here moves data; the movers and transforms read the specs
made here.
"""
