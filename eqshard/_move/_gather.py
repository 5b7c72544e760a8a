"""Copying pytrees from meshes to the host.

Arrays whose shards this process can all see are copied straight to host, without
leaving a host copy cached on the arrays, by the copy engine's `to_host`
(`_copies.py`: on CPU from the device buffers, spread over the cores; else, and
on its plain route, one `jax.device_get`). An
array spread over several processes is first laid out again over the same
devices, whole on each process and split across that process's devices, then
copied to host from those local shards, one leaf at a time: no device ever holds
a full replica (see `_multiprocess.py`).
"""

from collections.abc import Iterator
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._keys import HostKey, is_key, key_data, key_impl_name
from .._tree import (
    abstract_leaf_error,
    collision_message,
    deleted_error,
    is_array,
    is_deleted,
    path_name,
    path_str,
)
from .._typing import KeyPath, PyTreeDef, typecheck
from ._copies import to_host
from ._host import host_ready, leaf_casts, loss_error
from ._multiprocess import (
    check_timeout,
    host_value,
    is_global,
    needs_collective,
    wait_for_processes,
)


def _to_host(array: jax.Array) -> np.ndarray:
    """The full value of one array on this process's host."""
    if array.is_fully_addressable:
        return np.asarray(to_host([array])[0])
    return host_value(array)


def _elsewhere_error(caller: str, found: list[tuple[KeyPath, Any]]) -> ValueError:
    where = ", ".join(
        f"'{path_str(path)}' (on processes "
        f"{sorted({d.process_index for d in x.sharding.device_set})})"
        for path, x in found[:10]
    )
    return ValueError(
        f"eqshard.{caller}: process {jax.process_index()} holds no shard of the "
        f"arrays at {where}: their meshes have none of its devices, so it cannot "
        "copy them to host. Gather them on the processes that hold them, and leave "
        "them out of the tree this process gathers."
    )


def _host_leaves(
    tree: PyTree, caller: str
) -> tuple[list[tuple[KeyPath, Any]], PyTreeDef]:
    """The leaves of `tree` with their paths, checked before any of them moves:
    every array has data, and this process holds a shard of it."""
    path_leaves, treedef = jtu.tree_flatten_with_path(tree)
    abstract = [p for p, x in path_leaves if isinstance(x, jax.ShapeDtypeStruct)]
    if abstract:
        raise abstract_leaf_error(caller, abstract)
    deleted = [p for p, x in path_leaves if is_deleted(x)]
    if deleted:
        raise deleted_error(caller, deleted)
    elsewhere = [
        (p, x)
        for p, x in path_leaves
        if is_global(x) and not x.sharding.addressable_devices
    ]
    if elsewhere:
        raise _elsewhere_error(caller, elsewhere)
    return path_leaves, treedef


