"""`shard_map`: `jax.shard_map` over any pytree, Equinox modules included.

How a call goes:

1. **Split.** The arrays among the arguments are the inputs of the map; everything
   else (static fields, callables, Python scalars, `None`) is held static, as
   `eqx.filter_jit` does, and reaches `fn` unchanged.
2. **Resolve and check, before tracing.** `in_specs` (a spec tree or prefix,
   partition rules, logical `AxisNames`, or `None` to read each array's own
   layout) becomes one `PartitionSpec` per array. Every array whose spec cannot
   apply is reported in one error: specs that do not divide the array, axes the
   mesh (or its manual part) lacks, layouts that cannot be read, arrays on
   another mesh, and on Explicit axes a spec other than the array's own layout.
3. **Trace.** `fn` is traced under `jax.shard_map` with every output replicated
   (`_trace`): that reads the per-device shapes of its outputs, against which
   `out_specs` are resolved and checked, and its non-array outputs, which come
   back as `fn` returned them (as in `eqx.filter_jit`).
4. **Keep.** The program (a `jax.jit`, which traces `fn` once more when it is
   made) is kept under what that trace read (`_programs.program_key`: the jaxpr
   with the values of closed-over variables and globals, NumPy data by
   content) with the mesh, specs, options, rules and static arguments: a call
   whose trace is one already compiled compiles nothing, eagerly too (an eager
   `jax.shard_map` compiles at every call), and a value `fn` reads that has
   changed gives another program, never a stale result. So every call traces
   `fn` once; under `jax.jit` that is once per trace of the enclosing function.
"""

import functools as ft
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.core import Tracer
from jax.extend.core import ClosedJaxpr
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._mesh import find_mesh, mesh_repr, same_mesh
from .._move._host import host_private
from .._spectree._logical import (
    AxisNames,
    get_logical_axis_rules,
    LogicalRules,
    normalize_rules,
)
from .._spectree._spec_args import resolve_specs
from .._spectree._specs import (
    check_leaves,
    check_spec,
    entry_axes,
    is_spec_leaf,
    leaf_specs,
    spec_error_message,
)
from .._tree import abstract_leaf_error, is_array, listing, path_str, paths_text
from .._typing import AxisRulesArg, KeyPath, typecheck
from ._programs import program_key, Programs


_CALLER = "filter_shard_map"
# The options of `jax.shard_map` passed through (`axis_names`, `check_vma`).
_JAX_OPTIONS = tuple(
    name
    for name in inspect.signature(jax.shard_map).parameters
    if name not in ("f", "out_specs", "in_specs", "mesh")
)
_INFER = (
    " (`in_specs=None`, the default, means: read each array's own layout. In "
    "`jax.shard_map`, `in_specs=None` means that every input is static.)"
)


# One builder per kind of message.


def _options_error(unknown: list[str]) -> TypeError:
    return TypeError(
        f"eqshard.{_CALLER}: unknown option {', '.join(map(repr, unknown))}; the "
        f"options of `jax.shard_map` it passes on are {', '.join(_JAX_OPTIONS)}."
    )


def _kwargs_error(names: list[str]) -> TypeError:
    return TypeError(
        f"eqshard.{_CALLER}: the mapped function was called with keyword arguments "
        f"{', '.join(map(repr, names))}; pass them positionally, since `in_specs` "
        "describes the tuple of positional arguments (as in `jax.shard_map`)."
    )


def _no_mesh_error() -> ValueError:
    return ValueError(
        f"eqshard.{_CALLER}: no mesh: pass `mesh=`, set one with "
        "`jax.set_mesh(mesh)`, or pass arrays placed on a mesh (e.g. by "
        "`eqshard.shard`; under `jit`, `grad` or any other transformation, only "
        "arrays on Explicit axes say which mesh they are on)."
    )


def _meshes_error(meshes: list[Mesh | AbstractMesh]) -> ValueError:
    listed = ", ".join(mesh_repr(m) for m in meshes)
    return ValueError(
        f"eqshard.{_CALLER}: the arguments are placed on {len(meshes)} different "
        f"meshes ({listed}) and no mesh is given or set; pass `mesh=` for the map "
        "and place every array on it."
    )


