"""The step as [`eqshard.search_layout`][] compiles it, once per layout of its
parameters (`_search.py` makes the layouts and ranks them).

1. **Arguments.** `fn(params, *args)`. Each argument after `params` is one of
   three kinds: it *follows* the parameters when some of its arrays follow a
   parameter as [`eqshard.derive_specs`][] reads it (an optimizer state: it then
   takes each layout's specs); else it is *placed* when its arrays carry
   shardings (the batch: they are kept); else it is replicated.
2. **Data axes**: the mesh axes that split the leading dimension of the placed
   arguments' arrays; all axes if none does. Axis names are never read.
3. **One trace** of the step over its arrays (`jax.make_jaxpr`, nothing
   compiled) gives how each parameter is used (`_uses.py`) and the output's
   structure. On a mesh of Auto axes the trace does not depend on the
   arguments' shardings, so every layout compiles that jaxpr.
4. **A program per layout**: one `jax.jit` whose outputs with the structure,
   shapes and dtypes of `params` (or of an argument that follows it) get that
   argument's shardings, and whose arguments returned that way are donated, as
   a training step's are; compiled for abstract arguments as
   [`eqshard.analyze_step`][] compiles, with `fn`'s signature, so that the
   report names the leaves `params/...`, `opt_state/...`, `out/...`, but at
   XLA's backend optimisation level 0: the machine code is not optimised, which
   changes neither the program's text nor its memory analysis (all a report
   reads), and halves the compile.
"""

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.tree_util as jtu
from jax.extend.core import ClosedJaxpr
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._internals import jaxpr as jaxprs
from .._mesh._current import same_mesh
from .._spectree._derive import abstract_tree, derive_specs, follow_spec
from .._spectree._specs import entry_axes
from .._step._step import analysis_report
from .._step._step_report import StepReport
from .._transforms._jit_checks import mark_traced
from .._tree import is_array, path_name
from ._uses import parameter_uses, Use


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


def _follows(tree: Any, params: Any) -> bool:
    """Whether some array of `tree` follows a parameter (an optimizer state)."""
    by_path = {
        tuple(path): (tuple(int(n) for n in leaf.shape), None)
        for path, leaf in jtu.tree_flatten_with_path(params)[0]
        if is_array(leaf)
    }
    return any(
        follow_spec(path, tuple(int(n) for n in leaf.shape), by_path)[0]
        for path, leaf in jtu.tree_flatten_with_path(tree)[0]
        if is_array(leaf) and leaf.shape
    )


def _carries_shardings(tree: Any) -> bool:
    for leaf in jtu.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.committed:
            continue
        if is_array(leaf) and isinstance(
            getattr(leaf, "sharding", None), NamedSharding
        ):
            return True
    return False


class Argument:
    """An argument of the step: its kind (`"params"`, `"follows"`, `"placed"` or
    `"replicated"`), its tree, and its arrays' positions among the step's."""

    def __init__(self, name: str, tree: Any, kind: str, start: int, mesh: Mesh):
        self.name, self.tree, self.kind = name, tree, kind
        self.count = sum(is_array(leaf) for leaf in jtu.tree_leaves(tree))
        self.positions = list(range(start, start + self.count))
        filtered = jtu.tree_map(lambda x: x if is_array(x) else None, tree)
        self.structure = jtu.tree_structure(filtered)
        self.signature = _signature(filtered)
        self.placed = self._placed(mesh) if kind == "placed" else []

    def _placed(self, mesh: Mesh) -> list[NamedSharding]:
        """The shardings its arrays carry (replicated where none)."""
        out = []
        for path, leaf in jtu.tree_flatten_with_path(self.tree)[0]:
            if not is_array(leaf):
                continue
            sharding = getattr(leaf, "sharding", None)
            if isinstance(leaf, jax.Array) and not leaf.committed:
                sharding = None
            if isinstance(sharding, NamedSharding):
                if not same_mesh(sharding.mesh, mesh):
                    where = "/".join(filter(None, (self.name, path_name(path, "/"))))
                    raise _other_mesh_error(where, sharding.mesh, mesh)
                out.append(NamedSharding(mesh, sharding.spec))
            else:
                out.append(NamedSharding(mesh, PartitionSpec()))
        return out

    def split_axes(self) -> set[str]:
        """The mesh axes that split the leading dimension of its arrays."""
        leaves = [x for x in jtu.tree_leaves(self.tree) if is_array(x)]
        return {
            str(axis)
            for leaf, sharding in zip(leaves, self.placed, strict=True)
            if len(leaf.shape) and len(sharding.spec)
            for axis in entry_axes(sharding.spec[0])
        }

    def abstract(self, specs: PyTree, params: PyTree, mesh: Mesh) -> PyTree:
        """The argument as structs, laid out for the parameters' `specs`."""
        if self.kind == "params":
            return abstract_tree(self.tree, specs, mesh, caller=CALLER)
        if self.kind == "follows":
            derived = derive_specs(self.tree, params, specs, on_invalid="ignore")
            return abstract_tree(self.tree, derived, mesh, caller=CALLER)
        if self.kind == "placed":
            kept = iter(self.placed)
            return jtu.tree_map(
                lambda x: _struct(x, next(kept)) if is_array(x) else x, self.tree
            )
        return abstract_tree(self.tree, PartitionSpec(), mesh, caller=CALLER)


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


