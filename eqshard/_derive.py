"""Specs and targets for trees that follow the params.

`abstract` turns a tree into the `jax.ShapeDtypeStruct` skeleton (with shardings)
that `orbax` restore, `jax.jit(...).lower` and `eqx.filter_eval_shape` take.
`derive_specs` gives an optimizer state, a gradient tree or an EMA copy the specs
of the parameters its leaves follow.
"""

import typing
from typing import Any

import jax
import jax.tree_util as jtu
from jax.sharding import AbstractMesh, Mesh, PartitionSpec
from jaxtyping import PyTree

from ._mesh import require_mesh
from ._specs import check_leaves, leaf_specs, named_sharding, spec_error_message
from ._tree import is_array
from ._typing import typecheck


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
      `PartitionSpec`s, `NamedSharding`s and `None`s. A `None` spec gives a struct
      without a sharding.
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
    caller = "abstract"
    leaves, treedef = jtu.tree_flatten(tree)
    if specs is None:
        out = [_struct(x, None) if is_array(x) else x for x in leaves]
        return jtu.tree_unflatten(treedef, out)
    pairs = leaf_specs(specs, tree, caller=caller)
    if any(isinstance(spec, PartitionSpec) for _, spec in pairs):
        mesh = require_mesh(mesh, caller=caller)
    problems = check_leaves(pairs, leaves, mesh)
    if problems:
        raise ValueError(spec_error_message(caller, problems))
    out = []
    for (path, spec), leaf in zip(pairs, leaves, strict=True):
        if not is_array(leaf):
            out.append(leaf)
            continue
        if isinstance(spec, PartitionSpec):
            # `mesh` was required above, as `specs` has a `PartitionSpec`.
            on = typing.cast(Mesh, mesh)
            spec = named_sharding(spec, on, caller=caller, path=path)
        out.append(_struct(leaf, spec))
    return jtu.tree_unflatten(treedef, out)
