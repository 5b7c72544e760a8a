"""Constraining where arrays live, inside (and outside) `jit`: nothing moves here.

`with_sharding_constraint` tells `jit` where the arrays of a pytree should live: on
Auto mesh axes through `jax.lax.with_sharding_constraint`, on Explicit ones through
`jax.sharding.reshard`. Where `shard` raises on a spec that cannot apply, it
corrects the spec to the nearest one that can (`check_spec`, in `_check_spec.py`), and
`corrected_spec` exposes that correction.
"""

import dataclasses
from typing import Any

import jax
import jax.tree_util as jtu
from jax.core import Tracer
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._deprecated import renamed_keywords
from .._mesh._current import find_mesh, mesh_repr
from .._mesh._targets import require_traced_or_runnable
from .._spectree._check_spec import (
    check_leaf,
    check_spec,
    entry_axes,
    leaf_specs,
    ShardingProblem,
    spec_error_message,
)
from .._spectree._logical import normalize_rules
from .._spectree._memory import refuse_host
from .._spectree._resolve import resolve_specs
from .._tree import (
    abstract_leaf_error,
    deleted_error,
    is_array,
    is_deleted,
    path_str,
)
from .._typing import (
    AxisRulesArg,
    check_choice,
    KeyPath,
    ON_INVALID,
    OnInvalid,
    typecheck,
    warn,
)


def _constraint_kind(
    spec: PartitionSpec, mesh: Mesh | AbstractMesh, path: KeyPath
) -> AxisType:
    """Whether `spec` constrains Auto axes (`with_sharding_constraint`) or Explicit
    ones (`reshard`) of `mesh`. Inside `shard_map` the axes it maps over are Manual:
    a spec cannot name them, and a replicated spec follows the other axes."""
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    used = {types[axis] for entry in spec for axis in entry_axes(entry)}
    if not used:  # a replicated spec: follow the mesh (outside `shard_map`)
        used = set(mesh.axis_types) - {AxisType.Manual} or {AxisType.Auto}
        if len(used) > 1:  # Auto and Explicit axes: either can replicate
            explicit = AxisType.Explicit in _context_types().values()
            used = {AxisType.Explicit if explicit else AxisType.Auto}
    if used <= {AxisType.Auto}:
        return AxisType.Auto
    if used <= {AxisType.Explicit}:
        return AxisType.Explicit
    where = f"eqshard.with_sharding_constraint: spec {spec} at '{path_str(path)}'"
    if AxisType.Manual in used:
        manual = [a for e in spec for a in entry_axes(e) if types[a] == AxisType.Manual]
        raise ValueError(
            f"{where} names {', '.join(map(repr, manual))}, which `shard_map` maps "
            f"over here (Manual axes of mesh {mesh_repr(mesh)}), so no sharding "
            "constraint can name them. Leave them out of the spec: inside "
            "`shard_map` every device already holds its own block along them."
        )
    raise ValueError(
        f"{where} mixes mesh axes of types {sorted(map(str, used))} (mesh {mesh}). "
        "A spec can constrain Auto axes (`with_sharding_constraint`) or reshard "
        "Explicit ones (`reshard`), not both: build the mesh with one axis type, "
        "e.g. `eqshard.create_mesh(..., axis_types=...)`."
    )


def _context_types() -> dict[str, AxisType]:
    """The axis types of the mesh set with `jax.set_mesh` (empty if none)."""
    context = jax.sharding.get_abstract_mesh()
    if context.empty:
        return {}
    return dict(zip(context.axis_names, context.axis_types, strict=True))


def _check_context(
    kind: AxisType,
    spec: PartitionSpec,
    mesh: Mesh | AbstractMesh,
    path: KeyPath,
    traced: bool,
) -> None:
    """Raises eqshard's error where JAX would fail (or assert) for a constraint of
    `kind` on `mesh` under the mesh set with `jax.set_mesh`."""
    context = _context_types()
    where = f"eqshard.with_sharding_constraint: spec {spec} at '{path_str(path)}'"
    if kind == AxisType.Explicit and PartitionSpec.UNCONSTRAINED in tuple(spec):
        raise ValueError(
            f"{where} has `P.UNCONSTRAINED` on mesh {mesh_repr(mesh)}, whose axes "
            "are Explicit: `reshard` needs every dimension's layout, so a dimension "
            "cannot be left to the compiler. Use None (not sharded) or mesh axes "
            "there, or build the mesh with Auto axes."
        )
    if kind == AxisType.Explicit and traced and isinstance(mesh, Mesh):
        own = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
        if context != own:
            raise ValueError(
                f"{where} is on mesh {mesh_repr(mesh)}, whose axes are Explicit; "
                "inside `jit`, JAX reshards over Explicit axes only under that "
                "mesh. Call the jitted function within `with jax.set_mesh(mesh):`, "
                "or build the mesh with Auto axes (as `eqshard.create_mesh` does)."
            )
    if kind == AxisType.Auto:
        clash = [
            axis
            for axis, axis_type in zip(mesh.axis_names, mesh.axis_types, strict=True)
            if axis_type == AxisType.Auto and context.get(axis) == AxisType.Explicit
        ]
        if clash:
            raise ValueError(
                f"{where} is on a mesh whose axes {', '.join(map(repr, clash))} are "
                "Auto, but in the mesh set with `jax.set_mesh` they are Explicit: "
                "arrays there carry their sharding in their types, which an Auto "
                "constraint cannot change. Leave out `mesh=` to constrain on the "
                "set mesh, or set a mesh with Auto axes."
            )


