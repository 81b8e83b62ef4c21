"""Slot squatting: token holders that join, read the plan and never say ready.

Four of them held every admitted-connection slot of a `--workers 2` shepherd for as
long as they liked; the honest workers heard `busy` on every retry. Now a newcomer
takes the slot of the connection longest not ready, once that has had its grace
(`shepherd/serving/slots.py`), and --ready-timeout drops one that never gets ready.

The rules on trio's MockClock with real WorkerLinks; then a live shepherd in this
process, four squatting peers over 127.0.0.1 that join again whenever they are put
out, and two real `pcp-tui worker` processes that must get in and train.
"""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from pcp_tui import protocol
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.shepherd.serving import slots
from pcp_tui.shepherd.serving.connection import WorkerLink
from pcp_tui.testing import (
    PEER_ERRORS,
    connect_peer,
    faulty_worker_command,
    memory_link,
    peer_hello,
    ready_peer,
    run_shepherd,
    small_config,
    until,
)
from pcp_tui.training.build import build_workload


def _links(count: int) -> list[WorkerLink]:
    """`count` real WorkerLinks (of memory streams), welcomed now, none ready."""
    return [memory_link(f"w{index}", index) for index in range(count)]


def _ready(link: WorkerLink) -> None:
    link.ready_at = trio.current_time()
    link.ready.set()


def _sent(link: WorkerLink, number: int) -> None:
    """Round `number`'s roundStart went out to `link` and was delivered now."""
    link.rounds.started(number)
    link.rounds.delivered(number)


RULES = slots.SlotRules(ready_timeout=600, straggler_factor=4.0, workers=2)


