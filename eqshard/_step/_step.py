"""The compiled step: what a function's program communicates and holds on each
device, named by the tree paths of its arguments and results.

How a step is read ([`eqshard.analyze_step`][]):

1. **Leaves.** The arguments are flattened; their arrays (concrete or abstract)
   become `ShapeDtypeStruct`s with the sharding the call would use (a committed
   array's own, none for NumPy and uncommitted arrays), named by path
   (`params/b0/w1`: the signature's parameter name, else the position).
   Nothing is allocated.
2. **One program over the leaves.** `fn` is traced inside one `jax.jit` whose
   parameters are exactly those leaves (`keep_unused=True`: parameter `i` is
   leaf `i`) and whose results are the output's arrays. If `fn` is itself a
   `jax.jit`, `eqx.filter_jit`, [`eqshard.filter_jit`][] or
   [`eqshard.t5x.PartitionedFn`][], its
   `in_shardings`, `out_shardings` and donations are read from the one `jit`
   call of the trace and given to the outer program, so it compiles as `fn`
   would. A committed argument placed against `in_shardings` is an error here,
   as it is when called; NumPy and uncommitted arguments are moved at every call.
3. **Compile**, with file descriptor 2 captured: XLA logs its
   rematerialization and resharding warnings there, only when it compiles.
4. **Read** `memory_analysis()` and `as_text()` (`_hlo.py`): the collectives,
   their runs per step, device groups (mapped to mesh axes by device ids) and the
   leaves their data comes from or goes to.

The report is cached per function and arguments' signature, so a second call
compiles nothing and reports the same warnings.
"""

import contextlib
import dataclasses
import inspect
import os
import re
import sys
import tempfile
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, Sharding

from .._internals.jaxpr import boundary_of
from .._internals.routes import Unrecognised
from .._mesh import mesh_repr
from .._transforms._explicit import explained
from .._tree import is_array, path_name
from .._typing import typecheck, warn
from ._hlo_flow import Collective, Program
from ._hlo_text import text_error
from ._step_report import (
    CollectivePart,
    CollectiveRow,
    MovedInput,
    StepLeaf,
    StepMemory,
    StepReport,
    StepWarning,
)


_CALLER = "analyze_step"


def _abstract_mesh_error(path: str, mesh: AbstractMesh) -> ValueError:
    return ValueError(
        f"eqshard.{_CALLER}: the argument at '{path}' is laid out on an "
        f"AbstractMesh {mesh_repr(mesh)}, which cannot be compiled: analyze_step "
        "compiles the step for real devices. Lay it out on a `jax.sharding.Mesh` of "
        "that shape; without the hardware, start JAX with as many virtual CPU "
        f"devices (`jax.config.update('jax_num_cpu_devices', {mesh.size})` before "
        "any JAX operation)."
    )


def _placement_error(problems: Sequence[tuple[str, Sharding, Sharding]]) -> ValueError:
    lines = [
        f"  - '{path}': placed {_spec(have)}, `in_shardings` asks for {_spec(want)}"
        for path, have, want in problems
    ]
    return ValueError(
        f"eqshard.{_CALLER}: `fn` takes these arguments with `in_shardings` they are "
        "not placed with, so calling it with them raises (jax.jit does not move "
        "committed arrays):\n" + "\n".join(lines) + "\nPlace them as `fn` asks "
        "(`eqshard.shard(tree, specs, mesh)`), or change its `in_shardings`."
    )


def _devices_error(
    paths: Sequence[str], leaves: Sequence["_Leaf"]
) -> ValueError | None:
    """The error for committed arguments on different sets of devices (JAX
    raises when the step is called with them), or `None`."""
    groups: dict[frozenset[int], list[str]] = {}
    for path, leaf in zip(paths, leaves, strict=True):
        if leaf.sharding is not None:
            ids = frozenset(d.id for d in leaf.sharding.device_set)
            groups.setdefault(ids, []).append(path)
    if len(groups) < 2:
        return None
    most = max(groups, key=lambda ids: len(groups[ids]))
    others = [
        f"  - '{path}': on devices {sorted(ids)}"
        for ids, found in groups.items()
        if ids != most
        for path in found
    ]
    return ValueError(
        f"eqshard.{_CALLER}: the arguments are committed to different devices, so "
        f"calling the step with them raises: most are on devices {sorted(most)}, "
        "but\n" + "\n".join(others) + "\nPlace every argument on the step's mesh "
        "(`eqshard.shard(x, spec, mesh)`), or pass host data (NumPy), which the "
        "program places itself."
    )


