"""Host data made ready for devices, losing nothing and sharing nothing.

`shard` places NumPy arrays; before any of them moves, each is checked and, where
needed, converted on host, in one pass over its data:

1. **Casts asked for.** `dtype=` casts floating arrays, all of them or, as a tree
   of dtypes (a prefix of the tree, `None` for "keep"), only some. Only floating
   dtypes can be asked for: a cast to an integer type wraps or truncates.
2. **The dtype JAX places.** With `jax_enable_x64` off, JAX would narrow 64-bit
   arrays to 32 bits silently (int64 `2**40 + 7` became `7`, float64 `1e300`
   became `inf`). Every cast, asked for or not, is checked with vectorised NumPy
   reductions over the result: integers must fit the narrower type (`min`/`max`),
   and floats must stay finite where they were (`isfinite`) and, for a type with
   no inf that saturates instead (float4_e2m1fn), within its range
   (`overflow_bound`). Rounding to the narrower float's precision is the cast's
   meaning and is not an error.
   Big-endian arrays are converted to native byte order, which loses nothing.
3. **No aliasing.** On CPU, `jax.device_put` may place a suitably aligned NumPy
   array without copying it, so the caller's later writes to that buffer (a data
   loader reusing it) would change arrays already on the mesh. It can only do so
   with a block that is one dense run of the array's memory: a block cut out of
   the middle of a row (a 2-D weight split over both dimensions) is strided, and
   is copied whatever its alignment, so such arrays are placed as they are. A
   NumPy array placed on CPU devices (or in host memory) some of whose blocks are
   dense is copied up front into a private, 64-byte aligned buffer if it is under
   1 MiB, or if its blocks are each held by several devices (`P()`, or `P("dp")`
   on a ('dp', 'tp') mesh: they copy an unaligned block once each); the devices
   then share that buffer without further copies. A larger
   one is placed as it is, and the device buffers' addresses are compared with
   its memory: only if they lie in it is it placed again, from a private copy
   (one host copy, ~10 ms per 64 MiB; see `benchmarks/bench_host.py`). Arrays
   placed on other devices are copied there anyway. (These reads of XLA:CPU's
   buffers are `_internals/cpu.py`'s; the copy engine's plain route,
   `_copies.py`, reads none: it copies every array the devices could alias.)
4. **Nothing read later.** `jax.device_put` returns before its transfers are
   done, so a device may read the caller's buffer after the call (writes made
   at once changed arrays on the mesh). `shard` waits for the transfers of the
   arrays placed as they are (`borrowed`) before it returns, and before it
   compares addresses; a private copy is the devices' own, and is not waited
   for. `filter_jit`, `init_sharded` and `filter_shard_map` hand JAX NumPy arguments
   that it reads later still, in a program: they give it private copies
   instead (`host_private`), which keeps the call asynchronous.

This is the one policy for every path that brings data in: a cast asked for may
round, but values that would become inf or nan, wrap around, or be narrowed are
refused, naming every array, its values and the fix (`loss_error`). JAX arrays
cast with `dtype=` are checked alike: on CPU block by block as they are copied
(`cast_lost`, `more_lost`), elsewhere in the program that casts them (see
`_resident.py`). `load_safetensors` converts each block it reads with
`converted`, and adds up what the blocks lost (`Lost`, `more_lost`); `restore`
checks the arrays orbax read shard by shard (see `_checkpoint/`), with the same
records and messages; `init_sharded` converts the NumPy data among its arguments
and checks what its function reads (`_init._narrowed`).
"""

import functools as ft
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._caches import register
from .._internals import cpu
from .._internals.cpu import may_alias
from .._tree import broadcast_prefix, is_array, listing, path_str, placed_dtype
from .._typing import KeyPath
from ._threads import copy


# ---------------------------------------------------------------------------------
# 1. The casts asked for.
# ---------------------------------------------------------------------------------


def _is_dtype_leaf(x: Any) -> bool:
    return x is None or isinstance(x, np.dtype | type | str)


