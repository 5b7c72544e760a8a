"""Checkpoints of any pytree, read straight into the shardings asked for.

`save`/`restore` write and read orbax checkpoints; `save_safetensors` and
`load_safetensors` the format published weights come in. Both optional
dependencies are imported inside the functions that use them, so `import
eqshard` never imports them.

How a checkpoint is read, in the order of `restore`:

1. **Name.** Every array leaf of `like` is named by its path (`layers/3/w`);
   everything else (static fields, callables, Python scalars) is not saved and
   comes back from `like`. A skeleton from `eqx.filter_eval_shape` is enough.
2. **Target.** Each name gets a `jax.ShapeDtypeStruct` with its sharding: the
   spec's on `mesh`, or the sharding `like`'s leaf already has, and the dtype it
   is cast to.
3. **Compare first.** The checkpoint's own metadata (names, shapes, dtypes) is
   compared with the targets, and every name missing, extra or different is
   reported together before any data is read.
4. **Read.** orbax reads each device's shard straight from the files onto that
   device (no full copy of an array on any device or on the host); in a
   multi-process run each process reads only the shards its devices hold.
"""

import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh, Sharding
from jaxtyping import PyTree

from ._derive import abstract
from ._host import leaf_casts
from ._keys import is_key
from ._shard import abstract_leaf_error
from ._tree import collision_message, is_array, path_name, path_str
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
    """The shape and dtype a leaf has in a checkpoint: a typed PRNG key's data."""
    if is_key(leaf):
        leaf = jax.eval_shape(jax.random.key_data, leaf)
    return tuple(int(n) for n in leaf.shape), np.dtype(leaf.dtype)


# ---------------------------------------------------------------------------------
# orbax: save and restore.
# ---------------------------------------------------------------------------------


@typecheck
def save(
    directory: str | os.PathLike, tree: PyTree, *, overwrite: bool = False
) -> None:
    """Saves the arrays of a pytree as an orbax checkpoint.

    Every array leaf (`jax.Array`, NumPy) is saved under its path (`layers/3/w`),
    sharded or not, each process writing the shards it holds; everything else
    (static fields, callables, Python scalars, `None`) is not saved, and comes
    back from the `like` given to [`eqshard.restore`][]. So an Equinox module
    with activation functions, or an optax state, saves as it is: no
    `eqx.partition` first. The checkpoint is a standard orbax one (a flat dict of
    arrays keyed by path), readable by `orbax.checkpoint` directly. Returns when
    the checkpoint is complete on disk.

    In a multi-process run, every process makes the same call (with the same
    `directory`, on a file system all of them see).

    **Arguments:**

    - `directory`: the checkpoint's directory; it must not exist yet.
    - `tree`: any pytree.
    - `overwrite`: replace an existing checkpoint at `directory`.

    **Raises:**

    - `ValueError` if `directory` exists (and not `overwrite`), or naming both
      paths if two arrays have the same path string.
    - `TypeError` if `tree` holds `jax.ShapeDtypeStruct`s (no data to save).
    - `ImportError` if orbax-checkpoint is not installed
      (`pip install "eqshard[orbax]"`).

    !!! Example

        ```python
        eqshard.save("/tmp/ckpt/step_100", (model, opt_state))
        ```
    """
    caller = "save"
    ocp = import_optional("orbax.checkpoint", "orbax", caller)
    named = named_arrays(tree, caller)
    structs = [p for _, p, x in named.values() if isinstance(x, jax.ShapeDtypeStruct)]
    if structs:
        raise abstract_leaf_error(caller, structs)
    path = os.path.abspath(os.fspath(directory))
    if os.path.exists(path) and not overwrite:
        raise ValueError(
            f"eqshard.{caller}: {path!r} already exists. Save to a new directory "
            "(e.g. one per step), or pass `overwrite=True` to replace it."
        )
    checkpointer = ocp.StandardCheckpointer()
    try:
        checkpointer.save(
            path, {n: x for n, (_, _, x) in named.items()}, force=overwrite
        )
        checkpointer.wait_until_finished()
    finally:
        checkpointer.close()


def _metadata(checkpointer: Any, path: str, caller: str) -> dict[str, Any]:
    """`{name: metadata}` of the arrays saved at `path`, read from the
    checkpoint's own description of itself (no array data)."""
    if not os.path.isdir(path):
        raise ValueError(
            f"eqshard.{caller}: there is no checkpoint at {path!r} (no such "
            "directory). Check the path, and that `eqshard.save` finished there."
        )
    try:
        found = checkpointer.metadata(path)
    except (ValueError, OSError) as error:
        raise _unreadable(caller, path, error, []) from None
    tree = getattr(getattr(found, "item_metadata", None), "tree", None)
    if not isinstance(tree, dict):
        raise ValueError(
            f"eqshard.{caller}: {path!r} holds no readable checkpoint: its orbax "
            "metadata is missing or damaged. Restore from another checkpoint, or "
            "save again."
        )
    return tree


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