def _spec(sharding: Sharding | None) -> str:
    """A sharding as a user writes it: the `PartitionSpec` of a `NamedSharding`."""
    if sharding is None:
        return "unplaced"
    if isinstance(sharding, NamedSharding):
        return str(sharding.spec)
    if len(sharding.device_set) == 1:
        return f"single device {next(iter(sharding.device_set))}"
    return str(sharding)


def _names(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[str]:
    """The name of each positional argument: its parameter's name in `fn`'s
    signature, else its position."""
    names = [str(i) for i in range(len(args))]
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return names
    position = 0
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            position += len(value)
        elif kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            if position < len(args):
                names[position] = name
                position += 1
    return names


def _leaf_path(path: tuple[Any, ...], names: list[str]) -> str:
    """`(args, kwargs)` key path -> `params/b0/w1`."""
    top, key, rest = path[0], path[1], path[2:]
    head = names[key.idx] if top.idx == 0 else str(key.key)
    return "/".join((head, path_name(rest, "/"))) if rest else head


class _Leaf(NamedTuple):
    """An array argument as the call sees it."""

    struct: jax.ShapeDtypeStruct  # with the sharding the call uses, if any
    sharding: Sharding | None  # that sharding (`None`: the program chooses)
    kind: str  # "abstract", "committed", "uncommitted" or "host"
    have: Sharding | None  # where an uncommitted array is


def _abstract(leaf: Any, path: str) -> _Leaf:
    dtype = jax.dtypes.canonicalize_dtype(leaf.dtype, allow_extended_dtype=True)
    weak = bool(getattr(leaf, "weak_type", False))
    have = None
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding, kind = leaf.sharding, "abstract"
    elif isinstance(leaf, jax.Array):
        kind = "committed" if leaf.committed else "uncommitted"
        sharding = leaf.sharding if leaf.committed else None
        have = None if leaf.committed else leaf.sharding
    else:
        sharding, kind = None, "host"
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, AbstractMesh):
        raise _abstract_mesh_error(path, sharding.mesh)
    if not isinstance(sharding, Sharding):
        sharding = None  # none, or a `ShapeDtypeStruct` with a layout only
    struct = jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding, weak_type=weak)
    return _Leaf(struct, sharding, kind, have)


def _moved(leaf: _Leaf, row: StepLeaf, program: Sharding) -> MovedInput | None:
    """The argument as moved at every call, or `None` if it is not."""
    if leaf.kind == "host":
        have = "host (NumPy)"
    elif leaf.kind == "uncommitted" and leaf.have is not None:
        if leaf.have.is_equivalent_to(program, len(row.shape)):
            return None
        have = f"uncommitted, {_spec(leaf.have)}"
    else:
        return None
    return MovedInput(row.path, row.shape, row.dtype, have, row.spec)


@dataclasses.dataclass
class _Boundary:
    """The shardings and donations of the one `jit` call that `fn` makes."""

    in_shardings: list[Sharding | None]
    out_shardings: list[Sharding | None]
    donated: list[bool]


def _boundary(traced: Any, n_in: int, n_out: int) -> _Boundary | None:
    """`fn`'s own `jit` (a `jax.jit`, either `filter_jit` or `PartitionedFn`), when
    the trace is exactly one call of it (read by `_internals.jaxpr.boundary_of`).
    Where that read meets something it does not recognise, the step is read as
    traced, without its own `jit`'s shardings and donations, said in a warning."""
    try:
        found = boundary_of(traced, n_in, n_out)
    except Unrecognised as error:
        warn(
            f"eqshard.analyze_step: the step's `jit` holds something this JAX's "
            f"reader does not recognise ({error}); it is analysed without its "
            "`in_shardings`, `out_shardings` and donations.",
            RuntimeWarning,
        )
        return None
    if found is None:
        return None
    return _Boundary(found.in_shardings, found.out_shardings, found.donated)


@contextlib.contextmanager
def _captured_stderr() -> Iterator[list[str]]:
    """Captures what is written to file descriptor 2 (where XLA logs) into the
    yielded list's one string, and writes it on to the real stderr."""
    captured: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            data = sink.read()
            if data:
                os.write(2, data)
            captured.append(data.decode(errors="replace"))


_LOG_LINE = re.compile(r"^[WE]\d{4} [\d:.]+\s+\d+ [\w.\-/]+:\d+\] (.*)$", re.M)


def _mesh_of(shardings: Sequence[Any]) -> Mesh | None:
    for sharding in shardings:
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            return sharding.mesh
    return None


