"""The command's compiled step: `python -m eqshard --step M:STEP --args M:ARGS`
loads the user's training step, compiles it with the parameters laid out by the
rules, and prints its step report; with `--fit`, it searches for a layout that
fits (`eqshard.search_layout`).

The contract is `search_layout`'s: `--step MODULE:STEP` names the step as the
user calls it (a plain function, or an `eqx.filter_jit` or `eqshard.filter_jit`
object: not called, only looked up), `--args MODULE:CALLABLE` a function of no
arguments returning the step's arguments as a tuple (arrays or
`jax.ShapeDtypeStruct`s; it is called under `eqx.filter_eval_shape`, so nothing
is allocated), and `--params SELECTOR` which part of them is the parameters: an
argument's index, or a dotted path such as `1.0` (`args[1][0]`: the model of a
`(model, opt_state)` state) or `1.model`. An argument that holds no parameter
and nothing that follows one (the batch), not placed, has its leading dimension
split over the mesh's data axes (`dp`, `fsdp`, `data`, as `--fit` reads them)
where they divide it.
"""

import argparse
import math
import sys
from typing import Any

import equinox as eqx
import jax.tree_util as jtu
from jax.sharding import Mesh, PartitionSpec

import eqshard

from .._report import format_bytes
from .._spectree._follow import followed
from .._spectree._select import check_parameters, select, Selection
from .._transforms._jit_checks import is_traced
from .._tree import is_array
from .._typing import KeyPath
from ._demo import timed
from ._fit import (
    data_axes,
    PlanOptions,
    PROG,
    save_rules,
    Setup,
)
from ._load import (
    import_target,
    UsageError,
    user_code_error,
    USER_ERRORS,
)


def load_step(text: str) -> Any:
    """The step `--step MODULE:STEP` names (looked up, not called)."""
    try:
        return import_target(text, "--step")
    except ValueError as error:
        raise UsageError(str(error)) from None


def load_args(text: str) -> tuple[Any, ...]:
    """The step's arguments, from `--args MODULE:CALLABLE`."""
    try:
        fn = import_target(text, "--args")
    except ValueError as error:
        raise UsageError(str(error)) from None
    try:
        made = eqx.filter_eval_shape(fn)  # nothing allocated, whatever it makes
    except USER_ERRORS as error:  # the user's code: say where it failed
        raise user_code_error(f"--args {text!r}: calling it", error) from None
    if not isinstance(made, tuple | list):
        raise UsageError(
            f"--args {text!r}: it returned {type(made).__name__}; return the "
            "step's arguments as a tuple, e.g. (batch, (model, opt_state))"
        )
    if not any(is_array(leaf) for leaf in jtu.tree_leaves(made)):
        raise UsageError(f"--args {text!r}: the arguments it returned have no arrays")
    return tuple(made)


def _child(node: Any, part: str) -> Any:
    """`node[int(part)]`, `node[part]` or `node.part`, as `node` takes it."""
    if isinstance(node, tuple | list) and part.lstrip("-").isdigit():
        return node[int(part)]
    if isinstance(node, dict):
        return node[int(part)] if part.isdigit() and int(part) in node else node[part]
    return getattr(node, part)


def parse_params(text: str | None, arguments: tuple[Any, ...]) -> Any:
    """`--params`' selector: an argument's index, or a function of the argument
    tuple walking a dotted path (`1.0`: `args[1][0]`), checked on `arguments`."""
    if text is None:
        return 0
    parts = text.split(".")
    if not text or not all(parts):
        raise UsageError(
            f"--params {text!r}: give an argument's index (1) or a dotted path "
            "such as 1.0 (the first item of the second argument)"
        )
    if len(parts) == 1 and parts[0].isdigit():
        return int(parts[0])

    def selector(args: Any) -> Any:
        node = args
        for part in parts:
            node = _child(node, part)
        return node

    node: Any = arguments
    for k, part in enumerate(parts):
        try:
            node = _child(node, part)
        except (LookupError, AttributeError, TypeError):
            where = ".".join(parts[:k]) or "the argument tuple"
            raise UsageError(
                f"--params {text}: {where} ({type(node).__name__}) has no item "
                f"or field {part!r}; give an argument's index or a dotted path "
                "of items and fields, such as 1.0"
            ) from None
    return selector


def dotted(path: KeyPath) -> str:
    """`--params` for the node at `path` of the arguments."""
    parts = []
    for key in path:
        for name in ("idx", "name", "key"):
            if hasattr(key, name):
                parts.append(str(getattr(key, name)))
                break
    return f"`--params {'.'.join(parts)}`"


def _follows(tree: Any, params: Any) -> bool:
    """Whether some array of `tree` follows a parameter (an optimizer state)."""
    shapes = {
        tuple(path): tuple(int(n) for n in leaf.shape)
        for path, leaf in jtu.tree_flatten_with_path(params)[0]
        if is_array(leaf)
    }
    return any(
        is_array(leaf)
        and bool(leaf.shape)
        and followed(tuple(path), tuple(int(n) for n in leaf.shape), shapes.get)
        is not None
        for path, leaf in jtu.tree_flatten_with_path(tree)[0]
    )


