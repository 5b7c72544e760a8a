"""How each backend spells a collective in a program read by `_text`, and
whether its schedule overlaps it with computation.

The forms (JAX 0.10.2):

- **Plain ops** (`all-gather(`, CPU and TPU; TPU's `async_collective_name`
  attribute names an async pair XLA made synchronous again): one collective
  each, synchronous.
- **Async pairs** `all-gather-start`/`-done` (GPU; also TPU's permutes) and
  `async-start(...), calls=%c`/`async-done` (the collective inside `%c`): one
  collective each, at its start. A GPU start may combine several arrays into
  one tuple-shaped op (`_graph` keeps each array's data apart).
- **TPU async fusions**: a fusion (`kind=kCustom`) whose computation ends in
  `custom-call(%all-gather.3), custom_call_target="AsyncCollectiveStart"`
  starts the collective; a fusion ending in `AsyncCollectiveDone` finishes it;
  the fusions the schedule places between (`%async_collective_fusion`, the
  matmul that overlaps it) carry clones of the collective, with the same
  `channel_id`. Only the started one counts (`Forms.skipped` holds the others).
- **TPU all-reduce-scatter fusions** (`calls=%all-reduce-scatter.2`, emitter
  `AllReduceScatterFusion`): a full `all-reduce`, then each device's block
  (`partition-id`, `dynamic-slice`). One reduce-scatter, whose arrays are the
  fusion's results (the scattered blocks); the `all-reduce` inside does not count.
- **Kernels** (Pallas/Mosaic `custom-call`s): opaque; whatever they send is not
  in the text (`KERNELS`).

Overlap (`overlapped`): `False` for a plain op, or a start whose
`backend_config` says `"is_sync":true`; for an async pair, whether the schedule
(the text's order) places computation between the start and its done (a
transfer between slices, `send`/`recv`, computes nothing); `None`
when the done is not found in the start's computation (a loop that carries it
across iterations).
"""

import dataclasses
import re

from ._graph import DONES, KINDS, STARTS
from ._text import BadLine, callees, Computation, Instruction, Module


ASYNC_START = "AsyncCollectiveStart"
ASYNC_DONE = "AsyncCollectiveDone"
# Pallas and Mosaic kernels (TPU's Mosaic, GPU's Triton and Mosaic GPU).
KERNELS = {"tpu_custom_call", "__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2"}
# Custom-call targets that name a collective; those not read here are errors.
_COLLECTIVE_TARGET = re.compile(
    r"collective|all[-_]?gather|all[-_]?reduce|reduce[-_]?scatter|all[-_]?to[-_]?all"
    r"|nccl|nvshmem",
    re.IGNORECASE,
)
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_CHANNEL = re.compile(r"(?:^|,)\s*channel_id=(\d+)")
_SYNC = re.compile(r'"is_sync"\s*:\s*true')
# Ops that compute nothing: what the schedule places between a start and its
# done that does not overlap it.
_IDLE = (
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "copy-start",
        "copy-done",
        "opt-barrier",
        "add-dependency",
        "after-all",
        "partition-id",
        "replica-id",
        "async-update",
        "send",
        "recv",
        "send-done",
        "recv-done",
    }
    | set(STARTS)
    | DONES
    | {"async-start"}
)


def target(instruction: Instruction) -> str:
    """A custom-call's `custom_call_target` (`""` for other ops)."""
    if instruction.opcode != "custom-call":
        return ""
    found = _TARGET.search(instruction.rest)
    return "" if found is None else found[1]


def channel(instruction: Instruction) -> str | None:
    found = _CHANNEL.search(instruction.rest)
    return None if found is None else found[1]


def is_collective(instruction: Instruction) -> bool:
    return instruction.opcode in KINDS or instruction.opcode in STARTS


def unknown_collective_target(instruction: Instruction) -> str | None:
    """The target of a custom-call that names a collective this reader does not
    read (`None` for any other instruction)."""
    name = target(instruction)
    if not name or name in (ASYNC_START, ASYNC_DONE) or name in KERNELS:
        return None
    return name if _COLLECTIVE_TARGET.search(name) else None


def _root_target(computation: Computation) -> str:
    return target(computation.instructions[computation.root])


def is_scatter_fusion(module: Module, instruction: Instruction) -> bool:
    """A TPU all-reduce-scatter fusion: a full all-reduce, then each device's
    block."""
    if instruction.opcode != "fusion":
        return False
    if "AllReduceScatterFusion" in instruction.rest:
        return True
    (callee,) = callees(instruction)
    return callee.startswith("all-reduce-scatter") and any(
        i.opcode == "all-reduce" for i in module.computations[callee].instructions
    )


@dataclasses.dataclass
class Forms:
    """The collectives of a program that do not count on their own, and where
    the TPU async fusions start."""

    # (computation, position) of the collective instructions that are parts of
    # another row: clones in a TPU async pair, an all-reduce-scatter's inside.
    skipped: set[tuple[str, int]]
    # The computation of each TPU start fusion or async-start -> its call sites
    # (computation, position of the fusion or async-start).
    starts: dict[str, list[tuple[str, int]]]