def _axes(groups: Sequence[Sequence[int]], mesh: Mesh | None) -> tuple[str, ...]:
    """The mesh axes along which the devices of each group differ (device ids
    are positions in the mesh: the program's device assignment is its devices in
    order)."""
    if mesh is None or not groups:
        return ()
    shape = mesh.devices.shape
    varying: set[int] = set()
    for group in groups:
        if not group or max(group) >= mesh.size:
            continue
        coords = np.array(np.unravel_index(list(group), shape))
        varying.update(int(a) for a in np.nonzero(coords.min(1) != coords.max(1))[0])
    return tuple(name for a, name in enumerate(mesh.axis_names) if a in varying)


def _leaf_row(path: str, struct: Any, sharding: Any, donated: bool = False) -> StepLeaf:
    itemsize = int(getattr(struct.dtype, "itemsize", 0))
    shard = (
        sharding.shard_shape(tuple(struct.shape))
        if sharding is not None
        else struct.shape
    )
    return StepLeaf(
        path=path,
        shape=tuple(int(d) for d in struct.shape),
        dtype=str(struct.dtype),
        spec=_spec(sharding),
        bytes_per_device=int(np.prod(shard, dtype=np.int64)) * itemsize,
        donated=donated,
    )


def _collective_row(
    collective: Collective,
    arguments: Sequence[str],
    outputs: Sequence[str],
    mesh: Mesh | None,
) -> CollectiveRow:
    parts = []
    for part in collective.parts:
        paths = [arguments[i] for i in sorted(part.arguments)]
        paths += [outputs[i] for i in sorted(part.results)]
        via = ""
        if not paths:
            # A reduction combines the partial results of the op producing it; a
            # gather feeds the op consuming it; a resharding sits between both.
            producers = [arguments[i] for i in sorted(part.producers)]
            consumers = [arguments[i] for i in sorted(part.consumers)]
            consumers += [outputs[i] for i in sorted(part.consumer_results)]
            if collective.kind in ("all-reduce", "reduce-scatter"):
                paths, via = producers, "producer"
            elif collective.kind == "all-gather":
                paths, via = consumers, "consumer"
            else:
                paths, via = list(dict.fromkeys(producers + consumers)), "neighbours"
        parts.append(
            CollectivePart(
                shape=part.shape.dims,
                dtype=part.shape.dtype,
                bytes=part.shape.nbytes,
                paths=tuple(paths),
                via=via if paths else "",
            )
        )
    permute = collective.kind == "collective-permute"
    return CollectiveRow(
        name=collective.name,
        kind=collective.kind,
        parts=tuple(parts),
        count=collective.count,
        axes=_axes(collective.groups, mesh),
        group_size=2
        if permute
        else len(collective.groups[0])
        if collective.groups
        else 1,
        op_name=collective.op_name,
        source=_relative(collective.source),
        conditional=collective.conditional,
        unknown_trip_count=collective.unknown_trips,
    )


def _relative(source: str) -> str:
    """A source file under the working directory, relative to it."""
    cwd = os.getcwd() + os.sep
    return source[len(cwd) :] if source.startswith(cwd) else source


def _warnings(
    log: str, program: Program, arguments: Sequence[str], outputs: Sequence[str]
) -> tuple[StepWarning, ...]:
    """XLA's warnings in `log`, each with the leaves of the instructions carrying
    the op name it quotes."""
    found = []
    for message in _LOG_LINE.findall(log):
        named = re.search(r'op_name="((?:[^"\\]|\\.)*)"', message)
        frame = re.search(r"stack_frame_id=(\d+)", message)
        paths: dict[str, None] = {}
        if named is not None:
            for name, position, instruction in program.instructions():
                if f'op_name="{named[1]}"' in instruction.attrs.get("metadata", ""):
                    args, results = program.flow(name, position)
                    paths.update(dict.fromkeys(arguments[i] for i in sorted(args)))
                    paths.update(dict.fromkeys(outputs[i] for i in sorted(results)))
        source = ""
        if frame is not None:
            source = _relative(program.module.sources.get(int(frame[1]), ""))
        found.append(StepWarning(message.strip(), tuple(paths), source))
    return tuple(found)


# Reports by function, then by the signature of the arguments.
_REPORTS: "weakref.WeakKeyDictionary[Any, dict[Any, StepReport]]" = (
    weakref.WeakKeyDictionary()
)
_KEEP = 32  # reports kept per function


def _function_name(fn: Any) -> str:
    for candidate in (fn, getattr(fn, "__wrapped__", None)):
        name = getattr(candidate, "__name__", None)
        if isinstance(name, str):
            return name
    return type(fn).__name__


