"""All processes of a `shard` call must pass the same tree.

A 16-byte digest per call, which each process posts to the distributed client's
key-value store and reads the others' from (`_multiprocess.post_status`; no XLA
program, which took 30-40 ms to build on the first call), compares the paths,
shapes, dtypes and shardings, and a sample of the values that must be equal (or,
on request, a hash of every byte): one `_Record` per array. Only when digests
differ, an all-gather of the full descriptions lets every process raise the same
error, naming the leaves that differ, instead of some raising and the others
waiting forever in a collective.
"""

import dataclasses
import functools as ft
import hashlib
import json
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._caches import register
from .._keys import is_key, key_data
from .._mesh._current import find_mesh, mesh_repr
from .._spectree._check_spec import is_spec_leaf, leaf_specs
from .._tree import is_array, path_str
from .._typing import CheckValues, KeyPath
from ._multiprocess import (
    by_process,
    host_value,
    is_global,
    is_whole_block,
    MAX_LINES,
    post_status,
)
from ._process_blocks import spanning_axes


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
    header = [caller, host_local, [_describe_mesh(m) for m in meshes]]
    rows = _records(tree, specs, mesh, caller, root, host_local, check_values)
    payload = json.dumps([header, rows]).encode()
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


def _records(
    tree: PyTree,
    specs: PyTree,
    mesh: Mesh | AbstractMesh | None,
    caller: str,
    root: KeyPath,
    host_local: bool,
    check_values: CheckValues,
) -> list[list[Any]]:
    """This process's `_Record` of each array of `tree`, as JSON data."""
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
    return [r.row() for r in records]


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


@dataclasses.dataclass(frozen=True)
class _Record:
    """What all processes must agree on for one array, as each posts it (in JSON,
    as a list of the fields in this order)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str  # "" for no spec
    values: str  # a fingerprint of its values, "" where they may differ

    def row(self) -> list[Any]:
        """As JSON data."""
        return [self.path, list(self.shape), self.dtype, self.spec, self.values]

    @classmethod
    def from_row(cls, row: list[Any]) -> "_Record":
        """From `row`'s JSON data."""
        path, shape, dtype, spec, values = row
        return cls(path, tuple(shape), dtype, spec, values)


def _record(
    path: KeyPath,
    leaf: Any,
    spec: Any,
    mesh: Mesh | AbstractMesh | None,
    host_local: bool,
    check_values: CheckValues,
) -> _Record:
    """What all processes must agree on for one array: its path, shape, dtype and
    spec, and a fingerprint of its values if they must be equal everywhere."""
    if isinstance(spec, NamedSharding):
        spec, mesh = spec.spec, spec.mesh
    shape = tuple(np.shape(leaf))
    same = isinstance(spec, PartitionSpec) and not is_global(leaf)
    if same and host_local:
        same = isinstance(mesh, Mesh) and is_whole_block(shape, spec, mesh)
    values = ""
    if same:
        data = key_data(leaf) if is_key(leaf) else leaf
        values = _fingerprint(data, full=check_values == "full")
    return _Record(
        path_str(path),
        shape,
        str(leaf.dtype),
        "" if spec is None else str(spec),
        values,
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
    headers = [view[0] for view in views]
    records = [[_Record.from_row(row) for row in view[1]] for view in views]
    lines, kinds = _differences(records, processes, check_values)
    if any(h != headers[0] for h in headers):
        kinds.add("tree")
        lines.insert(0, f"  - the meshes: {by_process(headers, processes)}")
    if len(lines) > MAX_LINES:
        lines[MAX_LINES:] = [f"  ... and {len(lines) - MAX_LINES} more."]
    head = f"eqshard.{caller}: the processes passed different inputs:"
    fixes = _fixes(kinds, host_local, spanning, check_values)
    return "\n".join([head, *lines, *fixes])


def _differences(
    records: list[list[_Record]], processes: list[int], check_values: CheckValues
) -> tuple[list[str], set[str]]:
    """One line per difference between the processes' records (where their paths
    differ, the first such array only), and the kinds of difference: `"tree"`
    or `"values"`."""
    paths = [[r.path for r in rs] for rs in records]
    if any(p != paths[0] for p in paths):
        i = next(
            i
            for i in range(max(map(len, paths)))
            if len({tuple(p[i : i + 1]) for p in paths}) > 1
        )
        named = [f"'{p[i]}'" if i < len(p) else "no more arrays" for p in paths]
        line = f"  - the trees differ at array {i}: {by_process(named, processes)}"
        return [line], {"tree"}
    how = "full" if check_values == "full" else "sample"
    checks = (
        ("tree", lambda r: (r.shape, r.dtype), "shape {shape} {r.dtype}"),
        ("tree", lambda r: r.spec, "spec {spec}"),
        ("values", lambda r: r.values, f"values with {how} hash {{r.values}}"),
    )
    lines, kinds = [], set()
    for rows in zip(*records):
        for kind, field, text in checks:
            if any(field(r) != field(rows[0]) for r in rows):
                kinds.add(kind)
                described = [
                    text.format(r=r, shape=r.shape, spec=r.spec or None) for r in rows
                ]
                lines.append(
                    f"  - '{rows[0].path}': {by_process(described, processes)}"
                )
                break
    return lines, kinds


def _fixes(
    kinds: set[str],
    host_local: bool,
    spanning: tuple[str, ...],
    check_values: CheckValues,
) -> list[str]:
    """How to fix the `kinds` of difference that `_differences` found."""
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
    return fixes
