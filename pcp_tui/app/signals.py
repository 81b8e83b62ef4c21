"""Signals for a process without a dashboard: a headless shepherd's clean stop, a worker's exit."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import IO

import trio

from pcp_tui.app.closed_output import say


class SignalStop:
    """SIGINT / SIGTERM / SIGHUP / SIGQUIT for a run without a dashboard.

    The first SIGINT, SIGTERM or SIGHUP calls `stop(reason)`: the shepherd finishes
    its round, writes its checkpoint and tells the workers goodbye, resumable, so
    they wait for a `--resume` (for their --give-up-after). The second calls
    `now(reason)`: the round is abandoned, the goodbye still said. The next one (or
    the second, without `now`) cancels `scope`. SIGQUIT (Ctrl-\\) calls
    `cancel(reason)`: the run ends for good after its round and the workers exit.
    Without `stop`, the first signal cancels. The process then exits with 128 +
    the signal's number (130, 143, 129, 131), as shells expect. SIGHUP is what
    closing the terminal sends: it must stop a run the same clean way, not kill it
    with its checkpoint unwritten.
    """

    SIGNALS = (
        signal.SIGINT,
        signal.SIGTERM,
        *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else []),
    )
    CANCEL = getattr(signal, "SIGQUIT", None)  # Ctrl-\ at a terminal

    def __init__(
        self,
        stop: Callable[[str], None] | None = None,
        out: IO[str] = sys.stderr,
        *,
        plan: Callable[[], str] | None = None,
        now: Callable[[str], None] | None = None,
        cancel: Callable[[str], None] | None = None,
    ):
        self._stop = stop
        self._now = now
        self._cancel = cancel
        self._out = out
        # what the clean stop will do, said in the first signal's line (see clean_stop_plan)
        self._plan = plan or (
            lambda: (
                "stopping after the current round, writing the checkpoint and "
                "telling workers goodbye"
            )
        )
        self.received: int | None = None
        self._count = 0

    @property
    def exit_code(self) -> int | None:
        """128 + the signal's number once one arrived, else None."""
        return None if self.received is None else 128 + self.received

    async def watch(self, scope: trio.CancelScope, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        cancels = (self.CANCEL,) if self._cancel is not None and self.CANCEL else ()
        with trio.open_signal_receiver(*self.SIGNALS, *cancels) as signals:
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                self.received = signum
                if signum in cancels and self._cancel is not None:
                    self._say(
                        f"{name}: cancelling the run for good after the current round; the "
                        "workers are told to exit"
                    )
                    self._cancel(f"cancelled ({name})")
                    continue
                self._count += 1
                if self._count == 1 and self._stop is not None:
                    more = "; Ctrl-\\: cancel the run for good" if cancels else ""
                    self._say(f"{name}: {self._plan()} ({name} again: stop at once{more})")
                    self._stop(f"interrupted ({name})")
                    continue
                if self._count == 2 and self._now is not None:
                    self._say(
                        f"{name}: stopping at once, abandoning the round and telling workers "
                        f"goodbye ({name} again: exit without a goodbye)"
                    )
                    self._now(f"interrupted ({name})")
                    continue
                self._say(f"{name}: stopping at once")
                scope.cancel()
                return

    def _say(self, line: str) -> None:
        say(f"pcp-tui: {line}", self._out)  # after SIGHUP the terminal may be gone