def _check_abstract(
    spec: PartitionSpec, mesh: Mesh | AbstractMesh, path: KeyPath
) -> None:
    """Raises eqshard's error where JAX would fail: a spec on an abstract `mesh`
    is handed to JAX bare, and JAX resolves it against the mesh set with
    `jax.set_mesh`, which must have its axes, in the same sizes."""
    if not isinstance(mesh, AbstractMesh):
        return
    context = jax.sharding.get_abstract_mesh()
    want = dict(mesh.shape)
    have = {} if context.empty else dict(context.shape)
    if context.empty:
        why = "no mesh is set"
    else:
        named = [axis for entry in spec for axis in entry_axes(entry)]
        missing = [axis for axis in named if axis not in have]
        resized = [a for a in named if a in have and have[a] != want[a]]
        if not missing and not resized:
            return
        why = f"the set mesh {have} " + (
            f"lacks {', '.join(map(repr, missing))}"
            if missing
            else f"has {', '.join(f'{a!r} of size {have[a]}' for a in resized)}"
        )
    raise ValueError(
        f"eqshard.with_sharding_constraint: spec {spec} at '{path_str(path)}' is on "
        f"the abstract mesh {want}, which JAX resolves against the mesh set with "
        f"`jax.set_mesh`, but {why}. Call it under `with jax.set_mesh(mesh):` "
        "with a mesh of these axes, or give a `NamedSharding` on a concrete mesh "
        "(or `mesh=` a concrete mesh)."
    )


# How a constraint applies on each type of mesh axis.
_APPLY = {
    AxisType.Auto: jax.lax.with_sharding_constraint,
    AxisType.Explicit: jax.sharding.reshard,
}


@dataclasses.dataclass
class _Batch:
    """The leaves constrained one way (`_APPLY`'s), by position, with their
    shardings."""

    indices: list[int] = dataclasses.field(default_factory=list)
    shardings: list[Any] = dataclasses.field(default_factory=list)


def _apply(kind: AxisType, batch: _Batch, out: list[Any]) -> None:
    """Constrains the leaves of `out` at `batch.indices`, in place."""
    xs = [out[i] for i in batch.indices]
    shardings = batch.shardings
    unconstrained = any(
        PartitionSpec.UNCONSTRAINED in tuple(getattr(s, "spec", s)) for s in shardings
    )
    if (
        not unconstrained
        and all(isinstance(s, NamedSharding) for s in shardings)
        and not any(isinstance(x, Tracer) for x in xs)
    ):
        # Outside `jit` a constraint is a placement; JAX's eager
        # constraint gives size-0 arrays malformed shards.
        constrained = jax.device_put(xs, shardings)
    else:
        constrained = _APPLY[kind](xs, shardings)
    for i, leaf in zip(batch.indices, constrained, strict=True):
        out[i] = leaf


