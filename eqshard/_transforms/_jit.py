"""The one `jax.jit` wrapper of eqshard: `JitFunction`, the core under the front
ends [`eqshard.filter_jit`][] (`_filter_jit.py`) and [`eqshard.t5x.PartitionedFn`][].

A call reads top to bottom here (`JitFunction._call`, then `_program`): key the
call, look up its compiled program, and on a miss resolve the specs, check and
make the program (lowered and compiled by JAX at its first call); then call it
and put the output back together. Each step is a leaf helper by concern, which
never calls back into this module: the keys and the `Layout` kept per key
(`_jit_keys.py`), the resolver of a front end's specs (`Resolver`, e.g.
`_jit_specs.py`'s), the checks and their messages (`_jit_checks.py`), the
programs traced, lowered and compiled and their outputs reassembled
(`_jit_stages.py`). A front end passes what differs, as small objects, never as
mode flags: a `Front` (its name in messages, static arguments, logical rules),
the `Shardings` known up front or a `Resolver` that resolves them per structure
of the arguments, and a `Donation`.

How a call stays cheap, and keeps its layout:

- **Arrays only.** When every (non-static) argument is itself an array and the
  shardings are known up front (a partitioner's), the call goes straight to one
  `jax.jit` made at construction: no tree work in Python.
- **Modules and other pytrees.** The arguments are flattened once; the tree
  structure and the leaf types pick a cached *layout* (which leaves are arrays,
  which are donated, and the shardings of the arguments and the output). Where
  the shardings are resolved (`filter_jit`), the key also holds all that the
  resolution reads (`KeyReads`). The non-array leaves pick a cached `jax.jit`
  made for that layout, whose arguments are the flat tuples of array leaves.
  This is `eqx.filter_jit`'s filtering with less per-call work.
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
import warnings
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._mesh._current import find_mesh
from .._mesh._targets import compile_only_error
from .._move._host import host_private
from .._spectree._check_spec import is_spec_leaf
from .._spectree._logical import LogicalRules, RulesContext
from .._typing import PyTreeDef
from ._jit_checks import (
    abstract_error,
    argument_pairs,
    check_donation,
    check_placements,
    check_runnable,
    deleted_arguments_error,
    Donation,
    is_traced,
    keywords_error,
    non_array_pairs,
    unhashable_error,
)
from ._jit_keys import (
    DIRECT_TYPES,
    is_direct,
    KeyReads,
    Layout,
    layout_key,
    Shardings,
    Static,
    typed,
)
from ._jit_stages import avals, Compiled, Hooks, Lowered, Trace


@dataclasses.dataclass(frozen=True)
class Front:
    """What a front end tells the core about itself: its name in messages
    (`caller`), what to place arguments with (`place_hint`), the static arguments
    (as `jax.jit`'s `static_argnums`) and logical axis rules set while tracing."""

    caller: str
    place_hint: str = "`eqshard.shard`"
    static_argnums: tuple[int, ...] = ()
    rules: LogicalRules | None = None


@runtime_checkable
class Resolver(Protocol):
    """Resolves a layout's shardings from the first arguments of its structure;
    `reads` says what of the arguments that reads (for the cache key)."""

    reads: KeyReads

    def __call__(self, args: tuple[Any, ...]) -> Shardings: ...


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
        front: Front,
        shardings: Shardings | Resolver,
        donation: Donation = Donation(),
    ):
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)
        self._fn = fn
        self._caller = front.caller
        self._place_hint = front.place_hint
        self._static = front.static_argnums
        rules = None if front.rules is None else RulesContext(front.rules)
        self._trace = Trace(fn, self.__name__, front.caller, rules, self._static)
        # Given shardings, else the resolver and what it reads (for the key).
        fixed = shardings if isinstance(shardings, Shardings) else Shardings()
        self._resolve = None if isinstance(shardings, Shardings) else shardings
        self._reads = None if self._resolve is None else self._resolve.reads
        self.in_shardings = fixed.in_shardings
        self.out_shardings = fixed.out_shardings
        self._mesh = fixed.mesh
        self._donation = donation
        # The donated positions among the non-static arguments.
        self._donated = frozenset(
            i - sum(s < i for s in self._static) for i in donation.positions
        )
        self._layouts: dict[tuple[Any, ...], Layout] = {}
        self._direct_count = self._direct_arguments()
        self._direct = None
        if self._direct_count is not None:
            self._direct = self._trace.direct(
                self.in_shardings,
                self.out_shardings,
                self._mesh,
                tuple(sorted(donation.positions)),
            )
        self._get_dynamic = None
        self._min_count = 0
        if self._static:
            static = self._static
            self._get_dynamic = lambda args: tuple(
                x for i, x in enumerate(args) if i not in static
            )
            self._min_count = max(static) + 1

    def __repr__(self) -> str:
        return f"{self._caller}({self.__name__})"

    def _direct_arguments(self) -> int | None:
        """How many arguments a call going straight to `jax.jit` takes (-1: any
        number), if calls whose non-static arguments are all arrays can: when the
        shardings are given and `in_specs` is one spec, or one per argument."""
        if self._resolve is not None or self._donation.start is not None:
            return None
        if is_spec_leaf(self.in_shardings):
            return -1
        if isinstance(self.in_shardings, tuple) and all(
            map(is_spec_leaf, self.in_shardings)
        ):
            return len(self.in_shardings) + len(self._static)
        return None

    def _dynamic(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The non-static arguments."""
        return args if self._get_dynamic is None else self._get_dynamic(args)

    # -- the call path, top to bottom -------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise keywords_error(self._caller, self.__name__, kwargs)
        try:
            if self._donation.quiet:
                with warnings.catch_warnings():
                    # As `eqx.filter_jit(donate="all")`: buffers that no output can
                    # reuse are donated in vain, which is no news.
                    warnings.filterwarnings("ignore", message="Some donated buffers")
                    return self._call(args)
            return self._call(args)
        except (AttributeError, RuntimeError) as error:
            # What JAX raises running a program for a target's compile-only
            # devices ("no attribute 'local_devices'", "UNIMPLEMENTED").
            given = getattr(self._resolve, "mesh", None)
            failure = compile_only_error(self._caller, find_mesh(self._mesh or given))
            if failure is not None:
                raise failure from error
            raise

    def _call(self, args: tuple[Any, ...]) -> Any:
        """One call: its program (`_program`: keyed, looked up, made on a miss),
        called, and its output put back together."""
        # The common case first: every argument is an array of a type seen before.
        direct = self._direct
        if (
            direct is not None
            and self._get_dynamic is None
            and self._direct_count in (-1, len(args))
            and all(map(DIRECT_TYPES.__contains__, map(type, args)))
            # Donations are checked first, on the other path.
            and not self._donated
        ):
            program, call_args = direct, args
        else:
            program, call_args, _ = self._program(args, static=True)
        # Call it (JAX lowers and compiles a new program here, at its first call).
        try:
            out, statics = program(*host_private(call_args))
        except ValueError as e:
            self._diagnose(args, e)
            raise
        except RuntimeError as e:  # JAX's "Array has been deleted", naming none
            failure = deleted_arguments_error(self._caller, self._dynamic(args), e)
            if failure is not None:
                raise failure from e
            raise
        # Put the output back together.
        return out if statics is None else statics.rebuild(out)

    def _program(
        self, args: tuple[Any, ...], *, static: bool, run: bool = True
    ) -> tuple[Any, tuple[Any, ...], Any]:
        """The `jax.jit` for these arguments, the arguments to call it with, and a
        signature telling apart what it was made for. With `static=False` the
        arguments leave out the static ones, as compiled functions take them.
        With `run`, the arguments are about to be used: they are checked."""
        count = len(args)
        if count < self._min_count:
            raise TypeError(
                f"eqshard.{self._caller}: {self.__name__} got {count} positional "
                f"arguments, but static_argnums={self._static} needs at least "
                f"{self._min_count}."
            )
        dynamic, static_args, typed_args = args, (), ()
        if self._get_dynamic is not None:
            dynamic = self._get_dynamic(args)
            static_args = tuple(args[i] for i in self._static)
            try:
                typed_args = tuple(map(typed, static_args))
                hash(typed_args)
            except TypeError:
                raise self._unhashable(static_args, dynamic) from None
        if (
            self._direct is not None
            and self._direct_count in (-1, count)
            and all(map(is_direct, dynamic))
        ):
            call_args = self._direct_args(args, dynamic, static=static, run=run)
            return self._direct, call_args, (None, typed_args)
        return self._layout_program(dynamic, static_args, typed_args, run=run)

    def _layout_program(
        self,
        dynamic: tuple[Any, ...],
        static_args: tuple[Any, ...],
        typed_args: tuple[Any, ...],
        *,
        run: bool,
    ) -> tuple[Any, tuple[Any, ...], Any]:
        """`_program` through the layout of the arguments' structure."""
        # 1. Key the call.
        leaves, treedef = jtu.tree_flatten(dynamic)
        key = layout_key(treedef, leaves, self._reads)
        # 2. Look up its layout; on a miss, resolve the specs and check them.
        try:
            layout = self._layouts.get(key)
        except TypeError:  # a non-array leaf that the specs read is unhashable
            raise self._unhashable(static_args, dynamic) from None
        if layout is None:
            layout = self._new_layout(dynamic, treedef, leaves, key)
        if run and layout.abstract_paths:
            raise abstract_error(self._caller, self.__name__, layout.abstract_paths)
        # 3. Look up the program of its non-array values; on a miss, make it.
        statics = layout.get_static(leaves)
        jit_key = (layout.static_key(statics), typed_args)
        try:
            program = layout.jitted.get(jit_key)
        except TypeError:
            pairs = [(layout.paths[i], v) for i, v in zip(layout.static_index, statics)]
            raise unhashable_error(
                self._caller, self._static, pairs, static_args
            ) from None
        if program is None:
            program = layout.jitted[jit_key] = self._trace.for_layout(
                layout, statics, static_args
            )
        # 4. Check the donations, and give the arrays to call it with.
        if run and layout.donated_index:
            donated = set(layout.donated_index)
            check_donation(
                self._caller,
                self.__name__,
                self._donation,
                leaves,
                layout.paths,
                [i in donated for i in range(len(leaves))],
            )
        call_args = (layout.get_donated(leaves), layout.get_kept(leaves))
        return program, call_args, (layout.signature, jit_key)

    def _new_layout(
        self,
        dynamic: tuple[Any, ...],
        treedef: PyTreeDef,
        leaves: list[Any],
        key: tuple[Any, ...],
    ) -> Layout:
        """The layout of a structure seen first: its specs resolved, and checked
        to fit the arguments (naming the first path where `in_specs` differs)."""
        if self._resolve is None:
            shardings = Shardings(self.in_shardings, self.out_shardings, self._mesh)
        else:
            shardings = self._resolve(dynamic)
        pairs = argument_pairs(self._caller, dynamic, shardings.in_shardings)
        paths = [path for path, _ in pairs]
        donated = [self._is_donated(path[0].idx) for path in paths]
        layout = Layout(treedef, paths, leaves, donated, shardings)
        self._layouts[key] = layout
        return layout

    # -- what the call path asks of the function's options ------------------------

    def _direct_args(
        self,
        args: tuple[Any, ...],
        dynamic: tuple[Any, ...],
        *,
        static: bool,
        run: bool,
    ) -> tuple[Any, ...]:
        """The arguments of the direct `jax.jit` (all arrays), checked if `run`."""
        DIRECT_TYPES.update(
            type(x) for x in dynamic if not isinstance(x, jax.ShapeDtypeStruct)
        )
        if run:
            check_runnable(
                self._caller,
                self.__name__,
                self._donation,
                [(jtu.SequenceKey(i),) for i in range(len(dynamic))],
                dynamic,
                [i in self._donated for i in range(len(dynamic))],
            )
        if not static:
            return dynamic
        if self._get_dynamic is not None:
            return tuple(
                Static(x) if i in self._static else x for i, x in enumerate(args)
            )
        return args

    def _is_donated(self, position: int) -> bool:
        """Whether the non-static argument at `position` is donated."""
        if self._donation.start is not None:
            return position >= self._donation.start
        return position in self._donated

    def _unhashable(self, static_args: tuple[Any, ...], dynamic: Any) -> TypeError:
        return unhashable_error(
            self._caller, self._static, non_array_pairs(dynamic), static_args
        )

    def _in_shardings_for(self, dynamic: tuple[Any, ...]) -> PyTree | None:
        """The shardings the arguments `dynamic` are taken with, if known."""
        if self._resolve is None:
            return self.in_shardings
        leaves, treedef = jtu.tree_flatten(dynamic)
        layout = self._layouts.get(layout_key(treedef, leaves, self._reads))
        return None if layout is None else layout.in_shardings

    def _diagnose(self, args: tuple[Any, ...], error: ValueError) -> None:
        """Raises eqshard's message in place of an error JAX raised before tracing,
        if an argument's spec cannot apply or the argument is placed elsewhere."""
        if is_traced(error):  # eqshard's or the function's, from the trace
            return
        dynamic = self._dynamic(args)
        in_shardings = self._in_shardings_for(dynamic)
        if in_shardings is not None:
            check_placements(
                self._caller, self._place_hint, dynamic, in_shardings, error
            )

    # -- ahead of time ------------------------------------------------------------

    def lower(self, *args: Any) -> Lowered:
        """The function lowered for arguments like `args`; see
        [`eqshard.filter_jit`][]."""
        program, call_args, signature = self._program(args, static=True, run=False)
        hooks = Hooks(
            self.__name__,
            self._caller,
            lambda args: self._program(args, static=False),
            self._diagnose,
            self._dynamic,
        )
        return Lowered(hooks, signature, avals(hooks, args), program.lower(*call_args))

    def compile(self, *args: Any) -> Compiled:
        """A callable compiled ahead of time for arguments like `args`; see
        [`eqshard.filter_jit`][]."""
        return self.lower(*args).compile()
