"""safetensors files, read shard by shard and written leaf by leaf.

How `load_safetensors` reads:

1. **Which files.** The files given, or those a Hugging Face index
   (`*.index.json`) lists. An index may name only `.safetensors` files in its
   own directory: each entry is resolved (`os.path.realpath`, symlinks
   included) and must lie in the index's directory, as given or as the index's
   own link resolves (the Hugging Face cache links both into `blobs/`). So
   `../x.safetensors`, `/etc/passwd`, a link out of the directory, and an index
   named in an index are refused; nothing is ever unpickled.
2. **Headers.** safetensors itself checks each header against its file
   (`safe_open`: every tensor's bytes in the file, each byte once); its error
   becomes eqshard's, naming the file. The header (names, dtypes, shapes,
   offsets) is then read here: safetensors' NumPy reader knows no float8.
3. **Compare first.** `like`'s arrays are named by their paths joined by `sep`,
   each tensor name is mapped onto them (`rename`), and every tensor missing,
   extra, or of another shape or dtype is reported before any data is read.
4. **Read.** Each distinct block that this process's devices hold is read
   once into a buffer of its own, which becomes the device's without another
   copy on CPU devices (`_safetensors_reads.py`): a block that is one run of the
   file by `os.preadv`, a strided one copied out of the file mapped for that
   tensor only. So the host holds one tensor's blocks at a time, never a whole
   file, and no device's data is a mapping of the file. In a multi-process
   run each process reads only the blocks its devices hold. A typed PRNG key
   is read as its data (`jax.random.key_data`) and wrapped again.

How `save_safetensors` writes: the format itself (an 8-byte header length, a
JSON header, the raw bytes), so that the header is written from the shapes alone
and the data streamed from [`eqshard.iter_gather`][], one array on host at a
time, into a partial file of its own beside `path` (`path.partial-<hex>`),
renamed to `path` only when complete and removed on any failure (a file already
at `path` stays as it was, and is replaced only with `overwrite=True`, and only
if it is a regular file). In a multi-process run
process 0 writes. The processes of arrays spread over several meet at a barrier
first, so a process that makes the call alone raises after `timeout` instead of
waiting forever in a collective; process 0 takes part in gathering to the end
even if writing failed, then tells the others whether the file is complete, so
every process returns once it is, or raises.
"""

import contextlib
import json
import math
import os
import stat
import struct
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh
from jaxtyping import PyTree

from .._keys import is_key, key_impl_name
from .._mesh._current import find_mesh
from .._mesh._targets import require_runnable
from .._move._gather import iter_gather
from .._move._host import converted, leaf_casts, loss_error, Lost, lost_text, more_lost
from .._move._multiprocess import (
    check_timeout,
    fail_together,
    is_global,
    wait_for_processes,
)
from .._spectree._derive import abstract_tree
from .._spectree._resolve import resolve_specs
from .._tree import abstract_leaf_error, path_str
from .._typing import typecheck
from ._safetensors_files import DTYPES, files_of, header, NAMES
from ._safetensors_reads import block_bounds, place, read_tensor
from ._swap import rename_no_replace
from ._targets import (
    check_against,
    import_optional,
    named_arrays,
    stored_like,
    target_structs,
)


# ---------------------------------------------------------------------------------
# Reading, block by block.
# ---------------------------------------------------------------------------------


def _load(
    path: str,
    start: int,
    shape: tuple[int, ...],
    stored: np.dtype,
    target: jax.ShapeDtypeStruct,
    cast: np.dtype | None,
    caller: str,
) -> tuple[jax.Array, Lost | None]:
    """One array of `shape` and `stored` dtype, at byte `start` of `path`: each
    distinct block this process's devices hold read once into a buffer of its
    own (`_safetensors_reads.py`), converted as `shard` converts host data (to
    `cast`, or to the dtype JAX places), and placed. A typed key (`target`'s
    dtype) is read as its data, then wrapped. Returns the array and what
    converting its blocks lost."""
    sharding = target.sharding
    where = block_bounds(sharding, shape)
    blocks = read_tensor(path, start, shape, stored, list(where.values()), caller)
    lost: Lost | None = None
    for bounds, value in blocks.items():
        blocks[bounds], block_lost = converted(value, cast)
        lost = more_lost(lost, block_lost)
    array = place(shape, sharding, blocks, where)
    if is_key(target):
        array = jax.random.wrap_key_data(array, impl=key_impl_name(target))
    return array, lost


