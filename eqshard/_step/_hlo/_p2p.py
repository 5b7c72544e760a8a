"""Point-to-point transfers: a `collective-permute` that XLA's GPU compiler
split into `send`/`recv` pairs, not written as a collective op. Its
collective-permute decomposer does so for the permutes of a loop (a pipeline's
stages, ring attention) over `xla_gpu_collective_permute_decomposer_threshold`
bytes when `xla_gpu_enable_pipelined_p2p` is set (JAX 0.10.2):

    %ppermute.16-recv = (bf16[4,128], u32[], token[]) recv(%after-all.1),
      channel_id=1, frontend_attributes={_xla_send_recv_pipeline="0",
      _xla_send_recv_source_target_pairs={{2,0},{4,2},{6,4}}}
    %ppermute.16-send = (bf16[4,128], u32[], token[]) send(%data, %after-all.1),
      channel_id=1, frontend_attributes={...}
    %ppermute.16-recv-done = (bf16[4,128], token[]) recv-done(%ppermute.16-recv)
    %ppermute.16-send-done = token[] send-done(%ppermute.16-send)

- **One permute** is the send and the recv of one channel in one computation,
  with their dones. A cycle's permute is split in two, on two channels
  (`ppermute.16-fwd-recv`, `ppermute.16-bwd-recv`), each device taking part in
  one of them: one permute, of both's pairs, named `ppermute.16`.
- **Devices**: `_xla_send_recv_source_target_pairs`, as a permute's pairs.
- **Bytes**: the recv's array, the permute's result on each device; its data
  is read at the recv-done, which the schedule puts after the send (the recv
  itself often comes first).
- A send or recv to the host (`is_host_transfer=true`, the megascale runtime's
  among them: `_megascale`) is none of these.
"""

import re

from ._megascale import Transfer
from ._text import BadLine, Computation, frontend_attributes, Instruction


_PAIRS = "_xla_send_recv_source_target_pairs"
_CHANNEL = re.compile(r"(?:^|,)\s*channel_id=(\d+)")
# `ppermute.16-fwd-recv.1` -> `ppermute.16`, `.1`: the permute XLA split, and
# the suffix of a clone (a peeled loop iteration's copy).
_NAME = re.compile(r"^(.*?)(?:-(?:fwd|bwd))?-(?:send|recv)((?:\.\d+)*)$")
_STEM = re.compile(r"^(.*)-(?:send|recv)((?:\.\d+)*)$")


def _is_p2p(instruction: Instruction) -> bool:
    return (
        instruction.opcode in ("send", "recv")
        and "is_host_transfer=true" not in instruction.rest
    )


def _pairs(instruction: Instruction) -> tuple[tuple[int, int], ...]:
    try:
        text = frontend_attributes(instruction.attrs).get(_PAIRS)
    except ValueError as e:
        raise BadLine(str(e), instruction.line) from None
    if text is None:
        raise BadLine(
            f"a {instruction.opcode} between devices without {_PAIRS} (to "
            "read its permute as a collective-permute, compile with "
            "compiler_options={'xla_gpu_enable_pipelined_p2p': False})",
            instruction.line,
        )
    found = re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", text)
    return tuple((int(a), int(b)) for a, b in found)


def _stem(instruction: Instruction) -> str | None:
    """`ppermute.16-fwd` of `ppermute.16-fwd-recv` and `ppermute.16-fwd-send`:
    what pairs a send with its recv when several share a channel id."""
    found = _STEM.match(instruction.name)
    return None if found is None else found[1] + found[2]


def _channels(computation: Computation) -> list[dict[str, int]]:
    """The point-to-point sends and recvs of `computation`, paired
    ({"send": position, "recv": position}) by channel id and by name (XLA gives
    the halves of several permutes one channel id), in order where the names do
    not tell."""
    by_key: dict[tuple[str, str | None], list[dict[str, int]]] = {}
    for position, instruction in enumerate(computation.instructions):
        if not _is_p2p(instruction):
            continue
        found = _CHANNEL.search(instruction.rest)
        if found is None:
            raise BadLine(
                f"a {instruction.opcode} without a channel_id", instruction.line
            )
        pairs = by_key.setdefault((found[1], _stem(instruction)), [])
        free = [where for where in pairs if instruction.opcode not in where]
        if not free:
            free.append({})
            pairs.append(free[0])
        free[0][instruction.opcode] = position
    return [where for pairs in by_key.values() for where in pairs]


def _name(computation: Computation, where: dict[str, int]) -> str:
    name = computation.instructions[where.get("recv", where.get("send", 0))].name
    found = _NAME.match(name)
    return name if found is None else found[1] + found[2]


def p2p_transfers(computation: Computation) -> list[Transfer]:
    """The permutes written as point-to-point sends and recvs in
    `computation`, in the order they start."""
    ends: dict[str, int] = {}  # a send's or recv's name -> its done's position
    for position, instruction in enumerate(computation.instructions):
        if instruction.opcode in ("send-done", "recv-done") and instruction.operands:
            ends[instruction.operands[0]] = position
    merged: dict[str, list[dict[str, int]]] = {}  # permute -> its channels' ends
    for where in _channels(computation):
        merged.setdefault(_name(computation, where), []).append(where)
    out = []
    for key, channels in merged.items():
        first = channels[0]
        recv = first.get("recv")
        done = None if recv is None else ends.get(computation.instructions[recv].name)
        data = first.get("send", 0) if recv is None else recv if done is None else done
        positions = [p for where in channels for p in where.values()]
        names = [computation.instructions[p].name for p in positions]
        span = positions + [ends[n] for n in names if n in ends]
        groups = tuple(
            pair for p in positions for pair in _pairs(computation.instructions[p])
        )
        out.append(
            Transfer(
                key,
                "collective-permute",
                first.get("send"),
                first.get("recv"),
                data,
                first.get("send", first.get("recv", 0)),
                min(span),
                max(span),
                all(name in ends for name in names),
                tuple(dict.fromkeys(groups)),
                0,
                dcn=False,
            )
        )
    return sorted(out, key=lambda t: t.first)


def p2p_linked_sends(computation: Computation) -> dict[int, int]:
    """For the recv-done of each point-to-point recv of `computation`, the
    position of the send of its channel (the data it gives is the send's)."""
    dones = {
        i.operands[0]: position
        for position, i in enumerate(computation.instructions)
        if i.opcode == "recv-done" and i.operands
    }
    out = {}
    for where in _channels(computation):
        if "recv" in where and "send" in where:
            done = dones.get(computation.instructions[where["recv"]].name)
            if done is not None:
                out[done] = where["send"]
    return out
