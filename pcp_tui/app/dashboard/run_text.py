"""The words the dashboard shows about the run: the header's status and note, and the exit summary.

Pure functions of the run's state and of what the person asked for (quit,
pause), so they read without a terminal. `EventNotes` keeps what the header and
the worker table need from events between refresh ticks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pcp_tui.shepherd.run.events import Event, PeerRefused
from pcp_tui.shepherd.run.state import FINISHED, RunState


@dataclass
class EventNotes:
    """What outlives an event's tick: each refused peer's reason, and the latest phase note."""

    refused: dict[str, str] = field(default_factory=dict)  # host -> why it was refused
    phase: str = ""  # "exporting", "waiting", "resumed_from": shown while the run starts

    def fold(self, events: Iterable[Event]) -> None:
        """Take in one tick's new events (a refused peer is keyed by host: its port changes)."""
        for event in events:
            if isinstance(event, PeerRefused):
                peer = event.peer
                self.refused[peer.rpartition(":")[0] or peer] = event.message.partition(peer)[
                    2
                ].lstrip(": ")
            elif event.kind in ("exporting", "waiting", "resumed_from"):
                self.phase = event.message


def status_text(status: str, *, failure: str | None, quitting: bool) -> str:
    """The header's status word: the state's, unless the app knows it failed or is stopping."""
    if failure and status != "failed":
        return "failed"
    if quitting and status not in FINISHED:
        return "stopping"
    return status


def header_note(
    state: RunState, *, failure: str | None, quitting: bool, pause_wanted: bool, phase_note: str
) -> str:
    """The header's one line of advice: what the run is doing and which key does what next."""
    status = state.status
    if failure:
        return f"{failure} · q exits"
    if status in FINISHED:
        return "q exits"
    if quitting:
        return "finishing this round, then goodbye · q again stops now"
    if pause_wanted and status == "training":
        return "pausing after this round"
    if status == "paused":
        return "p resumes"
    if status == "waiting":
        compiling = sum(w.state == "compiling" for w in state.workers.values())
        if compiling:
            return f"{compiling} worker{'s' if compiling != 1 else ''} compiling"
    if status in ("starting", "waiting"):
        return phase_note
    return orphan_warning(state.shards.orphaned()) if status == "training" else ""


def orphan_warning(shards: list[int]) -> str:
    """The header's warning while data shards have no worker: that data is not trained."""
    if not shards:
        return ""
    listed = ", ".join(map(str, shards))
    return f"shard{'s' if len(shards) > 1 else ''} {listed} untrained (no worker): the next to join takes it"


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
