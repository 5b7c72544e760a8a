"""Following the data of a compiled program read by `_text`: how often each
collective runs, and which of the program's arguments and results its data comes
from and goes to.

1. **Count** (`Program`): how many times each computation runs per step: a
   `while` body as many times as its `known_trip_count`, or as its condition
   says (`_loops`; times the runs of the computation holding the loop), a
   branch of a `conditional` at most once per
   run of its caller (marked), a fusion or call as often as its caller.
2. **Follow the data** (`Program`): inside each computation, its graph
   (`_graph`) tells which of its parameter slots each slot derives from and
   which of its root slots each reaches. Then, top down from the entry
   computation, each computation learns which *arguments* (entry parameters)
   reach its parameters and which *results* (entry outputs) its root reaches; a
   loop body only where it passes a value on (stacked weights, an accumulator),
   not where it replaces it at each iteration (a scan's activations are its
   input only at the first). A slot's arguments and results follow, and, for a
   slot that has none, those of the nearest mixing ops: the operands of the op
   producing it (the dot whose partial sums an all-reduce adds), and the
   operands and results of the ops consuming it (the dot that needs what an
   all-gather gathers).
"""

import dataclasses
from collections.abc import Iterable, Iterator

from ._forms import (
    computes_between,
    is_scatter_fusion,
    KERNELS,
    overlapped,
    read_forms,
    target,
    unknown_collective_target,
)
from ._graph import DONES, Graph, Graphs, KINDS, span, STARTS
from ._loops import loop_trips
from ._megascale import Transfer, transfers
from ._p2p import p2p_transfers
from ._text import (
    ArrayShape,
    BadLine,
    branches,
    called,
    callees,
    Computation,
    flatten_shape,
    Instruction,
    Module,
    op_name,
    parse,
    replica_groups,
    source,
    source_target_pairs,
    text_error,
    trip_count,
)


# ---------------------------------------------------------------------------------
# The computations the entry runs, and how often.
# ---------------------------------------------------------------------------------

# The ops that run other computations whose parameters their operands become.
_CALL_SITES = {"fusion", "call", "async-start", "call-start", "while", "conditional"}


def _call_order(module: Module, caller: str) -> list[str]:
    """The computations the entry runs, callers before callees."""
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(name: str, line: str) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            raise text_error(caller, f"{name} calls itself", line)
        state[name] = 1
        computation = module.computations.get(name)
        if computation is None:
            raise text_error(caller, f"no computation named {name}", line)
        for instruction in computation.instructions:
            for callee in callees(instruction):
                visit(callee, instruction.line)
        state[name] = 2
        order.append(name)

    visit(module.entry, "")
    return order[::-1]


@dataclasses.dataclass(eq=False)
class _Runs:
    """How often a computation runs per step."""

    count: int = 0
    conditional: bool = False  # in a branch of a conditional: at most `count`
    unknown_trips: bool = False  # in a loop without a known trip count


def _count(module: Module, order: list[str]) -> dict[str, _Runs]:
    """Runs per step of each computation of `order` (callers first)."""
    runs = {name: _Runs() for name in order}
    runs[module.entry].count = 1
    for name in order:  # callers first
        mine = runs[name]
        computation = module.computations[name]
        for instruction in computation.instructions:
            here = callees(instruction)
            if not here:
                continue
            times, branch, unknown = mine.count, mine.conditional, mine.unknown_trips
            if instruction.opcode == "while":
                trips = trip_count(instruction.attrs)
                if trips is None:
                    trips = loop_trips(module, computation, instruction)
                if trips is None:
                    trips, unknown = 1, True
                condition = called(instruction, "condition")
                body = called(instruction, "body")
                each = {condition: times * (trips + 1), body: times * trips}
            else:
                branch = branch or instruction.opcode == "conditional"
                each = dict.fromkeys(here, times)
            for callee, n in each.items():
                theirs = runs[callee]
                theirs.count += n
                theirs.conditional = theirs.conditional or branch
                theirs.unknown_trips = theirs.unknown_trips or unknown
    return runs


# ---------------------------------------------------------------------------------
# The entry's arguments and results, in each computation.
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Context:
    """For one computation: the entry arguments reaching each of its parameter
    slots, and the entry results each of its root slots reaches."""

    origins: list[frozenset[int]]
    reaches: list[frozenset[int]]

    def arguments(self, params: Iterable[int]) -> frozenset[int]:
        """The entry arguments reaching any of the parameter slots `params`."""
        return frozenset().union(*(self.origins[p] for p in params))

    def results(self, roots: Iterable[int]) -> frozenset[int]:
        """The entry results any of the root slots `roots` reaches."""
        return frozenset().union(*(self.reaches[r] for r in roots))


