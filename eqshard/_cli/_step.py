"""The command's compiled step: `python -m eqshard --model M:F --step M:G` loads
the user's training step, compiles it for the model laid out by the rules, and
prints its step report; with `--fit`, it searches for a layout that fits
(`eqshard.search_layout`).

`--step MODULE:CALLABLE` follows `--model`'s convention: `CALLABLE()` takes no
arguments and returns `(step, optimizer, batch)`, where `step(params,
opt_state, batch)` is the training step, `optimizer` the optax optimizer whose
state it updates (or `None`; the state is then `None`), and `batch` one batch
(arrays or `jax.ShapeDtypeStruct`s); it is called under `eqx.filter_eval_shape`,
so nothing is allocated. The optimizer's state is made abstractly,
`optimizer.init(eqx.filter(model, eqx.is_array))`, as Equinox's examples make
it; the batch's leading dimension is split over the mesh's data axes (`dp`,
`fsdp`, `data`, as `--fit` reads them) where they divide it.
"""

import argparse
import math
import sys
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import PyTree

import eqshard

from .._report import format_bytes
from .._transforms._jit_checks import is_traced
from .._tree import is_array
from ._demo import timed
from ._fit import (
    data_axes,
    import_target,
    PlanOptions,
    PROG,
    save_rules,
    Setup,
    UsageError,
    user_code_error,
)


def load_step(text: str) -> tuple[Any, Any, PyTree]:
    """`(step, optimizer, batch)` from `--step MODULE:CALLABLE`."""
    try:
        fn = import_target(text, "--step")
    except ValueError as error:
        raise UsageError(str(error)) from None
    try:
        made = eqx.filter_eval_shape(fn)  # nothing allocated, whatever it makes
    except Exception as error:  # the user's code: say where it failed
        raise user_code_error(f"--step {text!r}: calling it", error) from None
    if not (isinstance(made, tuple | list) and len(made) == 3):
        raise UsageError(
            f"--step {text!r}: it returned {type(made).__name__}; return "
            "(step, optimizer, batch): step(params, opt_state, batch), the optax "
            "optimizer (or None), and one batch"
        )
    step, optimizer, batch = made
    if not callable(step):
        raise UsageError(f"--step {text!r}: the step it returned is not callable")
    if optimizer is not None and not hasattr(optimizer, "init"):
        raise UsageError(
            f"--step {text!r}: the optimizer it returned has no init(); return an "
            "optax optimizer, or None"
        )
    if not any(is_array(leaf) for leaf in jtu.tree_leaves(batch)):
        raise UsageError(f"--step {text!r}: the batch it returned has no arrays")
    return step, optimizer, batch


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())[:400]


def _placed_batch(batch: PyTree, mesh: Mesh) -> tuple[PyTree, tuple[str, ...]]:
    """The batch, abstract, its leading dimension split over the mesh's data axes
    where they divide it."""
    axes = data_axes(mesh)
    size = math.prod(mesh.shape[a] for a in axes)
    leaves = [x for x in jtu.tree_leaves(batch) if is_array(x)]
    if not axes or not all(x.shape and x.shape[0] % size == 0 for x in leaves):
        return eqshard.abstract(batch, PartitionSpec(), mesh), ()
    entry: Any = axes if len(axes) > 1 else next(iter(axes))
    return eqshard.abstract(batch, PartitionSpec(entry), mesh), axes


def run_step(
    args: argparse.Namespace, shapes: PyTree, setup: Setup, options: PlanOptions
) -> int:
    """Compiles the user's step for the rules (its report), or with `--fit`
    searches for a layout; returns the exit status."""
    mesh, rules, origin, timer = setup.mesh, setup.rules, setup.origin, setup.timer
    (step, optimizer, batch), seconds = timed(lambda: load_step(args.step))
    timer("load step", seconds, args.step)
    params = eqx.filter(shapes, is_array)
    state = None if optimizer is None else jax.eval_shape(optimizer.init, params)
    batch, split = _placed_batch(batch, mesh)
    shape = ", ".join(
        f"{tuple(x.shape)} {x.dtype}" for x in jtu.tree_leaves(batch) if is_array(x)
    )
    where = f"split over {', '.join(split)}" if split else "replicated"
    print(f"step {args.step}: batch {shape}, {where}")
    budget = options.device_memory
    given = {origin: rules} if (not args.fit or args.rules is not None) else None
    try:
        result, seconds = timed(
            lambda: eqshard.search_layout(
                step,
                shapes,
                state,
                batch,
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
    except Exception as error:  # the step raised while traced
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
