"""The one `jax.jit` wrapper of eqshard: `JitFunction`, under
[`eqshard.filter_jit`][] (`_filter_jit.py`) and [`eqshard.t5x.PartitionedFn`][].

How a call stays cheap, and keeps its layout:

- **Arrays only.** When every (non-static) argument is itself an array and the
  shardings are known up front (a partitioner's), the call goes straight to one
  `jax.jit` made at construction: no tree work in Python.
- **Modules and other pytrees.** The arguments are flattened once; the tree
  structure and the leaf types pick a cached *layout* (which leaves are arrays,
  which are donated, and the shardings of the arguments and the output). Where
  the shardings are resolved from specs (`filter_jit`), the key also holds all
  that the resolution reads: each array's shape, dtype and placement, and the
  mesh set, devices included. The non-array
  leaves pick a cached `jax.jit` made for that layout, whose arguments are the
  flat tuples of array leaves. This is `eqx.filter_jit`'s filtering with less
  per-call work: no signature binding, no rebuilding of filtered trees, no
  hashing of every leaf.
- **The output's own structure.** The output's arrays leave the program under the
  structure of its spec tree, and are put back into the output's own structure
  afterwards: a spec tree made from another build of a model (whose
  `eqx.nn.StateIndex` markers differ) fits, where `jax.jit`'s `out_shardings`
  would refuse it for its "different pytree metadata".
- **Contexts at trace time.** The mesh (as the abstract mesh) and the logical
  rules are set while `fn` is traced, which is the only time `fn`'s Python runs,
  so calls do not pay for entering them.
"""

import dataclasses
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jaxtyping import PyTree

from .._mesh import mesh_repr
from .._move._host import host_private
from .._spectree._logical import LogicalRules, RulesContext
from .._spectree._specs import (
    check_leaves,
    is_spec_leaf,
    spec_error_message,
)
from .._tree import (
    broadcast_prefix,
    deleted_error,
    flatten_up_to,
    is_array,
    is_deleted,
    path_str,
    paths_text,
    repeated_arrays,
)
from .._typing import KeyPath, PyTreeDef
from ._explicit import explained


def _check_shapes(
    paths: Sequence[KeyPath],
    leaves: Sequence[Any],
    shardings: Sequence[NamedSharding | None],
    caller: str,
) -> None:
    """Raises the eqshard message for every array whose sharding cannot apply."""
    problems = check_leaves(list(zip(paths, shardings, strict=True)), leaves, None)
    if problems:
        raise ValueError(spec_error_message(caller, problems))


# Types whose instances go straight to `jax.jit` as arguments: filled in as they
# are first seen (so importing eqshard never touches the JAX backend).
_DIRECT_TYPES: set[type] = set()


def _is_direct(x: Any) -> bool:
    """Whether `jax.jit` takes `x` as one array argument (abstract ones included,
    for `lower`)."""
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


