"""Device meshes: construction, mesh strings, current-mesh and axis queries."""

import jax
from jax.sharding import AbstractMesh, Mesh

from ._typing import typecheck


@typecheck
def current_mesh() -> Mesh | AbstractMesh | None:
    """Return the mesh set by `jax.set_mesh`, or `None` when no mesh is set.

    Outside `jax.jit` this is the concrete `jax.sharding.Mesh` (with devices);
    inside a trace, where JAX only knows the abstract mesh, it is the
    `jax.sharding.AbstractMesh` from `jax.sharding.get_abstract_mesh()`.

    !!! warning "Migrating from `with mesh:`"

        The deprecated `with mesh:` context manager of older libraries (fjformer,
        t5x, flax) does not set the mesh that `jax.set_mesh` sets, so it is not
        visible here. Replace `with mesh:` by `with jax.set_mesh(mesh):`, or pass
        `mesh=` explicitly to eqshard functions.

    **Arguments:** none.

    **Returns:**

    A `Mesh` outside `jit`, an `AbstractMesh` inside, or `None`.

    **Raises:** nothing.

    !!! Example

        ```python
        mesh = eqshard.create_mesh((2, 4), ("dp", "tp"))
        with jax.set_mesh(mesh):
            assert eqshard.current_mesh() == mesh
        assert eqshard.current_mesh() is None
        ```
    """
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty:
        return None
    try:
        concrete = jax.sharding.get_mesh()
    except ValueError:
        # `get_mesh` refuses to run inside `jit`; the abstract mesh is all
        # there is while tracing.
        return abstract
    if concrete.empty:
        return abstract
    return concrete


def _require_mesh(
    mesh: Mesh | AbstractMesh | None, *, caller: str
) -> Mesh | AbstractMesh:
    """Return `mesh` if given, else the current mesh, else raise a ValueError.

    `caller` is the public function name (without the `eqshard.` prefix) used in
    the message.
    """
    if mesh is not None:
        return mesh
    found = current_mesh()
    if found is None:
        raise ValueError(
            f"eqshard.{caller}: no mesh given and none set; pass mesh=... or use "
            "`jax.set_mesh(mesh)` (as `with jax.set_mesh(mesh): ...`) around the "
            "call. Note that the deprecated `with mesh:` does not set the mesh "
            "that `jax.set_mesh` sets."
        )
    return found
