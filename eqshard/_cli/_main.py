"""`python -m eqshard`: eqshard end to end on virtual CPU devices, and a planner.

With no arguments, on 8 virtual CPU devices: build a small Equinox transformer,
derive its specs from regex rules, print the sharding plan, shard the model, run a
few `eqx.filter_jit` training steps that constrain the model and the batch, gather
the model to host, serialise it, load and reshard it, check that nothing changed
(bit for bit), and print a summary with timings.

`--size 70B` plans an abstract model of about that many parameters instead (made
with `eqx.filter_eval_shape`, so nothing is allocated) and prints the plan only.
Run `python -m eqshard --help` for the options.
"""

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import equinox as eqx
import jax
from jax.sharding import Mesh

import eqshard

from .._mesh._current import mesh_repr
from .._mesh._targets import device_memory
from .._spectree._rules_syntax import SPEC_SYNTAX
from ._demo import (
    build,
    builtin_rules,
    checkpoint,
    config_for_size,
    demo_config,
    timed,
    Timer,
    train,
    Transformer,
)
from ._estimate import add_estimate_options, check_estimate_options, run_estimate
from ._fit import (
    add_context_option,
    OPTIMIZERS,
    PlanOptions,
    PROG,
    REPLICATED,
    Setup,
    show_model,
    show_plan,
    training_memory,
)
from ._load import (
    EXIT_DOES_NOT_FIT,
    EXIT_USAGE,
    EXIT_USER_CODE,
    UsageError,
    UserCodeError,
)
from ._rules_file import parse_size, read_rules
from ._step import run_step


_DEFAULT_NAMES = {
    1: ("dp",),
    2: ("dp", "tp"),
    3: ("dp", "fsdp", "tp"),
    4: ("dp", "fsdp", "tp", "sp"),
}


# ---------------------------------------------------------------------------------
# Options.
# ---------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block: `--help` has the usage.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description=(
            "eqshard end to end on virtual CPU devices: build an Equinox "
            "transformer, derive its specs from regex rules, print the plan, shard, "
            "train a few steps under eqx.filter_jit, gather, serialise, reload, "
            "reshard, and check that nothing changed. With --size, plan an "
            "abstract model of that many parameters instead; with --model, plan "
            "your own model: parameters, gradients and optimizer state per "
            "device, against --device-memory (exit status 1 if it does not "
            "fit), and with --fit, rules that make it fit."
        ),
        epilog=(
            "Rules files have one rule a line, 'REGEX SPEC' or 'REGEX -> SPEC' (the "
            "spec is the last field, or all that follows '->'): "
            f"{SPEC_SYNTAX}. This is the spec syntax of "
            "eqshard.compat.create_pattern_based_partition_spec too. "
            "Lines starting with # are comments. The first matching rule wins. "
            "Exit codes: 0 success (the plan fits); 1 the plan does not fit "
            "--device-memory, or nothing --fit tried does (--save-rules then "
            "writes nothing); 2 a bad option, rules file or mesh, or a --model, "
            "--step or --args naming no module, file or callable; 3 your code "
            "raised or called sys.exit (its traceback is summarised)."
        ),
    )
    _what_options(parser)
    _plan_options(parser)
    _run_options(parser)
    return parser


