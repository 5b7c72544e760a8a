"""XLA's compiled text, read (the step wing's readers; no JAX beyond the text).

`_text.py` reads a program's text into computations of instructions, shapes
flattened into slots, and the attributes asked for; `_graph.py` links each slot
to the parameter slots it derives from; `_flow.py` joins the computations and
follows the entry's arguments to each collective (`Program`, `Collective`),
with the trip counts of loops the text does not state from `_loops.py` and each
backend's spelling of collectives and their overlap from `_forms.py`, and a
multi-slice TPU program's transfers between slices over DCN (`send`/`recv` to
the megascale runtime) from `_megascale.py`, and a GPU permute split into
point-to-point `send`/`recv` pairs from `_p2p.py`; `_cost.py` counts each op's FLOPs
and HBM bytes for the step's time.
"""
