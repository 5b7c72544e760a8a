"""Moving pytrees onto meshes and back to the host.

How data moves, in the order of this file:

1. **Match.** A spec tree (or a prefix of one) is broadcast against the tree, so
   every leaf gets a spec. Arrays (`jax.Array`, NumPy) are placed; everything else
   (static fields, callables, Python scalars, `None`) stays where it is.
2. **Validate first.** Every array's spec is checked against its shape and the
   mesh before any data moves, and all the leaves that do not fit are reported in
   one error.
3. **Shard.** In one process, all arrays move in one batched `jax.device_put`: no
   per-leaf `jax.jit`, no compilation. JAX arrays whose sharding or dtype must
   change are the exception, as `device_put` would compile a program per shape
   for them: on CPU they come to host first and are placed like NumPy data; on
   GPU and TPU one program moves them all (why: `_resident.py`). In a
   multi-process run, each process first
   checks with the others that they all passed the same tree (one 16-byte
   all-gather), then supplies only the shards its own devices hold, from a full
   copy of each array or (for `Partitioner.move_to_devices(host_local=True)`)
   from its own block of it; see `_multiprocess.py`.
4. **Gather.** Arrays whose shards this process can all see are copied straight to
   host with one `jax.device_get`. An array spread over several processes is first
   laid out again over the same devices, whole on each process and split across
   that process's devices, then copied to host from those local shards, one leaf
   at a time: no device ever holds a full replica.

After these come `named_shardings` and `make_shard_and_gather_fns`, for code that
moves a tree piece by piece (their functions run steps 1-4 on one subtree each).
`with_sharding_constraint`, which moves nothing itself, is in `_constraint.py`.
"""

import functools as ft
import itertools
import typing
from collections.abc import Iterator
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._host import (
    check_cast_dtype,
    host_ready,
    leaf_casts,
    loss_error,
    may_alias,
    overflow_text,
    private_copy,
    shares_memory,
)
from ._keys import HostKey, is_host_key, is_key, key_data, key_impl_name, wrap_host_keys
from ._mesh import require_mesh
from ._multiprocess import (
    check_processes_agree,
    check_timeout,
    from_host_copies,
    from_host_local,
    host_local_shape,
    host_value,
    is_global,
    needs_collective,
    wait_for_processes,
)
from ._resident import move_in_programs, route
from ._spec_args import NO_TREE, resolve_specs
from ._specs import (
    bad_spec_leaf_message,
    check_leaves,
    check_placeable,
    check_spec,
    check_spec_on_mesh,
    is_spec_leaf,
    leaf_specs,
    named_sharding,
    spec_error_message,
)
from ._tree import (
    collision_message,
    deleted_error,
    is_array,
    is_deleted,
    path_name,
    path_str,
    paths_text,
    repeated_arrays,
)
from ._typing import (
    check_choice,
    CHECK_VALUES,
    CheckValues,
    KeyPath,
    PyTreeDef,
    typecheck,
)


# ---------------------------------------------------------------------------------
# 1-2. Match every leaf with its sharding, and validate before anything moves.
# ---------------------------------------------------------------------------------


def _concrete_mesh(mesh: Mesh | AbstractMesh | None, caller: str) -> Mesh:
    if isinstance(mesh, AbstractMesh):
        raise TypeError(
            f"eqshard.{caller}: `mesh` is an `AbstractMesh` ({mesh}), which has no "
            "devices to place arrays on. Pass a concrete `Mesh` (e.g. "
            "`eqshard.create_mesh(...)`); plan on abstract meshes with "
            "`eqshard.analyze_sharding_strategy`."
        )
    mesh = require_mesh(mesh, caller=caller)
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"eqshard.{caller}: moves data, so it needs a concrete `Mesh` of devices, "
            f"but the current mesh is abstract ({mesh}); you are probably inside "
            "`jax.jit`. Call it outside `jit`, or use "
            "`eqshard.with_sharding_constraint` inside."
        )
    return mesh


