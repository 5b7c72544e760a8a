"""What `JitFunction.lower` (`_jit.py`) gives: a function lowered, then compiled,
for one structure of arguments, called with the function's own arguments.

They reach their function through `Hooks`: its name, its caller's name, its
dispatch (the `jax.jit` arguments of a call), its diagnosis of JAX's errors, and
its non-static arguments.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.tree_util as jtu

from .._tree import is_array, path_str
from .._typing import KeyPath
from ._jit_checks import ARGS_NOTE


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
