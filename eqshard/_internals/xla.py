"""XLA's warnings, captured from the process's stderr around a compile.

XLA logs its rematerialization and resharding warnings with its own logger,
which writes to file descriptor 2 directly (not through `sys.stderr`), and only
while it compiles. `captured_stderr` redirects that descriptor to a temporary
file for the length of a `with` block, then writes what was logged on to the
real stderr, so the user still sees it. `logged_warnings` reads XLA's log lines
(`W0101 12:00:00.000000 1234 file.cc:12] message`) out of the captured text,
with the op name and stack frame a message quotes.

[`eqshard.analyze_step`][] uses both, unless called with
`capture_warnings=False`: then the compile runs with stderr untouched.
"""

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from collections.abc import Iterator


@dataclasses.dataclass
class Captured:
    """What was written to file descriptor 2 inside a `captured_stderr` block;
    `text` is filled when the block ends."""

    text: str = ""


@contextlib.contextmanager
def captured_stderr() -> Iterator[Captured]:
    """Captures what is written to file descriptor 2 (where XLA logs) into the
    yielded record's `text`, and writes it on to the real stderr."""
    captured = Captured()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            data = sink.read()
            if data:
                os.write(2, data)
            captured.text = data.decode(errors="replace")


@dataclasses.dataclass(frozen=True)
class Logged:
    """One warning or error line of XLA's log: its message, the `op_name` of the
    instruction it quotes and its `stack_frame_id` (`None` where it quotes none)."""

    message: str
    op_name: str | None
    stack_frame: int | None


_LOG_LINE = re.compile(r"^[WE]\d{4} [\d:.]+\s+\d+ [\w.\-/]+:\d+\] (.*)$", re.M)
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")


def logged_warnings(log: str) -> list[Logged]:
    """XLA's warning and error lines in `log`, in order."""
    found = []
    for message in _LOG_LINE.findall(log):
        named = _OP_NAME.search(message)
        frame = _FRAME.search(message)
        found.append(
            Logged(
                message.strip(),
                named[1] if named is not None else None,
                int(frame[1]) if frame is not None else None,
            )
        )
    return found
