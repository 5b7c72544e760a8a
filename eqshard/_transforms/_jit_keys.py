"""The keys of `JitFunction`'s caches (`_jit.py`): what a call's arguments are
made of, and the `Layout` kept per structure of them (its shardings, and its
programs per set of non-array values).

A call's key holds only what the shardings' resolution reads (`KeyReads`): the
argument's tree structure and leaf types always; each array's shape, dtype and
placement, the values of non-array leaves, and the mesh set, where read. The
non-array leaves then pick one `jax.jit` of the layout (`Layout.jitted`), keyed by
their types and, for floats and complexes, their bits (`Layout.static_key`, as
`typed` tells them apart), so that `True`, `1` and `1.0` (and `0.0` and `-0.0`)
compile apart; so do static fields of the structure (`structure_key`). Both keys
read the types in bulk: they run on every call.
"""

import dataclasses
import operator
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import AbstractMesh, Mesh
from jaxtyping import PyTree

from .._internals.program_keys import scalar_key
from .._tree import is_array
from .._typing import KeyPath, PyTreeDef


# Types whose instances go straight to `jax.jit` as arguments: filled in as they
# are first seen (so importing eqshard never touches the JAX backend).
DIRECT_TYPES: set[type] = set()


def is_direct(x: Any) -> bool:
    """Whether `jax.jit` takes `x` as one array argument (abstract ones included,
    for `lower`)."""
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


