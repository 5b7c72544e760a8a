"""The CPU copy engine behind one function per direction, each with its plain route.

- `to_devices`: staged values (NumPy data made ready by `_host.host_ready`, JAX
  arrays) onto their shardings, returning once no device reads the caller's
  NumPy memory any more and no device buffer is that memory.
- `to_host`: fully addressable arrays to NumPy, without leaving a host copy
  cached on them.
- `between`: JAX arrays on CPU devices onto other shardings or dtypes (the
  `"blocks"` route of `_resident.py`), without a compile per shape.

The fast route copies blocks straight from and into XLA:CPU's buffers, spread
over the cores (`_threads.py`, `_resident.py`), and compares device buffers'
addresses with the caller's memory; those reads go through
`eqshard/_internals/cpu.py`. The plain route reads no device buffer:
`jax.device_put` of private copies of the NumPy data the devices could alias,
waiting for the transfers that read the caller's memory; `jax.device_get`
then a writeable copy of its own; a move between shardings through the host.
Both give the same values on the same shardings, bit for bit.

`EQSHARD_PLAIN_ROUTES=copies` forces the plain route (`routes.plain`); when a
read of XLA:CPU's buffers meets something it does not know
(`routes.Unrecognised`), the call takes the plain route and says so once
(`routes.fall_back`).
"""

import functools as ft
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from .._caches import register
from .._internals import cpu, routes
from .._internals.cpu import may_alias
from ._host import borrowed, converted, Lost, private_copy
from ._resident import move_blocks
from ._threads import device_put as spread_device_put, split_above, spread


for _clear in cpu.CACHE_CLEARERS:  # XLA:CPU's reads, cached where they are made
    register(_clear)


# Places values on shardings (`jax.device_put`, or one process's shards of each).
Put = Callable[[list[Any], list[NamedSharding]], list[jax.Array]]


def plain() -> bool:
    """Whether the plain route is forced (`EQSHARD_PLAIN_ROUTES=copies`)."""
    return routes.plain("copies")


# ---------------------------------------------------------------------------------
# Onto devices.
# ---------------------------------------------------------------------------------


def to_devices(
    values: Sequence[Any],
    shardings: Sequence[NamedSharding],
    sources: Sequence[Any],
    *,
    donate: Sequence[bool] | None = None,
    put: Put | None = None,
    host_local: bool = False,
    plain_route: bool | None = None,
) -> list[jax.Array]:
    """`values` placed on `shardings`, once nothing of `sources` (the caller's
    leaves that `values` were staged from) is read by a device or is a device
    buffer. `donate`: which JAX arrays give up their buffers (one process);
    `put`: how a multi-process run places one process's shards, of a full copy
    or (`host_local`) of this process's block; `plain_route`: whether the plain
    route is forced, where the caller has read the switch for its call already."""
    values, shardings = list(values), list(shardings)
    if plain_route is None:
        plain_route = plain()
    if plain_route:
        return _to_devices_plain(values, shardings, sources, donate, put)
    if put is None and donate is not None and any(donate):
        placed = jax.device_put(values, shardings, donate=list(donate))
    elif put is None:
        placed = spread_device_put(values, shardings)
    else:
        placed = put(values, shardings)
    reading = [i for i, v in enumerate(values) if borrowed(v, sources[i])]
    if reading:
        jax.block_until_ready([placed[i] for i in reading])
        try:
            aliased = [i for i in reading if _aliases(placed[i], values[i], host_local)]
        except routes.Unrecognised as error:
            routes.fall_back("copies", str(error))
            aliased = [i for i in reading if may_alias(shardings[i])]
        _place_again(placed, values, shardings, aliased, put)
    return placed


