"""The programs of `JitFunction` (`_jit.py`): traced, lowered and compiled, and
their outputs put back together.

`Trace` holds what a function's programs are traced from (the function, its
name, its caller's name in messages, the logical rules set while tracing) and
makes the `jax.jit` of a call: the direct one, whose arguments are all arrays,
or the one of a `Layout` and its non-array values. Inside the trace the
arguments are checked against their shardings and moved out of host memory,
the function runs under the mesh and the rules, and its output is split into
arrays, under the structure of the output's shardings, and an `OutStatics`
that puts it back together after the call. Nothing here calls back into
`JitFunction`.

What `JitFunction.lower` gives: a function lowered (`Lowered`), then compiled
(`Compiled`), for one structure of arguments, called with the function's own
arguments. They reach their function through `Hooks`: its name, its caller's
name, its dispatch (the `jax.jit` arguments of a call), its diagnosis of JAX's
errors, and its non-static arguments.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.tree_util as jtu
from jax.sharding import AbstractMesh
from jaxtyping import PyTree

from .._spectree._check_spec import is_spec_leaf
from .._spectree._logical import RulesContext
from .._tree import flatten_up_to, is_array, path_str
from .._typing import KeyPath, PyTreeDef
from ._explicit import explained
from ._jit_checks import ARGS_NOTE, argument_pairs, check_shapes, mark_traced
from ._jit_keys import Layout, unwrap
from ._offload import to_device_memory, to_host_memory


class OutStatics:
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


jtu.register_static(OutStatics)


def split_output(
    out: Any, out_shardings: PyTree, caller: str
) -> tuple[Any, OutStatics | None]:
    """The output's arrays under the structure of `out_shardings`, and what puts
    the output back together (`None` where the arrays are the whole output, in
    that structure); checks that each array's sharding can apply."""
    try:
        _, shardings, subtrees, prefix_def = flatten_up_to(
            out_shardings, out, is_leaf=is_spec_leaf, name="out_specs", caller=caller
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
    paths = [path for path, _ in path_leaves]
    check_shapes(paths, leaves, per_leaf, f"{caller} (out_specs)")
    flags = [is_array(leaf) for leaf in leaves]
    try:  # as `jax.jit` checks it: static metadata included
        prefix_def.flatten_up_to(out)
        exact = True
    except (ValueError, TypeError):
        exact = False
    if all(flags) and exact:
        return out, None
    dynamic = prefix_def.unflatten(
        [
            jtu.tree_map(lambda x: x if is_array(x) else None, subtree)
            for subtree in subtrees
        ]
    )
    template = [
        None if flag else leaf for leaf, flag in zip(leaves, flags, strict=True)
    ]
    return dynamic, OutStatics(
        treedef, template, [i for i, flag in enumerate(flags) if flag]
    )


class Trace:
    """What the programs of one function are traced from: the function, its
    name, its caller's name in messages, the logical rules set while it is
    traced, and the positions of its static arguments. Makes the `jax.jit` of a
    call, whose trace checks the arguments and splits the output."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        caller: str,
        rules: RulesContext | None,
        static: tuple[int, ...],
    ):
        self.fn = fn
        self.name = name
        self.caller = caller
        self.in_caller = f"{caller} (in_specs)"
        self.rules = rules
        self.static = static

    def run(
        self, args: tuple[Any, ...], out_shardings: PyTree, mesh: Any
    ) -> tuple[Any, OutStatics | None]:
        """Calls the function under the mesh and the rules (at trace time) and
        splits its output into arrays, under the structure of `out_shardings`,
        and what puts the output back together."""
        with explained(self.caller):
            if mesh is None:
                out = self._call_fn(args)
            else:
                abstract = (
                    mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh
                )
                with jax.sharding.use_abstract_mesh(abstract):
                    out = self._call_fn(args)
        dynamic, statics = split_output(out, out_shardings, self.caller)
        return to_host_memory(dynamic, out_shardings), statics

    def _call_fn(self, args: tuple[Any, ...]) -> Any:
        if self.rules is None:
            return self.fn(*args)
        with self.rules:
            return self.fn(*args)

    def direct(
        self,
        in_shardings: PyTree,
        out_shardings: PyTree,
        mesh: Any,
        donate_argnums: tuple[int, ...],
    ) -> Any:
        """The `jax.jit` of calls whose non-static arguments are all arrays, with
        `in_shardings` one sharding for all, or one per argument."""
        static = self.static

        def call(*args: Any) -> tuple[Any, OutStatics | None]:
            try:
                args = unwrap(args)
                dynamic = tuple(x for i, x in enumerate(args) if i not in static)
                shardings = (
                    [in_shardings] * len(dynamic)
                    if is_spec_leaf(in_shardings)
                    else list(in_shardings)
                )
                paths = [(jtu.SequenceKey(i),) for i in range(len(dynamic))]
                check_shapes(paths, dynamic, shardings, self.in_caller)
                return self.run(args, out_shardings, mesh)
            except Exception as error:
                mark_traced(error)
                raise

        return jax.jit(
            named(call, self.fn, self.name),
            in_shardings=in_shardings,
            out_shardings=(out_shardings, None),
            static_argnums=static,
            donate_argnums=donate_argnums,
        )

    def for_layout(
        self, layout: Layout, statics: tuple[Any, ...], static_args: tuple[Any, ...]
    ) -> Any:
        """The `jax.jit` for one layout and one set of static values, taking the
        donated and the kept arrays as two flat tuples."""
        # Each leaf's sharding (the leaves of this stand-in only mark positions).
        stand_in = layout.treedef.unflatten(list(range(layout.treedef.num_leaves)))
        pairs = argument_pairs(self.caller, stand_in, layout.in_shardings)
        shardings = [s for _, s in pairs]
        template: list[Any] = [None] * layout.treedef.num_leaves
        for i, value in zip(layout.static_index, statics, strict=True):
            template[i] = value
        static_positions = self.static

        def call(donated: tuple[Any, ...], kept: tuple[Any, ...]) -> Any:
            try:
                leaves = list(template)
                for i, x in zip(layout.donated_index, donated, strict=True):
                    leaves[i] = x
                for i, x in zip(layout.kept_index, kept, strict=True):
                    leaves[i] = x
                check_shapes(layout.paths, leaves, shardings, self.in_caller)
                leaves = to_device_memory(leaves, shardings)
                args = list(layout.treedef.unflatten(leaves))
                for position, value in zip(static_positions, static_args, strict=True):
                    args.insert(position, value)
                return self.run(tuple(args), layout.out_shardings, layout.mesh)
            except Exception as error:
                mark_traced(error)
                raise

        return jax.jit(
            named(call, self.fn, self.name),
            in_shardings=(
                tuple(shardings[i] for i in layout.donated_index),
                tuple(shardings[i] for i in layout.kept_index),
            ),
            out_shardings=(layout.out_shardings, None),
            donate_argnums=(0,) if layout.donated_index else (),
        )


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What a lowered or compiled function needs of the `JitFunction` it is of."""

    name: str
    caller: str
    dispatch: Callable[[tuple[Any, ...]], tuple[Any, tuple[Any, ...], Any]]
    diagnose: Callable[[tuple[Any, ...], ValueError], None]
    dynamic: Callable[[tuple[Any, ...]], tuple[Any, ...]]


def aval_str(leaf: Any) -> str:
    """An array's type as JAX places it, printed as JAX does, e.g. `float32[8,4]`."""
    dtype = jax.dtypes.canonicalize_dtype(leaf.dtype, allow_extended_dtype=True)
    return f"{dtype}[{','.join(map(str, leaf.shape))}]"


def avals(owner: Hooks, args: tuple[Any, ...]) -> list[tuple[KeyPath, str]]:
    """The path and type of every array among the non-static arguments."""
    dynamic = owner.dynamic(args)
    return [
        (path, aval_str(leaf))
        for path, leaf in jtu.tree_flatten_with_path(dynamic)[0]
        if is_array(leaf)
    ]


@dataclasses.dataclass(eq=False, repr=False)
class Lowered:
    """A [`eqshard.filter_jit`][] function lowered for one structure and types of
    arguments: `compile()` gives a callable that takes the function's own
    arguments. JAX's `jax.stages.Lowered` is its `lowered` attribute."""

    _owner: Hooks
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
        return f"Lowered({self._owner.name})"


@dataclasses.dataclass(eq=False, repr=False)
class Compiled:
    """A [`eqshard.filter_jit`][] function compiled ahead of time for one structure
    of arguments. Calls take the function's own arguments."""

    _owner: Hooks
    _signature: Any
    _avals: list[tuple[KeyPath, str]]
    compiled: jax.stages.Compiled

    def __call__(self, *args: Any) -> Any:
        owner = self._owner
        _, call_args, signature = owner.dispatch(args)
        if signature != self._signature:
            raise TypeError(
                f"eqshard.{owner.caller}.compile: {owner.name} was "
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
        given = avals(owner, args)
        problems = [
            f"  - '{path_str(path)}': compiled for {want}, given {got}"
            for (path, want), (_, got) in zip(self._avals, given, strict=True)
            if want != got
        ]
        if problems:
            raise TypeError(
                f"eqshard.{owner.caller}.compile: {owner.name} was "
                f"compiled for arrays of other shapes or dtypes than it is given:\n"
                + "\n".join(problems)
                + "\nCompile again for these arguments (or call the function "
                "itself, which compiles as needed). " + ARGS_NOTE
            ) from error
        if isinstance(error, ValueError):
            owner.diagnose(args, error)

    def as_text(self) -> str | None:
        return self.compiled.as_text()

    def cost_analysis(self) -> Any:
        return self.compiled.cost_analysis()

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()

    def __repr__(self) -> str:
        return f"Compiled({self._owner.name})"


def named(f: Callable[..., Any], fn: Callable[..., Any], name: str) -> Any:
    """Gives the function `f` the name of `fn`, so that what `jax.jit` compiles
    from it is named after `fn` (in HLO dumps and profiles)."""
    f.__name__ = name
    f.__qualname__ = getattr(fn, "__qualname__", name)
    return f
