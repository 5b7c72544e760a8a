"""Host copies spread over the machine's cores.

On CPU devices a device's memory is host memory, so placing NumPy data
(`jax.device_put`), cutting device-resident arrays into the blocks of another
sharding (`_resident.py`) and gathering blocks into one NumPy array (`_gather.py`)
are memory copies, made with the GIL released. Into freshly allocated memory a
copy costs about as much in page faults as in copying, and both run on every
core at once (`benchmarks/bench_device_resident.py` and `bench_host.py` measure
these copies):

- a tree's arrays spread over the cores' threads move faster than from one
  thread, and gathering a large array over them beats `jax.device_get`;
- NumPy arrays whose blocks are dense gain nothing: XLA's CPU client copies
  them on threads of its own, faster than one thread copies here;
- nor does placing one array's blocks from several threads (slower than one
  `device_put`); gathering them does.
- a private copy of one large NumPy array (`shard`'s staging) gains a little:
  `copy` splits it into row ranges, one a core.

So those paths give their copies to `spread`: one bin of arrays per core, of
about equal bytes, each bin copied by one thread, the first by the calling
thread, the others by a pool of `cores - 1` threads that this process keeps
once it has spread a copy (JAX's first `device_put` on a new thread takes
longer, to fill caches of its own). Below 4 MiB in all, handing work to a
thread costs more than it saves, and everything stays on the calling thread.

JAX's configuration contexts belong to the thread that entered them
(`jax.enable_x64`, `jax.transfer_guard`), and a thread started here sees the
global values. So arrays of the dtypes that `jax_enable_x64` narrows are copied
on the calling thread, and under a transfer guard nothing is spread.
"""

import functools as ft
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar

import jax
import numpy as np

from .._caches import register
from .._internals import cpu


T = TypeVar("T")

# Below this many bytes in all, one thread copies everything: handing work to
# another costs more than it saves. So does an array (or block) smaller than
# `SPREAD_UNIT`, whose copy takes less time than JAX's Python work to place it
# (~50 us, holding the GIL): it stays on the calling thread.
SPREAD_FROM = 4 << 20
SPREAD_UNIT = 256 << 10

# Dtypes that `jax_enable_x64`, per thread, decides JAX narrows.
_X64 = frozenset(
    np.dtype(name) for name in ("int64", "uint64", "float64", "complex128")
)


@ft.lru_cache(maxsize=1024)
def in_cpu_memory(sharding: Any) -> bool:
    """Whether `sharding` is on CPU devices only, in their default memory."""
    return sharding.memory_kind in (None, "device") and all(
        device.platform == "cpu" for device in sharding.device_set
    )


register(in_cpu_memory.cache_clear)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


_POOL_LOCK = threading.Lock()
_POOL: list[ThreadPoolExecutor] = []  # this process's copying threads, if started


def _pool() -> ThreadPoolExecutor:
    """This process's copying threads, started when first needed."""
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(
                ThreadPoolExecutor(_cores() - 1, thread_name_prefix="eqshard-copy")
            )
        return _POOL[0]


def _guarded() -> bool:
    """Whether a transfer guard other than "allow" holds on this thread."""
    return any(
        getattr(jax.config, f"jax_transfer_guard{kind}") not in (None, "allow")
        for kind in ("", "_host_to_device", "_device_to_host", "_device_to_device")
    )


def split_above(total: int) -> int:
    """The bytes above which `gather` copies an array's blocks as units of their
    own, of `total` bytes to copy in all: more than one core's share, which no
    bin of whole arrays could balance (one large leaf, an embedding beside small
    layers, or a tree gathered one leaf at a time)."""
    return total // _cores()


def movable(dtype: Any) -> bool:
    """Whether arrays of `dtype` may be copied on another thread: JAX places them
    the same whatever that thread's `jax_enable_x64`."""
    return np.dtype(dtype) not in _X64


def native(*dtypes: Any) -> bool:
    """Whether NumPy defines all `dtypes` itself: its loops for the others
    (ml_dtypes' bfloat16, float8, int4) hold the GIL, so casts between them gain
    nothing from threads."""
    return all(np.dtype(dtype).isbuiltin == 1 for dtype in dtypes)