def test_a_newcomer_takes_the_slot_of_the_connection_longest_not_ready_after_its_grace():
    """Links welcomed at 0, 10 and 20 s; the one of 0 s says ready at 5 s and has earned its
    slot. The grace is 45 s (--ready-timeout 600). Just before 55 s no link has waited 45 s;
    at 55 s the one of 10 s has, and it goes (the earned one never); a closed one is not
    counted; the next frees at 65 s. --ready-timeout drops a link not ready 600 s after its
    welcome, never a ready one."""

    async def main() -> None:
        links = []
        for index in range(3):
            links += _links(1)
            await trio.sleep(5)
            if index == 0:
                _ready(links[0])
                links[0].view.rounds_contributed = 1
            await trio.sleep(5)
        grace = slots.evictable_after(600)
        assert grace == slots.EVICTABLE_AFTER == 45 and slots.evictable_after(40) == 10
        assert slots.next_to_free(links, RULES) == 55
        await trio.sleep_until(55 - 1e-6)
        assert slots.slot_to_take(links, trio.current_time(), RULES) is None
        await trio.sleep_until(55)
        assert slots.slot_to_take(links, trio.current_time(), RULES) is links[1]
        links[1].closed = True
        assert slots.slot_to_take(links, trio.current_time(), RULES) is None
        assert slots.next_to_free(links, RULES) == 65
        await trio.sleep_until(620)  # links[2] was welcomed at 20 s
        assert slots.not_ready_reason(links[2], 600, trio.current_time()) == ""
        await trio.sleep_until(621)
        reason = slots.not_ready_reason(links[2], 600, trio.current_time())
        assert reason.startswith("not ready 601 s after its welcome (--ready-timeout 600 s)")
        assert slots.not_ready_reason(links[0], 600, trio.current_time()) == ""

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_ready_link_that_shows_nothing_after_its_round_starts_gives_its_slot_up():
    """Four squatters say ready at once and are sent round 1 at 1 s; they show nothing. With
    nothing measured they keep their slots the grace (45 s) from their roundStart, and go
    in the order they got it. An honest worker whose result was taken is never moved; once
    it answered round 2 in 20 s, a silent link keeps its slot 4 x 20 = 80 s (the slowest
    answer times --straggler-factor: what an honest newcomer as slow needs), and one that
    reported progress while that progress keeps its promise (`kept`). A ready link not sent
    a round is moved only while fewer than --workers links were sent a round or earned."""

    async def main() -> None:
        squatters = _links(4)
        for link in squatters:
            _ready(link)
        await trio.sleep(1)
        for link in squatters:
            _sent(link, 1)
            await trio.sleep(0.5)
        assert slots.next_to_free(squatters, RULES) == 1 + 45
        await trio.sleep_until(46)
        assert slots.slot_to_take(squatters, trio.current_time(), RULES) is squatters[0]
        await trio.sleep_until(47.5)
        assert slots.slot_to_take(squatters, trio.current_time(), RULES) is squatters[0]
        squatters[0].closed = True  # each newcomer in line takes one
        assert slots.slot_to_take(squatters, trio.current_time(), RULES) is squatters[1]

        # an honest worker, sent round 2 at 100 s, answers at 120 s: counted
        honest, silent, talker, waiting = _links(4)
        await trio.sleep_until(100)
        for link in (honest, silent, talker, waiting):
            _ready(link)
        for link in (honest, silent, talker):
            _sent(link, 2)
        await trio.sleep_until(110)  # "step 1 of 10" 10 s in: 100 s a round, promised by 300
        talker.rounds.progressed(protocol.Progress(2, 1, 10, 1.0, 1.0, protocol.Phase.TRAINING))
        assert talker.rounds.shown_work and not silent.rounds.shown_work
        await trio.sleep_until(120)
        honest.rounds.answered(2, 0)
        honest.rounds.took(0)
        links = [honest, silent, talker, waiting]
        assert RULES.silent_seconds(links) == 4 * 20
        # the honest one has earned its slot; three links sent or earned, of --workers 2:
        # `waiting` (ready, not sent) is not needed; `silent` goes at 100 + 80
        assert slots.next_to_free(links, RULES) == 180
        await trio.sleep_until(180 - 1e-6)
        assert slots.slot_to_take(links, trio.current_time(), RULES) is None
        await trio.sleep_until(180)
        assert slots.slot_to_take(links, trio.current_time(), RULES) is silent
        silent.closed = True
        assert slots.next_to_free(links, RULES) == 100 + 200  # the talker: its promise
        talker.closed = True  # one of 2 working: the run needs `waiting`'s slot
        assert slots.next_to_free(links, RULES) == 100 + 80
        waiting.view.rounds_contributed = 1  # it contributed before a reconnect: earned
        assert slots.next_to_free(links, RULES) is None

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_link_that_shows_nothing_holds_its_round_only_as_long_as_it_would_keep_its_slot():
    """Two ids that said ready at once were round 1's only workers at --workers 2; the honest
    workers found free slots, so no newcomer waited in line to move them out, and round 1
    waited for them for ever. Now one that shows nothing is taken out of its round at the
    bound a newcomer in line has (the grace, 45 s, from its first roundStart), once a ready
    worker waits for the round it holds; not before, not without one waiting, and never one
    whose result was taken. One that reported progress and never answers is taken out once
    that progress has not kept its promise (before, never: round 1 held for ever)."""

    async def main() -> None:
        squatter, talker, earned = _links(3)
        for link in (squatter, talker, earned):
            _ready(link)
            _sent(link, 1)
        earned.rounds.results_taken = 1
        silent = RULES.silent_seconds([squatter, talker, earned])
        assert silent == slots.EVICTABLE_AFTER

        def reason(link: WorkerLink, holds: bool = True) -> str:
            return slots.holding_reason(
                link,
                lambda: silent,
                trio.current_time(),
                holds_a_round=lambda: holds,
                ready_timeout=RULES.ready_timeout,
            )

        await trio.sleep_until(6)  # "step 1 of 10" 6 s in: 60 s a round, promised by 120 s
        talker.rounds.progressed(protocol.Progress(1, 1, 10, 1.0, 1.0, protocol.Phase.TRAINING))
        await trio.sleep_until(45 - 1e-6)
        assert reason(squatter) == ""
        await trio.sleep_until(45)
        assert reason(squatter).startswith("no progress and no result 45 s after its first")
        assert reason(squatter, holds=False) == ""  # nobody waits for its round
        assert reason(talker) == reason(earned) == ""
        await trio.sleep_until(120 - 1e-6)
        assert reason(talker) == ""
        await trio.sleep_until(120)
        assert reason(talker).startswith("no result taken 120 s after its first roundStart")
        assert reason(earned) == ""

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_progress_that_never_becomes_a_result_keeps_a_slot_only_while_it_keeps_its_promise():
    """A peer sent round 1 at 0 s reports "step 1 of 10" at 3 s (30 s a round) and never
    answers. It kept its slot from a newcomer --ready-timeout (600 s) from its roundStart;
    now while its progress keeps its promise (PROMISE_SLACK x 30 s: 60 s), or the grace if
    longer. Reports that push the promise out buy at most --ready-timeout; once a round
    closes without its result it keeps its slot only the grace from its first roundStart,
    as a peer that showed nothing, until that result comes."""

    async def main() -> None:
        liar, silent = _links(2)
        for link in (liar, silent):
            _ready(link)
            _sent(link, 1)
        await trio.sleep_until(3)
        liar.rounds.progressed(protocol.Progress(1, 1, 10, 1.0, 1.0, protocol.Phase.TRAINING))
        assert slots.next_to_free([liar], RULES) == 60
        assert slots.next_to_free([silent], RULES) == 45
        await trio.sleep_until(44)  # "step 1 of 10" again: 440 s a round, capped
        liar.rounds.progressed(protocol.Progress(1, 1, 10, 1.0, 1.0, protocol.Phase.TRAINING))
        assert slots.next_to_free([liar], RULES) == 600
        liar.rounds.missed = True  # round 1 closed without it (`sitting_out.sit_out`)
        assert slots.next_to_free([liar], RULES) == 45
        assert slots.slot_to_take([liar], trio.current_time(), RULES) is None
        await trio.sleep_until(45)
        assert slots.slot_to_take([liar], trio.current_time(), RULES) is liar

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_late_result_does_not_stretch_how_long_silent_squatters_keep_their_slots():
    """A hostile peer is sent round 1 with three silent squatters, reports progress (its
    slot: --ready-timeout from its roundStart, now its promise's 60 s) and sends a result, long
    after the round closed: dropped as late, but its time was measured. It made the silent
    squatters keep their slots --straggler-factor x 590 s (2360 s) instead of the grace;
    only a result taken into a round measures the run's pace now."""

    async def main() -> None:
        stretcher, *silent = _links(4)
        for link in (stretcher, *silent):
            _ready(link)
            _sent(link, 1)
        await trio.sleep_until(3)
        stretcher.rounds.progressed(protocol.Progress(1, 1, 10, 1.0, 1.0, protocol.Phase.TRAINING))
        await trio.sleep_until(590)
        stretcher.rounds.answered(1, 0)  # what the pool does for every result, late ones too
        links = [stretcher, *silent]
        assert RULES.silent_seconds(links) == slots.EVICTABLE_AFTER
        assert slots.slot_to_take(links, trio.current_time(), RULES) is silent[0]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def squatter(port: int, worker_id: str, seen: dict) -> None:
    """Join, read the plan, heartbeat and never say ready; when put out or refused, join again."""
    while True:
        try:
            await _squat(port, worker_id, seen)
        except (*PEER_ERRORS, OSError):  # e.g. the run ended and the shepherd stopped listening
            pass
        await trio.sleep(0.1)


