"""Checkpoints of any pytree, read straight into the shardings asked for.

`save`/`restore` write and read orbax checkpoints; `save_safetensors` and
`load_safetensors` the format published weights come in. Both optional
dependencies are imported inside the functions that use them, so `import
eqshard` never imports them.

How a checkpoint is written, in the order of `save`:

1. **Check first.** Before anything touches the disk, every leaf is checked
   (arrays without data, deleted ones, dtypes orbax cannot store), and all that
   cannot be saved are named together; so is a directory that exists (without
   `overwrite`) or that holds something other than a checkpoint.
2. **Beside the old one.** orbax writes the arrays to `<directory>.eqshard-new`,
   and eqshard adds its own file, `eqshard.json`, for what orbax cannot hold:
   zero-size arrays (orbax refuses them), kept by shape and dtype, and the dtypes
   tensorstore has no name for (uint4, uint2, float8_e4m3), whose bits orbax holds
   as an integer type of the same width. A tree without arrays is that file alone.
3. **Swap.** Only a complete checkpoint replaces an old one: the old directory is
   renamed to `<directory>.eqshard-old`, the new one into its place, and the old
   one removed. A failure before that leaves the old checkpoint as it was.

How a checkpoint is read, in the order of `restore`:

1. **Name.** Every array leaf of `like` is named by its path (`layers/3/w`);
   everything else (static fields, callables, Python scalars) is not saved and
   comes back from `like`. A skeleton from `eqx.filter_eval_shape` is enough.
2. **Target.** Each name gets a `jax.ShapeDtypeStruct` with its sharding: the
   spec's on `mesh`, or the sharding `like`'s leaf already has, and the dtype JAX
   places (its cast, or `like`'s).
3. **Compare first.** The checkpoint's metadata (orbax's and eqshard's: names,
   shapes, dtypes, of a nested orbax tree too) is compared with the targets, and
   every name missing, extra or different is reported together before any data
   is read.
4. **Read.** orbax reads each device's shard straight from the files onto that
   device (no full copy of an array on any device or on the host), converted to
   the target's dtype; in a multi-process run each process reads only the shards
   its devices hold. Zero-size arrays are made on their shardings, and bits are
   viewed as their dtype again.
5. **Nothing lost.** Where the dtype placed differs from the one saved (a cast
   asked for with `dtype=`, or 64-bit data while `jax_enable_x64` is off), the
   values are checked with `shard`'s policy (`_host.py`), shard by shard on host
   (no program to compile; the processes add up what their shards show): a
   narrowed integer array is compared with a float32 reading of the same data
   (which keeps every value's magnitude), and a floating array that holds inf or
   nan after the cast is read once more, whole on host, to tell values that
   overflowed from infinities that were saved.

In a multi-process run every process makes the same call. eqshard drives orbax's
handlers itself, so that no process waits in orbax's barriers (collectives without
a timeout): the processes meet at eqshard's (`fail_together`), before anything is
written or read, after every process has written or read its shards, and after
the swap. If one of them failed, or did not come within `timeout`, all of them
raise, and none waits in a collective the others never join.
"""

import functools as ft
import json
import os
import shutil
import typing
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding
from jaxtyping import PyTree

from ._derive import abstract_tree
from ._host import converted, leaf_casts, loss_error, Lost, lost_text, placed_dtype
from ._keys import is_key
from ._mesh import require_mesh
from ._multiprocess import check_timeout, fail_together, meet
from ._shard import unplaceable
from ._spec_args import resolve_specs
from ._specs import (
    check_leaves,
    check_placeable,
    check_spec_on_mesh,
    leaf_specs,
    spec_error_message,
)
from ._tree import collision_message, is_array, is_deleted, path_name, path_str
from ._typing import KeyPath, typecheck


def import_optional(module: str, extra: str, caller: str) -> Any:
    """The optional dependency `module`, or an `ImportError` saying how to get it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        raise ImportError(
            f"eqshard.{caller} needs the `{error.name}` package: "
            f'`pip install "eqshard[{extra}]"`.'
        ) from None


def named_arrays(
    tree: PyTree, caller: str, sep: str = "/"
) -> dict[str, tuple[int, KeyPath, Any]]:
    """`{name: (index, path, leaf)}` for the array leaves of `tree` (`index` in
    `jax.tree_util.tree_leaves(tree)`), named by their paths joined by `sep`; two
    arrays of one name are an error."""
    named: dict[str, tuple[int, KeyPath, Any]] = {}
    for i, (path, leaf) in enumerate(jtu.tree_flatten_with_path(tree)[0]):
        if not is_array(leaf):
            continue
        name = path_name(path, sep) or "<root>"
        if name in named:
            message = collision_message(name, named[name][1], path)
            raise ValueError(f"eqshard.{caller}: {message}")
        named[name] = (i, path, leaf)
    return named


def _list(names: Sequence[str], limit: int = 10) -> str:
    text = ", ".join(f"'{n}'" for n in names[:limit])
    return text + (f" ... ({len(names) - limit} more)" if len(names) > limit else "")


def stored_like(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype a leaf has in a checkpoint: a typed PRNG key's data, in
    native byte order."""
    if is_key(leaf):
        leaf = jax.eval_shape(jax.random.key_data, leaf)
    return tuple(int(n) for n in leaf.shape), np.dtype(leaf.dtype).newbyteorder("=")


