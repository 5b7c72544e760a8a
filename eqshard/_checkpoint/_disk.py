"""An orbax checkpoint on disk: its directory (what `overwrite=True` may
replace), eqshard's own file in it (every field checked to be what `save`
writes, and to agree with orbax's metadata), and what it holds (read from its
descriptions, no array data). The lock and the swap are `_swap.py`'s.
"""

import glob
import json
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._tree import (
    collision_message,
    path_name,
    path_str,
    paths_text,
)
from .._typing import KeyPath
from ._swap import LOCK, lock_holder, OLD, OWN_FILE, read_regular
from ._targets import import_optional


# orbax's own files: every orbax checkpoint has one of them.
ORBAX_FILES = ("_CHECKPOINT_METADATA", "_METADATA")
# What orbax and eqshard write in a checkpoint's directory, by kind: each entry's
# name, and `None` for a regular file or, for a directory, what it holds in turn
# (beside a directory per array, named as its metadata names it, where the
# checkpoint is not OCDBT's: `_CHUNKS`).
_Kinds: TypeAlias = "list[tuple[re.Pattern[str], _Kinds | None]]"


def _kinds(*entries: tuple[str, "_Kinds | None"]) -> _Kinds:
    return [(re.compile(name), kind) for name, kind in entries]


_DATA = _kinds((r"[0-9a-f]+", None))  # OCDBT's data files
_CHUNKS = _kinds((r"\.z(array|attrs|group)|zarr\.json|\d+(\.\d+)*", None))
_CHUNKS += _kinds((r"c|\d+", _CHUNKS))  # zarr3's chunk directories
_CHECKPOINT = _kinds(
    (
        r"_CHECKPOINT_METADATA|_METADATA|_ROOT_METADATA|_sharding|manifest\.ocdbt|"
        r"commit_success\.txt|orbax\.checkpoint|eqshard\.json",
        None,
    ),
    ("d", _DATA),
    (
        r"ocdbt\.process_(replica_)?\d+",
        _kinds((r"manifest\.ocdbt", None), ("d", _DATA)),
    ),
    ("array_metadatas", _kinds((r"process_\d+", None))),
)


def _foreign(directory: str, kinds: _Kinds, prefix: str = "") -> list[str]:
    """The entries under `directory` (named from it, a directory's with a '/')
    that are not of the kind `kinds` says their names are: another kind (a
    directory named as a file, a link), or a name it does not know."""
    found = []
    with os.scandir(directory) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            name = prefix + entry.name
            is_dir = entry.is_dir(follow_symlinks=False)
            kind = next((k for p, k in kinds if p.fullmatch(entry.name)), False)
            if is_dir and isinstance(kind, list):
                found += _foreign(entry.path, kind, name + "/")
            elif kind is not None or not entry.is_file(follow_symlinks=False):
                found.append(name + "/" * is_dir)
    return found


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
    foreign = _foreign(path, _CHECKPOINT)
    for name in sorted(_array_entries(path) if foreign else ()):
        if name + "/" in foreign:  # an array's directory (not OCDBT's checkpoint)
            foreign.remove(name + "/")
            foreign += _foreign(os.path.join(path, name), _CHUNKS, name + "/")
    if foreign:
        raise ValueError(
            f"eqshard.{caller}: {path!r} holds a checkpoint and also "
            f"{paths_text(sorted(foreign), 5)}, which is not part of it (neither "
            "orbax nor eqshard writes it there): `overwrite=True` replaces the whole "
            "directory, so it would be deleted. Move it out of the directory (or "
            "save to another one), and save again."
        )


# What orbax's reader of a damaged metadata file raises: no file or a directory
# (OSError), text that is not JSON or not UTF-8 (ValueError), JSON of another
# shape (KeyError, AttributeError, TypeError).
_DAMAGED = (OSError, ValueError, LookupError, AttributeError, TypeError)