def _placed_batch(
    arguments: tuple[Any, ...], selection: Selection, mesh: Mesh
) -> tuple[tuple[Any, ...], list[str]]:
    """The arguments, those that hold no parameter and follow none (the batch)
    and are not placed split over the mesh's data axes where they divide them;
    a line saying so for each."""
    axes = data_axes(mesh)
    size = math.prod(mesh.shape[a] for a in axes)
    entry: Any = axes if len(axes) > 1 else (axes[0] if axes else None)
    starts, start = [], 0
    for argument in arguments:
        starts.append(start)
        start += len(jtu.tree_leaves(argument))
    out, lines = [], []
    for i, argument in enumerate(arguments):
        count = len(jtu.tree_leaves(argument))
        mine = set(range(starts[i], starts[i] + count)) & set(selection.leaves)
        leaves = [x for x in jtu.tree_leaves(argument) if is_array(x)]
        if mine or not leaves or _follows(argument, selection.tree):
            out.append(argument)
            continue
        if any(getattr(x, "sharding", None) is not None for x in leaves):
            out.append(argument)
            lines.append(f"argument {i}: as it is placed")
            continue
        shape = ", ".join(f"{tuple(x.shape)} {x.dtype}" for x in leaves)
        if axes and all(x.shape and x.shape[0] % size == 0 for x in leaves):
            out.append(eqshard.abstract(argument, PartitionSpec(entry), mesh))
            lines.append(f"argument {i}: {shape}, split over {', '.join(axes)}")
        else:
            out.append(eqshard.abstract(argument, PartitionSpec(), mesh))
            lines.append(f"argument {i}: {shape}, replicated")
    return tuple(out), lines


def run_step(args: argparse.Namespace, setup: Setup, options: PlanOptions) -> int:
    """Compiles the user's step for the rules (its report), or with `--fit`
    searches for a layout; returns the exit status."""
    mesh, rules, origin, timer = setup.mesh, setup.rules, setup.origin, setup.timer
    step = load_step(args.step)
    arguments, seconds = timed(lambda: load_args(args.args))
    timer("load arguments", seconds, args.args)
    selector = parse_params(args.params, arguments)
    try:
        selection = select(arguments, selector, caller="search_layout")
        check_parameters(selection, caller="search_layout", fix=dotted)
    except (ValueError, TypeError) as error:
        raise UsageError(f"--params {args.params}: {_one_line(error)}") from None
    arguments, lines = _placed_batch(arguments, selection, mesh)
    print(f"rules: {origin}")
    print(f"step {args.step}, arguments {args.args}")
    for line in lines:
        print(f"  {line}")
    budget = options.device_memory
    given = {origin: rules} if (not args.fit or args.rules is not None) else None
    try:
        result, seconds = timed(
            lambda: eqshard.search_layout(
                step,
                *arguments,
                params=selector,
                mesh=mesh,
                device_memory=budget or 2**62,
                candidates=given,
                builtin=args.fit,
                progress=sys.stderr.isatty(),
            )
        )
    except (ValueError, TypeError) as error:
        if is_traced(error):  # raised by the step, while traced
            raise user_code_error(f"--step {args.step}: the step", error) from None
        raise UsageError(f"--step {args.step}: {_one_line(error)}") from None
    except USER_ERRORS as error:  # the step raised while traced
        raise user_code_error(f"--step {args.step}: the step", error) from None
    what = f"{len(result.candidates)} layouts" if args.fit else "the step"
    timer("compile", seconds, f"eqshard.search_layout: {what}")
    if args.fit:
        return _show_search(result, args, options)
    (candidate,) = result.candidates
    print()
    print(candidate.report.table())
    if budget is None:
        return 0
    verdict = "fits" if candidate.fits else "DOES NOT FIT"
    print(
        f"compiled peak {format_bytes(candidate.memory.peak_bytes)} of "
        f"{format_bytes(budget)}: {verdict}"
    )
    return 0 if candidate.fits else 1


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())[:600]


def _show_search(
    result: eqshard.LayoutSearch, args: argparse.Namespace, options: PlanOptions
) -> int:
    print()
    print(result.table())
    best = result.best
    chosen = best if best is not None else result.smallest_peak
    if chosen is None:
        return 1
    print()
    if best is not None:
        print(f"rules that fit (a --rules file), {best.name}:")
    else:
        print(f"no layout fits; the smallest peak, {chosen.name}:")
    text = chosen.rules_text().replace(
        "made by eqshard.search_layout", f"made by `{PROG} --fit`"
    )
    print(text)
    save_rules(options.save_rules, text, fits=best is not None)
    print(f"step report of {chosen.name}:")
    print(chosen.report.table())
    return 0 if best is not None else 1
