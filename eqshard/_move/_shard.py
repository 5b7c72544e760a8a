"""Moving pytrees onto meshes.

How data moves, in the order of this file:

1. **One record per leaf, validated first** (`_leaves.py`): each leaf becomes a
   `Leaf` (its path, value, the `NamedSharding` it must get or `None`, and its
   cast), and every spec is checked before any data moves.
2. **Place**, in three steps over the distinct arrays (`_Move`s):
   - *tied arrays*: an array that stands at several leaves with one sharding is
     placed once, and the result stands at all of them;
   - *staging*: each array is made ready to hand to JAX, losing nothing: NumPy
     data is cast and copied on host (`_host.py`); JAX arrays whose sharding or
     dtype must change, which `device_put` would move with a program compiled
     per shape, are copied block by block on CPU (the copy engine's `between`,
     `_copies.py`; through the host for host memory kinds), and move in one
     program for the tree on GPU and TPU (`_resident.py`); data that would lose
     values is refused, naming every array;
   - *placing*, by the copy engine's `to_devices` (`_copies.py`): in one process
     the rest move in one batched `jax.device_put` (on CPU devices, NumPy
     arrays whose blocks are strided are spread over the cores: `_threads.py`),
     and `shard` waits for the transfers that read the caller's NumPy buffers,
     placing again from a private copy any array whose device buffers are that
     memory (`_host.py`, 3-4); in a multi-process run, each process supplies
     only the shards its own devices hold, from a full copy of each array or
     (for `Partitioner.move_to_devices(host_local=True)`) from its own block of
     it (`_multiprocess.py`), and checks with the others that they all passed
     the same tree (a 16-byte digest each, through the distributed client),
     posting its digest before placing and reading the others' after
     (`_agreement.py`).

A tree of NumPy arrays that `shard` checked before, with the same structure,
specs, mesh, shapes and dtypes (a data pipeline's batch), skips the checks and
is placed by the plan kept for it (`_plans.py`).

With `max_inflight_bytes`, staging and placing run batch by batch (at most that
many bytes of new blocks per device each), and with `donate` each batch's
sources are freed once placed (`_reshard.py`).

After these comes `named_shardings`, for code that moves a tree piece by piece.
Copying back to host is `_gather.py`; `with_sharding_constraint`, which moves
nothing itself, is in `_transforms/_constraint.py`.
"""

import collections
import dataclasses
import typing
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._keys import is_key, key_data, key_impl_name, wrap_host_keys
from .._mesh._current import concrete_mesh
from .._mesh._targets import require_runnable
from .._spectree._check_spec import (
    bad_spec_leaf_message,
    is_spec_leaf,
    named_sharding,
)
from .._spectree._memory import Host
from .._spectree._resolve import resolve_like, resolve_specs
from .._tree import (
    listing,
)
from .._typing import (
    check_choice,
    CHECK_VALUES,
    CheckValues,
    KeyPath,
    typecheck,
)
from ._agreement import agreed_alone, start_agreement
from ._copies import between, plain as copies_plain, to_devices, to_host
from ._host import (
    host_ready,
    loss_error,
    lost_text,
)
from ._leaves import Leaf, leaves_of
from ._multiprocess import (
    check_timeout,
    from_host_copies,
    from_host_local,
    host_value,
    is_global,
)
from ._plans import keep, place as place_planned, Planned, planned
from ._reshard import (
    batches,
    check_inflight,
    check_max_inflight,
    check_traced,
    move_size,
    release,
)
from ._resident import move_in_programs, Route, route


# ---------------------------------------------------------------------------------
# 3. Place: tied arrays, staging, placing.
# ---------------------------------------------------------------------------------


@dataclasses.dataclass
class _Move:
    """One distinct array to place, filled in step by step."""

    leaf: Leaf  # the first leaf it stands at
    route: Route | None  # how a JAX array reaches its sharding (`_resident.py`)
    source: Any = None  # the value to stage: the leaf's, or its host copy
    ready: Any = None  # what `device_put` gets: staged, cast, private
    placed: jax.Array | None = None


def _distinct(leaves: list[Leaf]) -> tuple[list[_Move], list[_Move | None]]:
    """Tied arrays: one `_Move` per distinct (array, sharding, cast), and for each
    leaf the move that places it (`None` for a leaf that stays)."""
    moves: dict[tuple[int, NamedSharding, Any], _Move] = {}
    of_leaf: list[_Move | None] = []
    for leaf in leaves:
        if leaf.sharding is None:
            of_leaf.append(None)
            continue
        key = (id(leaf.value), leaf.sharding, leaf.cast)
        if key not in moves:
            moves[key] = _Move(leaf, route(leaf.value, leaf.sharding, leaf.cast))
        of_leaf.append(moves[key])
    return list(moves.values()), of_leaf


