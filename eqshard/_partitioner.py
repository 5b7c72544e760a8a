"""The t5x-style partitioner: a mesh, logical axis rules, and `jax.jit` with the
shardings built once.

A [`eqshard.Partitioner`][] owns a mesh (given, or picked for the hardware by
[`eqshard.default_mesh`][]) and logical axis rules. `partition(fn, in_specs,
out_specs)` turns spec trees (`PartitionSpec`s, `NamedSharding`s or
[`eqshard.AxisNames`][]) into `NamedSharding`s once and wraps `fn` in `jax.jit`.

How a [`eqshard.PartitionedFn`][] call stays cheap:

- **Arrays only.** When every (non-static) argument is itself an array, the call
  goes straight to one `jax.jit` made at partition time: no tree work in Python.
- **Modules and other pytrees.** The arguments are flattened once; the leaf types
  and the tree structure pick a cached *layout* (which leaves are arrays), and the
  non-array leaves pick a cached `jax.jit` made for that layout, whose arguments
  are the flat tuples of array leaves. This is `eqx.filter_jit`'s filtering with
  less per-call work: no signature binding, no rebuilding of filtered trees, no
  hashing of every leaf, no blocking on a marker.
- **Contexts at trace time.** The mesh (as the abstract mesh) and the logical
  rules are set while `fn` is traced, which is the only time `fn`'s Python runs,
  so calls do not pay for entering them.

Data layout follows t5x: the data axes are the mesh axes that the rules map the
logical axis `'batch'` to, and [`eqshard.LocalChunker`][] finds which part of
each array a process holds from `mesh.devices` and `device.process_index` alone,
so every process's view can be computed (and tested) from one process.
"""

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence, Set
from types import MappingProxyType
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._logical import (
    _normalize_rules,
    _resolve,
    _RulesContext,
    AxisNames,
    LogicalRules,
    standard_logical_axis_rules,
)
from ._shard import _match, _shard
from ._specs import check_spec, entry_axes, is_spec_leaf, spec_error_message
from ._topology import default_mesh
from ._tree import broadcast_prefix, is_array, path_str
from ._typing import KeyPath, typecheck


# ---------------------------------------------------------------------------------
# Data layout: which part of the data and of each array a process holds.
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LocalChunkInfo:
    """The part of a global array that one process's devices hold.

    **Fields:**

    - `slice`: one `slice` per dimension of the array; `slice(None)` for
      dimensions that are not sharded.
    - `replica_id`: the index of this process among the processes that hold the
      same slice (0 for one of them: the one that should write it to a checkpoint).
    """

    slice: tuple[slice, ...]
    replica_id: int


@dataclasses.dataclass(frozen=True)
class DataLayout:
    """How the global batch is split between processes.

    **Fields:**

    - `batch_size`: the global batch size.
    - `shard_id`: which shard of the batch this process loads, in
      `range(num_shards)`.
    - `num_shards`: how many distinct shards the batch is split into (processes
      that hold replicas of the same data share a shard).
    - `is_first_host_in_replica_set`: whether this process is the first of those
      that load the same shard.
    """

    batch_size: int | None
    shard_id: int
    num_shards: int
    is_first_host_in_replica_set: bool


def _mesh_repr(mesh: Mesh) -> str:
    return str(dict(mesh.shape))


def _axes_tuple(
    axes: str | Sequence[str] | Set[str] | None,
    mesh: Mesh,
    caller: str,
    *,
    ordered: bool,
) -> tuple[str, ...]:
    """`axes` as a tuple of mesh axis names, checked against `mesh`."""
    if axes is None:
        return ()
    if isinstance(axes, str):
        axes = (axes,)
    elif isinstance(axes, Set) and ordered and len(axes) > 1:
        raise TypeError(
            f"eqshard.{caller}: got the set {set(axes)!r}, whose order is undefined; "
            "the shard id depends on the order of the mesh axes. Pass a tuple, "
            "major axis first, e.g. ('replica', 'data')."
        )
    out = tuple(axes)
    for axis in out:
        if not isinstance(axis, str):
            raise TypeError(
                f"eqshard.{caller}: mesh axes must be strings, got {axis!r} (a "
                f"{type(axis).__name__}) in {axes!r}."
            )
    unknown = [axis for axis in out if axis not in mesh.shape]
    if unknown:
        raise ValueError(
            f"eqshard.{caller}: {', '.join(map(repr, unknown))} "
            f"{'is not an axis' if len(unknown) == 1 else 'are not axes'} of the "
            f"mesh {_mesh_repr(mesh)}. Use the mesh's axis names."
        )
    return out


