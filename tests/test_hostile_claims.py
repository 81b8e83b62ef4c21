"""Third red-team pass: what a worker's messages claim, and how many it sends.

1. Results under --adaptive-steps are weighted by the tokens a worker reports,
and its pace is set by the steps and compute seconds it reports. A peer that
claimed a thousand times the steps it was asked (in no time) was taken as the
fastest worker: the honest one was given the fewest steps from then on. One that
claimed four steps' tokens for one step counted four times; one that claimed a
million compute seconds was taken as it said. Each now ends its connection
(`shepherd/rounds/claims.py`), and the honest worker trains H every round.

2. A peer that sends valid progress messages without pause made the shepherd
update its row and the loss chart's history for every one. Beyond a few a
second they are now dropped, and a flood ends the connection
(`shepherd/serving/progress_rate.py`).

3. A streaming round's roundStart whose last byte went out, its task not yet
resumed when a fragment closed, counted as undelivered: the worker was left
out of the fragment's update with its link open, and waited for it for ever
(`engine.RoundStarts.settle`).

4. The operator API took every TCP connection offered, each held until its read
timeout. At most `api_connections.MAX_CONNECTIONS` are open now; one more is
answered 503 at once.

One shepherd in this process, one real worker process, peers in this process
that speak the real protocol over 127.0.0.1; real sockets and httpx for 3 and 4.
"""

from __future__ import annotations

import copy
import time

import httpx
import numpy as np
import pytest
import trio

from pcp_tui import protocol
from pcp_tui.app import api_connections
from pcp_tui.app.api import OperatorAPI
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.shepherd.rounds.claims import ResultClaims
from pcp_tui.shepherd.rounds.engine import RoundStarts
from pcp_tui.shepherd.run.state import RunState, WorkerView
from pcp_tui.shepherd.serving import progress_rate
from pcp_tui.shepherd.serving.connection import WorkerLink
from pcp_tui.testing import (
    PEER_ERRORS,
    ready_peer,
    round_start,
    run_shepherd,
    until,
)
from pcp_tui.training.build import build_workload

from .conftest import small_config

H, CHUNK = 4, 2
PER_STEP = 4 * 32  # batch rows x tokens a row: small_config's batch 4, sequence 32

LIARS = {  # worker id -> what its round-1 result claims (the honest claim: H, H * PER_STEP, ~s)
    "greedy": dict(inner_steps=1000 * H, tokens=H * PER_STEP, compute_seconds=1e-3),
    "heavy": dict(inner_steps=1, tokens=H * PER_STEP, compute_seconds=0.1),
    "timeless": dict(inner_steps=H, tokens=H * PER_STEP, compute_seconds=1e6),
}


async def lying_peer(port: int, worker_id: str, seen: dict) -> None:
    """Answer round 1 with a well-formed result (zeros) whose claims are `LIARS[worker_id]`."""
    stream = await ready_peer(port, worker_id)
    async with stream.stream:
        start = await round_start(stream)
        seen[f"{worker_id} asked"] = start.body.inner_steps
        zeros = {name: np.zeros_like(value) for name, value in start.tensors.items()}
        claims = LIARS[worker_id]
        result = protocol.RoundResult(
            round=1, losses=(3.0,) * min(claims["inner_steps"], H), **claims
        )
        await stream.send(result, zeros)
        try:
            while (answer := await stream.receive()).kind != "error":
                pass
            seen[worker_id] = answer.body
        except PEER_ERRORS:
            seen[worker_id] = None


async def flooding_peer(port: int, seen: dict) -> None:
    """Take round 1's start, send BURST progress messages, let them be taken, then flood until
    cut off (the round goes on without it)."""
    stream = await ready_peer(port, "flooder")
    async with stream.stream:
        await round_start(stream)
        progress = protocol.Progress(1, 1, H, 7.0, 1.0, protocol.Phase.TRAINING)
        for _ in range(progress_rate.BURST):
            await stream.send(progress)
        await until(lambda: seen["shepherd"].state.workers["flooder"].loss == 7.0)
        seen["flood started"], seen["flood sent"] = time.monotonic(), 0
        try:
            while True:
                await stream.send(progress)
                seen["flood sent"] += 1
        except PEER_ERRORS:
            seen["flood ended"] = time.monotonic()


