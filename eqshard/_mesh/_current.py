"""Finding the mesh a call runs on: the current mesh (`current_mesh`), a call's
mesh (`find_mesh`, `require_mesh`, `concrete_mesh`), printing (`mesh_repr`) and
comparing (`same_mesh`) meshes, and the axis queries (`mesh_axis_size`,
`axis_size`, `axis_index`, ...). Building meshes is `_build.py`."""

import math
from collections.abc import Iterable, Sequence
from typing import Any, Literal, overload

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding

from .._typing import typecheck


# One builder per kind of message.


def mesh_repr(mesh: Mesh | AbstractMesh) -> str:
    """A mesh's axes and sizes, for messages: `{'data': 4, 'model': 2}`."""
    return str(dict(mesh.shape))


def _unknown_axes_error(
    caller: str, missing: Sequence[str], mesh: Mesh | AbstractMesh
) -> ValueError:
    """Axis names that the mesh does not have."""
    return ValueError(
        f"eqshard.{caller}: mesh axis {', '.join(map(repr, missing))} not in the "
        f"mesh {mesh_repr(mesh)}. Use one of {tuple(mesh.axis_names)}."
    )


# The current mesh and axis queries.


def same_mesh(a: Mesh | AbstractMesh, b: Mesh | AbstractMesh) -> bool:
    """Meshes with the same axes; concrete ones with the same devices in order."""
    if a is b:
        return True
    if tuple(a.axis_names) != tuple(b.axis_names) or tuple(a.axis_sizes) != tuple(
        b.axis_sizes
    ):
        return False
    if isinstance(a, Mesh) and isinstance(b, Mesh):
        return a.device_ids.tolist() == b.device_ids.tolist()
    return True


@typecheck
def current_mesh() -> Mesh | AbstractMesh | None:
    """Return the mesh set by `jax.set_mesh`, or `None` when no mesh is set.

    Outside `jax.jit` this is the concrete `jax.sharding.Mesh` (with devices);
    inside a trace, where JAX only knows the abstract mesh, it is the
    `jax.sharding.AbstractMesh` from `jax.sharding.get_abstract_mesh()` (inside
    `shard_map` its axes are `Manual`).

    !!! warning "Migrating from `with mesh:`"

        The deprecated `with mesh:` context manager of older libraries (fjformer,
        t5x, flax) does not set the mesh that `jax.set_mesh` sets, so it is not
        visible here. Replace `with mesh:` by `with jax.set_mesh(mesh):`, or pass
        `mesh=` explicitly to eqshard functions.

    **Returns:**

    A `Mesh` outside `jit`, an `AbstractMesh` inside, or `None`.

    !!! Example

        ```python
        mesh = eqshard.create_mesh((2, 4), ("dp", "tp"))
        with jax.set_mesh(mesh):
            eqshard.current_mesh()  # mesh
        eqshard.current_mesh()  # None
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


def _no_mesh_error(caller: str) -> ValueError:
    return ValueError(
        f"eqshard.{caller}: no mesh given and none set; pass mesh=... or use "
        "`jax.set_mesh(mesh)` (as `with jax.set_mesh(mesh): ...`) around the "
        "call. Note that the deprecated `with mesh:` does not set the mesh "
        "that `jax.set_mesh` sets."
    )


def _abstract_mesh_error(caller: str, mesh: AbstractMesh, given: bool) -> TypeError:
    if given:
        return TypeError(
            f"eqshard.{caller}: `mesh` is an `AbstractMesh` ({mesh}), which has no "
            "devices to put arrays on. Pass a concrete `Mesh` (e.g. "
            "`eqshard.create_mesh(...)`); plan on abstract meshes with "
            "`eqshard.analyze_sharding_strategy`."
        )
    return TypeError(
        f"eqshard.{caller}: moves data, so it needs a concrete `Mesh` of devices, "
        f"but the current mesh is abstract ({mesh}); you are probably inside "
        "`jax.jit`. Call it outside `jit`, or use "
        "`eqshard.with_sharding_constraint` inside."
    )


def find_mesh(
    mesh: Mesh | AbstractMesh | None, shardings: Iterable[Any] = ()
) -> Mesh | AbstractMesh | None:
    """The mesh a call works on: `mesh` if given, else the one set by
    `jax.set_mesh`, else the mesh of the first `NamedSharding` among `shardings`;
    `None` if there is none."""
    found = mesh if mesh is not None else current_mesh()
    if found is None:
        found = next((s.mesh for s in shardings if isinstance(s, NamedSharding)), None)
    return found


def require_mesh(
    mesh: Mesh | AbstractMesh | None, *, caller: str, shardings: Iterable[Any] = ()
) -> Mesh | AbstractMesh:
    """`find_mesh`, and eqshard's `ValueError` if there is none. `caller` is the
    public function's name (without the `eqshard.` prefix), for the message."""
    found = find_mesh(mesh, shardings)
    if found is None:
        raise _no_mesh_error(caller)
    return found


