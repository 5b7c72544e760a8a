"""The t5x-style partitioner: a mesh, logical axis rules, and `jax.jit` with the
shardings built once.

A [`eqshard.t5x.Partitioner`][] owns a mesh (given, or picked for the hardware by
[`eqshard.t5x.default_mesh`][]) and logical axis rules. `partition(fn, in_specs,
out_specs)` turns spec trees (`PartitionSpec`s, `NamedSharding`s or
[`eqshard.AxisNames`][]) into `NamedSharding`s once and wraps `fn` in a
[`eqshard.t5x.PartitionedFn`][] (`_partitioned.py`). Its data layout follows t5x: the
data axes are the mesh axes that the rules map the logical axis `'batch'` to, and
which part of them a process holds comes from [`eqshard.t5x.LocalChunker`][]
(`_chunking.py`).
"""

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.tree_util as jtu
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import PyTree

from .._deprecated import renamed_attribute, renamed_keywords
from .._mesh._current import mesh_repr
from .._move._shard import shard_tree
from .._spectree._check_spec import entry_axes, spec_entry
from .._spectree._logical import (
    AxisNames,
    logical_to_spec,
    LogicalRules,
)
from .._spectree._resolve import NO_TREE, resolve_specs
from .._typing import AxisRulesArg, Int, typecheck
from ._chunking import DataLayout, LocalChunker, LocalChunkInfo
from ._config import (
    axis_rules_for,
    check_config,
    no_data_axes_error,
    partitioner_mesh,
)
from ._partitioned import PartitionedFn, to_shardings


def _argnums(value: Int | Sequence[Int], name: str) -> tuple[int, ...]:
    numbers = (value,) if isinstance(value, Int) else tuple(value)
    for n in numbers:
        if not isinstance(n, Int) or isinstance(n, bool) or n < 0:
            raise ValueError(
                f"eqshard.t5x.Partitioner.partition: `{name}` must be non-negative "
                f"argument positions, got {value!r}."
            )
    if len(set(numbers)) != len(numbers):
        raise ValueError(
            f"eqshard.t5x.Partitioner.partition: `{name}` repeats a position: "
            f"{value!r}."
        )
    return tuple(sorted(map(operator.index, numbers)))