@pytest.mark.e2e
def test_claims_beyond_what_was_asked_and_a_progress_flood_end_their_connections(spawn_worker):
    config = small_config(
        workers=5, rounds=2, inner_steps=H, chunk_steps=CHUNK, adaptive_steps=True
    )
    shepherd = Shepherd(config, build_workload(config, shards=5))
    seen = {"shepherd": shepherd}

    async def scenario(port):
        seen["honest"] = spawn_worker(port, "--id", "honest")
        async with trio.open_nursery() as peers:
            for worker_id in LIARS:
                peers.start_soon(lying_peer, port, worker_id, seen)
            peers.start_soon(flooding_peer, port, seen)
            await until(lambda: shepherd.state.status == "done", polls=2400)  # a hang guard

    run_shepherd(shepherd, scenario)
    lost = {e.worker: e.message for e in shepherd.state.events if e.kind == "lost"}
    # 1. each lie ends its connection, the peer is told why; only the honest result counts
    assert "to 4000, but its roundStarts asked for 4" in lost["greedy"], lost
    assert "claims 512 tokens; the 1 inner steps it covers read 128" in lost["heavy"], lost
    assert "compute time on this connection to 1000000.0 s" in lost["timeless"], lost
    for worker_id in LIARS:
        assert seen[f"{worker_id} asked"] == H
        assert seen[worker_id].code == "badResult", seen[worker_id]
        assert "a worker reports what it was asked to train" in seen[worker_id].message
    history = shepherd.state.history
    assert [r.worker_ids for r in history] == [("honest",), ("honest",)]
    assert [r.tokens for r in history] == [H * PER_STEP] * 2  # paced by its own speed: H
    assert set(shepherd.engine.pacing.speeds) == {"honest"}
    # 2. progress beyond the rate is dropped, a flood ends the connection
    assert "progress messages far faster than 20 a second" in lost["flooder"], lost
    flooder = shepherd.state.workers["flooder"].index
    taken = sum(1 for *_, index in shepherd.state.step_losses if index == flooder)
    seconds = seen["flood ended"] - seen["flood started"]
    # the first burst, the bucket refilled while the test waited, then the rate
    most = 2 * progress_rate.BURST + progress_rate.RATE * seconds + 1
    assert progress_rate.BURST <= taken <= most, (taken, seconds)
    assert seen["flood sent"] > progress_rate.FLOOD_BURST  # dropped, then cut off
    assert shepherd.state.status == "done"
    assert seen["honest"].wait(timeout=60) == 0


def test_result_claims_are_bounded_by_the_steps_asked_and_the_wall_time():
    """The ledger's arithmetic, fragment results included, on a clock the test moves."""
    now = [100.0]
    claims = ResultClaims(tokens_per_step=10, clock=lambda: now[0], fragments=2)
    fragment = protocol.RoundResult
    claims.check(fragment(round=1, fragment=0, tokens=10**9, inner_steps=9))  # nothing asked
    claims.ask(4)
    now[0] += 2.0
    claims.check(fragment(round=1, fragment=0, tokens=20, inner_steps=2, compute_seconds=1.0))
    # fragment 1 covers every step since the connection began: 4, so 40 tokens
    claims.check(fragment(round=1, fragment=1, tokens=40, inner_steps=2, compute_seconds=1.0))
    claims.ask(4)
    claims.check(fragment(round=2, fragment=0, tokens=40, inner_steps=2, compute_seconds=0.0))
    with pytest.raises(Exception, match="claims 50 tokens; the 4 inner steps it covers read 40"):
        copy.deepcopy(claims).check(fragment(round=2, fragment=1, tokens=50, inner_steps=2))
    with pytest.raises(Exception, match="to 10, but its roundStarts asked for 8"):
        copy.deepcopy(claims).check(fragment(round=2, fragment=1, tokens=10, inner_steps=4))
    with pytest.raises(Exception, match="claims -1 compute seconds"):
        copy.deepcopy(claims).check(fragment(round=2, fragment=1, compute_seconds=-1.0))
    with pytest.raises(Exception, match="compute time on this connection to 4.0 s"):  # 2 s wall
        copy.deepcopy(claims).check(fragment(round=2, fragment=1, compute_seconds=2.0))


