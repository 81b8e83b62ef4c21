"""Second red-team pass: striped sessions (`--streams`) and a round's deadline, on one live run.

1. A round closes at its --round-timeout even while a roundStart is still on
its way. A peer that says ready and then stops reading holds its roundStart
in TCP flow control. The round used to send every roundStart first and only
then start its timeout, so the round lasted the send's own deadline
(--upload-grace + bytes / --min-upload-rate: a minute here) plus the timeout.
Now the timeout counts from the round's start; a roundStart still unsent then
is cut off, and since half a message cannot be taken back, its connection ends.
Streaming DiLoCo rounds the same, fragment by fragment (the second test).

2. Extra connections of a striped session (`--streams 2`) that are not the
session's own: a wrong session key, a proof replayed from another
connection's nonce, an index beyond K, another worker's session, one more
once the session is complete. Each is refused with a reason; the session and
the run go on.

3. A striped peer that closes its idle extra connection is dropped within two
heartbeat intervals. Nothing reads an idle connection, so before, it was noticed
only when the shepherd next sent a piece there (a roundStart): never, for a
peer that stays "compiling". The run goes on.

4. A peer that sends one result again and again (or one for a round not yet
started) is cut off at the first copy. Before, each copy was dropped as a
late result, with a line in the log and a metrics row, for as long as it sent.

5. A run stopped after its checkpoint directory was removed cannot be
resumed: it says so and ends its workers, rather than asking them to wait
half an hour for a --resume that has nothing to load.

One shepherd in this process, one real worker process (striped over 2
connections), peers in this process that speak the real protocol over 127.0.0.1.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import trio

from pcp_tui import protocol
from pcp_tui.contract import auth
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.testing import (
    connect_peer,
    heartbeat_until_hung_up,
    peer_hello,
    planned,
    run_shepherd,
    until,
)
from pcp_tui.training.build import build_workload

from .conftest import small_config

pytestmark = pytest.mark.e2e

TOKEN = "test-token"
REPEATS = 200  # copies of one result a peer sends


async def deaf_peer(port: int) -> None:
    """Join, read the plan, say ready, then heartbeat and never read again."""
    stream, nonce = await connect_peer(port, receive_buffer=4096)
    async with stream.stream:
        await stream.send(peer_hello("deaf", nonce))
        await planned(stream)
        await stream.send(protocol.Ready(compile_seconds=0.1))
        await heartbeat_until_hung_up(stream)  # alive to the watchdog, deaf to everything else


async def repeating_peer(port: int, seen: dict) -> None:
    """Join, say ready, answer round 1 with a well-formed result, then send it again and again
    (and one for a round that has not started): a flood of results no worker sends."""
    stream, nonce = await connect_peer(port)
    async with stream.stream:
        await stream.send(peer_hello("repeater", nonce))
        await planned(stream)
        await stream.send(protocol.Ready(compile_seconds=0.1))
        start = await stream.receive()
        while start.kind != "roundStart":
            start = await stream.receive()
        zeros = {name: np.zeros_like(value) for name, value in start.tensors.items()}
        result = protocol.RoundResult(
            round=start.body.round, tokens=256, losses=(3.0, 3.0), compute_seconds=0.1,
            inner_steps=2,
        )  # fmt: skip
        seen["repeats sent"] = 0
        try:
            for _ in range(REPEATS):
                await stream.send(result, zeros)
                seen["repeats sent"] += 1
            await stream.send(dataclasses.replace(result, round=99), zeros)
            while True:
                await stream.receive()
        except (trio.BrokenResourceError, trio.ClosedResourceError, protocol.ProtocolError):
            return  # the shepherd hung up on us


async def attach(port: int, worker_id: str, index: int, key: bytes, *, replay: bool = False):
    """An extra connection for `worker_id`'s session; the shepherd's error, or None (attached:
    the stream is returned instead). `replay`: the proof of another connection's nonce."""
    stream, nonce = await connect_peer(port)
    proof_nonce = b"\x01" * len(nonce) if replay else nonce
    await stream.send(
        peer_hello(
            worker_id,
            nonce,
            attach_index=index,
            attach_proof=auth.attach_proof(key, proof_nonce, worker_id, index),
        )
    )
    with trio.move_on_after(2):  # an attached connection hears nothing: the session owns it
        answer = await stream.receive()
        await trio.aclose_forcefully(stream.stream)
        return answer.body
    return stream


