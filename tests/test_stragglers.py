"""The straggler window: a round waits for the rest of its results only so long after its quorum.

The unit tests drive `results.collect` on trio's `MockClock` with a real `Round`
and real results, so every close time is exact; the links are stand-ins holding
what `collect` reads of a `WorkerLink`: when its roundStart went out, how long its
latest results took, and whether a message is partly in.
The end-to-end test runs a real worker beside one that heartbeats but never
answers, through the default-on window, on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
from dataclasses import dataclass, field

import numpy as np
import pytest
import trio
import trio.testing

from pcp_tui import protocol
from pcp_tui.app.headless import HeadlessPrinter
from pcp_tui.config.service import NetworkConfig
from pcp_tui.diloco.outer import PseudoGradientMean
from pcp_tui.diloco.screening import ResultScreen
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.shepherd.rounds import results
from pcp_tui.shepherd.rounds.claims import ResultClaims
from pcp_tui.shepherd.rounds.record import WorkerRounds
from pcp_tui.shepherd.rounds.results import Round, collect
from pcp_tui.shepherd.rounds.sitting_out import caught_up, hung_reason
from pcp_tui.shepherd.run.state import RunState, WorkerView
from pcp_tui.testing import (
    faulty_worker_command,
    memory_link,
    pause_after_round,
    run_shepherd,
    until,
)
from pcp_tui.training.build import build_workload

from .conftest import small_config, worker_env

SHAPES = {"w": (2, 3)}


@dataclass
class Link:
    """What `collect` reads of a `WorkerLink`: its real record in the rounds."""

    rounds: WorkerRounds = field(default_factory=WorkerRounds)
    admitted_at: float = 0.0  # welcomed, and ready at once unless a test says otherwise
    ready_at: float | None = 0.0
    worker_id: str = ""
    view: WorkerView = field(default_factory=lambda: WorkerView("w", 0, "127.0.0.1"))

    def paused(self) -> contextlib.AbstractContextManager:
        """What `Round.add` holds while it screens a result (no watchdog here to pause)."""
        return contextlib.nullcontext()


def result(shapes=SHAPES) -> protocol.Message:
    body = protocol.RoundResult(
        round=1, tokens=8, losses=(2.0,), compute_seconds=1.0, inner_steps=1
    )
    tensors = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
    return protocol.Message(body, tensors, wire_bytes=64)


def run_round(network: NetworkConfig, script, participants=("a", "b", "c"), shapes=SHAPES):
    """Run `collect` for one round while `script(current, links)` plays the workers;
    (the close time on the mock clock, the round, the run's events)."""
    state = RunState(run_id="test", rounds_total=1, settings={})
    links = {w: Link(worker_id=w) for w in participants}
    screen = ResultScreen(shapes, max_tokens=100)
    current = Round(
        1, list(participants), PseudoGradientMean(tuple(shapes)), screen, connections=links
    )

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(script, current, links)
            await collect(current, network, state)
            closed = trio.current_time()
            await current.close()  # as a round does: a result being folded in finishes first
            nursery.cancel_scope.cancel()
        return closed

    closed = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return closed, current, state.events


async def deliver(current: Round, at: dict[str, float]) -> None:
    """Mark each worker's roundStart delivered at its time (ascending)."""
    for worker, moment in sorted(at.items(), key=lambda item: item[1]):
        await trio.sleep_until(moment)
        current.connections[worker].rounds.delivered(current.number)


async def answer(current: Round, worker: str, at: float, shapes=SHAPES) -> None:
    await trio.sleep_until(at)
    await current.add(worker, result(shapes))


def late(events) -> list[str]:
    """The workers a round closed without (its `stragglers` event), [] if none."""
    return [w for e in events if e.kind == "stragglers" for w in e.workers]


def window(factor: float, floor: float, **changes) -> NetworkConfig:
    return NetworkConfig(straggler_factor=factor, straggler_min_seconds=floor, **changes)


def test_a_worker_that_never_answers_is_dropped_at_factor_times_the_first_result():
    async def script(current, links):
        await deliver(current, {"a": 0, "b": 0, "c": 0})
        await answer(current, "a", 10.0)
        await answer(current, "b", 25.0)  # 2.5x the first: inside the window

    closed, current, events = run_round(window(3.0, 5.0), script)
    assert closed == 30.0  # c's roundStart went out at 0; window max(5, 3 x 10)
    assert current.contributors == ["a", "b"] and not current.pending
    (stragglers,) = [e for e in events if e.kind == "stragglers"]
    assert stragglers.workers == ["c"]
    assert "straggler window of 30 s" in stragglers.message
    assert "--adaptive-steps" in stragglers.message


def test_the_window_counts_from_each_workers_own_delivery():
    async def script(current, links):
        await deliver(current, {"a": 0, "b": 0})
        await answer(current, "a", 10.0)
        await deliver(current, {"c": 20.0})  # a slow link: its parameters arrived at 20 s

    closed, current, _ = run_round(window(3.0, 5.0), script)
    assert closed == 50.0  # b's window ended at 30, c's at 20 + 30
    assert current.contributors == ["a"]


def test_a_result_arriving_is_waited_for_past_the_window():
    async def script(current, links):
        await deliver(current, {"a": 0, "b": 0, "c": 0})
        await answer(current, "a", 10.0)
        await trio.sleep_until(28.0)
        links["b"].rounds.result_arriving = True  # b's upload began inside its window
        await answer(current, "b", 41.0)

    closed, current, _ = run_round(window(3.0, 5.0), script)
    assert current.contributors == ["a", "b"]
    assert closed == 41.0  # c was overdue at 30; the round closed when b's result was in


def test_a_worker_whose_last_result_was_refused_gets_the_quorums_pace_not_the_floor():
    """Issue 25: a peer that answered zeros near its window's end held every round that long
    (the floor is 60 s by default; its progress projected a long round of its own). Once a
    result of its is refused, it has factor x the quorum's time, no floor, nothing of its
    own; a worker in good standing beside it keeps the whole window."""

    async def script(current, links):
        links["c"].rounds.unproven = 1
        links["c"].rounds.answer_seconds[0] = 500.0  # what it would buy, and its progress too:
        links["c"].rounds.progress = (current.number, 1, 500, 1.0)  # step 1 of 500 at 1 s
        links["b"].rounds.answer_seconds[0] = 1.0  # it has answered before: no stranger
        await deliver(current, {"a": 0, "b": 0, "c": 0})
        await answer(current, "a", 2.0)

    closed, current, events = run_round(window(3.0, 60.0), script)
    assert closed == 60.0  # b: the window (the floor, 60); c: 3 x 2 = 6 s, long past
    assert current.contributors == ["a"]
    (stragglers,) = [e for e in events if e.kind == "stragglers"]
    assert stragglers.workers == ["b", "c"]

    async def without_b(current, links):
        links["c"].rounds.unproven = 1
        links["c"].rounds.progress = (current.number, 1, 500, 1.0)  # projects 500 s
        await deliver(current, {"a": 0, "c": 0})
        await answer(current, "a", 2.0)

    closed, current, _ = run_round(window(3.0, 60.0), without_b, participants=("a", "c"))
    assert closed == 6.0  # before: 3 x 500 (its projection), at most 3² x 60 = 540 s


def test_a_refusal_during_the_wait_puts_the_refused_worker_on_probation_at_once():
    """Red team on the straggler wait that looks again only once a waiting worker leaves or
    the clock reaches the earliest due time: a validated round's check refuses a worker's
    previous result while the next round waits (`checks.py`, one round later). Its window
    there is the probation (3 x 2 s) from then on; when b answers at 10 s nobody else is left
    to wait for, and the round closes then, as it did when every leave made it look again.
    Before, it waited on to b's old due time (the floor, 60 s), and a worker whose zeros were
    just refused held the round 50 s more."""

    async def script(current, links):
        links["b"].rounds.answer_seconds[0] = 1.0  # answered before: the floor, no stranger
        links["c"].rounds.answer_seconds[0] = 40.0  # its own time: 3 x 40 s
        opened = results.OpenRounds()  # what the check is given, as the engine gives it
        opened.rounds = [current]
        await deliver(current, {"a": 0, "b": 0, "c": 0})
        await answer(current, "a", 2.0)
        await trio.sleep_until(3.0)  # the check of c's previous result refuses it
        refused = results.BadResult("no gain")
        state = RunState(run_id="test", rounds_total=1, settings={})
        results.note_refusal(state, links["c"], 0, 0, refused, opened)
        await answer(current, "b", 10.0)

    closed, _, events = run_round(window(3.0, 60.0), script)
    assert (closed, late(events)) == (10.0, ["c"])


def test_progress_that_shortens_a_workers_own_time_shortens_its_window_at_once():
    """Red team on the same wait: c's first report (step 1 of 100, 1 s in) projects 100 s, so
    its window is 2 x 60 s (its own time, up to factor x the window); 6 s in it is at step 60,
    which projects 10 s: its window is the round's 30 s from then on. b, whose last result
    was refused, is overdue at 2 s and its late result lands at 8 s. Looking again at every
    leave closed the round at 30 s; looking only when a waiting worker leaves or the earliest
    due time comes, at 120 s. A progress report now has its sender's window looked at again
    (itself, not every pending worker: progress comes a few times a second from each)."""

    async def script(current, links):
        links["b"].rounds.unproven = 1  # the quorum's pace, no floor: 2 x 1 s
        opened = results.OpenRounds()  # what the pool tells of each progress report
        opened.rounds = [current]

        def progress(step: int) -> None:
            training = protocol.Progress(1, step, 100, 3.0, 1.0, protocol.Phase.TRAINING)
            links["c"].rounds.progressed(training)
            opened.reconsider("c")

        await deliver(current, {"a": 0, "b": 0, "c": 0})
        await trio.sleep_until(1.0)
        progress(1)
        await answer(current, "a", 1.0)
        await trio.sleep_until(6.0)
        progress(60)
        await answer(current, "b", 8.0)

    closed, _, events = run_round(window(2.0, 30.0), script)
    assert (closed, late(events)) == (30.0, ["c"])


def test_a_projection_whose_promise_is_broken_buys_no_more_of_the_window():
    """Red team: a peer that reports "step 1 of 10" 1 s in (10 s projected) and then only
    heartbeats has factor (4) x 10 s of its own while its projection holds; it holds only
    until PROMISE_SLACK (2) x 10 s have passed (`WorkerRounds.projected_seconds`: a promise
    not kept buys nothing more). The straggler wait did not look again then, and the round
    waited for it to 40 s: factor x the projection, where the promise rule gives 20 s."""

    async def script(current, links):
        await deliver(current, {"a": 0, "c": 0})
        links["c"].rounds.progress = (current.number, 1, 10, 1.0)
        await answer(current, "a", 1.0)

    closed, current, _ = run_round(window(4.0, 5.0), script, participants=("a", "c"))
    assert closed == 20.0  # the round's window, 5 s, long past once the promise is broken


def test_a_worker_whose_own_results_take_longer_keeps_its_own_window():
    """A peer answering at once (a liar, or a far smaller model of speed) makes the round's
    window the floor; c's own latest result took 8 s, so it keeps 3 x 8 s."""

    async def script(current, links):
        links["c"].rounds.answer_seconds[0] = 8.0
        await deliver(current, {"a": 0, "b": 0, "c": 0})
        await answer(current, "a", 0.5)
        await answer(current, "c", 23.0)

    closed, current, events = run_round(window(3.0, 5.0), script)
    assert closed == 23.0  # b (no history) was overdue at 5 s; c had until 24 s
    assert current.contributors == ["a", "c"]
    assert [e.workers for e in events if e.kind == "stragglers"] == [["b"]]


@pytest.mark.parametrize("source", ["result", "progress"])
@pytest.mark.parametrize(("own", "closes"), [(40.0, 45.0), (36_000.0, 45.0), (10.0, 30.0)])
def test_a_workers_own_time_counts_up_to_factor_times_the_window(own, closes, source):
    """Fifth red-team pass: a peer dropped as a straggler that sent its late result ten hours
    after its roundStart, then hung in the next round it was given, held that round for
    3 x 36,000 s; and one answering just before each window's end multiplied its own window
    by the factor every round (5, 15, 45, 135 s, ...). Its own time now counts up to factor
    times the round's window, so no worker's window passes factor^2 x the round's. The same
    bound holds for the time its progress reports project (step 1 of a million...)."""

    async def script(current, links):
        if source == "result":
            links["c"].rounds.answer_seconds[0] = own
        else:
            # its latest progress report: step 1 of `own` steps, 1 s after its delivery at 0
            links["c"].rounds.progress = (current.number, 1, int(own), 1.0)
        await deliver(current, {"a": 0, "b": 0, "c": 0})
        await answer(current, "a", 0.5)
        await answer(current, "b", 1.0)

    closed, current, events = run_round(window(3.0, 5.0), script)
    if source == "progress" and own < 15:  # its one report's promise breaks at 2 x own first
        closes = 2 * own
    assert closed == closes  # the round's window is max(5, 3 x 0.5) = 5 s; c's, 3 x min(own, 15)
    assert [e.workers for e in events if e.kind == "stragglers"] == [["c"]]


@pytest.mark.parametrize("timeout", [0.0, 3.0], ids=["window", "round-timeout"])
def test_a_result_being_folded_in_as_the_round_closes_counts_and_is_no_straggler(
    monkeypatch, timeout
):
    """Fifth red-team pass: a result whose upload straddled the window's end was waited for,
    but not the fold that follows (in a thread for a model-sized result): the window's next
    look closed the round while it was folded in. The round counted it and also named its
    worker a straggler, which then sat new rounds out waiting for a result it had already
    sent: for ever (the last worker of a run: the run waited for ever). The same at a
    --round-timeout falling inside the fold."""
    shapes = {"w": (4, 2**20)}  # 16 MB: its fold takes a few milliseconds

    async def script(current, links):
        await deliver(current, {"a": 0, "b": 0})
        monkeypatch.setattr(results, "INLINE_BYTES", 2**30)  # a's: on the event loop
        await answer(current, "a", 1.0, shapes)
        monkeypatch.setattr(results, "INLINE_BYTES", 0)  # b's: in a thread, as a model-sized one
        await trio.sleep_until(2.0)
        links["b"].rounds.result_arriving = True  # its upload began inside its window (due at 5 s)
        await trio.sleep_until(2.9 if timeout else 6.0)
        links["b"].rounds.result_arriving = False  # all in; its fold takes a thread's time
        await current.add("b", result(shapes))

    network = window(3.0, 5.0, round_timeout=timeout)
    closed, current, events = run_round(network, script, ("a", "b"), shapes)
    assert current.contributors == ["a", "b"]
    assert [e.workers for e in events if e.kind == "stragglers"] == []


def test_a_fragment_round_reads_the_times_of_its_own_fragment():
    async def script(current, links):
        links["b"].rounds.answer_seconds.update({0: 10.0, 1: 14.0, 2: 1000.0})
        await deliver(current, {"a": 0, "b": 0})
        await answer(current, "a", 1.0)

    network = window(3.0, 5.0)
    for fragment, closes in ((0, 30.0), (1, 42.0)):
        state = RunState(run_id="test", rounds_total=1, settings={})
        links = {w: Link() for w in ("a", "b")}
        current = Round(
            1,
            ["a", "b"],
            PseudoGradientMean(tuple(SHAPES)),
            ResultScreen(SHAPES, max_tokens=100),
            connections=links,
            fragment=fragment,
        )

        async def main(current=current, links=links, state=state):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(script, current, links)
                await collect(current, network, state)
            return trio.current_time()

        assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == closes


def test_the_window_is_at_least_the_floor():
    async def script(current, links):
        await deliver(current, {"a": 0, "b": 0, "c": 0})
        for worker in ("b", "c"):  # training: step 1 of 10 at 0.1 s
            links[worker].rounds.progress = (current.number, 1, 10, 0.1)
        await answer(current, "a", 1.0)

    closed, _, _ = run_round(window(3.0, 5.0), script)
    assert closed == 5.0


def test_a_worker_that_has_shown_nothing_gets_the_quorums_pace_not_the_floor():
    """Issue 25, squatting at the defaults: token holders that said ready at once and never
    trained were sent every round beside the honest workers and held each for the floor
    (60 s) after the honest results came in 3 s. A connection that has shown nothing (no
    progress, no result) is waited for factor x the quorum's time, or factor x its own time
    from welcome to ready if longer (below: 0, said ready at once); once it reports progress
    it is timed by its own pace (`b`: step 1 of 10 at 5 s projects 50 s, so 3 x 50 while that
    promise holds: 2 x 50), and one
    that has answered before keeps the floor (`d`)."""

    async def script(current, links):
        links["d"].rounds.answer_seconds[0] = 1.0
        await deliver(current, {"a": 0, "b": 0, "c": 0, "d": 0})
        await answer(current, "a", 2.0)
        await trio.sleep_until(5.0)
        links["b"].rounds.progress = (current.number, 1, 10, 5.0)

    closed, current, events = run_round(
        window(3.0, 60.0), script, participants=("a", "b", "c", "d")
    )
    # c: 3 x 2 = 6 s; d: the floor, 60 s; b: 3 x its own 50 s, until that promise breaks
    # (2 x 50 s: it reported nothing more)
    assert closed == 100.0
    (stragglers,) = [e for e in events if e.kind == "stragglers"]
    assert stragglers.workers == ["b", "c", "d"]

    async def silent(current, links):
        await deliver(current, {"a": 0, "c": 0})
        await answer(current, "a", 2.0)

    closed, _, _ = run_round(window(3.0, 60.0), silent, participants=("a", "c"))
    assert closed == 6.0  # before: the floor, 60 s

    async def slow_to_ready(current, links):
        links["c"].ready_at = 5.0  # 5 s from its welcome to ready: its first chunk may take 3 x
        await deliver(current, {"a": 0, "c": 0})
        await answer(current, "a", 0.1)  # a fast answer (a liar's, say) does not cut it shorter

    closed, _, _ = run_round(window(3.0, 60.0), slow_to_ready, participants=("a", "c"))
    assert closed == 15.0

    async def slow_to_ready_again(current, links):
        """Its first round was an earlier one (at 0 s; it showed nothing there either): its
        welcome-to-ready time bought it 3 x 5 s in that round only, not in every round."""
        links["c"].ready_at = 5.0
        links["c"].rounds.delivered(0)
        await deliver(current, {"a": 2.0, "c": 2.0})
        await answer(current, "a", 2.5)

    closed, _, _ = run_round(window(3.0, 60.0), slow_to_ready_again, participants=("a", "c"))
    assert closed == 2.0 + 3 * 0.5  # the quorum's pace; before: 2 + 3 x 5


def test_the_window_starts_at_the_quorum_and_scales_with_its_time():
    async def script(current, links):
        await deliver(current, {"a": 0, "b": 0, "c": 0})
        await answer(current, "a", 2.0)
        await answer(current, "b", 8.0)

    closed, current, _ = run_round(window(2.0, 1.0, min_workers=2, workers=3), script)
    assert closed == 16.0  # the second result's 8 s, twice
    assert current.contributors == ["a", "b"]


def test_factor_zero_waits_for_every_result():
    async def script(current, links):
        await deliver(current, {"a": 0, "b": 0, "c": 0})
        await answer(current, "a", 1.0)
        await answer(current, "b", 500.0)
        await answer(current, "c", 1000.0)

    closed, current, events = run_round(window(0.0, 5.0), script)
    assert closed == 1000.0
    assert current.contributors == ["a", "b", "c"]
    assert not [e for e in events if e.kind == "stragglers"]


@pytest.mark.parametrize(("factor", "closes"), [(0.0, 20.0), (3.0, 20.0), (1.5, 15.0)])
def test_round_timeout_closes_the_round_if_it_comes_first(factor, closes):
    async def script(current, links):
        await deliver(current, {"a": 0, "b": 0, "c": 0})
        await answer(current, "a", 10.0)
        await answer(current, "b", 100.0)

    closed, current, events = run_round(window(factor, 5.0, round_timeout=20.0), script)
    assert closed == closes  # --round-timeout 20 s, or the window's 1.5 x 10 s
    assert current.contributors == ["a"]
    (stragglers,) = [e for e in events if e.kind == "stragglers"]
    assert ("--round-timeout" in stragglers.message) == (closes == 20.0)


def test_a_round_timeout_without_the_quorum_waits_on_for_it():
    async def script(current, links):
        await deliver(current, {"a": 0, "b": 0, "c": 0})
        await answer(current, "a", 100.0)

    closed, current, events = run_round(window(3.0, 5.0, round_timeout=40.0), script)
    assert closed == 100.0  # --min-workers 1: the first result closes it, past the timeout
    assert current.contributors == ["a"]
    assert [e.kind for e in events] == ["round_waiting", "stragglers"]


@pytest.mark.parametrize("factor", [4.0, 0.0])
def test_the_options_reach_the_network_section(factor):
    config = small_config(straggler_factor=factor, straggler_min_seconds=2.5)
    assert config.network.straggler_factor == factor
    assert config.network.straggler_min_seconds == 2.5


@pytest.mark.e2e
@pytest.mark.parametrize("fragments", [1, 2], ids=["plain", "streaming"])
def test_a_peer_that_heartbeats_but_never_answers_costs_one_window(spawn_worker, fragments):
    """The red team's finding: with no --round-timeout a silent-but-alive worker held its
    round for ever. Now its round closes one window after the honest worker's result, and
    it sits the next rounds out until that result comes. It sends no progress either, so
    one window later it counts as hung: its connection ends, it reconnects (its stalled
    round is cancelled with the connection) and trains again from the next round."""
    config = small_config(
        workers=2,
        rounds=4,
        inner_steps=4,
        straggler_factor=2.0,
        straggler_min_seconds=1.0,
        streaming_fragments=fragments,
        overlap_steps=1 if fragments > 1 else 0,
    )
    shepherd = Shepherd(config, build_workload(config, shards=2))
    workers, events = shepherd.state.workers, shepherd.state.events

    def kinds(kind: str) -> list:
        return [e for e in events if e.kind == kind and e.fields().get("worker") in (None, "hung")]

    async def scenario(port):
        pause_after_round(shepherd, 3)  # held until the hung worker is back
        spawn_worker(port, "--id", "steady")
        command = faulty_worker_command(port, "stall", "--id", "hung", round=2, seconds=3600)
        hung = subprocess.Popen(
            command, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        sitting_out = "late for round 2: sits new rounds out until that result comes"
        try:
            await until(lambda: "hung" in workers and workers["hung"].reason == sitting_out)
            await until(
                lambda: shepherd.state.status == "paused" and len(shepherd.state.history) == 3
            )
            await until(lambda: kinds("rejoined") and workers["hung"].state == "idle")
            shepherd.resume()
            await until(lambda: any(e.kind == "done" for e in events))
        finally:
            hung.kill()
            await trio.to_thread.run_sync(hung.wait)

    run_shepherd(shepherd, scenario)
    history = shepherd.state.history
    assert [r.round for r in history] == [1, 2, 3, 4]
    assert history[0].workers == 2
    assert [r.worker_ids for r in history[1:3]] == [("steady",), ("steady",)]
    dropped = [e for e in events if e.kind == "stragglers"]
    # each of round 2's fragments closed without it; round 3 did not wait for it
    assert [e.workers for e in dropped] == [["hung"]] * fragments
    (lost,) = kinds("lost")
    assert "hung: no result and no progress for round 2" in lost.message, lost.message
    assert set(history[3].worker_ids) == {"steady", "hung"}  # back, and trained round 4


def test_a_round_short_of_its_quorum_says_whom_it_waits_for():
    """Fifth red-team pass: with --min-workers 2 of 2 the window never starts (there is no
    'other' worker), and a peer that heartbeats but never answers held the round for ever
    without a word. The round still waits (the operator asked for two results), but says so
    one window after the first result, naming the worker and what to do."""

    async def script(current, links):
        await deliver(current, {"a": 0, "b": 0})
        await answer(current, "a", 1.0)
        await answer(current, "b", 500.0)

    network = window(3.0, 5.0, min_workers=2, workers=2)
    closed, current, events = run_round(network, script, ("a", "b"))
    assert closed == 500.0 and current.contributors == ["a", "b"]
    (waiting,) = [e.message for e in events]
    assert waiting.startswith(
        "round 1 has 1 of the 2 results --min-workers asks for, 5 s (the straggler window) "
        "after the first; waiting for b"
    )
    assert "waiting for b" in waiting and "--min-workers" in waiting
    log = io.StringIO()  # the headless log showed no round_waiting line, this one nor another
    HeadlessPrinter(RunState(run_id="test", rounds_total=1, settings={}), log)(events[0])
    assert log.getvalue() == waiting + "\n"


async def test_a_worker_sitting_out_is_hung_only_after_a_grace_without_progress(autojump_clock):
    link = Link()  # dropped from round 2 at 0 s, with 10 s to show a sign of it
    link.rounds.behind, link.rounds.behind_since, link.rounds.behind_grace = 2, 0.0, 10.0
    await trio.sleep_until(10.0)
    assert hung_reason(link.rounds) == ""  # within its grace
    link.rounds.progress = (2, 3, 4, 9.0)  # a slow worker, still at it: step 3 of 4
    await trio.sleep_until(19.0)
    assert hung_reason(link.rounds) == ""  # 10 s since its latest report
    link.rounds.progress = (3, 1, 4, 18.0)  # progress of another round does not count
    await trio.sleep_until(19.5)
    reason = hung_reason(link.rounds)
    assert reason.startswith("hung: no result and no progress for round 2 in 20 s"), reason
    link.rounds.behind = 0  # its late result came
    assert hung_reason(link.rounds) == ""


async def test_progress_puts_a_hang_off_for_three_graces_at_most(autojump_clock):
    """Issue 25: a peer that reported progress for its round and never answered sat out as long
    as it liked, its shard untrained. Progress puts the cut-off off, up to SIT_OUT_GRACES."""
    link = Link()  # dropped from round 2 at 0 s, with 10 s to show a sign of it
    link.rounds.behind, link.rounds.behind_since, link.rounds.behind_grace = 2, 0.0, 10.0
    for moment in range(5, 30, 5):
        await trio.sleep_until(float(moment))
        link.rounds.progress = (2, 1, 4, float(moment))  # step 1 of 4, said again and again
        assert hung_reason(link.rounds) == "", moment
    await trio.sleep_until(30.5)
    link.rounds.progress = (2, 1, 4, 30.5)
    reason = hung_reason(link.rounds)
    assert reason.startswith("no result for round 2 in 30 s since its round closed"), reason
    assert "its shard goes to the next worker to join" in reason


async def test_a_streaming_worker_sitting_out_is_back_with_its_last_fragments_result():
    """Issue 25: a streaming worker sitting out round 1 was back with its first fragment's late
    result and was sent the repeat of round 1 while it still trained the old one; the old
    one's second fragment result was then taken as the repeat's. It is back with its last
    fragment's (plain DiLoCo: its one result)."""
    streaming = memory_link("streaming")
    streaming.rounds.claims = ResultClaims(tokens_per_step=8, fragments=2)  # `bind_to_plan`
    streaming.rounds.behind, streaming.rounds.missed = 1, True
    assert not caught_up(streaming, 1, 0) and streaming.rounds.behind == 1
    assert caught_up(streaming, 1, 1)
    assert streaming.rounds.behind == 0 and not streaming.rounds.missed
    plain = memory_link("plain")
    plain.rounds.behind = 1
    assert caught_up(plain, 1, 0) and plain.rounds.behind == 0
