"""`init_sharded`: a model built straight into its shardings, under `jax.jit`.

`fn` is traced once (`jax.make_jaxpr`), which gives its program and the abstract
model: the shapes the specs are resolved and checked against, and everything that
is not an array (static fields, callables, Python scalars) as `fn` made it. The
program then runs under `jax.jit` with `out_shardings`, so that each device
computes only its own shards of every array; only arrays leave it, and they are
put back into the abstract model. Where pieces of the program repeat (the blocks
of a list), it runs in pieces instead, each distinct piece compiled once
(`_init_pieces.py`; the whole program is the plain route, `_pieces`). NumPy data
among the arguments, or read by `fn`, is checked first as `shard` checks host
data (`_narrowed` before the trace; `_captured_losses` after it, for the NumPy
data the trace captured, looked for among what `fn` reads): JAX would narrow it
to 32 bits while tracing, out of sight. What `fn` reads is found once per call
(`_internals.closures.find_reads`), for this check and for the key below.

The trace, its specs and its program are kept (`_BUILT`) under what the trace
depends on (`_built_key`: `fn` and what it reads, keyed by value by
`_internals.closures.reads_key`; the arguments; the specs, mesh and rules;
JAX's trace context), so a warm call traces nothing; the compiled program
(`_PROGRAMS`) under what was traced: the jaxpr with its parameters and nested
constants, the shardings, JAX's configuration and the route (both emptied by
`eqshard.clear_caches`). NumPy data `fn` closes over is an input of the
program, not part of it. A value `fn` reads that changed is traced again.
"""

import dataclasses
import functools as ft
import hashlib
import typing
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.extend.core import ClosedJaxpr
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._caches import register
from .._internals import jaxpr as jaxprs, routes
from .._internals.closures import (
    find_reads,
    Reads,
    reads_key,
    trace_context,
    Unkeyable,
    value_key,
)
from .._internals.program_keys import program_key
from .._mesh._current import concrete_mesh
from .._mesh._targets import require_runnable
from .._move._host import converted, host_private, loss_error, lost_text
from .._spectree._check_spec import (
    abstract_mesh_error,
    check_placeable,
    check_spec_on_mesh,
)
from .._spectree._derive import abstract_tree
from .._spectree._logical import get_logical_axis_rules
from .._spectree._resolve import resolve_specs
from .._transforms._programs import Programs
from .._tree import is_array, path_str, paths_text
from .._typing import KeyPath, typecheck
from ._init_pieces import Plan, plan


_CALLER = "init_sharded"


@dataclasses.dataclass(frozen=True)
class ShardedInit:
    """The parts of [`eqshard.init_sharded`][] for one call (`sharded_init`).

    - `run(*inputs)`: the model's arrays in their shardings, a flat list, from
      the program in pieces where pieces repeat (`_init_pieces.py`); else it is
      `jitted` (the plain route, also taken with `EQSHARD_PLAIN_ROUTES=init` and
      when the program cannot be read: `_pieces`).
    - `jitted(*inputs)`: the same from the whole program (`jitted.lower(*inputs)`
      is the program, for memory analysis).
    - `consts`, `arrays`: the NumPy data `fn` closes over and the arrays among
      its arguments (none in the record `_BUILT` keeps); `inputs` is both.
    - `shapes`: the abstract model, every array with its `NamedSharding`.
    - `assemble(arrays)`: the model with those arrays in it.
    """

    run: Callable[..., list[jax.Array]]
    jitted: Any
    consts: list[Any]
    shapes: PyTree
    assemble: Callable[[Sequence[jax.Array]], PyTree]
    arrays: list[Any] = dataclasses.field(default_factory=list)

    @property
    def inputs(self) -> tuple[list[Any], list[Any]]:
        return self.consts, self.arrays


def sharded_init(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    specs: Any,
    mesh: Mesh | AbstractMesh | None,
    caller: str = _CALLER,
) -> ShardedInit:
    """The parts of [`eqshard.init_sharded`][] for `fn(*args, **kwargs)`, traced
    and compiled once per what the trace depends on (`_built_key`)."""
    mesh = concrete_mesh(mesh, caller=caller, required=False)
    args, kwargs = _narrowed(args, kwargs, caller=caller)
    dynamic, static_args = eqx.partition((tuple(args), kwargs), eqx.is_array)
    flat, in_def = jtu.tree_flatten(dynamic)

    read = find_reads(fn)
    key, keep = _built_key(read, (static_args, in_def, flat), specs, mesh, caller)

    def make() -> tuple[ShardedInit, list[Any]]:
        # What the key holds by identity lives as long as it is kept.
        built = _build(fn, args, kwargs, read, specs=specs, mesh=mesh, caller=caller)
        return built, keep

    built, _ = make() if key is None else _BUILT.get(key, make)
    return dataclasses.replace(built, arrays=flat)