class Partitioner:
    """A mesh, logical axis rules, and `jax.jit` on them: t5x's `PjitPartitioner`.

    The mesh is `mesh` if given, else the one [`eqshard.t5x.default_mesh`][] picks
    for the hardware, built once here. `axis_rules` (by default
    [`eqshard.t5x.standard_logical_axis_rules`][], for a `('data', 'model')` mesh)
    resolve the [`eqshard.AxisNames`][] in specs; the mesh axes they map `'batch'`
    to are the *data axes* that batches are split over. Meshes of other axis
    names, multi-slice meshes and the data axes in full:
    [the mesh and the data axes](t5x.md#the-mesh-and-the-data-axes).

    **Arguments:**

    - `num_partitions`: the size of the model-parallel part of the default mesh
      (on CPU, as in t5x, the default mesh is processes x local devices).
    - `model_parallel_submesh`: the tile of the hardware mesh holding one model
      replica: `(x, y, z, core)` on TPU, `(processes, local devices)` elsewhere.
    - `mesh`: a `jax.sharding.Mesh` to use as it is.
    - `backend`: the JAX backend whose devices the default mesh uses.
    - `ici_mesh_shape`, `dcn_mesh_shape`: within- and across-slice shapes of a
      multi-slice default mesh; both or neither.
    - `axis_rules`: `(logical_name, mesh_axes)` pairs in priority order.
    - `params_on_devices`: t5x's flag for training loops; stored, not acted on.

    **Raises:**

    `ValueError` unless exactly one of `num_partitions`, `model_parallel_submesh`
    and `mesh` is given, for default-mesh options given with `mesh`, a
    `num_partitions` below 1, one ICI/DCN shape alone, or data axes the mesh
    lacks; [`eqshard.t5x.default_mesh`][]'s errors; `TypeError` or `ValueError`
    naming a malformed rule.

    !!! Example

        ```python
        mesh = eqshard.create_mesh((4, 2), ("data", "model"))
        partitioner = eqshard.t5x.Partitioner(mesh=mesh)
        step = partitioner.partition(
            train_step, in_specs=(model_specs, partitioner.data_partition_spec),
            out_specs=(model_specs, P()), donate_argnums=(0,),
        )
        model, loss = step(model, batch)
        ```
    """

    @renamed_keywords("t5x.Partitioner", logical_axis_rules="axis_rules")
    @typecheck
    def __init__(
        self,
        num_partitions: Int | None = None,
        model_parallel_submesh: Sequence[Int] | None = None,
        *,
        mesh: Mesh | None = None,
        backend: str | None = None,
        ici_mesh_shape: Sequence[Int] | None = None,
        dcn_mesh_shape: Sequence[Int] | None = None,
        axis_rules: AxisRulesArg | None = None,
        params_on_devices: bool = True,
    ):
        if num_partitions is not None:
            num_partitions = operator.index(num_partitions)
        check_config(
            num_partitions,
            model_parallel_submesh,
            mesh,
            backend=backend,
            ici_mesh_shape=ici_mesh_shape,
            dcn_mesh_shape=dcn_mesh_shape,
        )
        rules = axis_rules_for(axis_rules, multislice=ici_mesh_shape is not None)
        if mesh is None:
            mesh = partitioner_mesh(
                num_partitions,
                model_parallel_submesh,
                backend=backend,
                ici_mesh_shape=ici_mesh_shape,
                dcn_mesh_shape=dcn_mesh_shape,
            )
        data_axes = entry_axes(
            logical_to_spec(("batch",), rules, caller="t5x.Partitioner")[0]
        )
        # Without rules for this mesh, what needs them raises: at once if rules
        # were given, and otherwise when a logical name must be resolved or the
        # data axes are asked for (`PartitionSpec`s need no rules).
        self._rules_error: ValueError | None = no_data_axes_error(
            data_axes, mesh, default=axis_rules is None
        )
        if self._rules_error is not None and axis_rules is not None:
            raise self._rules_error
        self._mesh = mesh
        self._rules: LogicalRules = rules
        self._batch_axes: tuple[str, ...] = data_axes
        self._params_on_devices = params_on_devices
        self._chunkers: dict[int, LocalChunker] = {}

    def __repr__(self) -> str:
        data = "?" if self._rules_error else self.data_partition_spec
        return f"Partitioner(mesh={mesh_repr(self._mesh)}, data_partition_spec={data})"

    @property
    def _data_axes(self) -> tuple[str, ...]:
        if self._rules_error is not None:
            raise self._rules_error
        return self._batch_axes

    def _shardings(
        self, specs: PyTree, name: str, caller: str, tree: PyTree = NO_TREE
    ) -> PyTree:
        """`specs` for `tree` as `NamedSharding`s on the mesh; logical names need
        rules. Partition rules and functions need the tree."""
        specs = resolve_specs(
            specs,
            tree,
            caller=caller,
            argname=name,
            mesh=self._mesh,
            axis_rules=self._rules,
            no_tree="Match them first against the arguments (or their "
            "`eqx.filter_eval_shape`): `eqshard.match_partition_rules(rules, args)`.",
        )
        if self._rules_error is not None and any(
            isinstance(leaf, AxisNames)
            for leaf in jtu.tree_leaves(
                specs, is_leaf=lambda x: isinstance(x, AxisNames)
            )
        ):
            raise self._rules_error
        return to_shardings(specs, self._mesh, self._rules, name=name, caller=caller)

    # -- configuration ------------------------------------------------------------

    @property
    def mesh(self) -> Mesh:
        """The mesh, built once when the partitioner was made."""
        return self._mesh

    @property
    def axis_rules(self) -> LogicalRules:
        """The logical axis rules, validated, as a tuple of pairs."""
        return self._rules

    @property
    def logical_axis_rules(self) -> LogicalRules:
        """Deprecated: `axis_rules` (t5x's name; it goes in eqshard 0.3)."""
        renamed_attribute("t5x.Partitioner", "logical_axis_rules", "axis_rules")
        return self._rules

    @property
    def params_on_devices(self) -> bool:
        """t5x's flag: whether training loops should keep parameters on devices."""
        return self._params_on_devices

    # -- data layout --------------------------------------------------------------

    def _data_entry(self) -> str | tuple[str, ...] | None:
        return spec_entry(self._data_axes)

    def _chunker(self, process_index: Int | None) -> LocalChunker:
        if process_index is None:
            process_index = jax.process_index()
        process_index = operator.index(process_index)
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
        self, batch_size: Int | None = None, *, process_index: Int | None = None
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

        A [`eqshard.t5x.DataLayout`][].

        **Raises:**

        `ValueError` if `batch_size` is not positive or not divisible by
        `data_mesh_size` (the message gives both numbers); the errors of
        [`eqshard.t5x.LocalChunker`][].

        !!! Example

            ```python
            layout = partitioner.data_layout(batch_size=64)
            dataset = dataset.shard(layout.num_shards, layout.shard_id)
            per_host_batch = layout.batch_size // layout.num_shards
            ```
        """
        if batch_size is not None:
            batch_size = operator.index(batch_size)
        if process_index is not None:
            process_index = operator.index(process_index)
        if batch_size is not None and batch_size < 1:
            raise ValueError(
                f"eqshard.t5x.Partitioner.data_layout: `batch_size` must be positive, "
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
                f"eqshard.t5x.Partitioner.data_layout: batch size {batch_size} is not "
                f"divisible by the data mesh size (devices along "
                f"{self._data_entry()!r} on mesh {mesh_repr(self._mesh)}), "
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
        global_shape: Sequence[Int],
        mesh_axes: Sequence[Any] | PartitionSpec,
        *,
        process_index: Int | None = None,
    ) -> LocalChunkInfo:
        """The slice of a global array that one process's devices hold.

        As [`eqshard.t5x.LocalChunker`][]'s `get_local_chunk_info`, on this
        partitioner's mesh; `mesh_axes` may also be an [`eqshard.AxisNames`][],
        resolved with the partitioner's rules.

        **Arguments:**

        - `global_shape`: the shape of the global array.
        - `mesh_axes`: a `PartitionSpec`, a sequence of mesh axes (or `None`) per
          dimension, or logical names as an `AxisNames`.
        - `process_index`: the process; defaults to `jax.process_index()`.

        **Returns:**

        A [`eqshard.t5x.LocalChunkInfo`][].

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
            if self._rules_error is not None:
                raise self._rules_error
            mesh_axes = logical_to_spec(
                mesh_axes, self._rules, caller="t5x.Partitioner.local_chunk_info"
            )
        chunker = self._chunker(process_index)
        shape = tuple(map(operator.index, global_shape))
        return chunker.get_local_chunk_info(shape, mesh_axes)

    # -- functions and data -------------------------------------------------------

    @typecheck
    def partition(
        self,
        fn: Callable[..., Any],
        in_specs: PyTree,
        out_specs: PyTree,
        *,
        static_argnums: Int | Sequence[Int] = (),
        donate_argnums: Int | Sequence[Int] = (),
    ) -> PartitionedFn:
        """Compiles `fn` with `jax.jit` on this partitioner's mesh.

        The specs become `NamedSharding`s here, once. `fn` is traced with the mesh
        as the current (abstract) mesh and the partitioner's logical rules set, so
        [`eqshard.with_sharding_constraint`][] works inside it. Arguments may be
        Equinox modules or any pytrees: array leaves are traced, other leaves are
        static (see [`eqshard.t5x.PartitionedFn`][]). A spec of `None` leaves the
        sharding to JAX (the argument's own, or the compiler's); `P()` replicates.
        Placed arrays must have the sharding their spec asks for (JAX does not move
        them): place them with [`eqshard.t5x.Partitioner.move_to_devices`][].

        **Arguments:**

        - `fn`: the function. Arrays of its own (closed over, or in a module that is
          `fn`) are compiled in as constants: pass them as arguments.
        - `in_specs`: one entry per non-static positional argument (a tuple or
          list), or one for all, as `jax.jit`'s `in_shardings`: spec trees or
          prefixes with `PartitionSpec`, `NamedSharding`, [`eqshard.AxisNames`][]
          (resolved with the rules) or `None` leaves.
        - `out_specs`: the same for the output.
        - `static_argnums`: positions of static arguments (hashable, compiled in);
          they have no entry in `in_specs`.
        - `donate_argnums`: positions of arguments whose arrays are donated (their
          buffers may be reused for the output, and they are deleted).

        **Returns:**

        A [`eqshard.t5x.PartitionedFn`][].

        **Raises:**

        `TypeError` naming the path of a spec leaf of another type; `ValueError`
        naming the path of a spec with a mesh axis the mesh lacks, for bad or
        overlapping argnums, and on call naming every argument or output whose spec
        does not fit its shape, or the first path where a spec tree does not match.

        !!! Example

            ```python
            step = partitioner.partition(
                step, in_specs=(model_axes, eqshard.AxisNames("batch", None)),
                out_specs=(model_axes, P()), donate_argnums=0,
            )
            ```
        """
        static = _argnums(static_argnums, "static_argnums")
        donate = _argnums(donate_argnums, "donate_argnums")
        both = sorted(set(static) & set(donate))
        if both:
            raise ValueError(
                f"eqshard.t5x.Partitioner.partition: argument(s) {both} are both "
                "static and donated; static arguments are compiled in and have no "
                "buffers to donate."
            )
        caller = "t5x.Partitioner.partition"
        in_shardings = self._shardings(in_specs, "in_specs", caller)
        out_shardings = self._shardings(out_specs, "out_specs", caller)
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
          (left where it is) leaves; or partition rules, or a function of the
          abstract tree (see [the spec-tree family](specs.md)).
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
        caller = "t5x.Partitioner.move_to_devices"
        shardings = self._shardings(specs, "specs", caller, tree)
        return shard_tree(
            tree,
            shardings,
            self._mesh,
            dtype=None,
            caller=caller,
            # In one process a host-local block is the whole array.
            host_local=host_local and jax.process_count() > 1,
            donate=True,
        )
