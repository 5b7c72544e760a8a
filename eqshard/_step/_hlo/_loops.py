"""How many times a `while` loop of a program read by `_text` runs, where
the text does not say.

CPU and GPU programs state a loop's trip count (`backend_config=
{"known_trip_count":{"n":"6"}}`); TPU programs do not: their condition compares
the loop's counter with a constant (`compare(%get-tuple-element.3,
%constant.4), direction=LT`). `loop_trips` reads the count from the program
itself, as XLA's own analysis does: the condition must compare one element of
the loop's tuple with a constant (directly, or inside a fusion it calls), the
loop's initial tuple must give that element a constant, and the body must add
a constant to it. Values are followed through copies, bitcasts, conversions,
tuples and their elements, and fusions. Anything else gives `None`: the loop's
trip count is unknown, and the caller says so.
"""

import dataclasses
import math

from ._text import called, Computation, Instruction, Module


@dataclasses.dataclass(frozen=True)
class _Counter:
    """Element `element` of the loop's tuple, plus `offset`."""

    element: int
    offset: int = 0


# A value: a known integer, the loop's tuple itself, or an element of it.
_LOOP = object()
_Value = int | _Counter | object | None

_PASS = {"copy", "bitcast", "convert", "reshape", "copy-start", "copy-done"}
_FLIP = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE", "EQ": "EQ"}
_DEPTH = 32  # fusions and copies followed before giving up


def _integer(literal: str) -> int | None:
    try:
        return int(literal.strip())
    except ValueError:
        return None


def _value(
    module: Module,
    computation: Computation,
    name: str,
    env: dict[int, _Value],
    depth: int = 0,
) -> _Value:
    """What the instruction `name` of `computation` holds, where its parameter
    `n` holds `env[n]` (`None` where that is not known)."""
    position = computation.index.get(name)
    if position is None or depth > _DEPTH:
        return None
    instruction = computation.instructions[position]
    opcode = instruction.opcode

    def operand(i: int) -> _Value:
        return _value(module, computation, instruction.operands[i], env, depth + 1)

    if opcode == "constant":
        return _integer(instruction.literal)
    if opcode == "parameter":
        return env.get(int(instruction.literal))
    if opcode in _PASS and instruction.operands:
        return operand(0)
    if opcode == "get-tuple-element":
        return _element(module, computation, instruction, env, depth)
    if opcode in ("add", "subtract") and len(instruction.operands) == 2:
        a, b = operand(0), operand(1)
        sign = 1 if opcode == "add" else -1
        if isinstance(a, int) and isinstance(b, int):
            return a + sign * b
        if isinstance(a, _Counter) and isinstance(b, int):
            return _Counter(a.element, a.offset + sign * b)
        if isinstance(a, int) and isinstance(b, _Counter) and sign == 1:
            return _Counter(b.element, b.offset + a)
        return None
    if opcode in ("fusion", "call"):
        key = "calls" if opcode == "fusion" else "to_apply"
        callee = module.computations.get(called(instruction, key))
        if callee is None:
            return None
        inner = {n: operand(n) for n in range(len(instruction.operands))}
        root = callee.instructions[callee.root].name
        return _value(module, callee, root, inner, depth + 1)
    return None


def _element(
    module: Module,
    computation: Computation,
    instruction: Instruction,
    env: dict[int, _Value],
    depth: int,
) -> _Value:
    """A `get-tuple-element`: of the loop's tuple, a counter; of a `tuple`
    instruction, its operand."""
    k = _integer(instruction.attrs.get("index", ""))
    source = computation.index.get(instruction.operands[0])
    if k is None or source is None:
        return None
    tuple_instruction = computation.instructions[source]
    if tuple_instruction.opcode == "parameter":
        if env.get(_integer(tuple_instruction.literal) or 0) is _LOOP:
            return _Counter(k)
        return None
    if tuple_instruction.opcode == "tuple" and k < len(tuple_instruction.operands):
        name = tuple_instruction.operands[k]
        return _value(module, computation, name, env, depth + 1)
    return None


def _compare(
    module: Module, computation: Computation, env: dict[int, _Value], depth: int = 0
) -> tuple[_Counter, str, int] | None:
    """The condition `counter <direction> limit` computed by `computation`'s root
    (a `compare`, or a fusion whose root is one)."""
    root = computation.instructions[computation.root]
    if root.opcode == "fusion" and depth < _DEPTH:
        callee = module.computations.get(called(root, "calls"))
        if callee is None:
            return None
        inner = {
            n: _value(module, computation, name, env)
            for n, name in enumerate(root.operands)
        }
        return _compare(module, callee, inner, depth + 1)
    if root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = root.attrs.get("direction", "").strip()
    a, b = (_value(module, computation, name, env) for name in root.operands)
    if isinstance(b, _Counter) and isinstance(a, int):
        a, b, direction = b, a, _FLIP.get(direction, "")
    if not isinstance(a, _Counter) or not isinstance(b, int):
        return None
    return a, direction, b - a.offset


def _trips(start: int, step: int, direction: str, limit: int) -> int | None:
    """Runs of `for (i = start; i <direction> limit; i += step)`."""
    if direction == "LT" and step > 0:
        return max(0, math.ceil((limit - start) / step))
    if direction == "LE" and step > 0:
        return max(0, (limit - start) // step + 1)
    if direction == "GT" and step < 0:
        return max(0, math.ceil((start - limit) / -step))
    if direction == "GE" and step < 0:
        return max(0, (start - limit) // -step + 1)
    if direction == "NE" and step != 0 and (limit - start) % step == 0:
        runs = (limit - start) // step
        return runs if runs >= 0 else None
    return None


def loop_trips(
    module: Module, computation: Computation, instruction: Instruction
) -> int | None:
    """The trip count of the `while` `instruction` of `computation`, read from
    its condition, its initial tuple and its body; `None` where they are not a
    counter compared with a constant."""
    condition = module.computations.get(called(instruction, "condition"))
    body = module.computations.get(called(instruction, "body"))
    if condition is None or body is None or not instruction.operands:
        return None
    found = _compare(module, condition, {0: _LOOP})
    if found is None:
        return None
    counter, direction, limit = found
    initial = computation.index.get(instruction.operands[0])
    if initial is None:
        return None
    tuple_instruction = computation.instructions[initial]
    if (
        tuple_instruction.opcode != "tuple"
        or len(tuple_instruction.operands) <= counter.element
    ):
        return None
    name = tuple_instruction.operands[counter.element]
    start = _value(module, computation, name, {})
    root = body.instructions[body.root]
    if (
        not isinstance(start, int)
        or root.opcode != "tuple"
        or len(root.operands) <= counter.element
    ):
        return None
    step = _value(module, body, root.operands[counter.element], {0: _LOOP})
    if not isinstance(step, _Counter) or step.element != counter.element:
        return None
    return _trips(start, step.offset, direction, limit)