def _contexts(graphs: Graphs, order: list[str]) -> dict[str, _Context]:
    """Each computation's context, top down: a computation gets the arguments and
    results of all its call sites before it passes them on to its callees."""
    module = graphs.module
    bodies = {
        called(instruction, "body")
        for name in order
        for instruction in module.computations[name].instructions
        if instruction.opcode == "while"
    }
    origins = {n: [set() for _ in g.params] for n, g in graphs.by_name.items()}
    reaches = {n: [set() for _ in g.root] for n, g in graphs.by_name.items()}
    entry = graphs[module.entry]
    origins[module.entry] = [{k} for k in range(len(entry.params))]
    reaches[module.entry] = [{r} for r in range(len(entry.root))]
    out: dict[str, _Context] = {}
    for name in order:  # callers first: each gets all its call sites
        if name in bodies:
            _loop(graphs.summary(name), origins[name], reaches[name])
        context = _Context(
            [frozenset(s) for s in origins[name]], [frozenset(s) for s in reaches[name]]
        )
        out[name] = context
        computation = module.computations[name]
        graph = graphs[name]
        for position, instruction in enumerate(computation.instructions):
            for callee, sources, targets in _call_sites(
                graphs, computation, position, instruction
            ):
                for p, slot in enumerate(sources):
                    if slot is not None:
                        origins[callee][p] |= context.arguments(graph.slots[slot].back)
                for r, slots in enumerate(targets):
                    for slot in slots:
                        reaches[callee][r] |= context.results(graph.slots[slot].forward)
    return out


def _call_sites(
    graphs: Graphs, computation: Computation, position: int, instruction: Instruction
) -> Iterator[tuple[str, list[int | None], list[list[int]]]]:
    """For each computation `instruction` runs: the caller's slot that each of
    its parameter slots receives (`None`: none that counts), and the caller's
    slots that each of its root slots becomes.

    A loop's parameters receive its initial values only where the body passes
    them on (the stacked weights, an accumulator): a value the body replaces
    at each iteration (the activations of a scan) is its initial value only at
    the first, so the initial value's arguments are not given to all; likewise
    only what the body passes on reaches the loop's results."""
    opcode = instruction.opcode
    if opcode not in _CALL_SITES:
        return
    base = graphs[computation.name].base
    operands = graphs.operand_slots(computation, instruction, base)
    result = span(base, position, len(instruction.slots))
    if opcode in ("fusion", "call", "async-start", "call-start"):
        (callee,) = callees(instruction)
        params = graphs.param_slots(callee)
        sources: list[int | None] = [operands[i][k] for i, k in params]
        roots = len(graphs[callee].root)
        if opcode in ("async-start", "call-start"):
            yield callee, sources, [result] * roots
        else:
            yield callee, sources, [[slot] for slot in result[:roots]]
    elif opcode == "while":
        condition = called(instruction, "condition")
        body = called(instruction, "body")
        summary = graphs.summary(body)
        kept = {r for r, found in enumerate(summary) if r in found}
        yield condition, list(operands[0]), []
        yield (
            body,
            [slot if p in kept else None for p, slot in enumerate(operands[0])],
            [[slot] if r in kept else [] for r, slot in enumerate(result)],
        )
    else:  # conditional
        for b, branch in enumerate(branches(instruction)):
            yield branch, list(operands[1 + b]), [[slot] for slot in result]


def _loop(
    summary: list[frozenset[int]], origins: list[set[int]], reaches: list[set[int]]
) -> None:
    """Carries a loop body's arguments and results around the loop (whose root
    slot `r` derives from the parameter slots `summary[r]`): each iteration's
    parameters are the previous iteration's root."""
    changed = True
    while changed:
        changed = False
        for r, sources in enumerate(summary):
            for q in sources:
                if not origins[q] <= origins[r]:
                    origins[r] |= origins[q]
                    changed = True
                if (
                    r < len(reaches)
                    and q < len(reaches)
                    and not reaches[r] <= reaches[q]
                ):
                    reaches[q] |= reaches[r]
                    changed = True


# ---------------------------------------------------------------------------------
# The program and its collectives.
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Part:
    """One array of a collective's result, with the arguments (entry parameter
    slots) it comes from and the results (entry root slots) it reaches."""

    shape: ArrayShape
    arguments: frozenset[int]
    results: frozenset[int]
    # The arguments of the operands of the nearest mixing ops (dot, ...) that
    # produce it and that consume it, and the results those consumers reach.
    producers: frozenset[int]
    consumers: frozenset[int]
    consumer_results: frozenset[int]