def _array_entries(path: str) -> set[str]:
    """The names of the arrays orbax's metadata describes at `path` (the names of
    their directories, where the checkpoint is not OCDBT's); none if it cannot be
    read."""
    ocp = import_optional("orbax.checkpoint", "orbax", "save")
    epath = import_optional("etils.epath", "orbax", "save")
    handler = ocp.PyTreeCheckpointHandler()
    try:
        tree = handler.metadata(epath.Path(path)).tree
    except _DAMAGED:  # a damaged checkpoint: its directories are not told apart
        return set()
    finally:
        handler.close()
    leaves = jtu.tree_leaves(tree, is_leaf=_orbax_leaf)
    return {m.name for m in leaves if isinstance(getattr(m, "name", None), str)}


class Saved(NamedTuple):
    """An array in a checkpoint."""

    shape: tuple[int, ...]
    dtype: np.dtype  # the array's own
    stored: np.dtype  # the one orbax holds its data in (its bits, for some dtypes)
    position: int | None  # among the leaves of orbax's tree; `None`: zero-size
    # Saved as a circular pipeline's view of stacked layers (`_views.py`).
    stage_view: bool = False


class SaveInProgressError(ValueError):
    """No checkpoint, and a save to it holds its lock: the message says so
    (`restore` adds nothing then)."""


def _no_checkpoint(path: str, caller: str) -> ValueError:
    holder = lock_holder(path)
    old = sorted(glob.glob(glob.escape(path + OLD) + "*"))
    if holder is not None:
        hint = (
            f" A save to it is in progress, or stopped midway: {holder} holds "
            f"{path + LOCK!r}. Retry when that save has finished."
        )
    elif old:
        hint = (
            " A save that was replacing it stopped midway: the checkpoint that "
            f"was there is at {paths_text(old, 3)}; rename it back."
        )
    else:
        hint = " Check the path, and that `eqshard.save` finished there."
    kind = ValueError if holder is None else SaveInProgressError
    return kind(
        f"eqshard.{caller}: there is no checkpoint at {path!r} (no such "
        f"directory).{hint}"
    )


def damaged_error(caller: str, where: str, what: str) -> ValueError:
    return ValueError(
        f"eqshard.{caller}: {where} is damaged: {what}. Restore from another "
        "checkpoint, or save again."
    )


class _Lie(Exception):
    """A field of eqshard's file that is not what `save` writes: its path in the
    file, and what is wrong with it."""

    def __init__(self, field: str, what: str):
        super().__init__(field, what)
        self.field, self.what = field, what


def _dtype_field(value: Any, field: str) -> np.dtype:
    """The dtype `save` wrote as `value`: the name of a numeric or boolean dtype."""
    try:
        dtype = np.dtype(jnp.dtype(value)) if isinstance(value, str) else None
    except (TypeError, ValueError):
        dtype = None
    if (
        dtype is None
        or dtype.name != value
        or not (jnp.issubdtype(dtype, jnp.number) or dtype == np.bool_)
    ):
        raise _Lie(field, f"is {value!r}, not the name of a numeric dtype")
    return dtype


def _entry(name: str, entry: Any) -> Saved:
    """An entry of eqshard's file, as `save` writes it, or `_Lie`."""
    field = f"arrays/{name}"
    if not isinstance(entry, dict) or set(entry) != {"shape", "dtype", "saved_as"}:
        raise _Lie(field, "is not {'shape': ..., 'dtype': ..., 'saved_as': ...}")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(
        type(n) is int and 0 <= n < 2**62 for n in shape
    ):
        raise _Lie(f"{field}/shape", f"is {shape!r}, not a list of sizes")
    dtype = _dtype_field(entry["dtype"], f"{field}/dtype")
    bits = entry["saved_as"]
    if bits is None:
        if 0 not in shape:
            raise _Lie(
                f"{field}/shape",
                f"is {shape!r}, yet 'saved_as' is null: only a zero-size array is "
                "held in this file alone (it has no data)",
            )
        return Saved(tuple(shape), dtype, dtype, None)
    stored = _dtype_field(bits, f"{field}/saved_as")
    width = jax.dtypes.itemsize_bits
    if stored == dtype or width(stored) != width(dtype):
        raise _Lie(
            f"{field}/saved_as",
            f"is {bits!r}, which does not hold the bits of {dtype.name} (another "
            "dtype of the same width)",
        )
    return Saved(tuple(shape), dtype, stored, None)