def abstract_leaf_error(caller: str, paths: list[KeyPath]) -> TypeError:
    return TypeError(
        f"eqshard.{caller}: `tree` holds `jax.ShapeDtypeStruct` leaves at "
        f"{paths_text(paths)}, which have no data to move. Create the arrays "
        "first, or plan with abstract trees through "
        "`eqshard.analyze_sharding_strategy`."
    )


def _abstract_mesh_error(caller: str, paths: list[KeyPath]) -> TypeError:
    return TypeError(
        f"eqshard.{caller}: `specs` has `NamedSharding`s on an abstract mesh at "
        f"{paths_text(paths)}, which has no devices to place arrays on. Pass "
        "`PartitionSpec`s and a mesh (`eqshard.get_partition_spec` reads them "
        "from a tree), or bind the shardings of an `eqx.filter_eval_shape` tree "
        "to a mesh with `eqshard.extract_shardings(shapes, mesh)`."
    )


def unplaceable(dtype: np.dtype) -> str | None:
    """Why no device can hold NumPy arrays of `dtype`, or `None` if one can (a
    big-endian array is converted to native byte order, losslessly)."""
    if dtype.kind == "O":
        return "Python objects; make them numeric arrays"
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


def _unplaceable_error(
    caller: str, found: list[tuple[KeyPath, np.dtype, str]]
) -> TypeError:
    lines = [
        f"  - '{path_str(p)}' ({dtype}): {reason}." for p, dtype, reason in found[:10]
    ]
    more = [f"  ... and {len(found) - 10} more."] if len(found) > 10 else []
    return TypeError(
        "\n".join(
            [
                f"eqshard.{caller}: NumPy arrays of dtypes no device can hold:",
                *lines,
                *more,
            ]
        )
    )


def _check_movable(
    caller: str, pairs: list[tuple[KeyPath, Any]], leaves: list[Any]
) -> None:
    """Raises a `TypeError` naming the leaves that cannot move whatever their spec:
    structs without data, NumPy arrays no device can hold, and shardings on an
    abstract mesh."""
    abstract = [
        path
        for (path, _), leaf in zip(pairs, leaves, strict=True)
        if isinstance(leaf, jax.ShapeDtypeStruct)
    ]
    if abstract:
        raise abstract_leaf_error(caller, abstract)
    deleted = [
        path
        for (path, spec), leaf in zip(pairs, leaves, strict=True)
        if spec is not None and is_deleted(leaf)
    ]
    if deleted:
        raise deleted_error(caller, deleted)
    untyped = [
        (path, leaf.dtype, reason)
        for (path, spec), leaf in zip(pairs, leaves, strict=True)
        if spec is not None
        and isinstance(leaf, np.ndarray | np.generic)
        and (reason := unplaceable(leaf.dtype)) is not None
    ]
    if untyped:
        raise _unplaceable_error(caller, untyped)
    unbound = [
        path
        for (path, spec), leaf in zip(pairs, leaves, strict=True)
        if isinstance(spec, NamedSharding)
        and not isinstance(spec.mesh, Mesh)
        and is_array(leaf)
    ]
    if unbound:
        raise _abstract_mesh_error(caller, unbound)


def _check_block(
    shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh | AbstractMesh, leaf: Any
) -> tuple[PartitionSpec, list[str]]:
    """`check_spec` for one process's block of a global array (a host array with
    `host_local`): each process's devices must hold one slice of the array, and the
    array must fit `spec`."""
    if is_global(leaf) or not isinstance(mesh, Mesh):
        return check_spec(shape, spec, dict(mesh.shape))
    full, block_reasons, block_fixed = host_local_shape(shape, spec, mesh)
    fixed, reasons = check_spec(full, spec, dict(mesh.shape))
    if reasons and full != shape:
        reasons.insert(0, f"the blocks of all processes make an array of shape {full}")
    if block_reasons:
        return block_fixed, block_reasons + reasons
    return fixed, reasons