def _fn_error(arrays: list[KeyPath]) -> TypeError:
    return TypeError(
        f"eqshard.{_CALLER}: `fn` holds arrays (at {paths_text(arrays)}), which "
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
        f"eqshard.{_CALLER}: {where} cannot be hashed, but the program depends on "
        "it: non-array arguments are static, as in `eqx.filter_jit`. Make them "
        "hashable (e.g. a tuple instead of a list in a static field) or arrays."
    )


def _infer_error(found: list[tuple[KeyPath, str]], mesh: Any) -> ValueError:
    return ValueError(
        listing(
            f"eqshard.{_CALLER}: cannot read the layout of {len(found)} array(s) "
            f"on mesh {mesh_repr(mesh)}:",
            [f"'{path_str(p)}' {why}." for p, why in found],
            "Pass `in_specs` (a spec tree or prefix for the tuple of "
            "arguments, e.g. `(model_specs, P('dp'))`, or rules), or place "
            "the arrays first with `eqshard.shard`." + _INFER,
            limit=None,
        )
    )


def _other_mesh_error(
    argname: str, found: list[tuple[KeyPath, Any]], mesh: Any
) -> ValueError:
    return ValueError(
        listing(
            f"eqshard.{_CALLER}: `{argname}` has {len(found)} array(s) on another "
            f"mesh than the map's {mesh_repr(mesh)}:",
            [f"'{path_str(p)}': on mesh {mesh_repr(m)}." for p, m in found],
            "Place them on the map's mesh (`eqshard.shard(tree, specs, mesh)`), "
            "or pass `PartitionSpec`s instead of `NamedSharding`s.",
            limit=None,
        )
    )


def _explicit_error(found: list[tuple[KeyPath, Any, Any]], mesh: Any) -> ValueError:
    lines = [
        f"'{path_str(p)}': "
        + (
            f"laid out as {have}"
            if have is not None
            else "its type has no layout (a host array, or placed on Auto axes)"
        )
        + f", `in_specs` asks {want}."
        for p, have, want in found
    ]
    return ValueError(
        listing(
            f"eqshard.{_CALLER}: on Explicit axes ({mesh_repr(mesh)}) "
            "`jax.shard_map` takes each array as its type lays it out "
            f"(`jax.typeof(x).sharding`), but {len(found)} array(s) are laid "
            "out otherwise:",
            lines,
            "Omit `in_specs` to use the arrays' own layouts, or lay them out as "
            "asked first: `eqshard.shard` outside `jit`, "
            "`jax.sharding.reshard` inside.",
            limit=None,
        )
    )


def _no_rules_error(argname: str, found: list[tuple[KeyPath, Any]]) -> ValueError:
    listed = ", ".join(f"{names!r} at '{path_str(path)}'" for path, names in found)
    return ValueError(
        f"eqshard.{_CALLER}: `{argname}` has logical axis names ({listed}), but no "
        "logical axis rules are given or set, so they would resolve to no mesh "
        "axis (a replicated P(None, ...)). Pass `axis_rules=` (e.g. "
        "`axis_rules=[('batch', 'dp')]`), or set rules with "
        "`eqshard.set_logical_axis_rules` or `with eqshard.logical_axis_rules(...)`."
    )


def _no_out_spec_error(paths: list[KeyPath]) -> ValueError:
    return ValueError(
        f"eqshard.{_CALLER}: `out_specs` has `None` at {paths_text(paths)}, where `fn` "
        "returns arrays: give each a spec, e.g. P() for an array that is the same "
        "on every device of the map."
    )


# Specs: resolved against a tree, checked against a mesh.