def _chains(module: Module, computation: Computation, forms: Forms) -> set[str]:
    """The computations of the fusions of `computation` that continue an async
    chain started there: fed (through `get-tuple-element`) by a TPU start
    fusion or by a fusion that continues one. Records the starts in `forms`."""
    chained: set[str] = set()  # instructions that carry a chain's state
    clones: set[str] = set()
    for position, instruction in enumerate(computation.instructions):
        fed = any(operand in chained for operand in instruction.operands)
        if instruction.opcode == "get-tuple-element" and fed:
            chained.add(instruction.name)
        if instruction.opcode == "async-start":
            forms.starts.setdefault(callees(instruction)[0], []).append(
                (computation.name, position)
            )
        if instruction.opcode != "fusion":
            continue
        (callee,) = callees(instruction)
        inside = module.computations[callee]
        if _root_target(inside) == ASYNC_START:
            forms.starts.setdefault(callee, []).append((computation.name, position))
            chained.add(instruction.name)
        elif is_scatter_fusion(module, instruction):
            forms.skipped.update(
                (callee, k)
                for k, i in enumerate(inside.instructions)
                if is_collective(i)
            )
        elif fed and any(map(is_collective, inside.instructions)):
            chained.add(instruction.name)
            clones.add(callee)
    return clones


def read_forms(module: Module, order: list[str]) -> Forms:
    """The TPU async fusions and all-reduce-scatter fusions of the computations
    of `order`. Raises `BadLine` for a done whose collective nobody started.

    A start fusion's clones are the collectives of the fusions its state flows
    through to its done (its chain), whatever their channel ids: XLA reuses a
    channel id for other collectives (a peeled loop iteration's plain ops). A
    fusion that the chain reaches only across a loop's iterations is matched by
    channel id; a collective outside any fusion is never a clone."""
    forms = Forms(set(), {})
    started: set[str] = set()  # channel ids of started collectives
    clones: set[str] = set()  # computations of the fusions of a chain
    fused: set[str] = set()  # computations that fusions call
    for name in order:
        computation = module.computations[name]
        if _root_target(computation) == ASYNC_START:
            started.update(
                c for i in computation.instructions if (c := channel(i)) is not None
            )
        clones |= _chains(module, computation, forms)
        fused.update(
            callees(i)[0] for i in computation.instructions if i.opcode == "fusion"
        )
    for name in order:
        computation = module.computations[name]
        root = _root_target(computation)
        if root == ASYNC_START or (name not in clones and name not in fused):
            continue
        for position, instruction in enumerate(computation.instructions):
            if not is_collective(instruction):
                continue
            if name in clones or channel(instruction) in started:
                forms.skipped.add((name, position))
            elif root == ASYNC_DONE:
                raise BadLine(
                    "an AsyncCollectiveDone whose collective no "
                    "AsyncCollectiveStart starts",
                    instruction.line,
                )
    return forms


def _computes(module: Module, instruction: Instruction) -> bool:
    """Whether an instruction computes (a fusion of only moves does not, nor a
    TPU async fusion's start or done)."""
    if instruction.opcode not in ("fusion", "call"):
        return instruction.opcode not in _IDLE
    callee = module.computations[callees(instruction)[0]]
    if _root_target(callee) in (ASYNC_START, ASYNC_DONE):
        return False
    return any(i.opcode not in _IDLE for i in callee.instructions)


def computes_between(
    module: Module, computation: Computation, start: int, done: int
) -> bool:
    """Whether an op between positions `start` and `done` computes."""
    return any(
        _computes(module, computation.instructions[k]) for k in range(start + 1, done)
    )


def _done_of(computation: Computation, position: int) -> int | None:
    """The position of the done of the async start at `position` (through
    `async-update`s), in the same computation."""
    names = {computation.instructions[position].name}
    for k in range(position + 1, len(computation.instructions)):
        instruction = computation.instructions[k]
        if not instruction.operands or instruction.operands[0] not in names:
            continue
        if instruction.opcode == "async-update":
            names.add(instruction.name)
        elif instruction.opcode in DONES:
            return k
    return None


def _fusion_done_of(
    module: Module, computation: Computation, position: int, channels: set[str]
) -> int | None:
    """The position of the TPU done fusion finishing the collective of
    `channels` started by the fusion at `position`."""
    for k in range(position + 1, len(computation.instructions)):
        instruction = computation.instructions[k]
        if instruction.opcode != "fusion":
            continue
        callee = module.computations[callees(instruction)[0]]
        if _root_target(callee) == ASYNC_DONE and any(
            channel(i) in channels for i in callee.instructions if is_collective(i)
        ):
            return k
    return None


def overlapped(
    module: Module, computation: Computation, position: int, forms: Forms
) -> bool | None:
    """Whether the schedule overlaps the collective at `position` of
    `computation` with computation: `False` for a plain op or a start that XLA
    marks `is_sync`, `None` where its done is not in the same computation."""
    instruction = computation.instructions[position]
    sites = forms.starts.get(computation.name)
    if sites is not None:  # inside a TPU start fusion or an async-start
        found = {_site_overlap(module, name, site, instruction) for name, site in sites}
        return found.pop() if len(found) == 1 else None
    if instruction.opcode not in STARTS:
        return False
    if _SYNC.search(instruction.rest):
        return False
    done = _done_of(computation, position)
    return (
        None if done is None else computes_between(module, computation, position, done)
    )


def _site_overlap(
    module: Module, name: str, position: int, inner: Instruction
) -> bool | None:
    """`overlapped` of the collective `inner`, inside the computation that the
    async-start or TPU start fusion at `position` of `name` runs."""
    caller = module.computations[name]
    site = caller.instructions[position]
    if site.opcode == "async-start":
        if _SYNC.search(site.rest) or _SYNC.search(inner.rest):
            return False
        done = _done_of(caller, position)
    else:
        channels = {c for c in [channel(inner)] if c is not None}
        done = _fusion_done_of(module, caller, position, channels)
    return None if done is None else computes_between(module, caller, position, done)