# A value lost by a conversion: `(path, source dtype, target dtype, what, asked)`.
_Loss = tuple[KeyPath, np.dtype, np.dtype, str, bool]


def _stage(moves: list[_Move], *, plain: bool) -> list[_Loss]:
    """Staging: each move's `ready` value, for `device_put` (the `"program"` and
    `"blocks"` routes move in `_move_in_programs` instead). JAX arrays of the
    `"host"` route are fetched to host first. Returns what the conversions would
    lose. `plain`: the copy engine's plain route (`_copies.py`)."""
    by_host = [m for m in moves if m.route == "host"]
    if by_host:
        values = to_host([m.leaf.value for m in by_host])
        for move, value in zip(by_host, values, strict=True):
            move.source = value
    lost = []
    for move in moves:
        if move.route in ("program", "blocks"):
            continue
        leaf = move.leaf
        source = leaf.value if move.source is None else move.source
        move.source = source
        if isinstance(source, jax.Array):
            move.ready = source if leaf.cast is None else source.astype(leaf.cast)
            continue
        move.ready, what, asked = host_ready(
            source, leaf.cast, leaf.sharding, plain=plain
        )
        if what is not None:
            found = np.asarray(source).dtype
            lost.append((leaf.path, found, move.ready.dtype, what, asked))
    return lost


def _move_in_programs(moves: list[_Move]) -> list[_Loss]:
    """The JAX arrays of the `"blocks"` route, placed (and cast) by the copy
    engine (`_copies.between`), and those of the `"program"` route, by one
    program for the tree; returns the casts that lost values."""
    lost = []
    for name, move in (("blocks", between), ("program", move_in_programs)):
        group = [m for m in moves if m.route == name]
        if not group:
            continue
        placed, casts_lost = move(
            [m.leaf.value for m in group],
            [typing.cast(NamedSharding, m.leaf.sharding) for m in group],
            [m.leaf.cast for m in group],
        )
        for m, array in zip(group, placed, strict=True):
            m.placed = array
        for j, what in casts_lost:
            leaf = group[j].leaf
            lost.append(
                (leaf.path, leaf.value.dtype, what.dtype, lost_text(what), True)
            )
    return lost


def _put(
    moves: list[_Move],
    *,
    host_local: bool,
    donate: bool,
    moved_from: collections.Counter[int],
    plain: bool,
) -> None:
    """Placing, by the copy engine (`_copies.to_devices`; `plain`: its plain
    route): the moves not placed yet, in one batched `jax.device_put` in one
    process, or one process's shards of each in a multi-process run. It returns
    once no device reads the caller's NumPy memory, nor holds it as a buffer.
    With `donate` (one process), JAX arrays give up their old buffers, but an
    array that stands in several moves (`moved_from`: how many, by `id`) cannot
    give its buffer twice."""
    rest = [m for m in moves if m.placed is None]
    donated = None
    if donate:
        donated = [
            isinstance(m.ready, jax.Array) and moved_from[id(m.leaf.value)] == 1
            for m in rest
        ]

    def put(values: list[Any], shardings: list[NamedSharding]) -> list[jax.Array]:
        return [
            _to_global(v, s, host_local) for v, s in zip(values, shardings, strict=True)
        ]

    placed = to_devices(
        [m.ready for m in rest],
        [typing.cast(NamedSharding, m.leaf.sharding) for m in rest],
        [m.leaf.value for m in rest],
        donate=donated,
        put=None if jax.process_count() == 1 else put,
        host_local=host_local,
        plain_route=plain,
    )
    for move, array in zip(rest, placed, strict=True):
        move.placed = array


def _to_global(leaf: Any, sharding: NamedSharding, host_local: bool) -> jax.Array:
    """One array of a multi-process run on its sharding: a global array is laid
    out again; host data is this process's full copy or, with `host_local`, its
    block of the array."""
    if is_key(leaf):  # NumPy has no key dtype: place the key's data, wrap it again
        data = _to_global(key_data(leaf), sharding, host_local)
        return jax.random.wrap_key_data(data, impl=key_impl_name(leaf))
    if is_global(leaf) and leaf.sharding.device_set == sharding.device_set:
        return jax.device_put(leaf, sharding)  # JAX's cross-process move applies
    if is_global(leaf):  # onto other devices: through the hosts
        return from_host_copies(host_value(leaf), sharding)
    leaf = np.asarray(leaf)  # JAX arrays on this process's devices included
    if host_local:
        return from_host_local(leaf, sharding)
    return from_host_copies(leaf, sharding)


