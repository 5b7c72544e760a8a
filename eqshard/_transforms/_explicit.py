"""Explicit mesh axes: running code that does not name its shardings, and saying
where it fails.

On Explicit axes every array's sharding is part of its type, and JAX refuses an
operation whose result's sharding it cannot work out (an indexing gather with
sharded indices, a contraction over a dimension both sides shard) until it is
named (`out_sharding=`). Equinox's layers name none, so:

1. **`auto_axes`** runs a function (a model's forward) with the mesh's Explicit
   axes made Auto: its array arguments are resharded onto the Auto axes (their
   layouts kept along the others), the function runs with XLA choosing the
   layouts in between, and its array outputs leave with the specs asked for, as
   `with_sharding_constraint` gives them. Non-array arguments and outputs pass
   through, as in `eqx.filter_jit`.
2. **`explained`** turns JAX's error for such an operation, raised while eqshard
   traces a user's function, into eqshard's: which Equinox layer failed (the
   innermost frame of a module's method), where it is among the variables of the
   user's frames (the outermost one holding its traced arrays, by identity), and
   the fix.
"""

import contextlib
import functools as ft
import os
from collections.abc import Callable, Iterator, Sequence
from types import FrameType, TracebackType
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.sharding import AbstractMesh, AxisType, Mesh, PartitionSpec
from jaxtyping import PyTree

from .._internals.closures import direct_reads
from .._internals.errors import is_mixed_meshes, is_sharding_type_error
from .._mesh._current import mesh_repr, require_mesh, same_mesh
from .._spectree._carried import explicit_axes, type_sharding
from .._spectree._check_spec import leaf_specs
from .._spectree._resolve import resolve_specs
from .._tree import path_str
from .._typing import KeyPath, typecheck
from ._constraint import with_sharding_constraint


_CALLER = "auto_axes"


# One builder per kind of message.


def _axes_error(unknown: list[str], mesh: Mesh | AbstractMesh) -> ValueError:
    return ValueError(
        f"eqshard.{_CALLER}: `axes` names {', '.join(map(repr, unknown))}, which "
        f"mesh {mesh_repr(mesh)} does not have; name some of its axes, or leave "
        "`axes` out for all its Explicit ones."
    )


def _context_error(mesh: Mesh | AbstractMesh, context: AbstractMesh) -> ValueError:
    return ValueError(
        f"eqshard.{_CALLER}: `mesh` is {mesh_repr(mesh)}, but the mesh set with "
        f"`jax.set_mesh` is {mesh_repr(context)}, and the arrays are typed on that "
        "one. Leave `mesh=` out, or set the mesh you pass."
    )


def _no_out_spec_error(paths: list[KeyPath]) -> ValueError:
    shown = ", ".join(f"'{path_str(p)}'" for p in paths[:10])
    return ValueError(
        f"eqshard.{_CALLER}: `out_sharding` has `None` at {shown}, where the function "
        "returns arrays; an array leaving Auto axes needs its layout on the "
        "Explicit ones. Give each a spec (`P()` for a replicated one)."
    )


def _closed_over_error(
    fn: Any, auto: frozenset[str], mesh: Mesh | AbstractMesh, error: Exception
) -> ValueError:
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    found = []
    for var, value in direct_reads(fn):
        try:
            leaves = jtu.tree_leaves_with_path(value)
        except (ValueError, TypeError):
            continue  # keys JAX cannot sort (a dict's, a defaultdict's): not data
        paths = [
            path_str(path)
            for path, leaf in leaves
            if eqx.is_array(leaf) and _typed_on(leaf, auto)
        ]
        if paths == [""]:  # an array itself
            found.append(f"`{var}`")
        elif paths:
            shown = ", ".join(f"'{p}'" for p in paths[:5])
            more = f" and {len(paths) - 5} more" if len(paths) > 5 else ""
            found.append(f"`{var}` (its arrays at {shown}{more})")
    what = (
        f"`{name}` reads arrays typed on them, not as arguments: {'; '.join(found)}"
        if found
        else f"`{name}` reads an array typed on them that it does not take as an "
        "argument (a variable it closes over, or a global)"
    )
    return ValueError(
        f"eqshard.{_CALLER}: inside `fn` the Explicit axes "
        f"{tuple(sorted(auto))} of mesh {mesh_repr(mesh)} are Auto, and only the "
        f"arrays passed as arguments are moved onto them; {what}, which JAX "
        "cannot mix with them. Pass those arrays as arguments, e.g. "
        "`eqshard.auto_axes(lambda model, x: model(x), out_sharding=...)(model, x)`, "
        "or pass the model itself as `fn` (`eqshard.auto_axes(model, "
        f"out_sharding=...)(x)`), whose arrays are moved too. JAX says: {error}"
    )


def _typed_on(x: Any, auto: frozenset[str]) -> bool:
    """Whether `x`'s type places it on a mesh with Explicit axes among `auto`."""
    sharding = type_sharding(x)
    return sharding is not None and bool(explicit_axes(sharding.mesh) & auto)