def _match(
    tree: PyTree,
    specs: PyTree,
    mesh: Mesh | AbstractMesh | None,
    *,
    caller: str,
    root: KeyPath = (),
    host_local: bool = False,
) -> list[tuple[KeyPath, Any, NamedSharding | None]]:
    """Every leaf of `tree` with its path and the `NamedSharding` it must get, or
    `None` for the leaves that stay where they are. All the leaves whose spec does
    not fit are reported in one `ValueError`. With `host_local`, host arrays are
    each process's block of the global array, whose shape is checked instead."""
    leaves = jtu.tree_leaves(tree)
    pairs = [(root + p, s) for p, s in leaf_specs(specs, tree, caller=caller)]
    _check_movable(caller, pairs, leaves)
    if any(
        isinstance(spec, PartitionSpec) and is_array(leaf)
        for (_, spec), leaf in zip(pairs, leaves, strict=True)
    ):
        mesh = _concrete_mesh(mesh, caller)
    problems = check_leaves(
        pairs,
        leaves,
        mesh,
        check=ft.partial(
            check_placeable, _check_block if host_local else check_spec_on_mesh
        ),
    )
    if problems:
        raise ValueError(spec_error_message(caller, problems))
    matched = []
    for (path, spec), leaf in zip(pairs, leaves, strict=True):
        if spec is None or not is_array(leaf):
            matched.append((path, leaf, None))
        elif isinstance(spec, NamedSharding):  # its memory kind included
            matched.append((path, leaf, spec))
        else:  # a `PartitionSpec`, so `mesh` is the concrete mesh found above
            matched.append((path, leaf, NamedSharding(typing.cast(Mesh, mesh), spec)))
    return matched


# ---------------------------------------------------------------------------------
# 3. Shard: one batched device_put, or per-process shards in a multi-process run.
# ---------------------------------------------------------------------------------


def _place(
    matched: list[tuple[KeyPath, Any, NamedSharding | None]],
    casts: list[np.dtype | None],
    *,
    caller: str,
    host_local: bool = False,
    donate: bool = False,
) -> list[Any]:
    """The leaves of `matched`, the arrays among them moved to their shardings and
    cast as `casts` says (see `_host.py`). An array that stands at several leaves
    with one sharding is placed once, and the result stands at all of them. With
    `donate`, in one process, JAX arrays give up their old buffers. Raises, before
    anything is returned, if data would lose values."""
    out = [leaf for _, leaf, _ in matched]
    first: dict[tuple[int, NamedSharding, Any], int] = {}
    unique: list[int] = []  # the leaves to place, one per distinct array
    slots: list[tuple[int, int]] = []  # (leaf, its entry of `unique`)
    for i, (_, leaf, sharding) in enumerate(matched):
        if sharding is None:
            continue
        key = (id(leaf), sharding, casts[i])
        if key not in first:
            first[key] = len(unique)
            unique.append(i)
        slots.append((i, first[key]))
    given = [matched[i][1] for i in unique]
    shardings = [typing.cast(NamedSharding, matched[i][2]) for i in unique]
    cast_of = [casts[i] for i in unique]
    # JAX arrays whose sharding or dtype must change would compile a program per
    # shape in `jax.device_put`: they go through the host on CPU, and through one
    # program for the whole tree elsewhere (why: `_resident.py`).
    routes = [route(x, s, c) for x, s, c in zip(given, shardings, cast_of, strict=True)]
    by_host = [k for k, r in enumerate(routes) if r == "host"]
    by_program = [k for k, r in enumerate(routes) if r == "program"]
    sources = list(given)  # what is placed: fetched host copies for the host route
    for k, value in zip(by_host, _fetch([given[k] for k in by_host]), strict=True):
        sources[k] = value
    ready: list[Any] = []
    lost = []
    for k, leaf in enumerate(sources):
        path = matched[unique[k]][0]
        if isinstance(leaf, jax.Array):
            cast = None if routes[k] == "program" else cast_of[k]
            ready.append(leaf if cast is None else leaf.astype(cast))
            continue
        array, what, asked = host_ready(leaf, cast_of[k], shardings[k])
        if what is not None:
            lost.append((path, np.asarray(leaf).dtype, array.dtype, what, asked))
        ready.append(array)
    moved: dict[int, jax.Array] = {}
    if by_program:
        placed, overflowed = move_in_programs(
            [given[k] for k in by_program],
            [shardings[k] for k in by_program],
            [cast_of[k] for k in by_program],
        )
        moved = dict(zip(by_program, placed, strict=True))
        for j, count, largest in overflowed:
            k = by_program[j]
            target = np.dtype(typing.cast(np.dtype, cast_of[k]))
            what = overflow_text(count, largest, target)
            lost.append((matched[unique[k]][0], given[k].dtype, target, what, True))
    if lost:
        raise loss_error(caller, lost)
    if jax.process_count() == 1:
        # Arrays placed by a program are in place already: the others move in one
        # batched `device_put`.
        rest = [k for k in range(len(ready)) if k not in moved]
        rest_ready = [ready[k] for k in rest]
        rest_shardings = [shardings[k] for k in rest]
        # An array that stands at several leaves cannot give its buffer twice.
        shared = set(itertools.chain(*repeated_arrays(given))) if donate else set()
        donated = [
            donate and isinstance(ready[k], jax.Array) and k not in shared for k in rest
        ]
        if any(donated):
            placed = jax.device_put(rest_ready, rest_shardings, donate=donated)
        else:
            placed = jax.device_put(rest_ready, rest_shardings)
        placed = _unaliased(
            placed, rest_ready, [sources[k] for k in rest], rest_shardings
        )
        moved.update(zip(rest, placed, strict=True))
    else:
        moved = {
            k: _to_global(x, s, host_local)
            for k, (x, s) in enumerate(zip(ready, shardings, strict=True))
        }
    for i, slot in slots:
        out[i] = moved[slot]
    return out