# ---------------------------------------------------------------------------------
# The checkpoint's directory, and eqshard's own file in it.
# ---------------------------------------------------------------------------------

_OWN_FILE = "eqshard.json"
# orbax's own files: every orbax checkpoint has one of them.
_ORBAX_FILES = ("_CHECKPOINT_METADATA", "_METADATA")
# Siblings of a checkpoint's directory: the new one while it is written, and the
# old one while the new one takes its place.
_NEW, _OLD = ".eqshard-new", ".eqshard-old"


def _check_directory(path: str, overwrite: bool, caller: str) -> None:
    """Raises unless a checkpoint may be written at `path`: it does not exist, or
    `overwrite` replaces a checkpoint (or an empty directory) there."""
    if not os.path.lexists(path):
        return
    if not overwrite:
        raise ValueError(
            f"eqshard.{caller}: {path!r} already exists. Save to a new directory "
            "(e.g. one per step), or pass `overwrite=True` to replace it."
        )
    if not os.path.isdir(path):
        raise ValueError(
            f"eqshard.{caller}: {path!r} is a file, not a checkpoint, so "
            "`overwrite=True` does not replace it. Save to another directory, or "
            "remove the file yourself."
        )
    entries = sorted(os.listdir(path))
    names = {_OWN_FILE, *_ORBAX_FILES}
    if entries and not names.intersection(entries):
        shown = [e + "/" * os.path.isdir(os.path.join(path, e)) for e in entries]
        raise ValueError(
            f"eqshard.{caller}: {path!r} is not a checkpoint (it holds "
            f"{_list(shown, 5)}, and neither eqshard's {_OWN_FILE!r} nor orbax's "
            "metadata), so `overwrite=True` does not replace it. Save to another "
            "directory, or empty this one yourself."
        )


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _swap(new: str, path: str) -> None:
    """Puts the complete checkpoint at `new` in the place of `path`: with two
    renames, each atomic, so that `path` always holds a whole checkpoint except
    between them (when the old one is at `path + _OLD`)."""
    if not os.path.lexists(path):
        os.rename(new, path)
        return
    old = path + _OLD
    _remove(old)  # left by a swap that stopped between the renames
    os.rename(path, old)
    try:
        os.rename(new, path)
    except BaseException:
        os.rename(old, path)
        raise
    _remove(old)


class _Saved(NamedTuple):
    """An array in a checkpoint."""

    shape: tuple[int, ...]
    dtype: np.dtype  # the array's own
    stored: np.dtype  # the one orbax holds its data in (its bits, for some dtypes)
    position: int | None  # among the leaves of orbax's tree; `None`: zero-size


def _no_checkpoint(path: str, caller: str) -> ValueError:
    old = path + _OLD
    hint = (
        f" A save that was replacing it stopped midway: the checkpoint that was "
        f"there is at {old!r}; rename it back."
        if os.path.isdir(old)
        else " Check the path, and that `eqshard.save` finished there."
    )
    return ValueError(
        f"eqshard.{caller}: there is no checkpoint at {path!r} (no such "
        f"directory).{hint}"
    )


def _damaged(caller: str, where: str, what: str) -> ValueError:
    return ValueError(
        f"eqshard.{caller}: {where} is damaged: {what}. Restore from another "
        "checkpoint, or save again."
    )


def _read_own(path: str, caller: str) -> tuple[bool, dict[str, _Saved]] | None:
    """eqshard's file in the checkpoint at `path`: whether orbax holds any array,
    and the arrays orbax does not hold as they are; `None` if there is no such
    file (a checkpoint orbax wrote alone)."""
    file = os.path.join(path, _OWN_FILE)
    if not os.path.exists(file):
        return None
    try:
        with open(file) as f:
            own = json.load(f)
        arrays = {}
        for name, entry in own["arrays"].items():
            dtype = np.dtype(jnp.dtype(entry["dtype"]))
            bits = entry["saved_as"]
            stored = dtype if bits is None else np.dtype(jnp.dtype(bits))
            shape = tuple(int(n) for n in entry["shape"])
            arrays[name] = _Saved(shape, dtype, stored, None)
        return bool(own["orbax"]), arrays
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        raise _damaged(caller, repr(file), f"{type(error).__name__}: {error}") from None


