"""The data flow inside each computation of a program read by `_text`: for
each slot, the computation's parameter slots it derives from and the root slots
it reaches.

Edges join the slots of an instruction to the slots of its operands through the
ops that keep each element's identity (elementwise arithmetic, conversions,
copies, reshapes, transposes, slices, pads, concatenations, selects, tuples,
collectives, and broadcasts that only add size-1 dimensions: a bias added across
a batch does not make the activations the bias) and stop at the ops that mix
elements (dot, reduce, convolution, gather, scatter, sort, custom calls, ...). A
called computation (fusion, call, `while` body, branch) is summarised by which
of its parameter slots reach which of its root slots, and a loop by the closure
of its body's summary, so the graphs are built callees first (`Graphs`). Next to
each slot are also the nearest mixing ops: the operands of the op producing it
(the dot whose partial sums an all-reduce adds), and the operands and results of
the ops consuming it (the dot that needs what an all-gather gathers). One pass
in program order reads what each slot derives from, one in reverse order what it
reaches. `_flow` joins the graphs into the entry's arguments and results.
"""

import dataclasses
import functools
import re
from collections.abc import Iterable, Sequence

from ._megascale import linked_sends
from ._p2p import p2p_linked_sends
from ._text import (
    branches,
    called,
    callees,
    Computation,
    flatten_shape,
    Instruction,
    Module,
    text_error,
)


# ---------------------------------------------------------------------------------
# The ops, by how data flows through them.
# ---------------------------------------------------------------------------------

# The collectives' opcodes and their kinds; those of async pairs' starts and dones.
KINDS = {
    "all-gather": "all-gather",
    "all-reduce": "all-reduce",
    "reduce-scatter": "reduce-scatter",
    "all-to-all": "all-to-all",
    "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute",
    "collective-broadcast": "collective-broadcast",
}
STARTS = {f"{opcode}-start": kind for opcode, kind in KINDS.items()}
DONES = {f"{opcode}-done" for opcode in KINDS} | {"async-done", "async-update"}
# An asynchronous call of a computation on another execution thread (TPU's
# SparseCore): `call-start(...), async_execution_thread=..., to_apply=%c`.
DONES |= {"call-done", "call-update"}

# Ops that keep each element's identity: which operands flow into the result
# (`None`: all of them).
_ELEMENTWISE = """abs add and atan2 bitcast-convert cbrt ceil clamp complex convert
cosine divide erf exponential exponential-minus-one floor imag log log-plus-one
logistic map maximum minimum multiply negate not or power real reduce-precision
remainder round-nearest-afz round-nearest-even rsqrt shift-left
shift-right-arithmetic shift-right-logical sign sine sqrt stochastic-convert
subtract tan tanh xor concatenate""".split()
_FLOWS: dict[str, tuple[int, ...] | None] = dict.fromkeys(_ELEMENTWISE)
_FLOWS.update(
    dict.fromkeys(
        "bitcast copy reshape reverse slice transpose dynamic-slice pad "
        "dynamic-reshape set-dimension-size add-dependency copy-start "
        "slice-start".split(),
        (0,),
    )
)
_FLOWS.update({"dynamic-update-slice": (0, 1), "select": (1, 2)})
# The ops of `_FLOWS` that compute: a value they make is its operands' data
# only in a loose sense (the dot next to a collective is attributed to the
# operands that are an argument's data moved, not computed on).
_ARITHMETIC = set(_ELEMENTWISE) - {
    "bitcast-convert",
    "concatenate",
    "convert",
    "reduce-precision",
    "stochastic-convert",
} | {"select"}
# Ops that run other computations, through which data flows.
_CALLING = {"fusion", "call", "while", "conditional"}
# Ops whose result is their operands, slot for slot.
_PASS = {"opt-barrier", "domain"}
# The ops of a transfer between TPU slices (`_megascale`) or a permute split
# into sends and recvs (`_p2p`), whose data flows.
_TRANSFERS = {"send", "recv", "recv-done"}
# Ops that pick, gather or pass on their operands' slots.
_PICKING = {"get-tuple-element", "tuple", "broadcast"} | _PASS
# The ops of asynchronous pairs, and collectives' other than `KINDS`: their
# result is all their operands' data.
_ASYNC = set(STARTS) | DONES | {"copy-done", "slice-done", "async-start", "call-start"}
# Ops that mix elements, and the operands whose data they mix (`None`: all; an
# int n: the first n, or half of them for negative n).
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_MIXING: dict[str, int | None] = {
    "dot": None,
    "convolution": None,
    "reduce": -2,
    "reduce-window": -2,
    "gather": 1,
}


