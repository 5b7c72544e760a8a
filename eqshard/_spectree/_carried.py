"""The layout an array carries: the one reader every wing asks.

A placed `jax.Array` or a `jax.ShapeDtypeStruct` holds its sharding
(`placed_sharding`); a traced array's type holds one (`type_sharding`,
`jax.typeof(x).sharding`), which speaks only for the Explicit axes of its mesh
(`explicit_axes`): along Auto and Manual axes it reads all-`None`, whatever XLA
will choose. NumPy data, and leaves that are not arrays, carry none.
"""

from typing import Any

import jax
from jax.core import Tracer
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding


def placed_sharding(leaf: Any) -> NamedSharding | None:
    """The `NamedSharding` a placed array or a struct holds; `None` for traced
    arrays, NumPy data, leaves that are not arrays and other shardings."""
    if isinstance(leaf, Tracer):
        return None
    sharding = getattr(leaf, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else None


def type_sharding(leaf: Any) -> NamedSharding | None:
    """The `NamedSharding` in `leaf`'s type (`jax.typeof(leaf).sharding`), whose
    spec names only the mesh's Explicit axes; `None` where `leaf` has no JAX type
    or its type holds no `NamedSharding`."""
    try:
        aval = jax.typeof(leaf)
    except TypeError:  # not a JAX type
        return None
    sharding = getattr(aval, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else None


def explicit_axes(mesh: Mesh | AbstractMesh) -> frozenset[str]:
    """The axes of `mesh` a type's sharding speaks for: its Explicit ones (none
    for an empty mesh)."""
    return frozenset(
        a
        for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t == AxisType.Explicit
    )