def restore_targets(
    named: dict[str, tuple[int, KeyPath, Any]],
    placed: list[Any],
    casts: list[np.dtype | None],
    caller: str,
) -> dict[str, jax.ShapeDtypeStruct]:
    """A struct per name: the leaf's shape, its dtype or cast, and its sharding
    (that of its leaf in `placed`: the struct `abstract` made, or the leaf of
    `like` itself)."""
    targets = {}
    unplaced = []
    for name, (i, path, leaf) in named.items():
        # A `None` spec keeps the leaf's own sharding.
        sharding = getattr(placed[i], "sharding", None) or getattr(
            leaf, "sharding", None
        )
        if not isinstance(sharding, Sharding):
            unplaced.append(path)
            continue
        dtype = casts[i] or leaf.dtype
        targets[name] = jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding)
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
    (unless cast). `labels` add what a name is called in the files."""
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
        if saved_shape != shape:
            lines.append(f"  - {label}: shape {saved_shape} there, {shape} in `like`.")
        elif casts[i] is None and saved_dtype != dtype:
            lines.append(
                f"  - {label}: {saved_dtype} there, {dtype} in `like` (pass "
                "`dtype=` to cast floating arrays)."
            )
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


@typecheck
def restore(
    directory: str | os.PathLike,
    like: PyTree,
    specs: PyTree = None,
    mesh: Mesh | AbstractMesh | None = None,
    *,
    dtype: Any = None,
) -> PyTree:
    """Restores an [`eqshard.save`][] checkpoint onto any mesh.

    The arrays are read straight into their shardings: each device's shard is
    read from the files onto that device, on the mesh the checkpoint was saved
    on or any other, so no full copy of an array is ever on one device or on the
    host. Everything that is not an array comes from `like`, so
    `eqx.filter_eval_shape(Model, ...)` (no memory) is enough. Before any data is
    read, the checkpoint's names, shapes and dtypes are compared with `like`'s,
    and every difference is reported at once.

    In a multi-process run, every process makes the same call, and reads only
    the shards its devices hold.

    **Arguments:**

    - `directory`: a checkpoint written by [`eqshard.save`][].
    - `like`: a tree of the saved tree's structure, concrete or abstract; its
      array leaves give the shapes and dtypes, the rest is returned as it is.
    - `specs`: where to put the arrays: a spec tree for `like` (or a prefix of
      it), e.g. `eqshard.restrict_specs(specs, mesh)` for another mesh. `None`
      (the default, also at a leaf) keeps `like`'s own shardings: those of its
      `jax.Array`s, or of its structs made by [`eqshard.abstract`][].
    - `mesh`: the mesh for `PartitionSpec`s; defaults to the mesh set by
      `jax.set_mesh`.
    - `dtype`: if given, floating arrays are cast to it as they are read: a
      floating dtype, or a tree of them and `None`s, as for [`eqshard.shard`][].

    **Returns:**

    A tree of the structure of `like`, with the saved arrays on their shardings.

    **Raises:**

    - `ValueError` naming every array missing from the checkpoint, extra in it,
      or saved with another shape or dtype (without a cast); naming the arrays
      that get no sharding; if the checkpoint is not there, or its files are
      truncated or damaged; or, as [`eqshard.shard`][], if `specs` does not fit.
    - `ImportError` if orbax-checkpoint is not installed.

    !!! Example

        ```python
        like = eqx.filter_eval_shape(Model, key=jax.random.key(0))
        model = eqshard.restore("/tmp/ckpt/step_100", like, specs, mesh)
        ```
    """
    caller = "restore"
    ocp = import_optional("orbax.checkpoint", "orbax", caller)
    named = named_arrays(like, caller)
    leaves, treedef = jtu.tree_flatten(like)
    placed = leaves if specs is None else jtu.tree_leaves(abstract(like, specs, mesh))
    casts = leaf_casts(dtype, like, caller=caller)
    targets = restore_targets(named, placed, casts, caller)
    path = os.path.abspath(os.fspath(directory))
    checkpointer = ocp.StandardCheckpointer()
    try:
        saved = {
            name: (tuple(int(n) for n in meta.shape), np.dtype(meta.dtype))
            for name, meta in _metadata(checkpointer, path, caller).items()
        }
        check_against(
            targets,
            named,
            saved,
            casts,
            caller=caller,
            where=f"the checkpoint at {path!r}",
            fix="Pass the `like` of the tree that was saved (an "
            "`eqx.filter_eval_shape` skeleton of it is enough).",
        )
        try:
            restored = checkpointer.restore(path, targets)
        except Exception as error:  # orbax wraps a failed read in a bare `Exception`
            if not _is_read_error(error):
                raise
            raise _unreadable(caller, path, error, list(targets)) from None
    finally:
        checkpointer.close()
    out = list(leaves)
    for name, (i, _, _) in named.items():
        out[i] = restored[name]
    return jtu.tree_unflatten(treedef, out)
