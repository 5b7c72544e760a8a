"""The step as [`eqshard.search_layout`][] compiles it, once per layout of its
parameters (`_search.py` makes the layouts and ranks them).

1. **Arguments.** `fn(*args)`, as the user calls it; `params=` selects the
   parameters among them (`_spectree/_select.py`). Every other array *follows*
   the parameters when it follows one as [`eqshard.derive_specs`][] reads it
   (an optimizer state, inside the same state tuple or not: it then takes each
   layout's specs); else it *keeps* its layout: the one `fn`'s own `jit` gives
   it (an [`eqshard.filter_jit`][]'s `in_specs`), else the one it is placed
   with, else replicated.
2. **One trace** of the step over its arrays (`jax.make_jaxpr`, nothing
   compiled), the parameters first, gives how each parameter is used
   (`_uses.py`), the output's structure and, where `fn` is one `jit` call (a
   `filter_jit` object), that call's shardings and donations (its boundary).
3. **Data axes**: the mesh axes that split the leading dimension of the kept
   arrays; all axes if none does. Axis names are never read.
4. **A program per layout**: one `jax.jit` of the traced program (of the body
   of `fn`'s own `jit`, on a mesh of Auto axes, where the trace does not depend
   on the arguments' shardings; else `fn`, unwrapped, traced again). Outputs
   with the structure, shapes and dtypes of an argument holding parameters (or
   arrays that follow them) get that argument's shardings; the other outputs
   those `fn`'s own `jit` gives them, if any. The donations are `fn`'s own
   `jit`'s; a step without them donates what it returns that way, as a
   training step does. So a layout compiles as the step with those rules
   compiles when the user calls it. A step that returns no state (an
   evaluation or serving forward pass, `loss = step(params, x)`) compiles so
   too: its inputs take the layout, its outputs are laid out as its own `jit`
   says (else as XLA chooses), and nothing is donated unless its `jit` says.
   It is compiled for abstract arguments as [`eqshard.analyze_step`][]
   compiles, with `fn`'s signature, so that the report names the leaves as
   `analyze_step` does, but at XLA's backend
   optimisation level 0: the machine code is not optimised, which changes
   neither the program's text nor its memory analysis (all a report reads),
   and halves the compile.
"""

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import ml_dtypes
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, Sharding
from jaxtyping import PyTree

from .._internals import jaxpr as jaxprs
from .._internals.routes import Unrecognised
from .._mesh._current import same_mesh
from .._spectree._check_spec import entry_axes
from .._spectree._derive import abstract_tree
from .._spectree._follow import followed, without_dim
from .._spectree._select import Selection
from .._step._report import StepReport
from .._step._step import analysis_report
from .._transforms._jit_checks import mark_traced
from .._tree import is_array, path_name
from .._typing import KeyPath
from ._flow import Use
from ._uses import parameter_uses


CALLER = "search_layout"
# XLA's options for the layouts' compiles. The report reads the program's text
# and memory analysis, which LLVM's optimisation of the machine code does not
# change: without it, a compile takes about half as long
# (tests/test_search.py checks that the reports are the same).
_OPTIONS: dict[str, Any] | None = {"xla_backend_optimization_level": 0}


def search_error(message: str) -> ValueError:
    """An error of `search_layout`."""
    return ValueError(f"eqshard.{CALLER}: {message}")


def _other_mesh_error(path: str, have: Any, mesh: Mesh) -> ValueError:
    return search_error(
        f"the argument at '{path}' is laid out on the mesh {dict(have.shape)}, "
        f"but the search is on the mesh {dict(mesh.shape)}. Lay the batch out on "
        "the search's mesh (`eqshard.shard(batch, P('dp'), mesh)` or "
        "`eqshard.abstract(batch, P('dp'), mesh)`), or pass that mesh as `mesh=`."
    )


def _signature(tree: Any) -> list[tuple[tuple[int, ...], str]]:
    """The shape and dtype of each array of `tree`."""
    return [(tuple(x.shape), str(x.dtype)) for x in jtu.tree_leaves(tree)]


def _struct(leaf: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
    dtype = jax.dtypes.canonicalize_dtype(leaf.dtype, allow_extended_dtype=True)
    weak = bool(getattr(leaf, "weak_type", False))
    return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding, weak_type=weak)