async def _squat(port: int, worker_id: str, seen: dict) -> None:
    stream, nonce = await connect_peer(port)
    async with stream.stream:
        await stream.send(peer_hello(worker_id, nonce))
        answer = await stream.receive()
        if answer.kind != "welcome":
            seen.setdefault("refused", []).append(answer.body.message)
            return
        assert (await stream.receive()).kind == "plan"
        seen.setdefault("welcomed", []).append(worker_id)
        async with trio.open_nursery() as alive:
            alive.start_soon(_heartbeats, stream)
            try:
                while (message := await stream.receive()).kind != "error":
                    pass
                seen.setdefault("put out", []).append(message.body)
            except PEER_ERRORS:  # closed without a word (the run ended)
                pass
            alive.cancel_scope.cancel()


async def _heartbeats(stream: protocol.MessageStream) -> None:
    try:
        while True:
            await stream.send(protocol.Heartbeat(time.time()))
            await trio.sleep(0.2)
    except PEER_ERRORS:
        return


def _two_honest_beside_four(squat, spawn_worker, squatters: int = 4) -> tuple[Shepherd, dict]:
    """A `--workers 2` run (--ready-timeout 40) whose 4 slots `squat` peers take first (or
    `squatters` of them); then two honest worker processes start. The shepherd after the
    run, and what the peers saw."""
    config = small_config(workers=2, rounds=2, inner_steps=2, chunk_steps=2, ready_timeout=28)
    shepherd = Shepherd(config, build_workload(config, shards=2))
    seen: dict = {}

    async def scenario(port):
        async with trio.open_nursery() as peers:
            for index in range(squatters):
                peers.start_soon(squat, port, f"squatter-{index}", seen)
            await until(lambda: len(seen.get("welcomed", ())) >= squatters)
            started = time.monotonic()
            seen["honest"] = [spawn_worker(port, "--id", f"honest-{i}") for i in range(2)]
            await until(lambda: shepherd.state.status == "done", polls=6000)  # a hang guard
            seen["seconds"] = time.monotonic() - started
            peers.cancel_scope.cancel()

    run_shepherd(shepherd, scenario)
    print(f"honest workers started to the run's end: {seen['seconds']:.1f} s")
    return shepherd, seen