@overload
def concrete_mesh(
    mesh: Mesh | AbstractMesh | None, *, caller: str, required: Literal[True] = True
) -> Mesh: ...


@overload
def concrete_mesh(
    mesh: Mesh | AbstractMesh | None, *, caller: str, required: bool
) -> Mesh | None: ...


def concrete_mesh(
    mesh: Mesh | AbstractMesh | None, *, caller: str, required: bool = True
) -> Mesh | None:
    """The mesh to put arrays on: `mesh` if given (eqshard's `TypeError` if it is
    abstract: it has no devices), else the one set by `jax.set_mesh`, which must
    be concrete (outside `jit`) when `required`, and is `None` otherwise if it is
    not (or if there is none)."""
    if isinstance(mesh, AbstractMesh):
        raise _abstract_mesh_error(caller, mesh, given=True)
    found = find_mesh(mesh)
    if isinstance(found, Mesh):
        return found
    if not required:
        return None
    if found is None:
        raise _no_mesh_error(caller)
    raise _abstract_mesh_error(caller, found, given=False)


def _as_names(names: str | Sequence[str]) -> tuple[str, ...]:
    """One axis name or a sequence of them, as a tuple."""
    if isinstance(names, str):
        return (names,)
    return tuple(names)


@typecheck
def names_in_current_mesh(*names: str) -> bool:
    """Whether the current mesh (from `jax.set_mesh`) has all of these axes.

    Useful to apply a constraint only when the mesh supports it. With no mesh
    set the answer is `False` (unless no names are given).

    **Arguments:**

    - `*names`: mesh axis names.

    **Returns:**

    `True` if every name is an axis of [`eqshard.current_mesh`][].

    !!! Example

        ```python
        with jax.set_mesh(eqshard.create_mesh((2, 4), ("dp", "tp"))):
            eqshard.compat.names_in_current_mesh("dp", "tp")  # True
            eqshard.compat.names_in_current_mesh("sp")  # False
        ```
    """
    mesh = current_mesh()
    axes = () if mesh is None else mesh.axis_names
    return set(names) <= set(axes)


@typecheck
def get_mesh_axis_names(mesh: Mesh | AbstractMesh | None = None) -> tuple[str, ...]:
    """The axis names of `mesh`, or of the current mesh.

    **Arguments:**

    - `mesh`: a mesh (default: the one set by `jax.set_mesh`).

    **Returns:**

    A tuple of names in mesh order.

    **Raises:**

    `ValueError` if `mesh` is not given and none is set.

    !!! Example

        ```python
        mesh = eqshard.create_mesh((2, 4), ("dp", "tp"))
        eqshard.compat.get_mesh_axis_names(mesh)  # ("dp", "tp")
        ```
    """
    return tuple(require_mesh(mesh, caller="compat.get_mesh_axis_names").axis_names)