def function_name(fn: Any) -> str:
    return str(getattr(fn, "__name__", type(fn).__name__))


def _argument_names(fn: Callable[..., Any], count: int) -> list[str]:
    """The names of `fn`'s first `count` positional parameters, else positions."""
    names = [str(i) for i in range(count)]
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return names
    for i, parameter in enumerate(parameters[:count]):
        if parameter.kind not in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            break
        names[i] = parameter.name
    return names


def _own_sharding(leaf: Any) -> NamedSharding | None:
    """The `NamedSharding` an argument is placed with (not an uncommitted array's)."""
    if isinstance(leaf, jax.Array) and not leaf.committed:
        return None
    sharding = getattr(leaf, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else None


def _on(sharding: Sharding | None, mesh: Mesh, path: str) -> NamedSharding | None:
    """`sharding` on the search's `mesh` (a mesh of the same shape and axes)."""
    if not isinstance(sharding, NamedSharding):
        return None
    if not same_mesh(sharding.mesh, mesh):
        raise _other_mesh_error(path, sharding.mesh, mesh)
    return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def _boundary(closed: Any, n_in: int, n_out: int) -> jaxprs.Boundary | None:
    """The shardings and donations of `fn`'s own `jit`, if it is one `jit` call
    that has some."""
    try:
        found = jaxprs.boundary_of(closed, n_in, n_out)
    except Unrecognised:
        return None
    if found is None or not (
        any(found.in_shardings) or any(found.out_shardings) or any(found.donated)
    ):
        return None
    return found


class _Target:
    """A node of the arguments whose arrays the step may return: its structure,
    the shapes and dtypes of its arrays, and their positions."""

    def __init__(self, node: Any, positions: list[int]):
        filtered = jtu.tree_map(lambda x: x if is_array(x) else None, node)
        self.structure = jtu.tree_structure(filtered)
        self.signature = _signature(filtered)
        self.positions = positions

    def matches(self, node: Any) -> bool:
        return (
            node is not None
            and jtu.tree_structure(node) == self.structure
            and _signature(node) == self.signature
        )


class Step:
    """The step over its array leaves: which are the parameters, which follow
    them and which keep their layout, what one trace of it tells, and its step
    report for a layout of the parameters."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        selection: Selection,
        mesh: Mesh,
    ):
        self.fn, self.mesh, self.params = fn, mesh, selection.tree
        self.leaves, self.treedef = jtu.tree_flatten(args)
        self.array_index = [i for i, x in enumerate(self.leaves) if is_array(x)]
        position = {leaf: k for k, leaf in enumerate(self.array_index)}
        paths = [path for path, _ in jtu.tree_flatten_with_path(args)[0]]
        self.paths = [paths[i] for i in self.array_index]
        # Array positions: the parameters' (in the order of `params`' leaves).
        self.param_positions = [position[i] for i in selection.leaves if i in position]
        self.follows = self._followers()
        chosen = set(self.param_positions) | set(self.follows)
        rest = [k for k in range(len(self.array_index)) if k not in chosen]
        self.order = self.param_positions + list(self.follows) + rest
        structs = [_struct(self._leaf(k)) for k in self.order]
        with jax.set_mesh(mesh):
            closed, self.out = jax.make_jaxpr(self.call, return_shape=True)(*structs)
        self.uses: list[Use] = parameter_uses(closed, len(self.param_positions))
        self.out_tree = jtu.tree_structure(self.out)
        n_out = self.out_tree.num_leaves
        found = _boundary(closed, len(structs), n_out)
        self.own_in: list[Sharding | None] = [None] * len(self.array_index)
        self.own_donated: list[bool] | None = None
        self.own_out: list[Sharding | None] = [None] * n_out
        if found is not None:
            for j, k in enumerate(self.order):
                self.own_in[k] = found.in_shardings[j]
            self.own_donated = [False] * len(self.array_index)
            for j, k in enumerate(self.order):
                self.own_donated[k] = found.donated[j]
            self.own_out = list(found.out_shardings)
        self.kept = {k: self._kept(k) for k in rest}
        split: set[str] = set()
        for k, sharding in self.kept.items():
            if self._leaf(k).shape and len(sharding.spec):
                split |= {str(a) for a in entry_axes(sharding.spec[0])}
        axes = tuple(str(a) for a in mesh.axis_names)
        self.data_axes = tuple(a for a in axes if a in split) or axes
        # On Auto axes, the trace does not depend on the arguments' shardings:
        # each layout compiles this program (without `fn`'s own `jit` call)
        # rather than tracing `fn` again.
        auto = set(mesh.axis_types) == {AxisType.Auto}
        body: Callable[..., Any] | None = None
        if auto and found is None:
            body = jaxprs.as_function(closed)
        elif auto:
            try:
                body = jaxprs.without_boundary(closed)
            except Unrecognised:
                body = None
        self.body = body
        self.unwrapped = getattr(fn, "__wrapped__", fn) if found else fn
        self.sources = self._sources(args, selection)

    def _leaf(self, k: int) -> Any:
        return self.leaves[self.array_index[k]]

    def _followers(self) -> dict[int, tuple[int, int | None]]:
        """The arrays outside the parameters that follow one: by position, the
        index of the parameter among `param_positions` and the dimension reduced
        away (`None`: the same shape)."""
        mine = set(self.param_positions)
        shapes: dict[KeyPath, tuple[tuple[int, ...], int]] = {}
        params = [
            (path, leaf)
            for path, leaf in jtu.tree_flatten_with_path(self.params)[0]
            if is_array(leaf)
        ]
        for j, (path, leaf) in enumerate(params):
            shapes[tuple(path)] = (tuple(int(n) for n in leaf.shape), j)

        def shape_of(path: KeyPath) -> tuple[int, ...] | None:
            entry = shapes.get(tuple(path))
            return None if entry is None else entry[0]

        found: dict[int, tuple[int, int | None]] = {}
        for k, path in enumerate(self.paths):
            leaf = self._leaf(k)
            if k in mine or not leaf.shape:
                continue
            follow = followed(path, tuple(int(n) for n in leaf.shape), shape_of)
            if follow is not None and follow.fits:
                found[k] = (shapes[tuple(follow.path)][1], follow.dim)
        return found

    def _kept(self, k: int) -> NamedSharding:
        """The layout an array that is no parameter and follows none keeps."""
        path = self.paths[k]
        names = _argument_names(self.fn, path[0].idx + 1)
        where = "/".join(filter(None, (names[-1], path_name(path[1:], "/"))))
        for sharding in (self.own_in[k], _own_sharding(self._leaf(k))):
            on = _on(sharding, self.mesh, where)
            if on is not None:
                return on
        return NamedSharding(self.mesh, PartitionSpec())

    def _sources(self, args: tuple[Any, ...], selection: Selection) -> list[int | None]:
        """For each output array, the argument array whose layout it takes (an
        output with the structure, shapes and dtypes of an argument that holds
        parameters or arrays following them, or of the parameters), else `None`."""
        chosen = set(self.param_positions) | set(self.follows)
        nodes: list[tuple[KeyPath, Any]] = []
        for i, arg in enumerate(args):
            nodes.append(((jtu.SequenceKey(i),), arg))
        if selection.path is not None:
            for n in range(2, len(selection.path) + 1):
                node: Any = args
                for key in selection.path[:n]:
                    node = _child(node, key)
                nodes.append((selection.path[:n], node))
        targets = []
        for path, node in nodes:
            positions = [
                k for k, p in enumerate(self.paths) if tuple(p[: len(path)]) == path
            ]
            if chosen & set(positions):
                targets.append(_Target(node, positions))

        def target(node: Any) -> _Target | None:
            return next((t for t in targets if t.matches(node)), None)

        sources: list[int | None] = []
        for node in jtu.tree_leaves(self.out, is_leaf=lambda x: target(x) is not None):
            found = target(node)
            if found is None:
                sources.append(None)
            else:
                sources += found.positions
        return sources

    def call(self, *arrays: Any) -> Any:
        """`fn` on the arguments with these arrays (in `order`); its output's
        arrays (other leaves `None`)."""
        return self._call(self.fn, arrays)

    def _call(self, fn: Callable[..., Any], arrays: Sequence[Any]) -> Any:
        full = list(self.leaves)
        for k, array in zip(self.order, arrays, strict=True):
            full[self.array_index[k]] = array
        try:
            out = fn(*jtu.tree_unflatten(self.treedef, full))
        except Exception as error:  # the step's own, whatever its text
            mark_traced(error)
            raise
        return jtu.tree_map(lambda x: x if isinstance(x, jax.Array) else None, out)

    def shardings(self, specs: PyTree) -> list[NamedSharding]:
        """The sharding of each argument array for the layout `specs` of the
        parameters."""
        placed = abstract_tree(self.params, specs, self.mesh, caller=CALLER)
        own = [x.sharding for x in jtu.tree_leaves(placed) if is_array(x)]
        out: list[Any] = [None] * len(self.array_index)
        for k, sharding in zip(self.param_positions, own, strict=True):
            out[k] = sharding
        for k, (j, dim) in self.follows.items():
            out[k] = without_dim(own[j], dim)
        for k, sharding in self.kept.items():
            out[k] = sharding
        return out

    def argument_floor(self, specs: PyTree) -> int:
        """A floor of the bytes each device holds of the arguments with the
        layout `specs` (whole elements of the smallest shard; sub-byte and key
        dtypes count nothing): the compiled peak is never below it."""
        total = 0
        for k, sharding in enumerate(self.shardings(specs)):
            leaf = self._leaf(k)
            if _extended(leaf.dtype):
                continue
            dtype = np.dtype(leaf.dtype)
            if dtype.itemsize * 8 != _bits(dtype):
                continue
            sizes = [int(n) for n in leaf.shape]
            spec = list(sharding.spec) + [None] * (len(sizes) - len(sharding.spec))
            for d, entry in enumerate(spec[: len(sizes)]):
                ways = math.prod(self.mesh.shape[a] for a in entry_axes(entry))
                sizes[d] //= ways
            total += math.prod(sizes) * dtype.itemsize
        return total

    def _program(self, out_shardings: Any, donate: Sequence[int]) -> Any:
        """The step as `analyze_step` reads it: `fn`'s signature, one `jax.jit`
        with these output shardings and donations inside."""
        order = self.order
        body = self.body
        unwrapped = self.unwrapped

        def inner(*arrays: Any) -> Any:
            ordered = [arrays[k] for k in order]
            if body is not None:
                return tuple(body(*ordered))
            return tuple(jtu.tree_leaves(self._call(unwrapped, ordered)))

        # XLA's op names then read `jit(step)/jit(train_step)/...`.
        inner.__name__ = inner.__qualname__ = function_name(self.fn)
        jitted = jax.jit(
            inner, out_shardings=tuple(out_shardings), donate_argnums=tuple(donate)
        )
        out_tree = self.out_tree

        @functools.wraps(self.fn)
        def step(*arguments: Any) -> Any:
            arrays = [x for x in jtu.tree_leaves(arguments) if is_array(x)]
            return jtu.tree_unflatten(out_tree, jitted(*arrays))

        return step

    def report(self, specs: PyTree) -> StepReport:
        """The step report of the layout `specs` of the parameters."""
        shardings = self.shardings(specs)
        full = list(self.leaves)
        for k, sharding in enumerate(shardings):
            full[self.array_index[k]] = _struct(self._leaf(k), sharding)
        trees = jtu.tree_unflatten(self.treedef, full)
        out_shardings = [
            own if source is None else shardings[source]
            for source, own in zip(self.sources, self.own_out, strict=True)
        ]
        if self.own_donated is not None:
            donate = [k for k, d in enumerate(self.own_donated) if d]
        else:
            donate = sorted({k for k in self.sources if k is not None})
        program = self._program(out_shardings, donate)
        with jax.set_mesh(self.mesh):
            return analysis_report(program, *trees, compiler_options=_OPTIONS)


def _extended(dtype: Any) -> bool:
    """Whether `dtype` is one of JAX's extended dtypes (typed PRNG keys)."""
    return bool(jnp.issubdtype(dtype, jax.dtypes.extended))


def _bits(dtype: np.dtype) -> int:
    """The bits of one element of `dtype` (4 for `int4`, whose itemsize is 1)."""
    try:
        return int(ml_dtypes.finfo(dtype).bits)
    except ValueError:
        pass
    try:
        return int(ml_dtypes.iinfo(dtype).bits)
    except ValueError:
        return dtype.itemsize * 8


def _child(node: Any, key: Any) -> Any:
    """The child of `node` at one key of a path."""
    children = jtu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
    for path, child in children:
        if path and path[0] == key:
            return child
    raise KeyError(key)