def _check(
    shape: tuple[int, ...],
    spec: PartitionSpec,
    mesh: Mesh | AbstractMesh,
    leaf: Any,
    *,
    manual: frozenset[str],
    blocks: bool,
) -> tuple[PartitionSpec, list[str]]:
    """`check_spec` for one array of the map, and the nearest spec that applies.
    Axes must be manual ones (see `axis_names`), and an array may not leave its
    layout to the compiler. With `blocks`, `shape` is one device's block of an
    output, which any sizes divide."""
    sizes = dict(mesh.shape)
    fixed, reasons = check_spec(
        shape, spec, dict.fromkeys(sizes, 1) if blocks else sizes
    )
    named = {axis for entry in spec for axis in entry_axes(entry)}
    automatic = sorted(axis for axis in named if axis in sizes and axis not in manual)
    if automatic:
        reasons.append(
            f"{', '.join(map(repr, automatic))} not among the manual axes "
            f"{tuple(sorted(manual))} (`axis_names`)"
        )
    if any(entry is PartitionSpec.UNCONSTRAINED for entry in spec):
        reasons.append("P.UNCONSTRAINED leaves a layout to the compiler")
    if automatic or PartitionSpec.UNCONSTRAINED in tuple(fixed):
        fixed = _only(fixed, manual)
    return fixed, reasons


def _only(spec: PartitionSpec, axes: frozenset[str]) -> PartitionSpec:
    """`spec` naming only `axes`, without trailing `None`s."""
    entries = []
    for entry in spec:
        kept = tuple(axis for axis in entry_axes(entry) if axis in axes)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _placement(spec: PartitionSpec, ndim: int) -> tuple[tuple[Any, ...], ...]:
    """The axes of each dimension: equal for `P('dp')` and `P(('dp',), None)`."""
    entries = tuple(spec)
    return tuple(
        tuple(entry_axes(entries[d])) if d < len(entries) else () for d in range(ndim)
    )


def _layout(leaf: Any) -> tuple[PartitionSpec, Mesh | AbstractMesh] | str:
    """The spec and mesh an array carries, or why it carries none: a placed array's
    `NamedSharding`, a traced array's type on Explicit axes."""
    if isinstance(leaf, Tracer):
        sharding = jax.typeof(leaf).sharding
        types = set(sharding.mesh.axis_types)
        if sharding.mesh.empty or types != {AxisType.Explicit}:
            return (
                "is traced on Auto axes, where its type carries no layout (the "
                "compiler chooses one)"
            )
        return sharding.spec, sharding.mesh
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return sharding.spec, sharding.mesh
    if sharding is None:
        return "is a NumPy array, on no mesh"
    return f"has a {type(sharding).__name__}, not a NamedSharding on a mesh"


def _map_mesh(
    mesh: Mesh | AbstractMesh | None, in_specs: Any, layouts: list[Any]
) -> Mesh | AbstractMesh:
    """The mesh of the map: `mesh`, the current mesh, or the one of the
    `NamedSharding`s in `in_specs` and of the arrays' `layouts`."""
    given = find_mesh(mesh)
    if given is not None:
        return given
    found: list[Mesh | AbstractMesh] = []
    named = jtu.tree_leaves(in_specs, is_leaf=is_spec_leaf)
    meshes = [x.mesh for x in named if isinstance(x, NamedSharding)]
    meshes += [x[1] for x in layouts if isinstance(x, tuple)]
    for on in meshes:
        if not any(same_mesh(on, m) for m in found):
            found.append(on)
    if not found:
        raise _no_mesh_error()
    if len(found) > 1:
        raise _meshes_error(found)
    return found[0]


def _logical_pairs(
    specs: Any,
    tree: Any,
    *,
    argname: str,
    mesh: Mesh | AbstractMesh,
    rules: LogicalRules,
    per_item: bool = False,
) -> list[tuple[KeyPath, Any]]:
    """`leaf_specs` of `specs` (a spec tree or prefix, rules, or a function)
    resolved for `tree`, `AxisNames` resolved by `rules`: refused while there are
    no rules, since every name would then resolve to no axis (in the specs as
    given, where rules' values are, and as resolved, where a function's are)."""
    resolved = resolve_specs(
        specs,
        tree,
        caller=_CALLER,
        argname=argname,
        mesh=mesh,
        axis_rules=rules,
        per_item=per_item,
    )
    if not rules:
        for given in (specs, resolved):
            found = [
                (path, leaf)
                for path, leaf in jtu.tree_leaves_with_path(
                    given, is_leaf=lambda x: isinstance(x, AxisNames)
                )
                if isinstance(leaf, AxisNames) and any(n is not None for n in leaf)
            ]
            if found:
                raise _no_rules_error(argname, found)
    return leaf_specs(
        resolved,
        tree,
        caller=_CALLER,
        logical=True,
        axis_rules=rules,
        argname=argname,
    )


