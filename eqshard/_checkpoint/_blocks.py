"""Arrays of an orbax checkpoint read block by block into the memory of CPU
devices by tensorstore, with no copy after the read.

orbax reads each device's block into a NumPy array and `jax.device_put`s it.
On CPU devices, whose memory is host memory, that is a second copy of every
byte (NumPy's large arrays start 16 bytes into their pages, and XLA's CPU
client copies any array not aligned to 64 bytes), made one block at a time on
the thread that called `restore`, while tensorstore decodes on the others.
Here each block is read by tensorstore into a buffer aligned to 64 bytes
(`aligned_empty` of `_internals/cpu.py`, as `_resident.py` makes them), which
the CPU client takes as the device's buffer itself: the read is the only copy.
(It takes any such NumPy array so, whatever `device_put`'s `may_alias` says: a
block that several devices hold, read once, is copied device to device for all
but the first, so that each device owns its buffer.) Every block of every array is
asked for before any is waited on, so tensorstore decodes them all on
its own threads.

The files are opened with orbax's own description of them (the tensorstore spec
it reads with, from `orbax.checkpoint.type_handlers`, read by the door
`_internals/orbax.py`), in one tensorstore context, so that every array shares
one cache of the checkpoint's index. This is the fast path `restore` of
`_internals/routes.py`: `EQSHARD_PLAIN_ROUTES=restore` gives every array orbax's
own read instead, and so does a door that does not recognise orbax's type
handlers (saying so once, in a warning).
Accelerators, and the host memories of a CPU device, keep orbax's read: there
the copy to the device is a transfer that happens either way, and orbax bounds
the host memory it holds at once.
"""

import typing
from typing import Any

import jax
import numpy as np

from .._internals import orbax
from .._internals.cpu import aligned_empty
from ._disk import Held
from ._targets import import_optional


def _block_bounds(
    target: jax.ShapeDtypeStruct,
) -> dict[Any, tuple[tuple[int, int], ...]]:
    """The block each of this process's devices holds of `target`: the
    `(start, stop)` of each dimension."""
    mine = target.sharding.addressable_devices
    return {
        device: tuple(s.indices(n)[:2] for s, n in zip(index, target.shape))
        for device, index in target.sharding.devices_indices_map(target.shape).items()
        if device in mine
    }


def _unread(name: str, error: Exception) -> ValueError:
    return ValueError(f"'{name}' could not be read: {error}")


def read_blocks(
    path: str,
    held: Held,
    wanted: dict[int, jax.ShapeDtypeStruct],
    names: dict[int, str],
    caller: str,
) -> dict[int, jax.Array]:
    """The leaves of orbax's tree at the positions of `wanted`, each read onto its
    struct's sharding (on CPU devices, in their default memory) as its struct's
    dtype, converted by tensorstore as orbax converts. `names` name them in
    errors: a `ValueError` for files that cannot be read. Raises `Unrecognised`
    (before reading anything) if orbax's type handlers are not as the door
    (`_internals/orbax.py`) reads them."""
    tensorstore = import_optional("tensorstore", "orbax", caller)
    files = {k: typing.cast(str, held.names[k]) for k in wanted}
    opened = orbax.read_specs(path, files, zarr3=held.zarr3)  # may be Unrecognised
    opening = {
        k: tensorstore.open(spec, context=opened.context, open=True, read=True)
        for k, spec in opened.specs.items()
    }
    where = {k: _block_bounds(target) for k, target in wanted.items()}
    read: dict[int, dict[Any, np.ndarray]] = {}
    writes = []
    for k, target in wanted.items():
        try:
            store = opening[k].result()
        except ValueError as error:
            raise _unread(names[k], error) from error
        if store.shape != target.shape:  # the files changed since their metadata
            raise ValueError(
                f"'{names[k]}' is held with shape {store.shape}, and described "
                f"with shape {target.shape}"
            )
        if store.dtype.numpy_dtype != target.dtype:
            store = tensorstore.cast(store, target.dtype)
        read[k] = {}
        for bounds in where[k].values():
            if bounds not in read[k]:
                shape = tuple(b - a for a, b in bounds)
                read[k][bounds] = block = aligned_empty(shape, np.dtype(target.dtype))
                source = store[tuple(slice(a, b) for a, b in bounds)]
                written = tensorstore.array(block).write(source.translate_to[0])
                writes.append((k, written))
    for k, written in writes:
        try:
            written.result()
        except ValueError as error:
            raise _unread(names[k], error) from error
    out = {}
    for k, target in wanted.items():
        placed: dict[Any, jax.Array] = {}
        first: dict[Any, jax.Array] = {}
        for device, bounds in where[k].items():
            if bounds in first:  # a replica: a copy of its own
                placed[device] = jax.device_put(first[bounds], device)
            else:  # the buffer read into becomes the device's
                placed[device] = first[bounds] = jax.device_put(
                    read[k][bounds], device, may_alias=True
                )
        out[k] = jax.make_array_from_single_device_arrays(
            target.shape, target.sharding, list(placed.values())
        )
    return out
