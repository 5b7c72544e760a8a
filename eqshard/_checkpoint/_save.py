"""`save`: the arrays of a pytree written as an orbax checkpoint, beside the old
one, which the new one replaces only when complete (see the package's docstring).
"""

import functools as ft
import json
import os
import uuid
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jaxtyping import PyTree

from .._caches import register
from .._internals import orbax, routes
from .._keys import is_key
from .._move._host import unplaceable
from .._move._multiprocess import check_timeout, fail_together, meet
from .._tree import (
    DELETED,
    is_deleted,
    listing,
    path_str,
)
from .._typing import KeyPath, typecheck
from ._disk import check_apart, check_directory, check_staged
from ._swap import (
    literal_name,
    OWN_FILE,
    release_lock,
    remove,
    staging_name,
    swap,
    take_lock,
)
from ._targets import import_optional, named_arrays, stored_like
from ._views import laid_as_stages


# Integer types by width, whose bits hold arrays of dtypes tensorstore lacks.
_SAME_WIDTH = {2: "int2", 4: "int4", 8: "uint8", 16: "uint16", 32: "uint32"}


@ft.lru_cache(maxsize=256)
def tensorstore_has(name: str) -> bool:
    import tensorstore

    try:
        tensorstore.dtype(name)
    except (ValueError, TypeError):
        return False
    return True


register(tensorstore_has.cache_clear)


def _stored_as(dtype: np.dtype) -> np.dtype | None:
    """The dtype orbax holds arrays of `dtype` in: `dtype` itself, or an integer
    type of the same width whose bits are saved (where tensorstore has no name for
    `dtype`); `None` if neither can."""
    if tensorstore_has(dtype.name):
        return dtype
    if jnp.issubdtype(dtype, jnp.integer):
        bits = jnp.iinfo(dtype).bits
    elif jnp.issubdtype(dtype, jnp.floating):
        bits = jnp.finfo(dtype).bits
    else:
        return None
    view = _SAME_WIDTH.get(bits)
    return np.dtype(jnp.dtype(view)) if view and tensorstore_has(view) else None