class LocalChunker:
    """Which chunk of the mesh, and so of every sharded array, a process holds.

    A process's devices form a block of the mesh. Along each mesh axis, the block
    covers `mesh.shape[axis] // num_chunks[axis]` devices, and is chunk
    `chunk_ids[axis]` of `num_chunks[axis]` along that axis. Everything is derived
    from `mesh.devices` and each device's `process_index`, so the view of any
    process can be computed from one process, and meshes of stand-in device
    objects (anything with a `process_index`) work too. These are t5x's
    `LocalChunker` semantics, extended to dimensions sharded over several mesh axes.

    **Arguments:**

    - `mesh`: a `jax.sharding.Mesh`.
    - `process_index`: the process to describe; defaults to `jax.process_index()`.

    **Attributes:**

    - `mesh`, `process_index`: as given.
    - `mesh_axes`: the mesh's axis names, in order.
    - `num_chunks`: a read-only mapping from each mesh axis to the number of
      chunks along it.
    - `chunk_ids`: a read-only mapping from each mesh axis to this process's chunk
      along it.

    **Raises:**

    `ValueError` if the process has no devices in the mesh, or if its devices do
    not form a block that tiles the mesh (the message shows the block).

    !!! Example

        ```python
        # 4 processes of 2 devices; process p holds row p of a (4, 2) mesh.
        chunker = eqshard.LocalChunker(mesh, process_index=2)
        chunker.num_chunks  # {'data': 4, 'model': 1}
        chunker.get_shard_id("data")  # 2
        chunker.get_local_chunk_info((8, 6), ("data", None)).slice
        # (slice(4, 6), slice(None))
        ```
    """

    @typecheck
    def __init__(self, mesh: Mesh, *, process_index: int | None = None):
        if process_index is None:
            process_index = jax.process_index()
        devices = np.asarray(mesh.devices)
        owners = np.array(
            [device.process_index for device in devices.flat], dtype=np.int64
        ).reshape(devices.shape)
        local = np.argwhere(owners == process_index)
        if not len(local):
            raise ValueError(
                f"eqshard.LocalChunker: process {process_index} has no devices in "
                f"the mesh {_mesh_repr(mesh)}; its devices belong to processes "
                f"{sorted(set(owners.ravel().tolist()))}."
            )
        low = local.min(axis=0)
        extent = local.max(axis=0) + 1 - low
        names = tuple(mesh.axis_names)
        block = {name: int(size) for name, size in zip(names, extent)}
        if math.prod(block.values()) != len(local):
            raise ValueError(
                f"eqshard.LocalChunker: the {len(local)} devices of process "
                f"{process_index} do not form a block of the mesh "
                f"{_mesh_repr(mesh)}: they span {block} devices along its axes, "
                "which also holds devices of other processes. Arrange the mesh so "
                "each process's devices are contiguous (as eqshard.create_mesh and "
                "eqshard.default_mesh do)."
            )
        num_chunks, chunk_ids = {}, {}
        for name, start, size in zip(names, low, extent):
            total = mesh.shape[name]
            if total % size or start % size:
                raise ValueError(
                    f"eqshard.LocalChunker: the devices of process {process_index} "
                    f"span {int(size)} devices from position {int(start)} along mesh "
                    f"axis {name!r} (size {total}), which does not tile that axis "
                    f"into equal chunks (mesh {_mesh_repr(mesh)}). Give every "
                    "process the same number of devices along each axis."
                )
            num_chunks[name] = total // int(size)
            chunk_ids[name] = int(start) // int(size)
        self.mesh = mesh
        self.process_index = process_index
        self.mesh_axes = names
        self.num_chunks = MappingProxyType(num_chunks)
        self.chunk_ids = MappingProxyType(chunk_ids)

    def __repr__(self) -> str:
        return (
            f"LocalChunker(process_index={self.process_index}, "
            f"num_chunks={dict(self.num_chunks)}, chunk_ids={dict(self.chunk_ids)})"
        )

    def _mixed_radix(self, axes: Sequence[str]) -> int:
        index = 0
        for axis in axes:
            index = index * self.num_chunks[axis] + self.chunk_ids[axis]
        return index

    @typecheck
    def get_shard_id(
        self, sharded_mesh_axes: str | Sequence[str] | Set[str] | None
    ) -> int:
        """This process's index along the given mesh axes.

        The chunk ids along `sharded_mesh_axes` read as one number, the first axis
        most significant: with 2 chunks along `'replica'` and 2 along `'data'`, the
        process at `('replica': 1, 'data': 0)` has shard id 2.

        **Arguments:**

        - `sharded_mesh_axes`: a mesh axis name or a sequence of them, major axis
          first (a set only of one axis); `None` or `()` gives 0.

        **Returns:**

        An int in `range(prod(num_chunks[axis] for axis in sharded_mesh_axes))`.

        **Raises:**

        `ValueError` naming an axis the mesh lacks; `TypeError` for a set of
        several axes (whose order is undefined).

        !!! Example

            ```python
            chunker.get_shard_id(("replica", "data"))
            ```
        """
        axes = _axes_tuple(
            sharded_mesh_axes, self.mesh, "LocalChunker.get_shard_id", ordered=True
        )
        return self._mixed_radix(axes)

    @typecheck
    def get_replica_id(
        self, sharded_mesh_axes: str | Sequence[str] | Set[str] | None
    ) -> int:
        """This process's index along the mesh axes *not* given.

        An array sharded over `sharded_mesh_axes` is replicated over the other
        axes; the replica id tells apart the processes that hold the same part of
        it. The chunk ids along the other axes, in mesh order, read as one number.

        **Arguments:**

        - `sharded_mesh_axes`: a mesh axis name, or a sequence or set of them.

        **Returns:**

        An int; 0 for exactly one of the processes holding each part.

        **Raises:**

        `ValueError` naming an axis the mesh lacks.

        !!! Example

            ```python
            chunker.get_replica_id("data")  # index along 'model'
            ```
        """
        axes = _axes_tuple(
            sharded_mesh_axes, self.mesh, "LocalChunker.get_replica_id", ordered=False
        )
        return self._mixed_radix([axis for axis in self.mesh_axes if axis not in axes])

    @typecheck
    def get_local_chunk_info(
        self,
        global_shape: Sequence[int],
        mesh_axes: Sequence[Any] | PartitionSpec,
    ) -> LocalChunkInfo:
        """The slice of a global array that this process's devices hold.

        **Arguments:**

        - `global_shape`: the shape of the global array.
        - `mesh_axes`: a `PartitionSpec`, or a sequence with one entry per leading
          dimension: `None`, a mesh axis name, or a tuple of mesh axis names for a
          dimension sharded over several axes (major first, as in a
          `PartitionSpec`).

        **Returns:**

        A [`eqshard.LocalChunkInfo`][]: the slice (`slice(None)` for unsharded
        dimensions) and the replica id among processes holding the same slice.

        **Raises:**

        - `ValueError` for an unknown or repeated mesh axis, more entries than
          dimensions, a dimension its mesh axes do not divide, or a dimension over
          several mesh axes whose local part is not one slice (the message says
          which order of axes would make it one).
        - `TypeError` for an entry of another type.

        !!! Example

            ```python
            info = chunker.get_local_chunk_info((8, 6), ("data", None))
            local_batch = global_batch[info.slice]
            ```
        """
        caller = "LocalChunker.get_local_chunk_info"
        shape = tuple(int(size) for size in global_shape)
        entries = tuple(mesh_axes)
        if len(entries) > len(shape):
            raise ValueError(
                f"eqshard.{caller}: `mesh_axes` {entries!r} has {len(entries)} "
                f"entries but the array has rank {len(shape)} (shape {shape})."
            )
        slices = [slice(None)] * len(shape)
        sharded: list[str] = []
        for dim, entry in enumerate(entries):
            if not (entry is None or isinstance(entry, str | tuple | list)):
                raise TypeError(
                    f"eqshard.{caller}: entry {dim} of `mesh_axes` is {entry!r} (a "
                    f"{type(entry).__name__}); use None, a mesh axis name, or a "
                    "tuple of them."
                )
            axes = _axes_tuple(entry_axes(entry), self.mesh, caller, ordered=True)
            if not axes:
                continue
            repeated = [axis for axis in axes if axis in sharded]
            if repeated or len(set(axes)) != len(axes):
                raise ValueError(
                    f"eqshard.{caller}: mesh axis {(repeated or list(axes))[0]!r} "
                    f"shards more than one dimension in {entries!r}; a mesh axis "
                    "can shard one dimension."
                )
            devices = math.prod(self.mesh.shape[axis] for axis in axes)
            if shape[dim] % devices:
                raise ValueError(
                    f"eqshard.{caller}: dimension {dim} (size {shape[dim]}) of shape "
                    f"{shape} is not divisible by {entry!r} (size {devices}) on "
                    f"mesh {_mesh_repr(self.mesh)}."
                )
            self._check_one_slice(axes, entries, caller)
            chunks = math.prod(self.num_chunks[axis] for axis in axes)
            size = shape[dim] // chunks
            index = self._mixed_radix(axes)
            slices[dim] = slice(index * size, (index + 1) * size)
            sharded.extend(axes)
        return LocalChunkInfo(tuple(slices), self.get_replica_id(sharded))

    def _check_one_slice(
        self, axes: tuple[str, ...], entries: tuple[Any, ...], caller: str
    ) -> None:
        """A dimension over several axes is one slice per process only if, after
        the first of its axes where the process holds several devices, the process
        holds every device of the axes that follow."""

        def held(axis: str) -> int:  # devices of this process along `axis`
            return self.mesh.shape[axis] // self.num_chunks[axis]

        spread = None
        for axis in axes:
            if spread is not None and self.num_chunks[axis] > 1:
                order = sorted(
                    axes,
                    key=lambda a: 0 if held(a) == 1 else 2 - (self.num_chunks[a] > 1),
                )
                raise ValueError(
                    f"eqshard.{caller}: the dimension sharded over {axes!r} (in "
                    f"{entries!r}) is not one contiguous slice on process "
                    f"{self.process_index}: it holds {held(spread)} devices along "
                    f"{spread!r} but only {held(axis)} of the {self.mesh.shape[axis]} "
                    f"along {axis!r}. Order the axes as {tuple(order)!r}: those "
                    "where each process holds one device first, those it holds "
                    "whole last."
                )
            if held(axis) > 1 and spread is None:
                spread = axis