@dataclasses.dataclass(frozen=True)
class Collective:
    name: str
    kind: str
    parts: tuple[Part, ...]
    count: int  # runs per step
    conditional: bool  # inside a branch of a conditional: at most `count`
    unknown_trips: bool  # inside a loop without a known trip count
    groups: tuple[tuple[int, ...], ...]  # device groups (collective-permute: pairs)
    op_name: str
    source: str
    # Whether the schedule overlaps it with computation (`None`: not known).
    overlapped: bool | None = None
    # A transfer between TPU slices over DCN (`_megascale`): its `groups` are
    # device ids, or none with `slices`: one device in each of `slices` slices.
    dcn: bool = False
    slices: int = 0


def _result_slots(
    graph: Graph, position: int, instruction: Instruction, kind: str
) -> tuple[list[ArrayShape], list[int]]:
    """The arrays a collective gives, and their slots: of an async start's
    `(operand, result[, context...])`, those of the result (element 1)."""
    slots = span(graph.base, position, len(instruction.slots))
    shapes = instruction.slots
    if instruction.opcode.endswith("-start") and isinstance(instruction.shape, list):
        result = instruction.shape[1] if kind != "all-reduce" else instruction.shape
        shapes = flatten_shape(result)
        offset = len(flatten_shape(instruction.shape[0])) if kind != "all-reduce" else 0
        slots = slots[offset : offset + len(shapes)]
    return shapes, slots


def _groups(
    instruction: Instruction, kind: str, num_devices: int
) -> tuple[tuple[int, ...], ...]:
    """A collective's device groups (a permute's source-target pairs)."""
    try:
        if kind == "collective-permute":
            return tuple(source_target_pairs(instruction.attrs))
        return tuple(map(tuple, replica_groups(instruction.attrs, num_devices)))
    except BadLine:
        raise
    except (ValueError, KeyError) as e:
        raise BadLine(str(e), instruction.line) from None