def _unaliased(
    placed: list[jax.Array],
    ready: list[Any],
    given: list[Any],
    shardings: list[NamedSharding],
) -> list[jax.Array]:
    """`placed`, with the arrays whose device buffers are the caller's own NumPy
    memory (large arrays placed as given; see `_host.py`) placed again from a
    private copy."""
    aliased = [
        k
        for k, (x, leaf) in enumerate(zip(ready, given, strict=True))
        if (x is leaf or getattr(x, "base", None) is leaf)
        and isinstance(x, np.ndarray)
        and may_alias(shardings[k])
        and shares_memory(placed[k], x)
    ]
    if not aliased:
        return placed
    again = jax.device_put(
        [private_copy(ready[k]) for k in aliased], [shardings[k] for k in aliased]
    )
    placed = list(placed)
    for k, array in zip(aliased, again, strict=True):
        placed[k] = array
    return placed


def _to_global(leaf: Any, sharding: NamedSharding, host_local: bool) -> jax.Array:
    """One array of a multi-process run on its sharding: a global array is laid
    out again; host data is this process's full copy or, with `host_local`, its
    block of the array."""
    if is_global(leaf):
        return jax.device_put(leaf, sharding)
    if is_key(leaf):  # NumPy has no key dtype: place the key's data, wrap it again
        data = _to_global(key_data(leaf), sharding, host_local)
        return jax.random.wrap_key_data(data, impl=key_impl_name(leaf))
    leaf = np.asarray(leaf)  # JAX arrays on this process's devices included
    if host_local:
        return from_host_local(leaf, sharding)
    return from_host_copies(leaf, sharding)


