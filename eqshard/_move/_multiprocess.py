"""What `shard` and `gather` do when a mesh spans several processes.

In a multi-process JAX run every process runs the same program, and an array whose
devices belong to several processes is *global*: each process holds only the
shards on its own devices. This module moves data between host memory and global
arrays, for [`eqshard.shard`][], [`eqshard.gather`][] and
[`eqshard.t5x.Partitioner.move_to_devices`][]:

- **Full copies to global arrays.** Every process holds the whole array (say a
  checkpoint every host loaded), and copies only the shards its own devices hold.
- **Host-local blocks to global arrays.** Every process holds only the block its
  own devices hold (its part of the batch: t5x's "host-local" arrays). The global
  shape follows from the block's shape and the mesh, and the block must be one
  contiguous slice of the global array.
- **Global arrays to a full host copy on every process.** One `jax.device_put`
  lays the array out again over the same devices, whole on each process and
  split across that process's devices, then each process copies its shards to
  host. A device holds 1/(devices of its process) of the array on the way, where
  `multihost_utils.process_allgather` replicates the whole array onto every
  device first. Arrays that every process already holds whole need no
  communication at all.
- **Agreement.** All processes must pass the same tree. A 16-byte digest per
  call, which each process posts to the distributed client's key-value store and
  reads the others' from (no XLA program, which took 30-40 ms to build on the
  first call), compares the paths, shapes, dtypes and shardings, and a sample of
  the values that must be equal (or, on request, a hash of every byte). Only
  when digests differ, an all-gather of the full descriptions lets every process
  raise the same error, naming the leaves that differ, instead of some raising
  and the others waiting forever in a collective.
- **Waiting for the others.** Before a collective that gathers arrays, every
  process meets the others at a barrier of the distributed client, with a
  timeout: a process that gathers alone raises, naming the arrays, instead of
  waiting forever. Checkpoints meet the same way, and every process also posts
  whether it failed (through the client's key-value store), so that all of them
  raise together instead of some going on to a collective alone.
"""

import functools as ft
import hashlib
import itertools
import json
import math
import typing
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .._caches import register
from .._internals import distributed
from .._spectree._check_spec import axes_repr, entry_axes
from .._tree import paths_text
from .._typing import KeyPath
from ._process_blocks import (
    blocks_by_process,
    not_one_slice,
    slice_order,
    why_no_order,
)


# ---------------------------------------------------------------------------------
# Host data to global arrays.
# ---------------------------------------------------------------------------------


def is_global(x: Any) -> bool:
    """Whether `x` is an array spread over several processes (anything else is
    host data, JAX arrays on this process's devices included)."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def from_host_copies(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a full copy of `value` that every process holds: each
    process copies only the shards its own devices hold (none, if the mesh has none
    of its devices; the dtype is then given, as JAX cannot read it from a shard)."""
    return jax.make_array_from_callback(
        value.shape, sharding, lambda index: value[index], dtype=value.dtype
    )


def from_host_local(value: Any, sharding: NamedSharding) -> jax.Array:
    """A global array from the block of it that this process holds (already
    validated by `host_local_shape`)."""
    value = np.asarray(value)
    # Data is placed only on concrete meshes (`shard` rejects abstract ones).
    mesh = typing.cast(Mesh, sharding.mesh)
    shape, _, _ = host_local_shape(value.shape, sharding.spec, mesh)
    return jax.make_array_from_process_local_data(sharding, value, shape)


def host_local_shape(
    local_shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh
) -> tuple[tuple[int, ...], list[str], PartitionSpec]:
    """The global shape of an array that each process holds a block of.

    Along a dimension split over mesh axes whose devices fall into `k` groups of
    processes, each process's block is `1/k` of it. Returns the global shape, the
    reasons `spec` cannot take host-local blocks (some process's devices hold
    several separate slices of a dimension), and a spec that could (the same
    dimensions, their axes in an order that makes one slice, where one does)."""
    global_shape = list(local_shape)
    reasons = []
    fixed: list[Any] = list(spec)
    for dim, entry in enumerate(list(spec)[: len(local_shape)]):
        axes = tuple(a for a in entry_axes(entry) if a in mesh.shape)
        if not axes:
            continue  # unknown axes are reported by `check_spec`
        problem = not_one_slice(mesh, axes)
        if problem is None:
            held = len(blocks_by_process(mesh, axes)[0][1])
            global_shape[dim] = (
                local_shape[dim] * math.prod(mesh.shape[a] for a in axes) // held
            )
            continue
        order = slice_order(mesh, axes)
        reasons.append(
            f"dimension {dim} is split over {axes_repr(axes)} so that {problem}, "
            "so no host-local block can hold them"
            + (
                ""
                if order
                else f"; no order of the axes does: {why_no_order(mesh, axes)}"
            )
        )
        if order is not None:
            fixed[dim] = order
    return tuple(global_shape), reasons, PartitionSpec(*fixed)


