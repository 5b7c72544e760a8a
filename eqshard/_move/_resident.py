"""JAX arrays already on devices, moved to other shardings without a compile per shape.

`jax.device_put` moves a `jax.Array` onto a sharding whose blocks its buffers do not
already hold by compiling a program for each distinct shape: a slicing program when
the array is whole on one device, a resharding `jit` when it is on the same devices
in another order, and `astype` (for `dtype=`) compiles a cast per shape too. For a
model of 60 distinct shapes made on device 0, that was 7 s of compiling on this
project's CPU before training could start (`benchmarks/bench_device_resident.py`).
`shard` moves such arrays (those whose sharding or dtype must change) together, by
the route that is cheapest on their backend:

- **Block by block, on CPU.** A CPU device's memory is host memory, and XLA's
  CPU client takes an aligned NumPy buffer as a device buffer without copying.
  So each block of the target is copied once, straight from the parts of the
  source's device buffers it overlaps, into an aligned buffer, which becomes
  that device's buffer (`move_blocks`): one memory copy of the data in all, and
  no compilation. An array's large blocks are carved from one allocation
  backed by huge pages (`cpu.aligned_blocks`): a buffer per block faulted on
  every 4 KiB page, most of the time of a move (`benchmarks/bench_reshard.py`).
  (A host round trip by hand, `device_get` then `device_put`, copies as much
  on CPU, from one thread.) Even one program for the whole tree costs far more
  there: XLA's CPU compiler took 4 s to build the 60-array resharding identity.
  The arrays are copied on every core at once (`_threads.py`, which gives the
  figures).
  A cast (`dtype=`) is made in the same copy, and what it loses is counted per
  block, so a lossy cast raises as it does for NumPy data.
- **Through the host, for host memory kinds.** The arrays are copied to NumPy
  and placed as NumPy data (`_shard.py`'s path for host arrays, with its checks:
  casts that overflow are refused, nothing aliased).
- **In one program, on GPU and TPU.** There a round trip crosses the host link
  twice, while device-to-device copies run over NVLink or ICI, and a single
  compilation is amortised over the whole tree. Arrays already spread over the
  target's devices, in the same order, go through one `jax.jit` identity with
  `out_shardings` (casts included); arrays whole on one device are cut into their
  blocks by one jitted program on that device, and the blocks are copied to their
  devices (a copy between devices compiles nothing). Arrays spread over other
  devices, and targets in host memory kinds, take the host route.

Each program also counts, for the arrays it casts, the finite values that became
inf or nan, so a lossy `dtype=` cast raises as it does for NumPy data. Arrays of
several processes (not fully addressable) and typed PRNG keys are left to
`jax.device_put`, as before.
"""

import functools as ft
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from .._caches import register
from .._internals import cpu
from .._keys import is_key
from .._tree import placed_dtype
from ._host import cast_lost, Lost, more_lost, overflow_bound, saturates
from ._threads import in_cpu_memory, movable, native, spread, SPREAD_UNIT


Route = Literal["blocks", "host", "program"]


@ft.lru_cache(maxsize=1024)
def _on_cpu_or_host_memory(sharding: Any) -> bool:
    return sharding.memory_kind not in (None, "device") or any(
        device.platform == "cpu" for device in sharding.device_set
    )


register(_on_cpu_or_host_memory.cache_clear)


def _device_order(sharding: Any) -> tuple[Any, ...] | None:
    """The devices of a `NamedSharding` in the order `jit` requires them, or `None`
    for other shardings (whose order is not public)."""
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
        return tuple(sharding.mesh.devices.flat)
    return None


def route(leaf: Any, sharding: NamedSharding, cast: np.dtype | None) -> Route | None:
    """How `leaf` reaches `sharding` (cast to `cast`): `None` if `jax.device_put`
    moves it without compiling (NumPy data, an array already laid out as asked,
    arrays of several processes, PRNG keys), else the route of the docstring."""
    if not isinstance(leaf, jax.Array) or is_key(leaf):
        return None
    return _route(leaf.sharding, sharding, leaf.ndim, cast, jax.process_count())


@ft.lru_cache(maxsize=4096)
def _route(
    source: Any,
    sharding: NamedSharding,
    ndim: int,
    cast: np.dtype | None,
    processes: int,
) -> Route | None:
    """`route` for a JAX array on `source` of rank `ndim`, once per pair of
    shardings: a model's arrays share a few."""
    if not source.is_fully_addressable or processes > 1:
        return None
    if cast is None and source.is_equivalent_to(sharding, ndim):
        return None
    if in_cpu_memory(source) and in_cpu_memory(sharding):
        return "blocks"
    if _on_cpu_or_host_memory(source) or _on_cpu_or_host_memory(sharding):
        return "host"
    one_device = len(source.device_set) == 1
    same_order = _device_order(source) == _device_order(sharding)
    return "program" if one_device or same_order else "host"