@renamed_keywords("with_sharding_constraint", rules="axis_rules")
@typecheck
def with_sharding_constraint(
    tree: PyTree,
    specs: PyTree,
    *,
    mesh: Mesh | AbstractMesh | None = None,
    on_invalid: OnInvalid = "warn",
    axis_rules: AxisRulesArg | None = None,
) -> PyTree:
    """Constrains the sharding of the arrays of a pytree, inside or outside `jit`.

    Array leaves get their spec; everything else is returned untouched (whole
    Equinox modules, inside `eqx.filter_jit` too). On `Auto` mesh axes this is
    `jax.lax.with_sharding_constraint`, on `Explicit` ones `jax.sharding.reshard`.
    With no mesh given or set, `PartitionSpec`s are ignored: code runs on one device.
    A spec that cannot apply (an unknown mesh axis, a dimension its mesh axes do not
    divide, more entries than the array's rank, an axis used twice) is corrected to
    the nearest one that can ([`eqshard.corrected_spec`][]), or raises, as
    `on_invalid` says: unlike JAX's, which always raises, the default corrects it
    with a warning.

    **Arguments:**

    - `tree`: any pytree.
    - `specs`: a spec tree for `tree` or a prefix, partition rules, or a function
      of the abstract tree ([the spec-tree family](specs.md)); leaves (and rules'
      values) may be logical [`eqshard.AxisNames`][], resolved by `axis_rules`.
    - `mesh`: defaults to the mesh set by `jax.set_mesh` (abstract inside `jit`).
    - `on_invalid`: `"warn"` corrects and warns, naming each leaf; `"raise"` raises
      a `ValueError` naming them all; `"ignore"` corrects silently.
    - `axis_rules`: defaults to the rules set by [`eqshard.logical_axis_rules`][]
      (as inside a [`eqshard.t5x.Partitioner`][]-partitioned function).

    **Returns:**

    A pytree of the structure of `tree`.

    **Raises:**

    `ValueError` as `on_invalid="raise"` says, if `specs` is not a prefix of
    `tree`, a spec mixes Auto and Explicit mesh axes, names an axis an enclosing
    `shard_map` maps over, or is on an abstract mesh whose axes the mesh set with
    `jax.set_mesh` lacks, or naming the arrays that were deleted (donated);
    `TypeError` if `tree` holds `jax.ShapeDtypeStruct`s.

    !!! Example

        ```python
        @eqx.filter_jit
        def step(model, batch):
            batch = eqshard.with_sharding_constraint(batch, P("dp"))
            model = eqshard.with_sharding_constraint(model, specs)
            ...
        ```
    """
    check_choice(
        on_invalid,
        ON_INVALID,
        caller="with_sharding_constraint",
        name="on_invalid",
    )
    mesh = find_mesh(mesh)
    caller = "with_sharding_constraint"
    require_traced_or_runnable(caller, mesh, tree)
    table = None if axis_rules is None else normalize_rules(axis_rules, caller=caller)
    specs = resolve_specs(specs, tree, caller=caller, mesh=mesh, axis_rules=table)
    path_leaves, treedef = jtu.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in path_leaves]
    abstract = [p for p, x in path_leaves if isinstance(x, jax.ShapeDtypeStruct)]
    if abstract:
        raise abstract_leaf_error(caller, abstract)
    problems: list[ShardingProblem] = []
    deleted: list[KeyPath] = []
    batches = {AxisType.Auto: _Batch(), AxisType.Explicit: _Batch()}
    pairs = leaf_specs(specs, tree, caller=caller, logical=True, axis_rules=table)
    refuse_host(caller, pairs, "specs", "a constraint says how a value is laid out")
    for i, ((path, spec), leaf) in enumerate(zip(pairs, leaves, strict=True)):
        if spec is None or not is_array(leaf):
            continue
        if mesh is None and not isinstance(spec, NamedSharding):
            continue
        if is_deleted(leaf):
            deleted.append(path)
            continue
        spec, spec_mesh, fixed, problem = check_leaf(path, spec, leaf, mesh)
        if problem is not None:
            problems.append(problem)
        _check_abstract(fixed, spec_mesh, path)
        kind = _constraint_kind(fixed, spec_mesh, path)
        _check_context(kind, fixed, spec_mesh, path, isinstance(leaf, Tracer))
        batches[kind].indices.append(i)
        batches[kind].shardings.append(
            NamedSharding(spec_mesh, fixed) if isinstance(spec_mesh, Mesh) else fixed
        )
    if deleted:
        raise deleted_error(caller, deleted)
    if problems and on_invalid == "raise":
        raise ValueError(spec_error_message(caller, problems))
    if problems and on_invalid == "warn":
        warn(spec_error_message(caller, problems, corrected=True))
    out = list(leaves)
    for kind, batch in batches.items():
        if batch.indices:
            _apply(kind, batch, out)
    return jtu.tree_unflatten(treedef, out)


@typecheck
def corrected_spec(
    shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh | AbstractMesh
) -> PartitionSpec:
    """The nearest spec to `spec` that can shard an array of `shape` on `mesh`.

    This is the correction [`eqshard.with_sharding_constraint`][] applies: entries
    beyond the array's rank are dropped, mesh axes that `mesh` does not have or that
    are used twice are dropped, and of each dimension's axes only those that keep
    the dimension divisible are kept, in order. A valid spec is returned unchanged.

    **Arguments:**

    - `shape`: the array's shape.
    - `spec`: the `PartitionSpec` to correct.
    - `mesh`: a `Mesh` or `AbstractMesh`.

    **Returns:**

    A `PartitionSpec` that fits.

    !!! Example

        ```python
        mesh = eqshard.create_mesh((2, 4), ("dp", "tp"))
        eqshard.corrected_spec((3, 8, 5), P("dp", "tp", "sp"), mesh)  # P(None, 'tp')
        ```
    """
    return check_spec(shape, spec, dict(mesh.shape))[0]