def _orbax_leaf(meta: Any) -> bool:
    return not isinstance(meta, dict | list | tuple)


def _saved(ocp: Any, path: str, caller: str) -> tuple[dict[str, _Saved], Any]:
    """`{name: _Saved}` of the arrays in the checkpoint at `path`, and the
    structure of orbax's tree (`None` if orbax holds no array), from the
    checkpoint's own descriptions of itself (no array data)."""
    if not os.path.isdir(path):
        raise _no_checkpoint(path, caller)
    own = _read_own(path, caller)
    if own is not None and not own[0]:
        return own[1], None
    epath = import_optional("etils.epath", "orbax", caller)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        tree = handler.metadata(epath.Path(path)).tree
    except FileNotFoundError:
        raise ValueError(
            f"eqshard.{caller}: {path!r} holds no checkpoint: neither eqshard's "
            f"{_OWN_FILE!r} nor orbax's metadata is there. Check the path, and "
            "that `eqshard.save` finished there."
        ) from None
    except (ValueError, OSError, TypeError, KeyError, AttributeError) as error:
        raise _unreadable(caller, path, error, []) from None
    finally:
        handler.close()
    path_leaves, layout = jtu.tree_flatten_with_path(tree, is_leaf=_orbax_leaf)
    found: dict[str, _Saved] = {}
    where: dict[str, KeyPath] = {}
    for index, (key, meta) in enumerate(path_leaves):
        if not (hasattr(meta, "shape") and hasattr(meta, "dtype")):
            continue
        name = path_name(key, "/") or "<root>"
        if name in found:
            message = collision_message(name, where[name], key)
            raise ValueError(f"eqshard.{caller}: in {path!r}: {message}")
        dtype = np.dtype(meta.dtype)
        shape = tuple(int(n) for n in meta.shape)
        found[name], where[name] = _Saved(shape, dtype, dtype, index), key
    for name, entry in ({} if own is None else own[1]).items():
        if entry.stored == entry.dtype:
            found[name] = entry  # zero-size: in eqshard's file only
        elif name in found:  # bits that orbax holds as another dtype
            found[name] = found[name]._replace(dtype=entry.dtype)
        else:
            raise _damaged(
                caller, repr(path), f"{_OWN_FILE} names {name!r}, which orbax lacks"
            )
    return found, layout


# ---------------------------------------------------------------------------------
# orbax: save.
# ---------------------------------------------------------------------------------

# Integer types by width, whose bits hold arrays of dtypes tensorstore lacks.
_SAME_WIDTH = {2: "int2", 4: "int4", 8: "uint8", 16: "uint16", 32: "uint32"}


@ft.lru_cache(maxsize=256)
def _tensorstore_has(name: str) -> bool:
    import tensorstore

    try:
        tensorstore.dtype(name)
    except (ValueError, TypeError):
        return False
    return True


def _stored_as(dtype: np.dtype) -> np.dtype | None:
    """The dtype orbax holds arrays of `dtype` in: `dtype` itself, or an integer
    type of the same width whose bits are saved (where tensorstore has no name for
    `dtype`); `None` if neither can."""
    if _tensorstore_has(dtype.name):
        return dtype
    if jnp.issubdtype(dtype, jnp.integer):
        bits = jnp.iinfo(dtype).bits
    elif jnp.issubdtype(dtype, jnp.floating):
        bits = jnp.finfo(dtype).bits
    else:
        return None
    view = _SAME_WIDTH.get(bits)
    return np.dtype(jnp.dtype(view)) if view and _tensorstore_has(view) else None


