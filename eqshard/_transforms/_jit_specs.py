"""`filter_jit`'s specs, resolved: `Specs` is the `Resolver` that
`_filter_jit.py` gives `JitFunction` (`_jit.py`), called at the first call with
arguments of each structure, shapes, dtypes and placements (and under each mesh
set), against those arguments.

`in_specs` go through `resolve_specs` (rules matched inside each argument);
`out_specs` too, where an integer stands for an argument's layout (its spec, or
where its arrays are placed); rules and functions among the `out_specs` cost one
trace of `fn` for the output's paths and shapes. `Specs.reads` says what of the
arguments the resolution reads, and so what a call's key holds (`KeyReads`).
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.core import Tracer
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._mesh._current import find_mesh, mesh_repr, same_mesh
from .._spectree._carried import placed_sharding
from .._spectree._check_spec import (
    bad_spec_leaf_message,
    is_spec_leaf,
    leaf_specs,
    named_sharding,
)
from .._spectree._memory import Host
from .._spectree._resolve import is_partition_rules, resolve_specs
from .._tree import path_str
from .._typing import KeyPath
from ._jit_keys import KeyReads, Shardings


CALLER = "filter_jit"


def _is_spec_fn(x: Any) -> bool:
    """A callable of an abstract tree giving its spec tree (an Equinox module may
    define `__call__`, but in a spec tree it is a node)."""
    return callable(x) and not isinstance(x, eqx.Module | PartitionSpec | type)


def _is_out_entry(x: Any) -> bool:
    """A leaf of `out_specs`: a spec, an argument's index, rules or a callable."""
    return (
        is_spec_leaf(x)
        or (isinstance(x, int) and not isinstance(x, bool))
        or is_partition_rules(x)
        or _is_spec_fn(x)
    )


def _own_layout(leaf: Any) -> NamedSharding | None:
    """The `NamedSharding` an argument is placed with, if any: a committed array's
    or an abstract one's; `None` for host data, uncommitted and traced arrays."""
    if isinstance(leaf, jax.Array) and not isinstance(leaf, Tracer):
        if not leaf.committed:
            return None
    return placed_sharding(leaf)