def _typed_spec(x: Any, auto: frozenset[str]) -> PartitionSpec:
    """The spec in `x`'s type without the axes in `auto` (which become Auto, where
    a type names no axis)."""
    entries = []
    sharding = type_sharding(x)
    for entry in () if sharding is None else sharding.spec:
        axes = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(a for a in axes if a is not None and a not in auto)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


def _lay_out(out: Any, out_sharding: PyTree, on: Mesh | AbstractMesh) -> Any:
    """`out` constrained as `out_sharding` says, every array output given a spec."""
    specs = resolve_specs(
        out_sharding, out, caller=_CALLER, argname="out_sharding", mesh=on
    )
    pairs = leaf_specs(specs, out, caller=_CALLER, logical=True, argname="out_sharding")
    missing = [
        path
        for (path, spec), leaf in zip(pairs, jtu.tree_leaves(out), strict=True)
        if spec is None and eqx.is_array(leaf)
    ]
    if missing:
        raise _no_out_spec_error(missing)
    return with_sharding_constraint(out, specs, mesh=on, on_invalid="raise")


@typecheck
def auto_axes(
    fn: Callable[..., Any],
    *,
    out_sharding: PyTree,
    axes: str | Sequence[str] | None = None,
    mesh: Mesh | AbstractMesh | None = None,
) -> Callable[..., Any]:
    """Runs `fn` with the mesh's Explicit axes made Auto, and gives its outputs
    the layout `out_sharding` asks: the way to run a model whose layers do not name
    their results' shardings on an Explicit mesh, the model unchanged.

    Inside `fn` those axes are Auto, so XLA chooses the layouts in between (where
    JAX would refuse `eqx.nn.Embedding`'s lookup of sharded ids, say); the outputs
    are typed on the Explicit axes again by `out_sharding`. This is the filtered
    `jax.sharding.auto_axes`: non-arrays pass through. On a mesh with no Explicit
    axes it is `fn` followed by [`eqshard.with_sharding_constraint`][], so the same
    step runs on both kinds of mesh (see
    [the how-to](../how-to/explicit-axes.md#layers-jax-cannot-type-the-embedding-fix)).

    **Arguments:**

    - `fn`: the function, or a module (or a `functools.partial`), whose arrays
      are moved onto the Auto axes as the arguments' are. Arrays it closes over
      are not: pass them as arguments.
    - `out_sharding`: a spec tree for `fn`'s output or a prefix of one, partition
      rules, or a function of the abstract output, as for
      [`eqshard.with_sharding_constraint`][]; every array output needs a spec.
    - `axes`: the Explicit axes to make Auto (default all of them).
    - `mesh`: defaults to the mesh set with `jax.set_mesh`; given and none set, it
      is set (abstractly) for the call.

    **Returns:**

    A function of `fn`'s arguments, returning its outputs laid out by `out_sharding`.

    **Raises:**

    At the call: `ValueError` if there is no mesh, `axes` names an axis the mesh
    lacks, `mesh` is not the mesh set, an array output has no spec, `fn` reads
    arrays typed on the axes made Auto that it does not take as arguments (naming
    them), or specs cannot apply (naming each path).

    !!! Example

        ```python
        @jax.jit
        def forward(embed, tokens):  # jax.vmap(embed)(tokens) alone raises
            lookup = eqshard.auto_axes(lambda e, t: jax.vmap(e)(t),
                                       out_sharding=P("dp", "tp"), mesh=mesh)
            return lookup(embed, tokens)  # float32[8@dp,32@tp]
        ```
    """
    names = (axes,) if isinstance(axes, str) else None if axes is None else tuple(axes)

    @ft.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        on = require_mesh(mesh, caller=_CALLER)
        context = jax.sharding.get_abstract_mesh()
        if not context.empty and not same_mesh(context, on):
            raise _context_error(on, context)
        base = on.abstract_mesh if isinstance(on, Mesh) else on
        base = base if context.empty else context
        if names is not None:
            unknown = [a for a in names if a not in base.axis_names]
            if unknown:
                raise _axes_error(unknown, on)
        auto = frozenset(
            a
            for a, t in zip(base.axis_names, base.axis_types, strict=True)
            if t == AxisType.Explicit and (names is None or a in names)
        )
        if not auto:  # nothing to make Auto: the function and a constraint
            out = fn(*args, **kwargs)
            return with_sharding_constraint(
                out, out_sharding, mesh=on, on_invalid="raise"
            )
        with contextlib.ExitStack() as stack:
            if context.empty:  # JAX reshards over Explicit axes only under a mesh
                stack.enter_context(jax.sharding.use_abstract_mesh(base))
            inner = base.update_axis_types(dict.fromkeys(auto, AxisType.Auto))
            with jax.sharding.use_abstract_mesh(inner):
                # A module (or partial) given as `fn` holds arrays: moved too.
                call, args, kwargs = jtu.tree_map(
                    lambda x: (
                        jax.sharding.reshard(x, _typed_spec(x, auto))
                        if eqx.is_array(x)
                        else x
                    ),
                    (fn, args, kwargs),
                )
                try:
                    out = call(*args, **kwargs)
                except ValueError as error:
                    if not is_mixed_meshes(error):
                        raise
                    raise _closed_over_error(fn, auto, on, error) from error
            return _lay_out(out, out_sharding, on)

    return run