# ---------------------------------------------------------------------------------
# Specs -> shardings, once, at partition time.
# ---------------------------------------------------------------------------------


def _is_spec_or_names(x: Any) -> bool:
    return is_spec_leaf(x) or isinstance(x, AxisNames)


def _to_shardings(
    specs: PyTree, mesh: Mesh, rules: LogicalRules, *, name: str, caller: str
) -> PyTree:
    """A spec tree with `AxisNames` resolved by `rules` and every `PartitionSpec`
    made a `NamedSharding` on `mesh`; `None` and `NamedSharding` leaves are kept."""
    resolved: dict[AxisNames, PartitionSpec] = {}

    def convert(path: KeyPath, leaf: Any) -> NamedSharding | None:
        if leaf is None or isinstance(leaf, NamedSharding):
            return leaf
        if isinstance(leaf, AxisNames):
            spec = resolved.get(leaf)
            if spec is None:
                spec = resolved[leaf] = _resolve(leaf, rules, caller=caller, path=path)
            leaf = spec
        if not isinstance(leaf, PartitionSpec):
            hint = ""
            if isinstance(leaf, str):
                hint = (
                    " A plain tuple is a container, so its names became separate "
                    "leaves: wrap logical names as eqshard.AxisNames(...) and mesh "
                    "axes as P(...)."
                )
            raise TypeError(
                f"eqshard.{caller}: `{name}` has {leaf!r} (a {type(leaf).__name__}) "
                f"at '{path_str(path)}'. Leaves must be PartitionSpec, "
                f"NamedSharding, eqshard.AxisNames or None.{hint}"
            )
        unknown = [a for e in leaf for a in entry_axes(e) if a not in mesh.shape]
        if unknown:
            raise ValueError(
                f"eqshard.{caller}: `{name}` at '{path_str(path)}' is {leaf}, which "
                f"names {', '.join(map(repr, unknown))}, not "
                f"{'an axis' if len(unknown) == 1 else 'axes'} of the mesh "
                f"{_mesh_repr(mesh)}. Use the mesh's axis names, or logical names "
                "(eqshard.AxisNames) with rules for this mesh."
            )
        return NamedSharding(mesh, leaf)

    if isinstance(specs, list):  # one entry per argument, like `jax.jit`
        specs = tuple(specs)
    return jtu.tree_map_with_path(convert, specs, is_leaf=_is_spec_or_names)


def _check_shapes(
    paths: Sequence[KeyPath],
    leaves: Sequence[Any],
    shardings: Sequence[NamedSharding | None],
    caller: str,
) -> None:
    """Raises the eqshard message for every array whose sharding cannot apply."""
    problems = []
    for path, leaf, sharding in zip(paths, leaves, shardings):
        if sharding is None or not is_array(leaf):
            continue
        shape = tuple(leaf.shape)
        fixed, reasons = check_spec(shape, sharding.spec, dict(sharding.mesh.shape))
        if reasons:
            problems.append((path, shape, sharding.spec, fixed, reasons, sharding.mesh))
    if problems:
        raise ValueError(spec_error_message(caller, problems))


# ---------------------------------------------------------------------------------
# Partitioned functions.
# ---------------------------------------------------------------------------------

_IN = "PartitionedFn (in_specs)"
_OUT = "PartitionedFn (out_specs)"

# Types whose instances go straight to `jax.jit` as arguments: filled in as they
# are first seen (so importing eqshard never touches the JAX backend).
_DIRECT_TYPES: set[type] = set()


def _is_direct(x: Any) -> bool:
    """Whether `jax.jit` takes `x` as one array argument (abstract ones included,
    for `lower`)."""
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


def _getter(indices: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """A fast function from a sequence to the tuple of its items at `indices`."""
    if not indices:
        return lambda seq: ()
    if len(indices) == 1:
        (i,) = indices
        return lambda seq: (seq[i],)
    return operator.itemgetter(*indices)


class _OutStatics:
    """The non-array leaves of a traced output, returned next to its arrays.

    Registered as a static pytree node: `jax.jit` keeps it in the output structure
    of the trace that made it, so each compiled function gives back its own."""

    __slots__ = ("treedef", "template", "array_index")

    def __init__(
        self, treedef: jtu.PyTreeDef, template: list[Any], array_index: list[int]
    ):
        self.treedef = treedef
        self.template = template
        self.array_index = array_index

    def rebuild(self, dynamic: PyTree) -> PyTree:
        leaves = list(self.template)
        for i, array in zip(self.array_index, jtu.tree_leaves(dynamic)):
            leaves[i] = array
        return self.treedef.unflatten(leaves)


jtu.register_static(_OutStatics)


class _Layout:
    """The structure of a call's (non-static) arguments: which flat leaves are
    arrays, which of those are donated, and one `jax.jit` per set of values of the
    non-array leaves."""

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
    )

    def __init__(
        self,
        treedef: jtu.PyTreeDef,
        paths: list[KeyPath],
        leaves: list[Any],
        donated_args: frozenset[int],
    ):
        self.treedef = treedef
        self.paths = paths
        flags = [is_array(leaf) for leaf in leaves]
        self.array_index = [i for i, flag in enumerate(flags) if flag]
        self.static_index = [i for i, flag in enumerate(flags) if not flag]
        donated = [paths[i][0].idx in donated_args for i in range(len(leaves))]
        self.donated_index = [i for i in self.array_index if donated[i]]
        self.kept_index = [i for i in self.array_index if not donated[i]]
        self.get_static = _getter(self.static_index)
        self.get_donated = _getter(self.donated_index)
        self.get_kept = _getter(self.kept_index)
        self.signature = (treedef, tuple(self.array_index))
        self.jitted: dict[tuple[Any, ...], Any] = {}


