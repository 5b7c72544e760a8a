"""`pipeline`: layers stacked on a leading axis, run as pipeline stages over one
mesh axis, with the result of `jax.lax.scan` over them.

How a call goes:

1. **Check.** The stack's array leaves share the leading layer axis L; L is a
   multiple of S·R (S stages: the size of `axis`; R repeats), the batch of `x` a
   multiple of M (`microbatches`), M a multiple of S for the circular schedule,
   `axis` in the mesh and not already manual. Every mistake is an eqshard error
   naming the leaf and the fix.
2. **Lay out** (`_split`). The stack is reshaped to the view `(R, S, K, ...)`
   (`stage_view`, K = L/(R·S)), stage axis over `axis`; `x` and the arrays of
   `args` that `batched_args` marks to `(M, B/M, ...)`, microbatch `i`
   being the rows `i::M` (strided, so a batch laid out over a data axis keeps
   each microbatch spread over it and nothing moves).
3. **Run** (`_loop`), inside `jax.shard_map` manual over `axis` only, so the
   other axes keep their layouts inside a stage. The loop runs `R·M + S - 1`
   steps; at step `t` stage `s` works on item `j = t - s` (microbatch `j % M`,
   chunk `j // M` of its R), its input from stage `s - 1` by `ppermute` (stage 0
   reads the microbatch, or for a later repeat what stage S-1 sent round the
   ring, kept until needed), and the last stage keeps the last chunk's outputs.
   Each step's chunk is `jax.checkpoint`-ed: the backward pass keeps each step's
   stage input and recomputes the rest. With `has_aux`, each stage sums its
   valid steps' aux; the sums are added over `axis` and divided by M. The
   stage weights split over data axes are all-gathered where the loop uses
   them (`fsdp_gather="per_step"`), or before it (`"once"`: a sharding
   constraint to their spec without the data axes), or per window of M steps
   (`"per_repeat"`, `_per_repeat`).
4. **Return.** By default the last stage's outputs are summed over `axis` (an
   all-reduce of the whole result) so every stage holds them; `output="last"`
   returns each stage's buffer instead, stacked `(S, B, ...)` over `axis`, of
   which `[-1]` is the result. On a mesh with Explicit axes all of this runs as
   `auto_axes` runs a function, and the result is typed like `x` (the stages'
   dimension typed over `axis` only where that axis is Explicit: a type names
   no Auto axis).
"""

import functools as ft
from collections.abc import Callable
from typing import Any, Literal, TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._mesh._current import require_mesh
from .._mesh._targets import require_traced_or_runnable
from .._typing import typecheck
from ._explicit import auto_axes
from ._pipeline_checks import (
    aux_error,
    batched_leaves,
    check_counts,
    check_layout,
    check_mesh,
    choice,
    count,
    gather_specs,
    GATHERS,
    input_error,
    layer_output_error,
    layers_of,
    OUTPUTS,
    Plan,
    schedule_counts,
    SCHEDULES,
)
from ._stage_view import stage_view


# Options `pipeline` validates itself, with eqshard's one-line errors: type
# checkers see the precise types, the runtime check admits any value.
if TYPE_CHECKING:
    Count = int | np.integer
    Schedule = Literal["gpipe", "circular"]
    Output = Literal["all", "last"]
    Gather = Literal["per_step", "once", "per_repeat"]
else:
    Count = Schedule = Output = Gather = Any


def _split(a: Any, m: int) -> Any:
    """`(B, ...)` -> `(M, B/M, ...)`, microbatch `i` the rows `i::M`."""
    return jnp.swapaxes(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 0, 1)


def _join(a: Any) -> Any:
    """The inverse of `_split`: `(M, B/M, ...)` -> `(B, ...)`."""
    return jnp.swapaxes(a, 0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _index(a: Any, i: Any) -> Any:
    return jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)