register(_route.cache_clear)


def _cast_checked(
    x: jax.Array, cast: np.dtype | None
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """`x` cast to `cast`, and (for a cast) how many finite values became inf or
    nan, or overflowed a type without either, with the largest of them in
    magnitude."""
    if cast is None:
        return x, None
    y = x.astype(cast)
    bound = overflow_bound(cast)  # past it, a type without inf saturates
    bad = ~jnp.isfinite(y) | (jnp.abs(x) > bound)
    # inf and nan stay so, where the type has them; else they are lost too
    bad = (bad | ~jnp.isfinite(x)) if saturates(cast) else (bad & jnp.isfinite(x))
    finite_bad = bad & ~jnp.isnan(x)
    largest = jnp.max(jnp.where(finite_bad, jnp.abs(x), 0), initial=0)
    largest = largest.astype(jnp.float32)
    return y, (jnp.sum(bad), largest)


@ft.lru_cache(maxsize=64)
def _reshard_program(
    shardings: tuple[NamedSharding, ...], casts: tuple[np.dtype | None, ...]
) -> Any:
    """One `jit` that lays every array out on its sharding, cast as asked."""
    replicated = NamedSharding(shardings[0].mesh, jax.sharding.PartitionSpec())

    def reshard(arrays: list[jax.Array]) -> tuple[list[jax.Array], list[Any]]:
        out = [_cast_checked(x, c) for x, c in zip(arrays, casts, strict=True)]
        return [y for y, _ in out], [loss for _, loss in out]

    losses = [None if c is None else (replicated, replicated) for c in casts]
    return jax.jit(reshard, out_shardings=(list(shardings), losses))


register(_reshard_program.cache_clear)


Blocks = tuple[tuple[tuple[int, int], ...], ...]  # per block: (start, stop) per dim


@ft.lru_cache(maxsize=64)
def _slice_program(blocks: tuple[Blocks, ...], casts: tuple[np.dtype | None, ...]):
    """One `jit`, run on the device that holds the arrays, that cuts every array
    into its distinct blocks (cast as asked)."""

    def cut(arrays: list[jax.Array]) -> tuple[list[list[jax.Array]], list[Any]]:
        out, losses = [], []
        for x, cast, indices in zip(arrays, casts, blocks, strict=True):
            y, loss = _cast_checked(x, cast)
            out.append([y[tuple(slice(a, b) for a, b in index)] for index in indices])
            losses.append(loss)
        return out, losses

    return jax.jit(cut)


register(_slice_program.cache_clear)


def _block_key(index: Any, shape: tuple[int, ...]) -> Any:
    """A block's index (a tuple of slices) as hashable `(start, stop)` pairs."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _from_one_device(
    arrays: Sequence[jax.Array],
    shardings: Sequence[NamedSharding],
    casts: Sequence[np.dtype | None],
) -> tuple[list[jax.Array], list[Any]]:
    """Arrays whole on one device (the same one), each placed on its sharding: one
    program cuts out all the blocks, which are then copied to their devices."""
    maps = [
        s.addressable_devices_indices_map(x.shape)
        for x, s in zip(arrays, shardings, strict=True)
    ]
    keys = [
        [_block_key(index, x.shape) for index in m.values()]
        for x, m in zip(arrays, maps, strict=True)
    ]
    distinct = tuple(tuple(dict.fromkeys(k)) for k in keys)
    pieces, losses = _slice_program(distinct, tuple(casts))(list(arrays))
    wanted, devices = [], []
    for m, k, blocks, distinct_k in zip(maps, keys, pieces, distinct, strict=True):
        position = {key: j for j, key in enumerate(distinct_k)}
        for device, key in zip(m, k, strict=True):
            wanted.append(blocks[position[key]])
            devices.append(device)
    copied = iter(jax.device_put(wanted, devices))
    out = []
    for x, s, m, cast in zip(arrays, shardings, maps, casts, strict=True):
        shards = [next(copied) for _ in m]
        shape, dtype = x.shape, x.dtype if cast is None else cast
        out.append(
            jax.make_array_from_single_device_arrays(
                shape, s, shards, dtype=jnp.dtype(dtype)
            )
        )
    return out, losses


# How each distinct block of the target is made: the `_index_key`s of its index
# on the devices that hold it, its shape, and the parts of the source's blocks it
# is copied from, `(k, source slices, target slices)`, `k` being the source
# block's position in `array.addressable_data(k)`.
_Copies = tuple[tuple[int, tuple[slice, ...], tuple[slice, ...]], ...]
_BlockPlan = tuple[tuple[Any, tuple[int, ...], _Copies], ...]


@ft.lru_cache(maxsize=4096)
def _block_plan(source: Any, target: Any, shape: tuple[int, ...]) -> _BlockPlan:
    """For each distinct block of `target` for an array of `shape`, where in the
    distinct blocks of `source` its parts are."""
    # Each block is read from a device of the target where one holds it (so that
    # a move onto the devices that remain reads none of the others).
    sources: dict[Any, int] = {}
    on_target: set[Any] = set()
    staying = target.device_set
    held = source.addressable_devices_indices_map(shape)
    for k, (device, index) in enumerate(held.items()):
        key = _block_key(index, shape)
        if key not in sources or (device in staying and key not in on_target):
            sources[key] = k
            if device in staying:
                on_target.add(key)
    keys: dict[Any, list[Any]] = {}  # bounds -> the `_index_key`s of the block
    for index in target.addressable_devices_indices_map(shape).values():
        keys.setdefault(_block_key(index, shape), []).append(_index_key(index))
    plan = []
    for block, raw in keys.items():
        copies = []
        for bounds, k in sources.items():
            low = [max(a, c) for (a, _), (c, _) in zip(block, bounds, strict=True)]
            high = [min(b, d) for (_, b), (_, d) in zip(block, bounds, strict=True)]
            if any(lo >= hi for lo, hi in zip(low, high, strict=True)):
                continue
            copies.append(
                (
                    k,
                    tuple(
                        slice(lo - c, hi - c)
                        for lo, hi, (c, _) in zip(low, high, bounds, strict=True)
                    ),
                    tuple(
                        slice(lo - a, hi - a)
                        for lo, hi, (a, _) in zip(low, high, block, strict=True)
                    ),
                )
            )
        plan.append((tuple(raw), tuple(b - a for a, b in block), tuple(copies)))
    return tuple(plan)


register(_block_plan.cache_clear)


def _index_key(index: Any) -> tuple[Any, ...]:
    """A block's index as `addressable_devices_indices_map` gives it, hashable."""
    return tuple((s.start, s.stop, s.step) for s in index)


def _blocks(
    x: jax.Array, plan: _BlockPlan, dtype: np.dtype
) -> tuple[dict[Any, np.ndarray], Lost | None]:
    """The blocks of the target for `x` in `dtype`, by `_index_key` of their
    index: a strided view of the source's device buffer where one source block
    holds the block and nothing is cast (which `device_put` copies, as it cannot
    take it in place), else a copy, cast as it is made, in an aligned block of
    an array's one allocation (which it takes in place). Also what the cast
    lost."""
    views: dict[int, np.ndarray] = {}
    planned = []  # (keys, shape, parts, the view taken as it is or None)
    for raw, shape, copies in plan:
        parts = []
        for k, source, target in copies:
            view = views.get(k)
            if view is None:  # the device buffer itself, not a copy
                view = views[k] = cpu.device_buffer(x, k)
            parts.append((view[source], target))
        whole = parts[0][0] if len(parts) == 1 else None
        if whole is not None and dtype == x.dtype and not whole.flags.c_contiguous:
            planned.append((raw, shape, parts, whole))
        else:
            planned.append((raw, shape, parts, None))
    fresh = iter(cpu.aligned_blocks([s for _, s, _, v in planned if v is None], dtype))
    out: dict[Any, np.ndarray] = {}
    lost = None
    for raw, _, parts, value in planned:
        if value is None:
            value = next(fresh)
            for part, target in parts:
                with np.errstate(over="ignore", invalid="ignore"):  # `cast_lost`
                    value[target] = part
                if dtype != x.dtype:  # the distinct blocks do not overlap
                    lost = more_lost(lost, cast_lost(part, value[target]))
        for key in raw:
            out[key] = value
    return out, lost


def _whole_and_strided(x: jax.Array, sharding: NamedSharding) -> np.ndarray | None:
    """`x`'s device buffer, if one holds all of `x` and every block of `sharding`
    is a strided view of it (which `device_put` copies, as it cannot take it in
    place): then `device_put` of the buffer itself copies each block once, as
    `_blocks` would, on its own faster path. Else `None`."""
    if not x.sharding.is_fully_replicated:
        return None
    whole = cpu.device_buffer(x, 0)  # the buffer itself, not a copy
    return None if cpu.has_dense_block(whole, sharding) else whole


def _move_some(
    arrays: Sequence[jax.Array],
    shardings: Sequence[NamedSharding],
    dtypes: Sequence[np.dtype],
    wholes: Sequence[np.ndarray | None],
) -> list[tuple[jax.Array, Lost | None]]:
    """`move_blocks` of some of its arrays, on one thread: each placed in its
    dtype, from its `_whole_and_strided` buffer where it has one, with what the
    cast lost."""
    out: list[Any] = [None] * len(arrays)
    strided: list[int] = []
    for i, (x, sharding, dtype, whole) in enumerate(
        zip(arrays, shardings, dtypes, wholes, strict=True)
    ):
        if whole is not None:
            strided.append(i)
            continue
        shape = tuple(x.shape)
        blocks, lost = _blocks(x, _block_plan(x.sharding, sharding, shape), dtype)
        placed = jax.make_array_from_callback(
            shape,
            sharding,
            lambda index, blocks=blocks: blocks[_index_key(index)],
            dtype=dtype,
        )
        out[i] = (placed, lost)
    placed = jax.device_put(
        [wholes[i] for i in strided], [shardings[i] for i in strided]
    )
    for i, array in zip(strided, placed, strict=True):
        out[i] = (array, None)
    return out


def move_blocks(
    arrays: Sequence[jax.Array],
    shardings: Sequence[NamedSharding],
    casts: Sequence[np.dtype | None],
) -> tuple[list[jax.Array], list[tuple[int, Lost]]]:
    """The arrays of the `"blocks"` route (on CPU devices), each placed on its
    sharding and cast, every block of the target copied once from the source's
    device buffers (see `_blocks` and `_whole_and_strided`). Also returns
    `(position, lost)` for each cast that lost values.

    The arrays are spread over the cores (`_threads.py`) where that pays: those
    `device_put` cuts from a whole buffer (it copies without the GIL), and those
    whose blocks are `SPREAD_UNIT` or larger on average. Smaller blocks, copied
    by NumPy with Python work per block that holds the GIL, and casts to or
    from ml_dtypes' types (whose NumPy loops hold it), stay on this thread: on
    two threads, the arrays of `bench_device_resident.py` moved from a permuted
    mesh more slowly."""
    dtypes = [
        np.dtype(x.dtype) if cast is None else placed_dtype(np.dtype(cast))
        for x, cast in zip(arrays, casts, strict=True)
    ]
    wholes = [
        _whole_and_strided(x, s) if dtype == x.dtype else None
        for x, s, dtype in zip(arrays, shardings, dtypes, strict=True)
    ]
    pinned = [
        not movable(dtype)
        or (dtype != x.dtype and not native(dtype, x.dtype))
        or (
            whole is None
            and x.nbytes < SPREAD_UNIT * len(_block_plan(x.sharding, s, x.shape))
        )
        for x, s, dtype, whole in zip(arrays, shardings, dtypes, wholes, strict=True)
    ]
    moved = spread(
        lambda indices: _move_some(
            [arrays[i] for i in indices],
            [shardings[i] for i in indices],
            [dtypes[i] for i in indices],
            [wholes[i] for i in indices],
        ),
        [x.nbytes for x in arrays],
        pinned=pinned,
    )
    losses = [(i, lost) for i, (_, lost) in enumerate(moved) if lost is not None]
    return [array for array, _ in moved], losses


def move_in_programs(
    arrays: Sequence[jax.Array],
    shardings: Sequence[NamedSharding],
    casts: Sequence[np.dtype | None],
) -> tuple[list[jax.Array], list[tuple[int, Lost]]]:
    """The arrays of the `"program"` route, placed on their shardings and cast:
    one program per group of arrays on the same devices (in practice, one). Also
    returns `(position, lost)` for each cast that turned finite values into inf or
    nan, as `move_blocks` does."""
    groups: dict[Any, list[int]] = {}
    for k, (x, s) in enumerate(zip(arrays, shardings, strict=True)):
        if len(x.sharding.device_set) == 1:
            key = ("device", next(iter(x.sharding.device_set)))
        else:
            key = ("mesh", _device_order(s))
        groups.setdefault(key, []).append(k)
    out: list[Any] = [None] * len(arrays)
    found: list[tuple[int, Any]] = []
    for (kind, _), members in groups.items():
        xs = [arrays[k] for k in members]
        ss = [shardings[k] for k in members]
        cs = [casts[k] for k in members]
        if kind == "device":
            placed, losses = _from_one_device(xs, ss, cs)
        else:
            placed, losses = _reshard_program(tuple(ss), tuple(cs))(xs)
        for k, array, loss in zip(members, placed, losses, strict=True):
            out[k] = array
            if loss is not None:
                found.append((k, loss))
    counts = jax.device_get([loss for _, loss in found])
    lost = [
        (k, Lost(np.dtype(casts[k]), int(count), float(largest)))
        for (k, _), (count, largest) in zip(found, counts, strict=True)
        if count
    ]
    return out, lost
