"""The compiled step: what a function's program communicates and holds on each
device, named by the tree paths of its arguments and results.

How a step is read ([`eqshard.analyze_step`][]):

1. **Leaves** (`_args.py`): the arguments flattened, their arrays as
   `ShapeDtypeStruct`s with the sharding the call would use, named by path.
   Nothing is allocated.
2. **One program over the leaves.** `fn` is traced inside one `jax.jit` whose
   parameters are exactly those leaves (`keep_unused=True`: parameter `i` is
   leaf `i`) and whose results are the output's arrays. If `fn` is itself a
   `jax.jit`, `eqx.filter_jit`, [`eqshard.filter_jit`][] or
   [`eqshard.t5x.PartitionedFn`][], its
   `in_shardings`, `out_shardings` and donations are read from the one `jit`
   call of the trace (`_boundary`) and given to the outer program, so it
   compiles as `fn` would. A committed argument placed against `in_shardings`
   is an error here, as it is when called; NumPy and uncommitted arguments are
   moved at every call.
3. **Compile**, with file descriptor 2 captured (`_internals.xla`) unless
   `capture_warnings=False`: XLA logs its rematerialization and resharding
   warnings there, only when it compiles.
4. **Read** `memory_analysis()` and `as_text()` (`_hlo/_flow.py`) and build the
   report's rows (`_rows.py`): the collectives, their runs per step,
   device groups (mapped to mesh axes by device ids) and the leaves their data
   comes from or goes to.

The report is cached per function and arguments' signature (`eqshard.clear_caches`
empties the cache), so a second call compiles nothing and reports the same
warnings.
"""

import contextlib
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.tree_util as jtu
from jax.sharding import Mesh, Sharding

from .._caches import register
from .._internals.errors import is_resource_exhausted
from .._internals.jaxpr import boundary_of
from .._internals.routes import Unrecognised
from .._internals.xla import Captured, captured_stderr
from .._mesh._targets import compiler_versions
from .._transforms._explicit import explained
from .._tree import path_name
from .._typing import typecheck, warn
from ._args import Arguments, arguments, CALLER, on_devices, placed_as_asked
from ._hlo._flow import Program
from ._hlo._text import text_error
from ._options import step_options
from ._records import OutOfMemory
from ._report import StepReport
from ._rows import (
    collective_row,
    host_memory,
    leaf_row,
    memory,
    mesh_of,
    moved,
    step_warnings,
)
from ._time import estimate_time


# Reports by function, then by the signature of the arguments.
_REPORTS: "weakref.WeakKeyDictionary[Any, dict[Any, StepReport]]" = (
    weakref.WeakKeyDictionary()
)
register(_REPORTS.clear)
_KEEP = 32  # reports kept per function


