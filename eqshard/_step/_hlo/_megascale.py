"""Megascale transfers: in a program compiled for several TPU slices, the part
of a collective that crosses the slices over the data-center network (DCN),
which XLA writes as a `send` and a `recv` (each with its `-done`) handed to
the megascale runtime rather than as a collective op:

    %send.20 = (bf16[1,128,512], u32[], token[]) send(%piece, %after-all.20),
      is_host_transfer=true, frontend_attributes={
      _xla_host_transfer_handler_name="xla_megascale_runtime",
      _xla_host_transfer_rendezvous="all-gather.16_0",
      _xla_megascale_target="{1,2}x{0:7}",
      _xla_megascale_transfer_type="ALL_GATHER"}
    %recv.20 = (bf16[2,128,512], u32[], token[]) recv(%after-all.20), ...

- **One transfer** is the send and the recv of one rendezvous key in one
  computation, with their dones. The collective the key names
  (`all-gather.16`) is no longer in the program: XLA split it into this
  transfer and, where its groups also span several devices of a slice, a
  collective over ICI, which is an instruction (and a row) of its own.
- **Kind**: `_xla_megascale_transfer_type` (`ALL_GATHER`, `ALL_REDUCE`,
  `REDUCE_SCATTER`, `ALL_TO_ALL`, `ONE_TO_ONE`: a permute).
- **Devices**: `_xla_megascale_target`: `"{1,2}x{0:7}"` is one device in each
  of slices 1 and 2 (the same device of each: groups of `slices` devices,
  `groups` empty); `{{100000,300000},...}` groups of device ids;
  `{{100002->200000},...}` a permute's pairs of device ids.
- **Bytes**: the recv's array, the result on each device, as for any
  collective: an all-gather's gathered array (the send's operand is one of its
  `slices` pieces: `bf16[1,128,512]` sent, `bf16[2,128,512]` received on two
  slices), an all-reduce's or all-to-all's buffer (the send's shape), a
  reduce-scatter's block (the send holds the whole input). What each device
  sends over DCN is the ring's share of it (`CollectiveRow.link_bytes`): on
  two slices, the send's operand for an all-gather, all-reduce or permute,
  and the peer's block, the recv's size, for a reduce-scatter. The device's
  own piece of the recv never leaves it.
"""

import dataclasses
import re

from ._text import BadLine, Computation, frontend_attributes, Instruction


HANDLER = "xla_megascale_runtime"
_KINDS = {
    "ALL_GATHER": "all-gather",
    "ALL_REDUCE": "all-reduce",
    "REDUCE_SCATTER": "reduce-scatter",
    "ALL_TO_ALL": "all-to-all",
    "ONE_TO_ONE": "collective-permute",
}
_SLICES = re.compile(r"\{([\d,\s]+)\}x\{\d+(?::\d+)?\}")
_GROUP = re.compile(r"\{([^{}]*)\}")


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One megascale transfer of a computation: positions of its send, recv
    and dones (`None` where the computation has none). `_p2p` describes a
    GPU's point-to-point permute by the same fields (`dcn` unset)."""

    key: str  # the rendezvous key: `all-gather.16_0`
    kind: str
    send: int | None
    recv: int | None
    data: int  # the array that counts: the recv's (the send's without one;
    # a point-to-point permute's recv-done, `_p2p`)
    head: int  # the op name and source: the send's (the recv's without one)
    first: int  # the first and last of its instructions in the schedule
    last: int
    done: bool  # whether its dones are in the computation
    groups: tuple[tuple[int, ...], ...]  # device ids (a permute: pairs)
    slices: int  # with `groups` empty: one device in each of `slices` slices
    dcn: bool = True  # between slices; `False`: a permute's send/recv (`_p2p`)


def _attributes(instruction: Instruction) -> dict[str, str] | None:
    """The frontend attributes of a send or recv to the megascale runtime;
    `None` for any other instruction."""
    if instruction.opcode not in ("send", "recv") or HANDLER not in instruction.rest:
        return None
    try:
        found = frontend_attributes(instruction.attrs)
    except ValueError as e:
        raise BadLine(str(e), instruction.line) from None
    return found if found.get("_xla_host_transfer_handler_name") == HANDLER else None


def _target(text: str, line: str) -> tuple[tuple[tuple[int, ...], ...], int]:
    """The groups of device ids and the slices of `_xla_megascale_target`."""
    compact = _SLICES.fullmatch(text.strip())
    if compact is not None:
        return (), len([s for s in compact[1].split(",") if s.strip()])
    groups = []
    for inside in _GROUP.findall(text.strip()[1:-1]):
        ids = re.split(r"\s*(?:,|->)\s*", inside.strip())
        if not all(i.isdigit() for i in ids):
            raise BadLine(f"a megascale target that is not read: {text[:60]!r}", line)
        groups.append(tuple(map(int, ids)))
    if not groups:
        raise BadLine(f"a megascale target that is not read: {text[:60]!r}", line)
    return tuple(groups), 0


def transfers(computation: Computation) -> list[Transfer]:
    """The megascale transfers of `computation`, in the order they start."""
    ends: dict[str, int] = {}  # a send's or recv's name -> its done's position
    for position, instruction in enumerate(computation.instructions):
        if instruction.opcode in ("send-done", "recv-done") and instruction.operands:
            ends[instruction.operands[0]] = position
    found: dict[str, dict[str, int]] = {}  # key -> {"send": position, ...}
    head: dict[str, tuple[Instruction, dict[str, str]]] = {}
    for position, instruction in enumerate(computation.instructions):
        attributes = _attributes(instruction)
        if attributes is None:
            continue
        key = attributes.get("_xla_host_transfer_rendezvous")
        if key is None:
            raise BadLine("a megascale transfer without a rendezvous", instruction.line)
        found.setdefault(key, {})[instruction.opcode] = position
        head.setdefault(key, (instruction, attributes))
    out = []
    for key, where in found.items():
        instruction, attributes = head[key]
        kind = _KINDS.get(attributes.get("_xla_megascale_transfer_type", ""))
        if kind is None:
            raise BadLine(
                "a megascale transfer of an unknown type "
                f"{attributes.get('_xla_megascale_transfer_type')!r}",
                instruction.line,
            )
        target = attributes.get("_xla_megascale_target")
        if target is None:
            raise BadLine("a megascale transfer without a target", instruction.line)
        groups, slices = _target(target, instruction.line)
        names = [computation.instructions[p].name for p in where.values()]
        done = all(name in ends for name in names)
        positions = list(where.values()) + [ends[n] for n in names if n in ends]
        out.append(
            Transfer(
                key,
                kind,
                where.get("send"),
                where.get("recv"),
                where.get("recv", where.get("send", 0)),
                where.get("send", where.get("recv", 0)),
                min(positions),
                max(positions),
                done,
                groups,
                slices,
            )
        )
    return sorted(out, key=lambda t: t.first)


def linked_sends(computation: Computation) -> dict[int, int]:
    """For each megascale recv of `computation`, the position of the send of
    its rendezvous (the data it receives is the sends' data)."""
    return {
        t.recv: t.send
        for t in transfers(computation)
        if t.recv is not None and t.send is not None
    }