def _cast_dtype(dtype: Any, caller: str, where: str) -> np.dtype:
    try:
        found = np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise TypeError(
            f"eqshard.{caller}: `dtype`{where} is {dtype!r}, which is not a dtype. "
            "Pass a floating dtype such as `jnp.bfloat16`, `None`, or a tree of them."
        ) from None
    if not jnp.issubdtype(found, jnp.floating):
        raise ValueError(
            f"eqshard.{caller}: `dtype`{where} is {found}, but `dtype=` casts "
            "floating arrays, and a cast to a non-floating type wraps or truncates "
            f"their values (300.0 becomes {np.array(300.0).astype(np.int8)} as "
            "int8). Pass a floating dtype (e.g. `jnp.bfloat16`), or quantise the "
            "arrays yourself, with their scales."
        )
    return found


def check_cast_dtype(dtype: Any, caller: str) -> np.dtype:
    """`dtype` as a NumPy dtype, if it is one floating dtype (not a tree)."""
    if not _is_dtype_leaf(dtype):
        raise TypeError(
            f"eqshard.{caller}: `dtype` must be one floating dtype here; got "
            f"{type(dtype).__name__}. Give a tree of dtypes to `eqshard.shard`."
        )
    return _cast_dtype(dtype, caller, "")


def leaf_casts(
    dtype: Any,
    tree: PyTree,
    *,
    caller: str,
    root: KeyPath = (),
    leaves: Sequence[Any] | None = None,
) -> list[np.dtype | None]:
    """The dtype each leaf of `tree` is cast to, or `None`: floating arrays get
    `dtype`, or their entry of a tree of dtypes that is a prefix of `tree`.
    `leaves` are the leaves of `tree`, where the caller has them already."""
    if leaves is None:
        leaves = jtu.tree_leaves(tree)
    if dtype is None:
        return [None] * len(leaves)
    if _is_dtype_leaf(dtype):
        pairs = [((), _cast_dtype(dtype, caller, ""))] * len(leaves)
    else:
        pairs = broadcast_prefix(
            dtype, tree, is_leaf=_is_dtype_leaf, name="dtype", caller=caller
        )
    checked: dict[Any, np.dtype] = {}
    out: list[np.dtype | None] = []
    for (path, want), leaf in zip(pairs, leaves, strict=True):
        if want is None or not is_array(leaf):
            out.append(None)
            continue
        if not isinstance(want, np.dtype):
            if want not in checked:
                where = f" at '{path_str(root + path)}'"
                checked[want] = _cast_dtype(want, caller, where)
            want = checked[want]
        out.append(want if jnp.issubdtype(leaf.dtype, jnp.floating) else None)
    return out


# ---------------------------------------------------------------------------------
# 2-3. Converted and copied, losing nothing.
# ---------------------------------------------------------------------------------


class Lost(NamedTuple):
    """Values that a conversion to `dtype` lost, over one or several blocks of an
    array: `number` of them, and the farthest, `extreme` (an integer beyond
    `dtype`'s range, or the magnitude of a finite value that became inf or nan)."""

    dtype: np.dtype
    number: int
    extreme: int | float


def more_lost(first: Lost | None, then: Lost | None) -> Lost | None:
    """What two blocks of one array lost together."""
    if first is None or then is None:
        return first or then
    extreme = max(first.extreme, then.extreme, key=abs)
    return Lost(first.dtype, first.number + then.number, extreme)


def lost_text(lost: Lost) -> str:
    """What a conversion lost, for `loss_error`."""
    if lost.dtype.kind in "iu":
        info = np.iinfo(lost.dtype)
        extreme = lost.extreme if isinstance(lost.extreme, int) else f"{lost.extreme:g}"
        return (
            f"{lost.number} of its values lie beyond the range of {lost.dtype} "
            f"({info.min} to {info.max}), reaching {extreme}"
        )
    return overflow_text(lost.number, float(lost.extreme), lost.dtype)