def _unsavable(leaf: Any) -> tuple[str, bool] | None:
    """Why `leaf` cannot be saved, and whether its type is at fault (rather than
    its state), or `None` if it can."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return "a `jax.ShapeDtypeStruct`, which has no data: save the arrays", True
    if is_deleted(leaf):
        return (
            f"{DELETED}; save what that function returned, or a copy kept before",
            False,
        )
    if is_key(leaf):
        return None
    dtype = np.dtype(leaf.dtype)
    reason = unplaceable(dtype) if isinstance(leaf, np.ndarray | np.generic) else None
    if reason is None and _stored_as(dtype.newbyteorder("=")) is None:
        reason = f"orbax cannot store {dtype}, nor its bits; cast it first"
    return None if reason is None else (reason, True)


def _check_leaves(
    named: dict[str, tuple[int, KeyPath, Any]], caller: str
) -> dict[str, dict[str, Any]]:
    """The entries of eqshard's file (zero-size arrays, and arrays whose bits orbax
    holds as another dtype), or an error naming every leaf that cannot be saved."""
    own: dict[str, dict[str, Any]] = {}
    bad = []
    for name, (_, path, leaf) in named.items():
        problem = _unsavable(leaf)
        if problem is not None:
            bad.append((path, leaf, *problem))
            continue
        shape, dtype = stored_like(leaf)
        stored = _stored_as(dtype)
        empty = 0 in shape  # orbax refuses zero-size arrays
        if empty or stored != dtype:
            saved_as = None if empty or stored is None else stored.name
            own[name] = {
                "shape": list(shape),
                "dtype": dtype.name,
                "saved_as": saved_as,
            }
    if bad:
        lines = [
            f"'{path_str(path)}' ({leaf.dtype}{list(leaf.shape)}): {reason}."
            for path, leaf, reason, _ in bad
        ]
        head = (
            f"eqshard.{caller}: nothing was written, as these leaves cannot be saved:"
        )
        kind = TypeError if any(typed for *_, typed in bad) else ValueError
        raise kind(listing(head, lines))
    return own


def _stage_views(named: dict[str, tuple[int, KeyPath, Any]]) -> list[str]:
    """The names of the arrays laid out as a circular pipeline's view of stacked
    layers (`laid_as_stages`), which `restore` may read as `(L, ...)`: their
    stages over mesh axes named (a `(2, 1, 4)` array with its dimension 1 unnamed
    is no pipeline's, whatever its size)."""
    return [
        name
        for name, (_, _, leaf) in named.items()
        if isinstance(leaf, jax.Array)
        and isinstance(leaf.sharding, NamedSharding)
        and len(leaf.sharding.spec) > 1
        and leaf.sharding.spec[1] not in (None, ())
        and laid_as_stages(tuple(leaf.shape), leaf.sharding)
    ]


def _check_apart(
    named: dict[str, tuple[int, KeyPath, Any]],
    own: dict[str, dict[str, Any]],
    caller: str,
) -> None:
    """Refuses two arrays orbax would write to one place (`check_apart`); a
    zero-size array is in eqshard's file alone."""
    check_apart(
        (
            (path, name)
            for name, (_, path, _) in named.items()
            if not (name in own and own[name]["saved_as"] is None)
        ),
        where="nothing was written, as orbax would store",
        caller=caller,
    )


def _bits(leaf: Any, stored: np.dtype) -> Any:
    """`leaf`'s data viewed as `stored`, a dtype of the same width."""
    if isinstance(leaf, jax.Array):
        return jax.lax.bitcast_convert_type(leaf, stored)
    return np.asarray(leaf).view(stored)


def _items(
    named: dict[str, tuple[int, KeyPath, Any]], own: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """What orbax writes: every array but the zero-size ones, bits as saved."""
    items = {}
    for name, (_, _, leaf) in named.items():
        entry = own.get(name)
        if entry is None:
            items[name] = leaf
        elif entry["saved_as"] is not None:
            items[name] = _bits(leaf, np.dtype(jnp.dtype(entry["saved_as"])))
    return items


def _writer(ocp: Any) -> Any:
    """orbax's handler that `save` writes with: in one process, one whose
    `jax.Array`s are saved shard by shard from one replica each (the `save` route,
    `_internals/orbax.py` says why); otherwise, or where that handler cannot be
    made, orbax's own (the plain route)."""
    if jax.process_count() == 1 and not routes.plain("save"):
        try:
            handler = orbax.one_replica_writer()
        except routes.Unrecognised as error:
            routes.fall_back("save", str(error))
        else:
            if handler is not None:
                return handler
    return ocp.PyTreeCheckpointHandler(save_concurrent_gb=96)


def _not_written(caller: str, path: str, error: Exception) -> ValueError:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    failure = ValueError(
        f"eqshard.{caller}: writing the checkpoint at {path!r} failed, so nothing "
        f"there was replaced: {first[:600]}"
    )
    failure.__cause__ = error
    return failure


@typecheck
def save(
    directory: str | os.PathLike,
    tree: PyTree,
    *,
    overwrite: bool = False,
    timeout: float | int = 300.0,
) -> None:
    """Saves the arrays of a pytree as an orbax checkpoint.

    Every array leaf (`jax.Array`, NumPy) is saved under its path (`layers/3/w`),
    each process writing the shards it holds; everything else (static fields,
    callables, Python scalars, `None`) comes back from the `like` given to
    [`eqshard.restore`][], so a module or an optax state saves as it is. The
    checkpoint is a standard orbax one plus eqshard's `eqshard.json` (see
    [what eqshard adds](../how-to/checkpoints.md#what-eqshard-adds-to-orbaxs-format)).
    Every leaf is checked before anything is written, and the checkpoint replaces
    one at `directory` only when complete, atomically where the file system can
    ([saving over a checkpoint](../how-to/checkpoints.md#saving-over-a-checkpoint)).
    Several processes: see [the how-to](../how-to/checkpoints.md#several-processes).

    **Arguments:**

    - `directory`: the checkpoint's directory; it must not exist yet.
    - `tree`: any pytree.
    - `overwrite`: replace a checkpoint (or an empty directory) at `directory`;
      a directory that holds anything else too is refused, naming it.
    - `timeout`: in a multi-process run, how many seconds each process waits
      for the others at each meeting.

    **Raises:**

    - `TypeError` naming every leaf that cannot be saved: `jax.ShapeDtypeStruct`s
      and dtypes orbax cannot store (with them, deleted arrays, which alone raise
      `ValueError`).
    - `ValueError` if `directory` exists (and not `overwrite`), holds something
      other than a checkpoint, or its parent is a file; if another save to it is
      under way (naming its host, process and `<directory>.eqshard-lock`); if two
      arrays have the same path, or orbax would store two in one place (`a`,
      `a/`); if writing fails or does not read back (nothing is replaced); or if
      another process fails, passes another tree or does not come within
      `timeout` seconds.
    - `ImportError` if orbax-checkpoint is not installed
      (`pip install "eqshard[orbax]"`).

    !!! Example

        ```python
        eqshard.save("/tmp/ckpt/step_100", (model, opt_state))
        ```
    """
    caller = "save"
    check_timeout(caller, timeout)
    ocp = import_optional("orbax.checkpoint", "orbax", caller)
    epath = import_optional("etils.epath", "orbax", caller)
    path = os.path.abspath(os.fspath(directory))
    primary = jax.process_index() == 0
    new = staging_name(path) if primary else ""
    cannot = f"the checkpoint at {path!r} is not written"
    rule = "Every process must make the same `save` call at the same point"
    failure: Exception | None = None
    named: dict[str, tuple[int, KeyPath, Any]] = {}
    own: dict[str, dict[str, Any]] = {}
    lock: int | None = None
    made = False
    handler = _writer(ocp)
    try:
        try:
            named = named_arrays(tree, caller)
            own = _check_leaves(named, caller)
            _check_apart(named, own, caller)
            if primary:  # the one writer: process 0 (see `_swap.py`)
                _make_parent(path, caller)
                lock = take_lock(path, new, caller)
            check_directory(path, overwrite, caller)
            if primary:
                os.mkdir(new)
                made = True
        except OSError as error:  # a lock or directory that cannot be made
            failure = _not_written(caller, path, error)
        except Exception as error:  # raised on every process, by `fail_together`
            failure = error
        rows = [(n, x.shape, x.dtype) for n, (_, _, x) in named.items()]
        fail_together(caller, failure, timeout, rows=rows, cannot=cannot, rule=rule)
        processes = tuple(range(jax.process_count()))
        staged = meet(caller, processes, timeout, cannot=cannot, rule=rule, status=new)
        new = staged.get(0, new)  # process 0's staging directory
        items = _items(named, own)
        try:  # every process writes its shards
            if items:
                with literal_name(new, caller) as where:
                    handler.save(epath.Path(where), args=ocp.args.PyTreeSave(items))
        except Exception as error:
            failure = _not_written(caller, path, error)
        fail_together(caller, failure, timeout, cannot=cannot, rule=rule)
        try:  # all have written: process 0 completes the checkpoint, and swaps
            if primary:
                if items:
                    with literal_name(new, caller) as where:
                        handler.finalize(epath.Path(where))
                with open(os.path.join(new, OWN_FILE), "w") as f:
                    json.dump(
                        {
                            "version": 1,
                            "generation": uuid.uuid4().hex,
                            "orbax": bool(items),
                            "arrays": own,
                            "stage_views": _stage_views(named),
                        },
                        f,
                    )
                check_staged(ocp, new, sorted(named), caller)
                swap(new, path)
        except Exception as error:
            failure = _not_written(caller, path, error)
        fail_together(caller, failure, timeout, cannot=cannot, rule=rule)
    finally:
        handler.close()
        try:
            if made:  # after a failure: the new files go, the old stay
                remove(new)
        finally:
            if lock is not None:
                release_lock(path, lock)


def _make_parent(path: str, caller: str) -> None:
    """Makes the directory `path` goes in, or raises naming the file in the way."""
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocking = parent
        while os.path.dirname(blocking) != blocking and (
            not os.path.lexists(blocking) or os.path.isdir(blocking)
        ):
            blocking = os.path.dirname(blocking)
        raise ValueError(
            f"eqshard.{caller}: cannot write the checkpoint at {path!r}: "
            f"{blocking!r} is a file, not a directory. Save under a directory, or "
            "move that file away."
        ) from None