def _leafpaths_text(tree: Any) -> list[KeyPath]:
    """The paths of the leaves of `tree`, for messages (found again only then)."""
    return [path for path, _ in jtu.tree_leaves_with_path(tree)]


def _in_specs(
    in_specs: Any,
    args: tuple[Any, ...],
    leaves: list[Any],
    layouts: list[Any],
    mesh: Mesh | AbstractMesh,
    manual: frozenset[str],
    rules: LogicalRules,
) -> tuple[PartitionSpec, ...]:
    """One spec per array of `args`, checked against it; raises the errors above,
    each listing every array it concerns. `layouts` are those of `_layout`."""
    if in_specs is None:  # every layout read: no spec tree to match
        given: list[Any] = [None] * len(leaves)
        paths: list[KeyPath] | None = None
    else:
        pairs = _logical_pairs(
            in_specs, args, argname="in_specs", mesh=mesh, rules=rules, per_item=True
        )
        paths = [path for path, _ in pairs]
        given = [spec for _, spec in pairs]
    cannot, elsewhere = [], []
    specs: list[Any] = []  # one for each leaf, None for non-arrays
    for i, (spec, leaf, layout) in enumerate(zip(given, leaves, layouts, strict=True)):
        if not is_array(leaf):
            specs.append(None)
            continue
        if spec is None:
            if isinstance(layout, str):
                cannot.append((i, layout))
                continue
            spec, on = layout
            if not manual.issuperset(on.axis_names):
                spec = _only(spec, manual)
        elif isinstance(spec, NamedSharding):
            spec, on = spec.spec, spec.mesh
        else:
            on = mesh
        if not same_mesh(on, mesh):
            elsewhere.append((i, on))
        specs.append(spec)
    if cannot or elsewhere:
        where = paths or _leafpaths_text(args)
        if cannot:
            raise _infer_error([(where[i], why) for i, why in cannot], mesh)
        found = [(where[i], on) for i, on in elsewhere]
        raise _other_mesh_error("in_specs", found, mesh)
    if paths is not None:  # given specs: checked (read layouts fit already)
        given = [s.spec if isinstance(s, NamedSharding) else s for s in given]
        problems = check_leaves(
            list(zip(paths, given, strict=True)),
            leaves,
            mesh,
            check=ft.partial(_check, manual=manual, blocks=False),
        )
        if problems:
            raise ValueError(spec_error_message(_CALLER, problems))
    at = [i for i, spec in enumerate(specs) if spec is not None]
    if manual == frozenset(mesh.axis_names) and set(mesh.axis_types) == {
        AxisType.Explicit
    }:
        differ = []
        for i in at:
            typed, spec = jax.typeof(leaves[i]).sharding, specs[i]
            ndim = leaves[i].ndim
            if _placement(typed.spec, ndim) != _placement(spec, ndim):
                explicit = set(typed.mesh.axis_types) == {AxisType.Explicit}
                differ.append((i, typed.spec if explicit else None, spec))
        if differ:
            where = paths or _leafpaths_text(args)
            found = [(where[i], have, want) for i, have, want in differ]
            raise _explicit_error(found, mesh)
    return tuple(specs[i] for i in at)


