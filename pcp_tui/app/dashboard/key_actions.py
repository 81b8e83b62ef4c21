"""What the dashboard's keys do: the actions `DashboardApp.BINDINGS` names, and the filter box.

`KeyActions` is a base of `DashboardApp`. Commands for the run (quit, pause,
resume) go through `GuestRun._in_trio`; everything else only changes a view.
`check_action` decides which of them the footer shows right now.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from textual.widgets import Input

from pcp_tui.app.dashboard.guest_run import GuestRun
from pcp_tui.app.dashboard.help_screen import HelpScreen
from pcp_tui.app.dashboard.widgets import EventLog, LossChart, WorkerTable
from pcp_tui.app.dashboard.worker_detail import WorkerDetail, WorkerHistory
from pcp_tui.shepherd.run.state import FINISHED


class KeyActions(GuestRun):
    """The actions behind the bindings; the attributes are set by `DashboardApp.__init__`."""

    _clock: Callable[[], float]
    _quitting: bool
    _stopping_now: bool
    _pause_wanted: bool
    worker_history: dict[str, WorkerHistory]

    async def action_quit(self) -> None:
        if not self.guest_running:
            self.exit(return_code=self.exit_code)
            return
        if not self._quitting:  # q cancels the run for good: the workers exit, not wait
            self._quitting = True
            self._in_trio(lambda: self.shepherd.cancel("quit from the dashboard"))
            self.notify(
                "ending the run for good: finishing the current round, then the workers are "
                "told to exit; q again stops at once"
            )
        elif not self._stopping_now:  # still a goodbye: the round is abandoned, not the workers
            self._stopping_now = True
            self._in_trio(lambda: self.shepherd.stop_now("quit again from the dashboard"))
        elif self._cancel_scope is not None:
            self._in_trio(self._cancel_scope.cancel)
        self._after_command()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Show `p pause` or `p resume`, and neither once the run is over; `c` once there is a join command."""
        if action in ("pause", "resume"):
            if self.shepherd is None or not self.guest_running or self._quitting:
                return False
            if self.state.status in FINISHED:
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

    def action_log_scale(self) -> None:
        self.query_one(LossChart).toggle_log()

    def action_zoom(self) -> None:
        self.query_one(LossChart).cycle_window()

    def action_copy_join(self) -> None:
        """Send the join command to the clipboard, and say what that does and does not promise.

        OSC 52 is a request the terminal may ignore, and no answer comes back; tmux
        drops it unless `set-clipboard` is on. So the note shows the command too.
        """
        command = self.state.join_command
        if not command:
            return
        self.copy_to_clipboard(command)
        if os.environ.get("TMUX"):
            sent = "sent to tmux, which passes it to your clipboard only with `set -g set-clipboard on`"
        else:
            sent = "sent to the terminal's clipboard (OSC 52; some terminals ignore it)"
        self.notify(f"join command {sent}; it is: {command}", markup=False, timeout=15)

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
        self.query_one(WorkerTable).focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "event-filter":
            self.query_one(EventLog).set_filter(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "event-filter":
            if not event.value.strip():
                event.input.remove_class("-open")
            self.query_one(WorkerTable).focus()

    def on_data_table_row_selected(self, event: WorkerTable.RowSelected) -> None:
        """Enter on a worker's row: its detail view (a refused connection has none)."""
        key = event.row_key.value
        if key in self.state.workers:
            self.push_screen(WorkerDetail(key, self._worker_detail))

    def _worker_detail(self, worker_id: str) -> tuple:
        now = self.state.finished_at if self.state.finished_at is not None else self._clock()
        return self.state.workers.get(worker_id), self.worker_history.get(worker_id), now