def _place(
    leaves: list[Leaf],
    *,
    caller: str,
    host_local: bool,
    donate: bool,
    release_sources: bool = False,
    max_inflight_bytes: int | None = None,
) -> list[Any]:
    """The values of `leaves`, each array moved to its sharding and cast as asked,
    in batches of at most `max_inflight_bytes` per device (`_reshard.py`), each
    batch's sources deleted once placed with `release_sources`. Raises, before
    anything moves, if a bound is too small or NumPy data would lose values; a
    cast of JAX arrays that loses values raises before its batch is released."""
    moves, of_leaf = _distinct(leaves)
    groups = [list(range(len(moves)))]  # one batch without a bound
    if max_inflight_bytes is not None:
        sizes = [move_size(m.leaf) for m in moves]
        paths = [(m.leaf.path, n) for m, (_, n) in zip(moves, sizes, strict=True)]
        check_inflight(caller, paths, max_inflight_bytes)
        groups = batches(sizes, max_inflight_bytes)
    plain = copies_plain()  # the switch read once a call
    on_host = [m for m in moves if not isinstance(m.leaf.value, jax.Array)]
    lost = _stage(on_host, plain=plain)  # NumPy data: checked first
    if lost and len(groups) > 1:
        raise loss_error(caller, lost)
    moved_from: collections.Counter[int] = collections.Counter()
    left: collections.Counter[int] = collections.Counter()
    kept: set[int] = set()
    if donate or release_sources:
        moved_from.update(id(m.leaf.value) for m in moves)
        left.update(moved_from)
        kept = {id(leaf.value) for leaf in leaves if leaf.sharding is None}
    for group in groups:
        batch = [moves[i] for i in group]
        resident = [m for m in batch if isinstance(m.leaf.value, jax.Array)]
        if resident:
            lost += _stage(resident, plain=plain)  # one error for all
            lost += _move_in_programs(resident)
        if lost:
            raise loss_error(caller, lost)
        donating = donate and jax.process_count() == 1
        _put(
            batch,
            host_local=host_local,
            donate=donating,
            moved_from=moved_from,
            plain=plain,
        )
        if release_sources:
            release(
                [(m.leaf.value, m.placed) for m in batch],
                [(m.leaf.value, m.placed) for m in moves],
                left,
                kept,
            )
    return [
        leaf.value if move is None else move.placed
        for leaf, move in zip(leaves, of_leaf, strict=True)
    ]