@typecheck
def analyze_step(
    fn: Callable[..., Any],
    *args: Any,
    capture_warnings: bool = True,
    compiler_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> StepReport:
    """Compiles `fn` for these arguments, without running it, and reports what the
    program communicates and holds on each device, named by tree path.

    `fn` may be a plain function, a `jax.jit`, `eqx.filter_jit` or
    [`eqshard.filter_jit`][] function, or a [`eqshard.t5x.PartitionedFn`][],
    compiled with the shardings and donations it would use when called. Abstract
    arguments (such as [`eqshard.abstract`][] makes) allocate nothing. Paths
    start with the parameter's name in `fn`'s signature (`params/b0/w1`), else
    its position; outputs with `out`. The report is kept: the same call again
    compiles nothing. On a target mesh ([`eqshard.create_mesh`][]'s `target=`)
    the step is compiled by that hardware's own compiler, here, and
    `report.time` estimates its seconds ([`StepTime`][eqshard.StepTime]). How
    collectives are tied to leaves, the figures' limits, warnings and compiler
    options: [the how-to](../how-to/step-report.md#reading-the-report).

    **Arguments:**

    - `fn`: the step.
    - `*args`, `**kwargs`: its arguments, concrete or abstract.
    - `capture_warnings`: whether to capture XLA's warnings into
      `report.warnings` (standard error is redirected while the step compiles);
      `False` leaves standard error alone and `report.warnings` empty.
    - `compiler_options`: XLA options to compile with, as `.compile()` takes
      them; on a TPU target they override, key by key, the async-collective
      options set by default.

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
    call = arguments(fn, args, kwargs)
    key = call.key()
    cache = _cache_for(fn)
    options = _options(compiler_options)
    if key is not None:
        key = (key, capture_warnings, options)
    if cache is not None and key is not None and key in cache:
        return cache[key]
    report = _analyze(
        fn, call, compiler_options=compiler_options, capture_warnings=capture_warnings
    )
    if cache is not None and key is not None:
        if len(cache) >= _KEEP:
            del cache[next(iter(cache))]
        cache[key] = report
    return report


def analysis_report(
    fn: Callable[..., Any],
    *args: Any,
    compiler_options: dict[str, Any] | None,
    capture_warnings: bool = True,
) -> StepReport:
    """[`eqshard.analyze_step`][] compiled with XLA `compiler_options`, uncached:
    for options that change the machine code only (such as
    `xla_backend_optimization_level`), and so not the program's text or memory
    analysis, which is all a report reads (`search_layout` compiles each layout
    this way, once)."""
    call = arguments(fn, args, {})
    return _analyze(
        fn,
        call,
        compiler_options=compiler_options,
        capture_warnings=capture_warnings,
    )


def _options(options: dict[str, Any] | None) -> tuple[tuple[str, str], ...]:
    """Compiler options as the report records them: sorted, values as text."""
    return tuple(sorted((str(k), str(v)) for k, v in (options or {}).items()))


def _cache_for(fn: Any) -> dict[Any, StepReport] | None:
    try:
        return _REPORTS.setdefault(fn, {})
    except TypeError:  # not weakly referable, or not hashable
        return None


def _function_name(fn: Any) -> str:
    for candidate in (fn, getattr(fn, "__wrapped__", None)):
        name = getattr(candidate, "__name__", None)
        if isinstance(name, str):
            return name
    return type(fn).__name__


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


@dataclasses.dataclass(frozen=True)
class _Traced:
    """The step traced over the leaves, as it is compiled."""

    traced: Any  # a `jax.stages.Traced`
    parameters: list[jax.ShapeDtypeStruct]  # with `fn`'s own `in_shardings`
    out_paths: list[str]
    donated: list[bool]


@dataclasses.dataclass(frozen=True)
class _Compiled:
    """The compiled program, read."""

    program: Program
    stats: Any  # XLA's `memory_analysis()`
    in_shardings: list[Sharding]
    out_shardings: list[Sharding]
    mesh: Mesh | None
    log: str  # what XLA logged while compiling ("" when not captured)


def _analyze(
    fn: Callable[..., Any],
    call: Arguments,
    *,
    compiler_options: dict[str, Any] | None = None,
    capture_warnings: bool = True,
) -> StepReport:
    traced = _trace(fn, call)
    planned = [
        device
        for struct in traced.parameters[:1]
        if struct.sharding is not None
        for device in struct.sharding.device_set
    ]
    compiler_options = step_options(planned, compiler_options)
    compiled = _compile(traced, compiler_options, capture_warnings)
    report = _report(fn, call, traced, compiled)
    devices = _devices(compiled)
    return dataclasses.replace(
        report,
        versions=tuple(sorted(compiler_versions(devices).items())),
        compiler_options=_options(compiler_options),
    )


def _step(fn: Callable[..., Any], call: Arguments, out_paths: list[str]) -> Any:
    """`fn` as a function of the array leaves, returning its output's arrays;
    their paths are written into `out_paths` when it is traced."""

    def step(*arrays: Any) -> tuple[Any, ...]:
        call_args, call_kwargs = call.call(arrays)
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
    return step


def _trace(fn: Callable[..., Any], call: Arguments) -> _Traced:
    """The step traced over the leaves, again with `fn`'s own shardings and
    donations when it is one `jit` call that has some."""
    out_paths: list[str] = []
    step = _step(fn, call, out_paths)
    structs = [leaf.struct for leaf in call.arrays]
    traced = jax.jit(step, keep_unused=True).trace(*structs)
    boundary = _boundary(traced, len(structs), len(out_paths))
    if boundary is None or not (
        any(boundary.in_shardings)
        or any(boundary.out_shardings)
        or any(boundary.donated)
    ):
        return _Traced(traced, structs, out_paths, [False] * len(structs))
    structs = placed_as_asked(call.arrays, boundary.in_shardings)
    jitted = jax.jit(
        step,
        keep_unused=True,
        out_shardings=tuple(on_devices(call.arrays, boundary.out_shardings)),
        donate_argnums=tuple(k for k, d in enumerate(boundary.donated) if d),
    )
    return _Traced(jitted.trace(*structs), structs, out_paths, boundary.donated)


def _compile(
    traced: _Traced, compiler_options: dict[str, Any] | None, capture: bool
) -> _Compiled:
    """The traced step compiled (XLA's log captured if asked), its text read."""
    log = captured_stderr() if capture else contextlib.nullcontext(Captured())
    with log as captured:
        try:
            compiled = traced.traced.lower().compile(compiler_options=compiler_options)
        except jax.errors.JaxRuntimeError as error:
            if not is_resource_exhausted(error):
                raise
            raise OutOfMemory(
                f"eqshard.{CALLER}: the compiler refused the step, which does not "
                f"fit one device: {str(error).splitlines()[0]} Lay out more of it "
                "over the mesh (FSDP), rematerialise, or take a smaller batch; "
                "eqshard.search_layout tries layouts."
            ) from None
    in_shardings = list(compiled.input_shardings[0])
    out_shardings = list(compiled.output_shardings)
    mesh = mesh_of(in_shardings + out_shardings)
    devices = (
        mesh.size
        if mesh is not None
        else max((len(s.device_set) for s in in_shardings + out_shardings), default=1)
    )
    text = compiled.as_text()
    stats = compiled.memory_analysis()
    if text is None or stats is None:
        raise text_error(CALLER, "the backend gives no program text or memory analysis")
    program = Program(text, caller=CALLER, num_devices=devices)
    made = (len(traced.parameters), len(traced.out_paths))
    if (program.num_arguments(), program.num_results()) != made:
        raise text_error(
            CALLER,
            f"the program has {program.num_arguments()} parameters and "
            f"{program.num_results()} results where eqshard made {made[0]} and "
            f"{made[1]}",
        )
    return _Compiled(program, stats, in_shardings, out_shardings, mesh, captured.text)


def _devices(compiled: _Compiled) -> list[Any]:
    """The devices the program was compiled for."""
    if compiled.mesh is not None:
        return list(compiled.mesh.devices.flat)
    shardings = compiled.in_shardings + compiled.out_shardings
    return sorted({d for s in shardings for d in s.device_set}, key=lambda d: d.id)


def _report(
    fn: Callable[..., Any], call: Arguments, traced: _Traced, compiled: _Compiled
) -> StepReport:
    """The report's rows, from the leaves and the compiled program."""
    arguments = tuple(
        leaf_row(leaf.path, struct, sharding, donated)
        for leaf, struct, sharding, donated in zip(
            call.arrays,
            traced.parameters,
            compiled.in_shardings,
            traced.donated,
            strict=True,
        )
    )
    outputs = tuple(
        leaf_row(path, struct, sharding)
        for path, struct, sharding in zip(
            traced.out_paths,
            jtu.tree_leaves(traced.traced.out_info),
            compiled.out_shardings,
            strict=True,
        )
    )
    moves = zip(call.arrays, arguments, compiled.in_shardings, strict=True)
    paths, out_paths, mesh = call.paths, traced.out_paths, compiled.mesh
    found = compiled.program.collectives()
    time, note, rows = estimate_time(
        compiled.program,
        found,
        [collective_row(c, paths, out_paths, mesh) for c in found],
        _devices(compiled),
    )
    figures, notes = host_memory(
        memory(compiled.stats, _devices(compiled)),
        arguments + outputs,
        compiled.in_shardings + compiled.out_shardings,
        len(arguments),
    )
    return StepReport(
        function=_function_name(fn),
        mesh=tuple((str(a), int(n)) for a, n in mesh.shape.items())
        if mesh is not None
        else (),
        arguments=arguments,
        outputs=outputs,
        memory=figures,
        collectives=rows,
        moved=tuple(m for args in moves if (m := moved(*args)) is not None),
        warnings=step_warnings(compiled.log, compiled.program, paths, out_paths)
        + notes,
        time=time,
        time_note=note,
    )