def _unsavable(leaf: Any) -> tuple[str, bool] | None:
    """Why `leaf` cannot be saved, and whether its type is at fault (rather than
    its state), or `None` if it can."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return "a `jax.ShapeDtypeStruct`, which has no data: save the arrays", True
    if is_deleted(leaf):
        return (
            "deleted: donated to a function (`donate_argnums`, "
            "`Partitioner.move_to_devices`) or freed with `.delete()`; save what "
            "that function returned, or a copy kept before",
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
            f"  - '{path_str(path)}' ({leaf.dtype}{list(leaf.shape)}): {reason}."
            for path, leaf, reason, _ in bad[:10]
        ]
        more = [f"  ... and {len(bad) - 10} more."] if len(bad) > 10 else []
        head = (
            f"eqshard.{caller}: nothing was written, as these leaves cannot be saved:"
        )
        kind = TypeError if any(typed for *_, typed in bad) else ValueError
        raise kind("\n".join([head, *lines, *more]))
    return own


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


def _not_written(caller: str, path: str, error: Exception) -> ValueError:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    failure = ValueError(
        f"eqshard.{caller}: writing the checkpoint at {path!r} failed, so nothing "
        f"there was replaced: {first[:400]}"
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
    sharded or not, each process writing the shards it holds; everything else
    (static fields, callables, Python scalars, `None`) is not saved, and comes
    back from the `like` given to [`eqshard.restore`][]. So an Equinox module
    with activation functions, or an optax state, saves as it is: no
    `eqx.partition` first. The checkpoint is a standard orbax one (a flat dict of
    arrays keyed by path), readable by `orbax.checkpoint` directly, plus
    eqshard's file `eqshard.json` for what orbax cannot hold: zero-size arrays
    (by shape and dtype; plain orbax does not see them), and arrays of dtypes
    tensorstore lacks (uint4, uint2, float8_e4m3), whose bits orbax holds as
    an integer type of the same width.

    Every leaf is checked before anything is written, and the checkpoint is
    written beside `directory` and put in its place only when complete: a save
    that fails, at any point, leaves a checkpoint that was there as it was.
    Returns when the checkpoint is complete on disk.

    In a multi-process run, every process makes the same call (with the same
    `directory`, on a file system all of them see). The processes meet before
    writing and after: if one fails, or does not make the call within `timeout`
    seconds, all of them raise.

    **Arguments:**

    - `directory`: the checkpoint's directory; it must not exist yet.
    - `tree`: any pytree.
    - `overwrite`: replace a checkpoint (or an empty directory) at `directory`.
    - `timeout`: in a multi-process run, how many seconds each process waits
      for the others at each meeting (after writing its shards, for the
      slowest to write theirs).

    **Raises:**

    - `TypeError` naming every leaf that cannot be saved: `jax.ShapeDtypeStruct`s
      (no data), and dtypes orbax cannot store (text, Python objects); with them,
      deleted (donated) arrays, which alone raise `ValueError`.
    - `ValueError` if `directory` exists (and not `overwrite`), or holds something
      other than a checkpoint; naming both paths if two arrays have the same path
      string; if writing fails (nothing is replaced); and in a multi-process run,
      if another process failed, passed another tree, or did not make the call
      within `timeout` seconds.
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
    new = path + _NEW
    primary = jax.process_index() == 0
    cannot = f"the checkpoint at {path!r} is not written"
    rule = "Every process must make the same `save` call at the same point"
    failure: Exception | None = None
    named: dict[str, tuple[int, KeyPath, Any]] = {}
    own: dict[str, dict[str, Any]] = {}
    try:
        named = named_arrays(tree, caller)
        own = _check_leaves(named, caller)
        _check_directory(path, overwrite, caller)
        if primary:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _remove(new)  # left by a save that failed
            os.mkdir(new)
    except Exception as error:  # raised on every process, by `fail_together`
        failure = error
    rows = [(n, x.shape, x.dtype) for n, (_, _, x) in named.items()]
    handler = ocp.StandardCheckpointHandler()
    try:
        fail_together(caller, failure, timeout, rows=rows, cannot=cannot, rule=rule)
        items = _items(named, own)
        try:  # every process writes its shards
            if items:
                handler.save(epath.Path(new), args=ocp.args.StandardSave(items))
        except Exception as error:
            failure = _not_written(caller, path, error)
        fail_together(caller, failure, timeout, cannot=cannot, rule=rule)
        try:  # all have written: process 0 completes the checkpoint, and swaps
            if primary:
                if items:
                    handler.finalize(epath.Path(new))
                with open(os.path.join(new, _OWN_FILE), "w") as f:
                    json.dump({"version": 1, "orbax": bool(items), "arrays": own}, f)
                _swap(new, path)
        except Exception as error:
            failure = _not_written(caller, path, error)
        fail_together(caller, failure, timeout, cannot=cannot, rule=rule)
    finally:
        handler.close()
        if primary:  # after a failure: the new files go, the old stay
            _remove(new)


# ---------------------------------------------------------------------------------
# orbax: restore.
# ---------------------------------------------------------------------------------


def _is_read_error(error: Exception) -> bool:
    """Whether orbax's `error` says that files could not be read: a `ValueError`
    or `OSError` (tensorstore's errors are `ValueError`s), or the bare `Exception`
    orbax raises around one when a shard's read fails."""
    read = (ValueError, OSError)
    if type(error) is Exception:
        return isinstance(error.__cause__, read)
    return isinstance(error, read)


def _unreadable(
    caller: str, path: str, error: Exception, names: Sequence[str]
) -> ValueError:
    """The error for a checkpoint whose files are damaged, naming the arrays that
    orbax's message names."""
    cause = error.__cause__ if error.__cause__ is not None else error
    text = f"{error}\n{cause}"
    named = [n for n in names if f'"{n}/' in text or f"'{n}'" in text]
    where = f" (at {_list(named)})" if named else ""
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    first = first or type(error).__name__
    return ValueError(
        f"eqshard.{caller}: the checkpoint at {path!r} cannot be read{where}; its "
        f"files are truncated or damaged: {first[:400]}. Restore from another "
        "checkpoint, or save again."
    )


def _check_placeable(
    like: PyTree, leaves: list[Any], specs: PyTree, mesh: Any, caller: str
) -> None:
    """Raises, as `shard` does, naming every array of `like` whose spec cannot
    place it now (`P.UNCONSTRAINED` included)."""
    pairs = leaf_specs(specs, like, caller=caller)
    if any(isinstance(spec, PartitionSpec) for _, spec in pairs):
        mesh = require_mesh(mesh, caller=caller)
    check = ft.partial(check_placeable, check_spec_on_mesh)
    problems = check_leaves(pairs, leaves, mesh, check=check)
    if problems:
        raise ValueError(spec_error_message(caller, problems))


def _abstract_mesh_error(
    caller: str, paths: list[KeyPath], mesh: AbstractMesh
) -> TypeError:
    return TypeError(
        f"eqshard.{caller}: reads arrays onto devices, so it needs a concrete "
        f"`Mesh`, but the arrays at {_list([path_str(p) for p in paths])} would go "
        f"on an abstract mesh ({mesh}). Pass a mesh of devices as `mesh` "
        "(`eqshard.create_mesh(...)`, or a `jax.sharding.Mesh`), and "
        "`PartitionSpec`s rather than `NamedSharding`s on an abstract mesh as "
        "`specs`."
    )


def restore_targets(
    named: dict[str, tuple[int, KeyPath, Any]],
    placed: list[Any],
    casts: list[np.dtype | None],
    caller: str,
) -> dict[str, jax.ShapeDtypeStruct]:
    """A struct per name: the leaf's shape, the dtype JAX places (of its cast, or
    its own), and its sharding (that of its leaf in `placed`: the struct
    `abstract` made, or the leaf of `like` itself)."""
    targets = {}
    unplaced = []
    on_abstract = []
    for name, (i, path, leaf) in named.items():
        # A `None` spec keeps the leaf's own sharding.
        sharding = getattr(placed[i], "sharding", None) or getattr(
            leaf, "sharding", None
        )
        if not isinstance(sharding, Sharding):
            unplaced.append(path)
            continue
        if isinstance(sharding, NamedSharding) and not isinstance(sharding.mesh, Mesh):
            on_abstract.append((path, sharding.mesh))
            continue
        cast = casts[i]
        dtype = (
            leaf.dtype
            if is_key(leaf)
            else placed_dtype(np.dtype(leaf.dtype if cast is None else cast))
        )
        targets[name] = jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding)
    if on_abstract:
        paths = [path for path, _ in on_abstract]
        raise _abstract_mesh_error(caller, paths, on_abstract[0][1])
    if unplaced:
        raise ValueError(
            f"eqshard.{caller}: no sharding for the arrays at "
            f"{_list([path_str(p) for p in unplaced])}: `like` has NumPy arrays or "
            "structs without a sharding there, and `specs` gives none. Pass "
            "`specs` (and `mesh`), e.g. from `eqshard.match_partition_rules`."
        )
    return targets


