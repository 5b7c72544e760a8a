"""The compiled step: what a training step does with each leaf's layout.

How a step is read, in the order of `analyze_step` (`_step.py`):

1. **Compile.** The step is compiled for its arguments (flattened by
   `_args.py`), with `fn`'s own shardings and donations, its leaves named
   by path (`params/b0/w1`), and XLA's warnings captured; on a TPU target with
   the async-collective options production runs set (`_options.py`).
2. **Read the text.** `_hlo/_text.py` reads XLA's compiled text
   (`compiled.as_text()`) into computations of instructions, shapes flattened
   into slots, and the attributes asked for (called computations, replica
   groups, trip counts, op names); `HloTextError` on text it cannot read.
3. **Follow the data.** `_hlo/_graph.py` links each slot, inside each
   computation, to the parameter slots it derives from and the root slots it
   reaches through ops that keep identity; `_hlo/_flow.py` carries the entry's
   arguments and results down through the calls and attributes each collective
   (`Program`, `Collective`) to the user's leaves, or to the dot it feeds, with
   loops' trip counts the text does not state read by `_hlo/_loops.py` and each
   backend's spelling of collectives and their overlap by `_hlo/_forms.py`.
4. **Report.** `_rows.py` turns that into rows (leaves, collectives, moved
   inputs, warnings; their records in `_records.py`); memory, collectives
   by path and totals go into a `StepReport` (`_report.py`: `diff`, the
   table, JSON; `_json.py` reads it back, every field checked), cached per
   function and argument signature until `eqshard.clear_caches`.
5. **Time.** On a target's chips, `_hlo/_cost.py` counts each op's FLOPs and
   HBM bytes, `_links.py` times each collective on its links, and
   `_time.py` makes the `StepTime` of `report.time`.
"""
