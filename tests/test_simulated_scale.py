"""A thousand workers on trio's virtual clock: the real shepherd, protocol-level fakes.

The shepherd is the real one (admission with its handshake caps, the pool's slots, the
round engine, the shard ledger), served over `SimulatedNetwork`'s in-memory links; the
fakes speak the real protocol (HMAC handshake, plan, heartbeats, progress, results of the
plan's shapes) and answer at once. On `MockClock(autojump_threshold=0)` a round of a
thousand costs the shepherd's CPU time only, so what these runs show is what the round
code does at that scale: who is admitted, refused, dropped and counted.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import trio

from pcp_tui.diloco.aggregate import CenteredClip
from pcp_tui.shepherd.coordinator import RunFailed
from pcp_tui.shepherd.run.events import RoundDone
from pcp_tui.testing import simulate, stand_in_shepherd

pytestmark = pytest.mark.slow

WORKERS = 1000
STORMY = WORKERS // 3 + 1  # fakes 0, 3, 6, ... 999: they drop their links after round 2


@pytest.fixture(scope="module")
def storm():
    """One run of 4 rounds (5 s of seeming training each) that the tests below read."""
    shepherd = stand_in_shepherd(WORKERS, rounds=4)
    return shepherd, simulate(shepherd, WORKERS, train_seconds=5.0, storm_after=2)


def test_a_thousand_workers_dialling_at_once_all_get_through_the_handshake_caps(storm):
    """All dial at once: the shepherd finishes --max-handshakes (64) at a time and closes the
    rest, which come back as workers do (jittered back-off); the first rounds count all."""
    shepherd, run = storm
    turned_away = sum(e[:-1].count("peer closed the connection") for e in run.ends.values())
    assert turned_away >= WORKERS - shepherd.config.security.max_handshakes
    assert [r.workers for r in shepherd.state.history][:2] == [WORKERS, WORKERS]


def test_a_reconnect_storm_of_a_third_of_a_thousand_workers_is_back_the_next_round(storm):
    """After round 2 a third of the workers drop their links at once and rejoin (their
    5 s rounds give them time to): each is lost once, and the round after the storm's counts
    all of them again; every fake hears the run's goodbye."""
    shepherd, run = storm
    history = shepherd.state.history
    assert history[2].workers >= WORKERS - STORMY  # those mid-rejoin as it started miss it
    assert history[3].workers == WORKERS
    assert len(run.lost) == STORMY
    assert all(e.count("dropped") == 1 for i, e in run.ends.items() if i % 3 == 0)
    assert all(e[-1] == "goodbye" for e in run.ends.values())


RELAYS, SITE_WORKERS = 8, 200


@pytest.fixture(scope="module")
def relayed():
    """200 fakes through 8 real relays (fake i joins relay i mod 8, the shepherd next, as
    `--connect RELAY,SHEPHERD` does), 4 rounds; relay 0 is killed as round 2 ends. Also
    returns how many workers were behind relays as each round ended."""
    shepherd = stand_in_shepherd(SITE_WORKERS, rounds=4, relays=RELAYS)
    relayed: list[int] = []

    def note(event) -> None:  # before the kill: `simulate` subscribes after this
        if isinstance(event, RoundDone):
            relayed.append(sum(v.workers for v in shepherd.pool.relays.live.values()))

    shepherd.state.subscribe(note)
    run = simulate(shepherd, SITE_WORKERS, relays=RELAYS, train_seconds=5.0, relay_down_after=2)
    return shepherd, run, relayed


def test_workers_that_dial_their_relays_at_once_all_stay_behind_them(relayed):
    """All 200 dial their relays at once, past the shepherd's 64 unfinished handshakes: the
    ones it cannot take yet are told busy and try their relay again (not the shepherd
    directly, which had left 64 of 1,024 behind 32 relays), so rounds 1 and 2 count every
    worker, every one through a relay."""
    shepherd, _, behind = relayed
    history = shepherd.state.history
    assert [(r.workers, r.relays) for r in history[:2]] == [(SITE_WORKERS, RELAYS)] * 2
    assert behind[:2] == [SITE_WORKERS] * 2


def test_a_relay_killed_mid_run_loses_its_workers_once_and_they_fail_over(relayed):
    """Relay 0 dies as round 3 starts: each of its 25 workers is lost once and joins the
    shepherd directly; round 4 counts all 200 again through the 7 relays left and the
    shepherd, and no result counts twice (each round's tokens are its workers' tokens,
    each worker id once)."""
    shepherd, run, behind = relayed
    history = shepherd.state.history
    carried = SITE_WORKERS // RELAYS
    assert len(run.lost) == carried
    assert (history[3].workers, history[3].relays) == (SITE_WORKERS, RELAYS - 1)
    assert behind[3] == SITE_WORKERS - carried
    per_worker = history[0].tokens // SITE_WORKERS
    for record in history:
        assert len(set(record.worker_ids)) == record.workers
        assert record.tokens == record.workers * per_worker
    assert all(e[-1] == "goodbye" for e in run.ends.values())


