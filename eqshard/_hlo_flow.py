"""Reading XLA's compiled program text: its collectives, how often each runs, and
which of the program's arguments and results their data comes from and goes to.

How a program is read:

1. **Parse** (`parse`): `compiled.as_text()` is split into computations of
   instructions (name, opcode, result shape, operands, attributes) and the
   module's table of source locations. Shapes are arrays (`f32[4,8]{1,0}`) or
   tuples of shapes, flattened into *slots*, one per array. Replica groups are
   read in their three spellings: Shardy's `mesh['a'=2,'b'=4] {'b'}` (with
   `device_ids=` and sub-axes), iota `[2,4]<=[8]` (with transposes such as
   `[4,2]<=[2,4]T(1,0)`) and explicit `{{0,1},{2,3}}`. The text is XLA's, not a
   stable API: a line this module does not understand raises `HloTextError`,
   naming the JAX version and the line, rather than giving a wrong report.
2. **Count** (`Program`): how many times each computation runs per step: a
   `while` body as many times as its `known_trip_count` (times the runs of the
   computation holding the loop), a branch of a `conditional` at most once per
   run of its caller (marked), a fusion or call as often as its caller.
3. **Follow the data** (`Program`): inside each computation, edges join the
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
import importlib.metadata
import math
import re
from collections.abc import Iterable, Iterator, Sequence

import jax
import numpy as np


class HloTextError(ValueError):
    """The compiled program's text holds something this module cannot read."""


def text_error(caller: str, what: str, line: str | None = None) -> HloTextError:
    """The one message for text eqshard cannot read, naming the versions."""
    where = "" if line is None else f" The line is:\n    {line.strip()[:400]}"
    versions = f"JAX {jax.__version__}, jaxlib {importlib.metadata.version('jaxlib')}"
    return HloTextError(
        f"eqshard.{caller}: cannot read the compiled program: {what} ({versions}: "
        f"XLA's text format may have changed).{where}\nPlease report it with your "
        "JAX version; meanwhile `compiled.as_text()` shows the program."
    )


# ---------------------------------------------------------------------------------
# Shapes.
# ---------------------------------------------------------------------------------

# Bits per element as XLA stores them (sub-byte types take a byte unless the
# layout packs them, `E(4)`).
_BITS: dict[str, int] = dict.fromkeys(("s2", "u2"), 2)
_BITS |= dict.fromkeys(("s4", "u4", "f4e2m1fn"), 4)
_BITS |= dict.fromkeys(
    "pred s8 u8 f8e3m4 f8e4m3 f8e4m3fn f8e4m3fnuz f8e4m3b11fnuz f8e5m2 f8e5m2fnuz "
    "f8e8m0fnu".split(),
    8,
)
_BITS |= dict.fromkeys(("s16", "u16", "bf16", "f16"), 16)
_BITS |= dict.fromkeys(("s32", "u32", "f32"), 32)
_BITS |= dict.fromkeys(("s64", "u64", "f64", "c64"), 64) | {"c128": 128, "token": 0}


@dataclasses.dataclass(frozen=True)
class ArrayShape:
    """One array of a result: XLA's element type (`f32`), dimensions, and its
    bytes on one device as the program stores it."""

    dtype: str
    dims: tuple[int, ...]
    nbytes: int


