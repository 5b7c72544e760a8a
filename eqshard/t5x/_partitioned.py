"""Partitioned functions: [`eqshard.filter_jit`][]'s `jax.jit` with the
shardings built once, at partition time, from t5x-style specs.

A [`eqshard.t5x.PartitionedFn`][] is the `JitFunction` of `_jit.py` (placement,
donation and the per-structure cache live there, once), with the partitioner's
mesh and logical axis rules set while `fn` is traced, `static_argnums` and
`donate_argnums` as `jax.jit` has them, and specs whose logical names
([`eqshard.AxisNames`][]) are resolved by the partitioner's rules here.
"""

import typing
from collections.abc import Callable
from typing import Any

import jax.tree_util as jtu
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._mesh._current import mesh_repr
from .._spectree._check_spec import bad_spec_leaf_message, is_spec_leaf, named_sharding
from .._spectree._logical import axis_names_resolver, AxisNames, LogicalRules
from .._transforms._jit import Front, JitFunction
from .._transforms._jit_checks import Donation
from .._transforms._jit_keys import Shardings
from .._typing import KeyPath


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


class PartitionedFn(JitFunction):
    """A function compiled with `jax.jit` on a [`eqshard.t5x.Partitioner`][]'s mesh.

    Made by [`eqshard.t5x.Partitioner.partition`][], on the machinery of
    [`eqshard.filter_jit`][]. Calls take the function's own positional arguments.
    Array leaves are traced; every other leaf (Python scalars, callables, static
    configuration of Equinox modules) is held static, as in `eqx.filter_jit`, and
    a new value compiles again. Arguments in `static_argnums` are static whatever
    they hold. Outputs may hold non-array leaves too.

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
        super().__init__(
            fn,
            Front(
                "t5x.PartitionedFn",
                place_hint="`partitioner.move_to_devices` (or `eqshard.shard`)",
                static_argnums=static_argnums,
                rules=rules,
            ),
            Shardings(in_shardings, out_shardings, mesh),
            Donation(
                positions=frozenset(donate_argnums),
                text=f"`donate_argnums={tuple(sorted(donate_argnums))}`",
            ),
        )

    def __repr__(self) -> str:
        mesh = mesh_repr(typing.cast(Mesh, self._mesh))
        return f"PartitionedFn({self.__name__}, mesh={mesh})"
