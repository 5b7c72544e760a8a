"""The command's planner for the user's own model: load it abstractly, name an
optimizer, and propose partition rules that fit a per-device budget.

`python -m eqshard --model MODULE:CALLABLE` goes: `load_model` (the callable under
`eqx.filter_eval_shape`: nothing is allocated) -> the user's rules -> a
`plan_training` against `--device-memory`. With `--fit`, `propose_rules` adds
`auto_fsdp` over the mesh's data axes to every rule, lowering its size threshold
until the plan fits, and `rules_text` writes the specs it chose as a rules file
(one line per group of arrays that differ only in layer numbers).

The plans the command prints live here too: `show_plan` (the table of where each
array goes, and the checks that every spec can apply), `training_memory` (the
per-device plan of parameters, gradients and optimizer state, or `--fit`'s rules).
The user's code is loaded by `_load.py`.
"""

import argparse
import dataclasses
import functools as ft
import os
import pathlib
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.sharding import AbstractMesh, Mesh, PartitionSpec
from jaxtyping import PyTree

import eqshard

from .._mesh._current import mesh_repr
from .._readers._plan import TrainingPlan
from .._readers._plan_context import context_from_text
from .._readers._plan_pipeline import pipeline_from_text
from .._report import format_bytes, parse_bytes
from .._search._candidates import rules_text
from .._spectree._auto import auto_fsdp
from .._spectree._memory import follower_rules_text, Host, map_layout, offloads
from .._spectree._rules import match_partition_rules, NoRuleMatchesError
from .._tree import is_array
from ._demo import Config, timed, Timer
from ._load import import_target, UsageError, user_code_error, USER_ERRORS


PROG = "python -m eqshard"
OPTIMIZERS = ("adamw", "adam", "sgd", "lion", "adafactor", "none")
# The size thresholds `propose_rules` tries, largest first: arrays below it stay
# replicated, which costs memory but no communication.
THRESHOLDS = (2**20, 2**14, 0)


def load_model(text: str) -> PyTree:
    """The abstract model `MODULE:CALLABLE` (or `path/to/file.py:CALLABLE`) makes:
    the callable is called with no arguments under `eqx.filter_eval_shape`, so
    nothing is allocated; it may return a module or an abstract one."""
    fn = import_target(text, "--model")
    try:
        shapes = eqx.filter_eval_shape(fn)  # nothing allocated
    except USER_ERRORS as error:  # the user's code
        raise user_code_error(f"--model {text!r}: calling it", error) from None
    if not any(is_array(leaf) for leaf in jtu.tree_leaves(shapes)):
        raise ValueError(f"--model {text!r}: the model it returns has no arrays")
    return shapes


