"""Choosing a layout by compiling: [`eqshard.search_layout`][] compiles a training
step for each candidate layout of its parameters and ranks those that fit by
the communication XLA put in.

How a search goes:

1. **The step** (`_compile.py`): its arguments sorted (the parameters, the
   states that follow them, the batch that keeps its layout), its data axes
   (those that split the batch), and one trace: how each parameter is used and
   what the step returns.
2. **Candidates**: the rule sets given, then the built-in strategies
   (`_candidates.py`), each matched on the mesh; a layout equal to an earlier one
   is compiled once (under the name given, if one was), and those beyond
   `max_candidates` are skipped.
3. **Compile** each for abstract arguments (`Step.report`, through
   [`eqshard.analyze_step`][]): nothing is allocated. A layout whose arguments
   alone (their bytes per device, a floor of its peak) exceed the budget
   cannot win once another fits: those are compiled last, and skipped when
   another fits. After `time_budget` seconds, the rest is skipped.
4. **Rank**: the layouts whose compiled peak fits `device_memory` by cost (bytes
   sent per step, weighted by axis bandwidth), then peak, then order; then the
   rest by peak.
"""

import dataclasses
import io
import math
import operator
import sys
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, PartitionSpec
from jaxtyping import PyTree

from .._internals.errors import is_sharding_type_error
from .._mesh._current import require_mesh
from .._mesh._targets import device_memory as target_memory, is_compile_only
from .._report import format_bytes, parse_bytes
from .._spectree._rules import match_partition_rules
from .._spectree._select import check_parameters, select
from .._step._records import OutOfMemory
from .._step._report import StepReport
from .._tree import is_array
from .._typing import Int, typecheck
from ._candidates import (
    normalized,
    parameters,
    rules_text,
    strategies,
    strategy_rules,
    tensor_pairs,
    unpaired,
)
from ._compile import CALLER, function_name, search_error, Step
from ._report import LayoutCandidate, LayoutSearch


def _abstract_mesh_error(mesh: AbstractMesh) -> ValueError:
    return search_error(
        f"the mesh {dict(mesh.shape)} is an AbstractMesh, which cannot be "
        "compiled: each candidate is compiled for real devices. Without the "
        "hardware, start JAX with as many virtual CPU devices "
        f"(`jax.config.update('jax_num_cpu_devices', {mesh.size})` before any JAX "
        "operation) and pass a `jax.sharding.Mesh` of that shape."
    )


def _candidate_error(name: str, error: Exception) -> ValueError:
    return search_error(
        f"the rules of candidate {name!r} cannot lay out `params`:\n{error}\nFix "
        "those rules, or leave the candidate out."
    )


def _same_name_error(name: str, where: str) -> ValueError:
    return search_error(
        f"two candidates are named {name!r} ({where}); each layout is known by "
        "its name in the ranking and in `rules_text`. Give each of yours a name "
        "of its own."
    )


def _untyped_why(error: Exception) -> str:
    """Why a candidate was not compiled: JAX's error on Explicit axes, one line
    (eqshard's message names the layer and its arrays)."""
    message = " ".join(str(error).split()).removeprefix("eqshard.analyze_step: ")
    message = message.partition(" Run the model under")[0]  # the fix: said once
    return f"JAX cannot type the step with this layout: {message}"


def _untyped(error: BaseException) -> bool:
    """Whether `error` is (or was raised from) JAX's error on an operation whose
    result's sharding is ambiguous on Explicit axes: a layout JAX cannot type.
    JAX does not export its class, so it is known by name, as in `_explicit`."""
    found: BaseException | None = error
    while found is not None:
        if is_sharding_type_error(found):
            return True
        found = found.__cause__
    return False


