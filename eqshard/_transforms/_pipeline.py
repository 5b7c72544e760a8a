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
   `args` whose leading axis is the batch to `(M, B/M, ...)`, microbatch `i`
   being the rows `i::M` (strided, so a batch laid out over a data axis keeps
   each microbatch spread over it and nothing moves).
3. **Run** (`_loop`), inside `jax.shard_map` manual over `axis` only, so the
   other axes keep their layouts inside a stage. The loop runs `R·M + S - 1`
   steps; at step `t` stage `s` works on item `j = t - s` (microbatch `j % M`,
   chunk `j // M` of its R), its input from stage `s - 1` by `ppermute` (stage 0
   reads the microbatch, or for a later repeat what stage S-1 sent round the
   ring, kept until needed), and the last stage keeps the last chunk's outputs.
   Each step's chunk is `jax.checkpoint`-ed: the backward pass keeps each step's
   stage input and recomputes the rest.
4. **Return.** By default the last stage's outputs are summed over `axis` (an
   all-reduce of the whole result) so every stage holds them; `output="last"`
   returns each stage's buffer instead, stacked `(S, B, ...)` over `axis`, of
   which `[-1]` is the result. On a mesh with Explicit axes all of this runs as
   `auto_axes` runs a function, and the result is typed like `x`.