def check_against(
    targets: dict[str, jax.ShapeDtypeStruct],
    named: dict[str, tuple[int, KeyPath, Any]],
    found: dict[str, tuple[tuple[int, ...], np.dtype]],
    casts: list[np.dtype | None],
    *,
    caller: str,
    where: str,
    fix: str,
    labels: dict[str, str] | None = None,
) -> None:
    """Raises one `ValueError` listing every name of `targets` missing from
    `found` (`{name: (shape, dtype)}` of what `where` holds), every name extra in
    it, and every one stored with another shape, or another dtype than `like`'s
    (unless both are placed as one, or a floating one is cast). `labels` add what
    a name is called in the files."""
    labels = labels or {}
    missing = [n for n in targets if n not in found]
    extra = [n for n in found if n not in targets]
    lines = []
    for name in targets:
        if name not in found:
            continue
        i, _, leaf = named[name]
        shape, dtype = stored_like(leaf)
        saved_shape, saved_dtype = found[name]
        label = f"'{name}'{labels.get(name, '')}"
        floating = jnp.issubdtype(saved_dtype, jnp.floating)
        if saved_shape != shape:
            lines.append(f"  - {label}: shape {saved_shape} there, {shape} in `like`.")
        elif not (
            placed_dtype(saved_dtype) == placed_dtype(dtype)
            or (casts[i] is not None and floating)
        ):
            hint = (
                " (pass `dtype=` to cast floating arrays)"
                if floating and jnp.issubdtype(dtype, jnp.floating)
                else ""
            )
            lines.append(f"  - {label}: {saved_dtype} there, {dtype} in `like`{hint}.")
    if missing:
        lines.insert(0, f"  - in `like`, not there: {_list(missing)}.")
    if extra:
        named_extra = [f"{n}{labels.get(n, '')}" for n in extra]
        lines.insert(0, f"  - there, not in `like`: {_list(named_extra)}.")
    if lines:
        raise ValueError(
            "\n".join(
                [f"eqshard.{caller}: {where} does not match `like`:", *lines, fix]
            )
        )