STALL_RELAYS, STALL_WORKERS = 4, 40


def test_a_relay_that_hangs_mid_run_is_dropped_and_its_workers_fail_over():
    """Relay 0 hangs as round 2 ends (its sockets stay open and carry nothing, as a process
    stopped with SIGSTOP). Its 10 workers hear nothing for their silence timeout and dial
    the shepherd, which lets them in once it has dropped the relay's silent link (each lost
    once; round 3 counts the other 30, nothing of the hung relay's). Round 4 was under way
    as they came back; round 5 counts all 40 again (3 relays and the shepherd), each result
    once."""
    shepherd = stand_in_shepherd(STALL_WORKERS, rounds=5, relays=STALL_RELAYS)
    run = simulate(
        shepherd,
        STALL_WORKERS,
        relays=STALL_RELAYS,
        train_seconds=5.0,
        relay_down_after=2,
        relay_fault="stall",
    )
    history = shepherd.state.history
    carried = STALL_WORKERS // STALL_RELAYS
    assert [(r.workers, r.relays) for r in history[:2]] == [(STALL_WORKERS, STALL_RELAYS)] * 2
    assert (history[2].workers, history[2].relays) == (STALL_WORKERS - carried, STALL_RELAYS - 1)
    assert len(run.lost) == carried
    behind = [run.ends[i] for i in range(0, STALL_WORKERS, STALL_RELAYS)]  # relay 0's
    assert all(ends[0].startswith("silent for") for ends in behind)
    assert (history[4].workers, history[4].relays) == (STALL_WORKERS, STALL_RELAYS - 1)
    per_worker = history[0].tokens // STALL_WORKERS
    for record in history:
        assert len(set(record.worker_ids)) == record.workers
        assert record.tokens == record.workers * per_worker
    assert all(e[-1] == "goodbye" for e in run.ends.values())


class _FoldThatBreaks(CenteredClip):
    """The run's aggregate with a bug: folding any result raises."""

    def add(self, *args, **kwargs):
        raise RuntimeError("a bug in the fold")


def test_an_internal_error_that_every_retry_meets_stops_the_run_and_says_so():
    """A shepherd bug hit by every result (here its fold raises) drops each worker as an
    internal error; they rejoin and meet it again. After three tries of the round without a
    result the run stops as failed, naming the error and what to do, instead of retrying for
    ever."""
    shepherd = stand_in_shepherd(4, rounds=2)
    shepherd.engine.aggregates[0] = _FoldThatBreaks(shepherd.engine.fragments[0])
    tries: list[int] = []
    shepherd.state.subscribe(
        lambda e: tries.append(e.round) if e.kind == "round_repeated" else None
    )
    with pytest.raises(RunFailed) as failed:
        simulate(shepherd, 4)
    assert "failed internally in 3 tries of round 1" in str(failed.value)
    assert "RuntimeError: a bug in the fold" in str(failed.value)
    assert tries == [1, 1]  # two repeats; the third try ends the run
    assert not shepherd.state.history


FOLD_WORKERS, FOLD_RELAYS, FOLD_ROUNDS = 40, 4, 5


@pytest.mark.parametrize(("aggregate", "first_folded"), [("mean", 1), ("centered-clip", 3)])
def test_relays_fold_their_workers_results_and_the_run_is_the_flat_one(aggregate, first_folded):
    """40 workers through 4 relays that fold their results: the shepherd opens each round's
    fold at them (from round 1 with the mean; from round 3 with centered clip, whose first two
    rounds take results whole to set its radius) before their workers' round starts, so a
    worker that answers at once finds it open; every such result stays at its relay, and
    the parameters end as the same workers' flat run's to within float32 summation order (the
    issue's bound: 1e-6 of the largest parameter; measured about 5e-8)."""
    params = {}
    for relays in (0, FOLD_RELAYS):
        shepherd = stand_in_shepherd(
            FOLD_WORKERS, rounds=FOLD_ROUNDS, relays=relays, aggregate=aggregate
        )
        simulate(shepherd, FOLD_WORKERS, relays=relays)  # answers at once: after the fold
        history = shepherd.state.history
        assert [r.workers for r in history] == [FOLD_WORKERS] * FOLD_ROUNDS
        folded = [FOLD_WORKERS if relays and r.round >= first_folded else 0 for r in history]
        assert [r.relay_folded for r in history] == folded
        params[relays] = shepherd.engine.params
    for name, flat in params[0].items():
        largest = float(np.max(np.abs(flat)))
        assert np.max(np.abs(params[FOLD_RELAYS][name] - flat)) <= 1e-6 * largest, name