@pytest.mark.e2e
def test_four_squatters_do_not_keep_two_honest_workers_out(spawn_worker):
    """--workers 2, so 4 connection slots, all taken by squatters before the honest workers
    start. With --ready-timeout 40 a squatter keeps its slot from a newcomer for 10 s: the
    honest workers get in, train the run's rounds and exit 0; the squatters are told their
    slot went to a new worker. (Before, the honest workers heard `busy` until they gave up.)"""
    shepherd, seen = _two_honest_beside_four(squatter, spawn_worker)
    assert [sorted(r.worker_ids) for r in shepherd.state.history] == [["honest-0", "honest-1"]] * 2
    put_out = [error.message for error in seen["put out"]]
    assert len(put_out) >= 2, put_out  # each honest worker took a squatter's slot
    assert {error.code for error in seen["put out"]} == {protocol.ErrorCode.BUSY}
    assert all("its slot went to a new worker" in message for message in put_out), put_out
    assert [process.wait(timeout=60) for process in seen["honest"]] == [0, 0]


async def ready_squatter(port: int, worker_id: str, seen: dict) -> None:
    """Join, say ready at once (nothing compiled), heartbeat, read every roundStart and never
    answer one; when put out or refused, join again."""
    while True:
        try:
            stream = await ready_peer(port, worker_id)
            async with stream.stream, trio.open_nursery() as alive:
                seen.setdefault("welcomed", []).append(worker_id)
                alive.start_soon(_heartbeats, stream)
                try:
                    while (message := await stream.receive()).kind != "error":
                        pass
                    seen.setdefault("put out", []).append(message.body)
                except PEER_ERRORS:
                    pass
                alive.cancel_scope.cancel()
        except (*PEER_ERRORS, OSError, AssertionError):  # refused busy before a plan
            pass
        await trio.sleep(0.1)