def _bins(weights: Sequence[int], pinned: Sequence[bool]) -> list[list[int]]:
    """The indices of `weights` in bins of about equal weight, one per core (the
    heaviest first into the lightest bin); the pinned ones, and those lighter
    than `SPREAD_UNIT`, in the first. A single bin where spreading would not
    pay."""
    free = [i for i, w in enumerate(weights) if not pinned[i] and w >= SPREAD_UNIT]
    stay = sorted(set(range(len(weights))).difference(free))
    count = min(_cores(), len(free) + bool(stay))
    if count < 2 or sum(weights[i] for i in free) < SPREAD_FROM or _guarded():
        return [list(range(len(weights)))]
    bins: list[list[int]] = [stay] + [[] for _ in range(count - 1)]
    load = [sum(weights[i] for i in stay)] + [0] * (count - 1)
    for i in sorted(free, key=lambda i: -weights[i]):
        k = min(range(count), key=load.__getitem__)
        bins[k].append(i)
        load[k] += weights[i]
    return [sorted(b) for b in bins if b]


def spread(
    work: Callable[[list[int]], list[T]],
    weights: Sequence[int],
    *,
    pinned: Sequence[bool],
) -> list[T]:
    """`work(indices)` over bins of `range(len(weights))`, one thread per bin (the
    first on the calling thread), as the module docstring says; `pinned` indices
    run on the calling thread. Returns the results in index order once every bin
    is done, or raises the first error a bin raised."""
    bins = _bins(weights, pinned)
    futures = [_pool().submit(work, b) for b in bins[1:]]
    try:
        results = [work(bins[0])]
    finally:
        wait(futures)
    results += [future.result() for future in futures]  # raises what one raised
    out: list[Any] = [None] * len(weights)
    for indices, values in zip(bins, results, strict=True):
        for i, value in zip(indices, values, strict=True):
            out[i] = value
    return out


def copy(out: np.ndarray, source: np.ndarray) -> None:
    """`np.copyto(out, source)` for arrays of one shape and dtype, in row ranges
    over the cores where it moves `SPREAD_FROM` bytes or more: one thread does
    not fill the memory's bandwidth, and a private copy is most of `shard`'s
    time for a replicated array (`benchmarks/bench_shard_host.py`)."""
    rows = len(out) if out.ndim else 0
    parts = min(_cores(), rows)
    if out.nbytes < SPREAD_FROM or parts < 2 or not native(out.dtype):
        np.copyto(out, source)
        return
    bounds = [rows * i // parts for i in range(parts + 1)]
    futures = [
        _pool().submit(np.copyto, out[a:b], source[a:b])
        for a, b in zip(bounds[1:-1], bounds[2:], strict=True)
    ]
    try:
        np.copyto(out[: bounds[1]], source[: bounds[1]])
    finally:
        wait(futures)
    for future in futures:
        future.result()  # raises what a thread raised


def device_put(values: Sequence[Any], shardings: Sequence[Any]) -> list[jax.Array]:
    """`jax.device_put(values, shardings)`, the NumPy arrays bound for CPU devices
    whose blocks are strided spread over the cores. (XLA's CPU client copies
    dense blocks on threads of its own; splitting one array's strided blocks
    over threads was slower than one `device_put` of it.)"""
    if sum(v.nbytes for v in values if isinstance(v, np.ndarray)) < SPREAD_FROM:
        return jax.device_put(values, shardings)
    strided = [
        isinstance(value, np.ndarray)
        and in_cpu_memory(sharding)
        and not cpu.has_dense_block(value, sharding)
        and movable(value.dtype)
        for value, sharding in zip(values, shardings, strict=True)
    ]
    if not any(strided):  # nothing to spread
        return jax.device_put(values, shardings)
    return spread(
        lambda indices: jax.device_put(
            [values[i] for i in indices], [shardings[i] for i in indices]
        ),
        [v.nbytes if free else 0 for v, free in zip(values, strided, strict=True)],
        pinned=[not free for free in strided],
    )