async def striping_peer(port: int, seen: dict) -> None:
    """Open a session that asks for 2 connections; let strangers try to attach to it; attach
    the real one; read the plan over both; close the extra connection; heartbeat."""
    stream, nonce = await connect_peer(port)
    await stream.send(peer_hello("striper", nonce))
    offer = (await stream.receive()).body
    key, wrong = offer.session_key, auth.new_session_key()
    seen["offer"] = offer.streams
    seen["refused"] = {
        "wrong key": await attach(port, "striper", 1, wrong),
        "replayed proof": await attach(port, "striper", 1, key, replay=True),
        "index beyond K": await attach(port, "striper", 2, key),
        "another session": await attach(port, "honest", 1, key),
    }
    extra = await attach(port, "striper", 1, key)
    assert isinstance(extra, protocol.MessageStream), extra
    seen["settled"] = (await stream.receive()).body.streams
    seen["refused"]["once complete"] = await attach(port, "striper", 1, key)
    stream.stripe([extra])
    assert (await stream.receive()).kind == "plan"  # over both connections
    await trio.aclose_forcefully(extra.stream)  # cut the idle extra connection
    try:  # "compiling": the shepherd sends it nothing, so no piece is ever due on the cut one
        while True:  # a few bytes each: they all travel on the first connection
            await stream.send(protocol.Heartbeat(time.time()))
            await trio.sleep(0.2)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return


def test_a_round_closes_at_its_timeout_and_strangers_cannot_join_a_striped_session(
    spawn_worker, tmp_path
):
    checkpoints = tmp_path / "checkpoints"
    config = small_config(
        validate="off",  # its peers answer with zeros: the claim is timing, not their weight
        workers=3,
        rounds=20,
        checkpoint_dir=str(checkpoints),
        checkpoint_every=1,
        inner_steps=2,
        streams=2,
        round_timeout=3.0,
        upload_grace=60.0,  # the deaf peer's roundStart may take a minute before this change
        min_upload_rate=1e7,
    )
    shepherd = Shepherd(config, build_workload(config, shards=4))
    seen = {}

    async def scenario(port):
        honest = spawn_worker(port, "--id", "honest", "--log-level", "info")
        async with trio.open_nursery() as peers:
            peers.start_soon(deaf_peer, port)
            peers.start_soon(striping_peer, port, seen)
            peers.start_soon(repeating_peer, port, seen)
            # >= : rounds of 2 steps can finish two between polls (== 3 was missed, and the
            # run went on to its 20th round and the hang guard)
            await until(lambda: len(shepherd.state.history) >= 3, polls=2400)  # a hang guard
            # removed by an operator's slip or a cleanup job (a rename: atomic, so no tree
            # removal races the writer's thread); a file in its place fails every later write
            checkpoints.rename(tmp_path / "moved away")
            checkpoints.write_text("not a directory any more")  # and no later one is written
            shepherd.request_stop("test over")
        seen["honest"] = honest

    run_shepherd(shepherd, scenario)
    events = shepherd.state.events
    lost = {e.worker: e.message for e in events if e.kind == "lost"}
    # 1. round 1 closed at its timeout, without the peer that never took its roundStart
    assert sorted([r.worker_ids for r in shepherd.state.history][0]) == ["honest", "repeater"]
    stragglers = [e for e in events if e.kind == "stragglers"]
    assert "deaf" in stragglers[0].workers, [e.message for e in events]
    assert "deaf" in lost and "--round-timeout" in lost["deaf"], lost
    assert "download too slow" not in lost["deaf"]
    [deaf_lost] = [e for e in events if e.kind == "lost" and e.worker == "deaf"]
    assert events.index(stragglers[0]) < events.index(deaf_lost)  # late first, then cut off
    assert shepherd.state.status == "stopped"
    output = seen["honest"].communicate(timeout=60)[0]
    assert seen["honest"].returncode == 0, output
    assert "session striped over 2 connections" in output, output
    # 2. strangers' extra connections are refused; the session was striped all the same
    assert seen["offer"] == 2 and seen["settled"] == 2
    refused = seen["refused"]
    assert {kind: body.code for kind, body in refused.items()} == dict.fromkeys(
        refused, "authFailed"
    )
    assert "wrong session proof" in refused["wrong key"].message
    assert "wrong session proof" in refused["replayed proof"].message
    assert "attach index 2 is not within 1..1" in refused["index beyond K"].message
    assert refused["another session"].message.startswith(  # as its window closed, or not
        ("no session of worker 'honest'", "wrong session proof")
    )
    assert "no session of worker 'striper'" in refused["once complete"].message
    # 3. the cut idle connection is noticed though nothing is sent on it
    assert lost["striper"].endswith(
        "one of the 2 striped connections failed: connection 2 of 2 was closed by the peer"
    ), lost
    # 4. one result counts once; sending it again (or one for a round not started) ends the
    # connection at the first copy, instead of a late_result line in the log for every copy
    contributions = [r.worker_ids.count("repeater") for r in shepherd.state.history]
    assert contributions == [1] + [0] * (len(contributions) - 1)
    assert not [e for e in events if e.kind == "late_result"]
    assert "sent its result for round 1 twice" in lost["repeater"], lost
    assert seen["repeats sent"] < REPEATS  # the shepherd stopped reading them
    # 5. stopped with its checkpoints gone: the workers are not asked to wait for a --resume
    assert not [e for e in events if e.kind == "resumable"]
    [why] = [e.message for e in events if e.kind == "not_resumable"]
    assert f"no checkpoint at {checkpoints}: no such directory" in why
    assert "told the run ended" in why
    assert "the run can be resumed" not in output  # the honest worker ended (code 0 above)


