"""`restore`: an orbax checkpoint read straight into the shardings asked for,
compared with `like` before any data is read, and checked for values lost (see
the package's docstring).
"""

import dataclasses
import functools as ft
import json
import os
import typing
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh
from jaxtyping import PyTree

from .._internals import routes
from .._keys import is_key
from .._move._host import (
    converted,
    leaf_casts,
    loss_error,
    Lost,
    lost_text,
    saturates,
    signed_with_zero,
)
from .._move._multiprocess import check_timeout, fail_together, meet
from .._move._threads import in_cpu_memory
from .._spectree._check_spec import (
    check_placeable,
    check_spec_on_mesh,
)
from .._spectree._derive import abstract_tree
from .._tree import paths_text
from .._typing import check_choice, KeyPath, ON_INVALID, OnInvalid, typecheck
from ._blocks import read_blocks
from ._disk import (
    Held,
    is_read_error,
    NOTHING_HELD,
    Saved,
    saved_arrays,
    SaveInProgressError,
    unreadable_error,
)
from ._restore_like import like_and_specs, needs_arguments
from ._save import tensorstore_has
from ._swap import generation, lock_holder
from ._targets import (
    abstract_target_error,
    check_against,
    import_optional,
    named_arrays,
    target_structs,
)
from ._views import into_views, layer_views, unstaged_fix


def _from_orbax(
    ocp: Any, path: str, layout: Any, wanted: dict[int, Any], caller: str
) -> dict[int, Any]:
    """The leaves of orbax's tree at the positions of `wanted`, each read by orbax
    as asked: a `jax.ShapeDtypeStruct` onto its sharding, a NumPy dtype whole on
    host. One read for all of them, and none of the others."""
    epath = import_optional("etils.epath", "orbax", caller)
    items: list[Any] = [ocp.PLACEHOLDER] * layout.num_leaves
    args: list[Any] = list(items)
    for k, want in wanted.items():
        if isinstance(want, jax.ShapeDtypeStruct):
            items[k] = want
            args[k] = ocp.checkpoint_utils.construct_restore_args(want)
        else:
            items[k] = 0
            args[k] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=want)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        got = handler.restore(
            epath.Path(path),
            args=ocp.args.PyTreeRestore(
                item=jtu.tree_unflatten(layout, items),
                restore_args=jtu.tree_unflatten(layout, args),
            ),
        )
    finally:
        handler.close()
    flat = layout.flatten_up_to(got)
    return {k: flat[k] for k in wanted}


def _fetch(
    ocp: Any,
    path: str,
    held: Held,
    wanted: dict[int, Any],
    names: dict[int, str],
    caller: str,
) -> dict[int, Any]:
    """`_from_orbax` (the plain route), the arrays bound for CPU devices' own
    memory read by `read_blocks` instead (the fast path `restore`, see
    `_blocks.py`): unless `EQSHARD_PLAIN_ROUTES` forces the plain route, or the
    door does not recognise orbax's type handlers (then it says so once, in a
    warning). `names` name them in errors."""
    blocks = {
        k: want
        for k, want in wanted.items()
        if isinstance(want, jax.ShapeDtypeStruct)
        and held.names[k] is not None
        and not is_key(want)
        and in_cpu_memory(want.sharding)
    }
    got = {}
    if blocks and not routes.plain("restore"):
        try:
            got = read_blocks(path, held, blocks, names, caller)
        except routes.Unrecognised as error:
            routes.fall_back("restore", str(error))
    rest = {k: want for k, want in wanted.items() if k not in got}
    if rest:
        got.update(_from_orbax(ocp, path, held.layout, rest, caller))
    return got


def _made_empty(target: jax.ShapeDtypeStruct) -> jax.Array:
    """A zero-size array on its sharding (nothing to read). Made from host data:
    `jit` gives zero-size outputs blocks of the whole array's shape."""
    if not is_key(target):
        value = np.empty(target.shape, target.dtype)
        return jax.make_array_from_callback(
            value.shape, target.sharding, lambda index: value[index], dtype=value.dtype
        )
    data = jax.eval_shape(jax.random.key_data, target)
    data = _made_empty(
        jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=target.sharding)
    )
    impl = jax.random.key_impl(jnp.empty((0,), target.dtype))
    return jax.random.wrap_key_data(data, impl=impl)


