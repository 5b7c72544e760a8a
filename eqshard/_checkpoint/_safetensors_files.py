"""Which safetensors files are read, and what their headers say they hold.

The files given, or those a Hugging Face index (`*.index.json`) lists: an index
may name only `.safetensors` files in its own directory (see `_safetensors.py`'s
docstring). Each header is checked against its file by safetensors itself, and
read here.
"""

import json
import math
import os
import re
import struct
from typing import Any

import jax.numpy as jnp
import numpy as np


# safetensors' dtype names, and the NumPy dtype of each. Its F4 (two float4 values
# a byte) and F6 dtypes have no NumPy dtype of one value a byte, and eqshard's
# float8_e4m3 (with infinities) is not its F8_E4M3 (float8_e4m3fn).
DTYPES: dict[str, np.dtype] = {
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
NAMES = {dtype: name for name, dtype in DTYPES.items()}


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


def files_of(files: Any, caller: str) -> list[str]:
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


def damaged_error(caller: str, path: str, said: str, tensor: str | None) -> ValueError:
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
            nbytes = math.prod(info["shape"]) * DTYPES[info["dtype"]].itemsize
            if end > size or end - begin != nbytes:
                return name
    # A header too damaged to say: safetensors' words stand.
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return None


def header(
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
        raise damaged_error(
            caller, path, said or type(error).__name__, tensor
        ) from None
    return 8 + length, {
        name: (info["dtype"], tuple(info["shape"]), info["data_offsets"][0])
        for name, info in header.items()
        if name != "__metadata__"
    }
