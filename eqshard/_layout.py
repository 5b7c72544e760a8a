"""Checking that a pytree is laid out as asked.

`check_layout` compares the sharding every array has with the one its spec asks
for, and raises one error listing every array that differs: placed with another
spec, on another mesh, on a single device (which JAX calls "fully replicated",
but which is not on the mesh at all), on the host as a NumPy array, or in another
memory kind (host against device memory), deleted (donated), or asked for with a
spec that cannot apply to it. It moves nothing and compiles nothing. The error
is a `LayoutError` (a `ValueError`) whose message shows the first rows and whose
`mismatches` hold them all.
"""

import dataclasses
from typing import Any

import jax
import jax.tree_util as jtu
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._mesh import current_mesh, same_mesh
from ._spec_args import resolve_specs
from ._specs import check_spec, entry_axes, leaf_specs
from ._tree import is_array, is_deleted, path_str
from ._typing import typecheck


def _mesh_text(mesh: Mesh | AbstractMesh) -> str:
    return str(dict(mesh.shape))


def _memory_kind(sharding: Any) -> str | None:
    try:
        return sharding.memory_kind
    except AttributeError:  # abstract shardings of some kinds have none
        return None


def _placement(spec: PartitionSpec, ndim: int, sizes: dict[str, int]) -> list[Any]:
    """The mesh axes splitting each dimension, ignoring axes of size 1: two specs
    with the same placement place an array the same way."""
    out: list[Any] = []
    for d in range(ndim):
        entry = spec[d] if d < len(spec) else None
        if entry is PartitionSpec.UNCONSTRAINED:
            out.append(entry)
        else:
            out.append(tuple(a for a in entry_axes(entry) if sizes.get(a, 0) != 1))
    return out


@dataclasses.dataclass(frozen=True)
class LayoutMismatch:
    """An array that is not laid out as asked, found by [`eqshard.check_layout`][].

    **Fields:**

    - `path`: the array's path in the tree.
    - `shape`: its shape.
    - `spec`, `mesh`, `memory_kind`: what was asked (`memory_kind` is `None` for
      the device's default memory).
    - `problem`: what the array is instead, or why the spec cannot apply.
    """

    path: str
    shape: tuple[int, ...]
    spec: PartitionSpec
    mesh: Mesh | AbstractMesh
    memory_kind: str | None
    problem: str

    def line(self) -> str:
        """The mismatch as one line of the error message."""
        kind = self.memory_kind
        kind_note = f" in {kind!r} memory" if kind not in (None, "device") else ""
        return (
            f"  - '{self.path}' (shape {self.shape}): asked {self.spec} on mesh "
            f"{_mesh_text(self.mesh)}{kind_note}; {self.problem}."
        )


class LayoutError(ValueError):
    """The error of [`eqshard.check_layout`][]: a `ValueError` whose message lists
    the first mismatches, and whose `mismatches` hold every one, in tree order."""

    def __init__(self, message: str, mismatches: tuple[LayoutMismatch, ...] = ()):
        super().__init__(message)
        self.mismatches = mismatches

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.mismatches)


# Mismatches shown in the message; `LayoutError.mismatches` has them all.
_SHOWN = 20


def _layout_error(caller: str, mismatches: list[LayoutMismatch]) -> LayoutError:
    count = "1 array is" if len(mismatches) == 1 else f"{len(mismatches)} arrays are"
    lines = [f"eqshard.{caller}: {count} not laid out as asked:"]
    lines += [mismatch.line() for mismatch in mismatches[:_SHOWN]]
    if len(mismatches) > _SHOWN:
        lines.append(
            f"  ... and {len(mismatches) - _SHOWN} more (the error's `mismatches` "
            "lists every one)."
        )
    lines.append(
        "Place them with `eqshard.shard(tree, specs, mesh)` (or make them inside "
        "`jax.jit` with `out_shardings=`), or change `specs`."
    )
    return LayoutError("\n".join(lines), tuple(mismatches))


def _mismatch(leaf: Any, expected: NamedSharding) -> str | None:
    """What is wrong with where `leaf` is, or `None` if it is where `expected` says."""
    if not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
        return "is a NumPy array on the host, not on any device"
    if is_deleted(leaf):
        return (
            "has been deleted (donated to a jitted call, or `.delete()`d); check "
            "the array that call returned instead"
        )
    actual = leaf.sharding
    if actual is None:
        return "has no sharding (an abstract array made without one)"
    if not isinstance(actual, NamedSharding):
        devices = actual.device_set
        if len(devices) == 1:
            return f"is on a single device ({next(iter(devices))}), not on the mesh"
        return f"has a {type(actual).__name__}, not a NamedSharding on the mesh"
    problems = []
    if not same_mesh(actual.mesh, expected.mesh):
        problems.append(f"is on another mesh {_mesh_text(actual.mesh)}")
    sizes = dict(actual.mesh.shape)
    ndim = len(leaf.shape)
    if _placement(actual.spec, ndim, sizes) != _placement(expected.spec, ndim, sizes):
        problems.append(f"has spec {actual.spec}")
    want, have = expected.memory_kind, _memory_kind(actual)
    if want is not None and have is not None and have != want:
        problems.append(f"is in {have!r} memory, not {want!r}")
    return "; ".join(problems) or None


