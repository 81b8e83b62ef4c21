"""Streaming DiLoCo with elastic membership: a peer that lies about what it trained on.

A live shepherd in this process, a real worker (`Worker`, in this process too), and a peer
that speaks the real protocol over 127.0.0.1 (handshake with the token's proof, then
`MessageStream`).
"""

from __future__ import annotations

import numpy as np
import trio

from pcp_tui import protocol
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.testing import join_as, local_worker, pause_after_round, run_shepherd, until
from pcp_tui.training.build import build_workload

from .conftest import small_config

H, FRAGMENTS, TOKENS_PER_STEP = 8, 2, 4 * 32  # inner steps; batch 4 x sequence 32


def _result(plan, params, round_number: int, fragment: int) -> tuple:
    """A well-formed roundResult of zeros covering H / F steps: only its claims lie."""
    names = plan.fragments[fragment].tensors
    steps = H // FRAGMENTS
    body = protocol.RoundResult(
        round=round_number,
        fragment=fragment,
        tokens=steps * TOKENS_PER_STEP,
        losses=(3.0,) * steps,
        compute_seconds=0.01,
        inner_steps=steps,
    )
    return body, {n: np.zeros_like(params[n]) for n in names}


def test_a_peer_that_joins_mid_round_cannot_slip_in_results_of_rounds_it_was_not_sent():
    """It becomes ready during round 2 and at once sends a result for round 2's fragment 0
    (never given: its first roundStart is round 3's) and one for round 1 (before it joined):
    neither counts, and the connection ends at the first (no worker answers a round it was
    not sent), so the liar comes back as a new connection; as a participant of round 3 it
    sends fragment 1 before fragment 0: each is a well-formed result of the steps asked, so
    both count. The run ends with the honest worker."""
    config = small_config(
        workers=1,
        rounds=4,
        inner_steps=H,
        chunk_steps=2,
        streaming_fragments=FRAGMENTS,
        overlap_steps=0,
        validate="off",  # its results are zeros: the claim is which rounds, not their weight
    )
    shepherd = Shepherd(config, build_workload(config, shards=2))
    seen = {}

    async def liar(port):
        stream, welcome = await join_as(port, "liar")
        assert welcome.kind == "welcome"
        plan = (await stream.receive()).body
        await stream.send(protocol.Ready(compile_seconds=0.0))  # mid-round 2
        try:
            for round_number, fragment in ((2, 0), (1, 1)):
                body, tensors = _result(plan, shepherd.params, round_number, fragment)
                await stream.send(body, tensors)
                seen["sent"] = round_number
        except trio.BrokenResourceError:  # the shepherd hung up after the first
            pass
        seen["first answer"] = await _until_error_or_closed(stream)
        return plan

    async def participant(port, plan):
        stream, welcome = await join_as(port, "liar")  # while the run is held after round 2
        seen["back"] = welcome.kind
        await stream.receive()  # the plan
        await stream.send(protocol.Ready(compile_seconds=0.0))
        await until(lambda: shepherd.state.workers["liar"].state == "idle")  # ready
        shepherd.resume()
        start = await stream.receive()
        while start.kind != "roundStart":
            start = await stream.receive()
        seen["asked"] = start.body.round
        for fragment in (1, 0):  # out of the schedule's order
            body, tensors = _result(plan, shepherd.params, start.body.round, fragment)
            await stream.send(body, tensors)
        updates = 0
        while updates < FRAGMENTS:  # take both updates: a deaf peer is another attack
            updates += (await stream.receive()).kind == "fragmentUpdate"
        await stream.aclose()

    async def scenario(port):
        pause_after_round(shepherd, 2)
        async with trio.open_nursery() as nursery:  # the honest worker: real, in this process
            nursery.start_soon(local_worker(port, "honest").run)
            await until(lambda: shepherd.state.round == 2)
            plan = await liar(port)
            await until(
                lambda: shepherd.state.status == "paused" and len(shepherd.state.history) == 2
            )
            await participant(port, plan)

    run_shepherd(shepherd, scenario)
    events, history = shepherd.state.events, shepherd.state.history
    lost = [e.message for e in events if e.kind == "lost" and e.worker == "liar"]
    assert [r.round for r in history] == [1, 2, 3, 4]
    assert [r.worker_ids for r in history[:2]] == [("honest",)] * 2  # round 2 took none of it
    assert lost[0].endswith(
        "sent a result for round 2 fragment 0, but round 2's roundStart went to another "
        "connection or to none: a worker answers only the rounds it was sent"
    ), lost
    assert seen["first answer"] == "connection closed" and seen["back"] == "welcome"
    assert not [e for e in events if e.kind in ("late_result", "bad_result")]
    assert seen["asked"] == 3 and set(history[2].worker_ids) == {"honest", "liar"}
    assert history[2].fragment_results == (2, 2)  # either order is a worker's own business
    assert history[3].worker_ids == ("honest",)
    assert all(np.isfinite(p).all() for p in shepherd.params.values())


async def _until_error_or_closed(stream) -> str:
    """Read until the shepherd hangs up; what it said last ("connection closed" if nothing).

    A goodbye is an AssertionError: it tells a worker the run is over (it exits for good),
    which is not so when the shepherd ends one connection while the run goes on.
    """
    try:
        while True:
            message = await stream.receive()
            assert message.kind != "goodbye", message.body
            if message.kind == "error":
                return message.body.message
    except (protocol.ConnectionClosed, trio.BrokenResourceError):
        return "connection closed"
