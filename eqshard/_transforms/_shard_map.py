"""`filter_shard_map`: `jax.shard_map` over any pytree, Equinox modules included.

How a call goes:

1. **Split.** The arrays among the arguments are the inputs of the map; everything
   else (static fields, callables, Python scalars, `None`) is held static, as
   `eqx.filter_jit` does, and reaches `fn` unchanged.
2. **Resolve and check, before tracing.** `in_specs` (a spec tree or prefix,
   partition rules, logical `AxisNames`, or `None` to read each array's own
   layout) becomes one `PartitionSpec` per array. Every array whose spec cannot
   apply is reported in one error: specs that do not divide the array, axes the
   mesh (or its manual part) lacks, layouts that cannot be read, arrays on
   another mesh, and on Explicit axes a spec other than the array's own layout
   (`_shard_map_specs.py`).
3. **Trace.** `fn` is traced under `jax.shard_map` with every output replicated
   (`_trace`): that reads the per-device shapes of its outputs, against which
   `out_specs` are resolved and checked, and its non-array outputs, which come
   back as `fn` returned them (as in `eqx.filter_jit`).
4. **Keep.** The program (a `jax.jit`, which traces `fn` once more when it is
   made) is kept under what that trace read (`program_key`, behind the door: the jaxpr
   with the values of closed-over variables and globals, NumPy data by
   content) with the mesh, specs, options, rules and static arguments: a call
   whose trace is one already compiled compiles nothing, eagerly too (an eager
   `jax.shard_map` compiles at every call), and a value `fn` reads that has
   changed gives another program, never a stale result. JAX arrays `fn` reads
   are the program's inputs (by type in the key), so a new one compiles nothing.
5. **Warm calls.** An eager call is kept too (`_call_key`: what `fn` reads,
   keyed by value by `_internals.closures.reads_key`, with the specs and the
   arguments' types): the next call with the same key traces nothing, only
   dispatches the program. Under `jax.jit`, and where something `fn` reads
   cannot be keyed by value, each call traces `fn` once.
"""

import functools as ft
import inspect
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.core import Tracer
from jax.extend.core import ClosedJaxpr
from jax.sharding import AbstractMesh, Mesh, PartitionSpec
from jaxtyping import PyTree

from .._caches import register
from .._internals.closures import (
    find_reads,
    reads_key,
    trace_context,
    Unkeyable,
    value_key,
)
from .._internals.jaxpr import as_function, consts_of
from .._internals.program_keys import program_key
from .._mesh._targets import require_traced_or_runnable
from .._move._host import host_private
from .._spectree._check_spec import (
    is_spec_leaf,
)
from .._spectree._logical import (
    AxisNames,
    get_logical_axis_rules,
    LogicalRules,
    normalize_rules,
)
from .._tree import abstract_leaf_error, is_array, paths_text
from .._typing import AxisRulesArg, KeyPath, typecheck
from ._programs import Programs
from ._shard_map_specs import (
    array_layout,
    CALLER,
    leaf_paths,
    map_mesh,
    resolve_in_specs,
    resolve_out_specs,
)


# The options of `jax.shard_map` passed through (`axis_names`, `check_vma`).
_JAX_OPTIONS = tuple(
    name
    for name in inspect.signature(jax.shard_map).parameters
    if name not in ("f", "out_specs", "in_specs", "mesh")
)


# One builder per kind of message.


def _options_error(unknown: list[str]) -> TypeError:
    return TypeError(
        f"eqshard.{CALLER}: unknown option {', '.join(map(repr, unknown))}; the "
        f"options of `jax.shard_map` it passes on are {', '.join(_JAX_OPTIONS)}."
    )


def _kwargs_error(names: list[str]) -> TypeError:
    return TypeError(
        f"eqshard.{CALLER}: the mapped function was called with keyword arguments "
        f"{', '.join(map(repr, names))}; pass them positionally, since `in_specs` "
        "describes the tuple of positional arguments (as in `jax.shard_map`)."
    )