def _out_specs(
    out_specs: Any,
    blocks: Any,
    mesh: Mesh | AbstractMesh,
    manual: frozenset[str],
    rules: LogicalRules,
) -> list[PartitionSpec]:
    """One spec per array output, given each device's `blocks` of the outputs."""
    pairs = _logical_pairs(
        out_specs, blocks, argname="out_specs", mesh=mesh, rules=rules
    )
    leaves = jtu.tree_leaves(blocks)
    missing, elsewhere = [], []
    specs: list[tuple[KeyPath, Any]] = []
    for (path, spec), leaf in zip(pairs, leaves, strict=True):
        if not is_array(leaf):
            continue
        if spec is None:
            missing.append(path)
        elif isinstance(spec, NamedSharding):
            if not same_mesh(spec.mesh, mesh):
                elsewhere.append((path, spec.mesh))
            spec = spec.spec
        specs.append((path, spec))
    if missing:
        raise _no_out_spec_error(missing)
    if elsewhere:
        raise _other_mesh_error("out_specs", elsewhere, mesh)
    arrays = [leaf for leaf in leaves if is_array(leaf)]
    problems = check_leaves(
        specs, arrays, mesh, check=ft.partial(_check, manual=manual, blocks=True)
    )
    if problems:
        raise ValueError(
            spec_error_message(_CALLER, problems)
            + "\n(The shapes are those of one device's block of the outputs.)"
        )
    return [spec for _, spec in specs]


# The program, kept.


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