def _expected_mesh(mesh: Mesh | AbstractMesh | None) -> Mesh | AbstractMesh | None:
    return mesh if mesh is not None else current_mesh()


@typecheck
def check_layout(
    tree: PyTree, specs: PyTree, mesh: Mesh | AbstractMesh | None = None
) -> None:
    """Checks that every array of `tree` is laid out as `specs` asks; raises one
    error listing every array that is not.

    An array matches when it has a `NamedSharding` on `mesh` (the same axes and,
    for a concrete mesh, the same devices in the same order) whose spec places it
    as its spec does (`P('dp', None)` and `P('dp')` are the same placement), in the
    memory kind asked for: a `PartitionSpec` asks for the device's default memory,
    a `NamedSharding` for its own `memory_kind` (e.g. `"pinned_host"`). An array on
    a single device does not match even a replicated spec: JAX calls it fully
    replicated, but it is not on the mesh (a classic slip: an optimizer state made
    by `eqx.filter_jit(optimizer.init)` outside any mesh). NumPy arrays match
    nothing. Arrays whose spec is `None`, and leaves that are not arrays, are not
    checked. Abstract arrays (`jax.ShapeDtypeStruct`) are checked by the sharding
    they carry.

    Nothing is moved or compiled: use it in tests, after restoring a checkpoint,
    or every few hundred steps of a training loop.

    **Arguments:**

    - `tree`: any pytree.
    - `specs`: a spec tree for `tree` or a prefix of one, as for
      [`eqshard.shard`][]: `PartitionSpec`s (on `mesh`), `NamedSharding`s (on their
      own mesh) or `None`; or partition rules, or a function of the abstract tree
      (see [the spec-tree family](specs.md)).
    - `mesh`: the mesh `PartitionSpec`s refer to; defaults to the mesh set by
      `jax.set_mesh`.

    **Raises:**

    - `ValueError` (a `LayoutError`) listing the arrays laid out otherwise than
      asked, each with its path, what was asked and what it is (deleted, or asked
      with a spec that cannot apply to it, included): the first 20 in the
      message, and every one in the error's `mismatches`, each with `path`,
      `shape`, `spec`, `mesh`, `memory_kind` and `problem`. Also if `specs` is
      not a prefix of `tree`
      (naming the first path that differs); or if `specs` has a `PartitionSpec`
      and there is no mesh.
    - `TypeError` naming the path of a leaf of `specs` that is not a spec.

    !!! Example

        ```python
        params = eqshard.shard({"w": jnp.zeros((8, 4))}, P("dp", "tp"), mesh)
        eqshard.check_layout(params, P("dp", "tp"), mesh)  # nothing: all match
        state = {"mu": jnp.zeros((8, 4))}  # made on one device, not on the mesh
        # eqshard.check_layout(state, P(), mesh) raises: 'mu' (shape (8, 4)):
        # asked P() on mesh {'dp': 2, 'tp': 4}; is on a single device ...
        ```
    """
    caller = "check_layout"
    found = _expected_mesh(mesh)
    specs = resolve_specs(specs, tree, caller=caller, mesh=found)
    pairs = leaf_specs(specs, tree, caller=caller)
    mismatches = []
    for (path, spec), leaf in zip(pairs, jtu.tree_leaves(tree), strict=True):
        if spec is None or not is_array(leaf):
            continue
        if isinstance(spec, PartitionSpec):
            if found is None:
                raise ValueError(
                    f"eqshard.{caller}: `specs` has {spec} at '{path_str(path)}', a "
                    "PartitionSpec, but no mesh is given or set to say where it "
                    "places the array. Pass `mesh=...`, call it under "
                    "`with jax.set_mesh(mesh):`, or give `NamedSharding`s."
                )
            asked, on, kind = spec, found, None
        else:
            asked, on, kind = spec.spec, spec.mesh, spec.memory_kind
        shape = tuple(int(n) for n in leaf.shape)
        _, reasons = check_spec(shape, asked, dict(on.shape))
        if reasons:
            problem = (
                f"the spec cannot apply ({'; '.join(reasons)}), and "
                "`eqshard.shard` refuses it"
            )
        else:
            expected = (
                spec if isinstance(spec, NamedSharding) else NamedSharding(on, asked)
            )
            problem = _mismatch(leaf, expected)
        if problem is not None:
            mismatches.append(
                LayoutMismatch(path_str(path), shape, asked, on, kind, problem)
            )
    if mismatches:
        raise _layout_error(caller, mismatches)
