"""Training-memory plans: what parameters, gradients and optimizer state put on
each device, against a per-device budget, before anything is allocated.

The way through: the parameters' specs (given, or read from the arrays) ->
abstract parameters in the dtype asked -> `jax.eval_shape(optimizer.init, ...)`
for the optimizer state, whose specs follow the parameters they belong to ->
one `ShardingReport` per part (`analyze_pairs`) -> their sum per device, the
budget, and a per-device picture.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh
from jaxtyping import PyTree

from .._mesh._current import mesh_repr
from .._mesh._targets import device_memory as device_memory_of
from .._report import format_bytes, memory_row, parse_bytes, Report
from .._spectree._check_spec import leaf_specs, ShardingProblem, spec_error_message
from .._spectree._resolve import is_partition_rules, resolve_specs
from .._spectree._select import split_state
from .._tree import (
    grouped_paths,
    is_array,
    PathGroup,
)
from .._typing import (
    check_choice,
    ON_INVALID,
    OnInvalid,
    typecheck,
)
from ._inspect import own_shardings, ShardingReport, ShardingRow
from ._plan_context import context_buffers, ContextBuffers
from ._plan_pipeline import pipeline_buffers, PipelineBuffers
from ._plan_state import (
    abstracter,
    check_optimizer,
    given_state_pairs,
    host_bytes,
    optimizer_state,
    trained_mask,
)
from ._strategy import analyze_pairs


# ---------------------------------------------------------------------------------
# The plan.
# ---------------------------------------------------------------------------------


_BAR = 32  # characters of a full bar
_MAX_LINES = 16  # device groups shown before "..."


def _device_groups(values: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive devices holding as much: `(first, last, bytes)`."""
    groups: list[tuple[int, int, int]] = []
    for i, value in enumerate(values):
        if groups and groups[-1][2] == value:
            groups[-1] = (groups[-1][0], i, value)
        else:
            groups.append((i, i, value))
    return groups


def _bar(value: int, scale: int) -> str:
    filled = 0 if scale == 0 else round(_BAR * min(value, scale) / scale)
    return "█" * filled + "░" * (_BAR - filled)


