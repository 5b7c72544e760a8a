"""Partitioned functions: `jax.jit` with shardings built once, at partition time.

How a [`eqshard.t5x.PartitionedFn`][] call stays cheap:

- **Arrays only.** When every (non-static) argument is itself an array, the call
  goes straight to one `jax.jit` made at partition time: no tree work in Python.
- **Modules and other pytrees.** The arguments are flattened once; the leaf types
  and the tree structure pick a cached *layout* (which leaves are arrays), and the
  non-array leaves pick a cached `jax.jit` made for that layout, whose arguments
  are the flat tuples of array leaves. This is `eqx.filter_jit`'s filtering with
  less per-call work: no signature binding, no rebuilding of filtered trees, no
  hashing of every leaf, no blocking on a marker.
- **Contexts at trace time.** The mesh (as the abstract mesh) and the logical
  rules are set while `fn` is traced, which is the only time `fn`'s Python runs,
  so calls do not pay for entering them.
"""

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._explicit import explained
from .._logical import (
    axis_names_resolver,
    AxisNames,
    LogicalRules,
    RulesContext,
)
from .._mesh import mesh_repr
from .._specs import (
    bad_spec_leaf_message,
    check_leaves,
    is_spec_leaf,
    named_sharding,
    spec_error_message,
)
from .._tree import broadcast_prefix, is_array, path_str, repeated_arrays
from .._typing import KeyPath, PyTreeDef


# ---------------------------------------------------------------------------------
# Specs -> shardings, once, at partition time.
# ---------------------------------------------------------------------------------


def _is_spec_or_names(x: Any) -> bool:
    return is_spec_leaf(x) or isinstance(x, AxisNames)


def to_shardings(
    specs: PyTree, mesh: Mesh, rules: LogicalRules, *, name: str, caller: str
) -> PyTree:
    """A spec tree with `AxisNames` resolved by `rules` and every `PartitionSpec`
    made a `NamedSharding` on `mesh`; `None` and `NamedSharding` leaves are kept."""
    resolve = axis_names_resolver(rules, caller=caller)

    def convert(path: KeyPath, leaf: Any) -> NamedSharding | None:
        if leaf is None or isinstance(leaf, NamedSharding):
            return leaf
        if isinstance(leaf, AxisNames):
            leaf = resolve(leaf, path)
        if not isinstance(leaf, PartitionSpec):
            raise TypeError(
                bad_spec_leaf_message(caller, path, leaf, logical=True, argname=name)
            )
        return named_sharding(
            leaf, mesh, caller=caller, path=path, argname=name, logical=True
        )

    if isinstance(specs, list):  # one entry per argument, like `jax.jit`
        specs = tuple(specs)
    return jtu.tree_map_with_path(convert, specs, is_leaf=_is_spec_or_names)


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


# ---------------------------------------------------------------------------------
# Partitioned functions.
# ---------------------------------------------------------------------------------