@typecheck
def shard(
    tree: PyTree,
    specs: PyTree,
    mesh: Mesh | AbstractMesh | None = None,
    *,
    dtype: Any = None,
    check_values: CheckValues = "sample",
) -> PyTree:
    """Places the arrays of a pytree on a mesh.

    Every array leaf (`jax.Array` or NumPy) gets `NamedSharding(mesh, spec)`;
    everything else (static fields, callables, Python scalars, `None`) is returned
    untouched, so an Equinox module comes back as a module of the same type. All
    arrays move in one batched `jax.device_put`, with no compilation, and JAX
    arrays already on other devices or meshes move without one compilation per
    shape (on CPU through the host, on GPU and TPU in one program for the tree).

    In a multi-process run, every process of the mesh makes the same call with a
    full copy of every array, and copies to its devices only the shards they hold.
    The processes first compare their paths, shapes, dtypes, specs and values
    (one 16-byte all-gather of a hash of them all), so that a mismatch raises the
    same error on every process, naming the leaves that differ, instead of a hang
    or wrong values. By default the values compared are a sample: 64 elements of
    each array, evenly spread (all of a smaller one), which costs next to nothing
    but misses copies that differ only elsewhere; `check_values="full"` hashes
    every byte instead (one BLAKE2b pass, about 1.5 s per GiB on one CPU core).
    To pass each process's own part of an array instead (such as its part of the
    batch), use `Partitioner.move_to_devices(..., host_local=True)`.

    Every spec is checked before anything moves, and `shard` never corrects a spec:
    all the leaves whose specs cannot apply are reported together.

    **Arguments:**

    - `tree`: any pytree, e.g. an Equinox module.
    - `specs`: a spec tree for `tree` (`PartitionSpec`s or `NamedSharding`s where
      `tree` has arrays) or a prefix of one (one spec for a whole subtree; `None`
      leaves that subtree where it is), partition rules, or a function of the
      abstract tree returning a spec tree (see [the spec-tree family](specs.md)).
    - `mesh`: the mesh for `PartitionSpec`s; defaults to the mesh set by
      `jax.set_mesh`. Not needed when `specs` holds only `NamedSharding`s.
    - `dtype`: if given, floating arrays are cast to it while placed (e.g. a
      float32 checkpoint loaded as bfloat16): a floating dtype for all of them,
      or a tree of dtypes and `None`s (keep) that is a prefix of `tree`, to keep
      some in float32 on purpose (e.g. `{"layers": jnp.bfloat16, "norm": None}`).
      NumPy arrays are cast on host and JAX arrays with the rest of the tree
      (through the host on CPU, in one program elsewhere); a cast that would
      turn finite values into inf is refused.
    - `check_values`: in a multi-process run, how much of the values the processes
      compare: `"sample"` (64 elements of each array) or `"full"` (every byte).

    NumPy data loses nothing: with `jax_enable_x64` off, 64-bit arrays are placed
    as 32-bit ones (as JAX does) only if every value survives (integers in range,
    floats still finite; checked with one vectorised pass), and refused
    otherwise. Big-endian arrays are converted to native byte order. Placed
    arrays never share memory with the caller's NumPy buffers (on CPU, a NumPy
    array is copied once into a private buffer), so a data loader may reuse its
    buffers. An array that stands at several leaves with one spec (tied weights)
    is placed once and comes back as one array at all of them. An
    [`eqshard.HostKey`][] (a PRNG key as [`eqshard.gather`][] gives it) becomes a
    key array again, placed with its spec.

    **Returns:**

    A pytree of the structure of `tree`, its arrays now on the mesh.

    **Raises:**

    - `ValueError` if `specs` is not a prefix of `tree` (naming the first path that
      differs), if no mesh is given or set, or if specs cannot apply: an unknown
      mesh axis (or an entry that is no axis name, such as `P(1)`), a mesh axis
      used twice, `P.UNCONSTRAINED` (a layout only `jit` can choose), a spec
      longer than the array's rank, or a dimension not divisible by its mesh
      axes. The message names every such leaf,
      its shape and spec, and the nearest spec that fits. In a multi-process run,
      also (on every process) if the processes' paths, shapes, dtypes or specs
      differ, or their copies of an array do.
      Also, naming the arrays, if NumPy data would lose values (see above), if
      an array was deleted (donated), if `dtype` is not floating, or if
      `check_values` is neither `"sample"` nor `"full"`.
    - `TypeError` if `tree` holds `jax.ShapeDtypeStruct`s (no data to place), if a
      leaf of `specs` is not a spec, if `mesh` or a `NamedSharding`'s mesh is
      abstract,
      or if NumPy arrays have a dtype no device holds (strings, bytes, dates,
      objects, long doubles).

    !!! Example

        ```python
        mesh = eqshard.create_mesh((2, 4), ("dp", "tp"))
        model = eqx.nn.Linear(512, 256, key=jax.random.key(0))
        rules = [("weight", P("tp", None)), (".*", P())]
        specs = eqshard.match_partition_rules(rules, model)
        model = eqshard.shard(model, specs, mesh)
        model.weight.sharding  # NamedSharding(mesh, P('tp', None))
        ```
    """
    check_choice(check_values, CHECK_VALUES, caller="shard", name="check_values")
    specs = resolve_specs(specs, tree, caller="shard", mesh=mesh)
    return shard_tree(
        tree, specs, mesh, dtype=dtype, caller="shard", check_values=check_values
    )