@pytest.mark.e2e
def test_four_squatters_that_say_ready_do_not_keep_two_honest_workers_out(spawn_worker):
    """As above, but the squatters say ready at once and then never answer a round: ready
    workers were never moved, so they held every slot and round 1 waited for them for ever;
    then each kept its slot --ready-timeout (40 s) from its first roundStart, and the run
    ended 161 s after the honest workers started. Now one that shows nothing gives its slot
    up after the grace (10 s): each round is held at most that (the time is printed, about
    40 s here, not asserted). The honest workers train both rounds, alone."""
    shepherd, seen = _two_honest_beside_four(ready_squatter, spawn_worker)
    contributors = [(r.round, sorted(r.worker_ids)) for r in shepherd.state.history]
    assert contributors == [(1, ["honest-0", "honest-1"]), (2, ["honest-0", "honest-1"])]
    codes = [process.wait(timeout=60) for process in seen["honest"]]
    assert codes == [0, 0], [process.stdout.read()[-4000:] for process in seen["honest"]]


@pytest.mark.e2e
def test_two_ids_that_say_ready_do_not_hold_round_one_for_ever(spawn_worker):
    """One token holder joins a `--workers 2` run as two ids that say ready at once and never
    answer: they were round 1's only workers, and the honest workers, admitted to free slots
    (nobody in line), waited for round 1 for ever. Now round 1 goes on without each once it
    has shown nothing for the grace (10 s at --ready-timeout 40) while the honest workers
    wait for that round (it sits rounds out), and the honest workers train both rounds,
    alone."""
    shepherd, seen = _two_honest_beside_four(ready_squatter, spawn_worker, squatters=2)
    history = shepherd.state.history
    assert [r.round for r in history] == [1, 2]
    # a compile past the grace (13.5 s under load) misses the repeat of round 1, not round 2
    assert all(r.worker_ids and set(r.worker_ids) <= {"honest-0", "honest-1"} for r in history)
    assert {w for r in history for w in r.worker_ids} == {"honest-0", "honest-1"}
    held = [e for e in shepherd.state.events if e.kind == "stragglers" and "goes on" in e.message]
    assert {w for e in held for w in e.workers} >= {"squatter-0", "squatter-1"}, held
    codes = [process.wait(timeout=60) for process in seen["honest"]]
    assert codes == [0, 0], [process.stdout.read()[-4000:] for process in seen["honest"]]


async def progress_squatter(port: int, worker_id: str, seen: dict) -> None:
    """As `ready_squatter`, but 1 s after each roundStart it reports "step 1 of H" (a round
    it projects at H s) and then never answers."""
    while True:
        try:
            stream = await ready_peer(port, worker_id)
            async with stream.stream, trio.open_nursery() as alive:
                seen.setdefault("welcomed", []).append(worker_id)
                alive.start_soon(_heartbeats, stream)
                try:
                    while (message := await stream.receive()).kind != "error":
                        if message.kind == "roundStart":
                            await trio.sleep(1)
                            start = message.body
                            phase = protocol.Phase.TRAINING
                            await stream.send(
                                protocol.Progress(
                                    start.round, 1, start.inner_steps, 5.0, 1.0, phase
                                )
                            )
                    seen.setdefault("put out", []).append(message.body)
                except PEER_ERRORS:
                    pass
                alive.cancel_scope.cancel()
        except (*PEER_ERRORS, OSError, AssertionError):  # refused busy before a plan
            pass
        await trio.sleep(0.1)


@pytest.mark.e2e
def test_two_ids_that_report_progress_and_never_answer_do_not_hold_round_one_for_ever(
    spawn_worker,
):
    """The same two ids, each reporting "step 1 of 2" 1 s into round 1 and never answering:
    progress exempted them from the rule above, so round 1 (only theirs; no window closes a
    round before its first result) waited for them for ever while the honest workers waited
    for it. Now progress vouches for a connection only while it keeps its promise (2 x 2 s
    here, less than the grace: 10 s), and the honest workers train both rounds, alone."""
    shepherd, seen = _two_honest_beside_four(progress_squatter, spawn_worker, squatters=2)
    history = shepherd.state.history
    assert [r.round for r in history] == [1, 2]
    assert {w for r in history for w in r.worker_ids} == {"honest-0", "honest-1"}
    held = [e for e in shepherd.state.events if e.kind == "stragglers" and "goes on" in e.message]
    assert {w for e in held for w in e.workers} >= {"squatter-0", "squatter-1"}, held
    assert all("no result taken" in e.message for e in held), held
    codes = [process.wait(timeout=60) for process in seen["honest"]]
    assert codes == [0, 0], [process.stdout.read()[-4000:] for process in seen["honest"]]