_IN = "t5x.PartitionedFn (in_specs)"
_OUT = "t5x.PartitionedFn (out_specs)"

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
    """The non-array leaves of a traced output, returned next to its arrays.

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
    arrays, which of those are donated, and one `jax.jit` per set of values of the
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
    )

    def __init__(
        self,
        treedef: PyTreeDef,
        paths: list[KeyPath],
        leaves: list[Any],
        donated_args: frozenset[int],
    ):
        self.treedef = treedef
        self.paths = paths
        flags = [is_array(leaf) for leaf in leaves]
        self.array_index = [i for i, flag in enumerate(flags) if flag]
        self.static_index = [i for i, flag in enumerate(flags) if not flag]
        donated = [paths[i][0].idx in donated_args for i in range(len(leaves))]
        self.donated_index = [i for i in self.array_index if donated[i]]
        self.kept_index = [i for i in self.array_index if not donated[i]]
        self.get_static = _getter(self.static_index)
        self.get_donated = _getter(self.donated_index)
        self.get_kept = _getter(self.kept_index)
        self.signature = (treedef, tuple(self.array_index))
        self.jitted: dict[tuple[Any, ...], Any] = {}


class PartitionedFn:
    """A function compiled with `jax.jit` on a [`eqshard.t5x.Partitioner`][]'s mesh.

    Made by [`eqshard.t5x.Partitioner.partition`][]. Calls take the function's own
    positional arguments. Array leaves are traced; every other leaf (Python
    scalars, callables, static configuration of Equinox modules) is held static, as
    in `eqx.filter_jit`, and a new value compiles again. Arguments in
    `static_argnums` are static whatever they hold. Outputs may hold non-array
    leaves too.

    While the function is traced, the partitioner's mesh is the current (abstract)
    mesh and its logical axis rules are set, so [`eqshard.with_sharding_constraint`][]
    with mesh axes, or with logical names ([`eqshard.AxisNames`][]), works inside
    it. The rules are read when tracing: later changes do not retrace.

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

    **Attributes:**

    - `in_shardings`, `out_shardings`: the spec trees as `NamedSharding`s, built
      once when the function was partitioned.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        in_shardings: PyTree,
        out_shardings: PyTree,
        static_argnums: tuple[int, ...],
        donate_argnums: tuple[int, ...],
        mesh: Mesh,
        rules: LogicalRules,
    ):
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self._fn = fn
        self._mesh = mesh
        self._rules = RulesContext(rules)
        self._static = static_argnums
        self._donate = frozenset(donate_argnums)
        # The donated positions among the non-static arguments.
        self._donated = frozenset(
            i - sum(s < i for s in static_argnums) for i in donate_argnums
        )
        self._layouts: dict[tuple[Any, ...], _Layout] = {}
        # Calls whose non-static arguments are all arrays skip the tree work: this
        # is possible when `in_specs` is one spec, or one spec per argument.
        if is_spec_leaf(in_shardings):
            self._direct_count = -1
        elif isinstance(in_shardings, tuple) and all(map(is_spec_leaf, in_shardings)):
            self._direct_count = len(in_shardings) + len(static_argnums)
        else:
            self._direct_count = None
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
        return f"PartitionedFn({self.__name__}, mesh={mesh_repr(self._mesh)})"

    # -- tracing ------------------------------------------------------------------

    def _run(self, args: tuple[Any, ...]) -> tuple[Any, _OutStatics | None]:
        """Calls the function under the mesh and the rules (at trace time) and
        splits its output into arrays and static leaves."""
        with (
            jax.sharding.use_abstract_mesh(self._mesh.abstract_mesh),
            self._rules,
            explained("t5x.PartitionedFn"),
        ):
            out = self._fn(*args)
        try:
            pairs = broadcast_prefix(
                self.out_shardings,
                out,
                is_leaf=is_spec_leaf,
                name="out_specs",
                caller="t5x.PartitionedFn",
            )
        except ValueError as e:
            raise ValueError(f"{e} Here `tree` is the function's output.") from None
        path_leaves, treedef = jtu.tree_flatten_with_path(out)
        leaves = [leaf for _, leaf in path_leaves]
        _check_shapes(
            [path for path, _ in path_leaves],
            leaves,
            [sharding for _, sharding in pairs],
            _OUT,
        )
        flags = [is_array(leaf) for leaf in leaves]
        if all(flags):
            return out, None
        dynamic = [
            leaf if flag else None for leaf, flag in zip(leaves, flags, strict=True)
        ]
        template = [
            None if flag else leaf for leaf, flag in zip(leaves, flags, strict=True)
        ]
        statics = _OutStatics(
            treedef, template, [i for i, flag in enumerate(flags) if flag]
        )
        return treedef.unflatten(dynamic), statics

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
        _check_shapes(paths, dynamic, shardings, _IN)
        return self._run(args)

    def _in_pairs(self, dynamic: Any) -> list[tuple[KeyPath, Any]]:
        """One `(path, sharding)` pair per leaf of the non-static arguments; a
        structure that `in_specs` does not fit raises naming the first path."""
        try:
            return broadcast_prefix(
                self.in_shardings,
                dynamic,
                is_leaf=is_spec_leaf,
                name="in_specs",
                caller="t5x.PartitionedFn",
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
        shardings = [sharding for _, sharding in self._in_pairs(stand_in)]
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
            _check_shapes(layout.paths, leaves, shardings, _IN)
            args = list(layout.treedef.unflatten(leaves))
            for position, value in zip(static_positions, static_args, strict=True):
                args.insert(position, value)
            return self._run(tuple(args))

        return jax.jit(
            self._named(call),
            in_shardings=(
                tuple(shardings[i] for i in layout.donated_index),
                tuple(shardings[i] for i in layout.kept_index),
            ),
            out_shardings=(self.out_shardings, None),
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
                f"eqshard.t5x.PartitionedFn: {self.__name__} got {count} positional "
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
                if run and self._donated:
                    self._refuse_donated_twice(
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
        key = (treedef, tuple(map(type, leaves)))
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._new_layout(dynamic, treedef, leaves, key)
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
            self._refuse_donated_twice(
                layout.paths, leaves, [i in donated for i in range(len(leaves))]
            )
        call_args = (layout.get_donated(leaves), layout.get_kept(leaves))
        return jitted, call_args, (layout.signature, jit_key)

    def _new_layout(
        self,
        dynamic: tuple[Any, ...],
        treedef: PyTreeDef,
        leaves: list[Any],
        key: tuple[Any, ...],
    ) -> _Layout:
        # Checks the structure first, naming the first path where `in_specs` differs.
        paths = [path for path, _ in self._in_pairs(dynamic)]
        layout = _Layout(treedef, paths, leaves, self._donated)
        self._layouts[key] = layout
        return layout

    def _refuse_donated_twice(
        self, paths: Sequence[KeyPath], leaves: Sequence[Any], donated: Sequence[bool]
    ) -> None:
        """Raises if an array that is donated also stands at another leaf: XLA
        would use its buffer after giving it away (and crash the process)."""
        for first, again in repeated_arrays(leaves):
            if donated[first] or donated[again]:
                raise ValueError(
                    f"eqshard.t5x.PartitionedFn: {self.__name__} is given one array at "
                    f"both '{path_str(paths[first])}' and '{path_str(paths[again])}', "
                    f"and `donate_argnums={tuple(sorted(self._donate))}` donates it: "
                    "its buffer cannot be given away and used in the same call. Pass "
                    "a copy (`jnp.copy(x)`) at one of them, or do not donate that "
                    f"argument. {_ARGS_NOTE}"
                )

    def _unhashable_error(
        self,
        layout: _Layout | None,
        statics: tuple[Any, ...],
        static_args: tuple[Any, ...],
    ) -> TypeError:
        if layout is not None:
            for i, value in zip(layout.static_index, statics, strict=True):
                try:
                    hash(value)
                except TypeError:
                    return TypeError(
                        f"eqshard.t5x.PartitionedFn: the argument leaf at "
                        f"'{path_str(layout.paths[i])}' is {value!r} (a "
                        f"{type(value).__name__}), which is neither an array nor "
                        "hashable. Non-array leaves are compiled into the function, "
                        "so they must be hashable: make it an array, or hashable."
                    )
        return TypeError(
            f"eqshard.t5x.PartitionedFn: the static arguments {static_args!r} "
            f"(positions {self._static}) must be hashable."
        )

    def __call__(self, *args: Any) -> Any:
        # The common case first: every argument is an array of a type seen before.
        direct = self._direct
        if (
            direct is not None
            and self._get_dynamic is None
            and self._direct_count in (-1, len(args))
            and all(map(_DIRECT_TYPES.__contains__, map(type, args)))
            # With donation, one array given twice takes the path that refuses it.
            and (not self._donated or len(set(map(id, args))) == len(args))
        ):
            try:
                out, statics = direct(*args)
            except ValueError as e:
                self._diagnose(args, e)
                raise
        else:
            jitted, call_args, _ = self._dispatch(args, static=True)
            try:
                out, statics = jitted(*call_args)
            except ValueError as e:
                self._diagnose(args, e)
                raise
        return out if statics is None else statics.rebuild(out)

    def _diagnose(self, args: tuple[Any, ...], error: ValueError) -> None:
        """Raises eqshard's message in place of an error JAX raised before tracing,
        if an argument's spec cannot apply or the argument is placed elsewhere."""
        if str(error).startswith("eqshard."):  # ours, from the trace
            return
        dynamic = args if self._get_dynamic is None else self._get_dynamic(args)
        try:
            pairs = self._in_pairs(dynamic)
        except ValueError:
            return
        paths = [path for path, _ in pairs]
        leaves = jtu.tree_leaves(dynamic)
        shardings = [sharding for _, sharding in pairs]
        try:
            _check_shapes(paths, leaves, shardings, _IN)
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
                    f"eqshard.t5x.PartitionedFn: the argument at '{path_str(path)}' is "
                    f"already placed with {leaf.sharding}, but `in_specs` asks for "
                    f"{sharding.spec} on mesh {mesh_repr(sharding.mesh)}; jax.jit "
                    "does not move placed arrays. Place it first with "
                    "`partitioner.move_to_devices` (or `eqshard.shard`), or change "
                    "its spec. " + _ARGS_NOTE
                ) from error

    def lower(self, *args: Any) -> "_Lowered":
        """The function lowered for arguments like `args`; see
        [`eqshard.t5x.PartitionedFn`][]."""
        jitted, call_args, signature = self._dispatch(args, static=True, run=False)
        return _Lowered(self, signature, _avals(self, args), jitted.lower(*call_args))

    def compile(self, *args: Any) -> "_Compiled":
        """A callable compiled ahead of time for arguments like `args`; see
        [`eqshard.t5x.PartitionedFn`][]."""
        return self.lower(*args).compile()


_ARGS_NOTE = (
    "Paths start with the index of the argument among the non-static positional "
    "arguments."
)


def _aval_str(leaf: Any) -> str:
    """An array's type as JAX places it, printed as JAX does, e.g. `float32[8,4]`."""
    dtype = jax.dtypes.canonicalize_dtype(leaf.dtype, allow_extended_dtype=True)
    return f"{dtype}[{','.join(map(str, leaf.shape))}]"


def _avals(owner: PartitionedFn, args: tuple[Any, ...]) -> list[tuple[KeyPath, str]]:
    """The path and type of every array among the non-static arguments."""
    dynamic = args if owner._get_dynamic is None else owner._get_dynamic(args)
    return [
        (path, _aval_str(leaf))
        for path, leaf in jtu.tree_flatten_with_path(dynamic)[0]
        if is_array(leaf)
    ]


@dataclasses.dataclass(eq=False, repr=False)
class _Lowered:
    """A [`eqshard.t5x.PartitionedFn`][] lowered for one structure and types of
    arguments: `compile()` gives a callable that takes the function's own
    arguments. JAX's `jax.stages.Lowered` is its `lowered` attribute."""

    _owner: PartitionedFn
    _signature: Any
    _avals: list[tuple[KeyPath, str]]
    lowered: jax.stages.Lowered

    def compile(self) -> "_Compiled":
        return _Compiled(
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
class _Compiled:
    """A [`eqshard.t5x.PartitionedFn`][] compiled ahead of time for one structure of
    arguments. Calls take the function's own arguments."""

    _owner: PartitionedFn
    _signature: Any
    _avals: list[tuple[KeyPath, str]]
    compiled: jax.stages.Compiled

    def __call__(self, *args: Any) -> Any:
        _, call_args, signature = self._owner._dispatch(args, static=False)
        if signature != self._signature:
            raise TypeError(
                f"eqshard.t5x.PartitionedFn.compile: {self._owner.__name__} was "
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
        placement error as `PartitionedFn` calls do."""
        given = _avals(self._owner, args)
        problems = [
            f"  - '{path_str(path)}': compiled for {want}, given {got}"
            for (path, want), (_, got) in zip(self._avals, given, strict=True)
            if want != got
        ]
        if problems:
            raise TypeError(
                f"eqshard.t5x.PartitionedFn.compile: {self._owner.__name__} was "
                f"compiled for arrays of other shapes or dtypes than it is given:\n"
                + "\n".join(problems)
                + "\nCompile again for these arguments (or call the "
                "`PartitionedFn` itself, which compiles as needed). " + _ARGS_NOTE
            ) from error
        if isinstance(error, ValueError):
            self._owner._diagnose(args, error)

    def as_text(self) -> str | None:
        return self.compiled.as_text()

    def cost_analysis(self) -> Any:
        return self.compiled.cost_analysis()

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()

    def __repr__(self) -> str:
        return f"Compiled({self._owner.__name__})"