def _put(a: Any, i: Any, value: Any, when: Any) -> Any:
    """`a` with `a[i] = value` where `when`, unchanged otherwise."""
    return jax.lax.dynamic_update_index_in_dim(
        a, jnp.where(when, value, _index(a, i)), i, 0
    )


def _wide(a: Any, fn: Callable[[Any], Any]) -> Any:
    """`fn(a)` in at least 32 bits for floats: `fn` adds an all-reduce over the
    stage axis (a `psum`, or the transpose of a `pcast`) that XLA:CPU cannot
    compile in 16 bits under a partially manual map (its promotion of such an
    all-reduce aborts), and in 32 bits it sums more exactly anyway."""
    if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize < 4:
        return fn(a.astype(jnp.float32)).astype(a.dtype)
    return fn(a)


def _layer_call(
    layer: Callable[..., Any], static: Any, has_aux: bool
) -> Callable[..., Any]:
    """`layer` on one microbatch, its result checked: `(h, aux)` always."""

    def call(d: Any, h: Any, args: tuple[Any, ...], extra: dict[str, Any]) -> Any:
        out = layer(eqx.combine(d, static), h, *args, **extra)
        aux: Any = ()
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise layer_output_error(h, out, True)
            out, aux = out
            for path, leaf in jtu.tree_leaves_with_path(aux):
                if not eqx.is_inexact_array(leaf):
                    raise aux_error(path, leaf)
        if not eqx.is_array(out) or (out.shape, out.dtype) != (h.shape, h.dtype):
            raise layer_output_error(h, out, False)
        return out, aux

    return call


def _chunk(
    layer: Callable[..., Any],
    static: Any,
    plan: Plan,
    args: tuple[Any, tuple[bool, ...], Any],
) -> Callable[..., Any]:
    """One stage's chunk of K layers on one microbatch, rematerialised in the
    backward pass (its inputs are all that step keeps): `(h, aux summed over the
    K layers)`. It takes the stage's whole parameters and argument buffers with
    the indices, so that what the backward pass keeps per step is the
    activation, not a slice of them."""
    arg_def, batched, arg_static = args
    call = _layer_call(layer, static, plan.has_aux)

    def run(params: Any, key: Any, bufs: Any, h: Any, at: Any, m: Any) -> Any:
        (r, s, slot) = at  # repeat, stage, and r's index in `params`
        chunk = jtu.tree_map(lambda a: _index(a, slot), params)
        leaves = [_index(a, m) if b else a for a, b in zip(bufs, batched, strict=True)]
        args_m = eqx.combine(jtu.tree_unflatten(arg_def, leaves), arg_static)
        first = (r * plan.stages + s) * plan.chunk

        def apply(d: Any, h: Any, k: Any) -> Any:
            extra = {}
            if key is not None:
                extra["key"] = jax.random.fold_in(jax.random.fold_in(key, first + k), m)
            return call(d, h, args_m, extra)

        def one(carry: Any, xs: Any) -> tuple[Any, None]:
            (h, total), (d, k) = carry, xs
            h, aux = apply(d, h, k)
            return (h, jtu.tree_map(jnp.add, total, aux)), None

        # The first layer outside the scan: its aux starts the sum.
        carry = apply(jtu.tree_map(lambda a: a[0], chunk), h, 0)
        if plan.chunk == 1:
            return carry
        rest = jtu.tree_map(lambda a: a[1:], chunk)
        return jax.lax.scan(one, carry, (rest, jnp.arange(1, plan.chunk)))[0]

    return jax.checkpoint(run)


def _gather(params: Any, specs: list[PartitionSpec | None]) -> Any:
    """Each stage's `(n, K, ...)` weights laid out without the data axes (an
    all-gather over them), for `fsdp_gather`."""
    mesh = jax.sharding.get_abstract_mesh()
    leaves, tdef = jtu.tree_flatten(params)
    leaves = [
        a
        if spec is None
        else jax.lax.with_sharding_constraint(
            a, NamedSharding(mesh, PartitionSpec(None, None, *spec))
        )
        for a, spec in zip(leaves, specs, strict=True)
    ]
    return jtu.tree_unflatten(tdef, leaves)