def _from_orbax(
    ocp: Any, path: str, layout: Any, wanted: dict[int, Any], caller: str
) -> dict[int, Any]:
    """The leaves of orbax's tree at the positions of `wanted`, each read as
    asked: a `jax.ShapeDtypeStruct` onto its sharding, a NumPy dtype whole on
    host. One read for all of them, and none of the others."""
    epath = import_optional("etils.epath", "orbax", caller)
    items: list[Any] = [ocp.PLACEHOLDER] * layout.num_leaves
    args: list[Any] = list(items)
    for k, want in wanted.items():
        if isinstance(want, jax.ShapeDtypeStruct):
            items[k] = want
            args[k] = ocp.checkpoint_utils.construct_restore_args(want)
        else:
            items[k] = 0
            args[k] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=want)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        got = handler.restore(
            epath.Path(path),
            args=ocp.args.PyTreeRestore(
                item=jtu.tree_unflatten(layout, items),
                restore_args=jtu.tree_unflatten(layout, args),
            ),
        )
    finally:
        handler.close()
    flat = layout.flatten_up_to(got)
    return {k: flat[k] for k in wanted}


def _made_empty(target: jax.ShapeDtypeStruct) -> jax.Array:
    """A zero-size array on its sharding (nothing to read). Made from host data:
    `jit` gives zero-size outputs blocks of the whole array's shape."""
    if not is_key(target):
        value = np.empty(target.shape, target.dtype)
        return jax.make_array_from_callback(
            value.shape, target.sharding, lambda index: value[index], dtype=value.dtype
        )
    data = jax.eval_shape(jax.random.key_data, target)
    data = _made_empty(
        jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=target.sharding)
    )
    impl = jax.random.key_impl(jnp.empty((0,), target.dtype))
    return jax.random.wrap_key_data(data, impl=impl)