async def socket_links(count: int) -> tuple[list[WorkerLink], list[protocol.MessageStream]]:
    """`count` WorkerLinks over real TCP connections on 127.0.0.1, and the peers' ends."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    state = RunState(run_id="r", rounds_total=1, settings={})
    links, peers = [], []
    for index in range(count):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        server = await listener.accept()
        view = WorkerView(worker_id=f"w{index}", index=index, host="here")
        links.append(WorkerLink(protocol.MessageStream(server), view, state, protocol.Platform.CPU))
        peers.append(protocol.MessageStream(client))
    await listener.aclose()
    return links, peers


async def test_a_fragment_closing_as_roundstarts_finish_cuts_off_exactly_the_unsent_ones():
    """Fragments close while roundStarts go out, in every order the scheduler picks: a link
    whose roundStart went out whole keeps its connection and gets the fragment's update; one
    left out of the update has none of it (cut off mid-frame and closed, or never sent).
    Before, one whose last byte had gone out (its task not yet resumed) was left out of the
    update with its connection open: that worker waited for ever."""
    body = protocol.RoundStart(round=1, inner_steps=H)
    tensors = {"w": np.ones(64, np.float32)}

    async def one_round(seed: int) -> tuple[int, int]:
        links, peers = await socket_links(8)
        starts = RoundStarts(links, body.round)
        cut = set()

        async def close_fragment():
            for _ in range(seed % 3):  # a fragment closes at a varying point of the sends
                await trio.lowlevel.checkpoint()
            cut.update(await starts.settle([]))

        async with trio.open_nursery() as nursery:
            for link in links:
                nursery.start_soon(starts.send, link, body, tensors)
            nursery.start_soon(close_fragment)
        for link, peer in zip(links, peers, strict=True):
            still_open = not link.closed
            await link.stream.stream.aclose()
            if link in cut:  # left out of the fragment's update: it must not hold its roundStart
                with pytest.raises(PEER_ERRORS):  # the shepherd closed it mid-frame, or sent none
                    await peer.receive()
            else:
                assert still_open
                assert (await peer.receive()).body == body  # the whole roundStart arrived
            await peer.stream.aclose()
        return len(cut), len(links) - len(cut)

    outcomes = [await one_round(seed) for seed in range(30)]
    print("(cut off, delivered) per round:", outcomes)


async def test_a_claimed_speed_is_bounded_by_the_shepherds_clock(autojump_clock):
    """--adaptive-steps sized rounds by the compute seconds a result claims: a worker claiming
    1% of its real time was 100x the fastest, and the honest worker trained one chunk a round.
    Its time is now the longer of the claim and its roundStart's delivery to its result's
    arrival on the shepherd's clock: both workers took 2 s, so both train H."""
    from pcp_tui.shepherd.rounds.pacing import StepPacing

    (honest, liar), peers = await socket_links(2)
    pacing = StepPacing(inner_steps=8, quantum=2)
    for link in (honest, liar):
        await link.send(protocol.RoundStart(round=1, inner_steps=8))
    await trio.sleep(2.0)  # both train for 2 s (the mock clock jumps there)
    for link, claimed in ((honest, 2.0), (liar, 0.02)):
        link.rounds.answered(1, 0)
        pacing.measure(link.worker_id, 8, claimed, link)
    assert pacing.steps_for(["w0", "w1"], {"w0": honest, "w1": liar}) == {"w0": 8, "w1": 8}
    # by the claims alone (no connection measured): the liar 100x as fast, the honest 1 chunk
    by_claims = StepPacing(inner_steps=8, quantum=2)
    by_claims.measure("w0", 8, 2.0)
    by_claims.measure("w1", 8, 0.02)
    assert by_claims.steps_for(["w0", "w1"]) == {"w0": 2, "w1": 8}
    for peer in peers:
        await peer.stream.aclose()


async def test_a_progress_projection_is_a_promise_it_must_keep(autojump_clock):
    """A peer that reported "step 1 of H" early and then nothing had H x that time as its own,
    for as long as it liked (round 1 held for factor² windows). Its projection counts until
    PROMISE_SLACK times itself has passed since its roundStart's delivery."""
    from pcp_tui.shepherd.rounds.record import PROMISE_SLACK

    (link,), (peer,) = await socket_links(1)
    await link.send(protocol.RoundStart(round=1, inner_steps=8))
    await trio.sleep(1.0)
    link.rounds.progressed(protocol.Progress(1, 1, 8, 3.0, 1.0, protocol.Phase.TRAINING))
    assert link.rounds.projected_seconds(1) == 8.0
    await trio.sleep(PROMISE_SLACK * 8.0 - 1.0 - 0.5)
    assert link.rounds.projected_seconds(1) == 8.0  # a slow worker within its word
    await trio.sleep(1.0)
    assert link.rounds.projected_seconds(1) == 0.0  # past it: the promise is broken
    await peer.stream.aclose()


async def test_the_operator_api_answers_503_beyond_its_connection_cap():
    """MAX_CONNECTIONS idle TCP connections hold every slot of the operator API: a real HTTP
    client is answered 503 at once (Retry-After), not queued; once they close, it is served.
    Before, every connection was taken and held until its 10 s read timeout."""
    state = RunState(run_id="r", rounds_total=1, settings={})
    api = OperatorAPI(state, lambda reason: None, token="t")
    api.bind()
    url = f"http://{api.address}/healthz"
    host, port = api.address.rsplit(":", 1)

    def get() -> httpx.Response:
        return httpx.get(url, timeout=30)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(api.serve)
        assert (await trio.to_thread.run_sync(get)).status_code == 200
        await until(lambda: api.server.open == 0)  # that client has closed its connection
        idle = [await trio.open_tcp_stream(host, int(port)) for _ in range(64)]
        await until(lambda: api.server.open == api_connections.MAX_CONNECTIONS)
        busy = await trio.to_thread.run_sync(get)
        assert (busy.status_code, busy.headers["retry-after"]) == (503, "1"), busy
        assert "too many open connections" in busy.json()["error"]
        for stream in idle:
            await stream.aclose()
        await until(lambda: api.server.open == 0)
        assert (await trio.to_thread.run_sync(get)).status_code == 200
        assert api.server.turned_away == 1
        api.close()