def shard_tree(
    tree: PyTree,
    specs: PyTree,
    mesh: Mesh | AbstractMesh | None,
    *,
    dtype: Any,
    caller: str,
    root: KeyPath = (),
    host_local: bool = False,
    donate: bool = False,
    check_values: CheckValues = "sample",
) -> PyTree:
    """[`eqshard.shard`][], also for one subtree at `root` (the functions of
    `make_shard_and_gather_fns`), and for `Partitioner.move_to_devices`: host-local
    blocks (`host_local`) and, in one process, donated buffers (`donate`)."""
    if jax.process_count() > 1:
        # All processes compare their trees first: a process whose tree differs
        # could otherwise fail validation alone and leave the others waiting in a
        # collective.
        check_processes_agree(
            caller,
            tree,
            specs,
            mesh,
            root=root,
            host_local=host_local,
            check_values=check_values,
        )
    matched = _match(tree, specs, mesh, caller=caller, root=root, host_local=host_local)
    casts = leaf_casts(dtype, tree, caller=caller, root=root)
    placed = _place(matched, casts, caller=caller, host_local=host_local, donate=donate)
    out = jtu.tree_unflatten(jtu.tree_structure(tree), placed)
    if any(is_host_key(x) for x in jtu.tree_leaves(tree, is_leaf=is_host_key)):
        out = wrap_host_keys(out)
    return out


# ---------------------------------------------------------------------------------
# 4. Gather: straight to host, never through a replica on every device.
# ---------------------------------------------------------------------------------


def _uncached(array: jax.Array) -> jax.Array:
    """A new `jax.Array` over the same device buffers as `array`, copying nothing.

    `jax.device_get(array)` caches its host copy on `array`, where it lives as long
    as `array` does: a gathered model would keep a hidden second host copy, and
    `iter_gather` would hold every leaf at once. Copying through this wrapper puts
    the cache on the wrapper, which dies with it."""
    return jax.make_array_from_single_device_arrays(
        array.shape, array.sharding, [piece.data for piece in array.addressable_shards]
    )


@ft.lru_cache(maxsize=4096)
def _cpu_blocks(
    sharding: Any, shape: tuple[int, ...]
) -> tuple[tuple[int, tuple[slice, ...]], ...] | None:
    """For an array on CPU devices only: one `(k, index)` per distinct block of it,
    `k` being the block's position in `array.addressable_data(k)` (the order of
    `addressable_devices_indices_map`). `None` on other devices."""
    mapping = sharding.addressable_devices_indices_map(shape)
    if any(device.platform != "cpu" for device in mapping):
        return None
    blocks: dict[tuple[Any, ...], tuple[int, tuple[slice, ...]]] = {}
    for k, index in enumerate(mapping.values()):
        key = tuple(s.indices(n) for s, n in zip(index, shape, strict=True))
        blocks.setdefault(key, (k, index))
    return tuple(blocks.values())


