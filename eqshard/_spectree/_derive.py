"""Specs and targets for trees that follow the params.

`abstract` turns a tree into the `jax.ShapeDtypeStruct` skeleton (with shardings)
that `orbax` restore, `jax.jit(...).lower` and `eqx.filter_eval_shape` take.
`derive_specs` gives an optimizer state, a gradient tree or an EMA copy the specs
of the parameters its leaves follow. `restrict_specs` adapts a spec tree to another
mesh (a checkpoint restored elsewhere, rules written for a larger mesh).
"""

import typing
from collections.abc import Mapping
from typing import Any, Literal, TYPE_CHECKING, TypeAlias

import jax
import jax.tree_util as jtu
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._mesh._current import mesh_repr, require_mesh
from .._tree import is_array, listing, path_str
from .._typing import (
    check_choice,
    KeyPath,
    ON_INVALID,
    OnInvalid,
    StackAxis,
    typecheck,
    warn,
)
from ._check_spec import (
    bad_spec_leaf_message,
    check_leaves,
    check_spec,
    check_spec_on_mesh,
    entry_axes,
    is_spec_leaf,
    leaf_specs,
    named_sharding,
    spec_entry,
    spec_error_message,
    SpecCheck,
)
from ._follow import follow_spec, is_placeholder, replicated_like
from ._logical import AxisNames
from ._memory import Host, in_memory, memory_of
from ._resolve import resolve_like, resolve_specs


# `derive_specs`' choices for `memory_kind`, checked by itself (as `_typing`'s
# aliases of the arguments a function validates).
if TYPE_CHECKING:
    MemoryKind: TypeAlias = Literal["device", "pinned_host"]
else:
    MemoryKind = str


