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
from pcp_tui.shepherd.run.state import RunState, WorkerView
from pcp_tui.shepherd.serving import slots
from pcp_tui.shepherd.serving.connection import WorkerLink
from pcp_tui.testing import run_shepherd, small_config, until
from pcp_tui.testing._peers import connect_peer, peer_hello, ready_peer
from pcp_tui.training.build import build_workload

PEER_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, protocol.ProtocolError)


def test_a_newcomer_takes_the_slot_of_the_connection_longest_not_ready_after_its_grace():
    """Links welcomed at 0, 10 and 20 s; the one of 0 s says ready at 5 s. The grace is 45 s
    (--ready-timeout 600). Just before 55 s no link has waited 45 s; at 55 s the one of 10 s
    has, and it goes (the ready one does not); a closed one is not counted; the next frees
    at 65 s. --ready-timeout drops a link not ready 600 s after its welcome, never a ready one;
    a ready link sent a round whose worker has no result counted gives its slot up to a
    newcomer 600 s after its first roundStart; one not yet sent a round, or whose worker
    has contributed, never."""

    async def main() -> None:
        state = RunState(run_id="r", rounds_total=1, settings={})
        links = []
        for index in range(3):
            near, _far = trio.testing.memory_stream_pair()
            view = WorkerView(worker_id=f"w{index}", index=index, host="here")
            links.append(
                WorkerLink(protocol.MessageStream(near), view, state, protocol.Platform.CPU)
            )
            await trio.sleep(5)
            if index == 0:
                links[0].ready.set()
            await trio.sleep(5)
        grace = slots.evictable_after(600)
        assert grace == slots.EVICTABLE_AFTER == 45 and slots.evictable_after(40) == 10
        assert slots.next_to_free(links, 600) == 55
        await trio.sleep_until(55 - 1e-6)
        assert slots.slot_to_take(links, trio.current_time(), 600) is None
        await trio.sleep_until(55)
        assert slots.slot_to_take(links, trio.current_time(), 600) is links[1]
        links[1].closed = True
        assert slots.slot_to_take(links, trio.current_time(), 600) is None
        assert slots.next_to_free(links, 600) == 65
        await trio.sleep_until(620)  # links[2] was welcomed at 20 s
        assert slots.not_ready_reason(links[2], 600, trio.current_time()) == ""
        await trio.sleep_until(621)
        reason = slots.not_ready_reason(links[2], 600, trio.current_time())
        assert reason.startswith("not ready 601 s after its welcome (--ready-timeout 600 s)")
        assert slots.not_ready_reason(links[0], 600, trio.current_time()) == ""
        links[2].ready.set()
        assert slots.next_to_free(links, 600) is None  # ready and not yet sent a round
        links[0].rounds.first_delivered = 30.0  # its first roundStart: 30 s; no result since
        links[2].rounds.first_delivered = 40.0
        assert slots.next_to_free(links, 600) == 630
        assert slots.slot_to_take(links, trio.current_time(), 600) is None
        await trio.sleep_until(630)
        assert slots.slot_to_take(links, trio.current_time(), 600) is links[0]
        links[0].view.rounds_contributed = 1
        assert slots.next_to_free(links, 600) == 640
        links[2].view.rounds_contributed = 1
        assert slots.next_to_free(links, 600) is None  # every open link's worker contributed

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


@pytest.mark.e2e
def test_four_squatters_do_not_keep_two_honest_workers_out(spawn_worker):
    """--workers 2, so 4 connection slots, all taken by squatters before the honest workers
    start. With --ready-timeout 40 a squatter keeps its slot from a newcomer for 10 s: the
    honest workers get in, train the run's rounds and exit 0; the squatters are told their
    slot went to a new worker. (Before, the honest workers heard `busy` until they gave up.)"""
    config = small_config(workers=2, rounds=2, inner_steps=2, chunk_steps=2, ready_timeout=40)
    shepherd = Shepherd(config, build_workload(config, shards=2))
    seen: dict = {}

    async def scenario(port):
        async with trio.open_nursery() as peers:
            for index in range(4):
                peers.start_soon(squatter, port, f"squatter-{index}", seen)
            await until(lambda: len(seen.get("welcomed", ())) == 4)
            started = time.monotonic()
            seen["honest"] = [spawn_worker(port, "--id", f"honest-{i}") for i in range(2)]
            await until(lambda: shepherd.state.status == "done", polls=2400)  # a hang guard
            seen["seconds"] = time.monotonic() - started
            peers.cancel_scope.cancel()

    run_shepherd(shepherd, scenario)
    print(f"honest workers started to the run's end: {seen['seconds']:.1f} s")
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
    workers were never moved, so they held every slot and round 1 waited for them for ever."""
    config = small_config(workers=2, rounds=2, inner_steps=2, chunk_steps=2, ready_timeout=40)
    shepherd = Shepherd(config, build_workload(config, shards=2))
    seen: dict = {}

    async def scenario(port):
        async with trio.open_nursery() as peers:
            for index in range(4):
                peers.start_soon(ready_squatter, port, f"squatter-{index}", seen)
            await until(lambda: len(seen.get("welcomed", ())) >= 4)
            started = time.monotonic()
            seen["honest"] = [spawn_worker(port, "--id", f"honest-{i}") for i in range(2)]
            await until(lambda: shepherd.state.status == "done", polls=6000)  # a hang guard
            seen["seconds"] = time.monotonic() - started
            peers.cancel_scope.cancel()

    run_shepherd(shepherd, scenario)
    print(f"honest workers started to the run's end: {seen['seconds']:.1f} s")
    contributors = [sorted(r.worker_ids) for r in shepherd.state.history]
    assert contributors[-2:] == [["honest-0", "honest-1"]] * 2, contributors
    assert [process.wait(timeout=60) for process in seen["honest"]] == [0, 0]