def is_whole_block(shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> bool:
    """Whether a host-local block of `shape` is the whole array: `spec` does not
    split it across processes (and can take host-local blocks at all)."""
    try:
        full, reasons, _ = host_local_shape(shape, spec, mesh)
    except (TypeError, ValueError):  # a malformed spec, reported by `check_spec`
        return False
    return not reasons and full == shape


# ---------------------------------------------------------------------------------
# Global arrays to host.
# ---------------------------------------------------------------------------------


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[Any, ...]:
    # Slices are unhashable before Python 3.12; `indices` also normalises them.
    return tuple(s.indices(n) for s, n in zip(index, shape, strict=True))


@ft.lru_cache(maxsize=4096)
def _every_process_holds_all(sharding: Any, shape: tuple[int, ...]) -> bool:
    """Whether the devices of every process hold the whole array between them.
    Computed from the whole sharding, so every process gets the same answer."""
    held: dict[int, set[tuple[Any, ...]]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        held.setdefault(device.process_index, set()).add(_index_key(index, shape))
    everything = set().union(*held.values())
    return all(blocks == everything for blocks in held.values())


register(_every_process_holds_all.cache_clear)


@ft.lru_cache(maxsize=4096)
def _process_local_sharding(sharding: Any, shape: tuple[int, ...]) -> NamedSharding:
    """A sharding over the devices of `sharding` that gives every process the whole
    array, split across that process's own devices.

    The local devices are spread over the dimensions greedily, each dimension
    taking the largest factor of the remaining device count that divides it;
    devices left over hold replicas. Processes with unequal numbers of devices
    get a copy on every device."""
    devices = sorted(sharding.device_set, key=lambda d: (d.process_index, d.id))
    processes = len({d.process_index for d in devices})
    local = len(devices) // processes
    if local * processes != len(devices) or any(
        d.process_index != devices[i // local * local].process_index
        for i, d in enumerate(devices)
    ):
        mesh = Mesh(np.array(devices, dtype=object), ("all",), (AxisType.Auto,))
        return NamedSharding(mesh, PartitionSpec())
    left, splits = local, []
    for size in shape:
        split = math.gcd(left, size)  # all of `left` for a dimension of size 0
        splits.append(split)
        left //= split
    names = ["processes"] + [f"local{d}" for d, s in enumerate(splits) if s > 1]
    sizes = [processes] + [s for s in splits if s > 1] + [left]
    grid = np.array(devices, dtype=object).reshape(sizes)
    mesh = Mesh(grid, (*names, "replicas"), (AxisType.Auto,) * len(sizes))
    spec = [f"local{d}" if s > 1 else None for d, s in enumerate(splits)]
    return NamedSharding(mesh, PartitionSpec(*spec))


register(_process_local_sharding.cache_clear)


def needs_collective(x: Any) -> bool:
    """Whether copying `x` to host takes the other processes: it is spread over
    several processes and not every one of them holds all of it. The same answer
    on every process."""
    return is_global(x) and not _every_process_holds_all(x.sharding, tuple(x.shape))


def host_value(array: jax.Array) -> np.ndarray:
    """The full value of an array spread over several processes, on this host.

    Every process whose devices the array uses must call this for the same array
    at the same point: unless every process already holds the whole array, this
    is a collective."""
    shape = tuple(array.shape)
    out = np.empty(shape, array.dtype)
    if out.size == 0:
        return out
    if needs_collective(array):
        array = jax.device_put(array, _process_local_sharding(array.sharding, shape))
    copied = set()
    for shard in array.addressable_shards:
        key = _index_key(shard.index, shape)
        if key not in copied:
            copied.add(key)
            out[shard.index] = np.asarray(shard.data)
    return out


# Per-process count of barriers met with each set of processes: every process of
# the set makes the same calls in the same order, so the ids agree across them.
_barriers: dict[tuple[int, ...], itertools.count] = {}
# The key this process last posted its status under, per set of processes (by
# `meet` or `post_status`): removed once the next meeting or exchange of the set
# shows that every process has read it.
_posted: dict[tuple[int, ...], str] = {}


def check_timeout(caller: str, timeout: float | int) -> None:
    """Raises unless `timeout` is a number of seconds > 0."""
    if not timeout > 0:
        raise ValueError(
            f"eqshard.{caller}: timeout must be a number of seconds > 0, got "
            f"{timeout!r}."
        )


def meet(
    caller: str,
    processes: tuple[int, ...],
    timeout: float | int,
    *,
    cannot: str,
    rule: str,
    status: str | None = None,
) -> dict[int, str]:
    """Meets the other `processes` at a barrier of the distributed client, and
    raises a `ValueError` if they do not all arrive within `timeout` seconds (a
    process that makes a collective call alone would otherwise wait forever):
    `cannot` says what then cannot happen, `rule` who must make the call.

    With a `status`, every process also posts its own to the client's key-value
    store before the barrier, and gets everyone's after it: `{process: status}`.
    Nothing happens without a distributed client, or with one process (`{}`)."""
    if distributed.client() is None or len(processes) < 2:
        return {}
    count = next(_barriers.setdefault(processes, itertools.count()))
    barrier = f"eqshard.{caller}:{','.join(map(str, processes))}:{count}"
    others = None if processes == tuple(range(jax.process_count())) else processes
    if status is not None:
        distributed.post(f"{barrier}/{jax.process_index()}", status)
    try:
        distributed.barrier(barrier, timeout, others)
    except jax.errors.JaxRuntimeError as e:
        raise _not_all_came(
            caller, processes, timeout, e, cannot=cannot, rule=rule
        ) from e
    if status is None:
        return {}
    found = {
        int(key.rsplit("/", 1)[1]): value
        for key, value in distributed.read_under(f"{barrier}/")
    }
    # Every process has passed this barrier, so has read the previous statuses.
    _replace_posted(processes, f"{barrier}/{jax.process_index()}")
    return found


def post_status(
    caller: str,
    processes: tuple[int, ...],
    timeout: float | int,
    *,
    cannot: str,
    rule: str,
    status: str,
) -> Callable[[], dict[int, str]]:
    """Every process of `processes` posts its `status` to the distributed client's
    key-value store and reads everyone's, like `meet` with a status but without
    its barrier, in two steps: posts `status` now, and returns the function that
    reads everyone's, `{process: status}`, waiting for each other process's (in
    between, this process can do work of its own while the others arrive). It
    raises the same `ValueError` as `meet` if they do not all post within
    `timeout` seconds (a process that comes after one gave up raises too).
    Nothing happens without a distributed client, or with one process (`{}`)."""
    if distributed.client() is None or len(processes) < 2:
        return dict
    count = next(_barriers.setdefault(processes, itertools.count()))
    prefix = f"eqshard.{caller}:{','.join(map(str, processes))}:{count}"
    me = jax.process_index()
    distributed.post(f"{prefix}/{me}", status)

    def read() -> dict[int, str]:
        found = {me: status}
        try:
            for p in processes:
                if p != me:
                    found[p] = distributed.read(f"{prefix}/{p}", timeout)
        except jax.errors.JaxRuntimeError as e:
            # Withdrawn, so that a process that comes later waits in vain and
            # raises too, instead of going on alone.
            distributed.delete(f"{prefix}/{me}")
            raise _not_all_came(
                caller, processes, timeout, e, cannot=cannot, rule=rule
            ) from e
        # Every other process posted its status after reading the previous ones.
        _replace_posted(processes, f"{prefix}/{me}")
        return found

    return read


def _replace_posted(processes: tuple[int, ...], key: str) -> None:
    """Removes the key this process posted last with `processes` (every one of
    them has read it), and remembers `key` instead."""
    previous = _posted.get(processes)
    if previous is not None:
        distributed.delete(previous)
    _posted[processes] = key


def _not_all_came(
    caller: str,
    processes: tuple[int, ...],
    timeout: float | int,
    error: Exception,
    *,
    cannot: str,
    rule: str,
) -> ValueError:
    """The error when `processes` did not all reach a meeting within `timeout`
    seconds (`error`: what the distributed client raised)."""
    said = str(error).strip().splitlines()[0]
    return ValueError(
        f"eqshard.{caller}: on process {jax.process_index()}, processes "
        f"{list(processes)} did not all make this call within {timeout:g} s, so "
        f"{cannot} (all of them take part). {rule}; if the others are only "
        f"slow, raise `timeout=`. The distributed client said: {said}"
    )


def wait_for_processes(
    caller: str, found: list[tuple[KeyPath, jax.Array]], timeout: float | int
) -> None:
    """Meets the other processes of the arrays in `found` before they are gathered
    together (`meet`), naming the arrays if they do not all arrive in time."""
    if not found:
        return
    processes = tuple(
        sorted({d.process_index for _, x in found for d in x.sharding.device_set})
    )
    names = paths_text([path for path, _ in found])
    meet(
        caller,
        processes,
        timeout,
        cannot=f"the arrays at {names} cannot be gathered",
        rule="Every process whose devices hold a shard of these arrays must make "
        "the same call at the same point (e.g. gather on every process, then save "
        "on process 0 only)",
    )


def fail_together(
    caller: str,
    failure: Exception | None,
    timeout: float | int,
    *,
    cannot: str,
    rule: str,
    rows: list[tuple[str, Any, Any]] | None = None,
) -> None:
    """Raises on every process of the run if any of them failed (`failure`, on
    that process) or passed other `rows` (`(name, shape, dtype)` of each array),
    so that none goes on to a collective the others never join: a process raises
    its own error, the others one that quotes it. One `meet` of all processes (two
    if the rows differ: the second names the arrays); with a single process, only
    raises `failure`."""
    processes = tuple(range(jax.process_count()))
    message = None if failure is None else str(failure) or type(failure).__name__
    table = json.dumps(rows or [], default=str)
    digest = hashlib.blake2b(table.encode(), digest_size=16).hexdigest()
    statuses = meet(
        caller,
        processes,
        timeout,
        cannot=cannot,
        rule=rule,
        status=json.dumps([message, digest]),
    )
    if failure is not None:
        raise failure
    views = {p: json.loads(status) for p, status in sorted(statuses.items())}
    for p, (said, _) in views.items():
        if said is not None:
            said = said.removeprefix(f"eqshard.{caller}: ")
            raise ValueError(
                f"eqshard.{caller}: process {p} failed, so {cannot} on any "
                f"process. It said: {said}"
            )
    if len({d for _, d in views.values()}) < 2:
        return
    tables = meet(caller, processes, timeout, cannot=cannot, rule=rule, status=table)
    raise _different_trees(caller, tables, cannot=cannot, rule=rule)


def _different_trees(
    caller: str, tables: dict[int, str], *, cannot: str, rule: str
) -> ValueError:
    """The error of `fail_together` when the processes passed different rows
    (`tables`: each process's, in JSON), naming the arrays that differ."""
    by_name = [
        {name: f"shape {tuple(shape)} {dtype}" for name, shape, dtype in json.loads(t)}
        for _, t in sorted(tables.items())
    ]
    names = list(dict.fromkeys(n for table in by_name for n in table))
    lines = [
        f"  - '{name}': "
        + by_process([t.get(name, "absent") for t in by_name], sorted(tables))
        for name in names
        if len({t.get(name) for t in by_name}) > 1
    ]
    if len(lines) > MAX_LINES:
        lines[MAX_LINES:] = [f"  ... and {len(lines) - MAX_LINES} more."]
    head = f"eqshard.{caller}: the processes passed different trees, so {cannot}:"
    return ValueError("\n".join([head, *lines, f"{rule}, with the same tree."]))


def by_process(values: list[Any], processes: list[int]) -> str:
    """Which processes gave each of the distinct `values` (one per process)."""
    groups: dict[str, list[int]] = {}
    for value, p in zip(values, processes, strict=True):
        groups.setdefault(str(value), []).append(p)
    return "; ".join(
        f"{value} on process{'es' if len(ps) > 1 else ''} {', '.join(map(str, ps))}"
        for value, ps in groups.items()
    )


# Lines of differences quoted in one message, at most.
MAX_LINES = 10