def _build(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    read: Reads,
    *,
    specs: Any,
    mesh: Mesh | None,
    caller: str,
) -> ShardedInit:
    """`sharded_init`'s parts, traced and compiled (or found compiled) for these
    arguments, without the arrays among them (`read`: what `fn` reads)."""
    closed, _, shapes, outputs = _trace(fn, args, kwargs)
    lost = _captured_losses(read, closed)
    if lost:
        raise loss_error(caller, lost, fix=_NARROWED_FIX)
    spec_tree = resolve_specs(specs, shapes, caller=caller, mesh=mesh)
    # Built arrays need a layout: no `P.UNCONSTRAINED`, as for `shard`.
    check = ft.partial(check_placeable, check_spec_on_mesh)
    shapes = abstract_tree(shapes, spec_tree, mesh, caller=caller, check=check)
    shapes = _on_one_mesh(shapes, mesh, caller=caller)
    leaves, treedef = jtu.tree_flatten(shapes)
    shardings = [leaf.sharding for leaf, out in zip(leaves, outputs) if out]

    def assemble(arrays: Sequence[jax.Array]) -> PyTree:
        built = map(_readable, arrays)
        model = [next(built) if out else leaf for leaf, out in zip(leaves, outputs)]
        return jtu.tree_unflatten(treedef, model)

    program, plan, consts = _program(closed, shardings)
    run = program if plan is None else plan.run
    return ShardedInit(run, program, consts, shapes, assemble)


def _readable(array: jax.Array) -> jax.Array:
    """`array`, or for a size-0 one a copy placed anew: JAX's compiled programs
    give size-0 outputs split over an axis malformed shards (each the whole
    array), which `np.asarray` cannot read."""
    if array.size or jnp.issubdtype(array.dtype, jax.dtypes.prng_key):
        return array
    return jax.device_put(np.zeros(array.shape, array.dtype), array.sharding)


def _on_one_mesh(shapes: PyTree, mesh: Mesh | None, *, caller: str) -> PyTree:
    """`shapes` (the abstract model with its arrays' shardings) with every array
    on one concrete mesh: an array whose spec is `None` is replicated on `mesh`,
    or on the mesh of the others. Several meshes, an abstract one, or no mesh for
    an array without a spec are refused, naming the paths."""
    # Every output of one program lives on one set of devices: an array whose spec
    # is `None` is replicated on the mesh of the others.
    path_leaves = jtu.tree_leaves_with_path(shapes)
    meshes = {
        leaf.sharding.mesh
        for _, leaf in path_leaves
        if is_array(leaf) and isinstance(leaf.sharding, NamedSharding)
    }
    abstract_at = [
        path
        for path, leaf in path_leaves
        if is_array(leaf)
        and isinstance(leaf.sharding, NamedSharding)
        and not isinstance(leaf.sharding.mesh, Mesh)
    ]
    if abstract_at:
        raise abstract_mesh_error(caller, abstract_at)
    if len(meshes) > 1:
        raise _several_meshes_error(caller, path_leaves)
    unsharded = [
        path_str(path)
        for path, leaf in path_leaves
        if is_array(leaf) and leaf.sharding is None
    ]
    on = mesh if mesh is not None else (next(iter(meshes)) if meshes else None)
    if unsharded and on is None:
        raise ValueError(
            f"eqshard.{caller}: the arrays at {paths_text(unsharded)} "
            "have no spec and no mesh is given or set to replicate them on; pass "
            "mesh=... or give them specs."
        )
    shapes = jtu.tree_map(
        lambda leaf: (
            jax.ShapeDtypeStruct(
                leaf.shape,
                leaf.dtype,
                sharding=NamedSharding(typing.cast(Mesh, on), PartitionSpec()),
                weak_type=leaf.weak_type,
            )
            if is_array(leaf) and leaf.sharding is None
            else leaf
        ),
        shapes,
    )
    return shapes


