"""What `restore` reads into: `like` made abstractly when it is a function of no
arguments, and the specs for it adapted to the mesh (`like_and_specs`).
"""

import inspect
from typing import Any

import equinox as eqx
import jax.tree_util as jtu
from jax.sharding import AbstractMesh, Mesh, PartitionSpec
from jaxtyping import PyTree

from .._mesh._current import find_mesh
from .._mesh._targets import require_runnable
from .._spectree._check_spec import leaf_specs
from .._spectree._derive import restricted
from .._spectree._memory import Host, memory_of
from .._spectree._resolve import resolve_specs
from .._tree import is_array


def _binds_without_arguments(fn: Any) -> bool:
    try:
        inspect.signature(fn).bind()
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): called to find out
        return True
    return True


def _callable_leaf(like: Any) -> bool:
    """A callable that is a pytree leaf (a class, a function, a
    `functools.partial`); a model (an Equinox module, even with `__call__`) is a
    node."""
    return (
        callable(like)
        and not isinstance(like, eqx.Module)
        and jtu.treedef_is_leaf(jtu.tree_structure(like))
    )


def needs_arguments(like: Any) -> bool:
    """Whether `restore`'s `like` is a function that takes arguments: it is then
    the tree itself (one non-array leaf), and most likely a constructor given
    without its arguments."""
    return _callable_leaf(like) and not _binds_without_arguments(like)


def like_and_specs(
    like: Any,
    specs: Any,
    mesh: Mesh | AbstractMesh | None,
    *,
    on_invalid: str,
    caller: str,
) -> tuple[PyTree, PyTree]:
    """What [`eqshard.restore`][] reads into: `like` (the tree made abstractly, if
    `like` is a function of no arguments making it), and the spec tree that
    `specs` (a spec tree, rules, or a function of the abstract tree) gives for
    it, adapted to `mesh` as [`eqshard.restrict_specs`][] adapts specs, the
    changes reported as `on_invalid` says. Only what the mesh decides is
    adapted (a layout in host memory stays there): a `NamedSharding` says where
    it goes itself, and a spec longer than
    its array's rank, or with `P.UNCONSTRAINED`, is left for the caller to
    refuse, as `shard` does."""
    if _callable_leaf(like) and _binds_without_arguments(like):
        like = eqx.filter_eval_shape(like)
    if specs is None:
        return like, None
    specs = resolve_specs(specs, like, caller=caller, mesh=mesh)
    mesh = find_mesh(mesh)
    require_runnable(caller, mesh)
    if mesh is None:
        return like, specs
    pairs = leaf_specs(specs, like, caller=caller)
    treedef = jtu.tree_structure(like)
    layouts = [
        memory_of(spec)[0] if isinstance(spec, Host) else spec for _, spec in pairs
    ]
    kept = [
        not isinstance(spec, PartitionSpec)
        or not is_array(leaf)
        or len(spec) > len(leaf.shape)
        or PartitionSpec.UNCONSTRAINED in tuple(spec)
        for spec, leaf in zip(layouts, jtu.tree_leaves(like), strict=True)
    ]
    adapted = restricted(
        jtu.tree_unflatten(
            treedef,
            [None if keep else spec for keep, (_, spec) in zip(kept, pairs)],
        ),
        mesh,
        rename=None,
        like=like,
        on_invalid=on_invalid,
        caller=caller,
        fix='Pass `on_invalid="ignore"` if these changes are intended, or '
        '`on_invalid="raise"` to refuse them.',
    )
    out = [
        spec if keep else new
        for keep, (_, spec), new in zip(
            kept, pairs, treedef.flatten_up_to(adapted), strict=True
        )
    ]
    return like, jtu.tree_unflatten(treedef, out)