def _fetch(arrays: list[jax.Array]) -> list[np.ndarray]:
    """The values of fully addressable arrays on this host, as `jax.device_get`
    gives them, without leaving a host copy cached on the arrays.

    `jax.device_get` caches an array's host copy on it, where it lives as long as
    the array does: a gathered model would keep a hidden second host copy, and
    `iter_gather` would hold every leaf at once. On CPU each distinct block is
    read from its device buffer (no copy, so nothing is cached) into the result;
    elsewhere each array is read through a short-lived `_uncached` wrapper."""
    out: list[Any] = [None] * len(arrays)
    elsewhere = []
    for i, array in enumerate(arrays):
        shape = tuple(array.shape)
        blocks = _cpu_blocks(array.sharding, shape)
        if blocks is None:
            elsewhere.append(i)
        elif len(blocks) == 1:  # one block: the whole array
            out[i] = np.asarray(array.addressable_data(blocks[0][0]))
        else:
            value = np.empty(shape, array.dtype)
            for k, index in blocks:
                value[index] = np.asarray(array.addressable_data(k))
            out[i] = value
    if elsewhere:
        values = jax.device_get([_uncached(arrays[i]) for i in elsewhere])
        for i, value in zip(elsewhere, values, strict=True):
            out[i] = value
    return out


def _to_host(array: jax.Array) -> np.ndarray:
    """The full value of one array on this process's host."""
    if array.is_fully_addressable:
        return np.asarray(_fetch([array])[0])
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
    asks for a cast. Everything else (NumPy arrays, static fields, callables, Python
    scalars, `None`) is returned as it is. Arrays whose shards this process can see
    are copied with one `jax.device_get`; in a multi-process run, arrays spread over
    several processes are gathered one at a time without ever putting a full copy
    on every device, and every process gets the full value. Every process must
    then make the same call, since those arrays are gathered by all of them
    together (arrays every process already holds whole need no communication).
    Before that, the processes meet at a barrier of the distributed client: a
    process that gathers alone raises after `timeout` seconds, naming the arrays,
    instead of waiting forever.

    Use it before `eqx.tree_serialise_leaves`; [`eqshard.shard`][] puts the
    deserialised tree back. A typed PRNG key array (`jax.random.key`), which NumPy
    cannot hold, comes back as an [`eqshard.HostKey`][]: its data as NumPy and the
    name of its implementation. Deserialise into the gathered tree (or one
    gathered alike) and `shard` makes it a key array again, equal to the first.
    For trees too large to hold on host twice, see [`eqshard.iter_gather`][].

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
    for i, value in zip(local, _fetch([leaves[i] for i in local]), strict=True):
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


# ---------------------------------------------------------------------------------
# Shardings and per-leaf functions, for code that places leaves itself.
# ---------------------------------------------------------------------------------


@typecheck
def named_shardings(
    specs: PyTree, mesh: Mesh | AbstractMesh | None = None, *, like: PyTree = None
) -> PyTree:
    """Turns a spec tree into a tree of `NamedSharding`s on `mesh`.

    `NamedSharding`s and `None`s are kept as they are. The result can be passed to
    `jax.jit`'s `in_shardings`/`out_shardings` or to `jax.device_put`.

    **Arguments:**

    - `specs`: a pytree of `PartitionSpec`s, `NamedSharding`s and `None`s; with
      `like`, also partition rules or a function of the abstract tree (see
      [the spec-tree family](specs.md)).
    - `mesh`: defaults to the mesh set by `jax.set_mesh`.
    - `like`: the tree the specs are for, concrete or abstract: needed for rules
      and functions only.

    **Returns:**

    A pytree of the structure of `specs` (of what rules or a function give for
    `like`).

    **Raises:**

    - `ValueError` if no mesh is given or set, or if specs name a mesh axis that
      `mesh` lacks or name one twice (the message names every such path).
    - `TypeError` naming the paths of the leaves that are not specs, or if `mesh`
      is an `AbstractMesh`.

    !!! Example

        ```python
        shardings = eqshard.named_shardings({"w": P("tp"), "b": P()}, mesh)
        jax.jit(f, in_shardings=(shardings,))
        ```
    """
    caller = "named_shardings"
    specs = resolve_specs(
        specs,
        NO_TREE if like is None else like,
        caller=caller,
        mesh=mesh,
        no_tree="Pass the tree they are for as `like=`.",
    )
    path_specs, treedef = jtu.tree_flatten_with_path(specs, is_leaf=is_spec_leaf)
    not_specs = [
        bad_spec_leaf_message(caller, path, spec, logical=False)
        for path, spec in path_specs
        if not is_spec_leaf(spec)
    ]
    if not_specs:
        raise TypeError(_every_leaf(caller, "are not specs", not_specs))
    out = []
    problems = []
    for path, spec in path_specs:
        if isinstance(spec, PartitionSpec):
            mesh = _concrete_mesh(mesh, caller)
            try:
                spec = named_sharding(spec, mesh, caller=caller, path=path)
            except ValueError as error:  # every bad leaf is reported at once
                problems.append(str(error))
        out.append(spec)
    if problems:
        raise ValueError(_every_leaf(caller, "cannot apply", problems))
    return jtu.tree_unflatten(treedef, out)


