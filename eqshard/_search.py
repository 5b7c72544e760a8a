"""Choosing a layout by compiling: [`eqshard.search_layout`][] compiles a training
step for each candidate layout of its parameters and ranks those that fit by
the communication XLA put in.

How a search goes:

1. **Arguments.** `fn(params, *args)`. Each argument after `params` is one of
   three kinds: it *follows* the parameters when some of its arrays follow a
   parameter as [`eqshard.derive_specs`][] reads it (an optimizer state: it then
   takes each candidate's specs); else it is *placed* when its arrays carry
   shardings (the batch: they are kept); else it is replicated.
2. **Data axes**: the mesh axes that split the leading dimension of the placed
   arguments' arrays; all axes if none does. Axis names are never read.
3. **One trace** of the step (`jax.make_jaxpr`, nothing compiled) gives how
   each parameter is used (`_uses.py`) and the output's structure.
4. **Candidates**: the rule sets given, then the built-in strategies
   (`_candidates.py`), each matched on the mesh; a layout equal to an earlier one
   is skipped, and so are those beyond `max_candidates`.
5. **Compile** each for abstract arguments with [`eqshard.analyze_step`][]: the
   step under one `jax.jit` whose outputs with the structure of `params` (or of
   an argument that follows it) get that argument's shardings, and whose
   arguments returned that way are donated, as a training step's are. Nothing is
   allocated. After `time_budget` seconds, the rest is skipped.
6. **Rank**: the layouts whose compiled peak fits `device_memory` by cost (bytes
   sent per step, weighted by axis bandwidth), then peak, then order; then the
   rest by peak.
"""

import functools
import inspect
import io
import operator
import sys
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import jax
import jax.tree_util as jtu
from jax.extend.core import jaxpr_as_fun
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._candidates import (
    normalized,
    parameters,
    rules_text,
    strategies,
    strategy_rules,
    tensor_pairs,
)
from ._derive import abstract_tree, derive_specs, follow_spec
from ._inspect import format_bytes
from ._mesh import require_mesh, same_mesh
from ._plan import parse_bytes
from ._rules import match_partition_rules
from ._search_report import LayoutCandidate, LayoutSearch
from ._specs import entry_axes
from ._step import analyze_step
from ._step_report import StepReport
from ._tree import is_array, path_name
from ._typing import Int, typecheck
from ._uses import parameter_uses


_CALLER = "search_layout"


def _error(message: str) -> ValueError:
    return ValueError(f"eqshard.{_CALLER}: {message}")


def _abstract_mesh_error(mesh: AbstractMesh) -> ValueError:
    return _error(
        f"the mesh {dict(mesh.shape)} is an AbstractMesh, which cannot be "
        "compiled: each candidate is compiled for real devices. Without the "
        "hardware, start JAX with as many virtual CPU devices "
        f"(`jax.config.update('jax_num_cpu_devices', {mesh.size})` before any JAX "
        "operation) and pass a `jax.sharding.Mesh` of that shape."
    )


def _other_mesh_error(path: str, have: Any, mesh: Mesh) -> ValueError:
    return _error(
        f"the argument at '{path}' is laid out on the mesh {dict(have.shape)}, "
        f"but the search is on the mesh {dict(mesh.shape)}. Lay the batch out on "
        "the search's mesh (`eqshard.shard(batch, P('dp'), mesh)` or "
        "`eqshard.abstract(batch, P('dp'), mesh)`), or pass that mesh as `mesh=`."
    )


def _candidate_error(name: str, error: Exception) -> ValueError:
    return _error(
        f"the rules of candidate {name!r} cannot lay out `params`:\n{error}\nFix "
        "those rules, or leave the candidate out."
    )


# ---------------------------------------------------------------------------------
# The step and its arguments.
# ---------------------------------------------------------------------------------


def _signature(tree: Any) -> list[tuple[tuple[int, ...], str]]:
    """The shape and dtype of each array of `tree`."""
    return [(tuple(x.shape), str(x.dtype)) for x in jtu.tree_leaves(tree)]


class _Argument:
    """An argument of the step: its kind (`"params"`, `"follows"`, `"placed"` or
    `"replicated"`), its tree, and its leaves' positions among the step's."""

    def __init__(self, name: str, tree: Any, kind: str, start: int) -> None:
        self.name, self.tree, self.kind = name, tree, kind
        leaves = jtu.tree_leaves(tree)
        self.count = sum(is_array(leaf) for leaf in leaves)
        self.positions = list(range(start, start + self.count))
        filtered = jtu.tree_map(lambda x: x if is_array(x) else None, tree)
        self.structure = jtu.tree_structure(filtered)
        self.signature = _signature(filtered)


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


