"""Following the data of a compiled program read by `_hlo_text`: how often each
collective runs, and which of the program's arguments and results its data comes
from and goes to.

1. **Count** (`Program`): how many times each computation runs per step: a
   `while` body as many times as its `known_trip_count` (times the runs of the
   computation holding the loop), a branch of a `conditional` at most once per
   run of its caller (marked), a fusion or call as often as its caller.
2. **Follow the data** (`Program`): inside each computation, edges join the
   slots of an instruction to the slots of its operands through the ops that
   keep each element's identity (elementwise arithmetic, conversions, copies,
   reshapes, transposes, slices, pads, concatenations, selects, tuples,
   collectives, and broadcasts that only add size-1 dimensions: a bias added
   across a batch does not make the activations the bias) and stop at the ops that mix
   elements (dot, reduce, convolution, gather, scatter, sort, custom calls, ...).
   A called computation (fusion, call, `while` body, branch) is summarised by
   which of its parameter slots reach which of its root slots, and a loop by the
   closure of its body's summary. Then, top down from the entry computation,
   each computation learns which *arguments* (entry parameters) reach its
   parameters and which *results* (entry outputs) its root reaches; a loop body
   only where it passes a value on (stacked weights, an accumulator), not where
   it replaces it at each iteration (a scan's activations are its input only at
   the first). A slot's arguments and results follow, and, for a slot that has
   none, those of the nearest mixing ops: the operands of the op producing it
   (the dot whose partial sums an all-reduce adds), and the operands and results
   of the ops consuming it (the dot that needs what an all-gather gathers).
"""

import dataclasses
import functools
from collections.abc import Iterable, Iterator, Sequence

from ._hlo_text import (
    ArrayShape,
    BadLine,
    branches,
    called,
    callees,
    Computation,
    flatten_shape,
    Instruction,
    op_name,
    parse,
    replica_groups,
    source,
    source_target_pairs,
    text_error,
    trip_count,
)


# ---------------------------------------------------------------------------------
# What flows where.
# ---------------------------------------------------------------------------------

_KINDS = {
    "all-gather": "all-gather",
    "all-reduce": "all-reduce",
    "reduce-scatter": "reduce-scatter",
    "all-to-all": "all-to-all",
    "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute",
    "collective-broadcast": "collective-broadcast",
}
_STARTS = {f"{opcode}-start": kind for opcode, kind in _KINDS.items()}
_DONES = {f"{opcode}-done" for opcode in _KINDS} | {"async-done", "async-update"}

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
        "dynamic-reshape set-dimension-size add-dependency copy-start".split(),
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
# Ops that mix elements, and the operands whose data they mix (`None`: all; an
# int n: the first n, or half of them for negative n).
_MIXING: dict[str, int | None] = {
    "dot": None,
    "convolution": None,
    "reduce": -2,
    "reduce-window": -2,
    "gather": 1,
}


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


# Helpers of `Program`'s passes, at module level: a function defined in a loop is
# made again at every turn (and type-checked again when the tests instrument
# eqshard), which made reading a program several times slower than compiling it.


def _each(n: int, sources: list[int]) -> list[list[int]]:
    return [sources for _ in range(n)]


def _union(sets: Iterable[frozenset[int]]) -> frozenset[int]:
    out: frozenset[int] = frozenset()
    for one in sets:
        if one and not one <= out:
            out = out | one
    return out


def _derive(
    inputs: list[list[int]], param_slot: dict[int, int]
) -> list[frozenset[int]]:
    back: list[frozenset[int]] = []
    for slot, sources in enumerate(inputs):
        if slot in param_slot:
            back.append(frozenset((param_slot[slot],)))
        else:
            back.append(_union(back[s] for s in sources))
    return back


def _caller_slots(
    operands: list[list[int]], params: list[tuple[int, int]], slots: Iterable[int]
) -> list[int]:
    return [operands[i][k] for i, k in map(params.__getitem__, slots)]


def _origins_of(
    origins: Sequence[frozenset[int]], found: frozenset[int]
) -> frozenset[int]:
    return frozenset().union(*(origins[p] for p in found))