@typecheck
def gather(tree: PyTree, *, dtype: Any = None, timeout: float | int = 300.0) -> PyTree:
    """Copies every `jax.Array` of a pytree to host, as `numpy.ndarray`s.

    Values are bit-exact and keep their dtype (bfloat16 included) unless `dtype`
    asks for a cast. Each is a writeable array that owns its memory, whatever the
    array's spec; everything else is returned as it is. No full copy of an array is
    ever put on every device. A typed PRNG key comes back as an
    [`eqshard.HostKey`][], which [`eqshard.shard`][] makes a key array again. In a
    multi-process run every process gets the full value and must make the same
    call (see [the how-to](../how-to/gather-serialise.md#several-processes)). For
    trees too large to hold on host twice, see [`eqshard.iter_gather`][].

    **Arguments:**

    - `tree`: any pytree.
    - `dtype`: if given, floating arrays (NumPy ones too) are cast to it on host:
      a floating dtype, or a tree of them and `None`s, as for
      [`eqshard.shard`][]. A cast that would overflow raises.
    - `timeout`: in a multi-process run, how many seconds to wait for the other
      processes to make the same call before raising.

    **Returns:**

    A pytree of the structure of `tree` with NumPy arrays in place of JAX arrays.

    **Raises:**

    - `TypeError` if `tree` holds `jax.ShapeDtypeStruct`s.
    - `ValueError` in a multi-process run, naming the arrays of which this process
      holds no shard (their meshes have none of its devices), or if the other
      processes of its arrays do not make the same call within `timeout` seconds.

    !!! Example

        ```python
        host = eqshard.gather(model)
        eqx.tree_serialise_leaves("model.eqx", host)
        ```
    """
    check_timeout("gather", timeout)
    path_leaves, treedef = _host_leaves(tree, "gather")
    casts = leaf_casts(dtype, tree, caller="gather")
    leaves = [x for _, x in path_leaves]
    # A typed PRNG key comes to host as a `HostKey` of its data (see `_keys.py`).
    impls = {
        i: key_impl_name(x)
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array) and is_key(x)
    }
    for i in impls:
        leaves[i] = key_data(leaves[i])
    local = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array) and x.is_fully_addressable
    ]
    out = list(leaves)
    fetched = to_host([leaves[i] for i in local], own=True)
    for i, value in zip(local, fetched, strict=True):
        out[i] = value
    shared = [(path, x) for (path, _), x in zip(path_leaves, leaves, strict=True)]
    shared = [(path, x) for path, x in shared if needs_collective(x)]
    wait_for_processes("gather", shared, timeout)
    for i, x in enumerate(leaves):
        if is_global(x):
            out[i] = host_value(x)
    if any(cast is not None for cast in casts):
        lost = []
        for i, ((path, _), cast) in enumerate(zip(path_leaves, casts, strict=True)):
            if cast is not None:
                source = np.asarray(out[i])
                out[i], what, _ = host_ready(source, cast, None)
                if what is not None:
                    lost.append((path, source.dtype, out[i].dtype, what, True))
        if lost:
            raise loss_error("gather", lost)
    for i, impl in impls.items():
        out[i] = HostKey(out[i], impl)
    return jtu.tree_unflatten(treedef, out)


@typecheck
def iter_gather(tree: PyTree, *, sep: str = "/") -> Iterator[tuple[str, np.ndarray]]:
    """Yields `(path, numpy_array)` for each array of a pytree, one at a time.

    Like [`eqshard.gather`][], but only one array is on host at a time, so a
    checkpoint writer can save a model larger than host memory allows twice.
    Non-array leaves are skipped. In a multi-process run, every process must
    iterate in step, to the end, as every process takes part in gathering each
    array spread over several processes.

    **Arguments:**

    - `tree`: any pytree.
    - `sep`: the separator of the paths.

    **Returns:**

    An iterator of `(path, array)` pairs, in the order of
    `jax.tree_util.tree_leaves`. A typed PRNG key array gives its data
    (`jax.random.key_data`, as NumPy `uint32`).

    **Raises:**

    As [`eqshard.gather`][], before the first array is yielded; also a `ValueError`
    naming both paths if two arrays get the same path string.

    !!! Example

        ```python
        for path, value in eqshard.iter_gather(model):
            np.save(f"ckpt/{path.replace('/', '.')}.npy", value)
        ```
    """
    path_leaves, _ = _host_leaves(tree, "iter_gather")
    named: list[tuple[str, Any]] = []
    owner: dict[str, KeyPath] = {}
    for path, leaf in path_leaves:
        if is_array(leaf):
            name = path_name(path, sep)
            if name in owner:  # a checkpoint would silently keep one of them
                message = collision_message(name, owner[name], path)
                raise ValueError(f"eqshard.iter_gather: {message}")
            owner[name] = path
            named.append((name, leaf))
    return _iter_host(named)


def _iter_host(named: list[tuple[str, Any]]) -> Iterator[tuple[str, np.ndarray]]:
    for name, leaf in named:
        if isinstance(leaf, jax.Array) and is_key(leaf):
            leaf = key_data(leaf)  # a key's data: NumPy has no key dtype
        yield name, _to_host(leaf) if isinstance(leaf, jax.Array) else np.asarray(leaf)
