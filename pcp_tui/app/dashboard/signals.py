"""SIGHUP and SIGTERM under the dashboard: stop the run the way `q` does, even with no terminal left.

Textual installs no handler for either, so their default action used to end
the process on the spot: no final checkpoint, no goodbye to the workers.
Closing the terminal window (SIGHUP) is the everyday case.

Why `signal.signal` and not `loop.add_signal_handler`: an earlier attempt
with asyncio's handler made Textual spin (asyncio then owns the process's
signal wakeup fd, which the guest run is told the host uses). A plain
Python handler runs on the main thread between bytecodes, does a few system
calls at most and hands the rest to the loop with `call_soon_threadsafe`,
so the stop itself runs where the app runs, on the same path as `q`.

After a hang-up every write to the terminal fails with EIO: Textual's
output thread would die on its next write and the app would then block on
its full queue. The handler therefore points stdout and stderr at the null
device before anything else runs. Stdin stays: its reads fail at once, which
ends Textual's input thread (it asks the app to close) instead of leaving it
blocked or spinning; the app then waits for the stop in `on_unmount`. The
kernel also sends SIGCONT with the hang-up, and Textual's SIGCONT handler
restarts its input thread: that one fails the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from types import FrameType

STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGHUP", "SIGTERM") if hasattr(signal, name)
)


class StopSignals:
    """Calls `on_signal(signum)` on `loop` for each SIGHUP / SIGTERM while installed.

    Use as a context manager around the app's life; leaving restores the
    handlers that were there before (tests run many apps in one process).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, on_signal: Callable[[int], None]):
        self._loop = loop
        self._on_signal = on_signal
        self._previous: dict[int, object] = {}
        self._detached = False

    def __enter__(self) -> StopSignals:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == getattr(signal, "SIGHUP", None) and not self._detached:
            detach_from_terminal()
            self._detached = True
        with contextlib.suppress(RuntimeError):  # a closed loop: the app is gone, nothing to stop
            self._loop.call_soon_threadsafe(self._on_signal, signum)


def detach_from_terminal() -> None:
    """Point stdout and stderr (fds 1 and 2) at the null device: the terminal hung up."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
    finally:
        os.close(null)