def _what_options(parser: argparse.ArgumentParser) -> None:
    """What the command plans: the mesh, and the model (the demo's, one of
    `--size`, or the user's) and its step."""
    parser.add_argument(
        "--mesh",
        metavar="SPEC",
        help=(
            "mesh axes as name:size pairs, e.g. 'dp:2,tp:4' or 'fsdp:-1' (-1 takes "
            "the remaining devices); 1 to 4 sizes alone name the axes dp / dp,tp / "
            "dp,fsdp,tp / dp,fsdp,tp,sp. Default: dp:2,tp:4 on 8 devices."
        ),
    )
    parser.add_argument(
        "--target",
        metavar="NAME",
        help=(
            "plan and compile for hardware this machine need not have, with its "
            "real compiler: a TPU slice (v5p-1024, v4-128, v5litepod-256, "
            "v5e:2x4) or NVIDIA GPUs (h100, h100:8x8 for 8 hosts of 8, h200, "
            "a100-40g, a100-80g, b200); --device-memory defaults to one of its "
            "devices' memory. Needs eqshard[tpu] or eqshard[gpu]; implies "
            "--plan-only"
        ),
    )
    parser.add_argument(
        "--num-slices",
        type=int,
        default=1,
        metavar="N",
        help="with --target, that many slices over DCN (1)",
    )
    parser.add_argument(
        "--size",
        metavar="N",
        help=(
            "plan an abstract transformer of about N parameters (125M, 1B, 70B) "
            "instead of running the demo; implies --plan-only"
        ),
    )
    add_estimate_options(parser)
    parser.add_argument(
        "--model",
        metavar="MODULE:CALLABLE",
        help=(
            "plan your own model: CALLABLE() returns it (an Equinox module or any "
            "pytree, or an abstract one); it is called under eqx.filter_eval_shape, "
            "so nothing is allocated. MODULE is a module name (mypkg.models) or a "
            "file (models.py). Implies --plan-only; the default rules replicate "
            "everything"
        ),
    )
    parser.add_argument(
        "--step",
        metavar="MODULE:STEP",
        help=(
            "compile your training step as you call it (a function, or an "
            "eqx.filter_jit or eqshard.filter_jit object) with the parameters "
            "laid out by the rules, and print its report; with --fit, choose "
            "the layout by compiling it (eqshard.search_layout). Needs --args"
        ),
    )
    parser.add_argument(
        "--args",
        metavar="MODULE:CALLABLE",
        help=(
            "with --step, CALLABLE() returns the step's arguments as a tuple "
            "(arrays or ShapeDtypeStructs; called under eqx.filter_eval_shape); "
            "an argument holding no parameter, not placed, is split over the "
            "mesh's data axes dp, fsdp, data"
        ),
    )
    parser.add_argument(
        "--params",
        metavar="SELECTOR",
        help=(
            "with --step, which part of the arguments is the parameters: an "
            "index (default 0) or a dotted path such as 1.0 (the model of a "
            "(model, opt_state) second argument)"
        ),
    )


def _plan_options(parser: argparse.ArgumentParser) -> None:
    """What the plan counts, against what memory, and `--fit`."""
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        help=(
            "the optax optimizer whose state the plan counts, with the gradients "
            "(default adamw; sgd has no state; none plans the parameters alone); "
            "with --step, the step's own optimizer counts"
        ),
    )
    parser.add_argument(
        "--param-dtype",
        metavar="DTYPE",
        help=(
            "dtype of the floating-point parameters and their gradients: float32, "
            "bfloat16 or float16 (default: the model's own)"
        ),
    )
    parser.add_argument(
        "--state-dtype",
        metavar="DTYPE",
        help=(
            "dtype of the optimizer state's floating-point arrays, e.g. float32 "
            "moments with --param-dtype bfloat16 (default: what optax makes)"
        ),
    )
    parser.add_argument(
        "--device-memory",
        metavar="BYTES",
        help=(
            "memory of one device, e.g. 80GiB, 16GB: the plan says whether it fits "
            "and the exit status is 1 if it does not"
        ),
    )
    parser.add_argument(
        "--fit",
        action="store_true",
        help=(
            "propose rules that fit --device-memory: the --rules given (or "
            "replicated) plus automatic FSDP over the mesh's data axes (dp, fsdp); "
            "print them and their plan"
        ),
    )
    parser.add_argument(
        "--pipeline",
        metavar="SCHEDULE",
        help=(
            "plan for eqshard.pipeline: microbatches=M,activation=ROWSxDxD... (one "
            "microbatch's activation) and optionally dtype=, spec=AXIS (its rows' "
            "axes, joined by +), axis= (pp), schedule= (gpipe, circular), repeats=, "
            "fsdp_gather= (per_step, once, per_repeat) with layers=L,layer_bytes=N "
            "(one layer's weights gathered on a device); the plan adds the stage "
            "inputs and buffers the schedule keeps, and the weights it gathers"
        ),
    )
    add_context_option(parser)
    parser.add_argument(
        "--save-rules",
        metavar="FILE",
        help=(
            "with --fit, also write the proposed rules to FILE (a --rules file) if "
            "they fit; never the --rules, --model, --step or --args file, and it says "
            "when it replaces a file"
        ),
    )
    parser.add_argument(
        "--table",
        action="store_true",
        help="full tables: every array (repeated layers share a row otherwise)",
    )