def _aliases(placed: jax.Array, value: np.ndarray, host_local: bool) -> bool:
    """Whether a device buffer of `placed` is `value`'s memory (a large array
    placed as given; see `_host.py`). A host-local block is not the array's
    shape, so only its addresses are compared."""
    sharding = placed.sharding
    if not isinstance(sharding, NamedSharding):  # compare the addresses alone
        return cpu.shares_memory(placed, value)
    return (
        may_alias(sharding)
        and (host_local or cpu.takes_in_place(value, sharding))
        and cpu.shares_memory(placed, value)
    )


def _place_again(
    placed: list[jax.Array],
    values: list[Any],
    shardings: list[NamedSharding],
    which: list[int],
    put: Put | None,
) -> None:
    """Places `values[i]` for `i` in `which` again, from private copies."""
    if not which:
        return
    copies = [private_copy(np.asarray(values[i])) for i in which]
    again = (put or jax.device_put)(copies, [shardings[i] for i in which])
    for i, array in zip(which, again, strict=True):
        placed[i] = array


def _to_devices_plain(
    values: list[Any],
    shardings: list[NamedSharding],
    sources: Sequence[Any],
    donate: Sequence[bool] | None,
    put: Put | None,
) -> list[jax.Array]:
    """`to_devices` by `jax.device_put` alone: NumPy data of the caller's that
    the devices could alias is copied first, and the transfers that read the
    rest of the caller's memory are waited for."""
    reading = []
    for i, value in enumerate(values):
        if borrowed(value, sources[i]):
            if may_alias(shardings[i]):
                values[i] = np.array(value, copy=True)
            else:
                reading.append(i)
    if put is not None:
        placed = put(values, shardings)
    else:
        donated = list(donate) if donate is not None else False
        placed = jax.device_put(values, shardings, donate=donated)
    jax.block_until_ready([placed[i] for i in reading])
    return list(placed)


# ---------------------------------------------------------------------------------
# To host.
# ---------------------------------------------------------------------------------


def to_host(arrays: Sequence[jax.Array], *, own: bool = False) -> list[np.ndarray]:
    """The values of fully addressable arrays on this host, as `jax.device_get`
    gives them, without leaving a host copy cached on the arrays.

    `jax.device_get` caches an array's host copy on it, where it lives as long as
    the array does: a gathered model would keep a hidden second host copy, and
    `iter_gather` would hold every leaf at once. On CPU each distinct block is
    read from its device buffer (no copy, so nothing is cached) into the result,
    the blocks spread over the cores (`_threads.py`); elsewhere, and on the plain
    route, each array is read through a short-lived `_uncached` wrapper.

    An array of one distinct block (replicated, or on one device) comes back as
    a read-only view of its device buffer on CPU, and read-only elsewhere (JAX's
    host copy); with `own`, every value is a writeable array that owns its
    memory, as `gather` promises (a copy where the value was not one)."""
    arrays = list(arrays)
    if not plain():
        try:
            return _to_host_fast(arrays, own)
        except routes.Unrecognised as error:
            routes.fall_back("copies", str(error))
    return _device_get(arrays, own)


def _uncached(array: jax.Array) -> jax.Array:
    """A new `jax.Array` over the same device buffers as `array`, copying nothing:
    `jax.device_get` of it caches its host copy on the wrapper, which dies with
    it, not on `array`."""
    return jax.make_array_from_single_device_arrays(
        array.shape, array.sharding, [piece.data for piece in array.addressable_shards]
    )


def _device_get(arrays: list[jax.Array], own: bool) -> list[np.ndarray]:
    """`to_host` by one `jax.device_get`, through `_uncached` wrappers."""
    values = jax.device_get([_uncached(x) for x in arrays])
    return [_owned(v) if own else v for v in values]


def _owned(value: Any) -> np.ndarray:
    """`value` as a writeable array that owns its memory: itself, made writeable,
    if it owns its memory already (JAX's host copy, which nothing else holds once
    its `_uncached` wrapper is gone), else a copy."""
    value = np.asarray(value)
    if value.base is not None or not value.flags.owndata:
        return np.array(value, copy=True)
    value.flags.writeable = True
    return value