def test_a_straggler_folded_before_its_relay_got_the_close_counts_and_voids_nothing(monkeypatch):
    """8 workers through 2 relays, the mean folded at them; fake 7 trains 15.8 s longer in
    round 1, so the shepherd cuts it as a straggler a moment before its result reaches its
    relay, and the relay, whose close is still on its way, folds it and sends the notice.
    The relay's fold holds it: the shepherd takes that notice (the worker is the round's,
    on that relay), and the relay's other three results count with it, with no wait. Before,
    the notice was dropped as late, the fold refused as holding a result with no notice
    after a 2 s wait, and round 1 counted 4 of 8."""
    from pcp_tui.testing import _simulation

    async def drawn(shapes, seed, index):
        if index == 7:
            await trio.sleep(15.8)
        return _simulation.pseudo_gradient(shapes, seed)

    real = _simulation.fake_worker

    async def fake_worker(dial, index, **options):
        return await real(dial, index, **options, drawn=functools.partial(_drawn, drawn, index))

    monkeypatch.setattr(_simulation, "fake_worker", fake_worker)
    shepherd = stand_in_shepherd(8, rounds=2, relays=2, aggregate="mean", straggler_min_seconds=1)
    lost = []
    shepherd.state.subscribe(lambda e: lost.append(e) if e.kind == "relay_fold_lost" else None)
    simulate(shepherd, 8, relays=2, latency=0.05, train_seconds=5.0)
    assert not lost
    assert [(r.workers, r.relay_folded) for r in shepherd.state.history] == [(8, 8), (8, 8)]


async def _drawn(drawn, index, shapes, seed):
    return await drawn(shapes, seed, index)


def test_a_hostile_worker_cannot_void_its_honest_relays_fold(monkeypatch):
    """8 workers through 2 relays, the mean folded at them; fake 7 claims -1 compute seconds
    in its result, which the shepherd refuses (it ends the connection, taking no notice). Its
    relay checks the claims as the shepherd does (`Asked`), so it does not fold that result
    but passes it on, and its three other results count. Before, the relay folded it and the
    shepherd refused the relay's whole fold: round 1 counted 4 of 8."""
    from pcp_tui import protocol
    from pcp_tui.testing import _simulation

    class Lying:
        def __init__(self, stream):
            self.stream = stream

        async def send(self, body, tensors=None):
            if isinstance(body, protocol.RoundResult):
                body = dataclasses.replace(body, compute_seconds=-1.0)
            await self.stream.send(body, tensors)

        def __getattr__(self, name):
            return getattr(self.stream, name)

    real = _simulation._answer_rounds

    async def answer_rounds(stream, plan, tokens, index, *rest):
        return await real(Lying(stream) if index == 7 else stream, plan, tokens, index, *rest)

    monkeypatch.setattr(_simulation, "_answer_rounds", answer_rounds)
    shepherd = stand_in_shepherd(8, rounds=1, relays=2, aggregate="mean")
    lost = []
    shepherd.state.subscribe(lambda e: lost.append(e) if e.kind == "relay_fold_lost" else None)
    simulate(shepherd, 8, relays=2, train_seconds=5.0)
    assert [e.workers for e in lost] == []
    assert [r.workers for r in shepherd.state.history] == [7]


def test_relays_that_never_answer_a_folds_close_are_dropped_and_the_run_goes_on(monkeypatch):
    """8 workers through 2 relays whose links live but who never answer a fold's close (a
    hostile relay withholding its fold, or one whose control channel hangs). The shepherd
    waits the heartbeat timeout, then ends such a relay's link, and its workers fail over:
    the run ends, round 2 with all 8. Before, round 1 was tried again and again, every 25 s
    of virtual time, for ever: each try's results lay in folds that never came."""
    from pcp_tui import protocol
    from pcp_tui.relay import Fold, Folds

    async def serve(self, control):
        stream = protocol.MessageStream(control, clock=trio.current_time)
        while True:
            order = (await stream.receive()).body_as(protocol.Fold)
            if not order.close:
                self.open[(order.round, order.fragment)] = Fold(order, None)

    monkeypatch.setattr(Folds, "serve", serve)
    shepherd = stand_in_shepherd(8, rounds=2, relays=2, aggregate="mean")
    simulate(shepherd, 8, relays=2, train_seconds=5.0)
    assert [r.workers for r in shepherd.state.history][-1] == 8
    assert len(shepherd.state.history) == 2
