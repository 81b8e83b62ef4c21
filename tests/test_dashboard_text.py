"""The dashboard's words about the run (`run_text`), as pure functions of a real RunState.

Each case is one branch of the header's advice; the app tests see only a few of
them on screen, so the precedence (a failure beats a stop, a stop beats a pause)
is pinned here.
"""

from __future__ import annotations

import pytest

from pcp_tui.app.dashboard.run_text import EventNotes, header_note, orphan_warning, status_text
from pcp_tui.shepherd.run.events import Exporting, Paused, PeerRefused, Waiting
from pcp_tui.shepherd.run.ledger import ShardLedger
from pcp_tui.shepherd.run.state import RunState, WorkerView


def run_state(status: str, shards: int = 0) -> RunState:
    state = RunState(run_id="r", rounds_total=4, settings={})
    state.status = status
    state.shards = ShardLedger(shards)
    return state


@pytest.mark.parametrize(
    ("status", "asked", "note"),
    [
        ("training", {"failure": "RunFailed: no workers"}, "RunFailed: no workers · q exits"),
        ("done", {"quitting": True}, "q exits"),
        ("training", {"quitting": True, "pause_wanted": True}, "finishing this round, then"),
        ("training", {"pause_wanted": True}, "pausing after this round"),
        ("paused", {}, "p resumes"),
        ("starting", {"phase_note": "exporting the graph"}, "exporting the graph"),
        ("training", {}, "shards 0, 1 untrained (no worker): the next to join takes it"),
    ],
)
def test_the_header_note_follows_what_was_asked_before_the_state(status, asked, note):
    state = run_state(status, shards=2)
    options = dict(failure=None, quitting=False, pause_wanted=False, phase_note="")
    assert header_note(state, **{**options, **asked}).startswith(note)


def test_compiling_workers_are_counted_while_waiting_else_the_phase_note_shows():
    state = run_state("waiting")
    assert (
        header_note(
            state, failure=None, quitting=False, pause_wanted=False, phase_note="waiting for 2"
        )
        == "waiting for 2"
    )
    for worker_id in ("a", "b"):
        state.workers[worker_id] = WorkerView(worker_id, index=0, host="h", state="compiling")
    assert (
        header_note(state, failure=None, quitting=False, pause_wanted=False, phase_note="x")
        == "2 workers compiling"
    )


def test_status_text_and_orphans():
    assert status_text("training", failure="boom", quitting=False) == "failed"
    assert status_text("training", failure=None, quitting=True) == "stopping"
    assert status_text("done", failure=None, quitting=True) == "done"
    assert (orphan_warning([]), orphan_warning([3])) == (
        "",
        "shard 3 untrained (no worker): the next to join takes it",
    )


def test_event_notes_key_refusals_by_host_and_keep_the_latest_phase():
    notes = EventNotes()
    notes.fold(
        [
            PeerRefused("refused 10.0.0.66:50000: wrong join token", peer="10.0.0.66:50000"),
            Exporting("exporting the graph"),
            PeerRefused("refused 10.0.0.66:50001: version 2", peer="10.0.0.66:50001"),
            Waiting("waiting for 2 workers"),
            Paused("pausing after the current round"),
        ]
    )
    assert notes.refused == {"10.0.0.66": "version 2"}
    assert notes.phase == "waiting for 2 workers"


def test_the_run_header_names_a_sharding_mode_only_other_than_the_default():
    from pcp_tui.app.dashboard.widgets import _run_description

    state = RunState(run_id="r", rounds_total=4, settings={"sharding": "fsdp"})
    assert all("fsdp" not in details for _, details in _run_description(state))
    state.settings["sharding"] = "data"
    assert _run_description(state)[0][1].endswith(" · data")  # the longest wording