def _every_leaf(caller: str, what: str, messages: list[str]) -> str:
    """One message for several leaves, each of whose `messages` starts with
    `eqshard.<caller>: `."""
    if len(messages) == 1:
        return messages[0]
    prefix = f"eqshard.{caller}: "
    lines = [f"{prefix}{len(messages)} leaves of `specs` {what}:"]
    lines += [f"  - {m.removeprefix(prefix)}" for m in messages]
    return "\n".join(lines)


@typecheck
def make_shard_and_gather_fns(
    specs: PyTree, mesh: Mesh | AbstractMesh | None = None, *, dtype: Any = None
) -> tuple[PyTree, PyTree]:
    """Makes trees of functions that shard and gather one leaf (or subtree) each.

    For code that moves a tree piece by piece, such as a checkpoint loader, with
    [`eqshard.tree_apply`][]. Each function does what [`eqshard.shard`][] or
    [`eqshard.gather`][] does for its part of the tree, with no compilation, and its
    errors name the full path.

    **Arguments:**

    - `specs`: a spec tree (or prefix of one), as for [`eqshard.shard`][].
    - `mesh`: defaults to the mesh set by `jax.set_mesh` when the functions are made.
    - `dtype`: if given, a floating dtype the functions cast floating arrays to
      (one dtype: each function sees only its part of the tree).

    **Returns:**

    `(shard_fns, gather_fns)`, two pytrees of the structure of `specs`, with a
    function where `specs` has a spec and `None` where it has `None`.

    **Raises:**

    As [`eqshard.shard`][], when a function is called.

    !!! Example

        ```python
        shard_fns, gather_fns = eqshard.compat.make_shard_and_gather_fns(specs, mesh)
        model = eqshard.tree_apply(shard_fns, host_model)
        host_model = eqshard.tree_apply(gather_fns, model)
        ```
    """
    caller = "compat.make_shard_and_gather_fns"
    specs = resolve_specs(specs, NO_TREE, caller=caller, mesh=mesh)
    path_specs, treedef = jtu.tree_flatten_with_path(specs, is_leaf=is_spec_leaf)
    if dtype is not None:
        check_cast_dtype(dtype, caller)
    if any(isinstance(spec, PartitionSpec) for _, spec in path_specs):
        mesh = _concrete_mesh(mesh, caller)
    gather_fn = ft.partial(gather, dtype=dtype)
    shard_fns, gather_fns = [], []
    for path, spec in path_specs:
        if spec is None:
            shard_fns.append(None)
            gather_fns.append(None)
            continue
        shard_fns.append(
            ft.partial(
                shard_tree,
                specs=spec,
                mesh=mesh,
                dtype=dtype,
                caller="shard",
                root=path,
            )
        )
        gather_fns.append(gather_fn)
    return jtu.tree_unflatten(treedef, shard_fns), jtu.tree_unflatten(
        treedef, gather_fns
    )
