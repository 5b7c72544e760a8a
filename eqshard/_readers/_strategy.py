"""Planning memory before anything moves: `analyze_sharding_strategy` works out,
from shapes and specs alone, how many bytes each device of a mesh would hold. It
reads only `.shape` and `.dtype`, so it plans a 70B-parameter model from
`jax.ShapeDtypeStruct`s without allocating; the report is `_inspect.py`'s
`ShardingReport`.
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jaxtyping import PyTree

from .._deprecated import renamed_literals
from .._mesh._current import mesh_repr, require_mesh, same_mesh
from .._mesh._targets import pads_to_tiles, tpu_padded_bytes
from .._spectree._check_spec import (
    check_leaf,
    entry_axes,
    leaf_specs,
    ShardingProblem,
    spec_error_message,
)
from .._spectree._memory import Host, HOST_MEMORY
from .._spectree._resolve import resolve_specs
from .._tree import is_array, path_str, placed_dtype
from .._typing import check_choice, KeyPath, ON_INVALID, OnInvalid, typecheck, warn
from ._inspect import is_single_device, own_shardings, ShardingReport, ShardingRow


def _other_mesh_error(
    path: KeyPath, leaf_mesh: Mesh | AbstractMesh, mesh: Mesh | AbstractMesh
) -> ValueError:
    return ValueError(
        f"eqshard.analyze_sharding_strategy: the NamedSharding at '{path_str(path)}' "
        f"is on mesh {mesh_repr(leaf_mesh)}, which is neither the analysed mesh "
        f"{mesh_repr(mesh)} nor made of its devices. A report counts the bytes of "
        "one mesh's devices: use `PartitionSpec`s, or shardings on (a part of) that "
        "mesh."
    )


def _device_rows(
    leaf_mesh: Mesh | AbstractMesh,
    mesh: Mesh | AbstractMesh,
    index: dict[int, int] | None,
    path: KeyPath,
) -> slice | list[int]:
    """The positions, in `mesh.devices.flat` order, of the devices of `leaf_mesh`
    (an abstract mesh's devices are its mesh coordinates)."""
    if same_mesh(leaf_mesh, mesh):
        return slice(None)
    if isinstance(leaf_mesh, Mesh) and index is not None:
        try:
            return [index[device.id] for device in leaf_mesh.devices.flat]
        except KeyError:
            raise _other_mesh_error(path, leaf_mesh, mesh) from None
    raise _other_mesh_error(path, leaf_mesh, mesh)


@renamed_literals("analyze_sharding_strategy", "on_invalid", report="ignore")
@typecheck
def analyze_sharding_strategy(
    tree: PyTree,
    specs: PyTree,
    mesh: Mesh | AbstractMesh | None = None,
    *,
    on_invalid: OnInvalid = "ignore",
) -> ShardingReport:
    """Works out what a sharding plan puts on each device, without moving anything.

    For each array of `tree` (only `.shape` and `.dtype` are read, so abstract trees
    of any size work), every device holding it holds the piece its mesh coordinates
    select; a replicated array counts in full on every device. Non-array leaves are
    left out, and arrays whose spec is `None` are listed but placed nowhere. A spec
    that cannot apply is a planning finding, not a crash: it is listed in
    `report.problems` and the array counted with the nearest spec that applies (see
    [the how-to](../how-to/plan-large-model.md#a-plan-for-a-mesh-you-do-not-have)).

    **Arguments:**

    - `tree`: any pytree; concrete or abstract.
    - `specs`: a spec tree for `tree` or a prefix of one, partition rules, or a
      function of the abstract tree (see [the spec-tree family](specs.md)).
      `None` reads the shardings the arrays have (an array on a single device is
      flagged `single device`).
    - `mesh`: a `Mesh`, or an `AbstractMesh` to plan for devices you do not have.
      Defaults to the mesh set by `jax.set_mesh`, then to that of the
      `NamedSharding`s in `specs`.
    - `on_invalid`: `"ignore"` (the default) reports specs that cannot apply,
      `"warn"` reports them and warns, `"raise"` raises.

    **Returns:**

    An immutable [`eqshard.ShardingReport`][].

    **Raises:**

    - `ValueError` if `specs` is not a prefix of `tree`, if there is no mesh, if a
      `NamedSharding` holds devices outside the mesh (naming its path), or, with
      `on_invalid="raise"`, naming every array whose spec cannot apply.
    - `TypeError` naming the path of a leaf of `specs` that is not a spec.

    !!! Example

        ```python
        shapes = eqx.filter_eval_shape(make_model, jax.random.key(0))
        specs = eqshard.match_partition_rules(rules, shapes)
        report = eqshard.analyze_sharding_strategy(shapes, specs, mesh)
        print(report)  # one line per array, then the totals
        ```
    """
    caller = "analyze_sharding_strategy"
    check_choice(on_invalid, ON_INVALID, caller=caller, name="on_invalid")
    specs = resolve_specs(specs, tree, caller=caller, mesh=mesh)
    if specs is None:
        pairs = own_shardings(tree, caller)
    else:
        pairs = leaf_specs(specs, tree, caller=caller)
    return analyze_pairs(
        jtu.tree_leaves(tree), pairs, mesh, caller=caller, on_invalid=on_invalid
    )


@dataclasses.dataclass(frozen=True)
class _Placed:
    """What a spec places of an array of some shape: the spec asked for, the
    devices holding it (positions in `mesh.devices.flat`, or all of them), the
    elements of each piece, into how many pieces it is split, and how many
    devices hold one."""

    asked: Any
    devices: slice | list[int]
    piece: int
    shards: int
    holders: int
    block: tuple[int, ...] = ()  # the shape of a piece


@dataclasses.dataclass
class _Tally:
    """The report being made, array by array (`analyze_pairs`)."""

    mesh: Mesh | AbstractMesh
    index: dict[int, int] | None  # device id -> position in `mesh.devices.flat`
    per_device: np.ndarray
    every: int = 0  # bytes on every device of `mesh`, added to `per_device` at the end
    rows: list[ShardingRow] = dataclasses.field(default_factory=list)
    problems: list[ShardingProblem] = dataclasses.field(default_factory=list)
    dtypes: dict[Any, tuple[int, str]] = dataclasses.field(default_factory=dict)
    # (spec, shape) -> what a spec that applies places. Trees repeat a few shapes
    # under a few specs many times over (layers, gradients, moments).
    placed: dict[Any, _Placed] = dataclasses.field(default_factory=dict)
    padded: bool = False  # a TPU target's mesh: pieces laid out in tiles


def _dtype(tally: _Tally, leaf: Any, spec: Any) -> tuple[int, str]:
    """The itemsize and name of `leaf`'s dtype as placed: NumPy data placed
    counts as `shard` places it (32-bit without x64)."""
    dtype = (
        placed_dtype(leaf.dtype)
        if spec is not None and isinstance(leaf, np.ndarray | np.generic)
        else leaf.dtype
    )
    known = tally.dtypes.get(dtype)
    if known is None:
        known = tally.dtypes[dtype] = (int(dtype.itemsize), str(dtype))
    return known


def _placement(
    tally: _Tally, path: KeyPath, spec: Any, leaf: Any, shape: tuple[int, ...]
) -> tuple[_Placed, ShardingProblem | None]:
    """What `spec` places of `leaf` (the nearest spec that applies, and the
    problem, if it does not)."""
    found = tally.placed.get((spec, shape))
    if found is not None:
        return found, None
    if isinstance(spec, NamedSharding):
        devices = _device_rows(spec.mesh, tally.mesh, tally.index, path)
    else:
        devices = slice(None)
    asked, leaf_mesh, fixed, problem = check_leaf(path, spec, leaf, tally.mesh)
    sizes = dict(leaf_mesh.shape)
    # `fixed` divides every dimension evenly: every device holds as much.
    splits = [math.prod(sizes[a] for a in entry_axes(e)) for e in fixed]
    block = tuple(
        n // (splits[d] if d < len(splits) else 1) for d, n in enumerate(shape)
    )
    found = _Placed(
        asked,
        devices,
        math.prod(block),
        math.prod(splits),
        math.prod(leaf_mesh.axis_sizes),
        block,
    )
    if problem is None:
        tally.placed[(spec, shape)] = found
    return found, problem


def _add(tally: _Tally, path: KeyPath, spec: Any, leaf: Any) -> None:
    """`leaf`'s row, and its bytes on the devices that hold it."""
    shape = tuple(map(int, leaf.shape))
    itemsize, dtype_name = _dtype(tally, leaf, spec)
    nbytes = math.prod(shape) * itemsize
    name = path_str(path)
    if spec is None:
        tally.rows.append(ShardingRow(name, shape, dtype_name, None, nbytes, 0, 1, 0))
        return
    if is_single_device(spec):
        (device,) = spec.device_set
        if tally.index is not None and device.id in tally.index:
            tally.per_device[tally.index[device.id]] += nbytes
        tally.rows.append(
            ShardingRow(
                name, shape, dtype_name, None, nbytes, nbytes, 1, 1, single_device=True
            )
        )
        return
    memory_kind = (
        spec.memory_kind
        if isinstance(spec, NamedSharding)
        else HOST_MEMORY
        if isinstance(spec, Host)
        else None
    )
    found, problem = _placement(tally, path, spec, leaf, shape)
    if problem is not None:
        tally.problems.append(problem)
    held = found.piece * itemsize
    if tally.padded:
        held = tpu_padded_bytes(found.block, itemsize)
    if isinstance(found.devices, slice):
        tally.every += held
    else:
        tally.per_device[found.devices] += held
    tally.rows.append(
        ShardingRow(
            name,
            shape,
            dtype_name,
            found.asked,
            nbytes,
            held,
            found.shards,
            found.holders,
            problem is None,
            memory_kind=memory_kind,
        )
    )


def analyze_pairs(
    leaves: Sequence[Any],
    pairs: Sequence[tuple[KeyPath, Any]],
    mesh: Mesh | AbstractMesh | None,
    *,
    caller: str,
    on_invalid: str = "ignore",
) -> ShardingReport:
    """The report for `leaves`, with one `(path, spec)` pair each: a
    `PartitionSpec`, a `NamedSharding`, a `SingleDeviceSharding` or `None`."""
    mesh = require_mesh(mesh, caller=caller, shardings=(s for _, s in pairs))
    index = (
        {device.id: i for i, device in enumerate(mesh.devices.flat)}
        if isinstance(mesh, Mesh)
        else None
    )
    per_device = np.zeros(math.prod(mesh.axis_sizes), dtype=np.int64)
    tally = _Tally(mesh, index, per_device, padded=pads_to_tiles(mesh))
    for (path, spec), leaf in zip(pairs, leaves, strict=True):
        if is_array(leaf):
            _add(tally, path, spec, leaf)
    per_device += tally.every
    problems, rows = tally.problems, tally.rows
    if problems and on_invalid == "raise":
        raise ValueError(spec_error_message(caller, problems))
    if problems and on_invalid == "warn":
        warn(spec_error_message(caller, problems, corrected=True))
    return ShardingReport(
        mesh=mesh,
        rows=tuple(rows),
        problems=tuple(problems),
        bytes_per_device=tuple(per_device.tolist()),
        total_parameters=sum(row.size for row in rows),
        sharded_parameters=sum(row.size for row in rows if row.sharded),
        total_bytes=sum(row.nbytes for row in rows),
        replicated_bytes=sum(row.nbytes for row in rows if row.replicated),
        unplaced_bytes=sum(
            row.nbytes for row in rows if not row.placed and not row.single_device
        ),
        single_device_bytes=sum(row.nbytes for row in rows if row.single_device),
    )
