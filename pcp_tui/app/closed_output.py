"""Output nobody reads any more: a closed pipe (`| head`), a terminal that was closed.

Printing to a pipe whose reader has exited raises EPIPE (Python ignores SIGPIPE),
and to a terminal that hung up EIO. Neither is a reason to end a run or a worker:
what they print is for a person who is no longer there. `abandon` points such a
stream at /dev/null, so every later write, and the interpreter's last flush at
exit (which would otherwise turn exit 0 into 120), goes nowhere.
"""

from __future__ import annotations

import os
import sys
from typing import IO


def abandon(stream: IO[str]) -> None:
    """Send what `stream` still holds, and every later write, to /dev/null: its reader is gone.

    Printing to a pipe nobody reads raises EPIPE, to a terminal that was closed EIO.
    A run must not end because nobody reads its log, and the interpreter's last
    flush of that stream at exit must not fail either (it would turn exit 0 into 120).
    A stream without a descriptor of its own (a `StringIO`) is left as it is.
    """
    try:
        fd = stream.fileno()
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def say(line: str, out: IO[str] | None = None) -> None:
    """Print `line` on `out` (standard error); if that is gone too, abandon it and go on."""
    out = out or sys.stderr
    try:
        print(line, file=out, flush=True)
    except OSError:
        abandon(out)  # the operator's terminal is closed: nobody is left to tell