def _loop(run: Callable[..., Any], plan: Plan, specs: Any) -> Callable[..., Any]:
    """The body of the map: the schedule's steps on one stage."""
    stages, repeats, m_count, axis = (
        plan.stages,
        plan.repeats,
        plan.microbatches,
        plan.axis,
    )
    items = repeats * m_count
    ring = [(i, (i + 1) % stages) for i in range(stages)]
    perm = ring if repeats > 1 else ring[:-1]

    def body(params: Any, key: Any, xs: Any, bufs: Any) -> Any:
        params = jtu.tree_map(lambda a: a[:, 0], params)  # this stage's (R, K, ...)
        s = jax.lax.axis_index(axis)
        pcast = ft.partial(jax.lax.pcast, axis_name=axis, to="varying")
        vary = ft.partial(_wide, fn=pcast)
        bufs = [vary(a) if eqx.is_inexact_array(a) else a for a in bufs]
        first = vary(jnp.zeros_like(xs[0]))

        def step(held: Any, w0: Any, carry: Any, t: Any) -> tuple[Any, None]:
            recv, inbox, out, total = carry
            if repeats > 1:  # what stage S-1 finished at step t - 1, round the ring
                done = t - stages
                ok = (s == 0) & (done >= 0) & (done < items)
                inbox = _put(inbox, jnp.clip(done, 0, items - 1) % m_count, recv, ok)
            j = t - s
            jc = jnp.clip(j, 0, items - 1)
            r, m = jc // m_count, jc % m_count
            # `held` holds all R chunks, or per repeat chunks `w0` and `w0 + 1`.
            slot = r if w0 is None else jnp.clip(r - w0, 0, 1)
            h_in = jnp.where(s == 0, _index(inbox, m), recv)
            h, aux = run(held, key, bufs, h_in, (r, s, slot), m)
            valid = (j >= 0) & (j < items)
            total = jtu.tree_map(
                lambda t, a: t + jnp.where(valid, a, 0).astype(t.dtype), total, aux
            )
            last = valid & (s == stages - 1) & (r == repeats - 1)
            out = _put(out, m, h, last)
            return (jax.lax.ppermute(h, axis, perm), inbox, out, total), None

        shapes = jax.eval_shape(lambda: run(params, key, bufs, first, (0, s, 0), 0)[1])
        zero = jtu.tree_map(lambda a: vary(jnp.zeros(a.shape, a.dtype)), shapes)
        init = (first, vary(xs), vary(jnp.zeros_like(xs)), zero)
        steps = jnp.arange(items + stages - 1)
        if plan.gather == "per_repeat" and repeats > 2:
            carry = _per_repeat(step, params, specs, init, plan)
        else:  # with R <= 2, two chunks per repeat are the stage: "once"
            held = params if plan.gather == "per_step" else _gather(params, specs)
            carry = jax.lax.scan(ft.partial(step, held, None), init, steps)[0]
        _, _, out, total = carry
        psum = ft.partial(jax.lax.psum, axis_name=axis)
        aux = jtu.tree_map(lambda a: _wide(a, psum) / m_count, total)
        if plan.output == "last":
            return out[None], aux
        return _wide(jnp.where(s == stages - 1, out, 0), psum), aux

    return body


def _per_repeat(
    step: Callable[..., Any], params: Any, specs: Any, init: Any, plan: Plan
) -> Any:
    """The loop in windows of M steps, window `w` gathering chunks `w - 1` and
    `w` (what the stages work on in it: stage `s` finishes chunk `w - 1` in its
    first `s` steps); the last window runs the S - 1 steps after it too. Each
    window is rematerialised: the backward pass gathers its chunks again
    rather than keep every window's."""
    m_count, repeats = plan.microbatches, plan.repeats

    def window(carry: Any, w: Any, length: int) -> tuple[Any, None]:
        start = jnp.maximum(w - 1, 0)  # chunks `start` and `start + 1`
        pair = jtu.tree_map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, 2), params)
        steps = w * m_count + jnp.arange(length)
        body = ft.partial(step, _gather(pair, specs), start)
        return jax.lax.scan(body, carry, steps)[0], None

    inner = jax.checkpoint(ft.partial(window, length=m_count))
    last = jax.checkpoint(ft.partial(window, length=m_count + plan.stages - 1))
    carry = jax.lax.scan(inner, init, jnp.arange(repeats - 1))[0]
    return last(carry, jnp.asarray(repeats - 1))[0]