def cast_lost(source: np.ndarray, out: np.ndarray) -> Lost | None:
    """What a cast from `source` to `out` (of the same shape) lost, if anything."""
    if out.size == 0 or source.dtype == out.dtype:
        return None
    if source.dtype.kind in "iu" and out.dtype.kind in "iu":
        info = np.iinfo(out.dtype)
        low, high = int(source.min()), int(source.max())
        if low >= info.min and high <= info.max:
            return None
        count = int(np.count_nonzero((source < info.min) | (source > info.max)))
        extreme = low if info.min - low > high - info.max else high
        return Lost(out.dtype, count, extreme)
    if jnp.issubdtype(out.dtype, jnp.inexact):
        if _within_range(source, out.dtype):
            return None
        bad = ~np.isfinite(out)
        kept = np.isfinite(source)  # inf and nan stay so, where the type has them
        if source.dtype.kind != "c" and jnp.issubdtype(out.dtype, jnp.floating):
            # Saturated, where no inf or nan; compared as float64, which NumPy
            # would otherwise bring down to a narrower source's dtype, warning.
            bound = np.float64(overflow_bound(out.dtype))
            bad |= (source > bound) | (source < -bound)
            if saturates(out.dtype):  # inf became its largest, nan another value
                bad, kept = bad | ~kept, True
        bad &= kept
        if bad.any():
            magnitudes = np.abs(source[bad])
            largest = float(magnitudes.max(initial=0, where=~np.isnan(magnitudes)))
            return Lost(out.dtype, int(bad.sum()), largest)
    return None


def _within_range(source: np.ndarray, dtype: np.dtype) -> bool:
    """Whether every value of a real `source` lies within the finite range of a
    floating `dtype`, so that no cast to it makes inf or nan (rounding is
    monotonic and the range's ends are representable; a nan fails the test).
    Two passes of NumPy's own reductions over `source`, where testing the
    result for inf or nan would take ml_dtypes' loops (4 ms against 15 ms for
    64 MiB cast to bfloat16)."""
    real = jnp.issubdtype(source.dtype, jnp.integer) or jnp.issubdtype(
        source.dtype, jnp.floating
    )
    if not (real and signed_with_zero(dtype)):
        return False
    largest = float(jnp.finfo(dtype).max)
    with np.errstate(invalid="ignore"):  # ml_dtypes' reductions warn of a nan
        low, high = float(source.min()), float(source.max())
    # As Python floats: NumPy would bring `largest` down to a narrower source's
    # dtype, warning that it overflows (float16's range against float32's).
    return low >= -largest and high <= largest


@ft.lru_cache(maxsize=64)
def signed_with_zero(dtype: np.dtype) -> bool:
    """Whether the floating `dtype` holds 0 and negative values, so that its
    finite range is `[-max, max]` (float8_e8m0fnu, a power of two, holds
    neither: they become nan)."""
    if not jnp.issubdtype(dtype, jnp.floating):
        return False
    with np.errstate(invalid="ignore"):
        return bool(np.isfinite(np.array([-1.0, 0.0]).astype(dtype)).all())