class Program:
    """A compiled program read: its collectives and the data flow of every
    instruction, for the entry's `arguments` parameter slots and `results` root
    slots."""

    def __init__(self, text: str, *, caller: str, num_devices: int):
        self.caller = caller
        self.module = parse(text, caller=caller)
        self.num_devices = num_devices
        try:
            self._order = _call_order(self.module, caller)
            self._graphs = Graphs(self.module, self._order, caller)
            self._runs = _count(self.module, self._order)
            self._contexts = _contexts(self._graphs, self._order)
        except BadLine as e:
            raise text_error(caller, e.what, e.line) from None

    @property
    def entry(self) -> Computation:
        return self.module.computations[self.module.entry]

    def runs(self) -> dict[str, int]:
        """Runs per step of each computation the entry runs (a loop body: its
        trip count, once where that is unknown), callers first."""
        return {name: self._runs[name].count for name in self._order}

    def num_arguments(self) -> int:
        return len(self._graphs[self.module.entry].params)

    def num_results(self) -> int:
        return len(self._graphs[self.module.entry].root)

    def flow(self, name: str, position: int) -> tuple[frozenset[int], frozenset[int]]:
        """The entry arguments and results of all slots of one instruction."""
        graph, context = self._graphs[name], self._contexts[name]
        n = len(self.module.computations[name].instructions[position].slots)
        slots = [graph.slots[k] for k in span(graph.base, position, n)]
        arguments = frozenset().union(*(context.arguments(s.back) for s in slots))
        results = frozenset().union(*(context.results(s.forward) for s in slots))
        return arguments, results

    def instructions(self) -> Iterator[tuple[str, int, Instruction]]:
        """Every instruction the entry runs: (computation, position, instruction)."""
        for name in self._order:
            for position, instruction in enumerate(
                self.module.computations[name].instructions
            ):
                yield name, position, instruction

    def collectives(self) -> list[Collective]:
        """One entry per collective instruction (an async pair once, at its
        start), in program order."""
        try:
            return self._collectives()
        except BadLine as e:
            raise text_error(self.caller, e.what, e.line) from None

    def _collectives(self) -> list[Collective]:
        forms = read_forms(self.module, self._order)
        moves = {
            (name, t.first): t
            for name in self._order
            for found in (transfers, p2p_transfers)
            for t in found(self.module.computations[name])
        }
        out = []
        for name, position, instruction in self.instructions():
            opcode = instruction.opcode
            if (name, position) in moves:
                out.append(self._transfer(name, moves[name, position]))
                continue
            kind = KINDS.get(opcode) or STARTS.get(opcode)
            if opcode == "ragged-all-to-all" or opcode == "ragged-all-to-all-start":
                kind = "ragged-all-to-all"  # its bytes: the output buffer, at most
            if (name, position) in forms.skipped:
                continue
            if kind is not None:
                collective = self._collective(name, position, instruction, kind)
                flag = overlapped(
                    self.module, self.module.computations[name], position, forms
                )
                out.append(dataclasses.replace(collective, overlapped=flag))
            elif is_scatter_fusion(self.module, instruction):
                out.append(self._scatter_fusion(name, position, instruction))
            elif target(instruction) in KERNELS:
                out.append(self._kernel(name, instruction))
            elif (unknown := unknown_collective_target(instruction)) is not None:
                raise text_error(
                    self.caller,
                    f"a custom-call to an unknown collective {unknown!r}",
                    instruction.line,
                )
            elif (
                "all-" in opcode or "collective" in opcode or "scatter-" in opcode
            ) and opcode not in DONES | {"call-start"}:
                raise text_error(
                    self.caller, f"an unknown collective {opcode!r}", instruction.line
                )
        return out

    def _scatter_fusion(
        self, name: str, position: int, instruction: Instruction
    ) -> Collective:
        """A TPU all-reduce-scatter fusion: one reduce-scatter, whose arrays are
        the fusion's results, over the device groups of the all-reduce inside."""
        (callee,) = callees(instruction)
        inner = next(
            i
            for i in self.module.computations[callee].instructions
            if i.opcode == "all-reduce"
        )
        graph = self._graphs[name]
        slots = span(graph.base, position, len(instruction.slots))
        collective = self._collective(name, position, instruction, "reduce-scatter")
        parts = tuple(
            self._part(name, shape, slot)
            for shape, slot in zip(instruction.slots, slots, strict=True)
        )
        groups = _groups(inner, "reduce-scatter", self.num_devices)
        return dataclasses.replace(
            collective, parts=parts, groups=groups, overlapped=False
        )

    def _transfer(self, name: str, transfer: Transfer) -> Collective:
        """A megascale transfer between TPU slices, or a permute written as a
        send and a recv: one row, whose array is the recv's (the send's where
        the computation has no recv)."""
        computation = self.module.computations[name]
        data, instruction = transfer.data, computation.instructions[transfer.head]
        runs = self._runs[name]
        overlapped = None
        if transfer.done:
            overlapped = computes_between(
                self.module, computation, transfer.first, transfer.last
            )
        slot = self._graphs[name].base[data]
        shape = computation.instructions[data].slots[0]
        return Collective(
            name=transfer.key,
            kind=transfer.kind,
            parts=(self._part(name, shape, slot),),
            count=runs.count,
            conditional=runs.conditional,
            unknown_trips=runs.unknown_trips,
            groups=transfer.groups,
            op_name=op_name(instruction.attrs),
            source=source(instruction.attrs, self.module.sources),
            overlapped=overlapped,
            dcn=transfer.dcn,
            slices=transfer.slices,
        )

    def _kernel(self, name: str, instruction: Instruction) -> Collective:
        """A Pallas/Mosaic kernel: one opaque row, without bytes (what it sends,
        if anything, is not in the text)."""
        runs = self._runs[name]
        return Collective(
            name=instruction.name,
            kind="kernel",
            parts=(),
            count=runs.count,
            conditional=runs.conditional,
            unknown_trips=runs.unknown_trips,
            groups=(),
            op_name=op_name(instruction.attrs),
            source=source(instruction.attrs, self.module.sources),
            overlapped=None,
        )

    def _part(self, name: str, shape: ArrayShape, k: int) -> Part:
        """The array of slot `k` of computation `name`, with its flow."""
        slot, context = self._graphs[name].slots[k], self._contexts[name]
        return Part(
            shape,
            context.arguments(slot.back),
            context.results(slot.forward),
            context.arguments(slot.producers),
            context.arguments(slot.consumers),
            context.results(slot.consumer_results),
        )

    def _collective(
        self, name: str, position: int, instruction: Instruction, kind: str
    ) -> Collective:
        graph = self._graphs[name]
        shapes, slots = _result_slots(graph, position, instruction, kind)
        parts = tuple(
            self._part(name, shape, slot)
            for shape, slot in zip(shapes, slots, strict=True)
        )
        groups = _groups(instruction, kind, self.num_devices)
        runs = self._runs[name]
        return Collective(
            name=instruction.name,
            kind=kind,
            parts=parts,
            count=runs.count,
            conditional=runs.conditional,
            unknown_trips=runs.unknown_trips,
            groups=groups,
            op_name=op_name(instruction.attrs),
            source=source(instruction.attrs, self.module.sources),
        )