def _fn_error(arrays: list[KeyPath]) -> TypeError:
    return TypeError(
        f"eqshard.{CALLER}: `fn` holds arrays (at {paths_text(arrays)}), which "
        "would be baked into the program without specs. Pass them as "
        "arguments, e.g. `eqshard.filter_shard_map(lambda model, x: model(x), ...)"
        "(model, x)`."
    )


def _unhashable_error(path_leaves: list[tuple[KeyPath, Any]]) -> TypeError:
    paths = []
    for path, leaf in path_leaves:
        try:
            hash(leaf)
        except TypeError:
            if not is_array(leaf):
                paths.append(path)
    where = (
        f"the non-array arguments at {paths_text(paths)}"
        if paths
        else "the structure of the arguments (a static field of a module?)"
    )
    return TypeError(
        f"eqshard.{CALLER}: {where} cannot be hashed, but the program depends on "
        "it: non-array arguments are static, as in `eqx.filter_jit`. Make them "
        "hashable (e.g. a tuple instead of a list in a static field) or arrays."
    )


class _Map(NamedTuple):
    """What a program of the map is made of."""

    fn: Callable[..., Any]
    mesh: Mesh | AbstractMesh
    in_specs: tuple[PartitionSpec, ...]  # one per array of the arguments
    out_specs: PyTree  # as given: resolved against the output's blocks
    options: dict[str, Any]  # for `jax.shard_map`
    manual: frozenset[str]
    rules: LogicalRules  # for `AxisNames`
    # The arguments' structure and non-array leaves (`None` for every array),
    # and their types.
    static: tuple[Any, tuple[Any, ...], tuple[type, ...]]


def _body(config: _Map, rest: dict[str, Any]) -> Callable[..., Any]:
    """`fn` on one device's blocks: takes the arguments' arrays (`None` for every
    non-array), returns the output's arrays (`None` elsewhere), and leaves the
    output's non-array part in `rest["out"]`."""
    fn = config.fn
    treedef, static_leaves, _ = config.static

    def body(*local: Any) -> Any:
        leaves = treedef.flatten_up_to(local)
        args = jtu.tree_unflatten(
            treedef,
            [x if s is None else s for x, s in zip(leaves, static_leaves, strict=True)],
        )
        arrays, rest["out"] = eqx.partition(fn(*args), is_array)
        return arrays

    body.__name__ = getattr(fn, "__name__", type(fn).__name__)
    body.__qualname__ = getattr(fn, "__qualname__", body.__name__)
    return body


def _spec_tree(config: _Map) -> Any:
    """The in_specs of `jax.shard_map`: the arguments with their arrays' specs,
    `None` for every non-array."""
    treedef, static_leaves, _ = config.static
    given = iter(config.in_specs)
    return jtu.tree_unflatten(
        treedef, [next(given) if s is None else None for s in static_leaves]
    )


def _trace(config: _Map, arrays: tuple[Any, ...]) -> tuple[ClosedJaxpr, Any]:
    """`fn` traced once under `jax.shard_map`, every output replicated (`P()`
    concatenates nothing): the program, with everything the trace read (closed
    over values, globals), and each device's blocks of the outputs, the non-array
    part as `fn` returned it. `out_specs` are checked against the blocks before
    JAX sees them."""
    rest: dict[str, Any] = {}
    shapes = jax.shard_map(
        _body(config, rest),
        mesh=config.mesh,
        in_specs=_spec_tree(config),
        out_specs=PartitionSpec(),
        **{**config.options, "check_vma": False},
    )
    closed, out_shapes = jax.make_jaxpr(shapes, return_shape=True)(*arrays)
    return closed, eqx.combine(out_shapes, rest["out"])