@typecheck
def shard(
    tree: PyTree,
    specs: PyTree,
    mesh: Mesh | AbstractMesh | None = None,
    *,
    dtype: Any = None,
    donate: bool = False,
    max_inflight_bytes: int | None = None,
    check_values: CheckValues = "sample",
    timeout: float | int = 300.0,
) -> PyTree:
    """Places the arrays of a pytree on a mesh.

    Every array leaf (`jax.Array` or NumPy) gets `NamedSharding(mesh, spec)`;
    everything else is returned untouched (an Equinox module stays one). Specs
    are checked before anything moves, never corrected: the leaves whose specs
    cannot apply are reported together. NumPy data loses nothing; a placed state
    moves to any mesh of the job's devices; see
    [what `shard` guarantees](../how-to/shard-modules.md#what-shard-guarantees).
    Inside `jit`, use [`eqshard.with_sharding_constraint`][].

    **Arguments:**

    - `tree`: any pytree, e.g. an Equinox module.
    - `specs`: a spec tree or prefix (`None` leaves a subtree where it is),
      partition rules, or a function of the abstract tree ([spec trees](specs.md));
      [`eqshard.host`][]`(spec)` places in host memory.
    - `mesh`: for `PartitionSpec`s (not needed for `NamedSharding`s); defaults to
      the mesh set by `jax.set_mesh`.
    - `dtype`: the floating dtype to cast floats to, or a prefix tree of them or `None`.
    - `donate`: delete each of the caller's JAX arrays once its new one is placed.
    - `max_inflight_bytes`: the most new bytes a device gets at once (`shard_plan`).
    - `check_values`, `timeout`: across processes, how much of the values they
      compare (`"sample"` or `"full"`) and the seconds to wait for the others.

    **Returns:**

    A pytree of the structure of `tree`, its arrays now on the mesh.

    **Raises:**

    `ValueError` if `specs` is not a prefix of `tree`, there is no mesh, specs
    cannot apply (naming each leaf, its shape, spec and the nearest that fits),
    NumPy data would lose values, an array was deleted, a block exceeds
    `max_inflight_bytes`, an option is invalid, or processes' trees differ or one
    is late; `TypeError` for traced arrays or `ShapeDtypeStruct`s, a spec leaf
    that is no spec, an abstract mesh, or a NumPy dtype no device holds.

    !!! Example

        ```python
        model = eqx.nn.Linear(512, 256, key=jax.random.key(0))
        specs = eqshard.match_partition_rules([("weight", P("tp", None))], model)
        model = eqshard.shard(model, specs, eqshard.create_mesh((2, 4), ("dp", "tp")))
        model.weight.sharding  # NamedSharding(mesh, P('tp', None))
        ```
    """
    check_choice(check_values, CHECK_VALUES, caller="shard", name="check_values")
    check_timeout("shard", timeout)
    check_max_inflight("shard", max_inflight_bytes)
    if donate and max_inflight_bytes is not None and dtype is not None:
        raise ValueError(
            "eqshard.shard: `dtype=` with `donate=True` and `max_inflight_bytes` "
            "could delete arrays before a later cast is found to lose values. Cast "
            "first (`shard(tree, specs, mesh, dtype=...)`), then move with donate."
        )
    plan = None
    if dtype is None and not donate and max_inflight_bytes is None:
        plan = planned(tree, specs, mesh) if jax.process_count() == 1 else None
        placed = None if plan is None else place_planned(plan)
        if placed is not None:  # a tree of NumPy arrays checked before
            return placed
    check_traced("shard", tree)
    specs = resolve_specs(specs, tree, caller="shard", mesh=mesh)
    return shard_tree(
        tree,
        specs,
        mesh,
        dtype=dtype,
        caller="shard",
        release_sources=donate,
        max_inflight_bytes=max_inflight_bytes,
        check_values=check_values,
        timeout=timeout,
        plan=plan,
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
    release_sources: bool = False,
    max_inflight_bytes: int | None = None,
    check_values: CheckValues = "sample",
    timeout: float | int = 300.0,
    plan: Planned | None = None,
) -> PyTree:
    """[`eqshard.shard`][], also for one subtree at `root` (the functions of
    `make_shard_and_gather_fns`), and for `Partitioner.move_to_devices`: host-local
    blocks (`host_local`) and, in one process, donated buffers (`donate`). With
    `release_sources`, the caller's arrays are deleted once their new ones are
    placed, in batches of `max_inflight_bytes` per device (`_reshard.py`). For a
    tree of NumPy arrays (`plan`), its plan is kept once checked (`_plans.py`)."""
    require_runnable(caller, mesh)
    agreed = agreed_alone
    if jax.process_count() > 1:
        # All processes compare their trees: a process whose tree differs could
        # otherwise fail validation alone and leave the others waiting in a
        # collective. Each posts its digest now, and places full copies and
        # host-local blocks (its own work, no collective) while the others
        # arrive; JAX arrays wait for the others first, as laying one out again
        # may be a collective.
        agreed = start_agreement(
            caller,
            tree,
            specs,
            mesh,
            root=root,
            host_local=host_local,
            check_values=check_values,
            timeout=timeout,
        )
        if any(isinstance(x, jax.Array) for x in jtu.tree_leaves(tree)):
            agreed()
            agreed = agreed_alone
    try:
        leaves, treedef = leaves_of(
            tree,
            specs,
            mesh,
            dtype=dtype,
            caller=caller,
            root=root,
            host_local=host_local,
        )
        if plan is not None:
            keep(plan, [leaf.sharding for leaf in leaves])
        placed = _place(
            leaves,
            caller=caller,
            host_local=host_local,
            donate=donate,
            release_sources=release_sources,
            max_inflight_bytes=max_inflight_bytes,
        )
    except (TypeError, ValueError):  # what a tree that does not fit raises
        agreed()  # if the trees differ, that is the error, on every process
        raise
    agreed()
    # A `HostKey` whose data was placed is a key array again.
    return wrap_host_keys(jtu.tree_unflatten(treedef, placed))


# ---------------------------------------------------------------------------------
# Shardings and per-leaf functions, for code that places leaves itself.
# ---------------------------------------------------------------------------------


@typecheck
def named_shardings(
    specs: PyTree, mesh: Mesh | AbstractMesh | None = None, *, like: PyTree = None
) -> PyTree:
    """Turns a spec tree into a tree of `NamedSharding`s on `mesh`.

    `NamedSharding`s and `None`s are kept as they are; [`eqshard.host`][] specs
    give `NamedSharding`s with `memory_kind="pinned_host"`. The result can be
    passed to `jax.jit`'s `in_shardings`/`out_shardings` or to `jax.device_put`.

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
    specs = resolve_like(specs, like, caller=caller, mesh=mesh)
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
        if isinstance(spec, PartitionSpec | Host):
            mesh = concrete_mesh(mesh, caller=caller)
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
    header = f"{prefix}{len(messages)} leaves of `specs` {what}:"
    lines = [m.removeprefix(prefix) for m in messages]
    return listing(header, lines, limit=None)