@dataclasses.dataclass(frozen=True, repr=False)
class TrainingPlan(Report):
    """What training a model puts on each device: parameters, gradients and
    optimizer state; made by [`eqshard.plan_training`][].

    `str(plan)` is the summary and the per-device view; `plan.show()` prints them
    with `rich` when it is installed; `plan.to_json()` is a byte-stable `str`.

    **Fields:**

    - `mesh`: the mesh planned for.
    - `params`, `grads`, `opt_state`: a [`eqshard.ShardingReport`][] for each part
      (`grads` and `opt_state` are `None` when not planned).
    - `bytes_per_device`: the bytes of all parts in each device's own memory,
      in `mesh.devices.flat` order (mesh coordinate order for an
      `AbstractMesh`): the arrays kept there, and the device copy of the
      offloaded ones that the update holds (`copy_bytes_per_device`).
    - `device_memory`: the per-device budget in bytes, or `None`.
    - `pipeline`: what a pipeline schedule keeps on each device
      (`PipelineBuffers`: `kept`, `buffers`, `total`, `steps`, `bubble`), or
      `None`.
    - `host_bytes_per_device`: the bytes of the arrays kept in host memory
      between steps ([`eqshard.host`][]), per device (each device's shards, in
      the host memory attached to it); zeros when nothing is offloaded.
    - `copy_bytes_per_device`: of `bytes_per_device`, the device copy of the
      offloaded arrays that the update needs (`offload_copy` of
      [`eqshard.plan_training`][]).
    - `context`: what context-parallel attention holds on each device
      (`ContextBuffers`: `scores`, `keys_values`, `accumulators`,
      `activations`, `total`), or `None`.
    """

    mesh: Mesh | AbstractMesh
    params: ShardingReport
    grads: ShardingReport | None
    opt_state: ShardingReport | None
    bytes_per_device: tuple[int, ...]
    device_memory: int | None
    pipeline: PipelineBuffers | None = None
    host_bytes_per_device: tuple[int, ...] = ()
    copy_bytes_per_device: tuple[int, ...] = ()
    context: ContextBuffers | None = None

    @property
    def parts(self) -> tuple[tuple[str, ShardingReport], ...]:
        """The planned parts, as `(name, report)` pairs."""
        named = (
            ("parameters", self.params),
            ("gradients", self.grads),
            ("optimizer state", self.opt_state),
        )
        return tuple((name, report) for name, report in named if report is not None)

    @property
    def problems(self) -> tuple[ShardingProblem, ...]:
        """The parameters whose spec cannot apply (which [`eqshard.shard`][] would
        refuse), each planned with the nearest spec that applies; their gradients
        and optimizer state follow them."""
        return self.params.problems

    @property
    def max_bytes_per_device(self) -> int:
        """The most bytes any device holds."""
        return max(self.bytes_per_device)

    @property
    def headroom(self) -> int | None:
        """`device_memory - max_bytes_per_device`: negative by as much as the plan
        does not fit; `None` without a budget."""
        if self.device_memory is None:
            return None
        return self.device_memory - self.max_bytes_per_device

    @property
    def fits(self) -> bool:
        """Whether every spec applies and every device holds at most
        `device_memory` (`True` without a budget); a plan with `problems` is not
        the plan asked for, so it does not fit."""
        headroom = self.headroom
        return not self.problems and (headroom is None or headroom >= 0)

    def largest_replicated(
        self, n: int | None = 5
    ) -> tuple[tuple[str, ShardingRow], ...]:
        """The `n` largest arrays of any part placed whole on every device (or on
        a single device), largest first, as `(part, row)` pairs (all of them for
        `None`)."""
        rows = [
            (name, row)
            for name, report in self.parts
            for row in report.rows
            if row.replicated or row.single_device
        ]
        return tuple(sorted(rows, key=lambda item: -item[1].nbytes)[:n])

    def _largest_groups(self, n: int) -> list[tuple[str, ShardingRow, str, int]]:
        """`largest_replicated` with a parameter's gradient and optimizer state
        on its line (where placed whole too, with its shape and spec):
        `(part, row, " (+ grad, mu, nu)", their bytes)`, the `n` largest."""
        rows = self.largest_replicated(None)
        key = {i: (row.shape, row.spec) for i, (_, row) in enumerate(rows)}
        params = {r.path: i for i, (part, r) in enumerate(rows) if part == "parameters"}
        grads: dict[int, int] = {}  # parameter's row -> its gradient's
        for i, (part, row) in enumerate(rows):
            lead = params.get(row.path)
            if part == "gradients" and lead is not None and key[lead] == key[i]:
                grads[lead] = i
        placed = set(grads.values())
        listed = [i for i in range(len(rows)) if i not in placed]
        paths = [
            f"{'o' if rows[i][0] == 'optimizer state' else 'p'}/{rows[i][1].path}"
            for i in listed
        ]
        out = []
        for group in grouped_paths(paths, [key[i] for i in listed]):
            lead = listed[group.leader]
            members = [(listed[i], label) for i, label in group.followers]
            if lead in grads:
                members.insert(0, (grads[lead], "grad"))
            total = sum(rows[i][1].nbytes for i in (lead, *(i for i, _ in members)))
            suffix = PathGroup(lead, tuple(members)).suffix
            out.append((rows[lead][0], rows[lead][1], suffix, total))
        return sorted(out, key=lambda item: -item[3])[:n]

    def summary(self) -> str:
        """One line per part with its bytes on the fullest device, then the total
        against the budget."""
        lines = [
            f"training memory on mesh {mesh_repr(self.mesh)} "
            f"({len(self.bytes_per_device)} devices), on the fullest device:"
        ]
        fullest = int(np.argmax(self.bytes_per_device))
        for name, report in self.parts:
            dtypes = sorted({row.dtype for row in report.rows})
            lines.append(
                memory_row(
                    name,
                    report.bytes_per_device[fullest],
                    f"({report.total_parameters:,} elements, {'/'.join(dtypes)})",
                )
            )
        if self.pipeline is not None:
            lines.append(self.pipeline.line())
        if self.context is not None:
            lines.append(self.context.line())
        verdict = ""
        headroom = self.headroom
        if self.device_memory is not None and headroom is not None:
            budget = format_bytes(self.device_memory)
            if headroom >= 0:
                verdict = f"of {budget}: fits, {format_bytes(headroom)} to spare"
            else:
                verdict = f"of {budget}: DOES NOT FIT, {format_bytes(-headroom)} over"
        lines.append(memory_row("total", self.max_bytes_per_device, verdict))
        if any(self.host_bytes_per_device):
            copy = format_bytes(self.copy_bytes_per_device[fullest])
            lines.append(
                memory_row(
                    "in host memory",
                    self.host_bytes_per_device[fullest],
                    "(offloaded between steps; the total counts the update's "
                    f"device copy, {copy})",
                )
            )
        other = "other " if self.context is not None else ""
        lines.append(
            f"  ({other}activations, temporaries and the compiled program come on top)"
        )
        if self.problems:
            lines.append(
                "NOT THE PLAN ASKED FOR: "
                + spec_error_message("plan_training", self.problems, corrected=True)
            )
        return "\n".join(lines)

    def _view_rows(self) -> tuple[int, list[tuple[str, str, str, bool]]]:
        values = self.bytes_per_device
        scale = max(self.max_bytes_per_device, self.device_memory or 0)
        rows = []
        groups = _device_groups(values)
        shown = groups[:_MAX_LINES]
        for first, last, value in shown:
            label = f"device {first}" if first == last else f"devices {first}-{last}"
            over = self.device_memory is not None and value > self.device_memory
            rows.append((label, _bar(value, scale), format_bytes(value), over))
        if len(groups) > len(shown):
            rest = values[shown[-1][1] + 1 :]
            rows.append(
                (
                    f"... {len(groups) - len(shown)} more groups",
                    "",
                    f"{format_bytes(min(rest))}-{format_bytes(max(rest))}",
                    False,
                )
            )
        return scale, rows

    def device_view(self, n: int = 5) -> str:
        """A compact per-device picture: a bar per device (consecutive devices
        holding as much share a line) scaled to the budget, then the `n` largest
        replicated arrays."""
        scale, rows = self._view_rows()
        width = max(len(label) for label, *_ in rows)
        budget = (
            f", the bar's end is the budget {format_bytes(self.device_memory)}"
            if self.device_memory is not None and scale == self.device_memory
            else ""
        )
        lines = [f"bytes per device{budget}:"]
        for label, bar, value, over in rows:
            flag = "  over budget" if over else ""
            lines.append(f"  {label:<{width}}  {bar}  {value}{flag}".rstrip())
        largest = self._largest_groups(n)
        if largest:
            lines.append("largest arrays placed whole on a device:")
            for part, row, suffix, nbytes in largest:
                where = "single device" if row.single_device else "replicated"
                lines.append(
                    f"  {format_bytes(nbytes):>10}  {part}: {row.path}{suffix} "
                    f"{row.shape} {row.dtype} ({where})"
                )
        return "\n".join(lines)

    def table(self) -> str:
        """The summary and the per-device view."""
        return self.summary() + "\n\n" + self.device_view()

    def _summary(self) -> dict[str, Any]:
        return {
            "parts": [name for name, _ in self.parts],
            "max_bytes_per_device": self.max_bytes_per_device,
            "device_memory": self.device_memory,
            "max_host_bytes_per_device": max(self.host_bytes_per_device, default=0),
            "fits": self.fits,
            "problems": len(self.problems),
            "mesh": dict(self.mesh.shape),
        }

    def _rich(self) -> list[Any]:
        """The summary, coloured bars (red over budget) and the largest replicated
        arrays."""
        from rich.table import Table
        from rich.text import Text

        out: list[Any] = [Text(self.summary())]
        _, rows = self._view_rows()
        table = Table(title="bytes per device", show_header=False, box=None)
        for label, bar, value, over in rows:
            style = "red" if over else "green"
            table.add_row(label, f"[{style}]{bar}[/{style}]", value)
        out.append(table)
        largest = self._largest_groups(5)
        if largest:
            replicated = Table(title="largest arrays placed whole on a device")
            for header in ("bytes", "part", "path", "shape", "dtype"):
                replicated.add_column(header)
            for part, row, suffix, nbytes in largest:
                replicated.add_row(
                    format_bytes(nbytes),
                    part,
                    row.path + suffix,
                    str(row.shape),
                    row.dtype,
                )
            out.append(replicated)
        return out


