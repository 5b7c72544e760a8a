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
from .._report import format_bytes, parse_bytes, Report
from .._spectree._select import split_state
from .._spectree._spec_args import is_partition_rules, resolve_specs
from .._spectree._specs import leaf_specs, ShardingProblem, spec_error_message
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
                f"  {name:<16} {format_bytes(report.bytes_per_device[fullest]):>10}"
                f"   ({report.total_parameters:,} elements, {'/'.join(dtypes)})"
            )
        if self.pipeline is not None:
            lines.append(self.pipeline.line())
        if self.context is not None:
            lines.append(self.context.line())
        total = format_bytes(self.max_bytes_per_device)
        line = f"  {'total':<16} {total:>10}"
        headroom = self.headroom
        if self.device_memory is not None and headroom is not None:
            budget = format_bytes(self.device_memory)
            if headroom >= 0:
                line += f"   of {budget}: fits, {format_bytes(headroom)} to spare"
            else:
                line += f"   of {budget}: DOES NOT FIT, {format_bytes(-headroom)} over"
        lines.append(line)
        if any(self.host_bytes_per_device):
            host = format_bytes(self.host_bytes_per_device[fullest])
            copy = format_bytes(self.copy_bytes_per_device[fullest])
            lines.append(
                f"  {'in host memory':<16} {host:>10}   (offloaded between steps; "
                f"the total counts the update's device copy, {copy})"
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
    """Plans the memory of training: parameters, gradients and optimizer state on
    each device, against a per-device budget, without allocating anything.

    The parameters are the arrays of `tree` (concrete or abstract:
    `eqx.filter_eval_shape(Model, ..., key=key)` plans a 70B model on a laptop),
    placed by `specs` as in [`eqshard.analyze_sharding_strategy`][], or where they
    are if `specs` is `None`. Given a whole training state, such as `(model,
    opt_state)`, `params` picks the parameters as [`eqshard.search_layout`][]'s
    `params` does: the rest of `tree` is then planned as the optimizer state
    (each array that follows a parameter with its spec, the others replicated),
    instead of `optimizer.init`'s. Gradients are one per trained floating-point
    parameter (see `trainable`), with its spec. The optimizer state is
    `jax.eval_shape(optimizer.init, ...)` of the trained floating-point
    parameters (so optax's own dtypes and shapes, e.g. Adafactor's
    factored moments, count), and each of its arrays follows the parameter it
    belongs to: the same spec for the same shape, the spec without the reduced
    dimension for a factored moment, replicated for step counts and other
    scalars. Activations, temporaries and the compiled program are not counted:
    leave headroom for them. Every array counts in the dtype it would be placed in,
    as [`eqshard.shard`][] places it: float64 and int64 (data or dtypes asked for)
    are 32-bit while `jax_enable_x64` is off.

    A spec that cannot apply is reported as
    [`eqshard.analyze_sharding_strategy`][] reports it: listed in `plan.problems`
    and in the summary, and counted with the nearest spec that applies; such a
    plan is not the one asked for, so `plan.fits` is `False`.
    `on_invalid="warn"` also warns, and `on_invalid="raise"` raises instead.

    **Arguments:**

    - `tree`: the parameters, any pytree such as an Equinox model; or a whole
      training state with `params`. Concrete or abstract.
    - `specs`: a spec tree for the parameters or a prefix of one, partition
      rules, or a function of the abstract parameters (see
      [the spec-tree family](specs.md)); or `None` to read the shardings the
      arrays have.
    - `mesh`: a `Mesh`, or an `AbstractMesh` to plan for devices you do not have;
      defaults to the mesh set by `jax.set_mesh`, then to the mesh of the
      `NamedSharding`s.
    - `params`: in a whole state `tree`, which part is the parameters: an index
      (`0` for `(model, opt_state)`), or a function of `tree` returning a
      subtree of it (`lambda state: state[0]`). `None` (the default): all of
      `tree`.
    - `optimizer`: an optax `GradientTransformation` (anything with `.init`), or
      `None` for no optimizer state (or the one in `tree`, with `params`).
    - `param_dtype`: the dtype of the floating-point parameters (e.g.
      `jnp.bfloat16`); by default their own.
    - `state_dtype`: the dtype of the optimizer state's floating-point arrays
      (e.g. `jnp.float32` moments with bf16 parameters); by default what
      `optimizer.init` makes of the parameters.
    - `grad_dtype`: the dtype of the gradients; by default the parameters'.
    - `gradients`: whether to count gradients.
    - `device_memory`: the memory of one device, in bytes or as a string such as
      `"80GiB"`; the plan then says whether it fits and by how much. On a
      target's mesh (`create_mesh(target=...)`) by default the target's, as
      [`eqshard.analyze_step`][] takes it.
    - `trainable`: which arrays are trained, as the `filter_spec` of
      `eqx.partition`: a bool, a callable of a leaf returning a bool, or a tree of
      them (a prefix of `params`). The floating-point arrays it selects get
      gradients and optimizer state; the rest (frozen layers, the initial values
      of `eqx.nn.StateIndex` caches) are planned as parameters only. `True` (the
      default) trains every floating-point array. A callable is given each leaf
      as it is in `params`: for an abstract tree, a `jax.ShapeDtypeStruct`
      (which `eqx.is_inexact_array` is `False` for).
    - `on_invalid`: for specs that cannot apply, `"ignore"` (the default)
      reports them, `"warn"` reports them and warns, `"raise"` raises.
    - `pipeline`: for a model run by [`eqshard.pipeline`][], its schedule:
      `{"microbatches": M, "activation": one microbatch's activation (a
      jax.ShapeDtypeStruct of its global shape), "activation_spec": its layout
      over the other axes (default P()), "axis": "pp", "schedule": "gpipe",
      "repeats": 1}`. The plan adds on every device the stage inputs the loop
      keeps for the backward pass, `(R·M + S - 1)` microbatch activations,
      its buffers of the microbatches' inputs and outputs, `2·M` of them, and
      what the backward loop holds in flight, `R·M + 1` (`plan.pipeline`:
      within 10 % of the compiled step's temporaries where activations
      dominate); the parameters and optimizer state are per stage as
      their specs say (`eqshard.stacked(spec, stages="pp")`). With
      `"fsdp_gather"` (`pipeline`'s option), `"layers"` (L) and
      `"layer_bytes"` (one layer's weights on a device once gathered over the
      data axes), it adds the weights that option holds gathered: K = L/(R·S)
      layers for `"per_step"`, R·K for `"once"`, 2·K for `"per_repeat"`.
    - `offload_copy`: the fraction of the arrays kept in host memory
      ([`eqshard.host`][]) that the step holds on the device at once: its
      update needs a device copy of what it updates, so `1.0` (the default)
      counts all of it. The compiled step's figures
      ([`eqshard.analyze_step`][]) say what XLA made of it.
    - `context`: for attention with the sequence split over a mesh axis
      ([`eqshard.dot_product_attention`][]): `{"query": its global [B, T, N, H]
      jax.ShapeDtypeStruct, "kv_heads": K (default N), "axis": "cp",
      "strategy": "ring", "batch_axes": the batch's axes (default the mesh's
      dp, fsdp, data), "activation": one layer's kept [B, T, D] activation,
      "layers": how many are kept (1), "block_size": the ring's, if given}`.
      The plan adds on every device one layer's attention buffers (float32
      scores: tiles of `T/n` keys for the ring, `T/n x T` for all-gather, `T x T`
      for `N/n` heads for Ulysses; the keys and values gathered or in flight;
      within 10 % of XLA:CPU's temporaries at `T >= 2048`; a GPU's compiler
      may hold fewer: check with [`eqshard.analyze_step`][] on its target),
      and the kept activations with their sequence split over the axis.

    Arrays kept in host memory between steps count apart, in
    `plan.host_bytes_per_device`; with partition rules as `specs`, the rules
    are matched against the parameters and the optimizer state built together,
    as [`eqshard.init_sharded`][] matches them, so a host rule such as
    `("(mu|nu)/", eqshard.host())` offloads the moments in the plan too.

    **Returns:**

    A [`eqshard.TrainingPlan`][]: `plan.bytes_per_device`, `plan.fits`,
    `plan.headroom`, and `print(plan)` for the summary and per-device view.

    **Raises:**

    - `ValueError` as [`eqshard.analyze_sharding_strategy`][] does (with
      `on_invalid="raise"`, naming every parameter whose spec cannot apply), or for
      a `device_memory` that is not an amount of memory.
    - `ValueError` for a `params` that selects nothing, or a state whose items
      follow one another (the message gives the `params` to use), or given with
      `optimizer`.
    - `TypeError` if `optimizer` has no `.init` method.

    !!! Example

        ```python
        import optax

        shapes = eqx.filter_eval_shape(make_model, jax.random.key(0))
        specs = eqshard.match_partition_rules(rules, shapes)
        mesh = jax.sharding.AbstractMesh((64,), ("fsdp",))
        plan = eqshard.plan_training(
            shapes, specs, mesh, optimizer=optax.adamw(1e-4),
            param_dtype=jnp.bfloat16, state_dtype=jnp.float32,
            device_memory="80GiB",
        )
        print(plan)  # per part, the total against 80 GiB, a bar per device
        plan.fits, plan.headroom
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
        if given_state is not None:
            state_leaves, state_specs = given_state_pairs(
                given_state, facts, _abstract, state_dtype
            )
        else:
            state_leaves, state_specs = optimizer_state(
                optimizer, facts, rules, _abstract, state_dtype, mesh
            )
        state_report = analyze_pairs(state_leaves, state_specs, mesh, caller=caller)
        parts.append((state_leaves, state_specs))
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