def _from_bits(x: jax.Array, dtype: np.dtype, target: Any) -> jax.Array:
    """Bits read as the integer type orbax holds them in, viewed as `dtype` and cast
    to `target`, on their sharding."""

    def view(bits: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(bits, dtype).astype(target)

    return jax.jit(view, out_shardings=x.sharding)(x)


def _read(
    ocp: Any,
    path: str,
    layout: Any,
    saved: dict[str, _Saved],
    targets: dict[str, jax.ShapeDtypeStruct],
    caller: str,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """Every target read onto its sharding (`read` in the module docstring), and a
    float32 reading of every narrowed integer array, to check it by."""
    wanted: dict[int, Any] = {}
    twins: dict[int, Any] = {}
    out: dict[str, jax.Array] = {}
    for name, target in targets.items():
        s = saved[name]
        if s.position is None:
            out[name] = _made_empty(target)
            continue
        dtype = s.stored if s.stored != s.dtype else target.dtype
        wanted[s.position] = jax.ShapeDtypeStruct(
            target.shape, dtype, sharding=target.sharding
        )
        if s.dtype.kind in "iu" and s.dtype != target.dtype and not is_key(target):
            twins[s.position] = jax.ShapeDtypeStruct(
                target.shape, jnp.float32, sharding=target.sharding
            )
    got = _from_orbax(ocp, path, layout, wanted, caller) if wanted else {}
    read_twins = _from_orbax(ocp, path, layout, twins, caller) if twins else {}
    checks = {}
    for name, target in targets.items():
        s = saved[name]
        if s.position is None:
            continue
        value = got[s.position]
        if s.stored != s.dtype:
            value = _from_bits(value, s.dtype, target.dtype)
        out[name] = value
        if s.position in read_twins:
            checks[name] = read_twins[s.position]
    return out, checks


def _found_in_shards(
    restored: dict[str, jax.Array], checks: dict[str, jax.Array], cast: list[str]
) -> dict[str, list[int | float]]:
    """What this process's shards show, each block once (its replica 0), one at a
    time on host (no program to compile): for each narrowed integer array, the
    values that differ from its float32 reading (a wrapped value differs in
    magnitude), `[how many, lowest, highest]`; for each cast floating array, how
    many values are inf or nan, `[how many]`."""
    found: dict[str, list[int | float]] = {}
    for name, reading in checks.items():
        by_device = {shard.device: shard.data for shard in reading.addressable_shards}
        count, low, high = 0, np.inf, -np.inf
        for shard in restored[name].addressable_shards:
            if shard.replica_id == 0:
                twin = np.asarray(by_device[shard.device])
                bad = np.asarray(shard.data).astype(np.float32) != twin
                if bad.any():
                    count += int(bad.sum())
                    low = min(low, float(twin[bad].min()))
                    high = max(high, float(twin[bad].max()))
        found[name] = [count, low, high]
    for name in cast:
        shards = restored[name].addressable_shards
        found[name] = [
            sum(
                int(np.count_nonzero(~np.isfinite(np.asarray(shard.data))))
                for shard in shards
                if shard.replica_id == 0
            )
        ]
    return found


def _losses(
    ocp: Any,
    path: str,
    layout: Any,
    saved: dict[str, _Saved],
    restored: dict[str, jax.Array],
    checks: dict[str, jax.Array],
    meeting: Any,
) -> dict[str, Lost]:
    """What placing the restored arrays lost, by name (`Nothing lost` in the
    module docstring). `meeting(status)` gives every process's status."""
    cast = [
        name
        for name, x in restored.items()
        if saved[name].position is not None
        and x.dtype != saved[name].dtype
        and jnp.issubdtype(saved[name].dtype, jnp.inexact)
    ]
    if not (checks or cast):
        return {}
    found = _found_in_shards(restored, checks, cast)
    statuses = meeting(json.dumps(found))
    for p, status in statuses.items():  # the other processes' shards
        if p == jax.process_index():
            continue
        for name, (count, *extremes) in json.loads(status).items():
            found[name][0] += count
            if extremes:
                found[name][1] = min(found[name][1], extremes[0])
                found[name][2] = max(found[name][2], extremes[1])
    lost: dict[str, Lost] = {}
    for name in checks:
        count, low, high = found[name]
        if count:
            info = np.iinfo(restored[name].dtype)
            extreme = low if info.min - low > high - info.max else high
            lost[name] = Lost(np.dtype(restored[name].dtype), int(count), extreme)
    overflowed = [name for name in cast if found[name][0]]
    if overflowed:  # inf or nan: overflowed, or saved so? The saved values tell.
        positions = {n: typing.cast(int, saved[n].position) for n in overflowed}
        wanted = {positions[n]: saved[n].stored for n in overflowed}
        host = _from_orbax(ocp, path, layout, wanted, "restore")
        for name in overflowed:
            source = host[positions[name]].view(saved[name].dtype)
            _, found_lost = converted(source, np.dtype(restored[name].dtype))
            if found_lost is not None:
                lost[name] = found_lost
    return lost


@typecheck
def restore(
    directory: str | os.PathLike,
    like: PyTree,
    specs: PyTree = None,
    mesh: Mesh | AbstractMesh | None = None,
    *,
    dtype: Any = None,
    timeout: float | int = 300.0,
) -> PyTree:
    """Restores an [`eqshard.save`][] checkpoint onto any mesh.

    The arrays are read straight into their shardings: each device's shard is
    read from the files onto that device, on the mesh the checkpoint was saved
    on or any other, so no full copy of an array is ever on one device or on the
    host. Everything that is not an array comes from `like`, so
    `eqx.filter_eval_shape(Model, ...)` (no memory) is enough. Before any data is
    read, the checkpoint's names, shapes and dtypes are compared with `like`'s,
    and every difference is reported at once. A checkpoint that orbax wrote
    directly (a nested dict of arrays, say) restores too: its arrays are named by
    their paths, as `like`'s are.

    Values are never changed silently, with [`eqshard.shard`][]'s policy: a cast
    asked for with `dtype=` may round, but an array whose values would become inf
    or nan, or, with `jax_enable_x64` off, a 64-bit array whose values do not fit
    32 bits, is refused, naming every such array and its values.

    In a multi-process run, every process makes the same call, and reads only
    the shards its devices hold. The processes meet before reading and after: if
    one fails, or does not make the call within `timeout` seconds, all of them
    raise.

    **Arguments:**

    - `directory`: a checkpoint written by [`eqshard.save`][] (or by orbax).
    - `like`: a tree of the saved tree's structure, concrete or abstract; its
      array leaves give the shapes and dtypes, the rest is returned as it is.
    - `specs`: where to put the arrays: a spec tree for `like` (or a prefix of
      it), e.g. `eqshard.restrict_specs(specs, mesh)` for another mesh, partition
      rules, or a function of the abstract tree (see
      [the spec-tree family](specs.md)). `None` (the default, also at a leaf)
      keeps `like`'s own shardings: those of its `jax.Array`s, or of its structs
      made by [`eqshard.abstract`][].
    - `mesh`: the mesh for `PartitionSpec`s (a concrete one: arrays are read
      onto its devices); defaults to the mesh set by `jax.set_mesh`.
    - `dtype`: if given, floating arrays are cast to it as they are read: a
      floating dtype, or a tree of them and `None`s, as for [`eqshard.shard`][].
    - `timeout`: in a multi-process run, how many seconds each process waits
      for the others at each meeting (after reading its shards, for the
      slowest to read theirs).

    **Returns:**

    A tree of the structure of `like`, with the saved arrays on their shardings.

    **Raises:**

    - `ValueError` naming every array missing from the checkpoint, extra in it,
      or saved with another shape or dtype (without a cast); naming the arrays
      that get no sharding, or whose values would be lost (see above); if the
      checkpoint is not there, or its files are truncated or damaged; as
      [`eqshard.shard`][], if `specs` does not fit; and in a multi-process run,
      if another process failed, or did not make the call within `timeout`
      seconds.
    - `TypeError` naming the arrays that would go on an `AbstractMesh`.
    - `ImportError` if orbax-checkpoint is not installed.

    !!! Example

        ```python
        like = eqx.filter_eval_shape(Model, key=jax.random.key(0))
        model = eqshard.restore("/tmp/ckpt/step_100", like, specs, mesh)
        ```
    """
    caller = "restore"
    check_timeout(caller, timeout)
    ocp = import_optional("orbax.checkpoint", "orbax", caller)
    path = os.path.abspath(os.fspath(directory))
    cannot = f"the checkpoint at {path!r} is not read"
    rule = "Every process must make the same `restore` call at the same point"
    leaves, treedef = jtu.tree_flatten(like)
    failure: Exception | None = None
    named: dict[str, tuple[int, KeyPath, Any]] = {}
    targets: dict[str, jax.ShapeDtypeStruct] = {}
    saved: dict[str, _Saved] = {}
    casts: list[np.dtype | None] = []
    layout = None
    try:
        named = named_arrays(like, caller)
        if isinstance(mesh, AbstractMesh):
            raise _abstract_mesh_error(caller, [p for _, p, _ in named.values()], mesh)
        placed = leaves
        specs = resolve_specs(specs, like, caller=caller, mesh=mesh)
        if specs is not None:
            _check_placeable(like, leaves, specs, mesh, caller)
            placed = jtu.tree_leaves(abstract_tree(like, specs, mesh, caller=caller))
        casts = leaf_casts(dtype, like, caller=caller)
        targets = restore_targets(named, placed, casts, caller)
        saved, layout = _saved(ocp, path, caller)
        check_against(
            targets,
            named,
            {name: (s.shape, s.dtype) for name, s in saved.items()},
            casts,
            caller=caller,
            where=f"the checkpoint at {path!r}",
            fix="Pass the `like` of the tree that was saved (an "
            "`eqx.filter_eval_shape` skeleton of it is enough).",
        )
    except Exception as error:  # raised on every process, by `fail_together`
        failure = error
    rows = [(n, t.shape, t.dtype) for n, t in targets.items()]
    fail_together(caller, failure, timeout, rows=rows, cannot=cannot, rule=rule)
    restored: dict[str, jax.Array] = {}
    checks: dict[str, jax.Array] = {}
    try:
        restored, checks = _read(ocp, path, layout, saved, targets, caller)
    except Exception as error:  # orbax wraps a failed read in a bare `Exception`
        failure = (
            _unreadable(caller, path, error, list(targets))
            if _is_read_error(error)
            else error
        )
    fail_together(caller, failure, timeout, cannot=cannot, rule=rule)
    processes = tuple(range(jax.process_count()))
    lost = _losses(
        ocp,
        path,
        layout,
        saved,
        restored,
        checks,
        lambda status: meet(
            caller, processes, timeout, cannot=cannot, rule=rule, status=status
        ),
    )
    if lost:
        raise loss_error(
            caller,
            [
                (
                    named[name][1],
                    saved[name].dtype,
                    lost[name].dtype,
                    lost_text(lost[name]),
                    casts[named[name][0]] is not None,
                )
                for name in targets
                if name in lost
            ],
        )
    out = list(leaves)
    for name, (i, _, _) in named.items():
        out[i] = restored[name]
    return jtu.tree_unflatten(treedef, out)