def _run_options(parser: argparse.ArgumentParser) -> None:
    """The rules, and how the demo runs."""
    parser.add_argument(
        "--rules",
        metavar="FILE",
        help="partition rules, one 'REGEX SPEC' a line (default: the built-in ones)",
    )
    parser.add_argument(
        "--plan-only", action="store_true", help="print the plan, move nothing"
    )
    parser.add_argument(
        "--steps", type=int, default=5, metavar="N", help="training steps (5)"
    )
    parser.add_argument(
        "--devices",
        type=int,
        metavar="N",
        help="number of virtual CPU devices (8); not with --target",
    )


def _default_mesh_string(devices: int) -> str:
    tp = next(size for size in (4, 2, 1) if devices % size == 0)
    return f"dp:{devices // tp},tp:{tp}"


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def build_mesh(text: str) -> Mesh:
    """A mesh from `--mesh`, through `eqshard.create_mesh`."""
    body = text.strip().removeprefix("!")
    names = None
    if ":" not in body:
        names = _DEFAULT_NAMES.get(len(body.split(",")), ())
        if not names:
            raise UsageError(
                f"--mesh {text!r}: give at most 4 sizes without names, or name the "
                "axes, e.g. dp:2,tp:4"
            )
    try:
        return eqshard.create_mesh(text, names)
    except (ValueError, TypeError) as error:
        raise UsageError(f"--mesh {text!r}: {_one_line(error)}") from None


# ---------------------------------------------------------------------------------
# The command.
# ---------------------------------------------------------------------------------


def run(
    args: argparse.Namespace,
    size: int | None,
    mesh: Mesh,
    rules: list[tuple[str, Any]],
    origin: str,
    start: float,
) -> int:
    """Plans (`--size`, `--model`, `--plan-only`), or runs the whole demo; returns
    the exit status."""
    timer = Timer()
    setup = Setup(mesh, rules, origin, timer)
    # --model, --size, --fit and --device-memory plan; they imply --plan-only.
    planning = args.plan_only or size is not None or args.model is not None
    planning = planning or args.step is not None
    planning = planning or args.fit or args.device_memory is not None
    planning = planning or args.context is not None
    options = PlanOptions.from_args(args) if planning else None
    platform = jax.default_backend()
    kind = "virtual CPU" if platform == "cpu" else platform
    where = f"on {jax.device_count()} {kind} devices"
    if args.target is not None:
        first = mesh.devices.flat[0]
        where = (
            f"for --target {args.target}: {mesh.devices.size} {first.device_kind} "
            "(compile-only)"
        )
    print(f"eqshard {eqshard.__version__} {where}, mesh {mesh_repr(mesh)}")
    if options is not None and args.step is not None:
        return run_step(args, setup, options)
    if size is not None and args.batch is not None:
        return run_estimate(args, size, mesh)
    if options is not None and args.model is not None:
        shapes, specs = show_model(args, setup)
        return training_memory(shapes, specs, setup, options)
    key = jax.random.key(0)
    config = demo_config(mesh) if size is None else config_for_size(size, mesh)
    if options is not None:
        shapes, seconds = timed(
            lambda: eqx.filter_eval_shape(Transformer, config, key=key)
        )
        print(f"abstract model built with eqx.filter_eval_shape in {seconds:.2f} s")
        print()
        specs = show_plan(shapes, config, setup, full=args.table)
        return training_memory(shapes, specs, setup, options)

    shapes, seconds = timed(lambda: eqx.filter_eval_shape(Transformer, config, key=key))
    timer("abstract model", seconds, "eqx.filter_eval_shape")
    print()
    specs = show_plan(shapes, config, setup, full=args.table)
    print()

    # Built under `jit` straight into the shardings, with its optimizer state
    # (whose specs are the model's): no device holds a whole sharded array.
    state_specs = (specs, {"momentum": specs})
    state = build(config, state_specs, mesh, timer)
    state = train(state, state_specs, mesh, args.steps, timer)
    checkpoint(state, state_specs, mesh, config=config, timer=timer)
    print()
    print(timer.summary(time.perf_counter() - start))
    return 0


