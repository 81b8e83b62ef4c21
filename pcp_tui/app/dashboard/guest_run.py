"""The dashboard's trio side: the shepherd's run hosted in guest mode on Textual's asyncio loop.

`GuestRun` is the base of `DashboardApp` (through `KeyActions`): it starts the
run, forwards commands into it through the guest run's token (a shepherd's
trio.Events need trio context), turns SIGHUP / SIGTERM into a stop, and never
lets the run outlive the app. What the run ended with becomes `failure` and `exit_code`.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import outcome
import trio
from textual.app import App

from pcp_tui.app.api import run_with_api
from pcp_tui.app.dashboard.signals import StopSignals
from pcp_tui.app.local_run import run_with_local_workers
from pcp_tui.shepherd.run.events import StopRequested
from pcp_tui.shepherd.run.state import FINISHED, RunState, RunStatus

SpawnWorkers = Callable[[trio.Nursery, int], Awaitable[list[trio.Process]]]


class GuestRun(App[None]):
    """The guest run's lifetime and commands; the attributes are set by `DashboardApp.__init__`."""

    state: RunState
    shepherd: Any
    _spawn_workers: SpawnWorkers | None
    _trio_token: trio.lowlevel.TrioToken | None
    _cancel_scope: trio.CancelScope | None
    processes: list[trio.Process]
    guest_running: bool
    failure: str | None
    _quitting: bool
    _stopping_now: bool
    _signals: StopSignals | None
    signal_received: int | None
    refresh_from_state: Callable[[], None]  # DashboardApp's: redraw every panel from `state`

    def _start_guest_run(self) -> None:
        """Start the shepherd on this loop; SIGHUP and SIGTERM now stop it (see `_on_stop_signal`)."""
        self.guest_running = True
        loop = asyncio.get_running_loop()
        self._signals = StopSignals(loop, self._on_stop_signal).__enter__()
        trio.lowlevel.start_guest_run(
            self._trio_main,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            done_callback=self._guest_done,
            host_uses_signal_set_wakeup_fd=True,
        )

    async def _trio_main(self) -> None:
        self._trio_token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._cancel_scope = nursery.cancel_scope
            if self._spawn_workers is None:
                await nursery.start(run_with_api, self.shepherd)
                return
            self.processes = await nursery.start(
                run_with_local_workers, self.shepherd, self._spawn_workers
            )

    def _guest_done(self, result: outcome.Outcome) -> None:
        self.guest_running = False
        if isinstance(result, outcome.Error):
            self.failure = failure_reason(result.error)
            self.state.status = RunStatus.FAILED
        elif self.state.status not in FINISHED:  # cancelled by a second q
            self.state.status = RunStatus.STOPPED
        if not self.screen_stack:  # the app is already gone (its terminal closed): nothing to draw
            return
        self.refresh_bindings()
        self.refresh_from_state()
        if self.failure:
            self.notify(self.failure, title="run failed", severity="error", timeout=30)
        if self._quitting:
            self.exit(return_code=self.exit_code)

    async def on_unmount(self) -> None:
        """Never leave the guest run behind when the app ends some other way than `q`.

        A guest run outliving its host loop keeps trio's run state on this thread
        (a later `trio.run` would refuse to start): cancel it and let it unwind on
        this loop first. Its goodbyes are bounded, so this ends in seconds.

        After SIGHUP the app ends as soon as its terminal is gone, but the stop
        the signal asked for is still under way: wait for it (the final
        checkpoint, the goodbyes); another SIGHUP or SIGTERM cancels it.
        """
        try:
            if self.signal_received is not None:
                while self.guest_running:
                    await asyncio.sleep(0.05)
            if not self.guest_running or self._cancel_scope is None:
                return
            self._in_trio(self._cancel_scope.cancel)
            for _ in range(200):
                if not self.guest_running:
                    return
                await asyncio.sleep(0.05)
        finally:
            if self._signals is not None:
                self._signals.__exit__(None, None, None)

    def _on_stop_signal(self, signum: int) -> None:
        """SIGHUP / SIGTERM: the first stops the run as `q` does, the next stops it at once.

        The process then exits with 128 + the signal's number, as in headless mode.
        """
        first = self.signal_received is None
        self.signal_received = signum
        if not self.guest_running:
            self.exit(return_code=self.exit_code)
        elif first and not self._quitting:
            name = signal.Signals(signum).name
            self._quitting = True
            self.state.emit(
                StopRequested(
                    f"{name}: stopping after the current round, writing the checkpoint and telling "
                    f"workers goodbye ({name} again: stop at once)",
                )
            )
            self._in_trio(lambda: self.shepherd.request_stop(f"interrupted ({name})"))
            if self.screen_stack:  # after a hang-up the app may already be closing
                self._after_command()
        elif not self._stopping_now:  # the round abandoned, the workers still told goodbye
            self._stopping_now = True
            self._in_trio(
                lambda: self.shepherd.stop_now(f"interrupted ({signal.Signals(signum).name})")
            )
        elif self._cancel_scope is not None:
            self._in_trio(self._cancel_scope.cancel)

    def _after_command(self) -> None:
        self.refresh_bindings()
        self.refresh_from_state()

    def _in_trio(self, command: Callable[[], None]) -> bool:
        """Run a shepherd command inside the guest run (its trio.Events need trio context)."""
        if self._trio_token is None or not self.guest_running:
            return False
        self._trio_token.run_sync_soon(command)
        return True

    @property
    def exit_code(self) -> int:
        """1 for a failed run, 128 + the signal's number after SIGHUP / SIGTERM, else 0."""
        if self.failure or self.state.status == "failed":
            return 1
        return 0 if self.signal_received is None else 128 + self.signal_received


def failure_reason(error: BaseException) -> str:
    """The RunFailed message out of a (possibly nested) exception group, else the error itself."""
    from pcp_tui.shepherd.coordinator import RunFailed

    if isinstance(error, BaseExceptionGroup):
        matched, _ = error.split(RunFailed)
        if matched is not None:
            first: BaseException = matched
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            return str(first)
        return "; ".join(failure_reason(e) for e in error.exceptions)
    if isinstance(error, RunFailed):
        return str(error)
    return f"{type(error).__name__}: {error}"
