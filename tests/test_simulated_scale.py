"""A thousand workers on trio's virtual clock: the real shepherd, protocol-level fakes.

The shepherd is the real one (admission with its handshake caps, the pool's slots, the
round engine, the shard ledger), served over `SimulatedNetwork`'s in-memory links; the
fakes speak the real protocol (HMAC handshake, plan, heartbeats, progress, results of the
plan's shapes) and answer at once. On `MockClock(autojump_threshold=0)` a round of a
thousand costs the shepherd's CPU time only, so what these runs show is what the round
code does at that scale: who is admitted, refused, dropped and counted.
"""

from __future__ import annotations

import pytest

from pcp_tui.testing import simulate, stand_in_shepherd

pytestmark = pytest.mark.slow


def test_a_thousand_workers_join_through_the_handshake_caps_and_every_round_counts_them_all():
    """All dial at once: the shepherd finishes --max-handshakes (64) at a time and closes the
    rest, which come back as workers do (jittered back-off); every round counts them all."""
    workers = 1000
    shepherd = stand_in_shepherd(workers, rounds=3)
    run = simulate(shepherd, workers)
    ends, lost = run.ends, run.lost
    assert [(r.round, r.workers) for r in shepherd.state.history] == [
        (1, workers),
        (2, workers),
        (3, workers),
    ]
    assert all(e[-1] == "goodbye" for e in ends.values())  # each at the run's end
    turned_away = sum(len(e) - 1 for e in ends.values())
    assert turned_away >= workers - shepherd.config.security.max_handshakes
    assert not lost


def test_a_reconnect_storm_of_a_third_of_a_thousand_workers_is_back_the_next_round():
    """After round 2 a third of the workers drop their links at once and rejoin (their
    5 s rounds give them time to): each is lost once, none is refused for long, and the
    round after the storm counts all of them again."""
    workers = 1000
    shepherd = stand_in_shepherd(workers, rounds=4)
    run = simulate(shepherd, workers, train_seconds=5.0, storm_after=2)
    ends, lost = run.ends, run.lost
    history = shepherd.state.history
    stormy = workers // 3 + 1  # fakes 0, 3, 6, ... 999
    assert [r.workers for r in history][:2] == [workers, workers]
    assert history[2].workers >= workers - stormy  # those mid-rejoin as it started miss it
    assert history[3].workers == workers
    assert len(lost) == stormy
    assert all(e[-1] == "goodbye" for e in ends.values())
    assert all(e.count("dropped") == 1 for i, e in ends.items() if i % 3 == 0)