def _check_target_options(args: argparse.Namespace) -> None:
    """`--target` plans a model for hardware that is not here: no demo, no
    virtual devices."""
    if args.target is None:
        if args.num_slices != 1:
            raise UsageError("--num-slices counts a --target's slices: give --target")
        args.devices = 8 if args.devices is None else args.devices
        return
    if args.devices is not None:
        raise UsageError(
            f"--devices {args.devices} sets this machine's virtual devices; "
            f"--target {args.target} brings its own: leave --devices out"
        )
    if args.size is None and args.model is None and args.step is None:
        raise UsageError(
            f"--target {args.target} plans a model for that hardware (nothing runs "
            "on it): give --size, --model or --step"
        )
    args.devices, args.plan_only = 1, True


def _target_mesh(args: argparse.Namespace) -> Mesh:
    """The mesh of `--mesh` (default `fsdp:-1`) over `--target`'s compile-only
    devices; `--device-memory` defaults to one device's memory."""
    text = "fsdp:-1" if args.mesh is None else args.mesh
    names = None
    if ":" not in text:
        names = _DEFAULT_NAMES.get(len(text.split(",")), ())
    try:
        mesh = eqshard.create_mesh(
            text, names, target=args.target, num_slices=args.num_slices
        )
    except ImportError as error:
        raise UsageError(f"--target {args.target}: {_one_line(error)}") from None
    except (ValueError, TypeError) as error:
        raise UsageError(f"--target {args.target}: {_one_line(error)}") from None
    memory = device_memory(list(mesh.devices.flat))
    if args.device_memory is None and memory is not None:
        args.device_memory = str(memory)
    return mesh


def _check_step_options(args: argparse.Namespace) -> None:
    if args.step is None:
        for option, value in (("--args", args.args), ("--params", args.params)):
            if value is not None:
                raise UsageError(f"{option} gives the arguments of --step: give --step")
        return
    if args.args is None:
        raise UsageError(
            "--step needs its arguments: give --args MODULE:CALLABLE, a function "
            "returning them as a tuple"
        )
    if args.model is not None or args.size is not None:
        raise UsageError(
            "--step takes its parameters from --args (--params picks them): leave "
            f"{'--model' if args.model is not None else '--size'} out"
        )
    for option, value in (
        ("--optimizer", args.optimizer),
        ("--param-dtype", args.param_dtype),
        ("--state-dtype", args.state_dtype),
    ):
        if value is not None:
            raise UsageError(
                f"{option} plans the parameters without a step; with --step the "
                "step is compiled with the dtypes and the optimizer state of its "
                f"arguments: leave {option} out"
            )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; returns the exit code: 0, 1 when a plan does not fit
    (or the reader of the output went away), 2 for a bad option, 3 when the
    user's model or step raised."""
    start = time.perf_counter()
    args = _parser().parse_args(argv)
    try:
        if args.steps < 0:
            raise UsageError(f"--steps {args.steps}: give 0 or more steps")
        _check_target_options(args)
        if args.devices < 1:
            raise UsageError(f"--devices {args.devices}: give at least 1 device")
        size = None if args.size is None else parse_size(args.size)
        if args.model is not None and args.size is not None:
            raise UsageError(
                "--model plans your model, --size the built-in one: give one"
            )
        _check_step_options(args)
        check_estimate_options(args)
        if args.rules is None:
            user_rules, origin = None, "built-in"
        else:
            user_rules, origin = read_rules(args.rules), f"--rules {args.rules}"
        # Before any JAX computation: the platform and the number of devices.
        if "JAX_PLATFORMS" not in os.environ:
            jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
        # An empty --mesh is an error, not the default.
        if args.target is not None:
            mesh = _target_mesh(args)
        elif args.mesh is None:
            mesh = build_mesh(_default_mesh_string(jax.device_count()))
        else:
            mesh = build_mesh(args.mesh)
        if user_rules is not None:
            rules = user_rules
        elif args.model is not None or args.step is not None:
            rules, origin = REPLICATED, "the default rule '.* ()' (all replicated)"
        else:
            rules = builtin_rules(mesh)
        status = run(args, size, mesh, rules, origin, start)
    except UsageError as error:
        sys.stdout.flush()
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except UserCodeError as error:
        sys.stdout.flush()
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_USER_CODE
    except BrokenPipeError:
        # The reader went away (`python -m eqshard --size 70B | head`): stop
        # quietly, and keep Python from failing again when it flushes stdout.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_DOES_NOT_FIT
    return status