def _mapped(config: _Map, blocks: Any) -> Callable[..., Any]:
    """`run(arrays)`: maps `fn` over the arguments made of `arrays` (the
    arguments with `None` for every non-array) and the static part of `config`,
    and returns the output's arrays (`None` elsewhere); `blocks` are each
    device's blocks of the outputs (`_trace`), against which `out_specs` are
    resolved and checked. JAX gets the trees as they are, so its own messages
    name their paths."""

    def run(arrays: tuple[Any, ...]) -> Any:
        out_def = jtu.tree_structure(eqx.filter(blocks, is_array))
        out_flat = resolve_out_specs(
            config.out_specs, blocks, config.mesh, config.manual, config.rules
        )
        mapped = jax.shard_map(
            _body(config, {}),
            mesh=config.mesh,
            in_specs=_spec_tree(config),
            out_specs=jtu.tree_unflatten(out_def, out_flat),
            **config.options,
        )
        return mapped(*arrays)

    return run


class _Program(NamedTuple):
    """A kept program: `jitted(fed, arrays)` returns the output's arrays; `fed`
    are the JAX arrays `fn` reads (its closure's, its globals'), the constants
    of the trace at the positions `take`, so that a new array there recompiles
    nothing. `kept`: whether it may serve another call (every array the program
    holds was found among the trace's constants)."""

    jitted: Any
    take: tuple[int, ...]
    kept: bool


def _make_program(
    config: _Map, blocks: Any, arrays: tuple[Any, ...], sources: list[Any]
) -> _Program:
    """The program for `config`, traced once more with its real `out_specs`
    (`jax.make_jaxpr`); the JAX arrays it holds as constants (what `fn` reads)
    become inputs, found by identity among `sources`."""
    closed, out_shape = jax.make_jaxpr(_mapped(config, blocks), return_shape=True)(
        arrays
    )
    out_def = jtu.tree_structure(out_shape)
    consts = consts_of(closed)
    where = {id(s): k for k, s in enumerate(sources) if isinstance(s, jax.Array)}
    fed_at = [
        i
        for i, c in enumerate(consts)
        if isinstance(c, jax.Array) and not isinstance(c, Tracer) and id(c) in where
    ]
    unfound = any(
        isinstance(c, jax.Array) and i not in fed_at for i, c in enumerate(consts)
    )
    fixed = [None if i in fed_at else c for i, c in enumerate(consts)]

    def run(fed: list[Any], arrays: tuple[Any, ...]) -> Any:
        given = iter(fed)
        values = [next(given) if c is None else c for c in fixed]
        flat = as_function(closed, values)(*jtu.tree_leaves(arrays))
        return jtu.tree_unflatten(out_def, flat)

    take = tuple(where[id(consts[i])] for i in fed_at)
    return _Program(jax.jit(run), take, not unfound)


_PROGRAMS: Programs[tuple[_Program, list[Any]]] = Programs()
register(_PROGRAMS.clear)


def _program(
    config: _Map, closed: ClosedJaxpr, blocks: Any, arrays: tuple[Any, ...]
) -> _Program:
    """The program for `config`, whose trace is `closed`: kept under what was
    traced (`program_key`: the jaxpr with the values `fn` read, its closure's and
    globals' included; the JAX arrays among them by type, as inputs of the
    program) and what else the program depends on, so that calling again
    compiles nothing, and a value `fn` reads that has changed gives another
    program, never a stale result. A trace that read a traced value (`fn`
    closing over an array of an enclosing `jit`) gives a program for this call
    only."""
    consts = consts_of(closed)
    if any(isinstance(c, Tracer) for c in consts):
        return _make_program(config, blocks, arrays, consts)
    out_leaves, out_def = jtu.tree_flatten(
        config.out_specs,
        is_leaf=lambda x: is_spec_leaf(x) or isinstance(x, AxisNames),
    )
    extra = (
        config.mesh,
        config.in_specs,
        out_def,
        tuple(out_leaves),
        tuple(sorted(config.options.items())),
        config.rules,
        config.static,
        jtu.tree_structure(blocks),
    )
    key, keep = program_key(closed, extra, skip=lambda c: isinstance(c, jax.Array))
    try:
        hash(key)
    except TypeError:
        # A leaf of `out_specs` that cannot be hashed (a rule's value, or no spec
        # at all, which the trace reports): a program for this call only.
        return _make_program(config, blocks, arrays, consts)

    def make() -> tuple[_Program, list[Any]]:
        return _make_program(config, blocks, arrays, consts), keep

    found = _PROGRAMS.get(key, make)[0]
    if not found.kept:
        _PROGRAMS.forget(key)
    return found