@ft.lru_cache(maxsize=64)
def saturates(dtype: np.dtype) -> bool:
    """Whether the floating `dtype` has neither inf nor nan for values past its
    range, and gives its largest value instead (float4_e2m1fn)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.array(1e300).astype(dtype)))


@ft.lru_cache(maxsize=64)
def overflow_bound(dtype: np.dtype) -> float:
    """The magnitude beyond which a cast to the floating `dtype` overflows: its
    largest value plus half a unit in the last place there. Past it, most types
    give inf or nan; those with neither (float4_e2m1fn) saturate, giving their
    largest value, which `isfinite` cannot tell from a rounding."""
    info = jnp.finfo(dtype)
    return float(info.max) + 2.0 ** (int(info.maxexp) - 2 - int(info.nmant))


for _cache in (signed_with_zero, saturates, overflow_bound):
    register(_cache.cache_clear)


def overflow_text(count: int, largest: float, dtype: np.dtype) -> str:
    """What a floating cast to `dtype` lost: `count` finite values, the largest
    `largest` in magnitude, became inf or nan (or, in a type with neither, its
    largest value)."""
    if saturates(dtype):
        top = float(jnp.finfo(dtype).max)
        return (
            f"{count} of its values (up to {largest:g} in magnitude, or nan) lie "
            f"beyond the range of {dtype} (-{top:g} to {top:g}), which has neither "
            "inf nor nan to hold them"
        )
    return (
        f"{count} of its finite values (up to {largest:g} in magnitude) become inf "
        f"or nan in {dtype}"
    )


def converted(
    value: np.ndarray, cast: np.dtype | None
) -> tuple[np.ndarray, Lost | None]:
    """A block of an array read from a file, as it must be handed to JAX: cast to
    `cast` or to the dtype JAX places (`placed_dtype`), and what that lost."""
    target = placed_dtype(value.dtype if cast is None else cast)
    if target == value.dtype:
        return value, None
    with np.errstate(over="ignore", invalid="ignore"):  # checked by `cast_lost`
        out = value.astype(target)
    return out, cast_lost(value, out)


# NumPy arrays smaller than this, placed where the devices could alias them, are
# copied into a private buffer up front (cheaper than checking); larger ones are
# placed as they are, and placed again from a private copy only if the devices
# turn out to alias them.
PRIVATE_BELOW = 1 << 20


@ft.lru_cache(maxsize=1024)
def _copied_per_device(sharding: NamedSharding) -> bool:
    """Whether `device_put` copies an unaligned host array once per device: it is
    whole on several devices. A private aligned copy is then one copy in all."""
    return sharding.is_fully_replicated and len(sharding.device_set) > 1


register(_copied_per_device.cache_clear)


@ft.lru_cache(maxsize=1024)
def _blocks_replicated(sharding: NamedSharding) -> bool:
    """Whether each block of `sharding` is held by several devices (the spec
    leaves some mesh axis out): `device_put` copies an unaligned dense block once
    per device that holds it, where a private aligned copy is one copy in all
    (16 MiB on `P("dp")` of a (2, 4) mesh: 15 ms placed as it was, 2 ms from a
    private copy; `benchmarks/bench_shard_host.py`)."""
    split = 1
    for entry in sharding.spec:
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            continue
        for axis in entry if isinstance(entry, tuple | list) else (entry,):
            split *= dict(sharding.mesh.shape).get(axis, 1)
    return len(sharding.device_set) > split


register(_blocks_replicated.cache_clear)


@ft.lru_cache(maxsize=1024)
def private_when(sharding: NamedSharding, small: bool, plain: bool) -> bool | None:
    """Whether `host_ready` copies an array bound for `sharding` into a private
    buffer: `True` or `False` whatever its memory, `None` if the devices would
    take this array in place (`cpu.takes_in_place`). `small`: under
    `PRIVATE_BELOW` bytes; `plain`: the copy engine's plain route."""
    if not may_alias(sharding):
        return False
    if plain or _copied_per_device(sharding):
        return True
    return None if small or _blocks_replicated(sharding) else False


register(private_when.cache_clear)


def private_copy(leaf: np.ndarray) -> np.ndarray:
    """A copy of `leaf` in a 64-byte aligned buffer of its own, in native byte
    order (`jax.jit` refuses big-endian arguments; the swap loses nothing)."""
    dtype = leaf.dtype if leaf.dtype.isnative else leaf.dtype.newbyteorder("=")
    out = cpu.aligned_empty(leaf.shape, dtype)
    copy(out, leaf)
    return out


def borrowed(ready: Any, value: Any) -> bool:
    """Whether `ready`, handed to `jax.device_put` for the leaf `value`, is (in
    part) the caller's own NumPy memory, which the transfer may read after
    `device_put` returns: `host_ready` returned it, or a view of it, rather than a
    copy of its own."""
    return (
        isinstance(value, np.ndarray)
        and isinstance(ready, np.ndarray)
        and np.may_share_memory(ready, value)
    )


def host_private(tree: PyTree) -> PyTree:
    """`tree` with every NumPy array replaced by a private copy (`private_copy`),
    for a call that hands its arguments to JAX and returns before JAX has read
    them (`jax.jit`, an eager `filter_shard_map`): the caller may then write its
    buffers at once. The same object if it holds no NumPy array."""
    leaves, treedef = jtu.tree_flatten(tree)
    if not any(map(_is_plain_numpy, leaves)):
        return tree
    return jtu.tree_unflatten(
        treedef, [private_copy(x) if _is_plain_numpy(x) else x for x in leaves]
    )


def _is_plain_numpy(x: Any) -> bool:
    """A NumPy array that JAX reads as it is (subclasses such as masked arrays,
    and Python objects, are JAX's to refuse, not copied first)."""
    return type(x) is np.ndarray and not x.dtype.hasobject


