"""The work of a compiled program read by `_flow`: the floating-point
operations of its dots and convolutions, and the HBM bytes each scheduled op
reads and writes, per run, with the runs per step of the computation holding
it (a loop's body: its trip count).

What is counted (`op_costs`):

- **FLOPs**: a `dot` (or a cuBLAS/cuDNN gemm custom-call) does
  `2 * prod(result dims) * prod(lhs contracting dims)`; a `convolution` (TPU
  writes most dots as one, `dim_labels=bf_io->bf`) `2 * prod(result dims) *
  prod(rhs dims) / rhs output features`, the window's taps that meet the
  padded and dilated input counted (TPU writes batched matmuls as
  convolutions whose window spans the batch). Each is counted where it runs: inside
  the fusion that holds it, at that fusion's runs. Elementwise work,
  reductions and transcendental functions are not counted: they are the
  memory-bound ops' bytes below. Each dot is keyed by its operands' type
  (`"bf16"`, `"fp8"`, `"int8"`, `"f32"`, with the HLO precision of an f32 dot:
  `"f32:highest"`).
- **Bytes**: an op of a scheduled computation (the entry, loop bodies,
  called computations, not fusion bodies) reads its operands and writes its
  results, except where it slices: a fusion parameter only sliced inside
  (`dynamic-slice`, `slice`, `gather`) is read as its slices, a buffer updated
  in place (`dynamic-update-slice`) costs its update, as XLA's own cost
  analysis counts them. Collectives, host copies and ops that move no data
  (tuples, bitcasts, loops, parameters) are left to the collective model or
  cost nothing.
"""

import dataclasses
import functools
import math
import re

import numpy as np

from ._graph import DONES, KINDS, STARTS
from ._text import callees, Computation, Instruction, Module


@dataclasses.dataclass(frozen=True)
class OpCost:
    """One scheduled op: its FLOPs by operand type and HBM bytes per run, and
    its runs per step."""

    name: str
    flops: tuple[tuple[str, float], ...]  # (operand type, FLOPs) per run
    bytes: int
    runs: int

    @property
    def total_flops(self) -> float:
        return sum((f for _, f in self.flops), 0.0)


_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
    "call", "conditional", "after-all", "partition-id", "replica-id",
    "copy-start", "copy-done", "send", "send-done", "recv", "recv-done",
    "opt-barrier", "add-dependency", "domain", "async-start", "async-update",
} | set(KINDS) | set(STARTS) | DONES  # fmt: skip
_SLICES = {"dynamic-slice", "slice", "gather"}
_GEMMS = re.compile(r"__cublas\$|__cudnn\$conv|__cublas\$lt")
_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')


def operand_type(dtype: str, precision: str) -> str:
    """The key of a dot's operands' type, as `Chip.peaks` names them."""
    if dtype.startswith("f8") or dtype.startswith("f4"):
        return "fp8"
    if dtype in ("bf16", "f16"):
        return "bf16"
    if dtype in ("s8", "u8", "s4", "u4"):
        return "int8"
    if dtype == "f32":
        return f"f32:{precision}" if precision != "default" else "f32"
    return dtype