# Packages whose frames are not the user's: the function's variables are looked
# for in the others' frames.
_LIBRARIES = ("jax", "jaxlib", "equinox", "eqshard", "jaxtyping", "beartype")


def _frames(traceback: TracebackType | None) -> list[tuple[FrameType, int]]:
    """The frames of a traceback, outermost first, with their lines."""
    frames = []
    while traceback is not None:
        frames.append((traceback.tb_frame, traceback.tb_lineno))
        traceback = traceback.tb_next
    return frames


def _package(frame: FrameType) -> str:
    return frame.f_globals.get("__name__", "").split(".")[0]


def _source(frame: FrameType, line: int) -> str:
    """`file:line`, the file from its package on (or as given, for a script)."""
    file = frame.f_code.co_filename
    _, sep, inside = file.rpartition("site-packages" + os.sep)
    return f"{inside if sep else file}:{line}"


def _layer(frames: list[tuple[FrameType, int]]) -> tuple[eqx.Module, str] | None:
    """The innermost Equinox layer whose method failed, and where."""
    for frame, line in reversed(frames):
        layer = frame.f_locals.get("self")
        if isinstance(layer, eqx.Module) and not type(layer).__module__.startswith(
            ("equinox._", "eqshard")
        ):
            return layer, _source(frame, line)
    return None


def _where(
    layer: eqx.Module, frames: list[tuple[FrameType, int]]
) -> tuple[str, KeyPath, list[tuple[KeyPath, Any]]] | None:
    """The outermost variable of a user's frame holding `layer`'s arrays (by
    identity), as (`name` in `function`, the layer's path in it, its arrays with
    their paths in it)."""
    own = [
        (path, leaf)
        for path, leaf in jtu.tree_flatten_with_path(layer)[0]
        if eqx.is_array(leaf)
    ]
    by_id = {id(leaf): path for path, leaf in own}
    for frame, _ in frames:
        if _package(frame) in _LIBRARIES:
            continue
        for name, value in frame.f_locals.items():
            try:
                path_leaves = jtu.tree_flatten_with_path(value)[0]
            except (TypeError, ValueError):  # JAX cannot flatten it (mixed keys)
                continue
            found = [(path, leaf) for path, leaf in path_leaves if id(leaf) in by_id]
            if found:
                path, leaf = found[0]
                inner = by_id[id(leaf)]
                prefix = path[: len(path) - len(inner)]
                return f"`{name}` in `{frame.f_code.co_name}`", prefix, found
    return None


def sharding_type_error(caller: str, error: Exception) -> TypeError:
    """eqshard's message for JAX's error on an operation whose result's sharding is
    ambiguous on Explicit axes, naming the Equinox layer and its arrays."""
    frames = _frames(error.__traceback__)
    found = _layer(frames)
    if found is None:
        user = [(f, n) for f, n in frames if _package(f) not in _LIBRARIES]
        at = f" at {_source(*user[-1])}" if user else ""
        what = f"an operation{at}"
    else:
        layer, at = found
        kind = type(layer)
        name = (
            f"eqx.nn.{kind.__name__}"
            if kind.__module__.startswith("equinox.nn")
            else kind.__qualname__
        )
        where = _where(layer, frames)
        if where is None:
            what = f"`{name}` (at {at})"
        else:
            holder, prefix, arrays = where
            listed = ", ".join(
                f"'{path_str(path)}' {jax.typeof(leaf).str_short()}"
                for path, leaf in arrays
            )
            what = (
                f"`{name}` at '{path_str(prefix)}' of {holder} (its arrays: "
                f"{listed}; at {at})"
            )
    return TypeError(
        f"eqshard.{caller}: on Explicit mesh axes JAX cannot work out the sharding "
        f"of a result in {what}, and Equinox's layers do not name it. JAX says: "
        f"{error} Run the model under `eqshard.auto_axes(fn, out_sharding=...)`, "
        "which makes the Explicit axes Auto inside `fn` (the model unchanged), or "
        "build the mesh with Auto axes (`eqshard.create_mesh`'s default). See the "
        'how-to "Explicit axes".'
    )


@contextlib.contextmanager
def explained(caller: str) -> Iterator[None]:
    """Re-raises JAX's error on an operation whose result's sharding is ambiguous on
    Explicit axes as eqshard's (`sharding_type_error`); other errors pass."""
    try:
        yield
    except Exception as error:
        if not is_sharding_type_error(error):
            raise
        raise sharding_type_error(caller, error) from error
