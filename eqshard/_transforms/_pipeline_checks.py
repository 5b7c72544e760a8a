"""What `pipeline` checks before tracing, and its messages: the counts (layers,
batch, stages, repeats, microbatches), the options, the stack's layer axis, the
stage axis, the arguments split into microbatches (`batched_args`), and the
stack's layout. `schedule_counts` is shared with `plan_training(pipeline=)`, so
a plan refuses what the pipeline would.
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from .._mesh._current import mesh_repr
from .._tree import path_str, paths_text
from .._typing import KeyPath, warn
from ._shard_map_specs import array_layout


_CALLER = "pipeline"
SCHEDULES = ("gpipe", "circular")
OUTPUTS = ("all", "last")

ErrorOf = Callable[[str, str], ValueError]
_UNSAID = object()  # an argument `batched_args` says nothing about


def input_error(what: str, fix: str) -> ValueError:
    return ValueError(f"eqshard.{_CALLER}: {what}; {fix}")


def leaf_error(path: KeyPath, what: str, fix: str) -> ValueError:
    where = path_str(path) or "(root)"
    return input_error(f"the leaf at '{where}' {what}", fix)


def layer_output_error(h: Any, out: Any, has_aux: bool) -> ValueError:
    got = (
        f"{out.dtype}{list(out.shape)}"
        if eqx.is_array(out)
        else f"a {type(out).__name__}"
    )
    if has_aux:
        return input_error(
            f"`layer` returned {got} with has_aux=True",
            "a layer with has_aux=True returns a pair `(h, aux)`: `h` of its "
            "input's shape and dtype, `aux` a pytree of floating-point arrays "
            "(or pass has_aux=False).",
        )
    return input_error(
        f"`layer` returned {got} for an input {h.dtype}{list(h.shape)} (one "
        "microbatch)",
        "a pipelined layer must return an array of its input's shape and dtype "
        "(cast its result, e.g. `.astype(h.dtype)`, or keep what changes shape "
        "outside the pipeline); a layer returning `(h, aux)` needs has_aux=True.",
    )


def aux_error(path: KeyPath, leaf: Any) -> ValueError:
    got = f"{leaf.dtype}{list(leaf.shape)}" if eqx.is_array(leaf) else repr(leaf)
    return input_error(
        f"the layer's aux at '{path_str(path) or '(root)'}' is {got}, not a "
        "floating-point array",
        "return floating-point arrays in `aux` (summed over the layers and "
        "averaged over the microbatches), e.g. `jnp.asarray(value, jnp.float32)`.",
    )


def count(value: Any, name: str, error: ErrorOf = input_error) -> int:
    """`value` as an `int`: a Python or NumPy integer, a whole float or a
    concrete JAX integer scalar; anything else is eqshard's one-line error."""
    if isinstance(value, bool):
        value = None  # True is not a count
    elif isinstance(value, float | np.floating) and float(value).is_integer():
        value = int(value)
    elif isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jnp.integer):
        try:
            value = int(value) if value.ndim == 0 else value
        except jax.errors.ConcretizationTypeError:  # a traced count
            pass
    if isinstance(value, int | np.integer):
        return int(value)
    raise error(
        f"`{name}` is {value!r} ({type(value).__name__}), not a whole number",
        f"give `{name}` as an int, e.g. {name}=4.",
    )


def choice(value: Any, choices: tuple[str, ...], name: str) -> str:
    """`value` if it is one of `choices`, else eqshard's error naming them."""
    if name == "schedule" and value == "1f1b":
        raise input_error(
            "schedule='1f1b' is not offered: 1F1B interleaves each microbatch's "
            "backward pass with the others' forward passes, so it needs the loss "
            "inside the schedule, which `pipeline` (a function whose gradients JAX "
            "takes) does not see",
            "use 'gpipe', or 'circular' with repeats > 1 for a smaller bubble.",
        )
    if not (isinstance(value, str) and value in choices):
        listed = " or ".join(map(repr, choices))
        raise input_error(f"`{name}` is {value!r}", f"use {listed}.")
    return value