class _Reader:
    """Costs of one module's ops, computations' FLOPs cached."""

    def __init__(self, module: Module):
        self.module = module

    def operand(self, computation: Computation, name: str) -> Instruction | None:
        position = computation.index.get(name)
        return None if position is None else computation.instructions[position]

    def _dims(self, computation: Computation, name: str) -> tuple[int, ...]:
        found = self.operand(computation, name)
        if found is None or not found.slots:
            return ()
        return found.slots[0].dims

    def op_flops(
        self, computation: Computation, instruction: Instruction
    ) -> dict[str, float]:
        """The FLOPs of one instruction by operand type (a fusion's: its
        body's)."""
        opcode = instruction.opcode
        if opcode in ("fusion", "async-start") or (
            opcode == "custom-call" and not _GEMMS.search(instruction.rest)
        ):
            out: dict[str, float] = {}
            for callee in callees(instruction):
                for key, value in self.computation_flops(callee):
                    out[key] = out.get(key, 0.0) + value
            return out
        if opcode not in ("dot", "convolution", "custom-call"):
            return {}
        if not instruction.slots or not instruction.operands:
            return {}
        result = math.prod(instruction.slots[0].dims)
        lhs = self.operand(computation, instruction.operands[0])
        dtype = lhs.slots[0].dtype if lhs is not None and lhs.slots else "f32"
        if opcode == "convolution":
            inner = self._convolution_inner(computation, instruction)
        else:
            inner = self._contracted(computation, instruction)
        precision = _precision(instruction)
        return {operand_type(dtype, precision): 2.0 * result * inner}

    def _contracted(self, computation: Computation, instruction: Instruction) -> int:
        lhs = self._dims(computation, instruction.operands[0])
        if instruction.opcode == "dot":
            text = instruction.attrs.get("lhs_contracting_dims", "{}")
            dims = [int(d) for d in re.findall(r"\d+", text)]
        else:
            found = _CONTRACTING.search(instruction.rest)
            dims = (
                [] if found is None else [int(d) for d in re.findall(r"\d+", found[1])]
            )
        return math.prod(lhs[d] for d in dims if d < len(lhs))

    def _convolution_inner(
        self, computation: Computation, instruction: Instruction
    ) -> float:
        """Multiplies per result element: the kernel's size per output
        feature."""
        if len(instruction.operands) < 2:
            return 0
        rhs = self._dims(computation, instruction.operands[1])
        labels = instruction.attrs.get("dim_labels", "")
        parts = labels.split("->")[0].split("_")
        kernel = parts[1] if len(parts) == 2 else ""
        o = kernel.find("o")
        if not rhs or o < 0 or o >= len(rhs) or rhs[o] == 0:
            return 0
        inner = math.prod(rhs) / rhs[o]
        sizes = _window_field(instruction, "size")
        if math.prod(sizes) <= 1:
            return inner
        # A padded or dilated input (TPU writes batched matmuls so: their
        # batch dimensions as a window over a padded or dilated input) meets
        # only some of the window's taps: count them.
        lhs = self._dims(computation, instruction.operands[0])
        taps = _taps(instruction, labels, lhs, sizes)
        return inner / math.prod(sizes) * taps

    @functools.cache  # noqa: B019 - one reader per program, dropped with it
    def computation_flops(self, name: str) -> tuple[tuple[str, float], ...]:
        computation = self.module.computations[name]
        out: dict[str, float] = {}
        for instruction in computation.instructions:
            for key, value in self.op_flops(computation, instruction).items():
                out[key] = out.get(key, 0.0) + value
        return tuple(sorted(out.items()))

    @functools.cache  # noqa: B019
    def has_collective(self, name: str) -> bool:
        computation = self.module.computations[name]
        for instruction in computation.instructions:
            if instruction.opcode in KINDS or instruction.opcode in STARTS:
                return True
            if any(self.has_collective(c) for c in callees(instruction)):
                return True
        return False

    @functools.cache  # noqa: B019
    def users(self, name: str) -> dict[str, list[Instruction]]:
        out: dict[str, list[Instruction]] = {}
        for instruction in self.module.computations[name].instructions:
            for operand in instruction.operands:
                out.setdefault(operand, []).append(instruction)
        return out

    def op_bytes(self, computation: Computation, instruction: Instruction) -> int:
        """HBM bytes one run of a scheduled op reads and writes."""
        opcode = instruction.opcode
        if opcode in _FREE:
            return 0
        reads = [self._bytes(computation, name) for name in instruction.operands]
        writes = sum(slot.nbytes for slot in instruction.slots)
        if opcode in _SLICES:
            return 2 * writes
        if opcode == "dynamic-update-slice" and len(reads) > 1:
            return 2 * reads[1]
        if opcode != "fusion":
            return sum(reads) + writes
        (callee,) = callees(instruction)
        if self.has_collective(callee):
            return 0
        body = self.module.computations[callee]
        users = self.users(callee)
        total = 0
        for k, read in enumerate(reads):
            if k >= len(body.params):
                break
            total += _parameter_bytes(body, k, read, users)
        return total + _root_bytes(body, writes)

    def _bytes(self, computation: Computation, name: str) -> int:
        found = self.operand(computation, name)
        return 0 if found is None else sum(slot.nbytes for slot in found.slots)


