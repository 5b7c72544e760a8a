"""What [`eqshard.shard`][] would move, said before anything moves.

`shard_plan` validates the tree and specs as `shard` does (`_leaves.py`), then
reads, for each distinct array to place, the route it takes (`none`, `device to
device`, `through the host`, `from the host`), the bytes each device of the new
mesh receives, and the batches `shard` makes under `max_inflight_bytes`
(`_reshard.py`, the same functions). From the blocks each device holds now it
follows the devices' holdings through those batches: the peak is the largest
any device reaches, its part of the old state included.
"""

import collections
import dataclasses
import typing
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jaxtyping import PyTree

from .._mesh._current import concrete_mesh, mesh_repr
from .._report import format_bytes, Report, text_table
from .._spectree._resolve import resolve_specs
from .._tree import grouped_paths, path_str
from .._typing import typecheck
from ._leaves import Leaf, leaves_of
from ._multiprocess import is_global
from ._reshard import (
    batches,
    block_bytes,
    check_inflight,
    check_max_inflight,
    check_traced,
    devices_of,
    itemsize,
    move_size,
    stays,
)
from ._resident import route as resident_route


RouteName = Literal["none", "device to device", "through the host", "from the host"]
_HOST_KINDS = ("pinned_host", "unpinned_host")


@dataclasses.dataclass(frozen=True)
class ShardPlanRow:
    """One leaf of a [`eqshard.ShardPlan`][]: its path, shape and dtype, where it
    is (`source`: its spec, or `"host"` for NumPy data) and where it goes
    (`target`), the `route`, and `bytes_moved`, the bytes the devices of the new
    mesh receive for it (all of them together; 0 for a leaf that stays, and
    for a leaf that stands where an earlier one with the same array does)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    source: str
    target: str
    route: RouteName
    bytes_moved: int


@dataclasses.dataclass(frozen=True, repr=False)
class ShardPlan(Report):
    """What [`eqshard.shard`][] would move, from [`eqshard.shard_plan`][].

    - `mesh`: the new mesh; `sources`, the meshes the arrays are on now (as
      `{axis: size}` text, `device k` for an array on one device).
    - `rows`: one [`ShardPlanRow`][eqshard.ShardPlanRow] per array leaf, in tree
      order.
    - `bytes_per_device`: what each device of the new mesh receives, one int per
      device in `mesh.devices.flat` order.
    - `max_inflight_bytes`, `donate`: the options the plan is for.
    - `batches`: how many batches `shard` moves the arrays in.
    - `peak_bytes_per_device`: the most each device of the new mesh holds during
      the move (its part of the old state included), in the same order;
      `peak_bytes`, the largest of them.
    - `outside`: the paths of the arrays some block of which only devices
      outside the new mesh hold now (`from_live` is `True` when there are none:
      after losing devices, a state whose every block still has a copy on the
      devices that remain moves from the live state; else restore it from the
      last checkpoint).
    - `seconds`: the expected time of the move; `None` (not estimated: it needs
      measured link speeds of the target).
    """

    mesh: Mesh
    sources: tuple[str, ...]
    rows: tuple[ShardPlanRow, ...]
    bytes_per_device: tuple[int, ...]
    max_inflight_bytes: int | None
    donate: bool
    batches: int
    peak_bytes_per_device: tuple[int, ...]
    peak_bytes: int
    outside: tuple[str, ...] = ()
    seconds: float | None = None

    @property
    def from_live(self) -> bool:
        """Whether the devices of the new mesh hold a copy of every block now."""
        return not self.outside

    @property
    def moves(self) -> bool:
        """Whether anything moves at all."""
        return any(row.route != "none" for row in self.rows)

    @property
    def bytes_moved(self) -> int:
        return sum(row.bytes_moved for row in self.rows)

    def table(self) -> str:
        now = ", ".join(self.sources) or "host"
        head = (
            f"shard_plan from {now} onto mesh {mesh_repr(self.mesh)} "
            f"({self.mesh.size} devices)"
        )
        if not self.moves:
            return f"{head}: nothing moves ({len(self.rows)} arrays in place)."
        paths = [row.path for row in self.rows]
        keys = [(r.route, r.source, r.target, r.shape) for r in self.rows]
        lines = [head + ":"]
        body = []
        for group in grouped_paths(paths, keys):
            rows = [self.rows[i] for i in group.members()]
            row = rows[0]
            moved = sum(r.bytes_moved for r in rows)
            body.append(
                (
                    group.name(paths),
                    str(row.shape),
                    row.source,
                    row.target,
                    row.route,
                    format_bytes(moved) if moved else "-",
                )
            )
        header = ("path", "shape", "from", "to", "route", "moved")
        right = (False, True, False, False, False, True)
        lines += ["  " + line for line in text_table(header, body, right)]
        per_device = sorted(set(self.bytes_per_device))
        received = " to ".join(
            format_bytes(n) for n in per_device[:: max(1, len(per_device) - 1)]
        )
        bound = (
            "no bound"
            if self.max_inflight_bytes is None
            else f"at most {format_bytes(self.max_inflight_bytes)} a device at once"
        )
        if self.outside:
            lines.append(
                f"not held by the new mesh's devices: {len(self.outside)} arrays "
                f"(first '{self.outside[0]}'): restore them from a checkpoint if "
                "the other devices are lost."
            )
        lines += [
            f"moved: {format_bytes(self.bytes_moved)} in all; each device receives "
            f"{received}; {self.batches} batch(es), {bound}.",
            f"expected peak: {format_bytes(self.peak_bytes)} on one device "
            f"({'donating' if self.donate else 'keeping'} the old arrays).",
            "time: not estimated (needs measured link speeds of the target mesh).",
        ]
        return "\n".join(lines)

    def _summary(self) -> dict[str, Any]:
        return {
            "arrays": len(self.rows),
            "moving": sum(row.route != "none" for row in self.rows),
            "bytes_moved": self.bytes_moved,
            "peak_bytes": self.peak_bytes,
        }


def _spec_text(value: Any) -> str:
    """Where `value` is now: its spec (`host` after it for host memory), the
    device it is on, or `host` for NumPy data."""
    if not isinstance(value, jax.Array):
        return "host"
    sharding = value.sharding
    if isinstance(sharding, NamedSharding):
        return _target_text(sharding)
    devices = sorted(d.id for d in sharding.device_set)
    return f"device {devices[0]}" if len(devices) == 1 else f"devices {devices}"


def _target_text(sharding: NamedSharding) -> str:
    host = sharding.memory_kind in _HOST_KINDS
    return str(sharding.spec) + (" host" if host else "")


def _route(leaf: Leaf) -> RouteName:
    sharding = typing.cast(NamedSharding, leaf.sharding)
    value = leaf.value
    if stays(value, sharding, leaf.cast):
        return "none"
    if not isinstance(value, jax.Array):
        return "from the host"
    kinds = (value.sharding.memory_kind, sharding.memory_kind)
    if resident_route(value, sharding, leaf.cast) == "host" or any(
        k in _HOST_KINDS for k in kinds
    ):
        return "through the host"
    if is_global(value) and value.sharding.device_set != sharding.device_set:
        return "through the host"
    return "device to device"


def _held(values: list[Any]) -> list[dict[Any, int]]:
    """For each distinct JAX array of `values`, the bytes of its block on each
    device that holds one (device memory only)."""
    out = []
    for value in values:
        held: dict[Any, int] = {}
        if (
            isinstance(value, jax.Array)
            and value.sharding.memory_kind not in _HOST_KINDS
        ):
            shape = value.sharding.shard_shape(value.shape)
            n = int(np.prod(shape)) * itemsize(value, None)
            held = {d: n for d in value.sharding.device_set}
        out.append(held)
    return out


def _sources(leaves: list[Leaf]) -> tuple[str, ...]:
    """The meshes (or single devices) the arrays of `leaves` are on now."""
    found: dict[str, None] = {}
    for leaf in leaves:
        value = leaf.value
        if not isinstance(value, jax.Array):
            continue
        sharding = value.sharding
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            devices = [d.id for d in sharding.mesh.devices.flat]
            found[f"mesh {mesh_repr(sharding.mesh)} of devices {devices}"] = None
        else:
            found[_spec_text(value)] = None
    return tuple(found)


def _outside(leaves: list[Leaf], mesh: Mesh) -> tuple[str, ...]:
    """The paths of the JAX arrays of `leaves` some block of which no device of
    `mesh` holds."""
    kept = set(mesh.devices.flat)
    out = []
    for leaf in leaves:
        value = leaf.value
        if not isinstance(value, jax.Array):
            continue
        holders: dict[Any, bool] = {}
        for device, index in value.sharding.devices_indices_map(value.shape).items():
            key = tuple(sl.indices(n)[:2] for sl, n in zip(index, value.shape))
            holders[key] = holders.get(key, False) or device in kept
        if not all(holders.values()):
            out.append(path_str(leaf.path))
    return tuple(out)


def _distinct(leaves: list[Leaf]) -> list[Leaf]:
    """The first leaf of each distinct `(array, sharding, cast)` to place, in
    tree order: what `shard` moves once (tied arrays)."""
    seen: dict[tuple[int, Any, Any], Leaf] = {}
    for leaf in leaves:
        if leaf.sharding is not None:
            seen.setdefault((id(leaf.value), leaf.sharding, leaf.cast), leaf)
    return list(seen.values())


def _peaks(
    leaves: list[Leaf],
    moves: list[Leaf],
    groups: list[list[int]],
    donate: bool,
    mesh: Mesh,
) -> tuple[int, ...]:
    """The most each device of `mesh` holds while `moves` are placed in `groups`:
    the tree's arrays now, each batch's new blocks (in device memory) on top, and
    with `donate` each old array gone once its moves are placed, as `shard`
    frees them (`_reshard.release`)."""
    arrays = {id(x.value): x.value for x in leaves if isinstance(x.value, jax.Array)}
    held = dict(zip(arrays, _held(list(arrays.values())), strict=True))
    load: collections.Counter[Any] = collections.Counter()
    for blocks in held.values():
        load.update(blocks)
    peak = collections.Counter(load)
    left = collections.Counter(id(m.value) for m in moves)
    kept = {id(x.value) for x in leaves if x.sharding is None}
    for group in groups:
        for i in group:
            sharding = typing.cast(NamedSharding, moves[i].sharding)
            devices, n = move_size(moves[i])
            if sharding.memory_kind not in _HOST_KINDS:
                load.update({d: n for d in devices})
        for d, n in load.items():
            peak[d] = max(peak[d], n)
        if not donate:
            continue
        for i in group:
            key = id(moves[i].value)
            left[key] -= 1
            if not left[key] and key not in kept and key in held:
                if move_size(moves[i])[1]:  # an array that stays is not freed
                    load.subtract(held[key])
    return tuple(peak[d] for d in mesh.devices.flat)


@typecheck
def shard_plan(
    tree: PyTree,
    specs: PyTree,
    mesh: Mesh | AbstractMesh | None = None,
    *,
    max_inflight_bytes: int | None = None,
    donate: bool = False,
) -> ShardPlan:
    """Says what [`eqshard.shard`][] would move, moving nothing.

    The tree and specs are checked as `shard` checks them (the same errors), and
    each array gets its route: `none` (already laid out as asked), `device to
    device`, `through the host` (host memory kinds; arrays of several processes
    going to other devices) or `from the host` (NumPy data). The plan also
    counts the bytes each device of the new mesh receives, the batches `shard`
    makes under `max_inflight_bytes`, and the peak each device reaches, its
    part of the old state included (with `donate`, the old arrays freed batch
    by batch, as `shard` frees them). The time of the move is not estimated.

    **Arguments:**

    - `tree`, `specs`, `mesh`: as for [`eqshard.shard`][].
    - `max_inflight_bytes`, `donate`: the options of the `shard` call to plan.

    **Returns:**

    A [`ShardPlan`][eqshard.ShardPlan]: `str(plan)` is a table of the leaves
    (an optimizer state's rows grouped with their parameter's), `plan.moves`
    says whether anything moves, `plan.bytes_per_device` what each device of
    `mesh` receives, `plan.peak_bytes` the expected peak.

    **Raises:**

    What [`eqshard.shard`][] raises for the same tree, specs and bound (a
    missing mesh axis, a dimension that does not divide, a deleted array, a
    bound smaller than one device's block), naming the paths.

    !!! Example

        ```python
        plan = eqshard.shard_plan(state, specs, new_mesh, max_inflight_bytes=2**26)
        print(plan)  # the leaves that move, their routes, the expected peak
        state = eqshard.shard(state, specs, new_mesh, donate=True,
                              max_inflight_bytes=2**26)
        ```
    """
    caller = "shard_plan"
    check_traced(caller, tree)
    check_max_inflight(caller, max_inflight_bytes)
    specs = resolve_specs(specs, tree, caller=caller, mesh=mesh)
    leaves, _ = leaves_of(
        tree, specs, mesh, dtype=None, caller=caller, root=(), host_local=False
    )
    moves = _distinct(leaves)
    sizes = [move_size(m) for m in moves]
    check_inflight(
        caller,
        [(m.path, n) for m, (_, n) in zip(moves, sizes, strict=True)],
        max_inflight_bytes,
    )
    groups = batches(sizes, max_inflight_bytes)
    mesh = concrete_mesh(mesh, caller=caller)
    order = {d: k for k, d in enumerate(mesh.devices.flat)}
    received = [0] * mesh.size
    first = {id(m): m for m in moves}
    rows = []
    for leaf in leaves:
        if leaf.sharding is None:
            continue
        route = _route(leaf)
        moved = 0
        if route != "none" and id(leaf) in first:
            n = block_bytes(leaf.value, leaf.sharding, leaf.cast)
            for d in devices_of(leaf.sharding):
                moved += n
                if d in order:
                    received[order[d]] += n
        rows.append(
            ShardPlanRow(
                path_str(leaf.path),
                tuple(int(n) for n in np.shape(leaf.value)),
                str(getattr(leaf.value, "dtype", "")),
                _spec_text(leaf.value),
                _target_text(leaf.sharding),
                route,
                moved,
            )
        )
    peaks = _peaks(leaves, moves, groups, donate, mesh)
    return ShardPlan(
        mesh,
        _sources(leaves),
        tuple(rows),
        tuple(received),
        max_inflight_bytes,
        donate,
        len([g for g in groups if g]),
        peaks,
        max(peaks, default=0),
        _outside(leaves, mesh),
    )