# Warm calls: the program and the output's non-array part under what the trace
# depends on (`_call_key`), traced no more.
_CALLS: Programs[tuple[tuple[Any, tuple[int, ...], Any], list[Any]]] = Programs()
register(_CALLS.clear)


def _call_key(
    config: _Map, leaves: list[Any]
) -> tuple[Hashable | None, list[Any], list[Any]]:
    """What a call's trace depends on, so that a warm call traces nothing:
    everything `fn` reads (`reads_key`; JAX arrays by type, as the program's
    inputs), `config` and the arguments' arrays' types, and JAX's trace context;
    `None` where something cannot be keyed by value, or under a trace. Also the
    JAX arrays `fn` reads, in order (the sources of the program's inputs), and
    the objects the key holds by identity."""
    keep: list[Any] = []
    found: list[Any] = []

    def array_key(array: Any) -> Hashable:
        if isinstance(array, Tracer):
            raise Unkeyable("a traced array")
        found.append(array)
        return jax.typeof(array)

    value = ft.partial(value_key, array_key=array_key, keep=keep)
    if any(isinstance(leaf, Tracer) for leaf in leaves):
        return None, found, keep
    try:
        out_leaves, out_def = jtu.tree_flatten(
            config.out_specs,
            is_leaf=lambda x: is_spec_leaf(x) or isinstance(x, AxisNames),
        )
        key = (
            reads_key(find_reads(config.fn), value, keep),
            config._replace(
                fn=None, options=None, out_specs=(out_def, tuple(out_leaves))
            ),
            tuple(sorted(config.options.items())),
            tuple(jax.typeof(x) for x in leaves if is_array(x)),
            trace_context(),
        )
        hash(key)
    except (Unkeyable, TypeError):
        return None, found, keep
    return key, found, keep


def _called(
    config: _Map, arrays: tuple[Any, ...], leaves: list[Any]
) -> tuple[Any, list[Any], Any]:
    """The program for this call, the JAX arrays `fn` reads that it takes as
    inputs, and the output's non-array part: kept from an earlier call whose
    trace depends on the same (`_call_key`), else traced, and kept for the next
    call where every input is found among what `fn` reads."""
    key, found, keep = _call_key(config, leaves)
    kept = None if key is None else _CALLS.find(key)
    if kept is not None:
        jitted, take, rest = kept[0]
        return jitted, [found[k] for k in take], rest
    closed, blocks = _trace(config, arrays)
    consts = consts_of(closed)
    program = _program(config, closed, blocks, arrays)
    rest = eqx.filter(blocks, is_array, inverse=True)
    fed = [consts[k] for k in program.take]
    where = {id(array): k for k, array in enumerate(found)}
    if key is not None and program.kept and all(id(a) in where for a in fed):
        take = tuple(where[id(a)] for a in fed)
        _CALLS.get(key, lambda: ((program.jitted, take, rest), keep))
    return program.jitted, fed, rest