class Step:
    """The step over its array leaves: its arguments sorted, what one trace of
    it tells, and its step report for a layout of the parameters."""

    def __init__(
        self, fn: Callable[..., Any], params: PyTree, args: Sequence[Any], mesh: Mesh
    ):
        self.fn, self.params, self.mesh = fn, params, mesh
        self.leaves, self.treedef = jtu.tree_flatten((params, *args))
        self.array_index = [i for i, x in enumerate(self.leaves) if is_array(x)]
        names = _argument_names(fn, len(args) + 1)
        self.arguments: list[Argument] = []
        position = 0
        for k, tree in enumerate((params, *args)):
            if k == 0:
                kind = "params"
            elif _follows(tree, params):
                kind = "follows"
            elif _carries_shardings(tree):
                kind = "placed"
            else:
                kind = "replicated"
            self.arguments.append(Argument(names[k], tree, kind, position, mesh))
            position += self.arguments[-1].count
        split: set[str] = set()
        for argument in self.arguments:
            split |= argument.split_axes() if argument.kind == "placed" else set()
        axes = tuple(str(a) for a in mesh.axis_names)
        self.data_axes = tuple(a for a in axes if a in split) or axes
        structs = [_struct(self.leaves[i]) for i in self.array_index]
        with jax.set_mesh(mesh):
            jaxpr, self.out = jax.make_jaxpr(self.call, return_shape=True)(*structs)
        self.uses: list[Use] = parameter_uses(jaxpr, self.arguments[0].count)
        # On Auto axes, the trace does not depend on the arguments' shardings:
        # each layout compiles this jaxpr rather than tracing `fn` again.
        auto = set(mesh.axis_types) == {AxisType.Auto}
        self.jaxpr = jaxpr if auto else None
        self.out_tree = jtu.tree_structure(self.out)

    def call(self, *arrays: Any) -> Any:
        """`fn` on the arguments with these arrays; its output's arrays (other
        leaves `None`)."""
        full = list(self.leaves)
        for i, array in zip(self.array_index, arrays, strict=True):
            full[i] = array
        try:
            out = self.fn(*jtu.tree_unflatten(self.treedef, full))
        except Exception as error:  # the step's own, whatever its text
            mark_traced(error)
            raise
        return jtu.tree_map(lambda x: x if isinstance(x, jax.Array) else None, out)

    def replay(self, jaxpr: ClosedJaxpr, *arrays: Any) -> Any:
        """`call`, from its `jaxpr`."""
        return jtu.tree_unflatten(self.out_tree, jaxprs.as_function(jaxpr)(*arrays))

    def _program(self, out_shardings: Any, donate: Sequence[int]) -> Any:
        """The step as `analyze_step` reads it: `fn`'s signature, one `jax.jit`
        with these output shardings and donations inside."""
        body = (
            self.call
            if self.jaxpr is None
            else functools.partial(self.replay, self.jaxpr)
        )

        def inner(*arrays: Any) -> Any:
            return body(*arrays)

        # XLA's op names then read `jit(step)/jit(train_step)/...`.
        inner.__name__ = inner.__qualname__ = function_name(self.fn)
        jitted = jax.jit(
            inner, out_shardings=out_shardings, donate_argnums=tuple(donate)
        )

        @functools.wraps(self.fn)
        def step(*arguments: Any) -> Any:
            return jitted(*[x for x in jtu.tree_leaves(arguments) if is_array(x)])

        return step

    def report(self, specs: PyTree) -> StepReport:
        """The step report of the layout `specs` of the parameters."""
        trees, targets = [], []
        for argument in self.arguments:
            tree = argument.abstract(specs, self.params, self.mesh)
            trees.append(tree)
            if argument.kind in ("params", "follows"):
                shardings = [x.sharding for x in jtu.tree_leaves(tree) if is_array(x)]
                targets.append((argument, shardings))
        out_shardings, returned = _out_shardings(self.out, targets)
        donate = [p for k in sorted(returned) for p in targets[k][0].positions]
        program = self._program(out_shardings, donate)
        with jax.set_mesh(self.mesh):
            return analysis_report(program, *trees, compiler_options=_OPTIONS)


def _out_shardings(
    out: Any, targets: Sequence[tuple[Argument, list[Any]]]
) -> tuple[Any, set[int]]:
    """Shardings for the step's output: a subtree with the structure, shapes and
    dtypes of a target argument gets its shardings; the rest is left to the
    compiler. Also the indices of the targets returned that way."""

    def target(node: Any) -> int | None:
        if node is None:
            return None
        structure = jtu.tree_structure(node)
        for k, (argument, _) in enumerate(targets):
            if structure == argument.structure:
                if argument.signature == _signature(node):
                    return k
        return None

    nodes = jtu.tree_leaves(out, is_leaf=lambda x: target(x) is not None)
    flat: list[Any] = []
    returned: set[int] = set()
    for node in nodes:
        k = target(node)
        if k is None:
            flat.append(None)
        else:
            returned.add(k)
            flat += targets[k][1]
    return jtu.tree_unflatten(jtu.tree_structure(out), flat), returned