def _all_untyped_error(skipped: list[tuple[str, str]]) -> ValueError:
    names = ", ".join(repr(name) for name, _ in skipped)
    return search_error(
        f"no candidate could be compiled: on the mesh's Explicit axes JAX cannot "
        f"type the step with any of {names}. The first: {skipped[0][1]}. Run "
        "the model under `eqshard.auto_axes(fn, out_sharding=...)`, which makes the "
        "Explicit axes Auto inside `fn`, or search on a mesh of Auto axes."
    )


class _Progress:
    """A progress bar on a terminal's stderr: rich's when installed."""

    def __init__(
        self, total: int, enabled: bool, stream: io.TextIOBase | TextIO
    ) -> None:
        self.total, self.stream, self.done = total, stream, 0
        self.rich: Any = None
        self.enabled = enabled and stream.isatty()
        if not self.enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import Progress
        except ImportError:
            return
        console = Console(file=typing.cast(TextIO, stream))
        self.rich = Progress(console=console, transient=True)
        self.task = self.rich.add_task("compiling layouts", total=total)
        self.rich.start()

    def update(self, note: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.rich is not None:
            self.rich.update(self.task, completed=self.done, description=note)
            return
        filled = 24 * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (24 - filled)
        self.stream.write(f"\rlayouts [{bar}] {self.done}/{self.total}  {note}\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        if self.rich is not None:
            self.rich.stop()
        elif self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _given(candidates: Any) -> list[tuple[str, Any]]:
    if candidates is None:
        return []
    if isinstance(candidates, Mapping):
        named = [(str(name), rules) for name, rules in candidates.items()]
    elif isinstance(candidates, Sequence) and not isinstance(candidates, str):
        named = [(f"candidate {i}", rules) for i, rules in enumerate(candidates, 1)]
        return named
    else:
        raise TypeError(
            f"eqshard.{CALLER}: `candidates` is {candidates!r}; give a list of rule "
            "lists, or a dict from a name to a rule list, e.g. "
            "`{'tp': [('mlp/up', P(None, 'tp')), ('.*', P())]}`."
        )
    seen: set[str] = set()
    for name, _ in named:
        if name in seen:  # keys such as 1 and "1"
            raise _same_name_error(name, "two keys of `candidates` read the same")
        seen.add(name)
    return named


def _number(value: Any) -> bool:
    """Whether `value` is a real number: a Python or NumPy int or float (no bool)."""
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool | np.bool_
    )


def _budget(device_memory: Any, mesh: Mesh) -> int:
    """The budget per device in bytes: `device_memory`, else a target mesh's."""
    if device_memory is None:
        device_memory = target_memory(list(mesh.devices.flat))
    if device_memory is None:
        raise search_error(
            "give `device_memory`, the budget per device (bytes, or a string "
            'such as "16GiB"); only a target mesh (create_mesh(..., target=...)) '
            "knows its own."
        )
    return _memory(device_memory)


def _memory(device_memory: Any) -> int:
    """`device_memory` in bytes: an int, a float (rounded to whole bytes), or a
    string such as `"16GiB"`."""
    if isinstance(device_memory, str):
        return parse_bytes(device_memory, caller=CALLER)
    if not _number(device_memory) or not math.isfinite(device_memory):
        raise search_error(
            f"`device_memory` is {device_memory!r}; give the budget per device in "
            "bytes (an int or a float, such as 16e9) or as a string such as "
            '"16GiB".'
        )
    if isinstance(device_memory, float | np.floating):
        device_memory = round(float(device_memory))
    return parse_bytes(operator.index(device_memory), caller=CALLER)


def _bandwidth(
    bandwidth: Mapping[str, Int | float | np.floating] | None, mesh: Mesh
) -> dict[str, float]:
    weights = {str(axis): 1.0 for axis in mesh.axis_names}
    first = next(iter(mesh.devices.flat))
    if bandwidth and is_compile_only(first):
        raise search_error(
            f"`bandwidth` is refused on a target's mesh ({first.device_kind}): its "
            "chips' links time each layout's collectives (report.time). Drop it."
        )
    for axis, value in (bandwidth or {}).items():
        if axis not in weights:
            raise search_error(
                f"`bandwidth` names {axis!r}, which is not an axis of the mesh "
                f"{dict(mesh.shape)}. Give a relative bandwidth per mesh axis, e.g. "
                f"{{{next(iter(weights))!r}: 1.0}}."
            )
        if not (_number(value) and value > 0 and math.isfinite(value)):
            raise search_error(
                f"`bandwidth[{axis!r}]` is {value!r}; a relative bandwidth is a "
                "positive finite number, an int or a float (1.0 for ICI, about 0.1 "
                "for DCN)."
            )
        weights[axis] = float(value)
    return weights


def _cost(
    report: StepReport, weights: Mapping[str, float], *, exposed: bool = False
) -> float:
    """The bytes a device sends per step, each over its slowest axis's relative
    bandwidth; with `exposed`, only those the schedule does not overlap."""
    total = 0.0
    for row in report.collectives:
        if exposed and row.overlapped is True:
            continue
        slowest = min((weights.get(a, 1.0) for a in row.axes), default=1.0)
        total += row.link_bytes * row.count / slowest
    return total


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A layout to compile: its name, its origin (`"given"` or `"built-in"`), its
    rules and the spec tree they give the parameters."""

    name: str
    origin: str
    rules: list[Any]
    specs: PyTree


def _layouts(
    given: list[tuple[str, Any]], builtin: bool, step: Step, mesh: Mesh
) -> tuple[list[_Layout], list[tuple[str, str]]]:
    """The layouts to compile, each once, and the given ones that repeat one."""
    params = step.params
    layouts: list[_Layout] = []
    for name, rules in given:
        try:
            specs = match_partition_rules(rules, params, mesh=mesh)
        except (ValueError, TypeError) as error:
            raise _candidate_error(name, error) from None
        layouts.append(_Layout(name, "given", list(rules), specs))
    if builtin:
        found = parameters(params, step.uses)
        pairs = tensor_pairs(found)
        for strategy in strategies(mesh, step.data_axes):
            rules = strategy_rules(strategy, found, pairs, params, mesh)
            specs = match_partition_rules(rules, params, mesh=mesh)
            layouts.append(_Layout(strategy.name, "built-in", rules, specs))
    seen: dict[Any, str] = {}
    unique, repeated = [], []
    for layout in layouts:
        key = tuple(
            normalized(s)
            for s in jtu.tree_leaves(layout.specs)
            if isinstance(s, PartitionSpec)
        )
        if key not in seen:
            seen[key] = layout.name
            unique.append(layout)
        elif layout.origin == "given":
            repeated.append((layout.name, f"the same layout as {seen[key]}"))
    names: set[str] = set()
    for layout in unique:
        if layout.name in names:  # yours, and a built-in strategy's other layout
            raise _same_name_error(
                layout.name, "yours, and a built-in strategy with another layout"
            )
        names.add(layout.name)
    return unique, repeated


def _checked_options(
    params: PyTree,
    candidates: Any,
    builtin: bool,
    max_candidates: Any,
    time_budget: Any,
) -> list[tuple[str, Any]]:
    """The candidates given (`_given`); raises if `search_layout`'s options are
    out of range or leave nothing to compile."""
    if max_candidates is not None and max_candidates < 1:
        raise search_error(
            f"`max_candidates` must be at least 1; got {max_candidates}."
        )
    if time_budget is not None and not (_number(time_budget) and time_budget > 0):
        raise search_error(
            f"`time_budget` must be a positive number of seconds; got {time_budget}."
        )
    given = _given(candidates)
    if not given and not builtin:
        raise search_error(
            "there is nothing to compile: `builtin=False` and no `candidates`. Give "
            "rule lists as `candidates=`, or leave `builtin` on."
        )
    if not any(is_array(leaf) for leaf in jtu.tree_leaves(params)):
        raise search_error("the parameters `params` selects have no arrays to lay out.")
    return given


def _compiled(
    step: Step, layout: _Layout, budget: int, weights: Mapping[str, float]
) -> LayoutCandidate | str:
    """`layout` compiled and judged, or why JAX cannot type the step with it (on
    an Explicit mesh: the other layouts may do)."""
    mesh = step.mesh
    try:
        report = step.report(layout.specs)
    except OutOfMemory as error:  # the TPU compiler checks the fit itself
        return _REFUSED + str(error).split(": ", 1)[1]
    except (TypeError, ValueError) as error:
        if not (AxisType.Explicit in mesh.axis_types and _untyped(error)):
            raise
        return _untyped_why(error)
    text = rules_text(
        step.params,
        layout.specs,
        header=[
            f"{layout.name}: made by eqshard.search_layout for mesh "
            f"{dict(mesh.shape)}, compiled peak "
            f"{format_bytes(report.memory.peak_bytes)} of "
            f"{format_bytes(budget)} per device"
        ],
    )
    cost = _cost(report, weights)
    return LayoutCandidate(
        layout.name,
        layout.origin,
        layout.rules,
        layout.specs,
        report,
        budget,
        cost,
        text,
        exposed_cost=_cost(report, weights, exposed=True),
    )


_REFUSED = "does not fit: "  # a layout the compiler itself refused


def _floor(step: Step, layout: _Layout) -> int:
    """A floor of `layout`'s compiled peak: its arguments' bytes per device (0
    where the layout cannot even place them: compiling it says why)."""
    try:
        return step.argument_floor(layout.specs)
    except (ValueError, TypeError):
        return 0


def _cannot_fit(floor: int, budget: int) -> str:
    return (
        f"cannot fit: its arguments alone are {format_bytes(floor)} per device, "
        f"over the {format_bytes(budget)} budget, and another layout fits"
    )


def _ranked(compiled: list[LayoutCandidate]) -> list[LayoutCandidate]:
    """The layouts that fit first, fastest first where all have a time (a
    target), else least exposed communication first, then least in all; then
    the others, smallest first; ties in the order they were compiled."""
    order = {id(c): i for i, c in enumerate(compiled)}
    timed = all(c.step_s is not None for c in compiled)
    return sorted(
        compiled,
        key=lambda c: (
            not c.fits,
            (c.step_s or 0.0) * (c.fits and timed),
            c.exposed_cost if c.fits else c.memory.peak_bytes,
            c.cost,
            c.memory.peak_bytes,
            order[id(c)],
        ),
    )


@typecheck
def search_layout(
    fn: Callable[..., Any],
    *args: Any,
    params: Any = 0,
    mesh: Mesh | AbstractMesh | None = None,
    device_memory: Int | float | str | None = None,
    candidates: Any = None,
    builtin: bool = True,
    bandwidth: Mapping[str, Int | float | np.floating] | None = None,
    max_candidates: Int | None = None,
    time_budget: int | float | None = None,
    progress: bool = True,
) -> LayoutSearch:
    """Chooses a layout of the parameters by compiling the step `fn(*args)` for each
    candidate: those whose compiled peak fits `device_memory`, ranked by estimated
    seconds on a target mesh, else by the communication XLA put in.

    The arrays that follow the parameters (an optimizer state) follow each
    candidate; every other array keeps its layout. Candidates are yours and
    built-in ones (replicated, FSDP, tensor-parallel pairs from the step's matmuls):
    [how-to](../how-to/find-a-layout.md#how-the-candidates-are-made).

    **Arguments:**

    - `fn`: the step as you call it (plain, or a `jax.jit` or filtered jit one).
    - `*args`: its arguments, concrete or abstract (the batch with its shardings).
    - `params`: the parameters among `args`: an index, or a function of the
      argument tuple returning them (`lambda args: args[1][0]`).
    - `mesh`: a concrete mesh (a target's too); defaults to `jax.set_mesh`'s.
    - `device_memory`: the budget per device (`"16GiB"`, bytes; a target's default).
    - `candidates`: your rule lists, a list or a dict from names to lists;
      `builtin`: whether to add the built-in strategies.
    - `bandwidth`: relative bandwidths of mesh axes (`{"dcn": 0.1}`), not on a
      target mesh.
    - `max_candidates`, `time_budget`: at most this many layouts (yours first),
      and no compile started after this many seconds; `progress`: a progress bar.

    **Returns:**

    A [`eqshard.LayoutSearch`][]: `.best` (or `None`) and the ranked `.candidates`
    (`rules`, `rules_text()`, memory, bytes, `step_s` on a target, the `report`).

    **Raises:**

    `ValueError` for an `AbstractMesh`, an argument on another mesh, a `params`
    that selects nothing or a state whose items follow one another (the message
    gives the `params=` to use), rules that cannot lay out the parameters, two
    candidates of one name, no candidate JAX can type, or bad options;
    `TypeError` for a `params` that is neither an index nor a function.

    !!! Example

        ```python
        step = eqshard.filter_jit(train_step, in_specs=(P("dp"), rules), mesh=mesh)
        result = eqshard.search_layout(step, batch, (model, opt_state),
            params=lambda args: args[1][0], mesh=mesh, device_memory="16GiB")
        print(result)  # the layouts ranked, the best one's rules
        ```
    """
    found = require_mesh(mesh, caller=CALLER)
    if not isinstance(found, Mesh):
        raise _abstract_mesh_error(found)
    mesh = found
    budget = _budget(device_memory, mesh)
    weights = _bandwidth(bandwidth, mesh)
    selection = select(args, params, caller=CALLER)
    check_parameters(selection, caller=CALLER)
    given = _checked_options(
        selection.tree, candidates, builtin, max_candidates, time_budget
    )
    start = time.perf_counter()
    step = Step(fn, args, selection, mesh)
    layouts, skipped = _layouts(given, builtin, step, mesh)
    if max_candidates is not None:
        skipped += [
            (layout.name, "max_candidates") for layout in layouts[max_candidates:]
        ]
        layouts = layouts[:max_candidates]
    # A layout whose arguments alone exceed the budget cannot win once another
    # fits: it is compiled last, and only if none has.
    floors = {layout.name: _floor(step, layout) for layout in layouts}
    layouts = [x for x in layouts if floors[x.name] <= budget] + [
        x for x in layouts if floors[x.name] > budget
    ]
    compiled: list[LayoutCandidate] = []
    untyped: list[tuple[str, str]] = []
    bar = _Progress(len(layouts), progress, sys.stderr)
    try:
        for i, layout in enumerate(layouts):
            late = time_budget is not None and time.perf_counter() - start > time_budget
            if i and late:
                skipped += [(rest.name, "time budget") for rest in layouts[i:]]
                break
            floor = floors[layout.name]
            if floor > budget and any(c.fits for c in compiled):
                skipped.append((layout.name, _cannot_fit(floor, budget)))
            else:
                done = _compiled(step, layout, budget, weights)
                if isinstance(done, LayoutCandidate):
                    compiled.append(done)
                elif done.startswith(_REFUSED):
                    skipped.append((layout.name, done))
                else:
                    untyped.append((layout.name, done))
            bar.update(layout.name)
    finally:
        bar.close()
    if untyped and not compiled:
        raise _all_untyped_error(untyped)
    ranked = _ranked(compiled)
    found = parameters(step.params, step.uses)
    return LayoutSearch(
        function=ranked[0].report.function if ranked else function_name(fn),
        mesh=tuple((str(a), int(n)) for a, n in mesh.shape.items()),
        device_memory=budget,
        data_axes=step.data_axes,
        bandwidth=tuple(sorted(weights.items())),
        candidates=tuple(ranked),
        skipped=tuple(skipped + untyped),
        unpaired=tuple(unpaired(found, tensor_pairs(found))) if builtin else (),
    )