def _to_host_fast(arrays: list[jax.Array], own: bool) -> list[np.ndarray]:
    """`to_host` from XLA:CPU's buffers where the arrays are on CPU devices."""
    out: list[Any] = [None] * len(arrays)
    on_cpu: list[tuple[int, Any]] = []
    elsewhere: list[int] = []
    for i, array in enumerate(arrays):
        blocks = cpu_blocks(array.sharding, tuple(array.shape))
        if blocks is None:
            elsewhere.append(i)
        else:
            on_cpu.append((i, blocks))
    # The blocks are copied into the arrays they belong to, spread over the cores:
    # an array's together, those of an array larger than a core's share each on
    # its own. An array of one block is its device buffer, unless it must `own`.
    several = [(i, blocks) for i, blocks in on_cpu if len(blocks) > 1 or own]
    large = split_above(sum(arrays[i].nbytes for i, _ in several))
    copies: list[tuple[int, Any]] = []  # (i, blocks of arrays[i])
    for i, blocks in on_cpu:
        if len(blocks) == 1 and not own:
            out[i] = cpu.device_buffer(arrays[i], blocks[0][0])
            continue
        out[i] = np.empty(arrays[i].shape, arrays[i].dtype)
        if out[i].nbytes > large:
            copies += [(i, (block,)) for block in blocks]
        else:
            copies.append((i, blocks))

    def copy(units: list[int]) -> list[None]:
        for i, blocks in (copies[u] for u in units):
            for k, index in blocks:
                out[i][index] = cpu.device_buffer(arrays[i], k)
        return [None] * len(units)

    spread(
        copy,
        [sum(out[i][index].nbytes for _, index in blocks) for i, blocks in copies],
        pinned=[False] * len(copies),
    )
    if elsewhere:
        values = _device_get([arrays[i] for i in elsewhere], own)
        for i, value in zip(elsewhere, values, strict=True):
            out[i] = value
    return out


@ft.lru_cache(maxsize=4096)
def cpu_blocks(
    sharding: Any, shape: tuple[int, ...]
) -> tuple[tuple[int, tuple[slice, ...]], ...] | None:
    """For an array on CPU devices only: one `(k, index)` per distinct block of it,
    `k` being the block's position in `array.addressable_data(k)` (the order of
    `addressable_devices_indices_map`). `None` on other devices."""
    mapping = sharding.addressable_devices_indices_map(shape)
    if any(device.platform != "cpu" for device in mapping):
        return None
    blocks: dict[tuple[Any, ...], tuple[int, tuple[slice, ...]]] = {}
    for k, index in enumerate(mapping.values()):
        key = tuple(s.indices(n) for s, n in zip(index, shape, strict=True))
        blocks.setdefault(key, (k, index))
    return tuple(blocks.values())


register(cpu_blocks.cache_clear)


# ---------------------------------------------------------------------------------
# Between shardings.
# ---------------------------------------------------------------------------------


def between(
    arrays: Sequence[jax.Array],
    shardings: Sequence[NamedSharding],
    casts: Sequence[np.dtype | None],
) -> tuple[list[jax.Array], list[tuple[int, Lost]]]:
    """JAX arrays on CPU devices, each placed on its sharding and cast (to the
    dtype JAX places), and `(position, lost)` for each cast that lost values.
    Fast: every block copied once from the source's device buffers
    (`_resident.move_blocks`); plain: through the host, with `jax.device_get`
    and `jax.device_put`."""
    if not plain():
        try:
            return move_blocks(arrays, shardings, casts)
        except routes.Unrecognised as error:
            routes.fall_back("copies", str(error))
    values = _device_get(list(arrays), own=True)
    ready, losses = [], []
    for i, (value, cast) in enumerate(zip(values, casts, strict=True)):
        out, lost = converted(value, cast)
        ready.append(out)
        if lost is not None:
            losses.append((i, lost))
    return list(jax.device_put(ready, list(shardings))), losses