async def churner(port: int, shepherd: Shepherd, seen: dict) -> None:
    """A token holder that keeps a ready id waiting for the round that runs: once a round has
    gone out, it joins under a fresh id and says ready at once; a roundStart sent to it, or
    the shepherd putting it out, and it leaves and does it again."""
    for index in range(1000):
        await until(lambda: shepherd.state.status == "training")
        try:
            stream = await ready_peer(port, f"churn-{index}")
            async with stream.stream, trio.open_nursery() as alive:
                alive.start_soon(_heartbeats, stream)
                try:
                    while (await stream.receive()).kind not in ("roundStart", "error"):
                        pass
                except PEER_ERRORS:
                    pass
                alive.cancel_scope.cancel()
        except (*PEER_ERRORS, OSError, AssertionError):  # refused busy before a plan
            pass
        seen["churned"] = index + 1
        await trio.sleep(0.1)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "rounds",
    [
        dict(inner_steps=2, chunk_steps=2),
        # fragment 0's result covers steps 0-1: one of step 0 alone is zero (the warm-up's
        # learning rate starts at 0), and validation refuses it
        dict(inner_steps=4, chunk_steps=2, streaming_fragments=2, overlap_steps=0),
    ],
    ids=["plain", "streaming"],
)
def test_a_churning_newcomer_does_not_starve_honest_workers_whose_first_chunk_is_slow(
    spawn_worker, rounds
):
    """Two honest workers whose one chunk takes 13 s (a slow machine: progress comes only
    after a chunk) hold round 1 past the grace (10 s at --ready-timeout 40) with nothing
    shown. A token holder that joins under a fresh id while a round runs and says ready at
    once made them lose their connection for holding a round (`slots.holding_reason`); they
    joined again, silent again on their new connection, and lost it again: round 1 never
    ended (none in 180 s). Now they sit the round out until their late result shows their
    work, keep their connections, and train the repeated round 1.

    Streaming (two fragments, a chunk each): they train the round on, with its fragment
    updates, and are back with their last fragment's late result. Back with their first
    fragment's, they were sent the repeat of round 1 while still training the old one, and
    the old one's second fragment result was taken as the repeat's: refused, or waiting
    there for the repeat's first fragment while the shepherd read nothing more from them
    (lost, silent)."""
    # --ready-timeout bounds the compile too: 25 s here with the two variants side by side
    config = small_config(workers=2, rounds=1, ready_timeout=40, **rounds)
    shepherd = Shepherd(config, build_workload(config, shards=2))
    seen: dict = {}

    async def scenario(port):
        honest = [
            faulty_worker_command(port, "pace", "--id", f"honest-{i}", seconds=13.0)
            for i in range(2)
        ]
        seen["honest"] = [spawn_worker.__self__.start(c) for c in honest]
        async with trio.open_nursery() as peers:
            peers.start_soon(churner, port, shepherd, seen)
            try:
                await until(lambda: shepherd.state.status == "done", polls=3600)
            finally:
                held = [
                    e.worker
                    for e in shepherd.state.events
                    if e.kind == "lost" and "round waits" in e.message
                ]
                print(f"churned {seen.get('churned')}, lost for holding a round: {held}")
            peers.cancel_scope.cancel()

    run_shepherd(shepherd, scenario)
    taken_out = [
        e.message
        for e in shepherd.state.events
        if e.kind == "stragglers" and "goes on without honest" in e.message
    ]
    assert taken_out, "no honest worker was taken out of round 1: the case this test is for"
    (round_1,) = shepherd.state.history  # it ended, with an honest result or two
    assert set(round_1.worker_ids) <= {"honest-0", "honest-1"} and round_1.worker_ids
    lost = [e.worker for e in shepherd.state.events if e.kind == "lost"]
    assert not [w for w in lost if w.startswith("honest")], lost