def _total(
    params: ShardingReport,
    reports: tuple[ShardingReport | None, ...],
    buffers: tuple[PipelineBuffers | ContextBuffers | None, ...],
) -> tuple[int, ...]:
    """The bytes on each device: the parts', a pipeline's and an attention's."""
    total = np.asarray(params.bytes_per_device, dtype=np.int64)
    total += sum(0 if b is None else b.total for b in buffers)
    for report in reports:
        if report is not None:
            total += np.asarray(report.bytes_per_device, dtype=np.int64)
    return tuple(total.tolist())


def _buffers(
    pipeline: Mapping[str, Any] | None,
    context: Mapping[str, Any] | None,
    mesh: Mesh | AbstractMesh,
    gradients: bool,
) -> tuple[PipelineBuffers | None, ContextBuffers | None]:
    """What a pipeline schedule and context-parallel attention keep, if asked."""
    return (
        None if pipeline is None else pipeline_buffers(pipeline, mesh),
        None
        if context is None
        else context_buffers(context, mesh, gradients=gradients),
    )


def _state(
    given_state: Any,
    optimizer: Any,
    facts: tuple[Any, ...],
    rules: Any,
    abstract: Any,
    state_dtype: Any,
    mesh: Any,
) -> tuple[list[Any], Any]:
    """The optimizer state's leaves and specs: the state given beside the
    parameters, else the one `optimizer.init` would build."""
    if given_state is not None:
        return given_state_pairs(given_state, facts, abstract, state_dtype)
    return optimizer_state(optimizer, facts, rules, abstract, state_dtype, mesh)


