"""Reading XLA's compiled program text (`compiled.as_text()`) into computations of
instructions, and the attributes of an instruction that eqshard asks for.

How the text is read (`parse`): the text is split into computations of
instructions (name, opcode, result shape, operands, attributes) and the module's
table of source locations. Shapes are arrays (`f32[4,8]{1,0}`) or tuples of
shapes, flattened into *slots*, one per array. An instruction's attributes are
read when first asked for: the computations it calls (`callees`), its replica
groups in their three spellings (Shardy's `mesh['a'=2,'b'=4] {'b'}`, with
`device_ids=` and sub-axes; iota `[2,4]<=[8]`, with transposes such as
`[4,2]<=[2,4]T(1,0)`; and explicit `{{0,1},{2,3}}`), a permute's source-target
pairs, a loop's trip count, and the op name and source location of the user's
code (the innermost frame outside eqshard's own files, so that the collectives
of `dot_product_attention` or `pipeline` are named by the line that called
them). The text is XLA's, not a stable API: a line this module does not
understand raises `HloTextError`, naming the JAX version and the line, rather
than giving a wrong report. `_flow` follows the data through what is read.
"""

import dataclasses
import functools
import importlib.metadata
import math
import os
import re
from collections.abc import Sequence

import beartype
import jax
import jaxtyping
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
    thread: str = "main"  # the execution thread (TPU's "sparsecore", ...)


_COMMENT = re.compile(r"/\*.*?\*/")
# A computation's end, with the execution thread it runs on when not the main
# one: `}, execution_thread="sparsecore"`.
_END = re.compile(r'\}(?:\s*,\s*execution_thread="([\w\-.]+)")?')
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


# eqshard's own source files: a frame in them (the attention's permutes, a
# pipeline's, a constraint) is named by the user's line that called eqshard.
# (This module is `eqshard/_step/_hlo/_text.py`: the package is three folders up.)
# So is a frame of the type checks around a public function: beartype's wrapper
# (`@typecheck`) names its code `<@beartype(eqshard.name) at 0x...>`, and
# jaxtyping's lives in its package.
_OWN = os.path.join(os.path.abspath(os.path.join(__file__, *[os.pardir] * 3)), "")
_CHECKS = ("<@beartype(eqshard.",) + tuple(
    os.path.join(os.path.dirname(os.path.abspath(module.__file__ or "")), "")
    for module in (beartype, jaxtyping)
)


def _sources(tables: dict[str, dict[int, str]]) -> dict[int, str]:
    """Stack frame id -> "file:line" of its innermost location outside
    eqshard's own files and their type checks (the innermost one if every frame
    is eqshard's).

    A frame's `parent_frame_id` is printed one above its parent's id (0 and 1
    mean none), as JAX 0.10's XLA writes the table."""
    files = {k: _unquote(v) for k, v in tables.get("FileNames", {}).items()}
    locations = {}
    for k, v in tables.get("FileLocations", {}).items():
        fields = _fields(v)
        name = files.get(int(fields.get("file_name_id", "0")), "?")
        locations[k] = f"{name}:{fields.get('line', '?')}"
    frames = {}
    for k, v in tables.get("StackFrames", {}).items():
        fields = _fields(v)
        frames[k] = (
            int(fields.get("file_location_id", "0")),
            int(fields.get("parent_frame_id", "0")) - 1,
        )
    out = {}
    for k, (location, _) in frames.items():
        if location in locations:
            out[k] = _outside(k, frames, locations) or locations[location]
    return out


def _outside(
    frame: int, frames: dict[int, tuple[int, int]], locations: dict[int, str]
) -> str | None:
    """The innermost location of `frame`'s stack outside eqshard's files and
    their type checks."""
    seen = set()
    while frame in frames and frame not in seen:
        seen.add(frame)
        location, parent = frames[frame]
        where = locations.get(location)
        if where is not None and not where.startswith((_OWN, *_CHECKS)):
            return where
        frame = parent
    return None


def _append(
    computation: Computation,
    line: str,
    shapes: dict[str, tuple[ShapeTree, list[ArrayShape]]],
    *,
    caller: str,
) -> None:
    """Adds the instruction of `line` to `computation`."""
    try:
        instruction = parse_instruction(line, shapes)
    except ValueError as e:
        raise text_error(caller, str(e), line) from None
    position = len(computation.instructions)
    computation.instructions.append(instruction)
    computation.index[instruction.name] = position
    if line.strip().startswith("ROOT "):
        computation.root = position
    if instruction.opcode == "parameter":
        number = int(instruction.literal)
        computation.params.extend([-1] * (number + 1 - len(computation.params)))
        computation.params[number] = position


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
            end = _END.fullmatch(stripped)
            if end is not None:
                if current.root < 0:
                    raise text_error(caller, f"{current.name} has no ROOT", line)
                current.thread = end[1] or current.thread
                computations[current.name] = current
                current = None
                continue
            if stripped:
                _append(current, line, shapes, caller=caller)
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


def frontend_attributes(attrs: dict[str, str]) -> dict[str, str]:
    """The `frontend_attributes={key="value",...}` of an instruction, values
    unquoted (`{}` without them); `ValueError` on a piece that is no `key=`."""
    text = attrs.get("frontend_attributes", "").strip()
    if not text.startswith("{"):
        return {}
    out: dict[str, str] = {}
    for piece in _split_top(text, 1, "}")[0]:
        key, equals, value = piece.partition("=")
        if piece.strip() and not equals:
            raise ValueError(f"a frontend attribute without a name: {piece[:60]!r}")
        if equals:
            out[key.strip()] = _unquote(value)
    return out


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


_CALLED = {
    key: re.compile(rf"(?:^|,)\s*{key}=%([\w.\-]+)")
    for key in ("calls", "to_apply", "condition", "body")
    + ("true_computation", "false_computation")
}


def called(instruction: Instruction, key: str) -> str:
    """The computation named by the attribute `key` (read without parsing the
    other attributes: a fusion's metadata is long)."""
    found = _CALLED[key].search(instruction.rest)
    if found is None:
        raise BadLine(f"{instruction.opcode} without {key}=", instruction.line)
    return found[1]


def callees(instruction: Instruction) -> list[str]:
    """The computations an instruction runs (not the reducers of `to_apply`,
    which are scalar functions, except for `call`)."""
    opcode = instruction.opcode
    if opcode in ("fusion", "async-start"):
        return [called(instruction, "calls")]
    if opcode in ("call", "call-start"):  # call-start: on another thread
        return [called(instruction, "to_apply")]
    if opcode == "while":
        return [called(instruction, "condition"), called(instruction, "body")]
    if opcode == "conditional":
        return branches(instruction)
    if opcode == "custom-call":
        return _OPERAND.findall(instruction.attrs.get("called_computations", ""))
    return []


def branches(instruction: Instruction) -> list[str]:
    attrs = instruction.attrs
    if "branch_computations" in attrs:
        return _OPERAND.findall(attrs["branch_computations"])
    return [
        called(instruction, "true_computation"),
        called(instruction, "false_computation"),
    ]