_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def _skip_braces(text: str, pos: int) -> int:
    """The position after the balanced `{...}` starting at `pos`."""
    depth = 0
    for i in range(pos, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


ShapeTree = ArrayShape | list["ShapeTree"]


def parse_shape(text: str, pos: int = 0) -> tuple[ShapeTree, int]:
    """The shape at `pos` (an array, or a list of the shapes of a tuple) and the
    position after it. Raises `ValueError` on what is not a shape."""
    if text.startswith("(", pos):
        elements: list[ShapeTree] = []
        pos += 1
        while not text.startswith(")", pos):
            element, pos = parse_shape(text, pos)
            elements.append(element)
            while pos < len(text) and text[pos] in ", ":
                pos += 1
        return elements, pos + 1
    match = _ARRAY.match(text, pos)
    if match is None or match[1] not in _BITS:
        raise ValueError(f"not a shape at {text[pos : pos + 40]!r}")
    dims = tuple(int(d.strip().removeprefix("<=")) for d in match[2].split(",") if d)
    pos = match.end()
    bits = max(_BITS[match[1]], 8) if _BITS[match[1]] else 0
    if text.startswith("{", pos):  # the layout, which may pack sub-byte types
        end = _skip_braces(text, pos)
        packed = re.search(r"E\((\d+)\)", text[pos:end])
        if packed is not None:
            bits = int(packed[1])
        pos = end
    count = math.prod(dims)
    return ArrayShape(match[1], dims, (count * bits + 7) // 8), pos


def flatten_shape(tree: ShapeTree) -> list[ArrayShape]:
    if isinstance(tree, ArrayShape):
        return [tree]
    return [array for element in tree for array in flatten_shape(element)]


# ---------------------------------------------------------------------------------
# Instructions and computations.
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Instruction:
    """One line of a computation. Its attributes are read when first asked for
    (most instructions are never asked)."""

    name: str
    opcode: str
    shape: ShapeTree
    slots: list[ArrayShape]  # the arrays of the result, a tuple flattened
    operands: list[str]  # the names of the operand instructions
    literal: str  # the text between the parentheses when it names no operand
    rest: str  # the attributes' text
    line: str

    @functools.cached_property
    def attrs(self) -> dict[str, str]:
        """`key=value` attributes; `ValueError` on a piece that is not one."""
        attrs: dict[str, str] = {}
        for piece in _split_top(self.rest, 0, None)[0]:
            piece = piece.strip()
            if not piece:
                continue
            key = _KEY.match(piece)
            if key is None:
                raise BadLine(f"an attribute without a name: {piece[:60]!r}", self.line)
            attrs[key[1]] = piece[key.end() :]
        return attrs


class BadLine(ValueError):
    """A line of the text that cannot be read, with what is wrong."""

    def __init__(self, what: str, line: str):
        super().__init__(what)
        self.what, self.line = what, line


@dataclasses.dataclass(eq=False)
class Computation:
    name: str
    instructions: list[Instruction]
    index: dict[str, int]  # name -> position in `instructions`
    params: list[int]  # positions of the parameters, by parameter number
    root: int  # position of the root


_COMMENT = re.compile(r"/\*.*?\*/")
_HEAD = re.compile(r"\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
# The shape, then the opcode: the first lower-case word before a parenthesis
# (layouts write upper-case `T(8,128)`, `E(4)`, `S(1)`).
_OPCODE = re.compile(r"(.*?)\s+([a-z][a-z0-9\-]*)\(")
_OPERAND = re.compile(r"%([\w.\-]+)")
_KEY = re.compile(r"([\w\-]+)=")
_CLOSE = {"(": ")", "{": "}", "[": "]"}
_SPECIAL = re.compile(r"[\"'(){}\[\],]")
_QUOTED = {q: re.compile(rf"{q}(?:[^{q}\\]|\\.)*{q}") for q in "\"'"}


def _split_top(text: str, pos: int, stop: str | None) -> tuple[list[str], int]:
    """Splits `text` from `pos` at commas outside brackets and quotes, until the
    closing `stop` (or the end); the pieces and the position after `stop`."""
    pieces: list[str] = []
    depth: list[str] = []
    start = i = pos
    while (found := _SPECIAL.search(text, i)) is not None:
        c, i = found[0], found.start()
        if c in _QUOTED:
            quoted = _QUOTED[c].match(text, i)
            i = len(text) if quoted is None else quoted.end()
            continue
        if c in _CLOSE:
            depth.append(_CLOSE[c])
        elif depth and c == depth[-1]:
            depth.pop()
        elif not depth and c == stop:
            pieces.append(text[start:i])
            return pieces, i + 1
        elif not depth and c == ",":
            pieces.append(text[start:i])
            start = i + 1
        i += 1
    if stop is not None:
        raise ValueError(f"no closing {stop!r}")
    pieces.append(text[start:])
    return pieces, len(text)


def parse_instruction(
    line: str, shapes: dict[str, tuple[ShapeTree, list[ArrayShape]]] | None = None
) -> Instruction:
    """One instruction line; `ValueError` if it is not one. `shapes` caches the
    shapes read (a program repeats a few shapes many times)."""
    text = _COMMENT.sub("", line) if "/*" in line else line
    head = _HEAD.match(text)
    if head is None:
        raise ValueError("not an instruction")
    opcode = _OPCODE.match(text, head.end())
    if opcode is None:
        raise ValueError("no opcode after the shape")
    shape_text = opcode[1]
    known = None if shapes is None else shapes.get(shape_text)
    if known is None:
        tree, end = parse_shape(shape_text)
        if end != len(shape_text):
            raise ValueError(f"not a shape: {shape_text[:60]!r}")
        known = (tree, flatten_shape(tree))
        if shapes is not None:
            shapes[shape_text] = known
    inside, pos = _split_top(text, opcode.end(), ")")
    operands = [m[1] for piece in inside for m in [_OPERAND.search(piece)] if m]
    return Instruction(
        name=head[2],
        opcode=opcode[2],
        shape=known[0],
        slots=known[1],
        operands=operands,
        literal="" if operands else ",".join(inside).strip(),
        rest=text[pos:],
        line=line,
    )


_COMPUTATION = re.compile(r"(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*)?\{\s*$")
_ENTRY = re.compile(r"(\d+) (.*)$")
_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


@dataclasses.dataclass(eq=False)
class Module:
    computations: dict[str, Computation]
    entry: str
    sources: dict[int, str]  # stack frame id -> "file:line"


def _unquote(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return text[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    return text


def _fields(text: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+?)[\s}]", text + " "))


def _sources(tables: dict[str, dict[int, str]]) -> dict[int, str]:
    """Stack frame id -> "file:line" of its innermost location."""
    files = {k: _unquote(v) for k, v in tables.get("FileNames", {}).items()}
    locations = {}
    for k, v in tables.get("FileLocations", {}).items():
        fields = _fields(v)
        name = files.get(int(fields.get("file_name_id", "0")), "?")
        locations[k] = f"{name}:{fields.get('line', '?')}"
    out = {}
    for k, v in tables.get("StackFrames", {}).items():
        location = int(_fields(v).get("file_location_id", "0"))
        if location in locations:
            out[k] = locations[location]
    return out


def parse(text: str, *, caller: str) -> Module:
    """The module of `compiled.as_text()`; raises `HloTextError` on a line it
    cannot read."""
    computations: dict[str, Computation] = {}
    entry = None
    tables: dict[str, dict[int, str]] = {}
    section = None
    current: Computation | None = None
    shapes: dict[str, tuple[ShapeTree, list[ArrayShape]]] = {}
    for line in text.splitlines():
        stripped = line.strip()
        if current is not None:
            if stripped == "}":
                if current.root < 0:
                    raise text_error(caller, f"{current.name} has no ROOT", line)
                computations[current.name] = current
                current = None
                continue
            if not stripped:
                continue
            try:
                instruction = parse_instruction(line, shapes)
            except ValueError as e:
                raise text_error(caller, str(e), line) from None
            position = len(current.instructions)
            current.instructions.append(instruction)
            current.index[instruction.name] = position
            if stripped.startswith("ROOT "):
                current.root = position
            if instruction.opcode == "parameter":
                number = int(instruction.literal)
                current.params.extend([-1] * (number + 1 - len(current.params)))
                current.params[number] = position
            continue
        if not stripped:
            section = None
            continue
        if stripped.startswith("HloModule "):
            continue
        if stripped in _SECTIONS:
            section = tables.setdefault(stripped, {})
            continue
        if section is not None:
            match = _ENTRY.match(stripped)
            if match is None:
                raise text_error(caller, "an unreadable source-location entry", line)
            section[int(match[1])] = match[2]
            continue
        match = _COMPUTATION.match(stripped)
        if match is None:
            raise text_error(caller, "a line outside any computation", line)
        current = Computation(match[2], [], {}, [], -1)
        if match[1]:
            entry = match[2]
    if current is not None:
        raise text_error(caller, f"the computation {current.name} does not end")
    if entry is None:
        raise text_error(caller, "no ENTRY computation")
    for computation in computations.values():
        if -1 in computation.params:
            raise text_error(caller, f"{computation.name} misses a parameter")
    return Module(computations, entry, _sources(tables))


# ---------------------------------------------------------------------------------
# Attributes.
# ---------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


def _iota(reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    ids = np.arange(int(np.prod(reshape)), dtype=np.int64).reshape(reshape)
    return ids if perm is None else ids.transpose(perm)


_IOTA_GROUPS = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?$")
_MESH = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\](?:\s*,\s*device_ids=\((?P<ids>[^)]*(?:\([^)]*\))?)\))?"
    r"\s*\{(?P<group>[^}]*)\}$"
)
_MESH_AXIS = re.compile(r"'?([^'=,]+)'?=(\d+)")
_GROUP_AXIS = re.compile(r"'?([^':,]+)'?(?::\((\d+)\)(\d+))?")


def _mesh_groups(match: re.Match[str]) -> list[list[int]]:
    """Shardy's `mesh[...] {axes}`: the devices that differ only along the listed
    axes (or sub-axes `'a':(pre)size`) form a group, ordered as listed."""
    names, sizes = [], []
    for name, size in _MESH_AXIS.findall(match["axes"]):
        names.append(name.strip())
        sizes.append(int(size))
    ids_text = (match["ids"] or "").strip()
    if not ids_text:
        devices = np.arange(int(np.prod(sizes)), dtype=np.int64)
    elif iota := re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", ids_text):
        perm = _ints(iota[2]) if iota[2] else None
        devices = _iota(_ints(iota[1]), perm).reshape(-1)
    else:
        devices = np.asarray(_ints(ids_text), dtype=np.int64)
    if devices.size != int(np.prod(sizes)):
        raise ValueError("the mesh's device ids do not fill it")
    # Each mesh axis is split at the sub-axes the group names (a sub-axis
    # `(pre)size` has `pre` devices' worth of more major sub-axes before it), so
    # the device array has one dimension per piece, major to minor; the grouped
    # pieces are moved last, in the order listed.
    grouped: list[tuple[int, int]] = []  # (axis, pre-size)
    cuts: list[set[int]] = [{1, size} for size in sizes]
    for name, pre, size in _GROUP_AXIS.findall(match["group"]):
        name = name.strip()
        if not name:
            continue
        if name not in names:
            raise ValueError(f"the group names an axis {name!r} the mesh lacks")
        axis = names.index(name)
        if pre:
            cuts[axis] |= {int(pre), int(pre) * int(size)}
        grouped.append((axis, int(pre or 1)))
    dims: list[int] = []
    where: dict[tuple[int, int], int] = {}  # (axis, pre-size) -> dimension
    for axis, points in enumerate(cuts):
        points = sorted(points)
        pieces = zip(points, points[1:], strict=False) if len(points) > 1 else [(1, 1)]
        for lo, hi in pieces:
            where[(axis, lo)] = len(dims)
            dims.append(hi // lo)
    array = devices.reshape(dims)
    keep = [where[key] for key in grouped]
    rest = [d for d in range(len(dims)) if d not in keep]
    size = int(np.prod([dims[d] for d in keep], dtype=np.int64))
    return array.transpose(rest + keep).reshape(-1, size).tolist()


def replica_groups(attrs: dict[str, str], num_devices: int) -> list[list[int]]:
    """The device groups of a collective, in any of XLA's three spellings; `{}`
    (or none) is one group of all devices. `ValueError` on another spelling."""
    text = attrs.get("replica_groups", "{}").strip()
    if text.startswith("mesh[") and "device_ids" in attrs:
        text = f"{text}, device_ids={attrs['device_ids'].strip()}"
    if text in ("{}", "{{}}"):
        return [list(range(num_devices))]
    if text.startswith("{"):
        groups = re.findall(r"\{([\d,\s]*)\}", text[1:-1])
        if "{" not in text[1:] or not groups:
            raise ValueError(f"unreadable replica groups {text[:80]!r}")
        return [_ints(group) for group in groups]
    iota = _IOTA_GROUPS.match(text)
    if iota is not None:
        shape = _ints(iota[1])
        perm = _ints(iota[3]) if iota[3] else None
        return _iota(_ints(iota[2]), perm).reshape(shape).tolist()
    mesh = _MESH.match(text)
    if mesh is not None:
        return _mesh_groups(mesh)
    raise ValueError(f"unreadable replica groups {text[:80]!r}")


def source_target_pairs(attrs: dict[str, str]) -> list[tuple[int, int]]:
    pairs = re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", attrs["source_target_pairs"])
    return [(int(a), int(b)) for a, b in pairs]


def trip_count(attrs: dict[str, str]) -> int | None:
    found = re.search(
        r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)',
        attrs.get("backend_config", ""),
    )
    return None if found is None else int(found[1])


def op_name(attrs: dict[str, str]) -> str:
    found = re.search(r'op_name="((?:[^"\\]|\\.)*)"', attrs.get("metadata", ""))
    return "" if found is None else found[1].replace('\\"', '"')


def source(attrs: dict[str, str], sources: dict[int, str]) -> str:
    """Where the instruction comes from in the user's code, `file:line`, if XLA
    kept it (as a stack frame, or as `source_file`/`source_line`)."""
    metadata = attrs.get("metadata", "")
    frame = re.search(r"stack_frame_id=(\d+)", metadata)
    if frame is not None and int(frame[1]) in sources:
        return sources[int(frame[1])]
    file = re.search(r'source_file="((?:[^"\\]|\\.)*)"', metadata)
    line = re.search(r"source_line=(\d+)", metadata)
    if file is not None:
        return f"{file[1]}:{line[1]}" if line is not None else file[1]
    return ""


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


_CALLED = {
    key: re.compile(rf"(?:^|,)\s*{key}=%([\w.\-]+)")
    for key in ("calls", "to_apply", "condition", "body")
    + ("true_computation", "false_computation")
}


def _called(instruction: Instruction, key: str) -> str:
    """The computation named by the attribute `key` (read without parsing the
    other attributes: a fusion's metadata is long)."""
    found = _CALLED[key].search(instruction.rest)
    if found is None:
        raise BadLine(f"{instruction.opcode} without {key}=", instruction.line)
    return found[1]


def _callees(instruction: Instruction) -> list[str]:
    """The computations an instruction runs (not the reducers of `to_apply`,
    which are scalar functions, except for `call`)."""
    opcode = instruction.opcode
    if opcode in ("fusion", "async-start"):
        return [_called(instruction, "calls")]
    if opcode == "call":
        return [_called(instruction, "to_apply")]
    if opcode == "while":
        return [_called(instruction, "condition"), _called(instruction, "body")]
    if opcode == "conditional":
        return _branches(instruction)
    if opcode == "custom-call":
        return _OPERAND.findall(instruction.attrs.get("called_computations", ""))
    return []


def _branches(instruction: Instruction) -> list[str]:
    attrs = instruction.attrs
    if "branch_computations" in attrs:
        return _OPERAND.findall(attrs["branch_computations"])
    return [
        _called(instruction, "true_computation"),
        _called(instruction, "false_computation"),
    ]


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
            _called(instruction, "body")
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
                for callee in _callees(instruction):
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
            (callee,) = _callees(instruction)
            params = self._param_slots(callee)
            return [
                [slots[i][k] for i, k in (params[p] for p in sources)]
                for sources in self._summary(callee, strict)
            ]
        if opcode == "async-start":
            return each([slot for operand in slots for slot in operand])
        if opcode == "while":
            body = _called(instruction, "body")
            return [
                [slots[0][p] for p in sources]
                for sources in _closure(self._summary(body, strict))
            ]
        if opcode == "conditional":
            out: list[list[int]] = [[] for _ in range(n)]
            for b, branch in enumerate(_branches(instruction)):
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
                (callee,) = _callees(instruction)
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
            for source in inputs[slot]:
                reach[source] |= reach[slot]
                consumers[source] |= consumers[slot]
                consumer_results[source] |= consumer_results[slot]
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
                callees = _callees(instruction)
                if not callees:
                    continue
                times, (branch, unknown) = runs[name], flags[name]
                if instruction.opcode == "while":
                    trips = trip_count(instruction.attrs)
                    if trips is None:
                        trips, unknown = 1, True
                    condition = _called(instruction, "condition")
                    body = _called(instruction, "body")
                    each = {condition: times * (trips + 1), body: times * trips}
                else:
                    branch = branch or instruction.opcode == "conditional"
                    each = dict.fromkeys(callees, times)
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
            (callee,) = _callees(instruction)
            params = self._param_slots(callee)
            sources: list[int | None] = [operands[i][k] for i, k in params]
            roots = len(self._graphs[callee].root)
            if opcode == "async-start":
                yield callee, sources, [result] * roots
            else:
                yield callee, sources, [[slot] for slot in result[:roots]]
        elif opcode == "while":
            condition = _called(instruction, "condition")
            body = _called(instruction, "body")
            summary = self._summary(body)
            kept = {r for r, found in enumerate(summary) if r in found}
            yield condition, list(operands[0]), []
            yield (
                body,
                [slot if p in kept else None for p, slot in enumerate(operands[0])],
                [[slot] if r in kept else [] for r, slot in enumerate(result)],
            )
        elif opcode == "conditional":
            for b, branch in enumerate(_branches(instruction)):
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