def _struct(leaf: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(
        leaf.shape,
        leaf.dtype,
        sharding=sharding,
        weak_type=getattr(leaf, "weak_type", False),
    )


@typecheck
def abstract(
    tree: PyTree, specs: PyTree = None, mesh: Mesh | AbstractMesh | None = None
) -> PyTree:
    """The tree with every array replaced by a `jax.ShapeDtypeStruct`.

    This is the target that `orbax` restore, `jax.jit(...).lower` and
    `eqx.filter_eval_shape` take. With `specs`, each struct carries the
    `NamedSharding` of its spec on `mesh`; without, it carries no sharding. Leaves
    that are not arrays ([`eqshard.is_array`][]) are kept as they are; structs are
    arrays, so an `eqx.filter_eval_shape` skeleton can be given shardings.

    **Arguments:**

    - `tree`: any pytree, concrete or abstract.
    - `specs`: `None`, or a spec tree for `tree` (or a prefix of it) of
      `PartitionSpec`s, `NamedSharding`s and `None`s, partition rules, or a
      function of the abstract tree (see [the spec-tree family](specs.md)). A
      `None` spec gives a struct without a sharding.
    - `mesh`: the mesh for `PartitionSpec`s; defaults to the mesh set by
      `jax.set_mesh`. Not needed without specs or with `NamedSharding`s only.

    **Returns:**

    A pytree of the structure of `tree`.

    **Raises:**

    - `ValueError` naming the first path where `specs` is not a prefix of `tree`,
      naming every leaf whose spec cannot apply (unknown or repeated mesh axis,
      indivisible dimension, spec longer than the rank), or if `specs` has a
      `PartitionSpec` and no mesh is given or set.
    - `TypeError` naming a leaf of `specs` that is not a spec.

    !!! Example

        ```python
        target = eqshard.abstract({"w": jnp.zeros((8, 4)), "n": 3}, P("tp"), mesh)
        target["w"]  # ShapeDtypeStruct(shape=(8, 4), dtype=float32, sharding=...)
        target["n"]  # 3
        ```
    """
    specs = resolve_specs(specs, tree, caller="abstract", mesh=mesh)
    return abstract_tree(tree, specs, mesh, caller="abstract")


def abstract_tree(
    tree: PyTree,
    specs: PyTree,
    mesh: Mesh | AbstractMesh | None,
    *,
    caller: str,
    check: SpecCheck = check_spec_on_mesh,
) -> PyTree:
    """[`eqshard.abstract`][], its errors in the name of `caller`, each leaf's spec
    checked by `check`."""
    leaves, treedef = jtu.tree_flatten(tree)
    if specs is None:
        out = [_struct(x, None) if is_array(x) else x for x in leaves]
        return jtu.tree_unflatten(treedef, out)
    pairs = leaf_specs(specs, tree, caller=caller)
    if any(isinstance(spec, PartitionSpec | Host) for _, spec in pairs):
        mesh = require_mesh(mesh, caller=caller)
    problems = check_leaves(pairs, leaves, mesh, check=check)
    if problems:
        raise ValueError(spec_error_message(caller, problems))
    out = []
    for (path, spec), leaf in zip(pairs, leaves, strict=True):
        if not is_array(leaf):
            out.append(leaf)
            continue
        if isinstance(spec, PartitionSpec | Host):
            # `mesh` was required above, as `specs` has a `PartitionSpec`.
            on = typing.cast(Mesh, mesh)
            spec = named_sharding(spec, on, caller=caller, path=path)
        out.append(_struct(leaf, spec))
    return jtu.tree_unflatten(treedef, out)


@typecheck
def derive_specs(
    tree: PyTree,
    params: PyTree,
    param_specs: PyTree,
    *,
    on_invalid: OnInvalid = "raise",
    memory_kind: MemoryKind | None = None,
) -> PyTree:
    """Specs for a tree that follows the parameters: an optimizer state, gradients,
    an EMA copy.

    Each array leaf gets the spec of the parameter it follows (whose path ends the
    leaf's path and whose shape is the leaf's, or with one dimension reduced away:
    the rule is told in
    [the how-to](../how-to/shard-modules.md#optimizer-states-and-other-pytrees));
    leaves under 1 KiB that follow no parameter are replicated, non-array leaves
    get `None`. Works on concrete and abstract trees and imports no optimizer
    library. A state built with the model, `(model, opt_state)`, needs no call:
    [`eqshard.match_partition_rules`][] places it by this same rule.

    **Arguments:**

    - `tree`: the tree to find specs for, e.g. `optimizer.init(params)` or
      `jax.eval_shape(optimizer.init, params)`.
    - `params`: the parameters, concrete or abstract, with the paths `tree`
      follows.
    - `param_specs`: their spec tree (or a prefix of it), partition rules, or a
      function of the abstract parameters (see [the spec-tree family](specs.md)).
    - `on_invalid`: a leaf of 1 KiB or more that follows no parameter: `"raise"`
      (the default), `"warn"` (replicated, with a warning) or `"ignore"`.
    - `memory_kind`: where the derived leaves live: `None` (where their parameters
      do), `"pinned_host"` (wrapped in [`eqshard.host`][]) or `"device"`.

    **Returns:**

    A spec tree for `tree`: a spec at each array leaf, `None` elsewhere.

    **Raises:**

    `ValueError` naming every large leaf that follows no parameter (with
    `on_invalid="raise"`), or the first path where `param_specs` is not a prefix of
    `params`; `TypeError` naming a leaf of `param_specs` that is not a spec.

    !!! Example

        ```python
        params = {"w": jnp.zeros((512, 256)), "b": jnp.zeros(256)}
        specs = {"w": P("dp", "tp"), "b": P("tp")}
        state = optax.adam(1e-3).init(params)
        eqshard.derive_specs(state, params, specs)
        # (ScaleByAdamState(count=P(), mu={"b": P("tp"), "w": P("dp", "tp")},
        #   nu={"b": P("tp"), "w": P("dp", "tp")}), EmptyState())
        ```
    """
    caller = "derive_specs"
    check_choice(on_invalid, ON_INVALID, caller=caller, name="on_invalid")
    if memory_kind is not None:
        check_choice(memory_kind, _MEMORY_KINDS, caller=caller, name="memory_kind")
    param_specs = resolve_specs(
        param_specs, params, caller=caller, argname="param_specs"
    )
    pairs = leaf_specs(param_specs, params, caller=caller, argname="param_specs")
    by_path = {
        tuple(path): (tuple(int(n) for n in leaf.shape), spec)
        for (path, spec), leaf in zip(pairs, jtu.tree_leaves(params), strict=True)
        if is_array(leaf)
    }
    default: Any = PartitionSpec()
    for _, spec in by_path.values():
        if spec is not None:
            default = replicated_like(spec)
            break
    path_leaves, treedef = jtu.tree_flatten_with_path(tree)
    out = []
    unmatched = []
    for path, leaf in path_leaves:
        if not is_array(leaf):
            out.append(None)
            continue
        shape = tuple(int(n) for n in leaf.shape)
        found, spec = follow_spec(path, shape, by_path)
        if not found:
            spec = default
            if not is_placeholder(shape, leaf.dtype):
                unmatched.append(f"'{path_str(path)}' (shape {shape}, {leaf.dtype})")
        out.append(spec)
    if unmatched and on_invalid != "ignore":
        message = (
            f"eqshard.{caller}: {len(unmatched)} array(s) of 1 KiB or more follow no "
            f"parameter: {', '.join(unmatched[:10])}"
            f"{' ...' if len(unmatched) > 10 else ''}. A leaf follows a parameter "
            "when its path ends with the parameter's path and its shape is the "
            "parameter's (or has one dimension reduced away). "
        )
        if on_invalid == "raise":
            raise ValueError(
                message + "Check that `params` is the tree `tree` was made from "
                '(the same paths), or pass `on_invalid="ignore"` to replicate such '
                "leaves."
            )
        warn(message + "They are replicated.")
    if memory_kind is not None:
        out = [_in_kind(spec, memory_kind) for spec in out]
    return jtu.tree_unflatten(treedef, out)


_MEMORY_KINDS = ("device", "pinned_host")


def _in_kind(spec: Any, memory_kind: str) -> Any:
    """A derived spec moved to `memory_kind` (`"device"`: out of host memory)."""
    layout, _ = memory_of(spec)
    if memory_kind == "device":
        return (
            layout.with_memory_kind("device")
            if isinstance(layout, NamedSharding)
            else layout
        )
    return in_memory(layout, memory_kind)


def _check_stack_axes(axes: tuple[Any, ...]) -> None:
    for index, axis in enumerate(axes):
        names = axis if isinstance(axis, tuple) else (axis,)
        if axis is None or (names and all(isinstance(a, str) for a in names)):
            continue
        raise TypeError(
            f"eqshard.stack_specs: stacking axis {index} is {axis!r}, which is not "
            "a mesh axis name. Give a name ('dp'), a tuple of names (('dp', "
            "'fsdp')), or None for an unsharded layer axis (the default)."
        )


@typecheck
def stack_specs(specs: PyTree, *axes: StackAxis) -> PyTree:
    """Per-layer specs for layers stacked by `eqx.filter_vmap` (or scanned over):
    each `PartitionSpec` with the stacking axes put in front.

    A block made by `eqx.filter_vmap(Block)(keys)` has every array with a leading
    layer axis, so the spec of one layer's `(192, 64)` weight, `P("tp", None)`,
    would land on the layer axis of the stacked `(4, 192, 64)` one. Match the rules
    against one layer (`eqx.filter_eval_shape(Block, key)`, no memory) and stack
    the result: `P("tp", None)` becomes `P(None, "tp", None)`. Logical names
    ([`eqshard.AxisNames`][]) get the entries in front too, as logical names:
    `AxisNames("embed", "mlp")` becomes `AxisNames(None, "embed", "mlp")`.

    **Arguments:**

    - `specs`: a spec tree of `PartitionSpec`s, `NamedSharding`s, `AxisNames` and
      `None`s.
    - `*axes`: one entry per stacking axis, in front: `None` (the default, one
      unsharded axis) or mesh axis names to shard the layers over (pipeline
      stages); for `AxisNames`, one logical name (such as `"layers"`) or `None`.

    **Returns:**

    The spec tree with the entries in front of every spec; `None`s stay `None`.

    **Raises:**

    `TypeError` if an entry of `axes` is not a name, a tuple of names or `None`,
    or if `specs` has `AxisNames` (naming the path) and an entry is a tuple.

    !!! Example

        ```python
        eqshard.stack_specs({"w": P("tp", None), "b": P()})
        # {"w": P(None, "tp", None), "b": P(None)}
        eqshard.stack_specs(P("tp"), "dp", None)  # P("dp", None, "tp")
        ```
    """
    front = axes or (None,)
    _check_stack_axes(front)

    def stack(path: KeyPath, spec: Any) -> Any:
        if isinstance(spec, AxisNames):
            several = [axis for axis in front if isinstance(axis, tuple)]
            if several:
                raise TypeError(
                    f"eqshard.stack_specs: {spec!r} at '{path_str(path)}' has one "
                    f"logical name per dimension, but stacking axis {several[0]!r} "
                    "is several mesh axes. Give a logical name (e.g. 'layers', "
                    "which the axis rules map to mesh axes) or None."
                )
            return AxisNames(*front, *spec)
        if isinstance(spec, NamedSharding):
            return NamedSharding(
                spec.mesh,
                PartitionSpec(*front, *spec.spec),
                memory_kind=spec.memory_kind,
            )
        if isinstance(spec, PartitionSpec):
            return PartitionSpec(*front, *spec)
        if isinstance(spec, Host):
            return Host(stack(path, spec.spec))
        return spec

    return jtu.tree_map_with_path(
        stack, specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def _renamed(
    spec: PartitionSpec, rename: Mapping[str, str | tuple[str, ...] | None]
) -> PartitionSpec:
    """`spec` with each mesh axis replaced by its entry of `rename` (several axes
    for a tuple, none for `None`); axes not in `rename` stay."""
    entries: list[Any] = []
    for entry in spec:
        if entry is PartitionSpec.UNCONSTRAINED:
            entries.append(entry)
            continue
        axes: list[Any] = []
        for axis in entry_axes(entry):
            new = rename.get(axis, axis) if isinstance(axis, str) else axis
            axes.extend(
                () if new is None else new if isinstance(new, tuple) else (new,)
            )
        entries.append(spec_entry(axes))
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


@typecheck
def restrict_specs(
    specs: PyTree,
    mesh: Mesh | AbstractMesh,
    *,
    rename: Mapping[str, str | tuple[str, ...] | None] | None = None,
    like: PyTree = None,
    on_invalid: OnInvalid = "warn",
) -> PyTree:
    """A spec tree adapted to another mesh: axes renamed, missing axes dropped and,
    given the arrays, entries that no longer divide corrected.

    For specs written for another mesh (a checkpoint's, a large cluster's rules),
    each spec is renamed by `rename`, then corrected for `mesh` as
    [`eqshard.corrected_spec`][] does: axes `mesh` lacks, or that a spec names
    twice, are dropped. With `like` the shapes are known too: entries beyond an
    array's rank are dropped, and of each dimension's axes only those that keep it
    divisible on `mesh` are kept. Renaming is not reported; every other change
    is, as `on_invalid` says (one warning listing each path, the spec before and
    after, and why).

    **Arguments:**

    - `specs`: a spec tree of `PartitionSpec`s, `NamedSharding`s and `None`s (or,
      with `like`, a prefix of `like`'s spec tree, partition rules, or a function
      of the abstract tree: see [the spec-tree family](specs.md)).
    - `mesh`: the mesh the specs are for (a `Mesh` or an `AbstractMesh`).
    - `rename`: a mapping from an axis name in `specs` to its name on `mesh`, a
      tuple of names (the dimension split over all) or `None` (dropped, unreported).
    - `like`: the tree the specs are for, concrete or abstract (only `.shape` is
      read); without it, only axis names are checked.
    - `on_invalid`: a spec that must change: `"warn"` (default) changes it and
      warns, `"ignore"` silently, `"raise"` raises with the same list.

    **Returns:**

    The specs for `mesh`, of `specs`' structure (with `like`, a spec at each array
    of `like`, `None` elsewhere); a `NamedSharding` becomes one on `mesh`, with its
    memory kind.

    **Raises:**

    `ValueError` if `on_invalid="raise"` and a spec changed, if `on_invalid` is
    not one of the three, or naming the first path where `specs` is not a prefix
    of `like`; `TypeError` naming a leaf of `specs` that is not a spec.

    !!! Example

        ```python
        mesh = eqshard.create_mesh((8,), ("fsdp",))
        eqshard.restrict_specs({"w": P("dp", "tp"), "b": P("tp")}, mesh,
                               rename={"dp": "fsdp"})
        # {"w": P("fsdp"), "b": P()}, and a warning: 'tp' is not a mesh axis
        ```
    """
    caller = "restrict_specs"
    check_choice(on_invalid, ON_INVALID, caller=caller, name="on_invalid")
    return restricted(
        specs,
        mesh,
        rename=rename,
        like=like,
        on_invalid=on_invalid,
        caller=caller,
        fix="Pass `rename=` to map axes onto the mesh's, or "
        '`on_invalid="ignore"` if these changes are intended.',
    )


def restricted(
    specs: PyTree,
    mesh: Mesh | AbstractMesh,
    *,
    rename: Mapping[str, str | tuple[str, ...] | None] | None,
    like: PyTree,
    on_invalid: str,
    caller: str,
    fix: str,
) -> PyTree:
    """[`eqshard.restrict_specs`][], its errors and warning in the name of
    `caller`, ending with `fix`."""
    rename = {} if rename is None else rename
    mesh_shape = dict(mesh.shape)
    # `(path, spec, shape)` per leaf; without `like`, a shape of zeros, which
    # every mesh axis divides.
    items: list[tuple[KeyPath, Any, tuple[int, ...]]] = []
    specs = resolve_like(specs, like, caller=caller, mesh=mesh)
    if like is None:
        path_leaves, treedef = jtu.tree_flatten_with_path(specs, is_leaf=is_spec_leaf)
        for path, spec in path_leaves:
            if not is_spec_leaf(spec):
                raise TypeError(
                    bad_spec_leaf_message(caller, path, spec, logical=False)
                )
            inner = spec.spec if isinstance(spec, NamedSharding | Host) else spec
            items.append((path, spec, (0,) * len(inner or ())))
    else:
        pairs = leaf_specs(specs, like, caller=caller)
        treedef = jtu.tree_structure(like)
        for (path, spec), leaf in zip(pairs, jtu.tree_leaves(like), strict=True):
            array = is_array(leaf)
            shape = tuple(int(n) for n in leaf.shape) if array else ()
            items.append((path, spec if array else None, shape))
    out = []
    changed = []
    for path, spec, shape in items:
        if spec is None:
            out.append(None)
            continue
        inner = spec.spec if isinstance(spec, NamedSharding | Host) else spec
        renamed = _renamed(inner, rename)
        fixed, reasons = check_spec(shape, renamed, mesh_shape)
        if not reasons and not rename:
            fixed = inner  # unchanged: as it was written
        if reasons:
            changed.append(
                f"'{path_str(path)}': {inner} -> {fixed}: {'; '.join(reasons)}."
            )
        if isinstance(spec, NamedSharding):
            out.append(NamedSharding(mesh, fixed, memory_kind=spec.memory_kind))
        elif isinstance(spec, Host):
            out.append(Host(fixed))
        else:
            out.append(fixed)
    if changed and on_invalid != "ignore":
        count = "1 spec" if len(changed) == 1 else f"{len(changed)} specs"
        message = listing(
            f"eqshard.{caller}: {count} changed for mesh {mesh_repr(mesh)}:",
            changed,
            fix,
            limit=20,
        )
        if on_invalid == "raise":
            raise ValueError(message)
        warn(message)
    return jtu.tree_unflatten(treedef, out)