def _several_meshes_error(caller: str, path_leaves: list[Any]) -> ValueError:
    """The error for specs placing arrays on several meshes, naming a path on
    each."""
    first: dict[Any, str] = {}
    for path, leaf in path_leaves:
        if is_array(leaf) and isinstance(leaf.sharding, NamedSharding):
            first.setdefault(leaf.sharding.mesh, path_str(path))
    listed = "; ".join(f"'{path}' on {on!r}" for on, path in first.items())
    return ValueError(
        f"eqshard.{caller}: `specs` places arrays on {len(first)} different "
        f"meshes ({listed}), but one program builds them all. Use one mesh for "
        "every spec (the same devices, axes and axis types)."
    )


def _narrowed(
    args: Sequence[Any], kwargs: dict[str, Any], *, caller: str
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments with their NumPy data as JAX takes it (`_host.converted`:
    64-bit narrowed to 32 bits while `jax_enable_x64` is off), after checking
    that this loses no value. Data that would change (an int64 beyond int32, a
    float64 becoming inf) is refused, naming where it is, as `shard` refuses it."""
    lost: list[tuple[KeyPath, np.dtype, np.dtype, str, bool]] = []

    def checked(root: str, tree: Any) -> Any:
        leaves, treedef = jtu.tree_flatten_with_path(tree)
        out = []
        for path, leaf in leaves:
            if isinstance(leaf, np.ndarray | np.generic) and leaf.dtype.kind in "biufc":
                value, loss = converted(np.asarray(leaf), None)
                if loss is not None:
                    where = (jtu.GetAttrKey(root), *path)
                    lost.append(
                        (where, leaf.dtype, value.dtype, lost_text(loss), False)
                    )
                elif value.dtype != leaf.dtype:
                    leaf = value[()] if isinstance(leaf, np.generic) else value
            out.append(leaf)
        return jtu.tree_unflatten(treedef, out)

    args = tuple(checked(f"args[{n}]", arg) for n, arg in enumerate(args))
    kwargs = {name: checked(name, value) for name, value in kwargs.items()}
    if lost:
        raise loss_error(caller, lost, fix=_NARROWED_FIX)
    return args, kwargs


_NARROWED_FIX = (
    "64-bit NumPy data is narrowed to 32 bits while `jax_enable_x64` is off: "
    "enable it first (`jax.config.update('jax_enable_x64', True)`), or give `fn` "
    "this data in a dtype that holds its values (float32 for floats up to 3.4e38)."
)


def _digest(data: np.ndarray) -> Hashable:
    data = np.asarray(data)
    return (data.shape, data.dtype.str, hashlib.sha256(data.tobytes()).hexdigest())


def _captured_losses(
    read: Reads, closed: ClosedJaxpr
) -> list[tuple[KeyPath, np.dtype, np.dtype, str, bool]]:
    """The NumPy data that `fn` reads (`read`), that its trace (`closed`)
    captured as a constant, and that JAX narrowed with a loss while tracing (out
    of sight), as `_host.loss_error` lists it. Only data the trace captured is
    reported: a value `fn` reads counts if, narrowed, it is one of the trace's
    constants. Nothing is looked for if the trace captured no NumPy data, and a
    dict whose keys JAX cannot sort (so cannot flatten) is skipped."""
    captured = {
        _digest(c)
        for c in jaxprs.nested_consts(closed)
        if _is_fed(c) and c.dtype.kind in "biufc"
    }
    if not captured:
        return []
    lost: list[tuple[KeyPath, np.dtype, np.dtype, str, bool]] = []
    for name, value in read.values:
        try:
            leaves = jtu.tree_leaves_with_path(value)
        except (ValueError, TypeError):
            continue  # keys JAX cannot sort (a dict's, a defaultdict's): not data
        for path, leaf in leaves:
            if isinstance(leaf, np.ndarray | np.generic) and leaf.dtype.kind in "biufc":
                narrowed, loss = converted(np.asarray(leaf), None)
                if loss is not None and _digest(narrowed) in captured:
                    where = (jtu.GetAttrKey(name), *path)
                    lost.append(
                        (where, leaf.dtype, narrowed.dtype, lost_text(loss), False)
                    )
    return lost


def _trace(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[ClosedJaxpr, list[Any], PyTree, list[bool]]:
    """`fn(*args, **kwargs)` traced once: its program, the arrays among the
    arguments (the program's inputs, such as the key; everything else is closed
    over), the abstract model (arrays as `jax.ShapeDtypeStruct`, everything else
    as `fn` made it), and which of the model's leaves the program outputs, in
    order."""
    dynamic, static_args = eqx.partition((tuple(args), kwargs), eqx.is_array)
    flat, in_def = jtu.tree_flatten(dynamic)
    static_out = []

    def arrays_of_fn(*flat: Any) -> PyTree:
        args, kwargs = eqx.combine(jtu.tree_unflatten(in_def, flat), static_args)
        arrays, static = eqx.partition(fn(*args, **kwargs), eqx.is_array)
        static_out.append(static)
        return arrays

    closed, out_shapes = jax.make_jaxpr(arrays_of_fn, return_shape=True)(*flat)
    static = static_out[0]
    shapes = eqx.combine(out_shapes, static)
    outputs = eqx.combine(
        jtu.tree_map(lambda _: True, out_shapes),
        jtu.tree_map(lambda _: False, static),
    )
    return closed, flat, shapes, jtu.tree_leaves(outputs)


def _is_fed(const: Any) -> bool:
    """Whether a constant of the traced program is an input of the kept one: NumPy
    data is (it can change in place, and goes wherever the program runs); a JAX
    array stays a constant (it cannot change, and an input would have to be on
    the program's devices already)."""
    return isinstance(const, np.ndarray | np.generic)


def _program(
    closed: ClosedJaxpr, shardings: list[Any]
) -> tuple[Any, Plan | None, list[Any]]:
    """The `jax.jit` that runs `closed` and puts its outputs, a flat list, in
    `shardings`, the same in pieces if pieces of it repeat (`_pieces`, else
    `None`), and the constants to give them: `jitted(consts, arrays)` and
    `plan.run(consts, arrays)` with the arrays among the arguments. The model's
    structure is not part of them, as that holds the static fields of this call.

    The program is kept for the next trace that is the same program, so that
    building a model again compiles nothing. Programs are told apart by what was
    traced (`_program_key`), never by the identity or hash of `fn` and its
    arguments, whose values can change between calls (a closure's variable, a
    mutable config object)."""
    consts = jaxprs.consts_of(closed)
    key, keep = _program_key(closed, shardings)
    fast = not routes.plain("init")

    def make() -> tuple[Any, Plan | None, list[Any]]:
        fixed = [None if _is_fed(c) else c for c in consts]

        def run(fed: list[Any], flat: list[Any]) -> list[Any]:
            given = iter(fed)
            all_consts = [next(given) if c is None else c for c in fixed]
            return jaxprs.as_function(closed, all_consts)(*flat)

        pieces = _pieces(closed, shardings) if fast else None
        return jax.jit(run, out_shardings=shardings), pieces, keep

    jitted, pieces, _ = _PROGRAMS.get((key, fast), make)
    return jitted, pieces, [c for c in consts if _is_fed(c)]


def _pieces(closed: ClosedJaxpr, shardings: list[Any]) -> Plan | None:
    """`closed` in pieces (`_init_pieces.plan`), or `None`: where no piece
    repeats, or where a read of the program meets something it does not
    recognise (then the whole program runs, the plain route, saying so once)."""
    try:
        return plan(
            closed, shardings, key_of=lambda c, s: _program_key(c, s)[0], is_fed=_is_fed
        )
    except routes.Unrecognised as error:
        routes.fall_back("init", str(error))
        return None


# Each program (whole, and in pieces) with the objects its key holds by
# identity, kept alive with it.
_PROGRAMS: Programs[tuple[Any, Plan | None, list[Any]]] = Programs()


register(_PROGRAMS.clear)

# Each build's parts under what its trace depends on (`_built_key`), with the
# objects that key holds by identity.
_BUILT: Programs[tuple[ShardedInit, list[Any]]] = Programs()
register(_BUILT.clear)


def _built_key(
    read: Reads,
    arguments: tuple[Any, Any, list[Any]],
    specs: Any,
    mesh: Mesh | None,
    caller: str,
) -> tuple[Hashable | None, list[Any]]:
    """What a build's trace, specs and program depend on (the module's
    docstring), or `None` where something cannot be keyed by value (then every
    call traces); and the objects the key holds by identity."""
    keep: list[Any] = []
    value = ft.partial(value_key, array_key=lambda x: _by_identity(x, keep), keep=keep)
    static_args, in_def, flat = arguments
    try:
        key = (
            reads_key(read, value, keep),
            value(static_args),
            in_def,
            tuple(map(_array_type, flat)),
            _specs_key(specs, value, keep),
            mesh,
            caller,
            get_logical_axis_rules(),
            routes.plain("init"),
            trace_context(),
        )
        hash(key)
    except (Unkeyable, TypeError):
        return None, keep
    return key, keep


def _by_identity(array: jax.Array, keep: list[Any]) -> Hashable:
    """A JAX array that `fn` reads is a constant of its program: by identity (it
    cannot change), kept alive with the key."""
    keep.append(array)
    return id(array)


def _array_type(array: Any) -> Hashable:
    """What a trace reads of an array among the arguments: its type (shape,
    dtype, weak type, and on Explicit axes its sharding)."""
    if isinstance(array, np.ndarray | np.generic):
        return ("numpy", array.shape, array.dtype.str)
    return jax.typeof(array)


def _specs_key(
    specs: Any, value: Callable[[Any], Hashable], keep: list[Any]
) -> Hashable:
    """`specs` by value: a function of the abstract model by what it reads."""
    if callable(specs) and not isinstance(specs, PartitionSpec | NamedSharding):
        return ("function", reads_key(find_reads(specs), value, keep))
    leaves, treedef = jtu.tree_flatten(
        specs, is_leaf=lambda x: x is None or isinstance(x, PartitionSpec)
    )
    return (treedef, tuple(map(value, leaves)))


def _program_key(
    closed: ClosedJaxpr, shardings: list[Any]
) -> tuple[Hashable, list[Any]]:
    """`programs.program_key` of `closed` with `shardings`, its top-level NumPy
    constants left out: they are inputs of the kept program, so only their
    types (in the jaxpr's text) are part of the key."""
    return program_key(closed, tuple(shardings), skip=_is_fed)


@typecheck
def init_sharded(
    fn: Callable[..., Any],
    *args: Any,
    specs: Any,
    mesh: Mesh | AbstractMesh | None = None,
    **kwargs: Any,
) -> PyTree:
    """Builds a model (or any pytree) with its arrays created in their shardings.

    `fn(*args, **kwargs)` (such as a module's constructor taking a PRNG key) is
    traced once to resolve and check the specs, then runs under `jax.jit` with
    `out_shardings`, so that each device computes only its own shards: a model
    larger than one device can be made. Everything that is not an array comes back
    as eager construction makes it, and the values are those of
    `eqx.filter_jit(fn)(*args, **kwargs)`. The program is kept: a new key compiles
    nothing, a changed value `fn` reads is traced again
    ([the how-to](../how-to/plan-large-model.md#what-init_sharded-computes-and-keeps)).
    Rules written for the model place an optimizer state's `mu` and `nu`, returned
    beside it, like their parameters.

    **Arguments:**

    - `fn`: a callable returning the pytree, e.g. an `eqx.Module` class.
    - `*args`, `**kwargs`: its arguments. Arrays among them (such as the key) are
      inputs of the compiled program; everything else is a constant of it.
    - `specs`: a spec tree for the model or a prefix, partition rules, or a
      function of the abstract model ([the spec-tree family](specs.md));
      [`eqshard.host`][] specs are built into host memory; `None` replicates.
    - `mesh`: for `PartitionSpec`s (not needed for `NamedSharding`s); defaults to
      the mesh set by `jax.set_mesh`.

    **Returns:**

    What `fn(*args, **kwargs)` returns, its arrays on the mesh.

    **Raises:**

    `ValueError` if the spec tree is not a prefix of the model, specs cannot apply
    (naming every such leaf and the nearest spec that fits), rules match no path,
    no mesh is given or set where one is needed, or NumPy data among the
    arguments or read by `fn` would change as JAX narrows it (`jax_enable_x64`
    off), as [`eqshard.shard`][] refuses it; `TypeError` naming a spec leaf that
    is not a spec, or if `mesh` is abstract.

    !!! Example

        ```python
        rules = [("weight", P("tp", None)), (".*", P())]
        model = eqshard.init_sharded(eqx.nn.Linear, 512, 256, key=jax.random.key(0),
                                     specs=rules, mesh=mesh)
        model.weight.sharding  # NamedSharding(mesh, P('tp', None))
        ```
    """
    parts = sharded_init(fn, args, kwargs, specs=specs, mesh=mesh)
    for leaf in jtu.tree_leaves(parts.shapes):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            require_runnable("init_sharded", leaf.sharding.mesh)
            break
    return parts.assemble(parts.run(*host_private(parts.inputs)))