@dataclasses.dataclass(eq=False)
class _Graph:
    """The slots of one computation's instructions and, for each, the parameter
    slots it derives from (`back`) and the root slots it reaches (`forward`)."""

    base: list[int]  # first slot of each instruction
    back: list[frozenset[int]]
    strict_back: list[frozenset[int]]  # through ops that move data only
    forward: list[frozenset[int]]
    # The parameter slots that reach, through the ops that keep identity, the
    # operands of the nearest mixing op (dot, ...) that produces the slot
    # (`producers`), or that consumes it (`consumers`).
    producers: list[frozenset[int]]
    consumers: list[frozenset[int]]
    consumer_results: list[frozenset[int]]  # root slots the consumers reach
    params: list[int]  # the slots of the parameters, in parameter-slot order
    root: list[int]  # the slots of the root


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


class Program:
    """A compiled program read: its collectives and the data flow of every
    instruction, for the entry's `arguments` parameter slots and `results` root
    slots."""

    def __init__(self, text: str, *, caller: str, num_devices: int):
        self.caller = caller
        self.module = parse(text, caller=caller)
        self.num_devices = num_devices
        try:
            self._read()
        except BadLine as e:
            raise text_error(caller, e.what, e.line) from None

    def _read(self) -> None:
        self._graphs: dict[str, _Graph] = {}
        self._order = self._call_order()
        for name in reversed(self._order):  # callees first
            self._graphs[name] = self._graph(self.module.computations[name])
        self._bodies = {
            called(instruction, "body")
            for name in self._order
            for instruction in self.module.computations[name].instructions
            if instruction.opcode == "while"
        }
        self._runs, self._flags = self._count()
        self._origins, self._reaches = self._contexts()

    # -- structure --------------------------------------------------------------

    def _computation(self, name: str, line: str) -> Computation:
        found = self.module.computations.get(name)
        if found is None:
            raise text_error(self.caller, f"no computation named {name}", line)
        return found

    def _call_order(self) -> list[str]:
        """The computations the entry runs, callers before callees."""
        order: list[str] = []
        state: dict[str, int] = {}

        def visit(name: str, line: str) -> None:
            if state.get(name) == 2:
                return
            if state.get(name) == 1:
                raise text_error(self.caller, f"{name} calls itself", line)
            state[name] = 1
            for instruction in self._computation(name, line).instructions:
                for callee in callees(instruction):
                    visit(callee, instruction.line)
            state[name] = 2
            order.append(name)

        visit(self.module.entry, "")
        return order[::-1]

    @property
    def entry(self) -> Computation:
        return self.module.computations[self.module.entry]

    def num_arguments(self) -> int:
        return len(self._graphs[self.module.entry].params)

    def num_results(self) -> int:
        return len(self._graphs[self.module.entry].root)

    # -- the graph of one computation --------------------------------------------

    def _summary(self, name: str, strict: bool = False) -> list[frozenset[int]]:
        """For each root slot of `name`, the parameter slots it derives from
        (with `strict`, its data moved but not computed on)."""
        graph = self._graphs[name]
        back = graph.strict_back if strict else graph.back
        return [back[slot] for slot in graph.root]

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
        each = functools.partial(_each, n)
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
        if opcode in _PASS:
            return [[slot] for slot in slots[0]]
        if opcode == "broadcast":
            # A broadcast that repeats its operand (a bias over a batch) makes
            # something else of it: only one that adds size-1 dimensions flows.
            (operand,) = instruction.operands
            before = computation.instructions[computation.index[operand]].slots[0]
            if before.nbytes == instruction.slots[0].nbytes:
                return each(slots[0])
            return each([])
        if strict and opcode in _ARITHMETIC:
            return each([])
        if opcode in _FLOWS:
            which = _FLOWS[opcode]
            picked = (
                slots if which is None else [slots[i] for i in which if i < len(slots)]
            )
            return each([slot for operand in picked for slot in operand])
        if opcode in _KINDS:
            if isinstance(instruction.shape, list) and opcode not in (
                "all-to-all",
                "ragged-all-to-all",
            ):
                if len(slots) == n:
                    return [operand for operand in slots]
            return each([slot for operand in slots for slot in operand])
        if opcode in _STARTS or opcode in _DONES or opcode == "copy-done":
            return each([slot for operand in slots for slot in operand])
        if opcode in ("fusion", "call"):
            (callee,) = callees(instruction)
            params = self._param_slots(callee)
            return [
                [slots[i][k] for i, k in (params[p] for p in sources)]
                for sources in self._summary(callee, strict)
            ]
        if opcode == "async-start":
            return each([slot for operand in slots for slot in operand])
        if opcode == "while":
            body = called(instruction, "body")
            return [
                [slots[0][p] for p in sources]
                for sources in _closure(self._summary(body, strict))
            ]
        if opcode == "conditional":
            out: list[list[int]] = [[] for _ in range(n)]
            for b, branch in enumerate(branches(instruction)):
                params = self._param_slots(branch)
                for r, sources in enumerate(self._summary(branch, strict)):
                    out[r] += [
                        slots[1 + b][k] for _, k in map(params.__getitem__, sources)
                    ]
            return out
        return [[] for _ in range(n)]

    def _param_slots(self, name: str) -> list[tuple[int, int]]:
        """For each parameter slot of `name`: (parameter number, slot in it)."""
        computation = self.module.computations[name]
        return [
            (number, k)
            for number, position in enumerate(computation.params)
            for k in range(len(computation.instructions[position].slots))
        ]

    def _graph(self, computation: Computation) -> _Graph:
        base = []
        total = 0
        for instruction in computation.instructions:
            base.append(total)
            total += len(instruction.slots)
        param_slot = {}
        for position in computation.params:
            for k in range(len(computation.instructions[position].slots)):
                param_slot[base[position] + k] = len(param_slot)
        operand_slots = [
            self._operand_slots(computation, instruction, base)
            for instruction in computation.instructions
        ]
        inputs: list[list[int]] = []
        strict_inputs: list[list[int]] = []
        for instruction, operands in zip(
            computation.instructions, operand_slots, strict=True
        ):
            loose = self._inputs(computation, instruction, operands, False)
            inputs += loose
            if instruction.opcode in _ARITHMETIC or instruction.opcode in _CALLING:
                loose = self._inputs(computation, instruction, operands, True)
            strict_inputs += loose
        empty: frozenset[int] = frozenset()
        union = _union
        back = _derive(inputs, param_slot)
        strict_back = _derive(strict_inputs, param_slot)
        # Next to each slot, the slots of the nearest mixing ops: the operands of
        # the one producing it (`near_in`), and the operands and results of those
        # consuming it (`near_out`, `near_out_results`).
        near_in: list[list[int]] = [[] for _ in range(total)]
        near_out: list[list[int]] = [[] for _ in range(total)]
        near_out_results: list[list[int]] = [[] for _ in range(total)]
        for position, instruction in enumerate(computation.instructions):
            operands = operand_slots[position]
            result = list(
                range(base[position], base[position] + len(instruction.slots))
            )
            if instruction.opcode in _MIXING:
                mixed = [
                    slot
                    for i in _mixed(instruction.opcode, len(operands))
                    for slot in operands[i]
                ]
                for slot in result:
                    near_in[slot] += mixed
                for slot in mixed:
                    near_out[slot] += mixed
                    near_out_results[slot] += result
            elif instruction.opcode in ("fusion", "call"):
                (callee,) = callees(instruction)
                graph = self._graphs[callee]
                params = self._param_slots(callee)
                caller = functools.partial(_caller_slots, operands, params)
                for r, slot in zip(graph.root, result, strict=True):
                    near_in[slot] += caller(graph.producers[r])
                for q, (i, k) in enumerate(params):
                    node = graph.params[q]
                    near_out[operands[i][k]] += caller(graph.consumers[node])
                    near_out_results[operands[i][k]] += [
                        result[r] for r in graph.consumer_results[node]
                    ]
        producers: list[frozenset[int]] = []
        for slot, sources in enumerate(inputs):
            producers.append(
                union(
                    [union(strict_back[s] for s in near_in[slot])]
                    + [producers[s] for s in sources]
                )
            )
        root_start = base[computation.root]
        root = list(
            range(
                root_start,
                root_start + len(computation.instructions[computation.root].slots),
            )
        )
        reach: list[frozenset[int]] = [empty] * total
        consumers: list[frozenset[int]] = [empty] * total
        consumer_results: list[frozenset[int]] = [empty] * total
        for r, slot in enumerate(root):
            reach[slot] = frozenset((r,))
        for slot in range(total - 1, -1, -1):
            # Everything after `slot` is final: its users come later.
            if near_out[slot]:
                consumers[slot] |= union(strict_back[s] for s in near_out[slot])
                consumer_results[slot] |= union(
                    reach[s] for s in near_out_results[slot]
                )
            for before in inputs[slot]:
                reach[before] |= reach[slot]
                consumers[before] |= consumers[slot]
                consumer_results[before] |= consumer_results[slot]
        params = sorted(param_slot, key=param_slot.__getitem__)
        return _Graph(
            base,
            back,
            strict_back,
            reach,
            producers,
            consumers,
            consumer_results,
            params,
            root,
        )

    def _operand_slots(
        self, computation: Computation, instruction: Instruction, base: list[int]
    ) -> list[list[int]]:
        """The slots of each operand of `instruction`."""
        index = computation.index
        out = []
        for name in instruction.operands:
            position = index.get(name)
            if position is None:
                raise text_error(
                    self.caller,
                    f"the operand {name} is not defined before its use",
                    instruction.line,
                )
            n = len(computation.instructions[position].slots)
            out.append(list(range(base[position], base[position] + n)))
        return out

    # -- runs per step ----------------------------------------------------------

    def _count(self) -> tuple[dict[str, int], dict[str, tuple[bool, bool]]]:
        """Runs per step of each computation, and whether it sits in a branch of a
        conditional, or in a loop of unknown trip count."""
        runs = {name: 0 for name in self._order}
        flags = {name: (False, False) for name in self._order}
        runs[self.module.entry] = 1
        for name in self._order:  # callers first
            computation = self.module.computations[name]
            for instruction in computation.instructions:
                runs_here = callees(instruction)
                if not runs_here:
                    continue
                times, (branch, unknown) = runs[name], flags[name]
                if instruction.opcode == "while":
                    trips = trip_count(instruction.attrs)
                    if trips is None:
                        trips, unknown = 1, True
                    condition = called(instruction, "condition")
                    body = called(instruction, "body")
                    each = {condition: times * (trips + 1), body: times * trips}
                else:
                    branch = branch or instruction.opcode == "conditional"
                    each = dict.fromkeys(runs_here, times)
                for callee, n in each.items():
                    runs[callee] += n
                    old = flags[callee]
                    flags[callee] = (old[0] or branch, old[1] or unknown)
        return runs, flags

    # -- arguments and results of each computation --------------------------------

    def _contexts(
        self,
    ) -> tuple[dict[str, list[frozenset[int]]], dict[str, list[frozenset[int]]]]:
        """For each computation: the entry arguments reaching each parameter slot,
        and the entry results each root slot reaches."""
        entry = self._graphs[self.module.entry]
        origins = {name: [set() for _ in g.params] for name, g in self._graphs.items()}
        reaches = {name: [set() for _ in g.root] for name, g in self._graphs.items()}
        origins[self.module.entry] = [{k} for k in range(len(entry.params))]
        reaches[self.module.entry] = [{r} for r in range(len(entry.root))]
        done: dict[str, tuple[list[frozenset[int]], list[frozenset[int]]]] = {}
        for name in self._order:  # callers first: each gets all its call sites
            if name in self._bodies:
                self._loop(name, origins[name], reaches[name])
            mine = [frozenset(s) for s in origins[name]]
            theirs = [frozenset(s) for s in reaches[name]]
            done[name] = (mine, theirs)
            computation = self.module.computations[name]
            for position, instruction in enumerate(computation.instructions):
                for callee, sources, targets in self._call_sites(
                    computation, position, instruction
                ):
                    for p, slot in enumerate(sources):
                        if slot is not None:
                            origins[callee][p] |= self._arguments(name, slot, mine)
                    for r, slots in enumerate(targets):
                        for slot in slots:
                            reaches[callee][r] |= self._results(name, slot, theirs)
        return {n: d[0] for n, d in done.items()}, {n: d[1] for n, d in done.items()}

    def _call_sites(
        self, computation: Computation, position: int, instruction: Instruction
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
        base = self._graphs[computation.name].base
        operands = self._operand_slots(computation, instruction, base)
        result = list(range(base[position], base[position] + len(instruction.slots)))
        if opcode in ("fusion", "call", "async-start"):
            (callee,) = callees(instruction)
            params = self._param_slots(callee)
            sources: list[int | None] = [operands[i][k] for i, k in params]
            roots = len(self._graphs[callee].root)
            if opcode == "async-start":
                yield callee, sources, [result] * roots
            else:
                yield callee, sources, [[slot] for slot in result[:roots]]
        elif opcode == "while":
            condition = called(instruction, "condition")
            body = called(instruction, "body")
            summary = self._summary(body)
            kept = {r for r, found in enumerate(summary) if r in found}
            yield condition, list(operands[0]), []
            yield (
                body,
                [slot if p in kept else None for p, slot in enumerate(operands[0])],
                [[slot] if r in kept else [] for r, slot in enumerate(result)],
            )
        elif opcode == "conditional":
            for b, branch in enumerate(branches(instruction)):
                yield branch, list(operands[1 + b]), [[slot] for slot in result]

    def _loop(
        self, body: str, origins: list[set[int]], reaches: list[set[int]]
    ) -> None:
        """Carries a loop body's arguments and results around the loop: each
        iteration's parameters are the previous iteration's root."""
        summary = self._summary(body)
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

    def _arguments(
        self, name: str, slot: int, origins: Sequence[frozenset[int]]
    ) -> frozenset[int]:
        found = self._graphs[name].back[slot]
        if not found:
            return frozenset()
        return frozenset().union(*(origins[p] for p in found))

    def _results(
        self, name: str, slot: int, reaches: Sequence[frozenset[int]]
    ) -> frozenset[int]:
        found = self._graphs[name].forward[slot]
        if not found:
            return frozenset()
        return frozenset().union(*(reaches[r] for r in found))

    def flow(self, name: str, position: int) -> tuple[frozenset[int], frozenset[int]]:
        """The entry arguments and results of all slots of one instruction."""
        graph = self._graphs[name]
        n = len(self.module.computations[name].instructions[position].slots)
        slots = range(graph.base[position], graph.base[position] + n)
        arguments = frozenset().union(
            *(self._arguments(name, s, self._origins[name]) for s in slots)
        )
        results = frozenset().union(
            *(self._results(name, s, self._reaches[name]) for s in slots)
        )
        return arguments, results

    # -- what the report reads ---------------------------------------------------

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
        out = []
        for name, position, instruction in self.instructions():
            opcode = instruction.opcode
            kind = _KINDS.get(opcode) or _STARTS.get(opcode)
            if kind is None:
                if (
                    "all-" in opcode or "collective" in opcode or "scatter-" in opcode
                ) and opcode not in _DONES:
                    raise text_error(
                        self.caller,
                        f"an unknown collective {opcode!r}",
                        instruction.line,
                    )
                continue
            out.append(self._collective(name, position, instruction, kind))
        return out

    def _collective(
        self, name: str, position: int, instruction: Instruction, kind: str
    ) -> Collective:
        graph = self._graphs[name]
        slots = list(
            range(graph.base[position], graph.base[position] + len(instruction.slots))
        )
        shapes = instruction.slots
        if instruction.opcode.endswith("-start") and isinstance(
            instruction.shape, list
        ):
            # `(operand, result[, context...])`: the result is element 1.
            result = instruction.shape[1] if kind != "all-reduce" else instruction.shape
            shapes = flatten_shape(result)
            offset = (
                len(flatten_shape(instruction.shape[0])) if kind != "all-reduce" else 0
            )
            slots = slots[offset : offset + len(shapes)]
        origins, reaches = self._origins[name], self._reaches[name]
        arguments = functools.partial(_origins_of, origins)
        parts = tuple(
            Part(
                shape,
                self._arguments(name, slot, origins),
                self._results(name, slot, reaches),
                arguments(graph.producers[slot]),
                arguments(graph.consumers[slot]),
                frozenset().union(*(reaches[r] for r in graph.consumer_results[slot])),
            )
            for shape, slot in zip(shapes, slots, strict=True)
        )
        try:
            if kind == "collective-permute":
                groups = tuple(source_target_pairs(instruction.attrs))
            else:
                groups = tuple(
                    map(tuple, replica_groups(instruction.attrs, self.num_devices))
                )
        except BadLine:
            raise
        except (ValueError, KeyError) as e:
            raise BadLine(str(e), instruction.line) from None
        branch, unknown = self._flags[name]
        return Collective(
            name=instruction.name,
            kind=kind,
            parts=parts,
            count=self._runs[name],
            conditional=branch,
            unknown_trips=unknown,
            groups=groups,
            op_name=op_name(instruction.attrs),
            source=source(instruction.attrs, self.module.sources),
        )