def getter(indices: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """A fast function from a sequence to the tuple of its items at `indices`."""
    if not indices:
        return lambda seq: ()
    if len(indices) == 1:
        (i,) = indices
        return lambda seq: (seq[i],)
    return operator.itemgetter(*indices)


def typed(value: Any) -> Any:
    """A cache key for a static value that also tells apart values that compare
    equal but differ in type (`True`, `1`, `1.0`) or in sign (`0.0`, `-0.0`),
    also inside tuples: the traced program can depend on them. Floats are keyed
    by their bits."""
    if isinstance(value, tuple):
        return (type(value), tuple(map(typed, value)))
    if isinstance(value, float | complex):
        return scalar_key(value)
    return (type(value), value)


def _itself(values: tuple[Any, ...]) -> tuple[Any, ...]:
    return values


def static_plan(kinds: tuple[type, ...]) -> tuple[Callable[..., Any], ...]:
    """How `Layout.static_key` reads non-array values of types `kinds`: the
    values `typed` keys as `(type, value)` (no tuple, float or complex), taken
    as they are, and the others, keyed by `typed`."""
    flags = [issubclass(kind, tuple | float | complex) for kind in kinds]
    if not any(flags):
        return _itself, getter(())
    plain = [i for i, flag in enumerate(flags) if not flag]
    return getter(plain), getter([i for i, flag in enumerate(flags) if flag])


_NUMBERS = (float, complex)


def _exact(data: Any) -> Any:
    """What `==` does not tell apart in a node's static data: the types of what
    it holds (`1`, `1.0` and `True` are equal), and the bits of its floats
    (`0.0` and `-0.0` are equal, a NaN is not itself). Reads only types where it
    can: this runs on every call."""
    kind = type(data)
    if kind is not tuple and kind is not list:
        return scalar_key(data) if kind in _NUMBERS else kind
    kinds = tuple(map(type, data))
    if float in kinds or complex in kinds or tuple in kinds or list in kinds:
        return tuple(map(_exact, data))
    return kinds


def structure_key(treedef: PyTreeDef, leaves: Sequence[Any]) -> tuple[Any, ...]:
    """What the static data of `treedef`'s nodes (an Equinox module's static
    fields, a dict's keys) holds that comparing treedefs does not tell apart
    (see `_exact`): a static `1.0` after `1`, or `-0.0` after `0.0`, must compile
    again. `leaves` are `treedef`'s.

    This runs on every call, so where no node's data holds a float or a complex
    (nor a tuple or list inside a tuple or list), the types are read in bulk: the
    types of the data, the lengths of the tuples and lists among them, and the
    types of what those hold (which tell equal treedefs apart as `_exact` does).
    Otherwise, every node's `_exact`."""
    found: list[Any] = []
    treedef.walk(lambda _, data: found.append(data), id, leaves)
    kinds = tuple(map(type, found))
    if float not in kinds and complex not in kinds:
        if tuple not in kinds and list not in kinds:
            return (kinds, (), ())
        sequences = [
            data
            for data, kind in zip(found, kinds, strict=True)
            if kind is tuple or kind is list
        ]
        inner = tuple(map(type, chain.from_iterable(sequences)))
        if not (float in inner or complex in inner or tuple in inner or list in inner):
            return (kinds, tuple(map(len, sequences)), inner)
    return (None, tuple(map(_exact, found)))


# Types of placed JAX arrays (not tracers), and of leaves that are no arrays of
# any kind: filled in as they are first seen.
PLACED_TYPES: set[type] = set()
OTHER_TYPES: set[type] = set()


def leaf_signature(leaf: Any, statics: bool, placements: bool) -> Any:
    """What resolving specs may read of one argument leaf: an array's shape,
    dtype, weak type, and placement where `placements`; a non-array leaf's type,
    and its value where `statics` (the specs are functions of the tree, or the
    output's)."""
    kind = type(leaf)
    if isinstance(leaf, Tracer):
        return (kind, leaf.aval)
    if isinstance(leaf, jax.Array):
        PLACED_TYPES.add(kind)
        return (leaf.aval, leaf.sharding, leaf.committed) if placements else leaf.aval
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return (kind, leaf.shape, leaf.dtype, leaf.weak_type, leaf.sharding)
    if isinstance(leaf, np.ndarray | np.generic):
        return (kind, leaf.shape, leaf.dtype)
    OTHER_TYPES.add(kind)
    return (kind, typed(leaf)) if statics else kind


def mesh_key() -> Any:
    """The mesh set by `jax.set_mesh`, with its devices where known (outside
    `jit`): meshes of the same axes over other devices, or in another order,
    resolve specs apart."""
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty:
        return None
    try:
        return (abstract, jax.sharding.get_mesh())
    except ValueError:  # inside `jit`, where only the abstract mesh is known
        return abstract


@dataclasses.dataclass(frozen=True)
class Shardings:
    """Where a layout's arguments go and its output is made, and the mesh they are
    on (traced under it)."""

    in_shardings: PyTree = None
    out_shardings: PyTree = None
    mesh: Mesh | AbstractMesh | None = None


@dataclasses.dataclass(frozen=True)
class KeyReads:
    """What resolving the shardings reads of the arguments, and so what a call's
    key holds besides the tree structure and the leaf types (the less, the cheaper
    a call): arrays' shapes and dtypes, non-array leaves' values, placements (and
    the mesh set)."""

    shapes: bool = True
    statics: bool = True
    placements: bool = True


def layout_key(
    treedef: PyTreeDef, leaves: list[Any], reads: KeyReads | None
) -> tuple[Any, ...]:
    """The key of a call's layout: its structure, the mesh set and what `reads`
    names (for placed arrays, the common case, inline); `None` where the
    shardings are given, not resolved: then the leaf types pick the layout."""
    if reads is None:
        return (treedef, structure_key(treedef, leaves), tuple(map(type, leaves)))
    placed, statics = PLACED_TYPES, reads.statics
    others = () if statics else OTHER_TYPES  # leaves whose type is all read
    if reads.placements:
        signature = [
            (x.aval, x.sharding, x.committed)
            if (kind := type(x)) in placed
            else kind
            if kind in others
            else leaf_signature(x, statics, True)
            for x in leaves
        ]
    elif reads.shapes or statics:
        signature = [
            x.aval
            if (kind := type(x)) in placed
            else kind
            if kind in others
            else leaf_signature(x, statics, False)
            for x in leaves
        ]
    else:  # spec trees on a given mesh: the types, as without specs
        signature = list(map(type, leaves))
    return (treedef, structure_key(treedef, leaves), mesh_key(), tuple(signature))


class Static:
    """A static argument as given to `jax.jit`: hashed and compared by
    [`typed`][], so that `f(x, (True,))` does not reuse the program of
    `f(x, (1,))`."""

    __slots__ = ("value", "key", "hash")

    def __init__(self, value: Any):
        self.value = value
        self.key = typed(value)
        self.hash = hash(self.key)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and self.key == other.key


def unwrap(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(x.value if isinstance(x, Static) else x for x in args)


class Layout:
    """The structure of a call's (non-static) arguments: which flat leaves are
    arrays, which of those are donated, the shardings of the arguments and the
    output (and the mesh they are on), and one `jax.jit` per set of values of the
    non-array leaves. `donated` says, per leaf, whether its argument is donated."""

    __slots__ = (
        "treedef",
        "paths",
        "array_index",
        "static_index",
        "donated_index",
        "kept_index",
        "get_static",
        "get_donated",
        "get_kept",
        "signature",
        "jitted",
        "static_plans",
        "in_shardings",
        "out_shardings",
        "mesh",
        "abstract_paths",
    )

    def __init__(
        self,
        treedef: PyTreeDef,
        paths: list[KeyPath],
        leaves: list[Any],
        donated: Sequence[bool],
        shardings: Shardings,
    ):
        self.treedef = treedef
        self.paths = paths
        flags = [is_array(leaf) for leaf in leaves]
        self.array_index = [i for i, flag in enumerate(flags) if flag]
        self.static_index = [i for i, flag in enumerate(flags) if not flag]
        self.donated_index = [i for i in self.array_index if donated[i]]
        self.kept_index = [i for i in self.array_index if not donated[i]]
        self.get_static = getter(self.static_index)
        self.get_donated = getter(self.donated_index)
        self.get_kept = getter(self.kept_index)
        self.signature = (treedef, tuple(self.array_index))
        self.jitted: dict[tuple[Any, ...], Any] = {}
        self.static_plans: dict[tuple[type, ...], tuple[Callable[..., Any], ...]] = {}
        self.in_shardings = shardings.in_shardings
        self.out_shardings = shardings.out_shardings
        self.mesh = shardings.mesh
        # Arguments without data, which only `lower` and `compile` take.
        self.abstract_paths = [
            path
            for path, leaf in zip(paths, leaves, strict=True)
            if isinstance(leaf, jax.ShapeDtypeStruct)
        ]

    def static_key(self, values: tuple[Any, ...]) -> tuple[Any, ...]:
        """The key of a call's non-array leaves `values` among `jitted`: it tells
        apart what `tuple(map(typed, values))` does (types, and floats' bits),
        reading the types in bulk and `typed` only for tuples, floats and
        complexes (this runs on every call), by a plan kept per types."""
        if not values:
            return ()
        kinds = tuple(map(type, values))
        plan = self.static_plans.get(kinds)
        if plan is None:
            plan = self.static_plans[kinds] = static_plan(kinds)
        plain, special = plan
        return (kinds, plain(values), tuple(map(typed, special(values))))