def _placed(tree: Any, name: str, mesh: Mesh) -> list[Any]:
    """The shardings the arrays of `tree` carry (replicated where none)."""
    out = []
    for path, leaf in jtu.tree_flatten_with_path(tree)[0]:
        if not is_array(leaf):
            continue
        sharding = getattr(leaf, "sharding", None)
        if isinstance(leaf, jax.Array) and not leaf.committed:
            sharding = None
        if isinstance(sharding, NamedSharding):
            if not same_mesh(sharding.mesh, mesh):
                where = "/".join(filter(None, (name, path_name(path, "/"))))
                raise _other_mesh_error(where, sharding.mesh, mesh)
            out.append(NamedSharding(mesh, sharding.spec))
        else:
            out.append(NamedSharding(mesh, PartitionSpec()))
    return out


def _carries_shardings(tree: Any) -> bool:
    for leaf in jtu.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.committed:
            continue
        if is_array(leaf) and isinstance(
            getattr(leaf, "sharding", None), NamedSharding
        ):
            return True
    return False


def _struct(leaf: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
    dtype = jax.dtypes.canonicalize_dtype(leaf.dtype, allow_extended_dtype=True)
    weak = bool(getattr(leaf, "weak_type", False))
    return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding, weak_type=weak)


class _Step:
    """The step over its array leaves, and what one trace of it tells."""

    def __init__(self, fn: Callable[..., Any], params: Any, args: Sequence[Any]):
        self.fn = fn
        self.leaves, self.treedef = jtu.tree_flatten((params, *args))
        self.array_index = [i for i, x in enumerate(self.leaves) if is_array(x)]
        self.jaxpr: Any = None
        self.out_tree: Any = None

    def call(self, *arrays: Any) -> Any:
        """`fn` on the arguments with these arrays, its output's arrays (other
        leaves `None`)."""
        full = list(self.leaves)
        for i, array in zip(self.array_index, arrays, strict=True):
            full[i] = array
        out = self.fn(*jtu.tree_unflatten(self.treedef, full))
        return jtu.tree_map(lambda x: x if isinstance(x, jax.Array) else None, out)

    def trace(self, count: int, mesh: Mesh) -> tuple[list[Any], Any]:
        """The uses of the first `count` arrays (the parameters), and the output's
        structure with `ShapeDtypeStruct` leaves."""
        structs = [_struct(self.leaves[i]) for i in self.array_index]
        jaxpr, out = jax.make_jaxpr(self.call, return_shape=True)(*structs)
        # On Auto axes, the trace does not depend on the arguments' shardings:
        # each layout compiles this jaxpr rather than tracing `fn` again.
        self.jaxpr = jaxpr if set(mesh.axis_types) == {AxisType.Auto} else None
        self.out_tree = jtu.tree_structure(out)
        return parameter_uses(jaxpr, count), out

    def replay(self, *arrays: Any) -> Any:
        """`call`, from its jaxpr."""
        return jtu.tree_unflatten(self.out_tree, jaxpr_as_fun(self.jaxpr)(*arrays))

    def program(self, out_shardings: Any, donate: Sequence[int]) -> Callable[..., Any]:
        """The step as `analyze_step` reads it: `fn`'s signature, one `jax.jit`
        with these output shardings and donations inside."""
        body = self.call if self.jaxpr is None else self.replay

        def inner(*arrays: Any) -> Any:
            return body(*arrays)

        # XLA's op names then read `jit(step)/jit(train_step)/...`.
        inner.__name__ = inner.__qualname__ = _name(self.fn)
        jitted = jax.jit(
            inner, out_shardings=out_shardings, donate_argnums=tuple(donate)
        )

        @functools.wraps(self.fn)
        def step(*arguments: Any) -> Any:
            return jitted(*[x for x in jtu.tree_leaves(arguments) if is_array(x)])

        return step


def _out_shardings(
    out: Any, targets: Sequence[tuple[_Argument, list[Any]]]
) -> tuple[Any, set[int]]:
    """Shardings for the step's output: a subtree with the structure of a target
    argument gets its shardings; the rest is left to the compiler. Also the
    indices of the targets returned that way."""

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


# ---------------------------------------------------------------------------------
# The search.
# ---------------------------------------------------------------------------------