def schedule_counts(
    schedule: str, repeats: int, microbatches: int, stages: int, error: ErrorOf
) -> None:
    """The counts every schedule needs, whatever the batch: `pipeline`'s and
    `plan_training(pipeline=)`'s errors."""
    if schedule == "gpipe" and repeats != 1:
        raise error(
            f"has schedule='gpipe' with repeats={repeats}",
            "use schedule='circular' for more than one chunk per stage.",
        )
    if repeats < 1:
        raise error(f"has repeats={repeats}", "give at least 1.")
    if microbatches < 1:
        raise error(f"has microbatches={microbatches}", "give at least 1.")
    if schedule == "circular" and microbatches % stages:
        raise error(
            f"has the circular schedule, which needs microbatches a multiple of "
            f"the {stages} stages, got {microbatches}",
            f"use microbatches={stages * max(1, microbatches // stages)} or "
            "another multiple.",
        )


def check_counts(
    layers: int, batch: int, stages: int, repeats: int, microbatches: int, gpipe: bool
) -> None:
    if layers % (stages * repeats):
        raise input_error(
            f"the stack has {layers} layers, not a multiple of stages·repeats = "
            f"{stages}·{repeats}",
            "give a number of layers divisible by that, or change `repeats` or "
            "the size of the stage axis.",
        )
    if batch % microbatches:
        raise input_error(
            f"the batch (leading axis of `x`) is {batch}, not divisible by "
            f"microbatches={microbatches}",
            "choose `microbatches` dividing the batch.",
        )
    if gpipe and microbatches < stages:
        warn(
            f"eqshard.{_CALLER}: microbatches={microbatches} is fewer than the "
            f"{stages} stages, so the pipeline is mostly bubble (a fraction "
            f"{(stages - 1) / (microbatches + stages - 1):.2f} of its steps); use "
            f"microbatches >= {stages}."
        )


def layers_of(dyn: Any, staged: bool, plan_counts: tuple[int, int]) -> int:
    """L, the stack's number of layers: every array leaf's leading axis (or, for
    a stack in the circular view, its leading `(R, S, K)`)."""
    stages, repeats = plan_counts
    found: tuple[KeyPath, tuple[int, ...]] | None = None
    for path, leaf in jtu.tree_leaves_with_path(dyn):
        shape = tuple(leaf.shape)
        lead = shape[:3] if staged else shape[:1]
        if len(lead) < (3 if staged else 1):
            raise leaf_error(
                path,
                f"has shape {shape}, with no leading layer "
                f"{'axes (R, S, K)' if staged else 'axis'}",
                "every array leaf of `stack` needs one (build the stack with "
                "`eqx.filter_vmap` over the layer's constructor, or "
                "`eqshard.stack_layers` from a list of layers).",
            )
        if found is not None and lead != found[1]:
            raise leaf_error(
                path,
                f"has {'leading axes' if staged else 'layer axis'} {lead}, but "
                f"the one at '{path_str(found[0])}' has {found[1]}",
                "every array leaf of `stack` must share the layer axis.",
            )
        found = found or (path, lead)
        if staged and lead[:2] != (repeats, stages):
            raise leaf_error(
                path,
                f"has shape {shape}, not the view (repeats, stages, K, ...) = "
                f"({repeats}, {stages}, K, ...) that `staged=True` says",
                f"pass `eqshard.stage_view(stack, stages={stages}, "
                f"repeats={repeats})`, or the natural stack with `staged=False`.",
            )
    if found is None:
        raise input_error(
            "`stack` holds no arrays", "give the stacked layers' parameters."
        )
    return math.prod(found[1])


def check_mesh(on: Mesh | AbstractMesh, axis: str) -> int:
    """S, the size of `axis`, after checking it can be the stage axis."""
    if axis not in on.axis_names:
        raise input_error(
            f"the stage axis {axis!r} is not in mesh {mesh_repr(on)}",
            "name one of its axes with `axis=`, or build the mesh with a stage "
            f"axis, e.g. eqshard.create_mesh(..., ('{axis}', ...)).",
        )
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and axis in context.manual_axes:
        raise input_error(
            f"the stage axis {axis!r} is already manual here (inside a "
            "`shard_map` over it)",
            "call `pipeline` outside that map, or map over the other axes only "
            "(`axis_names=`).",
        )
    return dict(zip(on.axis_names, on.axis_sizes, strict=True))[axis]