# Custom-calls whose result is their operands' data: those that end TPU's async
# collective fusions (the collective's operand and result, and state), and
# TPU's concatenation of slices by bitcast.
_FLOWING_CALLS = {"AsyncCollectiveStart", "AsyncCollectiveDone", "ConcatBitcast"}


def _target(instruction: Instruction) -> str:
    if instruction.opcode != "custom-call":
        return ""
    found = _TARGET.search(instruction.rest)
    return "" if found is None else found[1]


def _pieces(start: Instruction) -> tuple[int, int] | None:
    """For an async start `(operands, results, context...)`: the number of
    slots of its operands' echo and of its results; `None` for a start whose
    result is its results only (all-reduce)."""
    shape = start.shape
    if start.opcode == "all-reduce-start" or not isinstance(shape, list):
        return None
    if len(shape) < 2:
        return None
    return len(flatten_shape(shape[0])), len(flatten_shape(shape[1]))


def _paired_inputs(
    computation: Computation, instruction: Instruction, slots: list[list[int]]
) -> list[list[int]] | None:
    """`_inputs` of an async start or done that keeps each array of a combined
    collective apart: result `k` derives from operand `k` (and a done's result
    `k` from its start's result `k`); `None` where the counts do not match."""
    n = len(instruction.slots)
    if instruction.opcode in STARTS:
        flat = [slot for operand in slots for slot in operand]
        pieces = _pieces(instruction)
        if pieces is None:
            return [[slot] for slot in flat] if len(flat) == n else None
        echo, results = pieces
        if echo != len(flat) or results != len(flat):
            return None
        rest = n - echo - results
        return [[slot] for slot in flat] * 2 + [[] for _ in range(rest)]
    if len(slots) != 1:
        return None
    position = computation.index.get(instruction.operands[0])
    if position is None:
        return None
    start = computation.instructions[position]
    if start.opcode not in STARTS:
        return None
    pieces = _pieces(start)
    offset, count = (0, len(slots[0])) if pieces is None else pieces
    if count != n:
        return None
    return [[slot] for slot in slots[0][offset : offset + count]]


def _mixed(opcode: str, count: int) -> range:
    which = _MIXING[opcode]
    if which is None:
        return range(count)
    return range(count // -which if which < 0 else min(which, count))


def _closure(summary: Sequence[frozenset[int]]) -> list[frozenset[int]]:
    """For a loop body whose root slot `r` derives from its parameter slots
    `summary[r]`: the parameter slots that the result slot `r` derives from after
    one or more iterations."""
    closed = [set(s) for s in summary]
    changed = True
    while changed:
        changed = False
        for r, sources in enumerate(closed):
            more = set().union(*(closed[q] for q in sources if q != r)) - sources
            if more:
                sources |= more
                changed = True
    return [frozenset(s) for s in closed]


# Helpers of the passes, at module level: a function defined in a loop is made
# again at every turn (and type-checked again when the tests instrument eqshard),
# which made reading a program several times slower than compiling it.


def _each(n: int, sources: list[int]) -> list[list[int]]:
    return [sources for _ in range(n)]


def _union(sets: Iterable[frozenset[int]]) -> frozenset[int]:
    out: frozenset[int] = frozenset()
    for one in sets:
        if one and not one <= out:
            out = out | one
    return out


def span(base: list[int], position: int, count: int) -> list[int]:
    """The slots of the instruction at `position`, whose result has `count`."""
    return list(range(base[position], base[position] + count))


def _caller_slots(
    operands: list[list[int]], params: list[tuple[int, int]], slots: Iterable[int]
) -> list[int]:
    return [operands[i][k] for i, k in map(params.__getitem__, slots)]


# ---------------------------------------------------------------------------------
# The graph of one computation.
# ---------------------------------------------------------------------------------

_EMPTY: frozenset[int] = frozenset()


@dataclasses.dataclass(eq=False, slots=True)
class _Wires:
    """How one slot of a computation joins the others (by slot number), while the
    computation's graph is built."""

    inputs: list[int]  # the slots it derives from, through ops that keep identity
    strict_inputs: list[int]  # the same, through ops that move data only
    # The slots of the nearest mixing ops: the operands of the one producing it,
    # and the operands and results of those consuming it.
    near_in: list[int] = dataclasses.field(default_factory=list)
    near_out: list[int] = dataclasses.field(default_factory=list)
    near_out_results: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False, slots=True)
