"""What a person running `pcp-tui worker` sees: a live status line on a terminal, log lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

from pcp_tui.app.closed_output import abandon, say

# Seconds between redraws of the live line while only step, loss or tokens/s change.
REDRAW_SECONDS = 0.1
# Between sessions (reconnecting, compiling a new plan) the last round's numbers are old news:
# "connecting · round 13 · step 50/50" read as if round 13 were still going.
_BETWEEN_SESSIONS = ("connecting", "compiling")

_STATE_STYLES = {
    "connecting": "yellow",
    "compiling": "yellow",
    "idle": "dim",
    "training": "bold green",
    "syncing": "cyan",
    "done": "bold blue",
}


class PlainStatusLog:
    """One log line whenever the worker's state, round or message changes (logs, CI, pipes).

    A message is printed once, on the line where it is new: "compiled in 4.2 s;
    waiting for a round" is news once, not on every line of the rounds after it.
    """

    def __init__(self, out: IO[str] | None = None) -> None:
        self._out = out
        self._last: tuple = ()
        self._printed_message = ""

    def __enter__(self) -> PlainStatusLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def __call__(self, status: Any) -> None:
        key = (status.state, status.round, status.message)
        if key == self._last:
            return
        self._last = key
        current = status.state not in _BETWEEN_SESSIONS
        where = f" round {status.round}" if status.round and current else ""
        loss = f" loss {status.loss:.4f}" if status.loss is not None and current else ""
        message = status.message if status.message != self._printed_message else ""
        self._printed_message = status.message
        print(
            f"{time.strftime('%H:%M:%S')} {status.state:<10}{where}{loss} {message}".rstrip(),
            file=self._out or sys.stdout,
            flush=True,
        )


def status_line(status: Any, width: int | None = None, *, message: bool = True) -> Text:
    """`● training   worker 0 → host:port · round 3 · step 12/50 · loss 3.2140 · 1,234 tok/s`.

    When that is wider than `width` cells the shepherd's address, which never
    changes, is left out, so the numbers stay whole on an 80-column terminal.
    `message=False` leaves out the status message (old news).
    """
    line = _status_line(status, address=True, message=message)
    if width is not None and line.cell_len > width:
        line = _status_line(status, address=False, message=message)
    return line


def _status_line(status: Any, *, address: bool, message: bool) -> Text:
    style = _STATE_STYLES.get(status.state, "bold")
    line = Text(no_wrap=True, overflow="ellipsis")
    line.append("● ", style)
    line.append(f"{status.state:<10}", style)
    who = f"worker {status.worker_index}" if status.worker_index is not None else "worker"
    line.append(f" {who} → {status.shepherd}" if address else f" {who}", "dim")
    current = status.state not in _BETWEEN_SESSIONS
    if status.round and current:
        line.append(f" · round {status.round}")
        if status.total_steps:
            line.append(f" · step {status.step}/{status.total_steps}")
    if status.loss is not None and current:
        line.append(f" · loss {status.loss:.4f}")
    if status.tokens_per_second and current:
        line.append(f" · {status.tokens_per_second:,.0f} tok/s")
    if message and status.message and status.state not in ("training", "syncing"):
        line.append(f" · {status.message}", "dim")
    return line


class LiveStatusLine:
    """A rich live line that redraws at most every REDRAW_SECONDS; state changes also leave a log line above it."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._live = Live(console=console, auto_refresh=False, transient=True)  # no refresh thread
        self._last_key: tuple = ()
        self._last_draw = 0.0
        self._last_status: Any = None
        self._last_logged = False
        self._message = ""
        self._message_round = 0  # the round the current message appeared in: news until then

    def __enter__(self) -> LiveStatusLine:
        self._live.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._live.stop()
        if self._last_status is not None and not self._last_logged:
            self._console.print(self._log_line(self._last_status))

    def __call__(self, status: Any) -> None:
        self._last_status = status
        if status.message != self._message:
            self._message, self._message_round = status.message, status.round
        key = (status.state, status.round, status.message)
        now = time.monotonic()
        if key != self._last_key:
            self._last_logged = _worth_a_line(status, self._last_key)
            if self._last_logged:
                self._live.console.print(self._log_line(status))
            self._last_key = key
        elif now - self._last_draw < REDRAW_SECONDS:
            return
        self._last_draw = now
        self._live.update(
            status_line(status, self._console.width, message=self._news(status)), refresh=True
        )

    def _news(self, status: Any) -> bool:
        """A message stays on the line for the round it appeared in, not for the rounds after."""
        return status.round == self._message_round

    def _log_line(self, status: Any) -> Text:
        """A line that stays above the live one: the time, then the status (wrapped, not cut)."""
        line = Text(time.strftime("%H:%M:%S "), "dim")
        line.append_text(
            status_line(status, self._console.width - line.cell_len, message=self._news(status))
        )
        return line


def _worth_a_line(status: Any, last_key: tuple) -> bool:
    """Keep a line for what changed, but only one per round of the training/syncing/idle cycle."""
    message_changed = not last_key or status.message != last_key[2]
    in_cycle = status.round > 0 and status.state in ("training", "idle")
    return message_changed or not in_cycle


class WorkerStatusView:
    """Attach the right view to a worker's status for as long as the `with` block runs.

    On a terminal: a live status line (rich). Otherwise (pipes, logs, CI): plain lines.
    """

    def __init__(
        self, status: Any, out: IO[str] | None = None, *, live: bool | None = None
    ) -> None:
        self._status = status
        self._out = out = out or sys.stdout
        if live is None:
            live = out.isatty()
        self._view: LiveStatusLine | PlainStatusLog = (
            LiveStatusLine(Console(file=out)) if live else PlainStatusLog(out)
        )

    def __enter__(self) -> WorkerStatusView:
        self._view.__enter__()
        self._status.listeners.append(self._show)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._status.listeners.remove(self._show)
        self._view.__exit__(*exc_info)

    def _show(self, status: Any) -> None:
        """Show `status`; a terminal closed or a pipe nobody reads must not end the worker."""
        try:
            self._view(status)
        except OSError as exc:  # EIO, EPIPE: nobody is left to read it
            abandon(self._out)
            say(
                f"pcp-tui: cannot show the worker's status any more ({exc.strerror or exc}); "
                "it goes on training (--log-file FILE keeps a record)"
            )