class PartitionedFn:
    """A function compiled with `jax.jit` on a [`eqshard.Partitioner`][]'s mesh.

    Made by [`eqshard.Partitioner.partition`][]. Calls take the function's own
    positional arguments. Array leaves are traced; every other leaf (Python
    scalars, callables, static configuration of Equinox modules) is held static, as
    in `eqx.filter_jit`, and a new value compiles again. Arguments in
    `static_argnums` are static whatever they hold. Outputs may hold non-array
    leaves too.

    While the function is traced, the partitioner's mesh is the current (abstract)
    mesh and its logical axis rules are set, so [`eqshard.with_sharding_constraint`][]
    with mesh axes, or with specs from [`eqshard.logical_to_mesh_axes`][], works
    inside it. The rules are read when tracing: later changes do not retrace.

    **Methods:**

    - `__call__(*args)`: runs the function.
    - `lower(*args)`: JAX's `jax.stages.Lowered` for these arguments (for
      `as_text()`, `cost_analysis()`). For pytree arguments it is lowered over
      their flattened arrays, so use `compile` for something to call.
    - `compile(*args)`: a callable compiled ahead of time for arguments like these,
      taking the same arguments as the function; its `compiled` attribute is
      JAX's `jax.stages.Compiled`.

    **Attributes:**

    - `in_shardings`, `out_shardings`: the spec trees as `NamedSharding`s, built
      once when the function was partitioned.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        in_shardings: PyTree,
        out_shardings: PyTree,
        static_argnums: tuple[int, ...],
        donate_argnums: tuple[int, ...],
        mesh: Mesh,
        rules: LogicalRules,
    ):
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self._fn = fn
        self._mesh = mesh
        self._rules = _RulesContext(rules)
        self._static = static_argnums
        self._donate = frozenset(donate_argnums)
        self._layouts: dict[tuple[Any, ...], _Layout] = {}
        # Calls whose non-static arguments are all arrays skip the tree work: this
        # is possible when `in_specs` is one spec, or one spec per argument.
        if is_spec_leaf(in_shardings):
            self._direct_count = -1
        elif isinstance(in_shardings, tuple) and all(map(is_spec_leaf, in_shardings)):
            self._direct_count = len(in_shardings) + len(static_argnums)
        else:
            self._direct_count = None
        self._direct = None
        if self._direct_count is not None:
            self._direct = jax.jit(
                self._trace_direct,
                in_shardings=in_shardings,
                out_shardings=(out_shardings, None),
                static_argnums=static_argnums,
                donate_argnums=donate_argnums,
            )
        self._get_dynamic = None
        if static_argnums:
            last = max(static_argnums)
            self._get_dynamic = lambda args: tuple(
                x for i, x in enumerate(args) if i not in static_argnums
            )
            self._min_count = last + 1
        else:
            self._min_count = 0

    def __repr__(self) -> str:
        return f"PartitionedFn({self.__name__}, mesh={_mesh_repr(self._mesh)})"

    # -- tracing ------------------------------------------------------------------

    def _run(self, args: tuple[Any, ...]) -> tuple[Any, _OutStatics | None]:
        """Calls the function under the mesh and the rules (at trace time) and
        splits its output into arrays and static leaves."""
        with jax.sharding.use_abstract_mesh(self._mesh.abstract_mesh), self._rules:
            out = self._fn(*args)
        try:
            pairs = broadcast_prefix(
                self.out_shardings,
                out,
                is_leaf=is_spec_leaf,
                name="out_specs",
                caller="PartitionedFn",
            )
        except ValueError as e:
            raise ValueError(f"{e} Here `tree` is the function's output.") from None
        path_leaves, treedef = jtu.tree_flatten_with_path(out)
        leaves = [leaf for _, leaf in path_leaves]
        _check_shapes(
            [path for path, _ in path_leaves],
            leaves,
            [sharding for _, sharding in pairs],
            _OUT,
        )
        flags = [is_array(leaf) for leaf in leaves]
        if all(flags):
            return out, None
        dynamic = [leaf if flag else None for leaf, flag in zip(leaves, flags)]
        template = [None if flag else leaf for leaf, flag in zip(leaves, flags)]
        statics = _OutStatics(
            treedef, template, [i for i, flag in enumerate(flags) if flag]
        )
        return treedef.unflatten(dynamic), statics

    def _trace_direct(self, *args: Any) -> tuple[Any, _OutStatics | None]:
        dynamic = args if self._get_dynamic is None else self._get_dynamic(args)
        shardings = (
            [self.in_shardings] * len(dynamic)
            if is_spec_leaf(self.in_shardings)
            else list(self.in_shardings)
        )
        paths = [(jtu.SequenceKey(i),) for i in range(len(dynamic))]
        _check_shapes(paths, dynamic, shardings, _IN)
        return self._run(args)

    def _make_jit(
        self, layout: _Layout, statics: tuple[Any, ...], static_args: tuple[Any, ...]
    ) -> Any:
        """The `jax.jit` for one layout and one set of static values."""
        # Each leaf's sharding (the leaves of this stand-in only mark positions).
        shardings = [
            sharding
            for _, sharding in broadcast_prefix(
                self.in_shardings,
                layout.treedef.unflatten(list(range(layout.treedef.num_leaves))),
                is_leaf=is_spec_leaf,
                name="in_specs",
                caller="PartitionedFn",
            )
        ]
        template: list[Any] = [None] * layout.treedef.num_leaves
        for i, value in zip(layout.static_index, statics):
            template[i] = value
        static_positions = self._static

        def call(donated: tuple[Any, ...], kept: tuple[Any, ...]) -> Any:
            leaves = list(template)
            for i, x in zip(layout.donated_index, donated):
                leaves[i] = x
            for i, x in zip(layout.kept_index, kept):
                leaves[i] = x
            _check_shapes(layout.paths, leaves, shardings, _IN)
            args = list(layout.treedef.unflatten(leaves))
            for position, value in zip(static_positions, static_args):
                args.insert(position, value)
            return self._run(tuple(args))

        call.__name__ = self.__name__
        call.__qualname__ = getattr(self._fn, "__qualname__", self.__name__)
        return jax.jit(
            call,
            in_shardings=(
                tuple(shardings[i] for i in layout.donated_index),
                tuple(shardings[i] for i in layout.kept_index),
            ),
            out_shardings=(self.out_shardings, None),
            donate_argnums=(0,) if layout.donated_index else (),
        )

    # -- calling ------------------------------------------------------------------

    def _dispatch(
        self, args: tuple[Any, ...], *, static: bool
    ) -> tuple[Any, tuple[Any, ...], Any]:
        """The `jax.jit` for these arguments, the arguments to call it with, and a
        signature telling apart what it was made for. With `static=False` the
        arguments leave out the static ones, as compiled functions take them."""
        count = len(args)
        if count < self._min_count:
            raise TypeError(
                f"eqshard.PartitionedFn: {self.__name__} got {count} positional "
                f"arguments, but static_argnums={self._static} needs at least "
                f"{self._min_count}."
            )
        if self._get_dynamic is None:
            dynamic, static_args = args, ()
        else:
            dynamic = self._get_dynamic(args)
            static_args = tuple(args[i] for i in self._static)
        if self._direct is not None and self._direct_count in (-1, count):
            if all(map(_is_direct, dynamic)):
                _DIRECT_TYPES.update(
                    type(x) for x in dynamic if not isinstance(x, jax.ShapeDtypeStruct)
                )
                return self._direct, args if static else dynamic, (None, static_args)
        leaves, treedef = jtu.tree_flatten(dynamic)
        key = (treedef, tuple(map(type, leaves)))
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._new_layout(dynamic, treedef, leaves, key)
        statics = layout.get_static(leaves)
        jit_key = (statics, static_args)
        try:
            jitted = layout.jitted.get(jit_key)
        except TypeError:
            raise self._unhashable_error(layout, statics, static_args) from None
        if jitted is None:
            jitted = layout.jitted[jit_key] = self._make_jit(
                layout, statics, static_args
            )
        call_args = (layout.get_donated(leaves), layout.get_kept(leaves))
        return jitted, call_args, (layout.signature, jit_key)

    def _new_layout(
        self,
        dynamic: tuple[Any, ...],
        treedef: jtu.PyTreeDef,
        leaves: list[Any],
        key: tuple[Any, ...],
    ) -> _Layout:
        # Check the structure first, naming the first path where `in_specs` differs.
        try:
            broadcast_prefix(
                self.in_shardings,
                dynamic,
                is_leaf=is_spec_leaf,
                name="in_specs",
                caller="PartitionedFn",
            )
        except ValueError as e:
            raise ValueError(f"{e} {_ARGS_NOTE}") from None
        donated = frozenset(i - sum(s < i for s in self._static) for i in self._donate)
        paths = [path for path, _ in jtu.tree_flatten_with_path(dynamic)[0]]
        layout = _Layout(treedef, paths, leaves, donated)
        self._layouts[key] = layout
        return layout

    def _unhashable_error(
        self,
        layout: _Layout,
        statics: tuple[Any, ...],
        static_args: tuple[Any, ...],
    ) -> TypeError:
        for i, value in zip(layout.static_index, statics):
            try:
                hash(value)
            except TypeError:
                return TypeError(
                    f"eqshard.PartitionedFn: the argument leaf at "
                    f"'{path_str(layout.paths[i])}' is {value!r} (a "
                    f"{type(value).__name__}), which is neither an array nor "
                    "hashable. Non-array leaves are compiled into the function, so "
                    "they must be hashable: make it an array, or hashable."
                )
        return TypeError(
            f"eqshard.PartitionedFn: the static arguments {static_args!r} (positions "
            f"{self._static}) must be hashable."
        )

    def __call__(self, *args: Any) -> Any:
        # The common case first: every argument is an array of a type seen before.
        if (
            self._get_dynamic is None
            and self._direct_count in (-1, len(args))
            and all(map(_DIRECT_TYPES.__contains__, map(type, args)))
        ):
            try:
                out, statics = self._direct(*args)
            except ValueError as e:
                self._diagnose(args, e)
                raise
        else:
            jitted, call_args, _ = self._dispatch(args, static=True)
            try:
                out, statics = jitted(*call_args)
            except ValueError as e:
                self._diagnose(args, e)
                raise
        return out if statics is None else statics.rebuild(out)

    def _diagnose(self, args: tuple[Any, ...], error: ValueError) -> None:
        """Raises eqshard's message in place of an error JAX raised before tracing,
        if an argument's spec cannot apply or the argument is placed elsewhere."""
        if str(error).startswith("eqshard."):  # ours, from the trace
            return
        dynamic = args if self._get_dynamic is None else self._get_dynamic(args)
        try:
            pairs = broadcast_prefix(
                self.in_shardings,
                dynamic,
                is_leaf=is_spec_leaf,
                name="in_specs",
                caller="PartitionedFn",
            )
        except ValueError:
            return
        path_leaves = jtu.tree_flatten_with_path(dynamic)[0]
        paths = [path for path, _ in path_leaves]
        leaves = [leaf for _, leaf in path_leaves]
        shardings = [sharding for _, sharding in pairs]
        try:
            _check_shapes(paths, leaves, shardings, _IN)
        except ValueError as ours:
            raise ours from error
        for path, leaf, sharding in zip(paths, leaves, shardings):
            if (
                isinstance(leaf, jax.Array)
                and leaf.committed
                and sharding is not None
                and not leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
            ):
                raise ValueError(
                    f"eqshard.PartitionedFn: the argument at '{path_str(path)}' is "
                    f"already placed with {leaf.sharding}, but `in_specs` asks for "
                    f"{sharding.spec} on mesh {_mesh_repr(sharding.mesh)}; jax.jit "
                    "does not move placed arrays. Place it first with "
                    "`partitioner.move_to_devices` (or `eqshard.shard`), or change "
                    "its spec. " + _ARGS_NOTE
                ) from error

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """JAX's `Lowered` for these arguments; see [`eqshard.PartitionedFn`][]."""
        jitted, call_args, _ = self._dispatch(args, static=True)
        return jitted.lower(*call_args)

    def compile(self, *args: Any) -> "_Compiled":
        """A callable compiled ahead of time for arguments like `args`; see
        [`eqshard.PartitionedFn`][]."""
        jitted, call_args, signature = self._dispatch(args, static=True)
        return _Compiled(self, signature, jitted.lower(*call_args).compile())