class Specs:
    """Resolves `filter_jit`'s `in_specs` and `out_specs` for the first arguments
    of a structure (`JitFunction`'s `Resolver`)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        in_specs: Any,
        out_specs: Any,
        mesh: Mesh | AbstractMesh | None,
    ):
        self.fn = fn
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.mesh = mesh
        # What the resolution reads, for `JitFunction`'s cache key (the less, the
        # cheaper a call): rules and functions read shapes and dtypes; functions
        # of the arguments, and rules or functions of the output (whose shapes
        # static leaves may change), the values of non-array leaves; finding the
        # mesh from the arguments, or an argument's layout in `out_specs`, where
        # the arguments are placed.
        ins = jtu.tree_leaves(in_specs, is_leaf=_is_out_entry)
        outs = jtu.tree_leaves(out_specs, is_leaf=_is_out_entry)
        computed = [e for e in ins + outs if is_partition_rules(e) or _is_spec_fn(e)]
        self.reads = KeyReads(
            shapes=bool(computed),
            statics=any(map(_is_spec_fn, ins))
            or any(is_partition_rules(e) or _is_spec_fn(e) for e in outs),
            placements=mesh is None
            or any(isinstance(e, int) and not isinstance(e, bool) for e in outs),
        )

    def _mesh(self, leaves: list[Any]) -> Mesh | AbstractMesh | None:
        """The mesh given, else the one set, else the one the arguments are on."""
        found = find_mesh(self.mesh)
        if found is not None:
            return found
        meshes: list[Mesh | AbstractMesh] = []
        for leaf in leaves:
            sharding = _own_layout(leaf)
            if sharding is not None and not any(
                same_mesh(sharding.mesh, m) for m in meshes
            ):
                meshes.append(sharding.mesh)
        if len(meshes) > 1:
            raise ValueError(
                f"eqshard.{CALLER}: no mesh is given or set, and the arguments are "
                f"placed on {len(meshes)} meshes "
                f"({', '.join(mesh_repr(m) for m in meshes)}). Pass `mesh=`, or "
                "place every argument on one mesh."
            )
        return meshes[0] if meshes else None

    def _sharding(
        self, spec: Any, mesh: Mesh | AbstractMesh | None, path: KeyPath, name: str
    ) -> NamedSharding | None:
        """A spec leaf as `jax.jit` takes it: a `PartitionSpec` on `mesh`."""
        if not is_spec_leaf(spec):
            raise TypeError(
                bad_spec_leaf_message(CALLER, path, spec, logical=False, argname=name)
            )
        if not isinstance(spec, PartitionSpec | Host):
            return spec
        if mesh is None:
            raise ValueError(
                f"eqshard.{CALLER}: `{name}` has {spec} at '{path_str(path)}', but "
                "no mesh is given or set, and no argument is placed on one. Pass "
                "`mesh=`, or use `jax.set_mesh(mesh)`."
            )
        return named_sharding(spec, mesh, caller=CALLER, path=path, argname=name)

    def _count_error(self, count: int) -> ValueError | None:
        specs = self.in_specs
        if type(specs) is tuple and not is_partition_rules(specs):
            if len(specs) != count:
                return ValueError(
                    f"eqshard.{CALLER}: `in_specs` has {len(specs)} entries, but "
                    f"the function is called with {count} positional arguments. "
                    "Give one entry per argument (None for an argument placed as "
                    "it is), or one spec, rules or callable for all of them."
                )
        return None

    def __call__(self, args: tuple[Any, ...]) -> Shardings:
        leaves, treedef = jtu.tree_flatten(args)
        if isinstance(self.mesh, AbstractMesh) and not any(
            isinstance(leaf, Tracer) for leaf in leaves
        ):
            # Outside another trace, JAX needs devices to lower, compile or run.
            raise TypeError(
                f"eqshard.{CALLER}: `mesh` is an `AbstractMesh` ({self.mesh}), "
                "which has no devices: a concrete mesh is needed to lower, compile "
                "or run the function. Pass a `Mesh` (e.g. `eqshard.create_mesh(...)`"
                " or `jax.make_mesh(...)`); an `AbstractMesh` serves only for a "
                "function called inside another `jax.jit`."
            )
        mesh = self._mesh(leaves)
        error = self._count_error(len(args))
        if error is not None:
            raise error
        resolved = resolve_specs(
            self.in_specs,
            args,
            caller=CALLER,
            argname="in_specs",
            mesh=mesh,
            per_item=True,
        )
        pairs = leaf_specs(resolved, args, caller=CALLER, argname="in_specs")
        shardings = [
            self._sharding(spec, mesh, path, "in_specs") for path, spec in pairs
        ]
        in_shardings = jtu.tree_unflatten(treedef, shardings)
        # An output "as argument k" is as argument k's arrays go in: by their
        # spec, else as they are placed.
        layouts = jtu.tree_unflatten(
            treedef,
            [
                _own_layout(leaf) if sharding is None else sharding
                for leaf, sharding in zip(leaves, shardings, strict=True)
            ],
        )
        return Shardings(in_shardings, self._out(args, layouts, mesh), mesh)

    def _out(self, args: tuple[Any, ...], layouts: Any, mesh: Any) -> PyTree:
        specs = self.out_specs
        entries = jtu.tree_leaves(specs, is_leaf=_is_out_entry)
        if any(is_partition_rules(e) or _is_spec_fn(e) for e in entries):
            # Rules and functions need the output's paths and shapes: one more
            # trace, of the function alone.
            out = eqx.filter_eval_shape(self.fn, *args)
            specs = resolve_specs(
                specs, out, caller=CALLER, argname="out_specs", mesh=mesh
            )
        path_leaves, out_def = jtu.tree_flatten_with_path(specs, is_leaf=_is_out_entry)
        resolved = []
        for path, entry in path_leaves:
            if isinstance(entry, int) and not isinstance(entry, bool):
                if not 0 <= entry < len(args):
                    raise ValueError(
                        f"eqshard.{CALLER}: `out_specs` has {entry} at "
                        f"'{path_str(path)}', which names the layout of argument "
                        f"{entry}, but the function is called with {len(args)} "
                        "positional arguments. Give the index of an argument "
                        "(counting from 0)."
                    )
                resolved.append(layouts[entry])
                continue
            resolved.append(
                jtu.tree_map_with_path(
                    lambda p, s, base=path: self._sharding(
                        s, mesh, base + p, "out_specs"
                    ),
                    entry,
                    is_leaf=is_spec_leaf,
                )
            )
        return out_def.unflatten(resolved)