def _stage_views(own: dict[str, Any]) -> set[str]:
    """The names in eqshard's file of the arrays saved as a circular pipeline's
    view (none in a file written before `save` recorded them), or `_Lie`."""
    views = own.get("stage_views", [])
    if not isinstance(views, list) or not all(isinstance(n, str) for n in views):
        raise _Lie("stage_views", f"is {views!r}, not a list of array names")
    return set(views)


def _read_own(path: str, caller: str) -> tuple[bool, dict[str, Saved], set[str]] | None:
    """eqshard's file in the checkpoint at `path`: whether orbax holds any array,
    the arrays orbax does not hold as they are, and the names of those saved as
    a circular pipeline's view; `None` if there is no such file (a checkpoint
    orbax wrote alone). Every field is checked to be what `save` writes."""
    file = os.path.join(path, OWN_FILE)
    try:
        raw = read_regular(file, 1 << 26)
        if raw is None:
            return None
        own = json.loads(raw)
        if not isinstance(own, dict):
            raise _Lie("<root>", "is not a JSON object")
        if own.get("version") != 1 or type(own.get("version")) is not int:
            raise _Lie("version", f"is {own.get('version')!r}: this eqshard reads 1")
        if type(own.get("orbax")) is not bool:
            raise _Lie("orbax", f"is {own.get('orbax')!r}, not true or false")
        arrays = own.get("arrays")
        if not isinstance(arrays, dict):
            raise _Lie("arrays", f"is {arrays!r}, not an object")
        found = {name: _entry(name, entry) for name, entry in arrays.items()}
        if not own["orbax"]:
            held = [n for n, s in found.items() if s.stored != s.dtype]
            if held:
                raise _Lie(
                    f"arrays/{held[0]}/saved_as",
                    "names the dtype orbax holds the array in, yet 'orbax' is false",
                )
        return own["orbax"], found, _stage_views(own)
    except _Lie as lie:
        raise lie_error(caller, file, lie.field, lie.what) from None
    except (OSError, ValueError) as error:
        raise damaged_error(
            caller, repr(file), f"{type(error).__name__}: {error}"
        ) from None


def lie_error(caller: str, file: str, field: str, what: str) -> ValueError:
    return damaged_error(caller, repr(file), f"its field '{field}' {what}")


def check_apart(
    arrays: Iterable[tuple[KeyPath, str]], *, where: str, caller: str
) -> None:
    """Raises if two of `arrays` (each its path and its name in orbax's files)
    have one place for their data there: orbax joins a path's keys with '.'
    (`{"a": {"b": x}}` and `{"a.b": y}`), and tensorstore reads a name and the
    same name with one '/' more (`a` and `a/`) as one place, so one array's data
    overwrites the other's. `where` begins the message's account of it."""
    holder: dict[str, tuple[KeyPath, str]] = {}
    for key, name in arrays:
        place = name if name.endswith("/") else name + "/"
        if place in holder:
            first = holder[place]
            raise ValueError(
                f"eqshard.{caller}: {where} the arrays at '{path_str(first[0])}' "
                f"and '{path_str(key)}' in one place, as {first[1]!r} and "
                f"{name!r} (orbax joins a path's keys with '.', and tensorstore "
                "reads a name and the same name with one '/' more as one), so the "
                "files keep the data of only one of them. Rename one of the keys, "
                "and save again."
            )
        holder[place] = (key, name)


def _orbax_leaf(meta: Any) -> bool:
    return not isinstance(meta, dict | list | tuple)


class Held(NamedTuple):
    """How orbax holds a checkpoint's arrays: the structure of its tree, each
    leaf's name for its data among the checkpoint's files (`None` for a leaf
    that is not an array), and the format of those files."""

    layout: Any
    names: list[str | None]
    zarr3: bool


# A checkpoint whose arrays are all in eqshard's file (zero-size): orbax holds none.
NOTHING_HELD = Held(None, [], False)