_ARGS_NOTE = (
    "Paths start with the index of the argument among the non-static positional "
    "arguments."
)


class _Compiled:
    """A [`eqshard.PartitionedFn`][] compiled ahead of time for one structure of
    arguments. Calls take the function's own arguments."""

    def __init__(self, owner: PartitionedFn, signature: Any, compiled: Any):
        self._owner = owner
        self._signature = signature
        self.compiled = compiled

    def __call__(self, *args: Any) -> Any:
        _, call_args, signature = self._owner._dispatch(args, static=False)
        if signature != self._signature:
            raise TypeError(
                f"eqshard.PartitionedFn.compile: {self._owner.__name__} was compiled "
                "for arguments of another structure, or with other non-array "
                "leaves or static arguments. Compile again for these arguments."
            )
        out, statics = self.compiled(*call_args)
        return out if statics is None else statics.rebuild(out)

    def as_text(self) -> str | None:
        return self.compiled.as_text()

    def __repr__(self) -> str:
        return f"Compiled({self._owner.__name__})"


# ---------------------------------------------------------------------------------
# The partitioner.
# ---------------------------------------------------------------------------------


def _config_error(problem: str, fix: str) -> ValueError:
    return ValueError(f"eqshard.Partitioner: {problem} {fix}")


def _argnums(value: int | Sequence[int], name: str) -> tuple[int, ...]:
    numbers = (value,) if isinstance(value, int) else tuple(value)
    for n in numbers:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(
                f"eqshard.Partitioner.partition: `{name}` must be non-negative "
                f"argument positions, got {value!r}."
            )
    if len(set(numbers)) != len(numbers):
        raise ValueError(
            f"eqshard.Partitioner.partition: `{name}` repeats a position: {value!r}."
        )
    return tuple(sorted(numbers))


