"""An orbax checkpoint on disk: its directory, eqshard's own file in it, what
it holds (read from its descriptions, no array data), and a complete checkpoint
put in the place of an old one.
"""

import json
import os
import shutil
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._tree import (
    collision_message,
    path_name,
    paths_text,
)
from .._typing import KeyPath
from ._targets import import_optional


OWN_FILE = "eqshard.json"
# orbax's own files: every orbax checkpoint has one of them.
ORBAX_FILES = ("_CHECKPOINT_METADATA", "_METADATA")
# Siblings of a checkpoint's directory: the new one while it is written, and the
# old one while the new one takes its place.
NEW, OLD = ".eqshard-new", ".eqshard-old"


def check_directory(path: str, overwrite: bool, caller: str) -> None:
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
    names = {OWN_FILE, *ORBAX_FILES}
    if entries and not names.intersection(entries):
        shown = [e + "/" * os.path.isdir(os.path.join(path, e)) for e in entries]
        raise ValueError(
            f"eqshard.{caller}: {path!r} is not a checkpoint (it holds "
            f"{paths_text(shown, 5)}, and neither eqshard's {OWN_FILE!r} nor orbax's "
            "metadata), so `overwrite=True` does not replace it. Save to another "
            "directory, or empty this one yourself."
        )


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def swap(new: str, path: str) -> None:
    """Puts the complete checkpoint at `new` in the place of `path`: with two
    renames, each atomic, so that `path` always holds a whole checkpoint except
    between them (when the old one is at `path + OLD`)."""
    if not os.path.lexists(path):
        os.rename(new, path)
        return
    old = path + OLD
    remove(old)  # left by a swap that stopped between the renames
    os.rename(path, old)
    try:
        os.rename(new, path)
    except BaseException:
        os.rename(old, path)
        raise
    remove(old)


class Saved(NamedTuple):
    """An array in a checkpoint."""

    shape: tuple[int, ...]
    dtype: np.dtype  # the array's own
    stored: np.dtype  # the one orbax holds its data in (its bits, for some dtypes)
    position: int | None  # among the leaves of orbax's tree; `None`: zero-size


def _no_checkpoint(path: str, caller: str) -> ValueError:
    old = path + OLD
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


def damaged_error(caller: str, where: str, what: str) -> ValueError:
    return ValueError(
        f"eqshard.{caller}: {where} is damaged: {what}. Restore from another "
        "checkpoint, or save again."
    )


def _read_own(path: str, caller: str) -> tuple[bool, dict[str, Saved]] | None:
    """eqshard's file in the checkpoint at `path`: whether orbax holds any array,
    and the arrays orbax does not hold as they are; `None` if there is no such
    file (a checkpoint orbax wrote alone)."""
    file = os.path.join(path, OWN_FILE)
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
            arrays[name] = Saved(shape, dtype, stored, None)
        return bool(own["orbax"]), arrays
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        raise damaged_error(
            caller, repr(file), f"{type(error).__name__}: {error}"
        ) from None


def _orbax_leaf(meta: Any) -> bool:
    return not isinstance(meta, dict | list | tuple)


class Held(NamedTuple):
    """How orbax holds a checkpoint's arrays: the structure of its tree, each
    leaf's name for its data among the checkpoint's files (`None` for a leaf
    that is not an array), and the format of those files."""

    layout: Any
    names: list[str | None]
    ocdbt: bool
    zarr3: bool


# A checkpoint whose arrays are all in eqshard's file (zero-size): orbax holds none.
NOTHING_HELD = Held(None, [], False, False)


def saved_arrays(ocp: Any, path: str, caller: str) -> tuple[dict[str, Saved], Held]:
    """`{name: Saved}` of the arrays in the checkpoint at `path`, and how orbax
    holds them, from the checkpoint's own descriptions of itself (no array
    data)."""
    if not os.path.isdir(path):
        raise _no_checkpoint(path, caller)
    own = _read_own(path, caller)
    if own is not None and not own[0]:
        return own[1], NOTHING_HELD
    epath = import_optional("etils.epath", "orbax", caller)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        metadata = handler.metadata(epath.Path(path))
        tree = metadata.tree
        ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(epath.Path(path))
    except FileNotFoundError:
        raise ValueError(
            f"eqshard.{caller}: {path!r} holds no checkpoint: neither eqshard's "
            f"{OWN_FILE!r} nor orbax's metadata is there. Check the path, and "
            "that `eqshard.save` finished there."
        ) from None
    except (ValueError, OSError, TypeError, KeyError, AttributeError) as error:
        raise unreadable_error(caller, path, error, []) from None
    finally:
        handler.close()
    path_leaves, layout = jtu.tree_flatten_with_path(tree, is_leaf=_orbax_leaf)
    found: dict[str, Saved] = {}
    where: dict[str, KeyPath] = {}
    names: list[str | None] = [None] * len(path_leaves)
    for index, (key, meta) in enumerate(path_leaves):
        if not (hasattr(meta, "shape") and hasattr(meta, "dtype")):
            continue
        file_name = getattr(meta, "name", None)
        names[index] = file_name if isinstance(file_name, str) else None
        name = path_name(key, "/") or "<root>"
        if name in found:
            message = collision_message(name, where[name], key)
            raise ValueError(f"eqshard.{caller}: in {path!r}: {message}")
        dtype = np.dtype(meta.dtype)
        shape = tuple(int(n) for n in meta.shape)
        found[name], where[name] = Saved(shape, dtype, dtype, index), key
    for name, entry in ({} if own is None else own[1]).items():
        if entry.stored == entry.dtype:
            found[name] = entry  # zero-size: in eqshard's file only
        elif name in found:  # bits that orbax holds as another dtype
            found[name] = found[name]._replace(dtype=entry.dtype)
        else:
            raise damaged_error(
                caller, repr(path), f"{OWN_FILE} names {name!r}, which orbax lacks"
            )
    zarr3 = bool(getattr(metadata, "use_zarr3", False))
    return found, Held(layout, names, bool(ocdbt), zarr3)


def is_read_error(error: Exception) -> bool:
    """Whether orbax's `error` says that files could not be read: a `ValueError`
    or `OSError` (tensorstore's errors are `ValueError`s), or the bare `Exception`
    orbax raises around one when a shard's read fails."""
    read = (ValueError, OSError)
    if type(error) is Exception:
        return isinstance(error.__cause__, read)
    return isinstance(error, read)


def unreadable_error(
    caller: str, path: str, error: Exception, names: Sequence[str]
) -> ValueError:
    """The error for a checkpoint whose files are damaged, naming the arrays that
    orbax's message names."""
    cause = error.__cause__ if error.__cause__ is not None else error
    text = f"{error}\n{cause}"
    named = [n for n in names if f'"{n}/' in text or f"'{n}'" in text]
    where = f" (at {paths_text(named)})" if named else ""
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    first = first or type(error).__name__
    return ValueError(
        f"eqshard.{caller}: the checkpoint at {path!r} cannot be read{where}; its "
        f"files are truncated or damaged: {first[:400]}. Restore from another "
        "checkpoint, or save again."
    )