def saved_arrays(ocp: Any, path: str, caller: str) -> tuple[dict[str, Saved], Held]:
    """`{name: Saved}` of the arrays in the checkpoint at `path`, and how orbax
    holds them, from the checkpoint's own descriptions of itself (no array
    data)."""
    if not os.path.isdir(path):
        raise _no_checkpoint(path, caller)
    own = _read_own(path, caller)
    file = os.path.join(path, OWN_FILE)
    described = os.path.lexists(os.path.join(path, "_METADATA"))
    if own is not None and not own[0]:
        if described:
            raise lie_error(
                caller, file, "orbax", "is false, yet orbax's metadata is there"
            )
        return _with_views(own[1], own[2], caller, file), NOTHING_HELD
    if own is not None and not described:
        raise lie_error(
            caller, file, "orbax", "is true, yet orbax's metadata is not there"
        )
    epath = import_optional("etils.epath", "orbax", caller)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        metadata = handler.metadata(epath.Path(path))
        tree = metadata.tree
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
    check_apart(
        (
            (key, name)
            for (key, _), name in zip(path_leaves, names, strict=True)
            if name is not None
        ),
        where=f"the checkpoint at {path!r} holds",
        caller=caller,
    )
    if own is not None:
        _with_own(found, own[1], caller, file)
    zarr3 = bool(getattr(metadata, "use_zarr3", False))
    views = set() if own is None else own[2]
    return _with_views(found, views, caller, file), Held(layout, names, zarr3)


def _with_own(
    found: dict[str, Saved], own: dict[str, Saved], caller: str, file: str
) -> None:
    """Adds to `found` (orbax's arrays) eqshard's file's entries: the arrays held
    in that file alone, and the dtypes of those whose bits orbax holds as
    another; each checked to agree with orbax's metadata."""
    for name, entry in own.items():
        field = f"arrays/{name}"
        if entry.stored == entry.dtype:  # zero-size: in eqshard's file only
            if name in found:
                raise lie_error(
                    caller,
                    file,
                    field,
                    "says it is held here alone, yet orbax holds it",
                )
            found[name] = entry
            continue
        if name not in found:
            raise lie_error(caller, file, field, "names an array orbax does not hold")
        held = found[name]  # bits that orbax holds as another dtype
        if held.dtype != entry.stored:
            raise lie_error(
                caller,
                file,
                f"{field}/saved_as",
                f"is {entry.stored.name!r}, but orbax holds {held.dtype.name}",
            )
        if held.shape != entry.shape:
            raise lie_error(
                caller,
                file,
                f"{field}/shape",
                f"is {list(entry.shape)}, but orbax holds shape {list(held.shape)}",
            )
        found[name] = held._replace(dtype=entry.dtype)


def _with_views(
    found: dict[str, Saved], views: set[str], caller: str, file: str
) -> dict[str, Saved]:
    """`found`, the arrays named in `views` marked as saved in a circular
    pipeline's view: each one the checkpoint holds, of three axes or more."""
    for name in sorted(views):
        if name not in found or len(found[name].shape) < 3:
            what = (
                "which the checkpoint does not hold"
                if name not in found
                else f"of shape {list(found[name].shape)}: not three layer axes"
            )
            raise lie_error(caller, file, "stage_views", f"names {name!r}, {what}")
        found[name] = found[name]._replace(stage_view=True)
    return found


def check_staged(ocp: Any, staged: str, names: Sequence[str], caller: str) -> None:
    """Raises unless the checkpoint just written at `staged` reads back: its own
    descriptions name every array saved (`names`), and the files they point to
    are there (the index of OCDBT's files, or each array's directory)."""
    found, held = saved_arrays(ocp, staged, caller)
    missing = [f"the array {name!r}" for name in names if name not in found]
    entries = os.listdir(staged)
    if any(e.startswith("ocdbt.process_") for e in entries):
        if "manifest.ocdbt" not in entries:
            missing.append("the index of its files ('manifest.ocdbt')")
    else:
        missing += [
            f"the directory of {name!r}"
            for name in held.names
            if name is not None and not os.path.isdir(os.path.join(staged, name))
        ]
    if missing:
        raise ValueError(
            f"eqshard.{caller}: the checkpoint written at {staged!r} does not read "
            f"back: {'; '.join(missing[:3])} missing"
        )


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
