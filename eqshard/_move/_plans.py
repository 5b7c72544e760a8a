"""Checked plans for trees of NumPy arrays, kept to place a data pipeline's batches.

A training loop shards a batch of NumPy arrays every step: the same structure,
shapes, dtypes and specs each time. Checking it again (the tree flattened with
its paths, the specs broadcast against it, each spec checked against its
array's shape and the mesh) and deciding again how each array is staged is
Python work that a hand-written `jax.device_put` does not do, and it took about
as long as the transfer itself for a replicated batch of a few MiB
(`benchmarks/bench_shard_host.py`). So once `shard` has checked such a tree, it
keeps a plan: each leaf's sharding and whether it needs a private copy
(`_host.private_when`), under a key of everything they were computed from:

- the tree's structure (`PyTreeDef`, with an Equinox module's static fields);
- the specs: the spec itself, or the spec tree's structure and leaves;
- the mesh given, else the one set by `jax.set_mesh`;
- each leaf's shape and dtype.

A tree with a kept plan is placed by it: the copies it needs, then the copy
engine's `to_devices`, which waits for the transfers that read the caller's
memory, as for any tree. What depends on the buffers (whether the devices would
take an array in place) is read each call.

Only the plainest trees get a plan: every leaf a NumPy array (not a subclass)
that reaches the devices in its own dtype (no `dtype=` cast) whatever
`jax_enable_x64` says (no 64-bit dtype); specs that are `PartitionSpec`s,
`NamedSharding`s, `eqshard.host(PartitionSpec)`s or `None`s; no array at two
leaves; one process; the copy engine's fast route. Anything else
(JAX arrays, rules, functions of the tree, logical names, a static field that
cannot say whether it equals another) is checked on every call. At most
`MAX_PLANS` plans are kept; `eqshard.clear_caches` forgets them.
"""

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from .._caches import register
from .._internals import cpu
from .._mesh._current import find_mesh
from .._spectree._memory import Host
from .._tree import placed_dtype
from .._typing import PyTreeDef
from ._copies import plain, to_devices
from ._host import PRIVATE_BELOW, private_copy, private_when
from ._threads import movable


MAX_PLANS = 256

_ON_MESH = (PartitionSpec, Host)  # the specs that need the call's mesh


class _Step(NamedTuple):
    """How one leaf is placed: on `sharding` (`None`: it stays on host), from a
    private copy if `private` (`None`: if the devices would take it in place)."""

    sharding: NamedSharding | None
    private: bool | None


_PLANS: dict[Hashable, tuple[_Step, ...]] = {}
register(_PLANS.clear)


class Planned(NamedTuple):
    """A tree of NumPy arrays, flattened, and the key of its plan."""

    key: Hashable
    values: list[np.ndarray]
    treedef: PyTreeDef


def _is_spec(x: Any) -> bool:
    """A spec that means the same whatever the context: not logical names, which
    the rules in force resolve."""
    if isinstance(x, Host):
        return isinstance(x.spec, PartitionSpec)
    return x is None or isinstance(x, PartitionSpec | NamedSharding)


def planned(tree: Any, specs: Any, mesh: Mesh | AbstractMesh | None) -> Planned | None:
    """`tree` flattened, with the key of its plan, if its leaves are all NumPy
    arrays and `specs` is a spec or a tree of specs; `None` otherwise."""
    values, treedef = jtu.tree_flatten(tree)
    if not values or isinstance(mesh, AbstractMesh):
        return None
    for value in values:
        if type(value) is not np.ndarray:
            return None
    if _is_spec(specs):
        spec_key: Hashable = specs
        on_mesh = isinstance(specs, _ON_MESH)
    else:
        spec_leaves, spec_def = jtu.tree_flatten(specs, is_leaf=_is_spec)
        if not all(map(_is_spec, spec_leaves)):
            return None
        spec_key = (spec_def, tuple(spec_leaves))
        on_mesh = any(isinstance(spec, _ON_MESH) for spec in spec_leaves)
    key = (
        treedef,  # its hash leaves static fields out; equality compares them
        spec_key,
        find_mesh(mesh) if on_mesh else mesh,
        tuple([(value.shape, value.dtype) for value in values]),
    )
    return Planned(key, values, treedef)


def keep(tree: Planned, shardings: Sequence[NamedSharding | None]) -> None:
    """Keeps the plan of `tree`, whose leaves `shard` checked and found to go to
    `shardings`, if it is one of the trees the module docstring names."""
    if len({id(value) for value in tree.values}) < len(tree.values) or plain():
        return
    steps = []
    for value, sharding in zip(tree.values, shardings, strict=True):
        if placed_dtype(value.dtype) != value.dtype or not movable(value.dtype):
            return
        small = value.nbytes < PRIVATE_BELOW
        private = sharding is not None and private_when(sharding, small, False)
        steps.append(_Step(sharding, private))
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    try:
        _PLANS[tree.key] = tuple(steps)
    except (TypeError, ValueError):  # a static field that cannot say if it is equal
        return


def place(tree: Planned) -> Any:
    """The tree placed by its plan, or `None` if no plan is kept for it or it
    cannot take one (an array at two leaves, the plain route)."""
    try:
        steps = _PLANS.get(tree.key)
    except (TypeError, ValueError):
        return None
    values = tree.values
    if steps is None or len({id(value) for value in values}) < len(values) or plain():
        return None
    out: list[Any] = list(values)
    ready, shardings, sources, at = [], [], [], []
    for i, (value, (sharding, private)) in enumerate(zip(values, steps, strict=True)):
        if sharding is None:
            continue
        if private is None:
            private = cpu.takes_in_place(value, sharding)
        ready.append(private_copy(value) if private else value)
        shardings.append(sharding)
        sources.append(value)
        at.append(i)
    placed = to_devices(ready, shardings, sources, plain_route=False)
    for i, array in zip(at, placed, strict=True):
        out[i] = array
    return jtu.tree_unflatten(tree.treedef, out)