@typecheck
def analyze_step(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> StepReport:
    """Compiles `fn` for these arguments, without running it, and reports what the
    program communicates and holds on each device, named by tree path.

    `fn` may be a plain function, a `jax.jit`, `eqx.filter_jit` or
    [`eqshard.filter_jit`][] function, or a [`eqshard.t5x.PartitionedFn`][]; it is
    compiled with the shardings and donations
    it would use when called. Arguments may be arrays or abstract
    (`jax.ShapeDtypeStruct`s with shardings on a concrete `Mesh`, such as
    [`eqshard.abstract`][] makes): nothing is allocated. Non-array leaves are
    compiled in as constants. The figures are XLA's for the backend compiled for:
    fusion and scheduling differ between CPU, GPU and TPU, and bytes rank
    layouts, they do not forecast time.

    Each collective is attributed to the leaves its data comes from or goes to
    through ops that keep each element's identity (a weight gathered; a gradient
    reduced into the updated parameter and its optimizer state), else to the
    arguments of the dot (or reduce, convolution, gather) that makes the partial
    sums it reduces, or that consumes what it gathers; the rest is activation.
    Paths start with the parameter's name in `fn`'s signature (`params/b0/w1`),
    else its position; outputs with `out`. The report is cached: a second call
    with the same function and arguments compiles nothing.

    **Arguments:**

    - `fn`: the step.
    - `*args`, `**kwargs`: its arguments, concrete or abstract.

    **Returns:**

    A [`eqshard.StepReport`][].

    **Raises:**

    `ValueError` for an argument on an `AbstractMesh` (compiling needs devices:
    use virtual CPU devices), or a committed argument placed against `fn`'s
    `in_shardings`, naming the paths; or when XLA's text cannot be read.

    !!! Example

        ```python
        report = eqshard.analyze_step(train_step, params, opt_state, batch)
        print(report)  # memory per device, one line per collective
        report.by_path()  # {"params/head/weight": 1048576, ...}
        report.memory.fits("16GiB")
        ```
    """
    treedef, leaves, array_index, paths, abstract = _arguments(fn, args, kwargs)
    key = _cache_key(treedef, leaves, array_index, abstract)
    cache = _cache_for(fn)
    if cache is not None and key is not None and key in cache:
        return cache[key]
    report = _analyze(fn, treedef, leaves, array_index, paths, abstract)
    if cache is not None and key is not None:
        if len(cache) >= _KEEP:
            del cache[next(iter(cache))]
        cache[key] = report
    return report


def _arguments(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, list[Any], list[int], list[str], list[_Leaf]]:
    """The flattened arguments, the positions of their arrays, the arrays' paths
    and how the call sees them."""
    names = _names(fn, args, kwargs)
    path_leaves, treedef = jtu.tree_flatten_with_path((args, kwargs))
    leaves = [leaf for _, leaf in path_leaves]
    array_index = [i for i, leaf in enumerate(leaves) if is_array(leaf)]
    paths = [_leaf_path(path_leaves[i][0], names) for i in array_index]
    abstract = [
        _abstract(leaves[i], path) for i, path in zip(array_index, paths, strict=True)
    ]
    error = _devices_error(paths, abstract)
    if error is not None:
        raise error
    return treedef, leaves, array_index, paths, abstract


def analysis_report(
    fn: Callable[..., Any], *args: Any, compiler_options: dict[str, Any] | None
) -> StepReport:
    """[`eqshard.analyze_step`][] compiled with XLA `compiler_options`, uncached:
    for options that change the machine code only (such as
    `xla_backend_optimization_level`), and so not the program's text or memory
    analysis, which is all a report reads (`search_layout` compiles each layout
    this way, once)."""
    treedef, leaves, array_index, paths, abstract = _arguments(fn, args, {})
    return _analyze(fn, treedef, leaves, array_index, paths, abstract, compiler_options)


def _cache_for(fn: Any) -> dict[Any, StepReport] | None:
    try:
        return _REPORTS.setdefault(fn, {})
    except TypeError:  # not weakly referable, or not hashable
        return None


def _cache_key(
    treedef: Any, leaves: list[Any], array_index: list[int], abstract: list[_Leaf]
) -> Any:
    arrays = set(array_index)
    statics = tuple(
        (type(leaf), leaf) for i, leaf in enumerate(leaves) if i not in arrays
    )
    arrays = tuple(
        (leaf.struct.shape, leaf.struct.dtype, leaf.struct.weak_type) + leaf[1:]
        for leaf in abstract
    )
    key = (treedef, arrays, statics, jax.sharding.get_abstract_mesh())
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _analyze(
    fn: Callable[..., Any],
    treedef: Any,
    leaves: list[Any],
    array_index: list[int],
    paths: list[str],
    abstract: list[_Leaf],
    compiler_options: dict[str, Any] | None = None,
) -> StepReport:
    out_paths: list[str] = []

    def step(*arrays: Any) -> tuple[Any, ...]:
        full = list(leaves)
        for i, array in zip(array_index, arrays, strict=True):
            full[i] = array
        call_args, call_kwargs = jtu.tree_unflatten(treedef, full)
        with explained("analyze_step"):
            out = fn(*call_args, **call_kwargs)
        found = [
            (path, leaf)
            for path, leaf in jtu.tree_flatten_with_path(out)[0]
            if isinstance(leaf, jax.Array)
        ]
        out_paths[:] = [
            "/".join(("out", path_name(p, "/"))) if p else "out" for p, _ in found
        ]
        return tuple(leaf for _, leaf in found)

    step.__name__ = step.__qualname__ = _function_name(fn)
    structs = [leaf.struct for leaf in abstract]
    traced = jax.jit(step, keep_unused=True).trace(*structs)
    boundary = _boundary(traced, len(structs), len(out_paths))
    if boundary is not None and (
        any(boundary.in_shardings)
        or any(boundary.out_shardings)
        or any(boundary.donated)
    ):
        problems = []
        for k, (struct, sharding, _, _) in enumerate(abstract):
            want = boundary.in_shardings[k]
            if want is None:
                continue
            if isinstance(want, NamedSharding) and isinstance(want.mesh, AbstractMesh):
                raise _abstract_mesh_error(paths[k], want.mesh)
            if sharding is not None and not sharding.is_equivalent_to(
                want, len(struct.shape)
            ):
                problems.append((paths[k], sharding, want))
            structs[k] = jax.ShapeDtypeStruct(
                struct.shape, struct.dtype, sharding=want, weak_type=struct.weak_type
            )
        if problems:
            raise _placement_error(problems)
        jitted = jax.jit(
            step,
            keep_unused=True,
            out_shardings=tuple(boundary.out_shardings),
            donate_argnums=tuple(k for k, d in enumerate(boundary.donated) if d),
        )
        traced = jitted.trace(*structs)
    with _captured_stderr() as log:
        compiled = traced.lower().compile(compiler_options=compiler_options)
    in_shardings = list(compiled.input_shardings[0])
    out_shardings = list(compiled.output_shardings)
    mesh = _mesh_of(in_shardings + out_shardings)
    devices = (
        mesh.size
        if mesh is not None
        else max((len(s.device_set) for s in in_shardings + out_shardings), default=1)
    )
    text = compiled.as_text()
    stats = compiled.memory_analysis()
    if text is None or stats is None:
        raise text_error(
            _CALLER, "the backend gives no program text or memory analysis"
        )
    program = Program(text, caller=_CALLER, num_devices=devices)
    if program.num_arguments() != len(structs) or program.num_results() != len(
        out_paths
    ):
        raise text_error(
            _CALLER,
            f"the program has {program.num_arguments()} parameters and "
            f"{program.num_results()} results where eqshard made {len(structs)} and "
            f"{len(out_paths)}",
        )
    donated = boundary.donated if boundary is not None else [False] * len(structs)
    arguments = tuple(
        _leaf_row(path, struct, sharding, d)
        for path, struct, sharding, d in zip(
            paths, structs, in_shardings, donated, strict=True
        )
    )
    out_structs = traced.out_info
    outputs = tuple(
        _leaf_row(path, struct, sharding)
        for path, struct, sharding in zip(
            out_paths, jtu.tree_leaves(out_structs), out_shardings, strict=True
        )
    )
    moved = tuple(
        found
        for leaf, row, sharding in zip(abstract, arguments, in_shardings, strict=True)
        if (found := _moved(leaf, row, sharding)) is not None
    )
    memory = StepMemory(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        xla_peak_bytes=int(getattr(stats, "peak_memory_in_bytes", 0)),
    )
    argument_paths = [row.path for row in arguments]
    collectives = tuple(
        _collective_row(c, argument_paths, out_paths, mesh)
        for c in program.collectives()
    )
    return StepReport(
        function=_function_name(fn),
        mesh=tuple((str(a), int(n)) for a, n in mesh.shape.items())
        if mesh is not None
        else (),
        arguments=arguments,
        outputs=outputs,
        memory=memory,
        collectives=collectives,
        moved=moved,
        warnings=_warnings(log[0] if log else "", program, argument_paths, out_paths),
    )