def _from_bits(x: jax.Array, dtype: np.dtype, target: Any) -> jax.Array:
    """Bits read as the integer type orbax holds them in, viewed as `dtype` and cast
    to `target`, on their sharding."""

    def view(bits: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(bits, dtype).astype(target)

    return jax.jit(view, out_shardings=x.sharding)(x)


def _read(
    ocp: Any,
    path: str,
    held: Held,
    saved: dict[str, Saved],
    targets: dict[str, jax.ShapeDtypeStruct],
    caller: str,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """Every target read onto its sharding (`read` in the module docstring), and a
    float32 reading of every narrowed integer array, to check it by."""
    wanted: dict[int, Any] = {}
    twins: dict[int, Any] = {}
    out: dict[str, jax.Array] = {}
    for name, target in targets.items():
        s = saved[name]
        if s.position is None:
            out[name] = _made_empty(target)
            continue
        dtype = s.stored if s.stored != s.dtype else target.dtype
        wanted[s.position] = jax.ShapeDtypeStruct(
            target.shape, dtype, sharding=target.sharding
        )
        if s.dtype.kind in "iu" and s.dtype != target.dtype and not is_key(target):
            twins[s.position] = jax.ShapeDtypeStruct(
                target.shape, jnp.float32, sharding=target.sharding
            )
    names = {s.position: n for n, s in saved.items() if s.position is not None}
    got = _fetch(ocp, path, held, wanted, names, caller) if wanted else {}
    read_twins = _fetch(ocp, path, held, twins, names, caller) if twins else {}
    checks = {}
    for name, target in targets.items():
        s = saved[name]
        if s.position is None:
            continue
        value = got[s.position]
        if s.stored != s.dtype:
            value = _from_bits(value, s.dtype, target.dtype)
        out[name] = value
        if s.position in read_twins:
            checks[name] = read_twins[s.position]
    return out, checks


def _found_in_shards(
    restored: dict[str, jax.Array], checks: dict[str, jax.Array], cast: list[str]
) -> dict[str, list[int | float]]:
    """What this process's shards show, each block once (its replica 0), one at a
    time on host (no program to compile): for each narrowed integer array, the
    values that differ from its float32 reading (a wrapped value differs in
    magnitude), `[how many, lowest, highest]`; for each cast floating array, how
    many values are inf or nan, `[how many]`."""
    found: dict[str, list[int | float]] = {}
    for name, reading in checks.items():
        by_device = {shard.device: shard.data for shard in reading.addressable_shards}
        count, low, high = 0, np.inf, -np.inf
        for shard in restored[name].addressable_shards:
            if shard.replica_id == 0:
                twin = np.asarray(by_device[shard.device])
                bad = np.asarray(shard.data).astype(np.float32) != twin
                if bad.any():
                    count += int(bad.sum())
                    low = min(low, float(twin[bad].min()))
                    high = max(high, float(twin[bad].max()))
        found[name] = [count, low, high]
    for name in cast:
        shards = restored[name].addressable_shards
        found[name] = [
            sum(
                int(np.count_nonzero(~np.isfinite(np.asarray(shard.data))))
                for shard in shards
                if shard.replica_id == 0
            )
        ]
    return found


def _losses(
    ocp: Any,
    path: str,
    held: Held,
    saved: dict[str, Saved],
    restored: dict[str, jax.Array],
    checks: dict[str, jax.Array],
    meeting: Any,
) -> dict[str, Lost]:
    """What placing the restored arrays lost, by name (`Nothing lost` in the
    module docstring). `meeting(status)` gives every process's status."""
    cast = [
        name
        for name, x in restored.items()
        if saved[name].position is not None
        and x.dtype != saved[name].dtype
        and jnp.issubdtype(saved[name].dtype, jnp.inexact)
    ]
    if not (checks or cast):
        return {}
    found = _found_in_shards(restored, checks, cast)
    statuses = meeting(json.dumps(found))
    for p, status in statuses.items():  # the other processes' shards
        if p == jax.process_index():
            continue
        for name, (count, *extremes) in json.loads(status).items():
            found[name][0] += count
            if extremes:
                found[name][1] = min(found[name][1], extremes[0])
                found[name][2] = max(found[name][2], extremes[1])
    lost: dict[str, Lost] = {}
    for name in checks:
        count, low, high = found[name]
        if count:
            info = np.iinfo(restored[name].dtype)
            extreme = low if info.min - low > high - info.max else high
            lost[name] = Lost(np.dtype(restored[name].dtype), int(count), extreme)
    overflowed = [name for name in cast if found[name][0]]
    if overflowed:  # inf or nan: overflowed, or saved so? The saved values tell.
        positions = {n: typing.cast(int, saved[n].position) for n in overflowed}
        wanted = {positions[n]: saved[n].stored for n in overflowed}
        host = _from_orbax(ocp, path, held.layout, wanted, "restore")
        for name in overflowed:
            source = host[positions[name]].view(saved[name].dtype)
            _, found_lost = converted(source, np.dtype(restored[name].dtype))
            if found_lost is not None:
                lost[name] = found_lost
    return lost


def _finished_during(caller: str, path: str) -> ValueError:
    return ValueError(
        f"eqshard.{caller}: a save to {path!r} finished during the restore, so "
        "what was read may mix two checkpoints, and nothing is returned. Restore "
        "again (once saves to that path have finished)."
    )


def _during_save(caller: str, path: str, before: Any, error: Exception) -> Exception:
    """`error`, or the error saying that a save finished during the restore (the
    checkpoint's generation changed), or that one was in progress (its lock is
    there) when `error` is eqshard's."""
    if isinstance(error, ValueError) and generation(path) != before:
        failure = _finished_during(caller, path)
        failure.__cause__ = error
        return failure
    holder = lock_holder(path)
    if (
        not isinstance(error, ValueError)
        or holder is None
        or isinstance(error, SaveInProgressError)
    ):
        return error
    failure = ValueError(
        f"{error} A save to {path!r} was in progress meanwhile ({holder} holds its "
        "lock): restore again when it has finished."
    )
    failure.__cause__ = error.__cause__
    return failure


def _like_fix(like: Any) -> str:
    """How to fix a `like` that does not match the checkpoint."""
    fix = (
        "Pass the `like` of the tree that was saved (an `eqx.filter_eval_shape` "
        "skeleton of it is enough)."
    )
    if needs_arguments(like):
        fix += (
            f" `like` is {like!r}, a function that takes arguments: to restore "
            "what it makes, give it with its arguments bound, e.g. "
            "`functools.partial(make, key)` for the `make` and `key` given to "
            "`eqshard.init_sharded`."
        )
    return fix


@dataclasses.dataclass(frozen=True)
class _Meeting:
    """How `restore`'s processes meet (before reading, after, and to compare what
    they lost)."""

    caller: str
    timeout: float | int
    cannot: str
    rule: str = "Every process must make the same `restore` call at the same point"

    def fail_together(self, failure: Exception | None, rows: Any = None) -> None:
        fail_together(
            self.caller,
            failure,
            self.timeout,
            rows=rows,
            cannot=self.cannot,
            rule=self.rule,
        )

    def status(self, status: str) -> Any:
        processes = tuple(range(jax.process_count()))
        return meet(
            self.caller,
            processes,
            self.timeout,
            cannot=self.cannot,
            rule=self.rule,
            status=status,
        )


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What `restore` reads: `like`'s arrays by name (`named`), their targets, the
    checkpoint's description of them (`saved`, `held`), the casts asked for, and
    the checkpoint's generation before the read."""

    named: dict[str, tuple[int, KeyPath, Any]]
    targets: dict[str, jax.ShapeDtypeStruct]
    saved: dict[str, Saved]
    casts: list[np.dtype | None]
    held: Held
    before: Any
    # The targets of the arrays read in another view of their layers.
    views: dict[str, jax.ShapeDtypeStruct] = dataclasses.field(default_factory=dict)


def _compared(
    ocp: Any,
    path: str,
    like: PyTree,
    specs: PyTree,
    mesh: Mesh | AbstractMesh | None,
    dtype: Any,
    before: Any,
    fix: str,
) -> _Plan:
    """The targets of `like`'s arrays, compared with the checkpoint's description
    of them (steps 1 to 3 in the package's docstring)."""
    caller = "restore"
    named = named_arrays(like, caller)
    if isinstance(mesh, AbstractMesh):
        raise abstract_target_error(caller, [p for _, p, _ in named.values()], mesh)
    placed = jtu.tree_leaves(like)
    if specs is not None:
        # Arrays read now need a layout: every spec checked as `shard` does
        # (`P.UNCONSTRAINED` refused), all at once.
        check = ft.partial(check_placeable, check_spec_on_mesh)
        target = abstract_tree(like, specs, mesh, caller=caller, check=check)
        placed = jtu.tree_leaves(target)
    casts = leaf_casts(dtype, like, caller=caller)
    _check_read_casts(named, casts, caller)
    targets = target_structs(named, placed, casts, caller)
    try:  # the checkpoint's description, compared with the targets
        saved, held = saved_arrays(ocp, path, caller)
        # Stacked layers saved in another view (`_views.py`): read as saved.
        targets, compared, views = layer_views(targets, named, saved)
        check_against(
            targets,
            compared,
            {name: (s.shape, s.dtype) for name, s in saved.items()},
            casts,
            caller=caller,
            where=f"the checkpoint at {path!r}",
            fix=fix + unstaged_fix(targets, named, saved),
        )
    except ValueError as error:
        raise _during_save(caller, path, before, error) from error.__cause__
    return _Plan(named, targets, saved, casts, held, before, views)


def _check_read_casts(
    named: dict[str, tuple[int, KeyPath, Any]],
    casts: list[np.dtype | None],
    caller: str,
) -> None:
    """Refuses casts that orbax's read cannot be trusted with: `_losses` finds
    what a cast lost by the values that became inf or nan, which misses a type
    that saturates (float4_e2m1fn) or holds no 0 or negatives (tensorstore
    turned 1.0 into 5e-20 as float8_e8m0fnu), and tensorstore converts to its
    own types only."""
    bad = [
        (path, cast)
        for i, path, _ in named.values()
        if (cast := casts[i]) is not None
        and (
            saturates(cast)
            or not signed_with_zero(cast)
            or not tensorstore_has(cast.name)
        )
    ]
    if bad:
        raise ValueError(
            f"eqshard.{caller}: `dtype=` casts the arrays at "
            f"{paths_text([path for path, _ in bad])} to {bad[0][1]}, which the "
            "read cannot cast to and check: it has no inf (values past its range "
            "would become its largest), holds no 0 or negative values, or "
            "tensorstore lacks it. Restore them uncast (`None` at their paths in "
            "`dtype`), then cast with `eqshard.shard(tree, dtype=...)`, which "
            "checks every value."
        )


def _lost_error(caller: str, plan: _Plan, lost: dict[str, Lost]) -> ValueError:
    return loss_error(
        caller,
        [
            (
                plan.named[name][1],
                plan.saved[name].dtype,
                lost[name].dtype,
                lost_text(lost[name]),
                plan.casts[plan.named[name][0]] is not None,
            )
            for name in plan.targets
            if name in lost
        ],
    )


@typecheck
def restore(
    directory: str | os.PathLike,
    like: PyTree,
    specs: PyTree = None,
    mesh: Mesh | AbstractMesh | None = None,
    *,
    dtype: Any = None,
    timeout: float | int = 300.0,
    on_invalid: OnInvalid = "warn",
) -> PyTree:
    """Restores an [`eqshard.save`][] checkpoint onto any mesh.

    Each device's shard is read from the files straight onto that device, on the
    saved mesh or any other: no device and no host holds a whole array. Everything
    that is not an array comes from `like`. The checkpoint's names, shapes and
    dtypes are compared with `like`'s before any data is read, every difference
    reported at once. Checkpoints orbax wrote itself, and stacked layers saved in
    another view of their layer order ([`eqshard.stage_view`][]), restore too.
    Values are never changed silently (see
    [the how-to](../how-to/checkpoints.md#orbax-save-and-restore-onto-another-mesh));
    several processes: see [there](../how-to/checkpoints.md#several-processes).

    **Arguments:**

    - `directory`: a checkpoint written by [`eqshard.save`][] (or by orbax).
    - `like`: a tree of the saved tree's structure, concrete or abstract, or a
      function of no arguments making it (`partial(make, key)`), called abstractly.
    - `specs`: a spec tree for `like` (or a prefix), partition rules, or a
      function of the abstract tree; `None` (also at a leaf) keeps `like`'s own.
    - `mesh`: the (concrete) mesh for `PartitionSpec`s; defaults to `jax.set_mesh`'s.
    - `on_invalid`: a spec that cannot apply on `mesh` is corrected as
      [`eqshard.restrict_specs`][] does: `"warn"`, `"ignore"` (silently) or `"raise"`.
    - `dtype`: floating arrays cast as they are read, as for [`eqshard.shard`][].
    - `timeout`: in a multi-process run, seconds each process waits for the others.

    **Returns:**

    A tree of the structure of `like`, with the saved arrays on their shardings.

    **Raises:**

    `ValueError` naming every array missing, extra, or of another shape or dtype,
    the arrays with no sharding or whose values could be lost; if the checkpoint
    is missing or damaged, a save to `directory` finished meanwhile (restore
    again), `specs` does not fit (as [`eqshard.shard`][]), with
    `on_invalid="raise"` every spec that would change, or another process fails or
    is late; `TypeError` naming the arrays that would go on an `AbstractMesh`;
    `ImportError` if orbax-checkpoint is not installed.

    !!! Example

        ```python
        like = eqx.filter_eval_shape(Model, key=jax.random.key(0))
        model = eqshard.restore("/tmp/ckpt/step_100", like, specs, mesh)
        ```
    """
    caller = "restore"
    check_timeout(caller, timeout)
    check_choice(on_invalid, ON_INVALID, caller=caller, name="on_invalid")
    fix = _like_fix(like)
    like, specs = like_and_specs(
        like, specs, mesh, on_invalid=on_invalid, caller=caller
    )
    ocp = import_optional("orbax.checkpoint", "orbax", caller)
    path = os.path.abspath(os.fspath(directory))
    meeting = _Meeting(caller, timeout, f"the checkpoint at {path!r} is not read")
    leaves, treedef = jtu.tree_flatten(like)
    plan = _Plan({}, {}, {}, [], NOTHING_HELD, generation(path))
    failure: Exception | None = None
    try:
        plan = _compared(ocp, path, like, specs, mesh, dtype, plan.before, fix)
    except Exception as error:  # raised on every process, by `fail_together`
        failure = error
    rows = [(n, t.shape, t.dtype) for n, t in plan.targets.items()]
    meeting.fail_together(failure, rows=rows)
    restored: dict[str, jax.Array] = {}
    checks: dict[str, jax.Array] = {}
    try:
        restored, checks = _read(ocp, path, plan.held, plan.saved, plan.targets, caller)
        if generation(path) != plan.before:
            raise _finished_during(caller, path)
    except Exception as error:  # orbax wraps a failed read in a bare `Exception`
        failure = _during_save(
            caller,
            path,
            plan.before,
            unreadable_error(caller, path, error, list(plan.targets))
            if is_read_error(error)
            else error,
        )
    meeting.fail_together(failure)
    lost = _losses(ocp, path, plan.held, plan.saved, restored, checks, meeting.status)
    if lost:
        raise _lost_error(caller, plan, lost)
    restored = into_views(restored, plan.views)
    out = list(leaves)
    for name, (i, _, _) in plan.named.items():
        out[i] = restored[name]
    return jtu.tree_unflatten(treedef, out)