def _load_tree(
    files: str | os.PathLike | Sequence[str | os.PathLike],
    like: PyTree,
    specs: PyTree,
    mesh: Mesh | AbstractMesh | None,
    sep: str,
    rename: Callable[[str], str | None] | None,
    dtype: Any,
    caller: str,
) -> PyTree:
    """`load_safetensors` on this process (steps 1 to 4 of the module's
    docstring)."""
    require_runnable(caller, find_mesh(mesh))
    safetensors = import_optional("safetensors", "safetensors", caller)
    named = named_arrays(like, caller, sep)
    leaves, treedef = jtu.tree_flatten(like)
    specs = resolve_specs(specs, like, caller=caller, mesh=mesh)
    placed = (
        leaves
        if specs is None
        else jtu.tree_leaves(abstract_tree(like, specs, mesh, caller=caller))
    )
    casts = leaf_casts(dtype, like, caller=caller)
    targets = target_structs(named, placed, casts, caller)
    found: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    sources: dict[str, tuple[str, int]] = {}  # name -> (file, data offset)
    labels: dict[str, str] = {}
    for path in files_of(files, caller):
        data_start, tensors = header(safetensors, path, caller)
        for tensor, (kind, shape, offset) in tensors.items():
            name = tensor if rename is None else rename(tensor)
            if name is None:
                continue
            label = (
                f" (tensor {tensor!r} of {os.path.basename(path)})"
                if name != tensor
                else f" (in {os.path.basename(path)})"
            )
            if name in found:
                raise ValueError(
                    f"eqshard.{caller}: two tensors are named {name!r}: "
                    f"{labels[name].strip()[1:-1]} and {label.strip()[1:-1]}. "
                    "Make `rename` map them to different names, or to `None` "
                    "to skip one."
                )
            if kind not in DTYPES:
                raise TypeError(
                    f"eqshard.{caller}: the tensor {tensor!r} of {path!r} has "
                    f"dtype {kind}, which eqshard cannot read (it reads "
                    f"{', '.join(DTYPES)})."
                )
            found[name] = (shape, DTYPES[kind])
            sources[name] = (path, data_start + offset)
            labels[name] = label
    check_against(
        targets,
        named,
        found,
        casts,
        caller=caller,
        where="what the safetensors files hold",
        fix=f"Tensor names are `like`'s paths joined by sep={sep!r}; map the "
        "files' names onto them with `rename=`.",
        labels=labels,
    )
    out = list(leaves)
    losses = []
    for name, (i, key, _) in named.items():
        path, start = sources[name]
        shape, stored = found[name]
        out[i], lost = _load(
            path, start, shape, stored, targets[name], casts[i], caller
        )
        if lost is not None:
            asked = casts[i] is not None
            losses.append((key, stored, lost.dtype, lost_text(lost), asked))
    if losses:
        raise loss_error(caller, losses)
    return jtu.tree_unflatten(treedef, out)