def _window_field(instruction: Instruction, name: str) -> list[int]:
    """The numbers of one field of a convolution's `window={size=3x3 ...}`
    (a `pad=1_1x0_0` gives its low sides)."""
    window = instruction.attrs.get("window", "")
    found = re.search(rf"(?:^|[\s{{]){name}=([\d_x-]+)", window)
    if found is None:
        return []
    return [int(n.split("_")[0]) for n in found[1].split("x")]


def _taps(
    instruction: Instruction, labels: str, lhs: tuple[int, ...], sizes: list[int]
) -> float:
    """The mean number of the window's taps per output element that meet the
    (dilated, padded) input, over all outputs: per window dimension, each
    output's taps counted (few outputs and taps: batch dimensions)."""
    n = len(sizes)
    ones = [1] * n
    stride = _window_field(instruction, "stride") or ones
    pad = _window_field(instruction, "pad") or [0] * n
    dilate = _window_field(instruction, "lhs_dilate") or ones
    spread = _window_field(instruction, "rhs_dilate") or ones
    inputs, _, outputs = labels.partition("->")
    inputs = inputs.split("_")[0]
    result = instruction.slots[0].dims
    taps = 1.0
    for k in range(n):
        where, out = inputs.find(str(k)), outputs.find(str(k))
        if where < 0 or out < 0 or where >= len(lhs) or out >= len(result):
            return float(math.prod(sizes))
        length = (lhs[where] - 1) * dilate[k] + 1
        m = result[out]
        if m * sizes[k] > 1 << 20:
            taps *= min(sizes[k], -(-sizes[k] // dilate[k]))
            continue
        index = (
            np.arange(m)[:, None] * stride[k]
            + np.arange(sizes[k])[None, :] * spread[k]
            - pad[k]
        )
        real = (index >= 0) & (index < length) & (index % dilate[k] == 0)
        taps *= float(real.sum()) / m
    return taps


def _precision(instruction: Instruction) -> str:
    text = instruction.attrs.get("operand_precision", "").lower()
    for level in ("highest", "high"):
        if level in text:
            return level
    algorithm = instruction.attrs.get("algorithm", "").lower()
    if "x6" in algorithm or "f32_f32_f32" in algorithm:
        return "highest"
    if "x3" in algorithm:
        return "high"
    return "default"


def _parameter_bytes(
    body: Computation, k: int, read: int, users: dict[str, list[Instruction]]
) -> int:
    """What a fusion reads of its parameter `k` (`read` bytes): its slices
    where it is only sliced, nothing where it is only updated in place."""
    name = body.instructions[body.params[k]].name
    found = users.get(name, [])
    if found and all(u.opcode in _SLICES and u.operands[0] == name for u in found):
        return sum(slot.nbytes for u in found for slot in u.slots)
    if found and all(
        u.opcode == "dynamic-update-slice" and u.operands[0] == name for u in found
    ):
        return 0
    return read


def _root_bytes(body: Computation, writes: int) -> int:
    """What a fusion writes: an in-place update's update, else its results."""
    root = body.instructions[body.root]
    produced = [root]
    if root.opcode == "tuple":
        produced = [
            body.instructions[body.index[name]]
            for name in root.operands
            if name in body.index
        ]
    if not any(p.opcode == "dynamic-update-slice" for p in produced):
        return writes
    total = 0
    for p in produced:
        if p.opcode == "dynamic-update-slice" and len(p.operands) > 1:
            update = body.instructions[body.index[p.operands[1]]]
            total += sum(slot.nbytes for slot in update.slots)
        else:
            total += sum(slot.nbytes for slot in p.slots)
    return total


def op_costs(module: Module, runs: dict[str, int]) -> list[OpCost]:
    """The cost of every op of the scheduled computations of `module` (those
    `runs` counts, except fusion and async bodies), with its runs per step."""
    reader = _Reader(module)
    fused = {
        callee
        for name in runs
        for instruction in module.computations[name].instructions
        if instruction.opcode in ("fusion", "async-start", "custom-call")
        for callee in callees(instruction)
    }
    out = []
    for name, count in runs.items():
        if name in fused or count == 0:
            continue
        computation = module.computations[name]
        for instruction in computation.instructions:
            flops = reader.op_flops(computation, instruction)
            nbytes = reader.op_bytes(computation, instruction)
            if flops or nbytes:
                out.append(
                    OpCost(
                        instruction.name, tuple(sorted(flops.items())), nbytes, count
                    )
                )
    return out