"""

import functools as ft
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.sharding import AbstractMesh, AxisType, Mesh, PartitionSpec
from jaxtyping import PyTree

from .._mesh._current import mesh_repr, require_mesh
from .._mesh._targets import require_traced_or_runnable
from .._tree import path_str, paths_text
from .._typing import KeyPath, typecheck, warn
from ._explicit import auto_axes
from ._shard_map_specs import array_layout
from ._stage_view import stage_view


_CALLER = "pipeline"


# One builder per kind of message.


def _input_error(what: str, fix: str) -> ValueError:
    return ValueError(f"eqshard.{_CALLER}: {what}; {fix}")


def _leaf_error(path: KeyPath, what: str, fix: str) -> ValueError:
    where = path_str(path) or "(root)"
    return _input_error(f"the leaf at '{where}' {what}", fix)


def _layer_output_error(h: Any, out: Any) -> ValueError:
    got = (
        f"{out.dtype}{list(out.shape)}"
        if eqx.is_array(out)
        else f"a {type(out).__name__}"
    )
    return _input_error(
        f"`layer` returned {got} for an input {h.dtype}{list(h.shape)} (one "
        "microbatch)",
        "a pipelined layer must return an array of its input's shape and dtype "
        "(cast its result, e.g. `.astype(h.dtype)`, or keep what changes shape "
        "outside the pipeline).",
    )


class _Plan(NamedTuple):
    """The counts of a pipeline, fixed before tracing."""

    axis: str
    stages: int  # S
    repeats: int  # R
    microbatches: int  # M
    chunk: int  # K = L / (R·S) layers per chunk
    output: str


def _layers(dyn: Any, staged: bool, plan_counts: tuple[int, int]) -> int:
    """L, the stack's number of layers: every array leaf's leading axis (or, for
    a stack in the circular view, its leading `(R, S, K)`)."""
    stages, repeats = plan_counts
    found: tuple[KeyPath, tuple[int, ...]] | None = None
    for path, leaf in jtu.tree_leaves_with_path(dyn):
        shape = tuple(leaf.shape)
        lead = shape[:3] if staged else shape[:1]
        if len(lead) < (3 if staged else 1):
            raise _leaf_error(
                path,
                f"has shape {shape}, with no leading layer "
                f"{'axes (R, S, K)' if staged else 'axis'}",
                "every array leaf of `stack` needs one (build the stack with "
                "`eqx.filter_vmap` over the layer's constructor).",
            )
        if found is not None and lead != found[1]:
            raise _leaf_error(
                path,
                f"has {'leading axes' if staged else 'layer axis'} {lead}, but "
                f"the one at '{path_str(found[0])}' has {found[1]}",
                "every array leaf of `stack` must share the layer axis.",
            )
        found = found or (path, lead)
        if staged and lead[:2] != (repeats, stages):
            raise _leaf_error(
                path,
                f"has shape {shape}, not the view (repeats, stages, K, ...) = "
                f"({repeats}, {stages}, K, ...) that `staged=True` says",
                f"pass `eqshard.stage_view(stack, stages={stages}, "
                f"repeats={repeats})`, or the natural stack with `staged=False`.",
            )
    if found is None:
        raise _input_error(
            "`stack` holds no arrays", "give the stacked layers' parameters."
        )
    lead = found[1]
    return lead[0] * lead[1] * lead[2] if staged else lead[0]


def _check_mesh(on: Mesh | AbstractMesh, axis: str) -> int:
    """S, the size of `axis`, after checking it can be the stage axis."""
    if axis not in on.axis_names:
        raise _input_error(
            f"the stage axis {axis!r} is not in mesh {mesh_repr(on)}",
            "name one of its axes with `axis=`, or build the mesh with a stage "
            f"axis, e.g. eqshard.create_mesh(..., ('{axis}', ...)).",
        )
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and axis in context.manual_axes:
        raise _input_error(
            f"the stage axis {axis!r} is already manual here (inside a "
            "`shard_map` over it)",
            "call `pipeline` outside that map, or map over the other axes only "
            "(`axis_names=`).",
        )
    return dict(zip(on.axis_names, on.axis_sizes, strict=True))[axis]


def _check_counts(
    layers: int, batch: int, stages: int, repeats: int, microbatches: int, gpipe: bool
) -> None:
    if layers % (stages * repeats):
        raise _input_error(
            f"the stack has {layers} layers, not a multiple of stages·repeats = "
            f"{stages}·{repeats}",
            "give a number of layers divisible by that, or change `repeats` or "
            "the size of the stage axis.",
        )
    if microbatches < 1 or batch % microbatches:
        raise _input_error(
            f"the batch (leading axis of `x`) is {batch}, not divisible by "
            f"microbatches={microbatches}",
            "choose `microbatches` dividing the batch.",
        )
    if not gpipe and microbatches % stages:
        raise _input_error(
            f"the circular schedule needs microbatches a multiple of the "
            f"{stages} stages, got {microbatches}",
            f"use microbatches={stages * max(1, microbatches // stages)} or "
            "another multiple.",
        )
    if gpipe and microbatches < stages:
        warn(
            f"eqshard.{_CALLER}: microbatches={microbatches} is fewer than the "
            f"{stages} stages, so the pipeline is mostly bubble (a fraction "
            f"{(stages - 1) / (microbatches + stages - 1):.2f} of its steps); use "
            f"microbatches >= {stages}."
        )


def _check_layout(dyn: Any, plan: _Plan, staged: bool) -> None:
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


def _chunk(
    layer: Callable[..., Any],
    static: Any,
    plan: _Plan,
    args: tuple[Any, tuple[bool, ...], Any],
) -> Callable[..., Any]:
    """One stage's chunk of K layers on one microbatch, rematerialised in the
    backward pass (its inputs are all that step keeps). It takes the stage's
    whole parameters and argument buffers with the indices, so that what the
    backward pass keeps per step is the activation, not a slice of them."""
    arg_def, batched, arg_static = args

    def run(params: Any, key: Any, bufs: Any, h: Any, r: Any, s: Any, m: Any) -> Any:
        chunk = jtu.tree_map(lambda a: _index(a, r), params)
        leaves = [_index(a, m) if b else a for a, b in zip(bufs, batched, strict=True)]
        args_m = eqx.combine(jtu.tree_unflatten(arg_def, leaves), arg_static)
        first = (r * plan.stages + s) * plan.chunk

        def one(h: Any, xs: Any) -> tuple[Any, None]:
            d, k = xs
            extra = {}
            if key is not None:
                extra["key"] = jax.random.fold_in(jax.random.fold_in(key, first + k), m)
            out = layer(eqx.combine(d, static), h, *args_m, **extra)
            if not eqx.is_array(out) or (out.shape, out.dtype) != (h.shape, h.dtype):
                raise _layer_output_error(h, out)
            return out, None

        return jax.lax.scan(one, h, (chunk, jnp.arange(plan.chunk)))[0]

    return jax.checkpoint(run)


def _loop(run: Callable[..., Any], plan: _Plan) -> Callable[..., Any]:
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

        def step(carry: Any, t: Any) -> tuple[Any, None]:
            recv, inbox, out = carry
            if repeats > 1:  # what stage S-1 finished at step t - 1, round the ring
                done = t - stages
                ok = (s == 0) & (done >= 0) & (done < items)
                inbox = _put(inbox, jnp.clip(done, 0, items - 1) % m_count, recv, ok)
            j = t - s
            jc = jnp.clip(j, 0, items - 1)
            r, m = jc // m_count, jc % m_count
            h = run(
                params, key, bufs, jnp.where(s == 0, _index(inbox, m), recv), r, s, m
            )
            last = (j >= 0) & (j < items) & (s == stages - 1) & (r == repeats - 1)
            out = _put(out, m, h, last)
            return (jax.lax.ppermute(h, axis, perm), inbox, out), None

        init = (first, vary(xs), vary(jnp.zeros_like(xs)))
        steps = jnp.arange(items + stages - 1)
        out = jax.lax.scan(step, init, steps)[0][2]
        if plan.output == "last":
            return out[None]
        psum = ft.partial(jax.lax.psum, axis_name=axis)
        return _wide(jnp.where(s == stages - 1, out, 0), psum)

    return body


def _staged_run(
    layer: Callable[..., Any],
    static: Any,
    plan: _Plan,
    args: tuple[Any, tuple[bool, ...], Any],
    mesh: Mesh | AbstractMesh | None,
    staged: bool,
) -> Callable[..., Any]:
    """The whole pipeline on global arrays: lay out, map, put back together."""
    counts = {"stages": plan.stages, "repeats": plan.repeats}

    def go(dyn: Any, key: Any, x: Any, leaves: list[Any]) -> Any:
        view = dyn if staged else stage_view(dyn, **counts)
        bufs = [
            _split(a, plan.microbatches) if b else a
            for a, b in zip(leaves, args[1], strict=True)
        ]
        on = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
        mapped = jax.shard_map(
            _loop(_chunk(layer, static, plan, args), plan),
            mesh=on,
            in_specs=(
                PartitionSpec(None, plan.axis),
                PartitionSpec(),
                PartitionSpec(),
                PartitionSpec(),
            ),
            out_specs=PartitionSpec(plan.axis if plan.output == "last" else None),
            axis_names=frozenset({plan.axis}),
        )
        out = mapped(view, key, _split(x, plan.microbatches), bufs)
        if plan.output == "last":
            return jax.vmap(_join)(out)
        return _join(out)

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
    microbatches: int,
    axis: str = "pp",
    schedule: Literal["gpipe", "circular"] = "gpipe",
    repeats: int = 1,
    key: Any = None,
    output: Literal["all", "last"] = "all",
    staged: bool = False,
    mesh: Mesh | AbstractMesh | None = None,
) -> Any:
    """Runs layers stacked on a leading axis as pipeline stages over the mesh axis
    `axis`: what `jax.lax.scan` over the layers returns, and its gradients.

    The L layers are split into S stages (S the size of `axis`) and the batch into
    M microbatches; stage `s` holds its layers on its devices, and the stages hand
    activations on with `jax.lax.ppermute` inside a `jax.shard_map` manual over
    `axis` only, so the other mesh axes keep their FSDP or tensor-parallel layouts
    inside each stage (on Explicit axes the stages run with them made Auto, as
    [`eqshard.auto_axes`][] does, and the result is typed like `x`). With
    `schedule="gpipe"` stage `s` holds layers `[s·L/S, (s+1)·L/S)` and the loop
    runs `M + S - 1` steps, a bubble (idle fraction) of `(S-1)/(M+S-1)`; with
    `"circular"` each stage holds `repeats` chunks of `L/(R·S)` layers,
    round-robin (chunk `c` on stage `c % S`), the loop runs `R·M + S - 1` steps
    and the bubble is `(S-1)/(R·M+S-1)`. Microbatch `i` is the rows `x[i::M]`:
    a batch laid out over a data axis keeps each microbatch spread over it, so
    splitting moves nothing. Gradients run the loop backwards, recomputing each
    chunk: a stage keeps its input for every step, `R·M + S - 1` activations of
    one microbatch (no 1F1B bound in this SPMD form). The stack's layout that
    moves nothing is `P(axis)` on the layer axis for GPipe
    (`eqshard.stacked(spec, stages=axis)`), and for the circular schedule the
    view [`eqshard.stage_view`][] with `P(None, axis)`, passed with
    `staged=True`; otherwise XLA moves the stack into that layout at each call.

    **Arguments:**

    - `layer`: `layer(block, h, *args_mb) -> h`, one layer; given `key`, it is
      called with `key=` too. It must return an array of `h`'s shape and dtype.
    - `stack`: the layers stacked on a leading axis (an Equinox module built with
      `eqx.filter_vmap`, or any pytree whose array leaves share that axis);
      non-array leaves reach `layer` unchanged.
    - `x`: the activations, batch first.
    - `*args`: more arguments for `layer`. Arrays whose leading axis has the
      batch's size (padding masks, positions) are split into microbatches with
      `x`; the rest are passed whole.
    - `microbatches`: M, dividing the batch (a multiple of S for `"circular"`).
    - `axis`: the stage axis of the mesh.
    - `schedule`: `"gpipe"` or `"circular"` (interleaved).
    - `repeats`: R, the chunks per stage of the circular schedule (1 for GPipe).
    - `key`: a PRNG key; layer `l` on microbatch `m` gets
      `jax.random.fold_in(jax.random.fold_in(key, l), m)`.
    - `output`: `"all"` (default): the result on every stage, the last stage's
      outputs summed over `axis` (an all-reduce of the result's bytes);
      `"last"`: no such reduction, each stage's buffer returned stacked
      `(S, B, ...)` over `axis`, where `[-1]` is the result and the others zero,
      for a loss computed where the result is.
    - `staged`: `stack` is already `stage_view(stack, stages=S, repeats=R)`.
    - `mesh`: defaults to the mesh set with `jax.set_mesh`.

    **Returns:**

    What the scan over the layers returns for `x`, with `x`'s shape and layout
    (for `output="last"`, stacked `(S, ...)` as said).

    **Raises:**

    `ValueError`, naming the leaf, the sizes and the fix, if the stack's leaves
    disagree on the layer axis or L is not a multiple of S·R, if the batch is not
    divisible by M, if the circular M is not a multiple of S, if `axis` is not in
    the mesh or already manual, or if `layer` returns another shape or dtype; a
    warning if GPipe has fewer microbatches than stages.

    !!! Example

        ```python
        mesh = eqshard.create_mesh((2, 4), ("pp", "dp"))
        blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(
            jax.random.split(jax.random.key(0), 4)
        )
        step = lambda block, h: jax.vmap(block)(h)
        with jax.set_mesh(mesh):
            y = jax.jit(eqshard.pipeline, static_argnums=0,
                        static_argnames="microbatches")(
                step, blocks, jnp.ones((16, 8)), microbatches=4
            )
        ```
    """
    on = require_mesh(mesh, caller=_CALLER)
    require_traced_or_runnable(_CALLER, on, (x, stack), abstract=True)
    stages = _check_mesh(on, axis)
    if schedule == "gpipe" and repeats != 1:
        raise _input_error(
            f"schedule='gpipe' with repeats={repeats}",
            "use schedule='circular' for more than one chunk per stage.",
        )
    if repeats < 1:
        raise _input_error(f"repeats={repeats}", "give at least 1.")
    dyn, static = eqx.partition(stack, eqx.is_array)
    layers = _layers(dyn, staged, (stages, repeats))
    if not eqx.is_array(x) or not jnp.ndim(x):
        raise _input_error(
            f"`x` is {type(x).__name__} {getattr(x, 'shape', '')}, not an array "
            "with a leading batch axis",
            "pass the activations, batch first.",
        )
    batch = x.shape[0]
    _check_counts(layers, batch, stages, repeats, microbatches, schedule == "gpipe")
    plan = _Plan(
        axis, stages, repeats, microbatches, layers // (stages * repeats), output
    )
    _check_layout(dyn, plan, staged)
    arg_arrays, arg_static = eqx.partition(args, eqx.is_array)
    arrays, arrays_def = jtu.tree_flatten(arg_arrays)
    batched = tuple(bool(jnp.ndim(a)) and a.shape[0] == batch for a in arrays)
    base = on.abstract_mesh if isinstance(on, Mesh) else on
    explicit = any(t == AxisType.Explicit for t in base.axis_types)
    go = _staged_run(
        layer,
        static,
        plan,
        (arrays_def, batched, arg_static),
        None if explicit else on,
        staged,
    )
    if not explicit:
        return go(dyn, key, x, arrays)
    spec = _typed_spec(x)
    out_spec = PartitionSpec(axis, *spec) if output == "last" else spec
    return auto_axes(go, out_sharding=out_spec, mesh=on)(dyn, key, x, arrays)