def batched_leaves(args: tuple[Any, ...], batched_args: Any, batch: int) -> list[bool]:
    """Which array leaves of `args` are split into microbatches: those
    `batched_args` (a bool, or a prefix tree of bools over `args`) marks. An
    array with the batch's leading size that is not declared either way is an
    error: a per-row mask and a whole table of that size look alike."""
    arrays = eqx.filter(args, eqx.is_array)
    if batched_args is None or isinstance(batched_args, bool):
        spread: Any = _UNSAID if batched_args is None else batched_args
    else:
        spread = (
            tuple(batched_args)
            if isinstance(batched_args, list | tuple)
            else batched_args
        )
    try:
        marks = jtu.tree_map(
            lambda mark, sub: jtu.tree_map(
                lambda _: _UNSAID if mark is None else mark, sub
            ),
            spread,
            arrays,
            is_leaf=lambda m: m is None or m is _UNSAID or isinstance(m, bool),
        )
    except (ValueError, TypeError):
        raise input_error(
            f"`batched_args` is {batched_args!r}, which does not match the "
            f"{len(args)} arguments after `x`",
            "give one bool per argument (True: split into microbatches with "
            "`x`), a prefix tree of bools over them, or one bool for all.",
        ) from None
    flags = []
    for (path, leaf), mark in zip(
        jtu.tree_leaves_with_path(arrays),
        jtu.tree_leaves(marks, is_leaf=lambda m: m is _UNSAID),
        strict=True,
    ):
        per_row = bool(jnp.ndim(leaf)) and leaf.shape[0] == batch
        if mark is _UNSAID and per_row:
            where = f"args{jtu.keystr(path)}"
            raise input_error(
                f"the argument at {where} has shape {tuple(leaf.shape)}, its "
                f"leading axis the batch's size {batch}, and `batched_args` does "
                "not say whether it is per row",
                "pass batched_args=True (split every argument with `x`), False "
                "(pass them whole) or one bool per argument, e.g. "
                "batched_args=(True, False).",
            )
        if mark is True and not per_row:
            raise input_error(
                f"the argument at args{jtu.keystr(path)} has shape "
                f"{tuple(leaf.shape)}, declared batched but without the batch's "
                f"leading size {batch}",
                "mark it False in `batched_args`, or give it one row per example.",
            )
        flags.append(mark is True)
    return flags


class Plan(NamedTuple):
    """The counts of a pipeline, fixed before tracing."""

    axis: str
    stages: int  # S
    repeats: int  # R
    microbatches: int  # M
    chunk: int  # K = L / (R·S) layers per chunk
    output: str
    has_aux: bool
    gather: str = "per_step"  # fsdp_gather


def check_layout(dyn: Any, plan: Plan, staged: bool) -> None:
    """Warns, naming the leaves, when the stack's known layout (a placed array's,
    or its type on Explicit axes) is not the stages' own, so each call moves it."""
    dim = 1 if staged else 0
    fits = staged or plan.repeats == 1
    moved = []
    for path, leaf in jtu.tree_leaves_with_path(dyn):
        layout = array_layout(leaf)
        if isinstance(layout, str):  # no layout known: nothing to say
            continue
        spec = (*layout[0], *(None,) * (jnp.ndim(leaf) - len(layout[0])))
        if not fits or spec[dim] != plan.axis:
            moved.append(path)
    if moved:
        at = "P(None, axis)" if staged else "P(axis)"
        how = (
            f"lay the stack out with the layer axis over {plan.axis!r}, "
            f"{at} (`eqshard.stacked(spec, stages={plan.axis!r})`)"
            if fits
            else f"pass `eqshard.stage_view(stack, stages={plan.stages}, "
            f"repeats={plan.repeats})` with `staged=True`, laid out P(None, "
            f"{plan.axis!r}) (`eqshard.stacked(spec, stages={plan.axis!r})`)"
        )
        warn(
            f"eqshard.{_CALLER}: the stack's arrays at {paths_text(moved)} are "
            "not laid out as the stages hold them, so each call moves them "
            f"between devices first; {how}."
        )