@typecheck
def mesh_axis_size(
    names: str | Sequence[str], mesh: Mesh | AbstractMesh | None = None
) -> int:
    """The number of devices along one mesh axis, or the product over several.

    Works outside `shard_map`, on concrete and abstract meshes. An empty
    sequence gives 1.

    **Arguments:**

    - `names`: an axis name or a sequence of them.
    - `mesh`: a mesh (default: the one set by `jax.set_mesh`).

    **Returns:**

    The size as a Python `int`.

    **Raises:**

    `ValueError` if no mesh is given or set, or a name is not a mesh axis (the
    message lists the mesh axes and sizes).

    !!! Example

        ```python
        mesh = eqshard.create_mesh((2, 4), ("dp", "tp"))
        eqshard.mesh_axis_size(("dp", "tp"), mesh)  # 8
        ```
    """
    mesh = require_mesh(mesh, caller="mesh_axis_size")
    wanted = _as_names(names)
    missing = [n for n in wanted if n not in mesh.axis_names]
    if missing:
        raise _unknown_axes_error("mesh_axis_size", missing, mesh)
    shape = dict(mesh.shape)
    return math.prod(shape[n] for n in wanted)


def _bound_axis_error(
    caller: str, names: tuple[str, ...], error: NameError
) -> ValueError:
    """An axis name that is not bound where `axis_size`/`axis_index` ran."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = [
        n
        for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t == AxisType.Manual
    ]
    return ValueError(
        f"eqshard.{caller}: axis {names} is not bound here ({error}). Call it "
        "inside `jax.shard_map` (or `vmap`/`pmap` with `axis_name=`) over those "
        f"axes; the bound mesh axes here are {tuple(manual)}. Outside shard_map "
        "use `eqshard.mesh_axis_size`."
    )


@typecheck
def axis_size(names: str | Sequence[str]) -> int:
    """Inside `shard_map`: the number of devices along one axis, or the product
    over several.

    It differs from `jax.lax.axis_size` on purpose: `names` may be any sequence,
    and an unbound name raises `ValueError` saying where to call it (JAX's raises
    `NameError`).

    **Arguments:**

    - `names`: an axis name or a sequence of them (empty gives 1).

    **Returns:**

    The size as a Python `int`.

    **Raises:**

    `ValueError` if a name is not bound (for example, outside `shard_map`).

    !!! Example

        ```python
        mesh = eqshard.create_mesh((2, 4), ("dp", "tp"))

        @jax.shard_map(mesh=mesh, in_specs=P(), out_specs=P())
        def f(x):
            return x * eqshard.axis_size(("dp", "tp"))  # 8
        ```
    """
    wanted = _as_names(names)
    try:
        return int(jax.lax.axis_size(wanted))
    except NameError as e:
        raise _bound_axis_error("axis_size", wanted, e) from None


@typecheck
def axis_index(names: str | Sequence[str]) -> jax.Array:
    """Inside `shard_map`: this device's index along one axis, or its row-major
    linear index over several (the first name is the most significant).

    It differs from `jax.lax.axis_index` on purpose: `names` may be any sequence,
    and an unbound name raises `ValueError` saying where to call it (JAX's raises
    `NameError`).

    For `("dp", "tp")` on a `{"dp": 2, "tp": 4}` mesh the index is
    `4 * dp_index + tp_index`; an empty sequence gives `0`.

    **Arguments:**

    - `names`: an axis name or a sequence of them, major to minor.

    **Returns:**

    A scalar `int32` array.

    **Raises:**

    `ValueError` if a name is not bound (for example, outside `shard_map`).

    !!! Example

        ```python
        mesh = eqshard.create_mesh((2, 4), ("dp", "tp"))

        @jax.shard_map(mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P(("dp", "tp")))
        def f(x):
            return x + eqshard.axis_index(("dp", "tp"))

        f(jnp.zeros(8, jnp.int32))  # [0, 1, ..., 7]
        ```
    """
    wanted = _as_names(names)
    try:
        return jax.lax.axis_index(wanted)
    except NameError as e:
        raise _bound_axis_error("axis_index", wanted, e) from None