def unplaceable(dtype: np.dtype) -> str | None:
    """Why no device can hold NumPy arrays of `dtype`, or `None` if one can (a
    big-endian array is converted to native byte order, losslessly)."""
    if dtype.kind == "O":
        return "Python objects; make them numeric arrays"
    if dtype == jax.dtypes.float0:
        return (
            "float0, the gradient of an integer or bool array, which holds no "
            "values; leave it out of the tree (`eqx.filter(tree, "
            "eqx.is_inexact_array)`, or gradients from `eqx.filter_grad`)"
        )
    if dtype.type is np.void:
        return (
            "raw bytes; a bfloat16 array saved with `np.save` loads as '|V2': "
            "restore it with `.view(jnp.bfloat16)`"
        )
    if dtype.kind in "UST":
        return (
            "text or bytes; encode them as numbers first (e.g. token ids, or "
            "`np.frombuffer(data, np.uint8)`)"
        )
    if dtype.kind in "Mm":
        return (
            "dates or durations; convert them to numbers first, e.g. "
            "`.astype(np.int64)` for counts of their unit"
        )
    if (dtype.kind == "f" and dtype.itemsize > 8) or (
        dtype.kind == "c" and dtype.itemsize > 16
    ):
        return "extended precision, which no device has; cast to float64 first"
    return None


def host_ready(
    leaf: Any,
    cast: np.dtype | None,
    sharding: NamedSharding | None,
    *,
    plain: bool = False,
) -> tuple[np.ndarray, str | None, bool]:
    """A NumPy leaf as it must be handed to `device_put` for `sharding` (`None`:
    to stay on host): cast to `cast` or to the dtype JAX places, in native byte
    order, and, if it is small and the devices could alias it, in a private
    buffer (a large one is checked after placing, by `cpu.shares_memory`). With
    `plain` (the copy engine's plain route, which reads no device buffer), every
    leaf the devices could alias gets a private buffer. Also returns what the
    conversion lost (`None` if nothing), and whether it was asked for (`cast`)
    rather than imposed by JAX."""
    leaf = np.asarray(leaf)
    target = placed_dtype(leaf.dtype if cast is None else cast)
    private = False
    if sharding is not None:
        private = private_when(sharding, leaf.nbytes < PRIVATE_BELOW, plain)
        if private is None:
            private = cpu.takes_in_place(leaf, sharding)
    if target == leaf.dtype and not private:
        return leaf, None, False
    allocate = cpu.aligned_empty if private and not plain else np.empty
    out = allocate(leaf.shape, target)
    if target == leaf.dtype:  # a copy alone, which loses nothing
        copy(out, leaf)
        return out, None, False
    with np.errstate(over="ignore", invalid="ignore"):  # checked by `cast_lost`
        np.copyto(out, leaf, casting="unsafe")
    lost = cast_lost(leaf, out)
    return out, None if lost is None else lost_text(lost), cast is not None


def loss_error(
    caller: str,
    found: Sequence[tuple[KeyPath, np.dtype, np.dtype, str, bool]],
    *,
    fix: str | None = None,
) -> ValueError:
    """The message for arrays whose conversion would lose values: `found` holds
    `(path, source, target, what was lost, asked)` for each; `fix` replaces the
    fix for arrays that JAX narrows, where the caller has no `dtype=`."""
    lines = [
        f"'{path_str(path)}' ({source}; "
        f"{'`dtype=` casts it' if asked else 'JAX narrows it'} to {target}): {what}."
        for path, source, target, what, asked in found
    ]
    fixes = []
    if any(not asked for *_, asked in found):
        fixes.append(
            fix
            or "64-bit arrays are narrowed to 32 bits while `jax_enable_x64` is off: "
            "enable it first (`jax.config.update('jax_enable_x64', True)`), or "
            "convert these arrays yourself to a dtype that holds their values "
            "(floating ones with `dtype=`)."
        )
    if any(asked for *_, asked in found):
        fixes.append(
            "Cast to a dtype with the range of these values (bfloat16 has "
            "float32's), or leave these arrays uncast: give `dtype` as a tree with "
            "`None` at their paths."
        )
    doing = (
        "copying these arrays to host" if caller == "gather" else "placing these arrays"
    )
    header = f"eqshard.{caller}: {doing} would lose values:"
    return ValueError(listing(header, lines, *fixes))