@typecheck
def load_safetensors(
    files: str | os.PathLike | Sequence[str | os.PathLike],
    like: PyTree,
    specs: PyTree = None,
    mesh: Mesh | AbstractMesh | None = None,
    *,
    sep: str = ".",
    rename: Callable[[str], str | None] | None = None,
    dtype: Any = None,
    timeout: float | int = 300.0,
) -> PyTree:
    """Loads safetensors files into a pytree, each device's shard read by slice.

    The arrays of `like` are named by their paths joined by `sep`
    (`layers.0.attn.q.weight`), and each tensor goes to the array of its name
    (after `rename`). Every tensor missing, extra, or of another shape or dtype is
    reported together before any data is read; then each device's block is read by
    slice and placed, so the host never holds a whole file. Everything that is not
    an array comes from `like`. Only safetensors files are read, nothing unpickled
    ([the how-to](../how-to/checkpoints.md#what-the-loader-reads-and-what-it-does-not);
    [several processes](../how-to/checkpoints.md#several-processes)).

    **Arguments:**

    - `files`: a `.safetensors` file, a sequence of them, or a Hugging Face
      `model.safetensors.index.json` (its files are found next to it).
    - `like`: the tree to load into, concrete or abstract; `sep`: as above.
    - `specs`, `mesh`: where to put the arrays, as for [`eqshard.restore`][]
      (`None`: `like`'s own shardings).
    - `rename`: a function from a tensor's name in the files to the name of
      `like`'s array, or to `None` to skip the tensor (such as a tied head).
    - `dtype`: floating arrays cast as they are read, as for [`eqshard.shard`][].
    - `timeout`: in a multi-process run, seconds each process waits for the others.

    **Returns:**

    A tree of the structure of `like`, with the tensors on their shardings.

    **Raises:**

    `ValueError` naming every tensor missing, extra, or of another shape or dtype
    than `like`'s array; two tensors of one name; a file missing, truncated or
    damaged; an index that is malformed or names a file outside its directory or
    not `.safetensors`; as [`eqshard.shard`][], specs that do not fit or values
    that would be lost; or another process that fails or does not come in time;
    `TypeError` naming a tensor of a dtype eqshard cannot read (F4, F6);
    `ImportError` if safetensors is not installed (the `safetensors` extra).

    !!! Example

        ```python
        like = eqx.filter_eval_shape(Model, key=jax.random.key(0))
        model = eqshard.load_safetensors(
            "model.safetensors.index.json", like, specs, mesh,
            rename=lambda name: name.removeprefix("model."))
        ```
    """
    caller = "load_safetensors"
    check_timeout(caller, timeout)
    failure: Exception | None = None
    loaded = None
    try:
        loaded = _load_tree(files, like, specs, mesh, sep, rename, dtype, caller)
    except Exception as error:  # raised on every process, by `fail_together`
        failure = error
    fail_together(
        caller,
        failure,
        timeout,
        cannot="the safetensors files are not loaded",
        rule="Every process must make the same `load_safetensors` call at the same "
        "point",
    )
    return loaded


def _check_target(final: str, overwrite: bool, caller: str) -> None:
    """Raises unless a file may be written at `final`: its directory exists, and
    nothing is there, or (with `overwrite`) a regular file."""
    directory = os.path.dirname(os.path.abspath(final))
    fix = (
        "Pass the path of a file in an existing directory (create it first with "
        "`os.makedirs`)."
    )
    if not os.path.isdir(directory):
        raise ValueError(
            f"eqshard.{caller}: cannot write {final!r}: there is no directory "
            f"{directory!r}. {fix}"
        )
    try:
        mode = os.lstat(final).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        kind = (
            "a directory"
            if stat.S_ISDIR(mode)
            else "a symbolic link"
            if stat.S_ISLNK(mode)
            else "not a regular file"
        )
        raise ValueError(
            f"eqshard.{caller}: cannot write {final!r}: {final!r} is {kind}, which "
            "is never replaced. Pass the path of a file, or remove that yourself."
        )
    if not overwrite:
        raise ValueError(
            f"eqshard.{caller}: {final!r} already exists. Write to another path, or "
            "pass `overwrite=True` to replace it."
        )


def _write(
    final: str,
    header: bytes,
    values: Iterator[np.ndarray],
    overwrite: bool,
    caller: str,
) -> None:
    """Writes `header` and then each of `values` to a partial file of its own
    beside `final`, and renames it to `final` when complete (replacing a file
    there only if `overwrite`); on any failure the partial file is removed and
    a file already at `final` is left as it was."""
    _check_target(final, overwrite, caller)
    partial = f"{final}.partial-{uuid.uuid4().hex[:16]}"
    try:
        with open(partial, "xb") as writer:
            writer.write(struct.pack("<Q", len(header)) + header)
            for value in values:
                data = np.ascontiguousarray(value, value.dtype.newbyteorder("<"))
                # As bytes: a buffer of bfloat16 or float8 has no format code.
                writer.write(data.reshape(-1).view(np.uint8).data)
        _check_target(final, overwrite, caller)  # anything put there meanwhile
        if overwrite:
            os.replace(partial, final)
        else:
            rename_no_replace(partial, final)  # fails if something is there now
    except FileExistsError:
        raise ValueError(
            f"eqshard.{caller}: {final!r} was created while this file was being "
            "written, so it is not replaced. Write to another path, or pass "
            "`overwrite=True` to replace it."
        ) from None
    except OSError as error:
        raise ValueError(
            f"eqshard.{caller}: could not write {final!r}: {error.strerror or error}. "
            "Nothing was written there (a file already at that path is as it was). "
            "Make room or fix the permissions, and save again."
        ) from error
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)