class Slot:
    """One slot of a computation: the parameter slots it derives from (`back`) and
    the root slots it reaches (`forward`), of that computation."""

    back: frozenset[int]
    strict_back: frozenset[int]  # through ops that move data only
    # The parameter slots that reach, through the ops that keep identity, the
    # operands of the nearest mixing op (dot, ...) that produces the slot
    # (`producers`), or that consumes it (`consumers`), and the root slots those
    # consumers reach.
    producers: frozenset[int]
    forward: frozenset[int] = _EMPTY
    consumers: frozenset[int] = _EMPTY
    consumer_results: frozenset[int] = _EMPTY


@dataclasses.dataclass(eq=False)
class Graph:
    """The slots of one computation's instructions, one record each."""

    base: list[int]  # first slot of each instruction
    slots: list[Slot]
    params: list[int]  # the slots of the parameters, in parameter-slot order
    root: list[int]  # the slots of the root


def _layout(computation: Computation) -> tuple[list[int], dict[int, int]]:
    """The first slot of each instruction, and each parameter slot's number among
    the computation's parameter slots."""
    base = []
    total = 0
    for instruction in computation.instructions:
        base.append(total)
        total += len(instruction.slots)
    param_slot: dict[int, int] = {}
    for position in computation.params:
        for k in range(len(computation.instructions[position].slots)):
            param_slot[base[position] + k] = len(param_slot)
    return base, param_slot


def _forward(wires: list[_Wires], param_slot: dict[int, int]) -> list[Slot]:
    """The slots in program order, each from those before it: the parameter slots
    it derives from, and the producers' operands next to it."""
    slots: list[Slot] = []
    for k, wire in enumerate(wires):
        if k in param_slot:
            back = strict_back = frozenset((param_slot[k],))
        else:
            back = _union(slots[s].back for s in wire.inputs)
            strict_back = _union(slots[s].strict_back for s in wire.strict_inputs)
        # A mixing op none of whose operands is an argument's data moved (a
        # reduce of a dot's partial results) stands for its producer's.
        near = _union(slots[s].strict_back for s in wire.near_in)
        if not near and wire.near_in:
            near = _union(slots[s].producers for s in wire.near_in)
        producers = _union([near] + [slots[s].producers for s in wire.inputs])
        slots.append(Slot(back, strict_back, producers))
    return slots


def _backward(slots: list[Slot], wires: list[_Wires], root: list[int]) -> None:
    """The slots in reverse program order, each from those after it (its users):
    the root slots it reaches, and the consumers' operands next to it."""
    for r, k in enumerate(root):
        slots[k].forward = frozenset((r,))
    for k in range(len(slots) - 1, -1, -1):
        slot, wire = slots[k], wires[k]
        if wire.near_out:
            slot.consumers |= _union(slots[s].strict_back for s in wire.near_out)
            slot.consumer_results |= _union(
                slots[s].forward for s in wire.near_out_results
            )
        for before in wire.inputs:
            earlier = slots[before]
            earlier.forward |= slot.forward
            earlier.consumers |= slot.consumers
            earlier.consumer_results |= slot.consumer_results