def _getter(indices: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """A fast function from a sequence to the tuple of its items at `indices`."""
    if not indices:
        return lambda seq: ()
    if len(indices) == 1:
        (i,) = indices
        return lambda seq: (seq[i],)
    return operator.itemgetter(*indices)


def _typed(value: Any) -> Any:
    """A cache key for a static value that also tells apart values that compare
    equal but differ in type (`True`, `1`, `1.0`), also inside tuples: the traced
    program can depend on the type."""
    if isinstance(value, tuple):
        return (type(value), tuple(map(_typed, value)))
    return (type(value), value)


# Types of placed JAX arrays (not tracers), and of leaves that are no arrays of
# any kind: filled in as they are first seen.
_PLACED_TYPES: set[type] = set()
_OTHER_TYPES: set[type] = set()


def _leaf_signature(leaf: Any, statics: bool, placements: bool) -> Any:
    """What resolving specs may read of one argument leaf: an array's shape,
    dtype, weak type, and placement where `placements`; a non-array leaf's type,
    and its value where `statics` (the specs are functions of the tree, or the
    output's)."""
    kind = type(leaf)
    if isinstance(leaf, Tracer):
        return (kind, leaf.aval)
    if isinstance(leaf, jax.Array):
        _PLACED_TYPES.add(kind)
        return (leaf.aval, leaf.sharding, leaf.committed) if placements else leaf.aval
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return (kind, leaf.shape, leaf.dtype, leaf.weak_type, leaf.sharding)
    if isinstance(leaf, np.ndarray | np.generic):
        return (kind, leaf.shape, leaf.dtype)
    _OTHER_TYPES.add(kind)
    return (kind, _typed(leaf)) if statics else kind


def _mesh_key() -> Any:
    """The mesh set by `jax.set_mesh`, with its devices where known (outside
    `jit`): meshes of the same axes over other devices, or in another order,
    resolve specs apart."""
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty:
        return None
    try:
        return (abstract, jax.sharding.get_mesh())
    except ValueError:  # inside `jit`, where only the abstract mesh is known
        return abstract


def _first_buffer(leaf: jax.Array) -> int | None:
    """Where the first addressable shard of a placed array lies in memory (two
    arrays over the same buffers share it); `None` if there is none here."""
    try:
        return leaf.addressable_data(0).unsafe_buffer_pointer()
    except (IndexError, RuntimeError):
        return None


class _Static:
    """A static argument as given to `jax.jit`: hashed and compared by
    [`_typed`][], so that `f(x, (True,))` does not reuse the program of
    `f(x, (1,))`."""

    __slots__ = ("value", "key", "hash")

    def __init__(self, value: Any):
        self.value = value
        self.key = _typed(value)
        self.hash = hash(self.key)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self.key == other.key


def _unwrap(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(x.value if isinstance(x, _Static) else x for x in args)


class _OutStatics:
    """What puts a traced output back together: its structure and non-array
    leaves, returned next to its arrays.

    Registered as a static pytree node: `jax.jit` keeps it in the output structure
    of the trace that made it, so each compiled function gives back its own."""

    __slots__ = ("treedef", "template", "array_index")

    def __init__(self, treedef: PyTreeDef, template: list[Any], array_index: list[int]):
        self.treedef = treedef
        self.template = template
        self.array_index = array_index

    def rebuild(self, dynamic: PyTree) -> PyTree:
        leaves = list(self.template)
        for i, array in zip(self.array_index, jtu.tree_leaves(dynamic), strict=True):
            leaves[i] = array
        return self.treedef.unflatten(leaves)


jtu.register_static(_OutStatics)


class _Layout:
    """The structure of a call's (non-static) arguments: which flat leaves are
    arrays, which of those are donated, the shardings of the arguments and the
    output (and the mesh they are on), and one `jax.jit` per set of values of the
    non-array leaves."""

    __slots__ = (
        "treedef",
        "paths",
        "array_index",
        "static_index",
        "donated_index",
        "kept_index",
        "get_static",
        "get_donated",
        "get_kept",
        "signature",
        "jitted",
        "in_shardings",
        "out_shardings",
        "mesh",
        "abstract_paths",
    )

    def __init__(
        self,
        treedef: PyTreeDef,
        paths: list[KeyPath],
        leaves: list[Any],
        donated_args: Callable[[int], bool],
        shardings: tuple[PyTree, PyTree, Mesh | AbstractMesh | None],
    ):
        self.treedef = treedef
        self.paths = paths
        flags = [is_array(leaf) for leaf in leaves]
        self.array_index = [i for i, flag in enumerate(flags) if flag]
        self.static_index = [i for i, flag in enumerate(flags) if not flag]
        donated = [donated_args(paths[i][0].idx) for i in range(len(leaves))]
        self.donated_index = [i for i in self.array_index if donated[i]]
        self.kept_index = [i for i in self.array_index if not donated[i]]
        self.get_static = _getter(self.static_index)
        self.get_donated = _getter(self.donated_index)
        self.get_kept = _getter(self.kept_index)
        self.signature = (treedef, tuple(self.array_index))
        self.jitted: dict[tuple[Any, ...], Any] = {}
        self.in_shardings, self.out_shardings, self.mesh = shardings
        # Arguments without data, which only `lower` and `compile` take.
        self.abstract_paths = [
            path
            for path, leaf in zip(paths, leaves, strict=True)
            if isinstance(leaf, jax.ShapeDtypeStruct)
        ]


# What resolves a layout's shardings from the first arguments of its structure:
# `(in_shardings, out_shardings, mesh)`.
Resolver = Callable[
    [tuple[Any, ...]], tuple[PyTree, PyTree, Mesh | AbstractMesh | None]
]


class JitFunction:
    """A function compiled with `jax.jit`, its arguments filtered as
    `eqx.filter_jit` filters them and placed by spec trees; made by
    [`eqshard.filter_jit`][] (and, as [`eqshard.t5x.PartitionedFn`][], by
    [`eqshard.t5x.Partitioner.partition`][]).

    Calls take the function's own positional arguments. Array leaves are traced;
    every other leaf (Python scalars, callables, static configuration of Equinox
    modules) is held static, and a new value compiles again.

    **Methods:**

    - `__call__(*args)`: runs the function.
    - `lower(*args)`: the function lowered for arguments like these, with
      `as_text()`, `compiler_ir()`, `cost_analysis()` and `compile()`; its
      `lowered` attribute is JAX's `jax.stages.Lowered`.
    - `compile(*args)` (or `lower(*args).compile()`): a callable compiled ahead
      of time for arguments like these, taking the same arguments as the
      function and returning its outputs, with `as_text()`, `cost_analysis()`
      and `memory_analysis()`; its `compiled` attribute is JAX's
      `jax.stages.Compiled`. Called with arrays of other shapes or dtypes, or
      other non-array leaves, it raises naming the paths: compile again.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        caller: str,
        in_shardings: PyTree = None,
        out_shardings: PyTree = None,
        resolve: Resolver | None = None,
        static_argnums: tuple[int, ...] = (),
        donate_argnums: tuple[int, ...] = (),
        donate_from: int | None = None,
        donate_text: str = "",
        quiet_donation: bool = False,
        mesh: Mesh | AbstractMesh | None = None,
        rules: LogicalRules | None = None,
        place_hint: str = "`eqshard.shard`",
    ):
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self._fn = fn
        self._caller = caller
        self._in = f"{caller} (in_specs)"
        self._out = f"{caller} (out_specs)"
        self._resolve = resolve
        self._mesh = mesh
        self._rules = None if rules is None else RulesContext(rules)
        self._place_hint = place_hint
        self._static = static_argnums
        self._donate = frozenset(donate_argnums)
        self._donate_text = donate_text
        self._quiet = quiet_donation
        # The donated positions among the non-static arguments.
        self._donated = frozenset(
            i - sum(s < i for s in static_argnums) for i in donate_argnums
        )
        self._donate_from = donate_from
        self._layouts: dict[tuple[Any, ...], _Layout] = {}
        # Whether resolving the specs reads the values of non-array leaves.
        # What resolving them reads (everything, unless the resolver says).
        self._reads_shapes = bool(getattr(resolve, "reads_shapes", True))
        self._reads_statics = bool(getattr(resolve, "reads_statics", True))
        self._reads_placements = bool(getattr(resolve, "reads_placements", True))
        # Calls whose non-static arguments are all arrays skip the tree work: this
        # is possible when the shardings are known now and `in_specs` is one spec,
        # or one spec per argument.
        self._direct_count: int | None = None
        if resolve is None and donate_from is None:
            if is_spec_leaf(in_shardings):
                self._direct_count = -1
            elif isinstance(in_shardings, tuple) and all(
                map(is_spec_leaf, in_shardings)
            ):
                self._direct_count = len(in_shardings) + len(static_argnums)
        self._direct = None
        if self._direct_count is not None:
            self._direct = jax.jit(
                self._named(lambda *args: self._trace_direct(*args)),
                in_shardings=in_shardings,
                out_shardings=(out_shardings, None),
                static_argnums=static_argnums,
                donate_argnums=donate_argnums,
            )
        self._get_dynamic = None
        if static_argnums:
            last = max(static_argnums)
            self._get_dynamic = lambda args: tuple(
                x for i, x in enumerate(args) if i not in static_argnums
            )
            self._min_count = last + 1
        else:
            self._min_count = 0

    def __repr__(self) -> str:
        return f"{self._caller}({self.__name__})"

    def _is_donated(self, position: int) -> bool:
        """Whether the non-static argument at `position` is donated."""
        if self._donate_from is not None:
            return position >= self._donate_from
        return position in self._donated

    # -- tracing ------------------------------------------------------------------

    def _run(
        self,
        args: tuple[Any, ...],
        out_shardings: PyTree,
        mesh: Mesh | AbstractMesh | None,
    ) -> tuple[Any, _OutStatics | None]:
        """Calls the function under the mesh and the rules (at trace time) and
        splits its output into arrays, under the structure of `out_shardings`,
        and what puts the output back together."""
        with explained(self._caller):
            if mesh is None:
                out = self._call_fn(args)
            else:
                abstract = (
                    mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh
                )
                with jax.sharding.use_abstract_mesh(abstract):
                    out = self._call_fn(args)
        try:
            _, shardings, subtrees, prefix_def = flatten_up_to(
                out_shardings,
                out,
                is_leaf=is_spec_leaf,
                name="out_specs",
                caller=self._caller,
            )
        except ValueError as e:
            raise ValueError(f"{e} Here `tree` is the function's output.") from None
        path_leaves, treedef = jtu.tree_flatten_with_path(out)
        leaves = [leaf for _, leaf in path_leaves]
        per_leaf = [
            sharding
            for sharding, subtree in zip(shardings, subtrees, strict=True)
            for _ in jtu.tree_leaves(subtree)
        ]
        _check_shapes([path for path, _ in path_leaves], leaves, per_leaf, self._out)
        flags = [is_array(leaf) for leaf in leaves]
        try:  # as `jax.jit` checks it: static metadata included
            prefix_def.flatten_up_to(out)
            exact = True
        except (ValueError, TypeError):
            exact = False
        if all(flags) and exact:
            return out, None
        # The arrays, in the output's order, under the structure that
        # `out_shardings` has; the rest puts the output back together.
        dynamic = prefix_def.unflatten(
            [
                jtu.tree_map(lambda x: x if is_array(x) else None, subtree)
                for subtree in subtrees
            ]
        )
        template = [
            None if flag else leaf for leaf, flag in zip(leaves, flags, strict=True)
        ]
        statics = _OutStatics(
            treedef, template, [i for i, flag in enumerate(flags) if flag]
        )
        return dynamic, statics

    def _call_fn(self, args: tuple[Any, ...]) -> Any:
        if self._rules is None:
            return self._fn(*args)
        with self._rules:
            return self._fn(*args)

    def _named(self, f: Callable[..., Any]) -> Callable[..., Any]:
        """Gives the function `f` the name of `fn`, so that what `jax.jit` compiles
        from it is named after `fn` (in HLO dumps and profiles)."""
        f.__name__ = self.__name__
        f.__qualname__ = getattr(self._fn, "__qualname__", self.__name__)
        return f

    def _trace_direct(self, *args: Any) -> tuple[Any, _OutStatics | None]:
        args = _unwrap(args)
        dynamic = args if self._get_dynamic is None else self._get_dynamic(args)
        shardings = (
            [self.in_shardings] * len(dynamic)
            if is_spec_leaf(self.in_shardings)
            else list(self.in_shardings)
        )
        paths = [(jtu.SequenceKey(i),) for i in range(len(dynamic))]
        _check_shapes(paths, dynamic, shardings, self._in)
        return self._run(args, self.out_shardings, self._mesh)

    def _in_pairs(
        self, dynamic: Any, in_shardings: PyTree
    ) -> list[tuple[KeyPath, Any]]:
        """One `(path, sharding)` pair per leaf of the non-static arguments; a
        structure that `in_specs` does not fit raises naming the first path."""
        try:
            return broadcast_prefix(
                in_shardings,
                dynamic,
                is_leaf=is_spec_leaf,
                name="in_specs",
                caller=self._caller,
            )
        except ValueError as e:
            raise ValueError(
                f"{e} Here `tree` is the tuple of non-static positional arguments: "
                "give `in_specs` one entry per argument (wrap a single argument's "
                f"spec tree in a 1-tuple), or one spec for all. {_ARGS_NOTE}"
            ) from None

    def _make_jit(
        self, layout: _Layout, statics: tuple[Any, ...], static_args: tuple[Any, ...]
    ) -> Any:
        """The `jax.jit` for one layout and one set of static values."""
        # Each leaf's sharding (the leaves of this stand-in only mark positions).
        stand_in = layout.treedef.unflatten(list(range(layout.treedef.num_leaves)))
        shardings = [s for _, s in self._in_pairs(stand_in, layout.in_shardings)]
        template: list[Any] = [None] * layout.treedef.num_leaves
        for i, value in zip(layout.static_index, statics, strict=True):
            template[i] = value
        static_positions = self._static

        def call(donated: tuple[Any, ...], kept: tuple[Any, ...]) -> Any:
            leaves = list(template)
            for i, x in zip(layout.donated_index, donated, strict=True):
                leaves[i] = x
            for i, x in zip(layout.kept_index, kept, strict=True):
                leaves[i] = x
            _check_shapes(layout.paths, leaves, shardings, self._in)
            args = list(layout.treedef.unflatten(leaves))
            for position, value in zip(static_positions, static_args, strict=True):
                args.insert(position, value)
            return self._run(tuple(args), layout.out_shardings, layout.mesh)

        return jax.jit(
            self._named(call),
            in_shardings=(
                tuple(shardings[i] for i in layout.donated_index),
                tuple(shardings[i] for i in layout.kept_index),
            ),
            out_shardings=(layout.out_shardings, None),
            donate_argnums=(0,) if layout.donated_index else (),
        )

    # -- calling ------------------------------------------------------------------

    def _dispatch(
        self, args: tuple[Any, ...], *, static: bool, run: bool = True
    ) -> tuple[Any, tuple[Any, ...], Any]:
        """The `jax.jit` for these arguments, the arguments to call it with, and a
        signature telling apart what it was made for. With `static=False` the
        arguments leave out the static ones, as compiled functions take them.
        With `run`, the arguments are about to be used: donation is checked."""
        count = len(args)
        if count < self._min_count:
            raise TypeError(
                f"eqshard.{self._caller}: {self.__name__} got {count} positional "
                f"arguments, but static_argnums={self._static} needs at least "
                f"{self._min_count}."
            )
        if self._get_dynamic is None:
            dynamic, static_args, typed = args, (), ()
        else:
            dynamic = self._get_dynamic(args)
            static_args = tuple(args[i] for i in self._static)
            try:
                typed = tuple(map(_typed, static_args))
                hash(typed)
            except TypeError:
                raise self._unhashable_error(None, (), static_args) from None
        if self._direct is not None and self._direct_count in (-1, count):
            if all(map(_is_direct, dynamic)):
                _DIRECT_TYPES.update(
                    type(x) for x in dynamic if not isinstance(x, jax.ShapeDtypeStruct)
                )
                if run:
                    self._check_run(
                        [(jtu.SequenceKey(i),) for i in range(len(dynamic))],
                        dynamic,
                        [i in self._donated for i in range(len(dynamic))],
                    )
                if static and self._get_dynamic is not None:
                    args = tuple(
                        _Static(x) if i in self._static else x
                        for i, x in enumerate(args)
                    )
                return self._direct, args if static else dynamic, (None, typed)
        leaves, treedef = jtu.tree_flatten(dynamic)
        key = self._layout_key(treedef, leaves)
        try:
            layout = self._layouts.get(key)
        except TypeError:  # a non-array leaf that the specs read is unhashable
            raise self._unhashable_error(None, (), static_args, dynamic) from None
        if layout is None:
            layout = self._new_layout(dynamic, treedef, leaves, key)
        if run and layout.abstract_paths:
            raise self._abstract_error(layout.abstract_paths)
        statics = layout.get_static(leaves)
        jit_key = (statics, typed)
        try:
            jitted = layout.jitted.get(jit_key)
        except TypeError:
            raise self._unhashable_error(layout, statics, static_args) from None
        if jitted is None:
            jitted = layout.jitted[jit_key] = self._make_jit(
                layout, statics, static_args
            )
        if run and layout.donated_index:
            donated = set(layout.donated_index)
            self._check_donation(
                layout.paths, leaves, [i in donated for i in range(len(leaves))]
            )
        call_args = (layout.get_donated(leaves), layout.get_kept(leaves))
        return jitted, call_args, (layout.signature, jit_key)

    def _layout_key(self, treedef: PyTreeDef, leaves: list[Any]) -> tuple[Any, ...]:
        if self._resolve is None:  # the shardings are given: types pick the layout
            return (treedef, tuple(map(type, leaves)))
        # Specs are resolved again for anything their resolution reads: the mesh
        # set, and each leaf's shape, dtype and placement, where read (for placed
        # arrays, the common case, inline).
        placed, statics = _PLACED_TYPES, self._reads_statics
        others = () if statics else _OTHER_TYPES  # leaves whose type is all read
        if self._reads_placements:
            signature = [
                (x.aval, x.sharding, x.committed)
                if (kind := type(x)) in placed
                else kind
                if kind in others
                else _leaf_signature(x, statics, True)
                for x in leaves
            ]
        elif self._reads_shapes or statics:
            signature = [
                x.aval
                if (kind := type(x)) in placed
                else kind
                if kind in others
                else _leaf_signature(x, statics, False)
                for x in leaves
            ]
        else:  # spec trees on a given mesh: the types, as without specs
            signature = list(map(type, leaves))
        return (treedef, _mesh_key(), tuple(signature))

    def _new_layout(
        self,
        dynamic: tuple[Any, ...],
        treedef: PyTreeDef,
        leaves: list[Any],
        key: tuple[Any, ...],
    ) -> _Layout:
        if self._resolve is None:
            shardings = (self.in_shardings, self.out_shardings, self._mesh)
        else:
            shardings = self._resolve(dynamic)
        # Checks the structure first, naming the first path where `in_specs` differs.
        paths = [path for path, _ in self._in_pairs(dynamic, shardings[0])]
        layout = _Layout(treedef, paths, leaves, self._is_donated, shardings)
        self._layouts[key] = layout
        return layout

    def _check_run(
        self, paths: Sequence[KeyPath], leaves: Sequence[Any], donated: Sequence[bool]
    ) -> None:
        """Raises for arguments a call cannot run with: arrays without data, and
        donations that would crash the process."""
        abstract = [
            path
            for path, leaf in zip(paths, leaves, strict=True)
            if isinstance(leaf, jax.ShapeDtypeStruct)
        ]
        if abstract:
            raise self._abstract_error(abstract)
        if any(donated):
            self._check_donation(paths, leaves, donated)

    def _abstract_error(self, paths: Sequence[KeyPath]) -> TypeError:
        return TypeError(
            f"eqshard.{self._caller}: {self.__name__} is called with "
            f"`jax.ShapeDtypeStruct` arguments at {paths_text(paths)}, which have "
            "no data to run on. Pass arrays; for abstract arguments use "
            f"`{self.__name__}.lower(...)` (or `.compile(...)`), or "
            f"`eqshard.analyze_step`. {_ARGS_NOTE}"
        )

    def _check_donation(
        self, paths: Sequence[KeyPath], leaves: Sequence[Any], donated: Sequence[bool]
    ) -> None:
        """Raises before a donation that XLA would crash the process on: a
        deleted array (donated by an earlier call), one array at two leaves of
        which one is donated, or two donated arrays over the same buffers."""
        gone = [
            path for path, leaf in zip(paths, leaves, strict=True) if is_deleted(leaf)
        ]
        if gone:
            raise ValueError(f"{deleted_error(self._caller, gone)} {_ARGS_NOTE}")
        for first, again in repeated_arrays(leaves):
            if donated[first] or donated[again]:
                raise ValueError(
                    f"eqshard.{self._caller}: {self.__name__} is given one array at "
                    f"both '{path_str(paths[first])}' and '{path_str(paths[again])}', "
                    f"and {self._donate_text} donates it: its buffer cannot be given "
                    "away and used in the same call. Pass a copy (`jnp.copy(x)`) at "
                    f"one of them, or do not donate that argument. {_ARGS_NOTE}"
                )
        # Only among the donated leaves (to keep calls cheap): two array objects
        # over the same buffers (e.g. rebuilt from another's shards).
        seen: dict[int, int] = {}
        for i, leaf in enumerate(leaves):
            if (
                not donated[i]
                or not isinstance(leaf, jax.Array)
                or isinstance(leaf, Tracer)
            ):
                continue
            buffer = _first_buffer(leaf)
            if buffer is None:
                continue
            j = seen.setdefault(buffer, i)
            if j != i and leaves[j] is not leaf:
                raise ValueError(
                    f"eqshard.{self._caller}: {self.__name__} is given two arrays at "
                    f"'{path_str(paths[j])}' and '{path_str(paths[i])}' that share "
                    f"their buffers, and {self._donate_text} donates both: one "
                    "buffer cannot be given away twice. Pass a copy (`jnp.copy(x)`) "
                    f"at one of them, or do not donate those arguments. {_ARGS_NOTE}"
                )

    def _unhashable_error(
        self,
        layout: _Layout | None,
        statics: tuple[Any, ...],
        static_args: tuple[Any, ...],
        dynamic: Any = None,
    ) -> TypeError:
        if layout is not None:
            pairs = [(layout.paths[i], v) for i, v in zip(layout.static_index, statics)]
        else:  # no layout yet: every non-array leaf of `dynamic`
            pairs = [
                (path, leaf)
                for path, leaf in jtu.tree_flatten_with_path(dynamic)[0]
                if not is_array(leaf)
            ]
        for path, value in pairs:
            try:
                hash(_typed(value))
            except TypeError:
                return TypeError(
                    f"eqshard.{self._caller}: the argument leaf at "
                    f"'{path_str(path)}' is {value!r} (a "
                    f"{type(value).__name__}), which is neither an array nor "
                    "hashable. Non-array leaves are compiled into the function, "
                    "so they must be hashable: make it an array, or hashable."
                )
        return TypeError(
            f"eqshard.{self._caller}: the static arguments {static_args!r} "
            f"(positions {self._static}) must be hashable."
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(
                f"eqshard.{self._caller}: {self.__name__} is called with the keyword "
                f"arguments {', '.join(map(repr, sorted(kwargs)))}; pass them "
                "positionally: `in_specs`, `out_specs` and donation count positional "
                "arguments."
            )
        if not self._quiet:
            return self._call(args)
        with warnings.catch_warnings():
            # As `eqx.filter_jit(donate="all")`: buffers that no output can reuse
            # are donated in vain, which is no news.
            warnings.filterwarnings("ignore", message="Some donated buffers")
            return self._call(args)

    def _call(self, args: tuple[Any, ...]) -> Any:
        # The common case first: every argument is an array of a type seen before.
        direct = self._direct
        if (
            direct is not None
            and self._get_dynamic is None
            and self._direct_count in (-1, len(args))
            and all(map(_DIRECT_TYPES.__contains__, map(type, args)))
            # Donations are checked first, on the other path.
            and not self._donated
        ):
            jitted, call_args = direct, args
        else:
            jitted, call_args, _ = self._dispatch(args, static=True)
        try:
            out, statics = jitted(*host_private(call_args))
        except ValueError as e:
            self._diagnose(args, e)
            raise
        except RuntimeError as e:  # JAX's "Array has been deleted", naming none
            dynamic = args if self._get_dynamic is None else self._get_dynamic(args)
            paths = [
                p for p, x in jtu.tree_flatten_with_path(dynamic)[0] if is_deleted(x)
            ]
            if paths:
                raise ValueError(
                    f"{deleted_error(self._caller, paths)} {_ARGS_NOTE}"
                ) from e
            raise
        return out if statics is None else statics.rebuild(out)

    def _in_shardings_for(self, dynamic: tuple[Any, ...]) -> PyTree | None:
        """The shardings the arguments `dynamic` are taken with, if known."""
        if self._resolve is None:
            return self.in_shardings
        leaves, treedef = jtu.tree_flatten(dynamic)
        layout = self._layouts.get(self._layout_key(treedef, leaves))
        return None if layout is None else layout.in_shardings

    def _diagnose(self, args: tuple[Any, ...], error: ValueError) -> None:
        """Raises eqshard's message in place of an error JAX raised before tracing,
        if an argument's spec cannot apply or the argument is placed elsewhere."""
        if str(error).startswith("eqshard."):  # ours, from the trace
            return
        dynamic = args if self._get_dynamic is None else self._get_dynamic(args)
        in_shardings = self._in_shardings_for(dynamic)
        if in_shardings is None:
            return
        try:
            pairs = self._in_pairs(dynamic, in_shardings)
        except ValueError:
            return
        paths = [path for path, _ in pairs]
        leaves = jtu.tree_leaves(dynamic)
        shardings = [sharding for _, sharding in pairs]
        try:
            _check_shapes(paths, leaves, shardings, self._in)
        except ValueError as ours:
            raise ours from error
        for path, leaf, sharding in zip(paths, leaves, shardings, strict=True):
            if (
                isinstance(leaf, jax.Array)
                and leaf.committed
                and sharding is not None
                and not leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
            ):
                raise ValueError(
                    f"eqshard.{self._caller}: the argument at '{path_str(path)}' is "
                    f"already placed with {leaf.sharding}, but `in_specs` asks for "
                    f"{sharding.spec} on mesh {mesh_repr(sharding.mesh)}; jax.jit "
                    f"does not move placed arrays. Place it first with "
                    f"{self._place_hint}, or change its spec. " + _ARGS_NOTE
                ) from error

    def lower(self, *args: Any) -> "Lowered":
        """The function lowered for arguments like `args`; see
        [`eqshard.filter_jit`][]."""
        jitted, call_args, signature = self._dispatch(args, static=True, run=False)
        return Lowered(self, signature, _avals(self, args), jitted.lower(*call_args))

    def compile(self, *args: Any) -> "Compiled":
        """A callable compiled ahead of time for arguments like `args`; see
        [`eqshard.filter_jit`][]."""
        return self.lower(*args).compile()


_ARGS_NOTE = (
    "Paths start with the index of the argument among the non-static positional "
    "arguments."
)


def _aval_str(leaf: Any) -> str:
    """An array's type as JAX places it, printed as JAX does, e.g. `float32[8,4]`."""
    dtype = jax.dtypes.canonicalize_dtype(leaf.dtype, allow_extended_dtype=True)
    return f"{dtype}[{','.join(map(str, leaf.shape))}]"


def _avals(owner: JitFunction, args: tuple[Any, ...]) -> list[tuple[KeyPath, str]]:
    """The path and type of every array among the non-static arguments."""
    dynamic = args if owner._get_dynamic is None else owner._get_dynamic(args)
    return [
        (path, _aval_str(leaf))
        for path, leaf in jtu.tree_flatten_with_path(dynamic)[0]
        if is_array(leaf)
    ]


@dataclasses.dataclass(eq=False, repr=False)
class Lowered:
    """A [`eqshard.filter_jit`][] function lowered for one structure and types of
    arguments: `compile()` gives a callable that takes the function's own
    arguments. JAX's `jax.stages.Lowered` is its `lowered` attribute."""

    _owner: JitFunction
    _signature: Any
    _avals: list[tuple[KeyPath, str]]
    lowered: jax.stages.Lowered

    def compile(self) -> "Compiled":
        return Compiled(
            self._owner, self._signature, self._avals, self.lowered.compile()
        )

    def as_text(self, *args: Any, **kwargs: Any) -> str:
        return self.lowered.as_text(*args, **kwargs)

    def compiler_ir(self, *args: Any, **kwargs: Any) -> Any:
        return self.lowered.compiler_ir(*args, **kwargs)

    def cost_analysis(self) -> Any:
        return self.lowered.cost_analysis()

    def __repr__(self) -> str:
        return f"Lowered({self._owner.__name__})"


@dataclasses.dataclass(eq=False, repr=False)
class Compiled:
    """A [`eqshard.filter_jit`][] function compiled ahead of time for one structure
    of arguments. Calls take the function's own arguments."""

    _owner: JitFunction
    _signature: Any
    _avals: list[tuple[KeyPath, str]]
    compiled: jax.stages.Compiled

    def __call__(self, *args: Any) -> Any:
        owner = self._owner
        _, call_args, signature = owner._dispatch(args, static=False)
        if signature != self._signature:
            raise TypeError(
                f"eqshard.{owner._caller}.compile: {owner.__name__} was "
                "compiled for arguments of another structure, or with other non-array "
                "leaves or static arguments. Compile again for these arguments."
            )
        try:
            out, statics = self.compiled(*call_args)
        except (TypeError, ValueError) as e:
            self._diagnose(args, e)
            raise
        return out if statics is None else statics.rebuild(out)

    def _diagnose(self, args: tuple[Any, ...], error: Exception) -> None:
        """Raises eqshard's message, naming the paths, in place of JAX's error for
        arrays of other shapes or dtypes than those compiled for; or JAX's
        placement error as calls of the function do."""
        owner = self._owner
        given = _avals(owner, args)
        problems = [
            f"  - '{path_str(path)}': compiled for {want}, given {got}"
            for (path, want), (_, got) in zip(self._avals, given, strict=True)
            if want != got
        ]
        if problems:
            raise TypeError(
                f"eqshard.{owner._caller}.compile: {owner.__name__} was "
                f"compiled for arrays of other shapes or dtypes than it is given:\n"
                + "\n".join(problems)
                + "\nCompile again for these arguments (or call the function "
                "itself, which compiles as needed). " + _ARGS_NOTE
            ) from error
        if isinstance(error, ValueError):
            owner._diagnose(args, error)

    def as_text(self) -> str | None:
        return self.compiled.as_text()

    def cost_analysis(self) -> Any:
        return self.compiled.cost_analysis()

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()

    def __repr__(self) -> str:
        return f"Compiled({self._owner.__name__})"