@typecheck
def save_safetensors(
    path: str | os.PathLike,
    tree: PyTree,
    *,
    sep: str = ".",
    overwrite: bool = False,
    timeout: float | int = 300.0,
) -> None:
    """Writes the arrays of a pytree to a safetensors file, one array at a time.

    Each array is named by its path joined by `sep` (`layers.0.attn.q.weight`,
    as Hugging Face names tensors) and copied to host by [`eqshard.iter_gather`][]
    just before it is written, so the host never holds more than one array.
    Everything that is not an array is not saved; a typed PRNG key is saved as
    its data (`jax.random.key_data`, `uint32`). The file is written next to
    `path` and renamed into place when complete: if anything fails, nothing is
    left behind and a file already at `path` is as it was.

    In a multi-process run, every process makes the same call (all take part in
    gathering); process 0 writes, and every process returns once the file is
    complete, or raises if process 0 could not write it. A process that makes
    the call alone raises after `timeout` seconds instead of waiting forever.

    **Arguments:**

    - `path`: the file to write, in an existing directory.
    - `tree`: any pytree.
    - `sep`: the separator that joins a path into a tensor name.
    - `overwrite`: replace a file already at `path` (only a regular file is
      ever replaced).
    - `timeout`: in a multi-process run, how many seconds to wait for the other
      processes to make the same call (and for process 0 to finish writing).

    **Raises:**

    - `TypeError` naming the arrays of a dtype eqshard cannot write to
      safetensors (such as int4, float4 or complex128), before anything is
      written, or if `tree` holds `jax.ShapeDtypeStruct`s.
    - `ValueError` naming both paths if two arrays get the same name, or the
      path of one named `__metadata__` (a name safetensors reserves); if the
      directory of `path` is not there, something is at `path` (without
      `overwrite`, or other than a regular file), or the file cannot be
      written; or, in a multi-process run, if the other processes do not make
      the same call within `timeout` seconds.

    !!! Example

        ```python
        eqshard.save_safetensors("model.safetensors", model)
        ```
    """
    caller = "save_safetensors"
    check_timeout(caller, timeout)
    named = named_arrays(tree, caller, sep)
    reserved = named.get("__metadata__")
    if reserved is not None:  # the header's entry for the file's own metadata
        raise ValueError(
            f"eqshard.{caller}: the array at '{path_str(reserved[1])}' would be "
            "named '__metadata__', which safetensors keeps for the file's own "
            "metadata, so no reader could open the file. Rename that key, or "
            "leave the array out of `tree`. Nothing was written."
        )
    structs = [p for _, p, x in named.values() if isinstance(x, jax.ShapeDtypeStruct)]
    if structs:
        raise abstract_leaf_error(caller, structs)
    header: dict[str, Any] = {}
    offset = 0
    unnamed = []
    for name, (_, _, leaf) in named.items():
        shape, stored = stored_like(leaf)
        stored = stored.newbyteorder("=")  # written little-endian
        if stored not in NAMES:
            unnamed.append(f"'{name}' ({stored})")
            continue
        size = math.prod(shape) * stored.itemsize
        header[name] = {
            "dtype": NAMES[stored],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    if unnamed:
        raise TypeError(
            f"eqshard.{caller}: no safetensors dtype for the arrays at "
            f"{', '.join(unnamed[:10])}; eqshard writes "
            f"{', '.join(str(d) for d in NAMES)}. Cast them first (e.g. with "
            "`eqshard.gather(tree, dtype=...)`), or leave them out of `tree`."
        )
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    final = os.fspath(path)
    values = (value for _, value in iter_gather(tree, sep=sep))
    shared = [(p, x) for p, x in jtu.tree_flatten_with_path(tree)[0] if is_global(x)]
    wait_for_processes(caller, shared, timeout)
    failure = None
    if jax.process_index() == 0:
        try:
            _write(final, raw, values, overwrite, caller)
        except ValueError as error:
            failure = error
    for _ in values:  # the other processes gather to the end: take part
        pass
    fail_together(
        caller,
        failure,
        timeout,
        cannot=f"{final!r} is not written",
        rule="Every process must make the same call",
    )