def _staged_run(
    layer: Callable[..., Any],
    static: Any,
    plan: Plan,
    args: tuple[Any, tuple[bool, ...], Any],
    mesh: Mesh | AbstractMesh | None,
    staged: bool,
    specs: list[PartitionSpec | None] | None,
) -> Callable[..., Any]:
    """The whole pipeline on global arrays: lay out, map, put back together;
    `specs` what `fsdp_gather` gathers each leaf to."""
    counts = {"stages": plan.stages, "repeats": plan.repeats}

    def go(dyn: Any, key: Any, x: Any, leaves: list[Any]) -> Any:
        view = dyn if staged else stage_view(dyn, **counts)
        bufs = [
            _split(a, plan.microbatches) if b else a
            for a, b in zip(leaves, args[1], strict=True)
        ]
        on = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
        mapped = jax.shard_map(
            _loop(_chunk(layer, static, plan, args), plan, specs),
            mesh=on,
            in_specs=(
                PartitionSpec(None, plan.axis),
                PartitionSpec(),
                PartitionSpec(),
                PartitionSpec(),
            ),
            out_specs=(
                PartitionSpec(plan.axis if plan.output == "last" else None),
                PartitionSpec(),
            ),
            axis_names=frozenset({plan.axis}),
        )
        out, aux = mapped(view, key, _split(x, plan.microbatches), bufs)
        out = jax.vmap(_join)(out) if plan.output == "last" else _join(out)
        return (out, aux) if plan.has_aux else out

    return go


def _typed_spec(x: Any) -> PartitionSpec:
    try:
        return jax.typeof(x).sharding.spec
    except TypeError:  # not a JAX type
        return PartitionSpec()