class Partitioner:
    """A mesh, logical axis rules, and `jax.jit` on them: t5x's `PjitPartitioner`.

    The mesh is `mesh` if given, else the one [`eqshard.default_mesh`][] picks for
    the hardware, built once here: exactly one of `num_partitions`,
    `model_parallel_submesh` and `mesh` is given. `logical_axis_rules` (by default
    [`eqshard.standard_logical_axis_rules`][], for a `('data', 'model')` mesh)
    resolve the [`eqshard.AxisNames`][] in specs. With `ici_mesh_shape` and
    `dcn_mesh_shape` (a multi-slice `('replica', 'data', 'model')` mesh), the rule
    for `'batch'` becomes `('replica', 'data')`, as in t5x.

    The *data axes* are the mesh axes that the rules map the logical axis
    `'batch'` to (`'data'` with the standard rules): the data layout methods split
    batches over them, and they must be axes of the mesh. With a mesh of your own
    axis names, pass rules for it, e.g. `[("batch", "dp"), ...]`.

    **Arguments:**

    - `num_partitions`: the size of the model-parallel part of the default mesh.
      (On CPU, as in t5x, the default mesh is processes x local devices whatever
      this is.)
    - `model_parallel_submesh`: the `(x, y, z, core)` TPU tile of one model
      replica, for the default mesh.
    - `mesh`: a `jax.sharding.Mesh` to use as it is.
    - `backend`: the JAX backend whose devices the default mesh uses.
    - `ici_mesh_shape`, `dcn_mesh_shape`: within-slice and across-slice shapes of
      a multi-slice default mesh; both or neither.
    - `logical_axis_rules`: `(logical_name, mesh_axes)` pairs in priority order.
    - `params_on_devices`: t5x's flag telling training loops whether to keep
      parameters on devices; stored, not acted on here.

    **Raises:**

    `ValueError` if not exactly one of `num_partitions`, `model_parallel_submesh`
    and `mesh` is given, for options that only shape the default mesh given with
    `mesh`, for a `model_parallel_submesh` that is not 4 numbers, a
    `num_partitions` below 1, only one of the ICI/DCN shapes, or data axes that
    the mesh lacks; the errors of [`eqshard.default_mesh`][]; `TypeError` or
    `ValueError` naming a malformed rule.

    !!! Example

        ```python
        mesh = eqshard.create_mesh((4, 2), ("data", "model"))
        partitioner = eqshard.Partitioner(mesh=mesh)
        step = partitioner.partition(
            train_step,
            in_specs=(model_specs, partitioner.data_partition_spec),
            out_specs=(model_specs, P()),
            donate_argnums=(0,),
        )
        model, loss = step(model, batch)
        ```
    """

    @typecheck
    def __init__(
        self,
        num_partitions: int | None = None,
        model_parallel_submesh: Sequence[int] | None = None,
        *,
        mesh: Mesh | None = None,
        backend: str | None = None,
        ici_mesh_shape: Sequence[int] | None = None,
        dcn_mesh_shape: Sequence[int] | None = None,
        logical_axis_rules: Sequence[Any] | None = None,
        params_on_devices: bool = True,
    ):
        given = [
            name
            for name, value in (
                ("num_partitions", num_partitions),
                ("model_parallel_submesh", model_parallel_submesh),
                ("mesh", mesh),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise _config_error(
                "exactly one of `num_partitions`, `model_parallel_submesh` and "
                f"`mesh` must be given, got {' and '.join(given) or 'none'}.",
                "Pass `mesh=` to use a mesh of your own, or one of the others to "
                "let eqshard.default_mesh pick one for the hardware.",
            )
        if mesh is not None:
            extra = [
                name
                for name, value in (
                    ("backend", backend),
                    ("ici_mesh_shape", ici_mesh_shape),
                    ("dcn_mesh_shape", dcn_mesh_shape),
                )
                if value is not None
            ]
            if extra:
                raise _config_error(
                    f"{' and '.join(extra)} only shape the default mesh, but "
                    "`mesh=` was given.",
                    "Build the mesh with them yourself (e.g. "
                    "eqshard.create_hybrid_mesh), or drop `mesh=`.",
                )
        if num_partitions is not None and num_partitions < 1:
            raise _config_error(
                f"`num_partitions` must be at least 1, got {num_partitions}.",
                "It is the number of devices each model replica is split over.",
            )
        if model_parallel_submesh is not None and len(model_parallel_submesh) != 4:
            raise _config_error(
                "`model_parallel_submesh` must be 4 numbers (x, y, z, core), got "
                f"{tuple(model_parallel_submesh)!r}.",
                "For a number of devices rather than a TPU tile, use `num_partitions`.",
            )
        if (ici_mesh_shape is None) != (dcn_mesh_shape is None):
            raise _config_error(
                "`ici_mesh_shape` and `dcn_mesh_shape` describe a multi-slice mesh "
                "together, but only one was given.",
                "Pass both (e.g. ici (1, 4, 2) and dcn (2, 1, 1)), or neither.",
            )
        if logical_axis_rules is None:
            rules = standard_logical_axis_rules()
        else:
            rules = _normalize_rules(
                logical_axis_rules,
                caller="Partitioner",
                argname="logical_axis_rules",
            )
        if ici_mesh_shape is not None:  # and dcn_mesh_shape: multi-slice
            rules = tuple(
                (name, ("replica", "data") if name == "batch" else axes)
                for name, axes in rules
            )
        if mesh is None:
            submesh = None
            if model_parallel_submesh is not None:
                submesh = tuple(model_parallel_submesh)
                num_partitions = math.prod(submesh)  # ignored with a submesh
            assert num_partitions is not None
            mesh = default_mesh(
                num_partitions,
                submesh,
                backend=backend,
                ici_mesh_shape=None
                if ici_mesh_shape is None
                else tuple(ici_mesh_shape),
                dcn_mesh_shape=None
                if dcn_mesh_shape is None
                else tuple(dcn_mesh_shape),
            )
        data_axes = entry_axes(_resolve(("batch",), rules, caller="Partitioner")[0])
        missing = [axis for axis in data_axes if axis not in mesh.shape]
        if missing:
            raise _config_error(
                f"the rules map the logical axis 'batch' (the data axes) to "
                f"{data_axes if len(data_axes) > 1 else data_axes[0]!r}, but the mesh "
                f"{_mesh_repr(mesh)} has no axis {', '.join(map(repr, missing))}.",
                "Pass `logical_axis_rules` for this mesh, with a rule such as "
                f"('batch', {mesh.axis_names[0]!r}).",
            )
        self._mesh = mesh
        self._rules: LogicalRules = rules
        self._data_axes: tuple[str, ...] = data_axes
        self._params_on_devices = params_on_devices
        self._chunkers: dict[int, LocalChunker] = {}

    def __repr__(self) -> str:
        return (
            f"Partitioner(mesh={_mesh_repr(self._mesh)}, "
            f"data_partition_spec={self.data_partition_spec})"
        )

    # -- configuration ------------------------------------------------------------

    @property
    def mesh(self) -> Mesh:
        """The mesh, built once when the partitioner was made."""
        return self._mesh

    @property
    def logical_axis_rules(self) -> LogicalRules:
        """The logical axis rules, validated, as a tuple of pairs."""
        return self._rules

    @property
    def params_on_devices(self) -> bool:
        """t5x's flag: whether training loops should keep parameters on devices."""
        return self._params_on_devices

    # -- data layout --------------------------------------------------------------

    def _data_entry(self) -> str | tuple[str, ...] | None:
        axes = self._data_axes
        return None if not axes else axes[0] if len(axes) == 1 else axes

    def _chunker(self, process_index: int | None) -> LocalChunker:
        if process_index is None:
            process_index = jax.process_index()
        chunker = self._chunkers.get(process_index)
        if chunker is None:
            chunker = LocalChunker(self._mesh, process_index=process_index)
            self._chunkers[process_index] = chunker
        return chunker

    @property
    def data_partition_spec(self) -> PartitionSpec:
        """The spec of a batch: its first dimension over the data axes."""
        return PartitionSpec(self._data_entry())

    @property
    def data_mesh_size(self) -> int:
        """The number of devices along the data axes (1 if there are none)."""
        return math.prod(self._mesh.shape[axis] for axis in self._data_axes)

    @property
    def data_shards(self) -> int:
        """The number of distinct shards of a batch that processes load."""
        chunker = self._chunker(None)
        return math.prod(chunker.num_chunks[axis] for axis in self._data_axes)

    @property
    def data_shard_id(self) -> int:
        """Which shard of a batch this process loads."""
        return self._chunker(None).get_shard_id(self._data_axes)

    @typecheck
    def data_layout(
        self, batch_size: int | None = None, *, process_index: int | None = None
    ) -> DataLayout:
        """How a global batch is split between processes, seen from one process.

        With no data axes (the rules do not shard `'batch'`), every process loads
        the whole batch: one shard, and process 0 is the first host.

        **Arguments:**

        - `batch_size`: the global batch size; defaults to `data_mesh_size` (one
          example per device along the data axes).
        - `process_index`: the process to describe; defaults to
          `jax.process_index()`.

        **Returns:**

        A [`eqshard.DataLayout`][].

        **Raises:**

        `ValueError` if `batch_size` is not positive or not divisible by
        `data_mesh_size` (the message gives both numbers); the errors of
        [`eqshard.LocalChunker`][].

        !!! Example

            ```python
            layout = partitioner.data_layout(batch_size=64)
            dataset = dataset.shard(layout.num_shards, layout.shard_id)
            per_host_batch = layout.batch_size // layout.num_shards
            ```
        """
        if batch_size is not None and batch_size < 1:
            raise ValueError(
                f"eqshard.Partitioner.data_layout: `batch_size` must be positive, "
                f"got {batch_size}."
            )
        if process_index is None:
            process_index = jax.process_index()
        if not self._data_axes:
            return DataLayout(batch_size, 0, 1, process_index == 0)
        chunker = self._chunker(process_index)
        mesh_size = self.data_mesh_size
        shards = math.prod(chunker.num_chunks[axis] for axis in self._data_axes)
        if batch_size is None:
            batch_size = mesh_size
        # t5x also checks divisibility by the number of shards, which divides
        # the data mesh size (every process holds as many devices along each axis).
        if batch_size % mesh_size:
            raise ValueError(
                f"eqshard.Partitioner.data_layout: batch size {batch_size} is not "
                f"divisible by the data mesh size (devices along "
                f"{self._data_entry()!r} on mesh {_mesh_repr(self._mesh)}), "
                f"{mesh_size}. Use a multiple of {mesh_size}, e.g. "
                f"{(batch_size // mesh_size + 1) * mesh_size}."
            )
        return DataLayout(
            batch_size=batch_size,
            shard_id=chunker.get_shard_id(self._data_axes),
            num_shards=shards,
            is_first_host_in_replica_set=chunker.get_replica_id(self._data_axes) == 0,
        )

    @typecheck
    def local_chunk_info(
        self,
        global_shape: Sequence[int],
        mesh_axes: Sequence[Any] | PartitionSpec,
        *,
        process_index: int | None = None,
    ) -> LocalChunkInfo:
        """The slice of a global array that one process's devices hold.

        As [`eqshard.LocalChunker`][]'s `get_local_chunk_info`, on this
        partitioner's mesh; `mesh_axes` may also be an [`eqshard.AxisNames`][],
        resolved with the partitioner's rules.

        **Arguments:**

        - `global_shape`: the shape of the global array.
        - `mesh_axes`: a `PartitionSpec`, a sequence of mesh axes (or `None`) per
          dimension, or logical names as an `AxisNames`.
        - `process_index`: the process; defaults to `jax.process_index()`.

        **Returns:**

        A [`eqshard.LocalChunkInfo`][].

        **Raises:**

        As `LocalChunker.get_local_chunk_info`.

        !!! Example

            ```python
            names = eqshard.AxisNames("batch", "embed")
            info = partitioner.local_chunk_info((64, 512), names)
            host_rows = batch[info.slice]
            ```
        """
        if isinstance(mesh_axes, AxisNames):
            mesh_axes = _resolve(
                mesh_axes, self._rules, caller="Partitioner.local_chunk_info"
            )
        chunker = self._chunker(process_index)
        return chunker.get_local_chunk_info(global_shape, mesh_axes)

    # -- functions and data -------------------------------------------------------

    @typecheck
    def partition(
        self,
        fn: Callable[..., Any],
        in_specs: PyTree,
        out_specs: PyTree,
        *,
        static_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = (),
    ) -> PartitionedFn:
        """Compiles `fn` with `jax.jit` on this partitioner's mesh.

        The specs become `NamedSharding`s here, once. `fn` is traced with the mesh
        as the current (abstract) mesh and the partitioner's logical rules set, so
        [`eqshard.with_sharding_constraint`][] works inside it. Arguments may be
        Equinox modules or any pytrees: array leaves are traced, other leaves are
        static (see [`eqshard.PartitionedFn`][]). A spec of `None` leaves the
        sharding to JAX (the argument's own, or the compiler's choice); use `P()`
        for replicated. Arrays that are already placed must have the sharding
        their spec asks for (JAX does not move them): place them with
        [`eqshard.Partitioner.move_to_devices`][].

        **Arguments:**

        - `fn`: the function. Its arrays of its own (closed over, or in a module
          that is `fn`) are compiled in as constants: pass them as arguments.
        - `in_specs`: one entry per non-static positional argument (a tuple or
          list), or one entry for all of them, as in `jax.jit`'s `in_shardings`.
          Entries are spec trees or prefixes of them, with `PartitionSpec`,
          `NamedSharding`, [`eqshard.AxisNames`][] (resolved with the rules) or
          `None` leaves.
        - `out_specs`: the same for the output.
        - `static_argnums`: positions of arguments that are static (hashable, and
          compiled in); they have no entry in `in_specs`.
        - `donate_argnums`: positions of arguments whose arrays are donated: their
          buffers may be reused for the output, and they are deleted.

        **Returns:**

        A [`eqshard.PartitionedFn`][].

        **Raises:**

        - `TypeError` naming the path of a spec leaf of another type.
        - `ValueError` naming the path of a spec with a mesh axis the mesh lacks,
          for bad or overlapping argnums; on call, naming every argument or output
          whose spec does not fit its shape, or the first path where a spec tree
          does not match the arguments or the output.

        !!! Example

            ```python
            step = partitioner.partition(
                step,
                in_specs=(model_axes, eqshard.AxisNames("batch", None)),
                out_specs=(model_axes, P()),
                donate_argnums=0,
            )
            ```
        """
        static = _argnums(static_argnums, "static_argnums")
        donate = _argnums(donate_argnums, "donate_argnums")
        both = sorted(set(static) & set(donate))
        if both:
            raise ValueError(
                f"eqshard.Partitioner.partition: argument(s) {both} are both static "
                "and donated; static arguments are compiled in and have no buffers "
                "to donate."
            )
        caller = "Partitioner.partition"
        in_shardings = _to_shardings(
            in_specs, self._mesh, self._rules, name="in_specs", caller=caller
        )
        out_shardings = _to_shardings(
            out_specs, self._mesh, self._rules, name="out_specs", caller=caller
        )
        return PartitionedFn(
            fn, in_shardings, out_shardings, static, donate, self._mesh, self._rules
        )

    @typecheck
    def move_to_devices(
        self, tree: PyTree, specs: PyTree, *, host_local: bool = False
    ) -> PyTree:
        """Places a pytree on the mesh, donating the device buffers it had.

        t5x's `move_params_to_devices` for any pytree, as one batched
        `jax.device_put`: array leaves (NumPy or JAX) get their spec's sharding,
        and JAX arrays' old buffers are donated where the runtime can (a best
        effort: on some backends they are copied). Other leaves are returned as
        they are. Every spec is checked before anything moves.

        **Arguments:**

        - `tree`: any pytree, e.g. an Equinox module or an optimizer state.
        - `specs`: a spec tree for `tree` or a prefix of one, with
          `PartitionSpec`, `NamedSharding`, [`eqshard.AxisNames`][] or `None`
          (left where it is) leaves.
        - `host_local`: in a multi-process run, whether each process passes only
          the block of each array that its own devices hold (t5x's host-local
          arrays, e.g. its part of the batch, as `data_layout` describes) rather
          than a full copy, as [`eqshard.shard`][] takes. A block's global array
          is as many blocks long, along each dimension, as there are groups of
          processes along that dimension's mesh axes; where there are none, every
          process passes the same whole array. In one process this changes
          nothing.

        **Returns:**

        A pytree of the structure of `tree`, its arrays on the mesh.

        **Raises:**

        As [`eqshard.shard`][]. With `host_local`, also a `ValueError` naming every
        leaf whose spec gives some process's devices pieces of a dimension that
        are not one contiguous slice (no block can hold them), with a spec that
        would work.

        !!! Example

            ```python
            model = partitioner.move_to_devices(model, model_axes)
            ```
        """
        caller = "Partitioner.move_to_devices"
        shardings = _to_shardings(
            specs, self._mesh, self._rules, name="specs", caller=caller
        )
        if jax.process_count() > 1:
            return _shard(
                tree,
                shardings,
                self._mesh,
                dtype=None,
                caller=caller,
                host_local=host_local,
            )
        matched = _match(tree, shardings, self._mesh, caller=caller)
        leaves = [leaf for _, leaf, _ in matched]
        moving = [i for i, (_, _, sharding) in enumerate(matched) if sharding]
        placed = jax.device_put(
            [leaves[i] for i in moving],
            [matched[i][2] for i in moving],
            donate=[isinstance(leaves[i], jax.Array) for i in moving],
        )
        for i, array in zip(moving, placed):
            leaves[i] = array
        return jtu.tree_unflatten(jtu.tree_structure(tree), leaves)
