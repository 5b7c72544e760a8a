"""Searching for a layout: candidates, compiled and ranked.

`search_layout` (`_search.py`) gathers the candidates (the user's, then the
built-in ones of `_candidates.py`, drawn from paths, shapes and how the step uses
each parameter, read from its jaxpr by `_uses.py` with `_flow.py`), compiles
each with the step traced once (`_compile.py`), reads each one's
`StepReport`, and ranks them against the budgets into a `LayoutSearch`
(`_report.py`).
"""