GATHERS = ("per_step", "once", "per_repeat")


def _entry_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _known_spec(leaf: Any, need: str, name: str, fix: str) -> PartitionSpec:
    layout = array_layout(leaf)
    if isinstance(layout, str):
        raise input_error(f"fsdp_gather needs {need}, but {name} {layout}", fix)
    return layout[0]


def _data_axes(x: Any, fsdp_axes: Any, axis: str) -> tuple[str, ...]:
    """The data axes: `fsdp_axes`, or those splitting `x`'s batch."""
    if fsdp_axes is None:
        spec = _known_spec(
            x,
            "the data axes (those splitting `x`'s batch)",
            "`x`",
            "name them, e.g. `fsdp_axes=('fsdp',)`.",
        )
        return tuple(a for a in _entry_axes(spec[0] if spec else None) if a != axis)
    axes = (fsdp_axes,) if isinstance(fsdp_axes, str) else tuple(fsdp_axes)
    if not all(isinstance(a, str) for a in axes) or axis in axes:
        raise input_error(
            f"`fsdp_axes` is {fsdp_axes!r}",
            f"name the data axes as mesh axis names other than the stage axis "
            f"{axis!r}, e.g. ('fsdp',).",
        )
    return axes


def gather_specs(
    dyn: Any, x: Any, plan: Plan, staged: bool, named: tuple[Any, Any]
) -> list[PartitionSpec | None]:
    """Per array leaf of the stack, the spec of its dimensions after the layer
    axes with the data axes (and the stage axis) dropped, what `fsdp_gather`
    gathers it to; `None` for a leaf not split over a data axis (warned)."""
    fsdp_axes, stack_specs = named
    data = set(_data_axes(x, fsdp_axes, plan.axis))
    leaves = jtu.tree_leaves_with_path(dyn)
    if stack_specs is None:
        fix = (
            "pass the stack's specs, e.g. `stack_specs=` the tree of "
            "PartitionSpecs given to jit's in_shardings."
        )
        specs = [
            _known_spec(
                leaf, "the stack's layout", f"the leaf at '{path_str(path)}'", fix
            )
            for path, leaf in leaves
        ]
    else:
        specs = [
            s
            for s in jtu.tree_leaves(
                stack_specs, is_leaf=lambda s: isinstance(s, PartitionSpec)
            )
            if isinstance(s, PartitionSpec)
        ]
        if isinstance(stack_specs, PartitionSpec):
            specs = specs * len(leaves)
        if len(specs) != len(leaves):
            raise input_error(
                f"`stack_specs` has {len(specs)} specs for the stack's "
                f"{len(leaves)} arrays",
                "give one PartitionSpec per array leaf of the stack, as a tree "
                "of the stack's structure.",
            )
    lead = 3 if staged else 1
    out: list[PartitionSpec | None] = []
    unsplit = []
    for (path, leaf), spec in zip(leaves, specs, strict=True):
        spec = (*spec, *(None,) * (jnp.ndim(leaf) - len(spec)))[lead:]
        kept = [
            tuple(a for a in _entry_axes(e) if a not in data and a != plan.axis)
            for e in spec
        ]
        split = any(set(_entry_axes(e)) & data for e in spec)
        if not split:
            unsplit.append(path)
        out.append(
            PartitionSpec(*(k[0] if len(k) == 1 else (k or None) for k in kept))
            if split
            else None
        )
    if plan.gather != "per_step" and len(unsplit) == len(leaves):
        warn(
            f"eqshard.{_CALLER}: fsdp_gather={plan.gather!r}, but the stack's "
            f"arrays at {paths_text(unsplit)} are not split over a data axis "
            f"({sorted(data) or 'none found'}), so there is nothing to gather and "
            "the stage weights are used as they are; drop fsdp_gather, or lay "
            "the weights out over the data axes (FSDP)."
        )
    return out
