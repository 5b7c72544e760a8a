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
import jax.tree_util as jtu
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._caches import register
from .._keys import is_key, key_data
from .._mesh import find_mesh, mesh_repr
from .._spectree._specs import axes_repr, entry_axes, is_spec_leaf, leaf_specs
from .._tree import is_array, path_str, paths_text
from .._typing import CheckValues, KeyPath
from ._process_blocks import (
    blocks_by_process,
    not_one_slice,
    slice_order,
    spanning_axes,
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


def _is_whole_block(shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> bool:
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


def _distributed_client() -> Any:
    """The client of `jax.distributed.initialize`, or `None`.

    JAX 0.10 has no public accessor for it. This reads the one attribute
    `jax.experimental.multihost_utils` itself uses (`distributed.global_state.client`),
    through that public module rather than `jax._src`, and gives `None` if a
    later JAX moves it (the barrier is then skipped, as without a client)."""
    state = getattr(getattr(multihost_utils, "distributed", None), "global_state", None)
    return getattr(state, "client", None)


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
    client = _distributed_client()
    if client is None or len(processes) < 2:
        return {}
    count = next(_barriers.setdefault(processes, itertools.count()))
    barrier = f"eqshard.{caller}:{','.join(map(str, processes))}:{count}"
    others = None if processes == tuple(range(jax.process_count())) else processes
    if status is not None:
        client.key_value_set(f"{barrier}/{jax.process_index()}", status)
    try:
        client.wait_at_barrier(
            barrier, timeout_in_ms=max(1, math.ceil(timeout * 1000)), process_ids=others
        )
    except jax.errors.JaxRuntimeError as e:
        raise _not_all_came(
            caller, processes, timeout, e, cannot=cannot, rule=rule
        ) from e
    if status is None:
        return {}
    found = {
        int(key.rsplit("/", 1)[1]): value
        for key, value in client.key_value_dir_get(f"{barrier}/")
    }
    # Every process has passed this barrier, so has read the previous statuses.
    _replace_posted(client, processes, f"{barrier}/{jax.process_index()}")
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
    client = _distributed_client()
    if client is None or len(processes) < 2:
        return dict
    count = next(_barriers.setdefault(processes, itertools.count()))
    prefix = f"eqshard.{caller}:{','.join(map(str, processes))}:{count}"
    me = jax.process_index()
    client.key_value_set(f"{prefix}/{me}", status)

    def read() -> dict[int, str]:
        found = {me: status}
        try:
            for p in processes:
                if p != me:
                    found[p] = client.blocking_key_value_get(
                        f"{prefix}/{p}", max(1, math.ceil(timeout * 1000))
                    )
        except jax.errors.JaxRuntimeError as e:
            # Withdrawn, so that a process that comes later waits in vain and
            # raises too, instead of going on alone.
            client.key_value_delete(f"{prefix}/{me}")
            raise _not_all_came(
                caller, processes, timeout, e, cannot=cannot, rule=rule
            ) from e
        # Every other process posted its status after reading the previous ones.
        _replace_posted(client, processes, f"{prefix}/{me}")
        return found

    return read


def _replace_posted(client: Any, processes: tuple[int, ...], key: str) -> None:
    """Removes the key this process posted last with `processes` (every one of
    them has read it), and remembers `key` instead."""
    previous = _posted.get(processes)
    if previous is not None:
        client.key_value_delete(previous)
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
    by_name = [
        {name: f"shape {tuple(shape)} {dtype}" for name, shape, dtype in json.loads(t)}
        for _, t in sorted(tables.items())
    ]
    names = list(dict.fromkeys(n for table in by_name for n in table))
    lines = [
        f"  - '{name}': "
        + _by_process([t.get(name, "absent") for t in by_name], sorted(tables))
        for name in names
        if len({t.get(name) for t in by_name}) > 1
    ]
    if len(lines) > _MAX_LINES:
        lines[_MAX_LINES:] = [f"  ... and {len(lines) - _MAX_LINES} more."]
    raise ValueError(
        "\n".join(
            [
                f"eqshard.{caller}: the processes passed different trees, so {cannot}:",
                *lines,
                f"{rule}, with the same tree.",
            ]
        )
    )


# ---------------------------------------------------------------------------------
# All processes must pass the same tree.
# ---------------------------------------------------------------------------------


def start_agreement(
    caller: str,
    tree: PyTree,
    specs: PyTree,
    mesh: Mesh | AbstractMesh | None,
    *,
    root: KeyPath,
    host_local: bool,
    check_values: CheckValues = "sample",
    timeout: float | int = 300.0,
) -> Callable[[], None]:
    """Checks that every process of the call's meshes passed the same paths,
    shapes, dtypes and specs, and equal values where the values must be equal
    (every full copy; with `host_local`, every block that is the whole array): a
    sample of 64 of them, or with `check_values="full"` a hash of every byte.
    Nothing here depends on whether the specs fit, which each process checks
    afterwards: processes that agree then fail, or not, together.

    In two steps: posts this process's digest now (a meeting of the processes of
    the meshes, `post_status`, if there are several), and returns the function that
    finishes the check (reads the others' digests and raises the same
    `ValueError` on every process if they differ, or if the others do not post
    theirs within `timeout` seconds; `agreed_alone` if there is no other
    process). In between, a process may do work that involves no
    other process, such as placing full copies or host-local blocks (not laying
    out a global array again: a collective), and so not wait for the others
    idle; it must then finish the check before it raises what that work raised,
    so that every process raises the same error when the trees differ."""
    mesh = find_mesh(mesh)
    meshes = _meshes(specs, mesh)
    devices = _leaders(tuple(meshes))
    if not devices:
        return agreed_alone
    path_leaves = jtu.tree_flatten_with_path(tree)[0]
    try:
        spec_of = [spec for _, spec in leaf_specs(specs, tree, caller=caller)]
    except (TypeError, ValueError):  # raised again, on every process, afterwards
        spec_of = [None] * len(path_leaves)
    records = [
        _record(root + path, leaf, spec, mesh, host_local, check_values)
        for (path, leaf), spec in zip(path_leaves, spec_of, strict=True)
        if is_array(leaf)
    ]
    header = [caller, host_local, [_describe_mesh(m) for m in meshes]]
    payload = json.dumps([header, records]).encode()
    digest = hashlib.blake2b(payload, digest_size=16).hexdigest()
    read = post_status(
        caller,
        tuple(device.process_index for device in devices),
        timeout,
        cannot="they cannot compare their trees",
        rule="Every process of the mesh must make the same call at the same point",
        status=digest,
    )

    def finish() -> None:
        digests = read()
        if not digests:  # no distributed client: one XLA all-gather instead
            row = np.frombuffer(bytes.fromhex(digest), np.uint8)
            rows = _allgather_rows(row, devices)
            digests = dict(enumerate(row.tobytes().hex() for row in rows))
        if len(set(digests.values())) == 1:
            return
        views = [json.loads(view) for view in _allgather_bytes(payload, devices)]
        processes = [device.process_index for device in devices]
        spanning = tuple(dict.fromkeys(a for m in meshes for a in spanning_axes(m)))
        raise ValueError(
            _disagreement_message(
                caller, views, processes, host_local, spanning, check_values
            )
        )

    return finish


def agreed_alone() -> None:
    """The end of the check of a process with no other to agree with."""


def _meshes(specs: PyTree, mesh: Mesh | AbstractMesh | None) -> list[Mesh]:
    """The concrete meshes a `shard` call may place arrays on."""
    found = {}
    if isinstance(mesh, Mesh):
        found[mesh] = None
    for leaf in jtu.tree_leaves(specs, is_leaf=is_spec_leaf):
        if isinstance(leaf, NamedSharding) and isinstance(leaf.mesh, Mesh):
            found[leaf.mesh] = None
    return list(found)


@ft.lru_cache(maxsize=64)
def _describe_mesh(mesh: Mesh) -> str:
    ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(mesh.devices)
    return f"{mesh_repr(mesh)} over devices {ids.tolist()}"


register(_describe_mesh.cache_clear)


def _record(
    path: KeyPath,
    leaf: Any,
    spec: Any,
    mesh: Mesh | AbstractMesh | None,
    host_local: bool,
    check_values: CheckValues,
) -> tuple[str, tuple[int, ...], str, str, str]:
    """What all processes must agree on for one array: its path, shape, dtype and
    spec, and a fingerprint of its values if they must be equal everywhere."""
    if isinstance(spec, NamedSharding):
        spec, mesh = spec.spec, spec.mesh
    shape = tuple(np.shape(leaf))
    same = isinstance(spec, PartitionSpec) and not is_global(leaf)
    if same and host_local:
        same = isinstance(mesh, Mesh) and _is_whole_block(shape, spec, mesh)
    return (
        path_str(path),
        shape,
        str(leaf.dtype),
        "" if spec is None else str(spec),
        _fingerprint(
            key_data(leaf) if is_key(leaf) else leaf, full=check_values == "full"
        )
        if same
        else "",
    )


# Elements sampled from each array to compare values across processes.
_SAMPLE = 64


@ft.lru_cache(maxsize=1024)
def _sample_index(shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    flat = np.unique(np.linspace(0, math.prod(shape) - 1, _SAMPLE).astype(np.int64))
    return np.unravel_index(flat, shape)


register(_sample_index.cache_clear)


def _fingerprint(value: Any, *, full: bool) -> str:
    """A hash of a sample of the values of a host array (of all of them if it is
    small, or if `full`): equal on processes that hold equal arrays. The sample
    is cheap; `full` reads every byte once (no copy of a contiguous array)."""
    value = np.asarray(value)
    if value.size > _SAMPLE and not full:
        value = value[_sample_index(value.shape)]
    data = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    return hashlib.blake2b(data.data, digest_size=8).hexdigest()


@ft.lru_cache(maxsize=64)
def _leaders(meshes: tuple[Mesh, ...]) -> tuple[Any, ...]:
    """One device of each process of `meshes` (its lowest id), by process index;
    empty unless this process is one of several."""
    first: dict[int, Any] = {}
    for mesh in meshes:
        for device in np.asarray(mesh.devices).flat:
            p = device.process_index
            if p not in first or device.id < first[p].id:
                first[p] = device
    if len(first) < 2 or jax.process_index() not in first:
        return ()
    return tuple(first[p] for p in sorted(first))


register(_leaders.cache_clear)


def _allgather_rows(row: np.ndarray, devices: tuple[Any, ...]) -> np.ndarray:
    """Every process's `row` (of one length everywhere), stacked in process order.
    `devices` has one device of each process."""
    mesh = Mesh(np.array(devices, dtype=object), ("processes",), (AxisType.Auto,))
    stacked = jax.make_array_from_callback(
        (len(devices), row.size),
        NamedSharding(mesh, PartitionSpec("processes")),
        lambda index: row[None],
    )
    return host_value(stacked)


def _allgather_bytes(payload: bytes, devices: tuple[Any, ...]) -> list[bytes]:
    """Every process's `payload`, in process order."""
    length = np.array([len(payload)], dtype="<u4").view(np.uint8)
    lengths = _allgather_rows(length, devices).view("<u4")[:, 0]
    # Rounded up to a power of two, so few shapes (and compilations) occur.
    row = np.zeros(1 << max(int(lengths.max()) - 1, 63).bit_length(), np.uint8)
    row[: len(payload)] = np.frombuffer(payload, np.uint8)
    rows = _allgather_rows(row, devices)
    return [rows[i, :n].tobytes() for i, n in enumerate(lengths)]


def _by_process(values: list[Any], processes: list[int]) -> str:
    groups: dict[str, list[int]] = {}
    for value, p in zip(values, processes, strict=True):
        groups.setdefault(str(value), []).append(p)
    return "; ".join(
        f"{value} on process{'es' if len(ps) > 1 else ''} {', '.join(map(str, ps))}"
        for value, ps in groups.items()
    )


_MAX_LINES = 10


def _disagreement_message(
    caller: str,
    views: list[Any],
    processes: list[int],
    host_local: bool,
    spanning: tuple[str, ...],
    check_values: CheckValues,
) -> str:
    """The message when processes passed different trees: each view is one
    process's `[header, records]`, as JSON data."""
    lines = []
    kinds = set()
    how = "full" if check_values == "full" else "sample"
    headers = [view[0] for view in views]
    if any(h != headers[0] for h in headers):
        kinds.add("tree")
        lines.append(f"  - the meshes: {_by_process(headers, processes)}")
    records = [view[1] for view in views]
    paths = [[r[0] for r in rs] for rs in records]
    if any(p != paths[0] for p in paths):
        kinds.add("tree")
        i = next(
            i
            for i in range(max(map(len, paths)))
            if len({tuple(p[i : i + 1]) for p in paths}) > 1
        )
        named = [f"'{p[i]}'" if i < len(p) else "no more arrays" for p in paths]
        lines.append(
            f"  - the trees differ at array {i}: {_by_process(named, processes)}"
        )
    else:
        for rows in zip(*records):
            path = rows[0][0]
            for field, kind, describe in (
                (slice(1, 3), "tree", lambda r: f"shape {tuple(r[1])} {r[2]}"),
                (slice(3, 4), "tree", lambda r: f"spec {r[3] or None}"),
                (slice(4, 5), "values", lambda r: f"values with {how} hash {r[4]}"),
            ):
                if any(r[field] != rows[0][field] for r in rows):
                    kinds.add(kind)
                    described = [describe(r) for r in rows]
                    lines.append(f"  - '{path}': {_by_process(described, processes)}")
                    break
    if len(lines) > _MAX_LINES:
        lines[_MAX_LINES:] = [f"  ... and {len(lines) - _MAX_LINES} more."]
    head = f"eqshard.{caller}: the processes passed different inputs:"
    fixes = []
    if "tree" in kinds:
        fixes.append(
            "Every process must make this call with the same tree: the same "
            "paths, shapes, dtypes and specs, on the same mesh"
            + (
                " (with host-local blocks, every process's block has the same shape)."
                if host_local
                else "."
            )
        )
    if "values" in kinds and host_local:
        fixes.append(
            "The specs of the arrays whose values differ do not split them across "
            "processes, so every process's devices hold all of them and every "
            "process must pass the same value. To give each process its own part, "
            "shard a dimension over a mesh axis that spans processes ("
            + (", ".join(map(repr, spanning)) or "this mesh has none")
            + ")."
        )
    elif "values" in kinds:
        fixes.append(
            "eqshard.shard takes a full copy of every array on every process, so "
            "the copies must be equal (compared on "
            + (
                "every byte). "
                if check_values == "full"
                else "a sample of the values; `check_values='full'` compares "
                "every byte). "
            )
            + "If "
            "each process holds only its own part, e.g. of the batch, use "
            "`Partitioner.move_to_devices(tree, specs, host_local=True)`; if the "
            "copies should be equal, make them so (e.g. initialise from the same "
            "key on every process)."
        )
    return "\n".join([head, *lines, *fixes])