def test_a_streaming_round_cuts_off_a_roundstart_still_on_its_way_when_a_fragment_closes(
    spawn_worker,
):
    """The same deadline in Streaming DiLoCo: fragment results are collected while the
    roundStarts go out; one still on its way when a fragment closes is cut off (that worker
    would wait for the fragment's update, which only workers with their roundStart get)."""
    config = small_config(
        workers=2,
        rounds=2,
        inner_steps=4,
        streaming_fragments=2,
        overlap_steps=0,
        overlap_merge="mix",  # the deaf peer lists protocols 2 and 3; carry would need 5
        round_timeout=3.0,
        upload_grace=60.0,
        min_upload_rate=1e7,
    )
    shepherd = Shepherd(config, build_workload(config, shards=2))
    seen = {}

    async def scenario(port):
        seen["honest"] = spawn_worker(port, "--id", "honest")
        async with trio.open_nursery() as peers:
            peers.start_soon(deaf_peer, port)
            await until(lambda: len(shepherd.state.history) == 2, polls=2400)  # a hang guard

    run_shepherd(shepherd, scenario)
    events = shepherd.state.events
    lost = {e.worker: e.message for e in events if e.kind == "lost"}
    assert "--round-timeout" in lost["deaf"] and "roundStart" in lost["deaf"], lost
    stragglers = [e for e in events if e.kind == "stragglers"]
    [deaf_lost] = [e for e in events if e.kind == "lost" and e.worker == "deaf"]
    assert events.index(stragglers[0]) < events.index(deaf_lost)
    assert [r.worker_ids for r in shepherd.state.history] == [("honest",), ("honest",)]
    assert [r.fragment_results for r in shepherd.state.history] == [(1, 1), (1, 1)]
    assert shepherd.state.status == "done"
    assert seen["honest"].wait(timeout=60) == 0