@typecheck
def filter_shard_map(
    fn: Callable[..., Any],
    *,
    out_specs: PyTree,
    in_specs: PyTree = None,
    mesh: Mesh | AbstractMesh | None = None,
    axis_rules: AxisRulesArg | None = None,
    **jax_options: Any,
) -> Callable[..., Any]:
    """`jax.shard_map` over any pytree: `fn` runs once per device, on that device's
    block of each array, with everything that is not an array passed through.

    `fn` may return anything: its arrays are put together by `out_specs`, the rest
    comes back as returned. Inside `fn` the mesh axes are manual, so collectives
    name them; it works eagerly and in `jax.jit`, on Auto and Explicit axes. Specs
    are checked before tracing, every array whose spec cannot apply named in one
    error ([the how-to](../how-to/shard-map.md#giving-the-specs): specs, what is kept).

    **Arguments:**

    - `fn`: the per-device function, called with the positional arguments.
    - `out_specs`: a spec tree for `fn`'s output or a prefix of it, partition
      rules, a function of the abstract output, or [`eqshard.AxisNames`][]. An
      axis a spec leaves out promises that the output is the same along it.
    - `in_specs`: the same for the arguments' tuple; `None` at an array (the
      default) reads its layout, unlike `jax.shard_map`'s (every input static).
    - `mesh`: defaults to the one set by `jax.set_mesh`, else the arguments'.
    - `axis_rules`: logical axis rules for `AxisNames`; defaults to the rules set
      by [`eqshard.logical_axis_rules`][] when the map is called.
    - `**jax_options`: passed to `jax.shard_map` (`axis_names`, `check_vma`).

    **Returns:**

    A function of the positional arguments, returning what `fn` returns (its
    arrays global arrays on the mesh).

    **Raises:**

    `ValueError` if a spec tree is not a prefix of the arguments or the output,
    specs cannot apply (naming the nearest spec that fits), a layout cannot be
    read (an array on no mesh, or traced on Auto axes), arrays are on another
    mesh or differ from `in_specs` on Explicit axes, no mesh is found, or
    `AxisNames` meet no rules; `TypeError` for keyword arguments, unknown
    options, a spec leaf that is not a spec, `fn` holding arrays, unhashable
    non-array arguments, or bad `axis_rules`.

    !!! Example

        ```python
        def local_sum(model, x):  # each device sees its rows of x
            return jax.lax.psum(jax.vmap(model)(x).sum(0), "dp")
        x = eqshard.shard(jnp.ones((16, 4)), P("dp"), mesh)
        total = eqshard.filter_shard_map(local_sum, out_specs=P())(model, x)
        ```
    """
    unknown = sorted(set(jax_options) - set(_JAX_OPTIONS))
    if unknown:
        raise _options_error(unknown)
    options = dict(jax_options)
    given_rules = (
        None if axis_rules is None else normalize_rules(axis_rules, caller=CALLER)
    )
    if "axis_names" in options:
        options["axis_names"] = frozenset(options["axis_names"])

    @ft.wraps(fn)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise _kwargs_error(sorted(kwargs))
        held = [p for p, leaf in jtu.tree_leaves_with_path(fn) if is_array(leaf)]
        if held:
            raise _fn_error(held)
        leaves, treedef = jtu.tree_flatten(args)
        if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves):
            structs = [
                path
                for path, leaf in zip(leaf_paths(args), leaves, strict=True)
                if isinstance(leaf, jax.ShapeDtypeStruct)
            ]
            raise abstract_leaf_error(CALLER, structs)
        layouts = [array_layout(leaf) if is_array(leaf) else None for leaf in leaves]
        on = map_mesh(mesh, in_specs, layouts)
        require_traced_or_runnable(CALLER, on, leaves)
        manual = options.get("axis_names") or frozenset(on.axis_names)
        rules = get_logical_axis_rules() if given_rules is None else given_rules
        specs = resolve_in_specs(in_specs, args, leaves, layouts, on, manual, rules)
        static_leaves = tuple(None if is_array(leaf) else leaf for leaf in leaves)
        static = (treedef, static_leaves, tuple(map(type, static_leaves)))
        try:
            hash(static)
        except TypeError:
            raise _unhashable_error(jtu.tree_leaves_with_path(args)) from None
        # NumPy arguments as private copies, traced as JAX reads them (native
        # byte order), so that the caller may write their buffers at once.
        arrays = host_private(
            jtu.tree_unflatten(
                treedef, [leaf if is_array(leaf) else None for leaf in leaves]
            )
        )
        config = _Map(fn, on, specs, out_specs, options, manual, rules, static)
        jitted, fed, rest = _called(config, arrays, leaves)
        return eqx.combine(jitted(fed, arrays), rest)

    return mapped