class Graphs:
    """The graph of each computation a module's entry runs, built callees first:
    a computation's graph reads those of the computations it calls."""

    def __init__(self, module: Module, order: list[str], caller: str):
        self.module = module
        self.caller = caller
        self.by_name: dict[str, Graph] = {}
        for name in reversed(order):  # callees first
            self.by_name[name] = self._build(module.computations[name])

    def __getitem__(self, name: str) -> Graph:
        return self.by_name[name]

    def summary(self, name: str, strict: bool = False) -> list[frozenset[int]]:
        """For each root slot of `name`, the parameter slots it derives from
        (with `strict`, its data moved but not computed on)."""
        graph = self.by_name[name]
        if strict:
            return [graph.slots[slot].strict_back for slot in graph.root]
        return [graph.slots[slot].back for slot in graph.root]

    def param_slots(self, name: str) -> list[tuple[int, int]]:
        """For each parameter slot of `name`: (parameter number, slot in it)."""
        computation = self.module.computations[name]
        return [
            (number, k)
            for number, position in enumerate(computation.params)
            for k in range(len(computation.instructions[position].slots))
        ]

    def operand_slots(
        self, computation: Computation, instruction: Instruction, base: list[int]
    ) -> list[list[int]]:
        """The slots of each operand of `instruction`."""
        out = []
        for name in instruction.operands:
            position = computation.index.get(name)
            if position is None:
                raise text_error(
                    self.caller,
                    f"the operand {name} is not defined before its use",
                    instruction.line,
                )
            n = len(computation.instructions[position].slots)
            out.append(span(base, position, n))
        return out

    def _build(self, computation: Computation) -> Graph:
        """The graph of `computation`, whose callees' graphs are built."""
        base, param_slot = _layout(computation)
        operands = [
            self.operand_slots(computation, instruction, base)
            for instruction in computation.instructions
        ]
        # A recv receives its send's data (its operand is a token): a megascale
        # transfer's recv, a point-to-point permute's recv-done (its recv may
        # come before the send in the schedule, its done never does).
        sends = linked_sends(computation) | p2p_linked_sends(computation)
        for position, send in sends.items():
            operands[position] = [[base[send]] if send < position else []]
        wires: list[_Wires] = []
        for instruction, slots in zip(computation.instructions, operands, strict=True):
            loose = strict = self._inputs(computation, instruction, slots, False)
            if instruction.opcode in _ARITHMETIC or instruction.opcode in _CALLING:
                strict = self._inputs(computation, instruction, slots, True)
            wires += map(_Wires, loose, strict)
        for position, instruction in enumerate(computation.instructions):
            result = span(base, position, len(instruction.slots))
            self._mark_near(instruction, operands[position], result, wires)
        slots = _forward(wires, param_slot)
        root = computation.instructions[computation.root]
        root_slots = span(base, computation.root, len(root.slots))
        _backward(slots, wires, root_slots)
        params = sorted(param_slot, key=param_slot.__getitem__)
        return Graph(base, slots, params, root_slots)

    def _inputs(
        self,
        computation: Computation,
        instruction: Instruction,
        slots: list[list[int]],
        strict: bool,
    ) -> list[list[int]]:
        """For each slot of `instruction`'s result, the slots (of its operands,
        `slots`) it derives from; with `strict`, only through ops that move data
        (no arithmetic)."""
        n = len(instruction.slots)
        opcode = instruction.opcode
        if opcode in _CALLING:
            return self._called_inputs(instruction, slots, strict)
        if opcode in _PICKING:
            return self._picked_inputs(computation, instruction, slots)
        if opcode in _TRANSFERS and slots:
            # (data, context..., token): the data is the operand's, the recv's
            # its send's, a recv-done's its recv's data.
            data = slots[0][:1] if opcode == "recv-done" else slots[0]
            return [list(data)] + [[] for _ in range(n - 1)]
        if strict and opcode in _ARITHMETIC:
            return _each(n, [])
        if opcode in _FLOWS:
            which = _FLOWS[opcode]
            picked = (
                slots if which is None else [slots[i] for i in which if i < len(slots)]
            )
            return _each(n, [slot for operand in picked for slot in operand])
        if (
            opcode in KINDS
            and isinstance(instruction.shape, list)
            and opcode not in ("all-to-all", "ragged-all-to-all")
            and len(slots) == n
        ):
            return [operand for operand in slots]
        if opcode.startswith("ragged-all-to-all") and opcode in KINDS | STARTS:
            # The data sent and the buffer it lands in; not the offsets.
            return _each(n, [slot for operand in slots[:2] for slot in operand])
        if opcode in STARTS or opcode in DONES:
            paired = _paired_inputs(computation, instruction, slots)
            if paired is not None:
                return paired
        if (
            opcode in KINDS
            or opcode in _ASYNC
            or _target(instruction) in _FLOWING_CALLS
        ):
            return _each(n, [slot for operand in slots for slot in operand])
        return [[] for _ in range(n)]

    def _picked_inputs(
        self, computation: Computation, instruction: Instruction, slots: list[list[int]]
    ) -> list[list[int]]:
        """`_inputs` of the ops that pick, gather or pass on their operands' slots:
        a tuple's element, a tuple, an opt-barrier or domain, a broadcast."""
        n = len(instruction.slots)
        opcode = instruction.opcode
        if opcode == "get-tuple-element":
            tuple_shape = computation.instructions[
                computation.index[instruction.operands[0]]
            ].shape
            k = int(instruction.attrs.get("index", "-1"))
            if not isinstance(tuple_shape, list) or not 0 <= k < len(tuple_shape):
                raise text_error(
                    self.caller, "an element of a non-tuple", instruction.line
                )
            start = sum(len(flatten_shape(e)) for e in tuple_shape[:k])
            return [[slots[0][start + j]] for j in range(n)]
        if opcode == "tuple":
            return [[slot] for operand in slots for slot in operand]
        if opcode == "broadcast":
            # A broadcast that repeats its operand (a bias over a batch) makes
            # something else of it: only one that adds size-1 dimensions flows.
            (operand,) = instruction.operands
            before = computation.instructions[computation.index[operand]].slots[0]
            if before.nbytes == instruction.slots[0].nbytes:
                return _each(n, slots[0])
            return _each(n, [])
        return [[slot] for slot in slots[0]]  # opt-barrier, domain

    def _called_inputs(
        self, instruction: Instruction, slots: list[list[int]], strict: bool
    ) -> list[list[int]]:
        """`_inputs` of the ops that run other computations, from the summaries
        of those computations."""
        if instruction.opcode == "while":
            body = called(instruction, "body")
            return [
                [slots[0][p] for p in sources]
                for sources in _closure(self.summary(body, strict))
            ]
        if instruction.opcode == "conditional":
            out: list[list[int]] = [[] for _ in range(len(instruction.slots))]
            for b, branch in enumerate(branches(instruction)):
                params = self.param_slots(branch)
                for r, sources in enumerate(self.summary(branch, strict)):
                    out[r] += [
                        slots[1 + b][k] for _, k in map(params.__getitem__, sources)
                    ]
            return out
        (callee,) = callees(instruction)  # fusion, call
        params = self.param_slots(callee)
        return [
            [slots[i][k] for i, k in (params[p] for p in sources)]
            for sources in self.summary(callee, strict)
        ]

    def _mark_near(
        self,
        instruction: Instruction,
        operands: list[list[int]],
        result: list[int],
        wires: list[_Wires],
    ) -> None:
        """Next to each slot, the slots of the nearest mixing ops: the operands of
        the one producing it, and the operands and results of those consuming it
        (inside a fusion or call, as its caller's slots)."""
        if instruction.opcode in _MIXING:
            mixed = [
                slot
                for i in _mixed(instruction.opcode, len(operands))
                for slot in operands[i]
            ]
            for slot in result:
                wires[slot].near_in += mixed
            for slot in mixed:
                wires[slot].near_out += mixed
                wires[slot].near_out_results += result
        elif instruction.opcode in ("fusion", "call"):
            (callee,) = callees(instruction)
            graph = self.by_name[callee]
            params = self.param_slots(callee)
            caller = functools.partial(_caller_slots, operands, params)
            for r, slot in zip(graph.root, result, strict=True):
                wires[slot].near_in += caller(graph.slots[r].producers)
            for q, (i, k) in enumerate(params):
                node = graph.slots[graph.params[q]]
                wire = wires[operands[i][k]]
                wire.near_out += caller(node.consumers)
                wire.near_out_results += [result[r] for r in node.consumer_results]
