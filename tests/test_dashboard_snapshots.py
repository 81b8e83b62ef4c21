"""SVG snapshots of the dashboard fed with a hand-made RunState (no shepherd, frozen clocks).

Regenerate after an intended layout change with `pytest tests/test_dashboard_snapshots.py --snapshot-update`
and look at the SVGs under tests/__snapshots__/ before committing them.
"""

from __future__ import annotations

import time

import pytest

from pcp_tui.shepherd.run.events import Waiting
from pcp_tui.testing.dashboard import NOW, WALL, fake_state, frozen_app


@pytest.fixture(autouse=True)
def _utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_dashboard_80x24(snap_compare):
    assert snap_compare(frozen_app(fake_state()), terminal_size=(80, 24))


def test_dashboard_160x48(snap_compare):
    assert snap_compare(frozen_app(fake_state()), terminal_size=(160, 48))


def test_dashboard_finished_linear_zoomed_100x30(snap_compare):
    state = fake_state(status="done")
    state.finished_at = NOW
    assert snap_compare(frozen_app(state), terminal_size=(100, 30), press=["l", "z"])


def test_dashboard_waiting_for_workers_80x24(snap_compare):
    state = fake_state(status="waiting")
    state.round, state.history, state.step_losses = 0, [], type(state.step_losses)()
    state.events.clear()
    state.events.append(Waiting("waiting for 2 worker(s)", at=WALL))
    state.workers = {"late-3": state.workers["late-3"]}
    state.bytes_sent, state.bytes_received = 600_000, 0
    assert snap_compare(frozen_app(state), terminal_size=(80, 24))


def test_help_screen(snap_compare):
    assert snap_compare(frozen_app(fake_state()), terminal_size=(80, 24), press=["question_mark"])


def test_dashboard_60x15_drops_panels(snap_compare):
    assert snap_compare(frozen_app(fake_state()), terminal_size=(60, 15))


def test_worker_detail(snap_compare):
    assert snap_compare(frozen_app(fake_state()), terminal_size=(100, 30), press=["enter"])