@typecheck
def plan_training(
    tree: PyTree,
    /,
    specs: PyTree = None,
    mesh: Mesh | AbstractMesh | None = None,
    *,
    params: Any = None,
    optimizer: Any = None,
    param_dtype: Any = None,
    state_dtype: Any = None,
    grad_dtype: Any = None,
    gradients: bool = True,
    trainable: Any = True,
    device_memory: int | str | None = None,
    on_invalid: OnInvalid = "ignore",
    pipeline: Mapping[str, Any] | None = None,
    offload_copy: float = 1.0,
    context: Mapping[str, Any] | None = None,
) -> TrainingPlan:
    """Plans the memory of training per device (parameters, gradients, optimizer
    state, pipeline and attention buffers) against a budget, allocating nothing.

    `tree` may be abstract (`eqx.filter_eval_shape`: a 70B model plans on a laptop);
    activations, temporaries and the program are left to [`eqshard.analyze_step`][].
    [The how-to](../how-to/will-it-fit.md#what-plan_training-counts) tells each
    part, and the keys of `pipeline` and `context`.

    **Arguments:**

    - `tree`: the parameters (any pytree), or a whole state with `params`.
    - `specs`: a spec tree or prefix, partition rules, a function of the abstract
      parameters, or `None` for the arrays' own shardings.
    - `mesh`: a `Mesh` (a target's too) or an `AbstractMesh`; defaults to
      `jax.set_mesh`'s, then to the arrays'.
    - `params`: in a whole state, the parameters (an index or a selector, as
      [`eqshard.search_layout`][]'s); the rest is planned as optimizer state.
    - `optimizer`: an optax `GradientTransformation`, or `None`.
    - `param_dtype`, `state_dtype`, `grad_dtype`: dtypes to plan in (by default
      the parameters' own and what `optimizer.init` makes).
    - `gradients`: whether to count them; `trainable`: which arrays are trained.
    - `device_memory`: the budget (`"80GiB"` or bytes; a target's by default).
    - `on_invalid`: `"ignore"`, `"warn"` or `"raise"` for specs that cannot apply.
    - `pipeline`, `context`: [`eqshard.pipeline`][]'s schedule and
      [`eqshard.dot_product_attention`][]'s split, as dicts.
    - `offload_copy`: the share of host-memory arrays the step holds on device.

    **Returns:**

    A [`eqshard.TrainingPlan`][] (`bytes_per_device`, `fits`, `headroom`; print it).

    **Raises:**

    `ValueError` for a spec that cannot apply (`on_invalid="raise"`), a budget
    that is no amount of memory, a `params` selecting nothing, or a refused
    `pipeline` or `context`; `TypeError` for an `optimizer` without `.init`.

    !!! Example

        ```python
        shapes = eqx.filter_eval_shape(make_model, jax.random.key(0))
        plan = eqshard.plan_training(shapes, rules, mesh, optimizer=optax.adamw(1e-4),
                                     device_memory="80GiB")
        print(plan)  # per part, the total against 80 GiB, a bar per device
        ```
    """
    caller = "plan_training"
    check_choice(on_invalid, ON_INVALID, caller=caller, name="on_invalid")
    check_optimizer(optimizer, caller)
    params, given_state = split_state(tree, params, optimizer, caller=caller)
    budget = None if device_memory is None else parse_bytes(device_memory)
    rules = specs if is_partition_rules(specs) else None
    specs = resolve_specs(specs, params, caller=caller, mesh=mesh)
    if specs is None:
        pairs = own_shardings(params, caller)
    else:
        pairs = leaf_specs(specs, params, caller=caller)
    leaves = jtu.tree_leaves(params)
    trained = trained_mask(trainable, params, caller)
    _abstract = abstracter()
    abstract = [_abstract(leaf, param_dtype) for leaf in leaves]
    param_report = analyze_pairs(
        abstract, pairs, mesh, caller=caller, on_invalid=on_invalid
    )
    mesh = param_report.mesh
    parts: list[tuple[list[Any], Any]] = [(abstract, pairs)]
    grad_report = None
    if gradients and grad_dtype is None and trained == list(map(is_array, abstract)):
        # Every array is trained: its gradient is the parameter's report again.
        grad_report = param_report
    elif gradients:
        grads = [
            (leaf if grad_dtype is None else _abstract(leaf, grad_dtype))
            if train
            else None
            for leaf, train in zip(abstract, trained, strict=True)
        ]
        grad_report = analyze_pairs(grads, pairs, mesh, caller=caller)
    state_report = None
    if given_state is not None or optimizer is not None:
        facts = (jtu.tree_structure(params), abstract, trained, pairs)
        state = _state(
            given_state, optimizer, facts, rules, _abstract, state_dtype, mesh
        )
        state_report = analyze_pairs(*state, mesh, caller=caller)
        parts.append(state)
    buffers = _buffers(pipeline, context, mesh, gradients)
    total = _total(param_report, (grad_report, state_report), buffers)
    host = host_bytes(parts, mesh, caller)
    copy = np.round(host * float(offload_copy)).astype(np.int64)
    total = tuple((np.asarray(total, dtype=np.int64) + copy - host).tolist())
    if budget is None and isinstance(mesh, Mesh):  # a target's: its memory
        budget = device_memory_of(list(mesh.devices.flat))
    return TrainingPlan(
        mesh=mesh,
        params=param_report,
        grads=grad_report,
        opt_state=state_report,
        bytes_per_device=total,
        device_memory=budget,
        pipeline=buffers[0],
        host_bytes_per_device=tuple(host.tolist()),
        copy_bytes_per_device=tuple(copy.tolist()),
        context=buffers[1],
    )
