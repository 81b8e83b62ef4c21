"""The Textual dashboard: hosts the trio shepherd in guest mode, shows its state, sends it commands.

The shepherd is the same object headless mode runs under `trio.run`; here
`trio.lowlevel.start_guest_run` drives it on Textual's asyncio loop. The app
reads `shepherd.state` on a timer, every REFRESH_SECONDS (never per message, so
64 chatty workers do not cost a redraw each), and calls the shepherd's commands
inside trio through the guest run's token.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import outcome
import trio
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Footer, Input

from pcp_tui.app.dashboard.help_screen import HelpScreen
from pcp_tui.app.dashboard.loss_chart import StepMeans
from pcp_tui.app.dashboard.signals import StopSignals
from pcp_tui.app.dashboard.widgets import EventLog, LossChart, RoundTiming, RunHeader, WorkerTable
from pcp_tui.app.dashboard.worker_detail import WorkerDetail, WorkerHistory
from pcp_tui.app.local_run import run_with_local_workers
from pcp_tui.shepherd.state import Event, RunState

SpawnWorkers = Callable[[trio.Nursery, int], Awaitable[list[trio.Process]]]

REFRESH_SECONDS = 0.4
_FINISHED = ("done", "failed", "stopped")


class DashboardApp(App[None]):
    """Shows a RunState; with a shepherd, also runs it (guest mode) and sends it commands."""

    CSS_PATH = "app.tcss"
    TITLE = "PCP-TUI"
    ENABLE_COMMAND_PALETTE = False
    AUTO_FOCUS = None
    BINDINGS = [
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
        self._refused: dict[str, str] = {}
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._cancel_scope: trio.CancelScope | None = None
        self.processes: list[trio.Process] = []
        self.guest_running = False
        self.failure: str | None = None
        self._quitting = False
        self._signals: StopSignals | None = None
        self.signal_received: int | None = None
        self._pause_wanted = False
        self._step_means = StepMeans()
        self.worker_history: dict[str, WorkerHistory] = {}
        self._evals_shown = -1
        self._phase_note = ""
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
            self.guest_running = True
            loop = asyncio.get_running_loop()
            self._signals = StopSignals(loop, self._on_stop_signal).__enter__()
            trio.lowlevel.start_guest_run(
                self._trio_main,
                run_sync_soon_threadsafe=loop.call_soon_threadsafe,
                done_callback=self._guest_done,
                host_uses_signal_set_wakeup_fd=True,
            )

    # -- the trio side ----------------------------------------------------------

    async def _trio_main(self) -> None:
        self._trio_token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._cancel_scope = nursery.cancel_scope
            if self._spawn_workers is None:
                await nursery.start(self.shepherd.run)
                return
            self.processes = await nursery.start(
                run_with_local_workers, self.shepherd, self._spawn_workers
            )

    def _guest_done(self, result: outcome.Outcome) -> None:
        self.guest_running = False
        if isinstance(result, outcome.Error):
            self.failure = _failure_reason(result.error)
            self.state.status = "failed"
        elif self.state.status not in _FINISHED:  # cancelled by a second q
            self.state.status = "stopped"
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
                "stop_requested",
                f"{name}: stopping after the current round, writing the checkpoint and telling "
                f"workers goodbye ({name} again: stop at once)",
            )
            self._in_trio(lambda: self.shepherd.request_stop(f"interrupted ({name})"))
            if self.screen_stack:  # after a hang-up the app may already be closing
                self._after_command()
        elif self._cancel_scope is not None:
            self._in_trio(self._cancel_scope.cancel)

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

    # -- keys -------------------------------------------------------------------

    async def action_quit(self) -> None:
        if not self.guest_running:
            self.exit(return_code=self.exit_code)
            return
        if not self._quitting:
            self._quitting = True
            self._in_trio(lambda: self.shepherd.request_stop("quit from the dashboard"))
            self.notify(
                "finishing the current round and saying goodbye to the workers; q again stops at once"
            )
        elif self._cancel_scope is not None:
            self._in_trio(self._cancel_scope.cancel)
        self._after_command()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Show `p pause` or `p resume`, and neither once the run is over; `c` once there is a join command."""
        if action in ("pause", "resume"):
            if self.shepherd is None or not self.guest_running or self._quitting:
                return False
            if self.state.status in _FINISHED:
                return False
            return self._pause_wanted == (action == "resume")
        if action == "copy_join":
            return bool(self.state.join_command)
        return True

    def action_pause(self) -> None:
        if self.check_action("pause", ()):
            self._pause_wanted = True
            self._in_trio(self.shepherd.pause)
            self._after_command()

    def action_resume(self) -> None:
        if self.check_action("resume", ()):
            self._pause_wanted = False
            self._in_trio(self.shepherd.resume)
            self._after_command()

    def _after_command(self) -> None:
        self.refresh_bindings()
        self.refresh_from_state()

    def action_log_scale(self) -> None:
        self.query_one(LossChart).toggle_log()

    def action_zoom(self) -> None:
        self.query_one(LossChart).cycle_window()

    def action_copy_join(self) -> None:
        if self.state.join_command:
            self.copy_to_clipboard(self.state.join_command)
            self.notify("join command copied (terminals with OSC 52 clipboard support)")

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_filter_events(self) -> None:
        box = self.query_one("#event-filter", Input)
        box.add_class("-open")
        box.focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#event-filter", Input)
        box.value = ""
        box.remove_class("-open")
        self.query_one(EventLog).set_filter("")
        self.set_focus(None)

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "event-filter":
            self.query_one(EventLog).set_filter(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "event-filter":
            if not event.value.strip():
                event.input.remove_class("-open")
            self.set_focus(None)

    def on_data_table_row_selected(self, event: WorkerTable.RowSelected) -> None:
        """Enter on a worker's row: its detail view (a refused connection has none)."""
        key = event.row_key.value
        if key in self.state.workers:
            self.push_screen(WorkerDetail(key, self._worker_detail))

    def _worker_detail(self, worker_id: str) -> tuple:
        now = self.state.finished_at if self.state.finished_at is not None else self._clock()
        return self.state.workers.get(worker_id), self.worker_history.get(worker_id), now

    # -- state -> widgets (the one adapter) -------------------------------------

    def refresh_from_state(self) -> None:
        """One refresh tick: read the state, hand each panel what changed. Never per message."""
        self._fit_layout()
        state = self.state
        now = self._clock()
        if state.finished_at is not None:
            now = state.finished_at
        events, self._pending_events[:] = list(self._pending_events), []
        for event in events:
            if event.kind == "refused":
                peer = str(event.data.get("peer", "?"))
                self._refused[peer.rpartition(":")[0] or peer] = event.message.partition(peer)[
                    2
                ].lstrip(": ")
            elif event.kind in ("exporting", "waiting", "resumed_from"):
                self._phase_note = event.message
        status = self._status_text()
        if status != self._shown_status:
            self._shown_status = status
            self.refresh_bindings()
        self.query_one(RunHeader).show(state, now=now, status=status, note=self._note())
        evals = [r for r in state.history if r.eval_loss is not None]
        if self._step_means.update(state.step_losses) or len(evals) != self._evals_shown:
            self._evals_shown = len(evals)
            inner_steps = int(state.settings.get("inner_steps", 1) or 1)
            self.query_one(LossChart).set_data(
                self._step_means.points(),
                [(r.round * inner_steps, r.eval_loss) for r in evals],
                inner_steps=inner_steps,
            )
        self.query_one(RoundTiming).show(state.history)
        for view in state.workers.values():
            self.worker_history.setdefault(view.worker_id, WorkerHistory()).sample(view)
        self.query_one(WorkerTable).show(
            list(state.workers.values()),
            sorted(self._refused.items()),
            now=now,
            run_over=state.status in _FINISHED,
        )
        self.query_one(EventLog).add_events(events)

    def _status_text(self) -> str:
        status = self.state.status
        if self.failure and status != "failed":
            return "failed"
        if self._quitting and status not in _FINISHED:
            return "stopping"
        return status

    def _note(self) -> str:
        status = self.state.status
        if self.failure:
            return f"{self.failure} · q exits"
        if status in _FINISHED:
            return "q exits"
        if self._quitting:
            return "finishing this round, then goodbye · q again stops now"
        if self._pause_wanted and status == "training":
            return "pausing after this round"
        if status == "paused":
            return "p resumes"
        if status == "waiting":
            compiling = sum(w.state == "compiling" for w in self.state.workers.values())
            if compiling:
                return f"{compiling} worker{'s' if compiling != 1 else ''} compiling"
        if status in ("starting", "waiting"):
            return self._phase_note
        return _orphan_warning(self.state.shards.orphaned()) if status == "training" else ""


def _orphan_warning(shards: list[int]) -> str:
    """The header's warning while data shards have no worker: that data is not trained."""
    if not shards:
        return ""
    listed = ", ".join(map(str, shards))
    return f"shard{'s' if len(shards) > 1 else ''} {listed} untrained (no worker): the next to join takes it"


def _failure_reason(error: BaseException) -> str:
    """The RunFailed message out of a (possibly nested) exception group, else the error itself."""
    from pcp_tui.shepherd.coordinator import RunFailed

    if isinstance(error, BaseExceptionGroup):
        matched, _ = error.split(RunFailed)
        if matched is not None:
            while isinstance(matched, BaseExceptionGroup):
                matched = matched.exceptions[0]
            return str(matched)
        return "; ".join(_failure_reason(e) for e in error.exceptions)
    if isinstance(error, RunFailed):
        return str(error)
    return f"{type(error).__name__}: {error}"


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


def summary(state: RunState) -> str:
    """What stays in the terminal once the dashboard is gone: outcome and losses; workers and bytes."""
    from pcp_tui.app.dashboard._format import duration, loss_text
    from pcp_tui.app.headless import human_bytes

    last = state.history[-1] if state.history else None
    evals = [r.eval_loss for r in state.history if r.eval_loss is not None]
    lost = sum(w.state == "lost" for w in state.workers.values())
    workers = f"{len(state.workers)} worker{'s' if len(state.workers) != 1 else ''}" + (
        f" ({lost} lost)" if lost else ""
    )
    return (
        f"run {state.run_id} {state.status}: {len(state.history)}/{state.rounds_total} rounds in "
        f"{duration(state.elapsed())}, train loss {loss_text(last.train_loss if last else None)}, "
        f"eval loss {loss_text(evals[-1] if evals else None)}\n"
        f"{workers}; sent {human_bytes(state.bytes_sent)}, received {human_bytes(state.bytes_received)}"
    )