def _make_program(config: _Map, blocks: Any) -> Any:
    """`jax.jit(run)`: `run(arrays)` maps `fn` over the arguments made of `arrays`
    (the arguments with `None` for every non-array) and the static part of
    `config`, and returns the output's arrays (`None` elsewhere); `blocks` are
    each device's blocks of the outputs (`_trace`), against which `out_specs`
    are resolved and checked. JAX gets the trees as they are, so its own
    messages name their paths."""

    def run(arrays: tuple[Any, ...]) -> Any:
        out_def = jtu.tree_structure(eqx.filter(blocks, is_array))
        out_flat = _out_specs(
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

    return jax.jit(run)


_PROGRAMS: Programs[tuple[Any, list[Any]]] = Programs()


def _program(config: _Map, closed: ClosedJaxpr, blocks: Any) -> Any:
    """The program for `config`, whose trace is `closed`: kept under what was
    traced (`program_key`: the jaxpr with the values `fn` read, its closure's and
    globals' included) and what else the program depends on, so that calling
    again compiles nothing, and a value `fn` reads that has changed gives another
    program, never a stale result. A trace that read a traced value (`fn` closing
    over an array of an enclosing `jit`) gives a program for this call only."""
    if any(isinstance(c, Tracer) for c in closed.consts):
        return _make_program(config, blocks)
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
    key, keep = program_key(closed, extra)
    try:
        hash(key)
    except TypeError:
        # A leaf of `out_specs` that cannot be hashed (a rule's value, or no spec
        # at all, which the trace reports): a program for this call only.
        return _make_program(config, blocks)
    return _PROGRAMS.get(key, lambda: (_make_program(config, blocks), keep))[0]


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

    The arrays of the arguments get specs; everything else (an Equinox module's
    static fields and callables, Python scalars, `None`) reaches `fn` unchanged, and
    `fn` may return anything: its arrays are put together by `out_specs`, the rest
    comes back as `fn` returned it. Inside `fn` the mesh axes are manual, so
    collectives (`jax.lax.psum`, `jax.lax.ppermute`, ...) name them. It works
    eagerly and inside `jax.jit`/`eqx.filter_jit`, on Auto and Explicit axes.

    Specs are resolved and checked before anything is traced, and every array
    whose spec cannot apply is named in one error. The program is kept under
    what tracing `fn` read: calling again with arguments of the same structure,
    shapes and non-array values (by type and value, as `eqx.filter_jit` holds
    them static) compiles nothing, eagerly too, while a value `fn` reads that has
    changed (a closure's variable, a global, NumPy data changed in place) is
    read again, as an eager `jax.shard_map` reads it. Each call traces `fn` once
    (the first twice: once more for the program); for the least overhead per
    step, call it inside `jax.jit`, which traces once.

    **Arguments:**

    - `fn`: the per-device function, called with the positional arguments.
    - `out_specs`: a spec tree for `fn`'s output or a prefix of it (`P('dp')` for
      all of it; `None` only where it returns no array), partition rules matched
      against the output, a function of the abstract output (see
      [the spec-tree family](specs.md)), or logical [`eqshard.AxisNames`][]
      (resolved by `axis_rules`). An axis a spec leaves out promises that the
      output is the same along it.
    - `in_specs`: the same for the tuple of arguments, e.g. `(model_specs,
      P('dp'))`; rules are matched against each argument (paths start inside
      it), also as one entry of such a tuple. `None` at an array, and the
      default `in_specs=None` for all of them, means its current layout: a placed
      array's `NamedSharding` (on any mesh), or under `jit` (or `grad`, or any
      transformation) the type of an array on Explicit axes
      (`jax.typeof(x).sharding`); on Auto axes a traced array's type has no
      layout, so there give the specs. This is not `jax.shard_map`'s
      `in_specs=None`, which makes every input static.
    - `mesh`: the mesh; defaults to the one set by `jax.set_mesh`, else the one
      the arguments are placed on.
    - `axis_rules`: logical axis rules for the `AxisNames` in `in_specs` and
      `out_specs`; defaults to the rules set by [`eqshard.logical_axis_rules`][]
      or [`eqshard.set_logical_axis_rules`][] when the map is called.
    - `**jax_options`: passed to `jax.shard_map`: `axis_names` (the manual axes;
      default all), `check_vma`.

    **Returns:**

    A function taking the arguments positionally and returning what `fn` returns,
    its arrays global arrays on the mesh.

    **Raises:**

    At the call, before tracing, eqshard's error naming every array concerned:

    - `ValueError` if a spec tree is not a prefix of the arguments or the output
      (naming the first path that differs), if specs cannot apply (an axis not in
      the mesh, or not manual; a dimension its axes do not divide; a spec longer
      than the array's rank; naming the nearest spec that fits), if a layout
      cannot be read (an array on no mesh, or traced on Auto axes), if arrays
      are on another mesh, if on Explicit axes `in_specs` differ from the
      arrays' layouts, if no mesh is given, set or found, or if specs hold
      `AxisNames` while no logical axis rules are given or set (naming where).
    - `TypeError` for keyword arguments, unknown options, a spec leaf that is not
      a spec, `fn` holding arrays, non-array arguments that cannot be hashed, or
      bad `axis_rules`.

    !!! Example

        ```python
        mesh = eqshard.create_mesh((8,), ("dp",))
        model = eqx.nn.Linear(4, 2, key=jax.random.key(0))
        model = eqshard.shard(model, P(), mesh)  # a copy on every device
        x = eqshard.shard(jnp.ones((16, 4)), P("dp"), mesh)

        def local_sum(model, x):  # each device sees 2 rows of x
            return jax.lax.psum(jax.vmap(model)(x).sum(0), "dp")

        total = eqshard.filter_shard_map(local_sum, out_specs=P())(model, x)  # (2,)
        ```
    """
    unknown = sorted(set(jax_options) - set(_JAX_OPTIONS))
    if unknown:
        raise _options_error(unknown)
    options = dict(jax_options)
    given_rules = (
        None if axis_rules is None else normalize_rules(axis_rules, caller=_CALLER)
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
                for path, leaf in zip(_leafpaths_text(args), leaves, strict=True)
                if isinstance(leaf, jax.ShapeDtypeStruct)
            ]
            raise abstract_leaf_error(_CALLER, structs)
        layouts = [_layout(leaf) if is_array(leaf) else None for leaf in leaves]
        on = _map_mesh(mesh, in_specs, layouts)
        manual = options.get("axis_names") or frozenset(on.axis_names)
        rules = get_logical_axis_rules() if given_rules is None else given_rules
        specs = _in_specs(in_specs, args, leaves, layouts, on, manual, rules)
        static_leaves = tuple(None if is_array(leaf) else leaf for leaf in leaves)
        static = (treedef, static_leaves, tuple(map(type, static_leaves)))
        try:
            hash(static)
        except TypeError:
            raise _unhashable_error(jtu.tree_leaves_with_path(args)) from None
        arrays = jtu.tree_unflatten(
            treedef, [leaf if is_array(leaf) else None for leaf in leaves]
        )
        config = _Map(fn, on, specs, out_specs, options, manual, rules, static)
        closed, blocks = _trace(config, arrays)
        out = _program(config, closed, blocks)(host_private(arrays))
        return eqx.combine(out, eqx.filter(blocks, is_array, inverse=True))

    return mapped
