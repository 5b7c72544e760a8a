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
4. **Read.** Each array is built with `jax.make_array_from_callback`: every
   device's block is copied by slice from the file, memory-mapped for that array
   only, so the host holds one array's blocks at a time, never a whole file. In
   a multi-process run each process reads only the blocks its devices hold. A
   typed PRNG key is read as its data (`jax.random.key_data`) and wrapped again.

How `save_safetensors` writes: the format itself (an 8-byte header length, a
JSON header, the raw bytes), so that the header is written from the shapes alone
and the data streamed from [`eqshard.iter_gather`][], one array on host at a
time, into `path.partial`, renamed to `path` only when complete and removed on
any failure (a file already at `path` stays as it was). In a multi-process run
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
import re
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh
from jaxtyping import PyTree

from ._checkpoint import (
    check_against,
    import_optional,
    named_arrays,
    restore_targets,
    stored_like,
)
from ._derive import abstract_tree
from ._host import converted, leaf_casts, loss_error, Lost, lost_text, more_lost
from ._keys import is_key, key_impl_name
from ._multiprocess import check_timeout, fail_together, is_global, wait_for_processes
from ._shard import abstract_leaf_error, iter_gather
from ._spec_args import resolve_specs
from ._typing import typecheck


# safetensors' dtype names, and the NumPy dtype of each. Its F4 (two float4 values
# a byte) and F6 dtypes have no NumPy dtype of one value a byte, and eqshard's
# float8_e4m3 (with infinities) is not its F8_E4M3 (float8_e4m3fn).
_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(jnp.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "C64": np.dtype(np.complex64),
    "F8_E4M3": np.dtype(jnp.float8_e4m3fn),
    "F8_E5M2": np.dtype(jnp.float8_e5m2),
    "F8_E8M0": np.dtype(jnp.float8_e8m0fnu),
    "F8_E4M3FNUZ": np.dtype(jnp.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(jnp.float8_e5m2fnuz),
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


# ---------------------------------------------------------------------------------
# Which files: those given, or those an index names in its own directory.
# ---------------------------------------------------------------------------------


def _index_error(caller: str, index: str, what: str, fix: str = "") -> ValueError:
    return ValueError(
        f"eqshard.{caller}: the index {index!r} {what}. "
        + (
            fix
            or "A Hugging Face index is a JSON object whose `weight_map` maps each "
            "tensor name to the `.safetensors` file beside it that holds it."
        )
    )


def _index_files(index: str, caller: str) -> list[str]:
    """The files a Hugging Face index names, each resolved and checked to lie in
    the index's directory (as given, or as the index's own link resolves)."""
    try:
        with open(index, "rb") as f:
            content = json.load(f)
    except (ValueError, RecursionError) as error:  # JSON, Unicode, nesting
        raise _index_error(caller, index, f"is not JSON ({error})") from None
    if not isinstance(content, dict):
        raise _index_error(
            caller, index, f"holds {type(content).__name__}, not an object"
        )
    weight_map = content.get("weight_map")
    if not isinstance(weight_map, dict):
        what = (
            "has no `weight_map`"
            if weight_map is None
            else (
                f"has a `weight_map` of type {type(weight_map).__name__}, not an object"
            )
        )
        raise _index_error(caller, index, what)
    given = os.path.dirname(os.path.abspath(index))
    homes = {os.path.realpath(given), os.path.dirname(os.path.realpath(index))}
    files: dict[str, str] = {}
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or "\0" in name:
            raise _index_error(
                caller, index, f"maps {tensor!r} to {name!r}, not a file"
            )
        if name in files:
            continue
        target = os.path.realpath(os.path.join(given, name))
        if not any(os.path.commonpath([home, target]) == home for home in homes):
            raise _index_error(
                caller,
                index,
                f"maps {tensor!r} to {name!r}, which is {target!r}, outside the "
                f"index's directory {os.path.realpath(given)!r}",
                "An index may name only files in its own directory (links are "
                "followed first). Move the files there, or pass them directly.",
            )
        if not name.endswith(".safetensors"):
            raise _index_error(
                caller,
                index,
                f"maps {tensor!r} to {name!r}, which is not a `.safetensors` file",
                "eqshard reads only safetensors files: never pickles (`.bin`, "
                "`.pt`) nor an index named in an index. Convert the weights to "
                "safetensors first.",
            )
        if not os.path.isfile(target):
            raise _index_error(
                caller,
                index,
                f"maps {tensor!r} to {name!r}, which is not there",
                "Download every file the index names, next to it.",
            )
        files[name] = target
    return list(files.values())


def _files(files: Any, caller: str) -> list[str]:
    """The safetensors files to read: `files` itself, each of a sequence, or
    those a Hugging Face index (`*.index.json`) names; each file once."""
    paths = [files] if isinstance(files, str | os.PathLike) else list(files)
    out: dict[str, str] = {}  # real path -> the path named
    for path in map(os.fspath, paths):
        if not os.path.isfile(path):
            raise ValueError(
                f"eqshard.{caller}: there is no file {path!r}. Pass safetensors "
                "files, or a Hugging Face `model.safetensors.index.json`."
            )
        found = _index_files(path, caller) if path.endswith(".json") else [path]
        for file in found:
            out.setdefault(os.path.realpath(file), file)
    return list(out.values())


# ---------------------------------------------------------------------------------
# Headers, checked by safetensors.
# ---------------------------------------------------------------------------------


def _damaged(caller: str, path: str, said: str, tensor: str | None) -> ValueError:
    at = f" (at the tensor {tensor!r})" if tensor else ""
    return ValueError(
        f"eqshard.{caller}: {path!r} is not a readable safetensors file{at}: it is "
        f"truncated, damaged, or not safetensors (safetensors says: {said}). "
        "Download or save it again."
    )


def _suspect(path: str) -> str | None:
    """The first tensor whose bytes the header of `path` places beyond the data,
    or of another size than its shape and dtype take, if the header says so."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
            size = os.fstat(f.fileno()).st_size - 8 - length
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            nbytes = math.prod(info["shape"]) * _DTYPES[info["dtype"]].itemsize
            if end > size or end - begin != nbytes:
                return name
    except Exception:  # a header too damaged to say: safetensors' words stand
        return None
    return None


def _header(
    safetensors: Any, path: str, caller: str
) -> tuple[int, dict[str, tuple[str, tuple[int, ...], int]]]:
    """Where the data of `path` starts, and each tensor's dtype name, shape and
    offset, once safetensors has checked the header against the file."""
    try:
        with safetensors.safe_open(path, framework="numpy"):
            pass  # opening checks the header against the file
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (safetensors.SafetensorError, OSError, ValueError) as error:
        said = str(error).strip().splitlines()[0] if str(error).strip() else ""
        named = re.search(r"tensor `([^`]*)`", said)
        tensor = named.group(1) if named else _suspect(path)
        raise _damaged(caller, path, said or type(error).__name__, tensor) from None
    return 8 + length, {
        name: (info["dtype"], tuple(info["shape"]), info["data_offsets"][0])
        for name, info in header.items()
        if name != "__metadata__"
    }


# ---------------------------------------------------------------------------------
# Reading, block by block.
# ---------------------------------------------------------------------------------


def _read(
    piece: Any, index: tuple[slice, ...], dtype: np.dtype, cast: Any
) -> tuple[np.ndarray, Lost | None]:
    """One block of a tensor (`index` of plain `start:stop`s), copied out of the
    mapped file in native byte order and converted as `shard` converts host data
    (to `cast`, or to the dtype JAX places), with what that lost."""
    block = tuple(s.stop - s.start for s in index)
    if 0 in block:
        value = np.empty(block, dtype)
    else:
        value = np.array(piece[index] if index else piece[()], dtype)
    return converted(value, cast)


def _load(
    path: str,
    start: int,
    shape: tuple[int, ...],
    stored: np.dtype,
    target: jax.ShapeDtypeStruct,
    cast: np.dtype | None,
    caller: str,
) -> tuple[jax.Array, Lost | None]:
    """One array of `shape` and `stored` dtype, at byte `start` of `path`, each
    device's block read by slice. The file is mapped for this array only, so the
    pages read leave this process's memory with it; replicated blocks are read
    once. A typed key (`target`'s dtype) is read as its data, then wrapped. Returns
    the array and what converting its blocks lost."""
    nbytes = math.prod(shape) * stored.itemsize
    try:  # (an empty file region cannot be mapped)
        data = (
            np.memmap(path, np.uint8, "r", offset=start, shape=(nbytes,))
            if nbytes
            else np.empty(0, np.uint8)
        )
    except (OSError, ValueError) as error:  # changed since its header was read
        raise _damaged(caller, path, str(error), None) from None
    piece = data.view(stored.newbyteorder("<")).reshape(shape)
    read: dict[tuple[Any, ...], Any] = {}
    lost: Lost | None = None

    def block(index: Any) -> Any:
        nonlocal lost
        index = tuple(
            slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True)
        )
        key = tuple((s.start, s.stop) for s in index)
        if key not in read:
            read[key], block_lost = _read(piece, index, stored, cast)
            lost = more_lost(lost, block_lost)
        return read[key]

    array = jax.make_array_from_callback(shape, target.sharding, block)
    if is_key(target):
        array = jax.random.wrap_key_data(array, impl=key_impl_name(target))
    return array, lost


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
) -> PyTree:
    """Loads safetensors files into a pytree, each device's shard read by slice.

    The arrays of `like` are named by their paths joined by `sep`
    (`layers.0.attn.q.weight`), and each tensor of the files goes to the array of
    its name (after `rename`). Before any data is read, every tensor missing,
    extra, or of another shape or dtype is reported together. Each array is then
    built shard by shard: every device's block is read from the memory-mapped
    file by slice and placed, so the host holds at most one array's shards at a
    time, never a whole file. Everything that is not an array comes from `like`.

    What is read: safetensors files only, each header checked against its file
    before any data is read. An index may name only `.safetensors` files in its
    own directory, links followed first (or in the directory the index's own link
    resolves into, as in the Hugging Face cache): `../x.safetensors`, absolute
    paths, links out of the directory and an index named in an index are
    refused. Nothing is ever unpickled: `.bin` and `.pt` files are not read.

    In a multi-process run, every process makes the same call (the files on a
    file system all of them see), and reads only the shards its devices hold.

    **Arguments:**

    - `files`: a `.safetensors` file, a sequence of them, or a Hugging Face
      `model.safetensors.index.json` (its files are found next to it).
    - `like`: a tree of the structure to load into, concrete or abstract (an
      `eqx.filter_eval_shape` skeleton is enough).
    - `specs`, `mesh`: where to put the arrays, as for [`eqshard.restore`][]
      (`None`: `like`'s own shardings).
    - `sep`: the separator that joins a path into a tensor name.
    - `rename`: a function from a tensor name in the files to the name of
      `like`'s array (for prefixes such as `"model."` and other naming
      differences), or to `None` to skip the tensor (such as a tied head).
    - `dtype`: if given, floating arrays are cast to it as they are read: a
      floating dtype, or a tree of them and `None`s, as for [`eqshard.shard`][].
      As there, a cast may round, but values that would become inf or nan (or,
      with `jax_enable_x64` off, 64-bit values that do not fit 32 bits) are
      refused.

    **Returns:**

    A tree of the structure of `like`, with the tensors on their shardings.

    **Raises:**

    - `ValueError` naming every tensor missing, extra, or of another shape or
      dtype (without a cast) than `like`'s array, with both names; two tensors
      of one name; a file that is not there, or truncated or damaged (naming it,
      and the tensor where that can be told); an index that is malformed, or
      names a file outside its directory or not `.safetensors` (naming the
      entry and the file); or, as [`eqshard.shard`][], specs that do not fit, or
      arrays whose values would be lost.
    - `TypeError` naming a tensor of a dtype eqshard cannot read (safetensors'
      packed F4 and F6).
    - `ImportError` if safetensors is not installed
      (`pip install "eqshard[safetensors]"`).

    !!! Example

        ```python
        like = eqx.filter_eval_shape(Model, key=jax.random.key(0))
        model = eqshard.load_safetensors(
            "model.safetensors.index.json", like, specs, mesh,
            rename=lambda name: name.removeprefix("model."),
        )
        ```
    """
    caller = "load_safetensors"
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
    targets = restore_targets(named, placed, casts, caller)
    found: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    sources: dict[str, tuple[str, int]] = {}  # name -> (file, data offset)
    labels: dict[str, str] = {}
    for path in _files(files, caller):
        data_start, tensors = _header(safetensors, path, caller)
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
            if kind not in _DTYPES:
                raise TypeError(
                    f"eqshard.{caller}: the tensor {tensor!r} of {path!r} has "
                    f"dtype {kind}, which eqshard cannot read (it reads "
                    f"{', '.join(_DTYPES)})."
                )
            found[name] = (shape, _DTYPES[kind])
            sources[name] = (path, data_start + offset)
            labels[name] = label
    check_against(
        targets,
        named,
        found,
        casts,
        caller=caller,
        where="the safetensors files",
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


def _write(
    final: str, header: bytes, values: Iterator[np.ndarray], caller: str
) -> None:
    """Writes `header` and then each of `values` to `final.partial`, and renames
    it to `final` when complete; on any failure the partial file is removed and
    a file already at `final` is left as it was."""
    directory = os.path.dirname(os.path.abspath(final))
    if not os.path.isdir(directory) or os.path.isdir(final):
        what = (
            f"{final!r} is a directory"
            if os.path.isdir(final)
            else f"there is no directory {directory!r}"
        )
        raise ValueError(
            f"eqshard.{caller}: cannot write {final!r}: {what}. Pass the path of a "
            "file in an existing directory (create it first with `os.makedirs`)."
        )
    partial = f"{final}.partial"
    done = False
    try:
        with open(partial, "wb") as writer:
            writer.write(struct.pack("<Q", len(header)) + header)
            for value in values:
                data = np.ascontiguousarray(value, value.dtype.newbyteorder("<"))
                # As bytes: a buffer of bfloat16 or float8 has no format code.
                writer.write(data.reshape(-1).view(np.uint8).data)
        os.replace(partial, final)
        done = True
    except OSError as error:
        raise ValueError(
            f"eqshard.{caller}: could not write {final!r}: {error.strerror or error}. "
            "Nothing was written there (a file already at that path is as it was). "
            "Make room or fix the permissions, and save again."
        ) from error
    finally:
        if not done:
            with contextlib.suppress(FileNotFoundError):
                os.remove(partial)


@typecheck
def save_safetensors(
    path: str | os.PathLike,
    tree: PyTree,
    *,
    sep: str = ".",
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
    - `timeout`: in a multi-process run, how many seconds to wait for the other
      processes to make the same call (and for process 0 to finish writing).

    **Raises:**

    - `TypeError` naming the arrays of a dtype eqshard cannot write to
      safetensors (such as int4, float4 or complex128), before anything is
      written, or if `tree` holds `jax.ShapeDtypeStruct`s.
    - `ValueError` naming both paths if two arrays get the same name; if the
      directory of `path` is not there or the file cannot be written; or, in a
      multi-process run, if the other processes do not make the same call
      within `timeout` seconds.

    !!! Example

        ```python
        eqshard.save_safetensors("model.safetensors", model)
        ```
    """
    caller = "save_safetensors"
    check_timeout(caller, timeout)
    named = named_arrays(tree, caller, sep)
    structs = [p for _, p, x in named.values() if isinstance(x, jax.ShapeDtypeStruct)]
    if structs:
        raise abstract_leaf_error(caller, structs)
    header: dict[str, Any] = {}
    offset = 0
    unnamed = []
    for name, (_, _, leaf) in named.items():
        shape, stored = stored_like(leaf)
        stored = stored.newbyteorder("=")  # written little-endian
        if stored not in _NAMES:
            unnamed.append(f"'{name}' ({stored})")
            continue
        size = math.prod(shape) * stored.itemsize
        header[name] = {
            "dtype": _NAMES[stored],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    if unnamed:
        raise TypeError(
            f"eqshard.{caller}: no safetensors dtype for the arrays at "
            f"{', '.join(unnamed[:10])}; eqshard writes "
            f"{', '.join(str(d) for d in _NAMES)}. Cast them first (e.g. with "
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
            _write(final, raw, values, caller)
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