@typecheck
def pipeline(
    layer: Callable[..., Any],
    stack: PyTree,
    x: Any,
    *args: Any,
    microbatches: Count,
    batched_args: Any = None,
    has_aux: bool = False,
    axis: str = "pp",
    schedule: Schedule = "gpipe",
    repeats: Count = 1,
    key: Any = None,
    output: Output = "all",
    staged: bool = False,
    fsdp_gather: Gather = "per_step",
    fsdp_axes: str | tuple[str, ...] | None = None,
    stack_specs: Any = None,
    mesh: Mesh | AbstractMesh | None = None,
) -> Any:
    """Runs layers stacked on a leading axis as pipeline stages over the mesh axis
    `axis`: what `jax.lax.scan` over the layers returns, and its gradients.

    The L layers are split into S stages (S the size of `axis`), the batch into M
    microbatches (rows `x[i::M]`); stages hand activations on with `ppermute` in
    a `jax.shard_map` manual over `axis` only, so the other axes keep their
    layouts inside each stage. Layouts, bubbles and what a stage keeps:
    [the how-to](../how-to/pipeline.md); each option: [in full](#pipeline-in-full).

    **Arguments:**

    - `layer`: `layer(block, h, *args_mb) -> h` (and `key=` if `key` is given),
      of `h`'s shape and dtype; with `has_aux=True`, a pair `(h, aux)`.
    - `stack`: the layers stacked on a leading axis; `x`: the activations, batch
      first; `*args`: more arguments for `layer`.
    - `microbatches`: M, dividing the batch (a multiple of S for `"circular"`).
    - `batched_args`: which `args` are per row, split into microbatches with `x`.
    - `has_aux`: `aux` is returned summed over layers, averaged over microbatches.
    - `axis`; `schedule` (`"gpipe"` or `"circular"`); `repeats`, R, its chunks.
    - `key`: a PRNG key, folded in per layer and microbatch.
    - `output`: `"all"` (the result on every stage) or `"last"` (one per stage).
    - `staged`: `stack` is already `stage_view(stack, stages=S, repeats=R)`.
    - `fsdp_gather`, `fsdp_axes`, `stack_specs`: when stage weights split over
      data axes are gathered, those axes, and the stack's specs.
    - `mesh`: defaults to the mesh set with `jax.set_mesh`.

    **Returns:**

    What the scan returns for `x`, with `x`'s shape and layout (`(S, ...)` for
    `output="last"`); with `has_aux`, the pair `(y, aux)`.

    **Raises:**

    `ValueError`, naming the leaf, sizes and fix, for a stack, batch, axis,
    layer output or option that does not fit ([the list](#pipeline-in-full)).

    !!! Example

        ```python
        blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(
            jax.random.split(jax.random.key(0), 4))
        with jax.set_mesh(eqshard.create_mesh((2, 4), ("pp", "dp"))):
            y = jax.jit(lambda b, x: eqshard.pipeline(lambda l, h: jax.vmap(l)(h), b, x,
                        microbatches=4))(blocks, jnp.ones((16, 8)))
        ```
    """
    microbatches, repeats = (
        count(microbatches, "microbatches"),
        count(repeats, "repeats"),
    )
    choice(schedule, SCHEDULES, "schedule")
    choice(output, OUTPUTS, "output")
    choice(fsdp_gather, GATHERS, "fsdp_gather")
    on = require_mesh(mesh, caller="pipeline")
    require_traced_or_runnable("pipeline", on, (x, stack), abstract=True)
    stages = check_mesh(on, axis)
    schedule_counts(schedule, repeats, microbatches, stages, input_error)
    dyn, static = eqx.partition(stack, eqx.is_array)
    layers = layers_of(dyn, staged, (stages, repeats))
    if not eqx.is_array(x) or not jnp.ndim(x):
        raise input_error(
            f"`x` is {type(x).__name__} {getattr(x, 'shape', '')}, not an array "
            "with a leading batch axis",
            "pass the activations, batch first.",
        )
    batch = x.shape[0]
    check_counts(layers, batch, stages, repeats, microbatches, schedule == "gpipe")
    plan = Plan(
        axis,
        stages,
        repeats,
        microbatches,
        layers // (stages * repeats),
        output,
        has_aux,
        fsdp_gather,
    )
    check_layout(dyn, plan, staged)
    specs = (
        None
        if fsdp_gather == "per_step"
        else gather_specs(dyn, x, plan, staged, (fsdp_axes, stack_specs))
    )
    batched = tuple(batched_leaves(args, batched_args, batch))
    arg_arrays, arg_static = eqx.partition(args, eqx.is_array)
    arrays, arrays_def = jtu.tree_flatten(arg_arrays)
    base = on.abstract_mesh if isinstance(on, Mesh) else on
    explicit = any(t == AxisType.Explicit for t in base.axis_types)
    go = _staged_run(
        layer,
        static,
        plan,
        (arrays_def, batched, arg_static),
        None if explicit else on,
        staged,
        specs,
    )
    if not explicit:
        return go(dyn, key, x, arrays)
    spec = _typed_spec(x)
    # A type names no Auto axis: with the stage axis Auto, the stages'
    # dimension of `output="last"` is laid out over it by XLA, not by its type.
    types = dict(zip(base.axis_names, base.axis_types, strict=True))
    stage = axis if types[axis] == AxisType.Explicit else None
    out_spec = PartitionSpec(stage, *spec) if output == "last" else spec
    if has_aux:
        out_spec = (out_spec, PartitionSpec())
    return auto_axes(go, out_sharding=out_spec, mesh=on)(dyn, key, x, arrays)