class _Progress:
    """A progress bar on a terminal's stderr: rich's when installed."""

    def __init__(
        self, total: int, enabled: bool, stream: io.TextIOBase | TextIO
    ) -> None:
        self.total, self.stream, self.done = total, stream, 0
        self.rich: Any = None
        self.enabled = enabled and stream.isatty()
        if not self.enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import Progress
        except ImportError:
            return
        console = Console(file=typing.cast(TextIO, stream))
        self.rich = Progress(console=console, transient=True)
        self.task = self.rich.add_task("compiling layouts", total=total)
        self.rich.start()

    def update(self, note: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.rich is not None:
            self.rich.update(self.task, completed=self.done, description=note)
            return
        filled = 24 * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (24 - filled)
        self.stream.write(f"\rlayouts [{bar}] {self.done}/{self.total}  {note}\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        if self.rich is not None:
            self.rich.stop()
        elif self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _given(candidates: Any) -> list[tuple[str, Any]]:
    if candidates is None:
        return []
    if isinstance(candidates, Mapping):
        named = [(str(name), rules) for name, rules in candidates.items()]
    elif isinstance(candidates, Sequence) and not isinstance(candidates, str):
        named = [(f"candidate {i}", rules) for i, rules in enumerate(candidates, 1)]
    else:
        raise TypeError(
            f"eqshard.{_CALLER}: `candidates` is {candidates!r}; give a list of rule "
            "lists, or a dict from a name to a rule list, e.g. "
            "`{'tp': [('mlp/up', P(None, 'tp')), ('.*', P())]}`."
        )
    return named


def _bandwidth(bandwidth: Mapping[str, float] | None, mesh: Mesh) -> dict[str, float]:
    weights = {str(axis): 1.0 for axis in mesh.axis_names}
    for axis, value in (bandwidth or {}).items():
        if axis not in weights:
            raise _error(
                f"`bandwidth` names {axis!r}, which is not an axis of the mesh "
                f"{dict(mesh.shape)}. Give a relative bandwidth per mesh axis, e.g. "
                f"{{{next(iter(weights))!r}: 1.0}}."
            )
        if not value > 0:
            raise _error(
                f"`bandwidth[{axis!r}]` is {value!r}; a relative bandwidth is a "
                "positive number (1.0 for ICI, about 0.1 for DCN)."
            )
        weights[axis] = float(value)
    return weights


def _cost(report: StepReport, weights: Mapping[str, float]) -> float:
    total = 0.0
    for row in report.collectives:
        slowest = min((weights.get(a, 1.0) for a in row.axes), default=1.0)
        total += row.link_bytes * row.count / slowest
    return total


def _data_axes(arguments: Sequence[_Argument], mesh: Mesh, placed: dict[int, Any]):
    found: set[str] = set()
    for argument in arguments:
        if argument.kind != "placed":
            continue
        for leaf, sharding in zip(
            [x for x in jtu.tree_leaves(argument.tree) if is_array(x)],
            placed[id(argument)],
            strict=True,
        ):
            if len(leaf.shape) and len(sharding.spec):
                found.update(entry_axes(sharding.spec[0]))
    axes = tuple(str(a) for a in mesh.axis_names)
    return tuple(a for a in axes if a in found) or axes


@typecheck
def search_layout(
    fn: Callable[..., Any],
    params: PyTree,
    *args: Any,
    mesh: Mesh | AbstractMesh | None = None,
    device_memory: Int | str,
    candidates: Any = None,
    builtin: bool = True,
    bandwidth: Mapping[str, float] | None = None,
    max_candidates: Int | None = None,
    time_budget: float | None = None,
    progress: bool = True,
) -> LayoutSearch:
    """Chooses a layout of `params` by compiling the step `fn(params, *args)` for
    each candidate: those whose compiled peak memory fits `device_memory`, ranked
    by the communication XLA put in.

    Candidates are partition rules a person can read and keep: yours
    (`candidates`), and built-in strategies over the mesh's axes: replicated
    (data parallel); FSDP ([`eqshard.auto_fsdp`][]) over the data axes and over
    all axes; tensor parallel on the step's attention and MLP pairs (found from
    paths and shapes: the first matrices split on their output, the second on its
    input), with and without the vocabulary, alone or with FSDP. The *data axes*
    are the mesh axes that split the leading dimension of the arguments that
    carry shardings (the batch, kept as it is); all axes if none does. Leading
    axes a `lax.scan` iterates over (stacked layers) are never split. An argument
    whose arrays follow the parameters (an optimizer state, as
    [`eqshard.derive_specs`][] reads it) follows each candidate; others are
    replicated.

    Each candidate is compiled once with [`eqshard.analyze_step`][], for
    abstract arguments: nothing is allocated. Outputs with the structure of
    `params` (or of an argument that follows it) get its shardings, and those
    arguments are donated. The figures are XLA's for the backend compiled for:
    a search on virtual CPU devices ranks layouts; it does not forecast GPU or
    TPU time.

    **Arguments:**

    - `fn`: the step, called as `fn(params, *args)`: a plain function or an
      `eqx.filter_jit` one (a `jax.jit` with `in_shardings` fixes the layout
      itself).
    - `params`: the tree the candidates lay out, concrete or abstract.
    - `*args`: the step's other arguments, concrete or abstract (the batch with
      its shardings, e.g. `eqshard.abstract(batch, P("dp"), mesh)`).
    - `mesh`: a concrete mesh; defaults to the one set by `jax.set_mesh`.
    - `device_memory`: the budget per device: bytes, or a string such as
      `"16GiB"`.
    - `candidates`: your rule lists, as a list or a dict from names to lists;
      ranked with the built-in ones, and kept where a built-in one gives the
      same layout.
    - `builtin`: whether to add the built-in strategies.
    - `bandwidth`: the relative bandwidth of mesh axes (default 1.0 each), such
      as `{"dcn": 0.1}`: a collective's bytes count divided by the bandwidth of
      the slowest axis it crosses.
    - `max_candidates`: compile at most this many layouts (yours first).
    - `time_budget`: start no compile after this many seconds (the result is
      then not repeatable).
    - `progress`: show a progress bar on a terminal (`rich`'s when installed).

    **Returns:**

    A [`eqshard.LayoutSearch`][]: `.best` (or `None`), `.candidates`, ranked,
    each with its `rules`, `rules_text()`, `memory`, `total_bytes` and step
    `report`.

    **Raises:**

    `ValueError` for an `AbstractMesh` (compiling needs devices: use virtual CPU
    devices), an argument on another mesh, rules of yours that cannot lay out
    `params` (naming the candidate and the paths), or bad options.

    !!! Example

        ```python
        tokens = jax.ShapeDtypeStruct((64, 128), jnp.int32)
        batch = eqshard.abstract(tokens, P("dp"), mesh)
        result = eqshard.search_layout(
            train_step, model, opt_state, batch, mesh=mesh, device_memory="16GiB"
        )
        print(result)  # the layouts ranked, the best one's rules
        specs = eqshard.match_partition_rules(result.best.rules, model, mesh=mesh)
        ```
    """
    found = require_mesh(mesh, caller=_CALLER)
    if not isinstance(found, Mesh):
        raise _abstract_mesh_error(found)
    mesh = found
    if not isinstance(device_memory, str):
        device_memory = operator.index(device_memory)
    budget = parse_bytes(device_memory, caller=_CALLER)
    weights = _bandwidth(bandwidth, mesh)
    if max_candidates is not None and max_candidates < 1:
        raise _error(f"`max_candidates` must be at least 1; got {max_candidates}.")
    if time_budget is not None and not time_budget > 0:
        raise _error(
            f"`time_budget` must be a positive number of seconds; got {time_budget}."
        )
    given = _given(candidates)
    if not given and not builtin:
        raise _error(
            "there is nothing to compile: `builtin=False` and no `candidates`. Give "
            "rule lists as `candidates=`, or leave `builtin` on."
        )
    if not any(is_array(leaf) for leaf in jtu.tree_leaves(params)):
        raise _error("`params` has no arrays to lay out.")

    start = time.perf_counter()
    names = _argument_names(fn, len(args) + 1)
    arguments, position = [], 0
    for k, tree in enumerate((params, *args)):
        if k == 0:
            kind = "params"
        elif _follows(tree, params):
            kind = "follows"
        elif _carries_shardings(tree):
            kind = "placed"
        else:
            kind = "replicated"
        arguments.append(_Argument(names[k], tree, kind, position))
        position += arguments[-1].count
    placed = {
        id(a): _placed(a.tree, a.name, mesh) for a in arguments if a.kind == "placed"
    }
    data_axes = _data_axes(arguments, mesh, placed)
    step = _Step(fn, params, args)
    with jax.set_mesh(mesh):
        uses, out = step.trace(arguments[0].count, mesh)
    params_info = parameters(params, uses)

    layouts: list[tuple[str, str, list[Any], Any]] = []
    for name, rules in given:
        try:
            specs = match_partition_rules(rules, params, mesh=mesh)
        except (ValueError, TypeError) as error:
            raise _candidate_error(name, error) from None
        layouts.append((name, "given", list(rules), specs))
    if builtin:
        pairs = tensor_pairs(params_info)
        for strategy in strategies(mesh, data_axes):
            rules = strategy_rules(strategy, params_info, pairs, params, mesh)
            specs = match_partition_rules(rules, params, mesh=mesh)
            layouts.append((strategy.name, "built-in", rules, specs))
    skipped: list[tuple[str, str]] = []
    seen: dict[Any, str] = {}
    unique = []
    for layout in layouts:
        key = tuple(
            normalized(s)
            for s in jtu.tree_leaves(layout[3])
            if isinstance(s, PartitionSpec)
        )
        if key in seen:
            if layout[1] == "given":
                skipped.append((layout[0], f"the same layout as {seen[key]}"))
        else:
            seen[key] = layout[0]
            unique.append(layout)
    if max_candidates is not None:
        skipped += [(layout[0], "max_candidates") for layout in unique[max_candidates:]]
        unique = unique[:max_candidates]

    compiled = []
    bar = _Progress(len(unique), progress, sys.stderr)
    try:
        for i, (name, origin, rules, specs) in enumerate(unique):
            if (
                time_budget is not None
                and i
                and time.perf_counter() - start > time_budget
            ):
                skipped += [(layout[0], "time budget") for layout in unique[i:]]
                break
            report = _compile(step, arguments, placed, specs, params, mesh, out)
            text = rules_text(
                params,
                specs,
                header=[
                    f"{name}: made by eqshard.search_layout for mesh "
                    f"{dict(mesh.shape)}, compiled peak "
                    f"{format_bytes(report.memory.peak_bytes)} of "
                    f"{format_bytes(budget)} per device"
                ],
            )
            compiled.append(
                LayoutCandidate(
                    name,
                    origin,
                    rules,
                    specs,
                    report,
                    budget,
                    _cost(report, weights),
                    text,
                )
            )
            bar.update(name)
    finally:
        bar.close()
    order = {id(c): i for i, c in enumerate(compiled)}
    ranked = sorted(
        compiled,
        key=lambda c: (
            not c.fits,
            c.cost if c.fits else c.memory.peak_bytes,
            c.memory.peak_bytes,
            order[id(c)],
        ),
    )
    return LayoutSearch(
        function=ranked[0].report.function if ranked else _name(fn),
        mesh=tuple((str(a), int(n)) for a, n in mesh.shape.items()),
        device_memory=budget,
        data_axes=data_axes,
        bandwidth=tuple(sorted(weights.items())),
        candidates=tuple(ranked),
        skipped=tuple(skipped),
    )


def _name(fn: Any) -> str:
    return str(getattr(fn, "__name__", type(fn).__name__))


def _argument_names(fn: Callable[..., Any], count: int) -> list[str]:
    names = [str(i) for i in range(count)]
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return names
    for i, parameter in enumerate(parameters[:count]):
        if parameter.kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            names[i] = parameter.name
        else:
            break
    return names


def _compile(
    step: _Step,
    arguments: Sequence[_Argument],
    placed: dict[int, Any],
    specs: Any,
    params: Any,
    mesh: Mesh,
    out: Any,
) -> StepReport:
    """The step report of one layout."""
    trees, targets = [], []
    for argument in arguments:
        if argument.kind == "params":
            tree = abstract_tree(argument.tree, specs, mesh, caller=_CALLER)
        elif argument.kind == "follows":
            derived = derive_specs(
                argument.tree, params, specs, on_unmatched="replicate"
            )
            tree = abstract_tree(argument.tree, derived, mesh, caller=_CALLER)
        elif argument.kind == "placed":
            kept = iter(placed[id(argument)])
            tree = jtu.tree_map(
                lambda x: _struct(x, next(kept)) if is_array(x) else x,
                argument.tree,
            )
        else:
            tree = abstract_tree(argument.tree, PartitionSpec(), mesh, caller=_CALLER)
        trees.append(tree)
        if argument.kind in ("params", "follows"):
            shardings = [x.sharding for x in jtu.tree_leaves(tree) if is_array(x)]
            targets.append((argument, shardings))
    out_shardings, returned = _out_shardings(out, targets)
    donate = [p for k in sorted(returned) for p in targets[k][0].positions]
    with jax.set_mesh(mesh):
        return analyze_step(step.program(out_shardings, donate), *trees)
