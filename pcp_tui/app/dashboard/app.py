"""The Textual dashboard: hosts the trio shepherd in guest mode, shows its state, sends it commands.

The shepherd is the same object headless mode runs under `trio.run`; here
`trio.lowlevel.start_guest_run` drives it on Textual's asyncio loop. The app
reads `shepherd.state` on a timer, every REFRESH_SECONDS (never per message, so
64 chatty workers do not cost a redraw each), and calls the shepherd's commands
inside trio through the guest run's token.

This module is the layout and the one adapter from state to widgets; the trio
side is `guest_run.GuestRun`, the keys are `key_actions.KeyActions`, the words
`run_text`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import trio
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Footer, Input

from pcp_tui.app.dashboard.guest_run import SpawnWorkers
from pcp_tui.app.dashboard.key_actions import KeyActions
from pcp_tui.app.dashboard.loss_chart import StepMeans
from pcp_tui.app.dashboard.run_text import (
    EventNotes,
    header_note,
    status_text,
    summary,
)
from pcp_tui.app.dashboard.signals import StopSignals
from pcp_tui.app.dashboard.widgets import EventLog, LossChart, RoundTiming, RunHeader, WorkerTable
from pcp_tui.app.dashboard.worker_detail import WorkerHistory
from pcp_tui.shepherd.run.events import Event
from pcp_tui.shepherd.run.state import FINISHED, RunState

__all__ = ["REFRESH_SECONDS", "DashboardApp", "SpawnWorkers", "run_dashboard", "summary"]

REFRESH_SECONDS = 0.4


class DashboardApp(KeyActions):
    """Shows a RunState; with a shepherd, also runs it (guest mode) and sends it commands."""

    CSS_PATH = "app.tcss"
    TITLE = "PCP-TUI"
    ENABLE_COMMAND_PALETTE = False
    AUTO_FOCUS = "#workers"  # so the documented ↑ ↓ enter work at once, without Tab
    BINDINGS = [  # the actions are in key_actions.py
        Binding("q", "quit", "quit"),
        Binding("p", "pause", "pause"),
        Binding("p", "resume", "resume"),
        Binding("l", "log_scale", "log y"),
        Binding("z", "zoom", "zoom"),
        Binding("c", "copy_join", "copy join"),
        Binding("slash", "filter_events", "filter", key_display="/"),
        Binding("escape", "clear_filter", "clear filter", show=False),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),
    ]

    def __init__(
        self,
        state: RunState,
        shepherd: Any = None,
        spawn_workers: SpawnWorkers | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__()
        self.state = state
        self.shepherd = shepherd
        self._spawn_workers = spawn_workers
        self._clock = clock
        self._pending_events: list[Event] = list(state.events)
        self._notes = EventNotes()
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._cancel_scope: trio.CancelScope | None = None
        self.processes: list[trio.Process] = []
        self.guest_running = False
        self.failure: str | None = None
        self._quitting = False
        self._stopping_now = False  # a second q (or signal): the round abandoned, goodbye said
        self._signals: StopSignals | None = None
        self.signal_received: int | None = None
        self._pause_wanted = False
        self._step_means = StepMeans()
        self.worker_history: dict[str, WorkerHistory] = {}
        self._evals_shown = -1
        self._shown_status = ""
        state.subscribe(self._pending_events.append)

    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        with Horizontal(id="charts"):
            yield LossChart(id="loss")
            yield RoundTiming(id="timing")
        yield WorkerTable(id="workers")
        yield Input(placeholder="filter events (enter keeps it, escape clears)", id="event-filter")
        yield EventLog(id="events")
        yield Footer()

    def _fit_layout(self) -> None:
        """Panels give way on small terminals (see app.tcss): the chart never shrinks to a strip.

        Run on mount and on every refresh tick (a resize is followed within one tick).
        """
        width, height = self.size
        self.screen.set_class(width < 72, "-narrow")
        self.screen.set_class(height < 20, "-short")
        self.screen.set_class(height < 14, "-tiny")

    def on_mount(self) -> None:
        self._fit_layout()
        for widget_id, title in (
            ("loss", "Loss"),
            ("timing", "Round time"),
            ("workers", "Workers"),
            ("events", "Events"),
        ):
            self.query_one(f"#{widget_id}").border_title = title
        self.refresh_from_state()
        self.set_interval(REFRESH_SECONDS, self.refresh_from_state)
        if self.shepherd is not None:
            self._start_guest_run()

    # -- state -> widgets (the one adapter) -------------------------------------

    def refresh_from_state(self) -> None:
        """One refresh tick: read the state, hand each panel what changed. Never per message."""
        if not self.is_running:  # a tick due as the app shuts down: its widgets may be gone
            return
        self._fit_layout()
        state = self.state
        now = self._clock()
        if state.finished_at is not None:
            now = state.finished_at
        events, self._pending_events[:] = list(self._pending_events), []
        self._notes.fold(events)
        status = status_text(state.status, failure=self.failure, quitting=self._quitting)
        if status != self._shown_status:
            self._shown_status = status
            self.refresh_bindings()
        note = header_note(
            state,
            failure=self.failure,
            quitting=self._quitting,
            pause_wanted=self._pause_wanted,
            phase_note=self._notes.phase,
        )
        self.query_one(RunHeader).show(state, now=now, status=status, note=note)
        evals = [(r.round, r.eval_loss) for r in state.history if r.eval_loss is not None]
        if self._step_means.update(state.step_losses) or len(evals) != self._evals_shown:
            self._evals_shown = len(evals)
            inner_steps = int(state.settings.get("inner_steps", 1) or 1)
            self.query_one(LossChart).set_data(
                self._step_means.points(),
                [(number * inner_steps, loss) for number, loss in evals],
                inner_steps=inner_steps,
            )
        self.query_one(RoundTiming).show(state.history)
        for view in state.workers.values():
            self.worker_history.setdefault(view.worker_id, WorkerHistory()).sample(view)
        self.query_one(WorkerTable).show(
            list(state.workers.values()),
            sorted(self._notes.refused.items()),
            now=now,
            run_over=state.status in FINISHED,
        )
        self.query_one(EventLog).add_events(events)


def run_dashboard(shepherd: Any, spawn_workers: SpawnWorkers | None = None) -> int:
    """Run the shepherd inside the dashboard until the person quits; print a summary; 0 or 1."""
    app = DashboardApp(shepherd.state, shepherd, spawn_workers)
    app.run()
    for process in app.processes:  # only when the app died with the run still going
        if process.returncode is None:
            process.kill()
    state = shepherd.state
    print(summary(state))
    if app.exit_code:
        print(f"pcp-tui: run failed: {app.failure or 'see the events above'}", flush=True)
    return app.exit_code