def make_optimizer(name: str) -> Any:
    """The optax optimizer of that name (learning rate 1e-4; the rate does not
    change the memory), or `None` for `"none"`."""
    if name == "none":
        return None
    try:
        import optax
    except ImportError:
        raise ValueError(
            f"--optimizer {name}: planning an optimizer's state needs optax "
            "(`pip install optax`); or pass --optimizer none to plan without one"
        ) from None
    makers: dict[str, Callable[[], Any]] = {
        "adamw": lambda: optax.adamw(1e-4),
        "adam": lambda: optax.adam(1e-4),
        "sgd": lambda: optax.sgd(1e-4),
        "lion": lambda: optax.lion(1e-4),
        "adafactor": lambda: optax.adafactor(1e-4),
    }
    if name not in makers:
        raise ValueError(f"--optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    return makers[name]()


def data_axes(mesh: Mesh | AbstractMesh) -> tuple[str, ...]:
    """The mesh's data axes, which FSDP shards parameters over."""
    return tuple(a for a in mesh.axis_names if a in ("data", "dp", "fsdp"))


def fsdp_rules(
    rules: Sequence[tuple[Any, Any]],
    mesh: Mesh | AbstractMesh,
    axes: tuple[str, ...],
    min_size: int,
) -> list[tuple[Any, Any]]:
    """`rules` with FSDP over `axes` added to each spec, and a last rule that
    shards whatever they leave out."""
    for regex, value in rules:
        layout = value.spec if isinstance(value, Host) else value
        if not isinstance(layout, PartitionSpec) and value != Host(None):
            raise ValueError(
                f"--fit adds FSDP to each rule's spec, but the rule {regex!r} has "
                f"{value!r}; write that rule's spec for the whole array (as "
                "P(None, 'tp', None)), or leave --fit out"
            )
    fsdp = ft.partial(auto_fsdp, axes, min_size=min_size, mesh=mesh)
    out = [(regex, map_layout(spec, lambda s: fsdp(base=s))) for regex, spec in rules]
    out.append((".*", fsdp()))
    return out


def propose_rules(
    shapes: PyTree,
    rules: Sequence[tuple[Any, Any]],
    mesh: Mesh | AbstractMesh,
    plan: Callable[[PyTree], TrainingPlan],
) -> tuple[PyTree, TrainingPlan, int]:
    """The specs of `rules` plus FSDP over the mesh's data axes, with the largest
    size threshold (in `THRESHOLDS`) whose plan fits, else the smallest; returns
    the specs, their plan and the threshold."""
    axes = data_axes(mesh)
    if not axes:
        raise ValueError(
            f"--fit adds FSDP over the mesh's data axes ('dp', 'fsdp' or 'data'), "
            f"but the mesh {mesh_repr(mesh)} has none; add one to --mesh"
        )
    tried = []
    for min_size in THRESHOLDS:
        fitted = fsdp_rules(rules, mesh, axes, min_size)
        specs = match_partition_rules(fitted, shapes)
        tried.append((specs, plan(fitted if offloads(rules) else specs), min_size))
        if tried[-1][1].fits:
            break
    return tried[-1]


# ---------------------------------------------------------------------------------
# The plans the command prints.
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the steps of the command read: the mesh, the rules and where they
    come from (for messages), and the timer of the summary."""

    mesh: Mesh
    rules: list[tuple[str, Any]]  # a rules file's: specs, stacked(...)
    origin: str
    timer: Timer


def _match(rules: list[tuple[str, Any]], tree: PyTree, origin: str) -> PyTree:
    try:
        return eqshard.match_partition_rules(rules, tree)
    except (ValueError, TypeError) as error:
        lines = str(error).splitlines()
        hint = ""
        if isinstance(error, NoRuleMatchesError):
            hint = " (a last rule '.*  ()' replicates the rest)"
        summary = " ".join(line.strip() for line in lines[:2])
        raise UsageError(f"{origin}: {summary}{hint}") from None


# ---------------------------------------------------------------------------------
# Output.
# ---------------------------------------------------------------------------------


def _matched(tree: PyTree, setup: Setup) -> PyTree:
    """The specs the rules give `tree`, timed."""
    rules, origin = setup.rules, setup.origin
    specs, seconds = timed(lambda: _match(rules, tree, origin))
    setup.timer("match rules", seconds, f"{len(rules)} rules ({origin})")
    return specs


def _check_plan(report: eqshard.ShardingReport) -> None:
    if report.problems:
        first = report.problems[0]
        count = len(report.problems)
        raise UsageError(
            f"{count} {'array has a spec' if count == 1 else 'arrays have specs'} "
            f"that cannot apply on mesh "
            f"{report.mesh_shape} (listed under the plan), e.g. '{first.path}' "
            f"{first.spec}: {first.reasons[0]}; fix the rules or the mesh"
        )


def show_plan(
    tree: PyTree, config: Config, setup: Setup, *, full: bool = False
) -> PyTree:
    """Matches the rules, prints the plan of `tree` (concrete or abstract), and
    returns the specs. A plan that cannot apply is a usage error. The table groups
    repeated layers' arrays (`blocks/*/attn/q/weight  x80`); `full` (`--table`)
    lists every array."""
    mesh, rules, timer = setup.mesh, setup.rules, setup.timer
    specs = _matched(tree, setup)
    report, seconds = timed(
        lambda: eqshard.analyze_sharding_strategy(tree, specs, mesh)
    )
    timer("plan", seconds, "analyze_sharding_strategy")
    print(report.table(group=not full))
    print()
    print(
        f"model: {config.layers} blocks, dim {config.dim}, {config.heads} heads, "
        f"vocab {config.vocab}: {report.total_parameters:,} parameters in "
        f"{len(report.rows)} arrays"
    )
    print(
        f"plan: at most {format_bytes(report.max_bytes_per_device)} per device "
        f"(balance {report.balance_score:.2f}) over the "
        f"{len(report.bytes_per_device)} devices of mesh {report.mesh_shape}"
    )
    _note_dead_rules(rules, tree)
    _check_plan(report)
    return specs


def _note_dead_rules(rules: list[tuple[str, Any]], tree: PyTree) -> None:
    dead = eqshard.explain_partition_rules(rules, tree).dead_rules
    dead = [i for i in dead if not isinstance(rules[i][1], Host)]  # state's rules
    if dead:
        listed = ", ".join(f"{i} {rules[i][0]!r}" for i in dead)
        print(
            f"note: {len(dead)} of the {len(rules)} rules matched no array (a typo, "
            f"or shadowed by an earlier rule): {listed}"
        )


# ---------------------------------------------------------------------------------
# Training-memory plans (--size, --model, --plan-only) and --fit.
# ---------------------------------------------------------------------------------


_DTYPES = {
    "float32": jnp.float32,
    "f32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float16": jnp.float16,
    "f16": jnp.float16,
    "fp16": jnp.float16,
}
# The rules of --model when no --rules are given: everything replicated.
REPLICATED = [(".*", PartitionSpec())]


def _dtype(option: str, text: str | None) -> Any:
    if text is None:
        return None
    try:
        return _DTYPES[text.lower()]
    except KeyError:
        raise UsageError(
            f"{option} {text!r}: choose float32, bfloat16 or float16"
        ) from None


def add_context_option(parser: argparse.ArgumentParser) -> None:
    """`--context`: the plan counts context-parallel attention's buffers."""
    parser.add_argument(
        "--context",
        metavar="ATTENTION",
        help=(
            "plan for eqshard.dot_product_attention with the sequence split over a "
            "mesh axis: query=BxTxNxH (global) and optionally axis= (cp), "
            "strategy= (ring, all_gather, ulysses), kv_heads=, dtype=, batch=AXIS "
            "(joined by +; default the mesh's dp, fsdp, data), activation=BxTxD and "
            "layers= (the activations kept); the plan adds the attention's buffers"
        ),
    )


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """The options of a training-memory plan, checked."""

    optimizer: Any
    optimizer_name: str
    param_dtype: Any
    state_dtype: Any
    device_memory: int | None
    fit: bool
    save_rules: str | None
    pipeline: dict[str, Any] | None = None
    context: dict[str, Any] | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "PlanOptions":
        memory = None
        if args.device_memory is not None:
            try:
                memory = parse_bytes(args.device_memory)
            except ValueError:
                raise UsageError(
                    f"--device-memory {args.device_memory!r}: write an amount of "
                    "memory such as 80GiB, 16GB or 512MiB"
                ) from None
        if args.fit and memory is None:
            raise UsageError("--fit needs --device-memory, the budget to fit in")
        if args.save_rules is not None and not args.fit:
            raise UsageError("--save-rules writes the rules that --fit proposes")
        if args.save_rules is not None:
            _check_not_an_input(args.save_rules, args)
        text = getattr(args, "pipeline", None)
        attention = getattr(args, "context", None)
        try:
            optimizer = make_optimizer(args.optimizer or "adamw")
            pipeline = None if text is None else pipeline_from_text(text, _DTYPES)
            context = (
                None if attention is None else context_from_text(attention, _DTYPES)
            )
        except ValueError as error:
            raise UsageError(str(error)) from None
        return cls(
            optimizer=optimizer,
            optimizer_name=args.optimizer or "adamw",
            param_dtype=_dtype("--param-dtype", args.param_dtype),
            state_dtype=_dtype("--state-dtype", args.state_dtype),
            device_memory=memory,
            fit=args.fit,
            save_rules=args.save_rules,
            pipeline=pipeline,
            context=context,
        )


def _plan_for(
    shapes: PyTree, mesh: Mesh, options: PlanOptions
) -> Callable[[PyTree], eqshard.TrainingPlan]:
    def plan(specs: PyTree) -> eqshard.TrainingPlan:
        try:
            return eqshard.plan_training(
                shapes,
                specs,
                mesh,
                optimizer=options.optimizer,
                param_dtype=options.param_dtype,
                state_dtype=options.state_dtype,
                device_memory=options.device_memory,
                pipeline=options.pipeline,
                context=options.context,
            )
        except ValueError as error:
            for option in ("pipeline", "context"):
                if f"`{option}`" in str(error):
                    raise UsageError(f"--{option}: {error}") from None
            raise

    return plan


def _print_plan(plan: eqshard.TrainingPlan) -> None:
    if sys.stdout.isatty():
        sys.stdout.flush()
        plan.show()  # with rich, if installed
    else:
        print(plan.table())


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return pathlib.Path(a).resolve() == pathlib.Path(b).resolve()


def _check_not_an_input(path: str, args: argparse.Namespace) -> None:
    """Refuses a `--save-rules` file that the command reads: the `--rules` file,
    or the file of `--model`, `--step` or `--args`."""
    inputs = [("--rules", args.rules)]
    named = (("--model", args.model), ("--step", args.step), ("--args", args.args))
    for option, text in named:
        module = (text or "").rpartition(":")[0]
        if module.endswith(".py") or "/" in module:
            inputs.append((option, module))
    for option, given in inputs:
        if given is not None and _same_file(path, given):
            raise UsageError(
                f"--save-rules {path}: that is the file of {option} {given}, which "
                "the command reads; it is never replaced. Save the proposed rules "
                "to another file"
            )


def _write(path: str, text: str) -> None:
    """Writes `text` to `path`: a regular file is replaced whole (a new file,
    renamed over it), so that a failed write keeps the old one; anything else
    (`/dev/stdout`) is written in place."""
    real = os.path.realpath(path)
    if os.path.exists(real) and not os.path.isfile(real):
        with open(real, "w") as file:
            file.write(text)
        return
    folder, name = os.path.split(real)
    handle, staged = tempfile.mkstemp(prefix=f".{name}.", suffix=".new", dir=folder)
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        if os.path.exists(real):
            mode = os.stat(real).st_mode & 0o7777
        else:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(staged, mode)
        os.replace(staged, real)
    except BaseException:
        os.unlink(staged)
        raise


def save_rules(path: str | None, text: str, *, fits: bool) -> None:
    """Writes `--save-rules`' file when the rules fit, and says what it did:
    saved, saved over a file that was there, or not saved."""
    if path is None:
        return
    existed = os.path.lexists(path)
    if not fits:
        kept = "; the file there is kept as it was" if existed else ""
        print(f"not saved to {path}: --save-rules saves only rules that fit{kept}")
        print()
        return
    try:
        _write(path, text)
    except OSError as error:
        raise UsageError(
            f"--save-rules {path}: cannot write the file ({error.strerror or error})"
        ) from None
    print(f"saved to {path}" + (", replacing the file there" if existed else ""))
    print()


def training_memory(
    shapes: PyTree, specs: PyTree, setup: Setup, options: PlanOptions
) -> int:
    """Prints the training-memory plan of `specs`, or with --fit the rules
    proposed and their plan; returns the exit status (1 if it does not fit)."""
    mesh, rules, origin, timer = setup.mesh, setup.rules, setup.origin, setup.timer
    what = "parameters and gradients"
    if options.optimizer is not None:
        what += f", {options.optimizer_name} state"
    plan_for = _plan_for(shapes, mesh, options)
    print()
    if not options.fit:
        plan, seconds = timed(lambda: plan_for(rules if offloads(rules) else specs))
        timer("training plan", seconds, what)
        _print_plan(plan)
        return 0 if plan.fits else 1
    try:
        (specs, plan, min_size), seconds = timed(
            lambda: propose_rules(shapes, rules, mesh, plan_for)
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    timer("fit", seconds, f"rules + auto_fsdp, {what}")
    axes = ", ".join(data_axes(mesh))
    header = [
        f"proposed by `{PROG} --fit` for mesh {mesh_repr(mesh)} and "
        f"{format_bytes(options.device_memory or 0)} per device:",
        f"from {origin}, plus FSDP over {axes} for arrays of at least "
        f"{min_size:,} elements (eqshard.auto_fsdp).",
    ]
    text = rules_text(shapes, specs, header=header) + follower_rules_text(rules)
    if plan.fits:
        print("rules that fit (a --rules file):")
    else:
        print(
            "no rules fit: even with FSDP over the data axes on every array, the "
            "plan below is over budget. Use more devices, a larger data axis, or "
            "a smaller --param-dtype / --state-dtype. The closest rules:"
        )
    print(text)
    save_rules(options.save_rules, text, fits=plan.fits)
    _print_plan(plan)
    return 0 if plan.fits else 1


def show_model(args: argparse.Namespace, setup: Setup) -> tuple[PyTree, PyTree]:
    """Loads the user's own model (`--model`) abstractly, prints what it holds
    and checks that the rules apply; returns it and its specs."""
    mesh, rules, origin, timer = setup.mesh, setup.rules, setup.origin, setup.timer
    try:
        shapes, load_seconds = timed(lambda: load_model(args.model))
    except ValueError as error:
        raise UsageError(str(error)) from None
    timer("load model", load_seconds, "eqx.filter_eval_shape")
    specs = _matched(shapes, setup)
    report = eqshard.analyze_sharding_strategy(shapes, specs, mesh)
    if args.table:
        print(report.table(group=False))
        print()
    print(
        f"model {args.model}: {report.total_parameters:,} parameters in "
        f"{len(report.rows)} arrays, made abstractly with eqx.filter_eval_shape in "
        f"{load_seconds:.2f} s"
    )
    print(f"rules: {origin}")
    _note_dead_rules(rules, shapes)
    _check_plan(report)
    return shapes, specs
