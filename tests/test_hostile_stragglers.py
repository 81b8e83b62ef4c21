"""Fifth red-team pass, end to end: the straggler window and the sit-out, attacked.

1. "A result already arriving is waited for" counted any message partly in: a peer that
trickles heartbeats one after another, each within the upload rule (--upload-grace, then
--min-upload-rate), was "uploading" for ever, and its round never closed. Only a result
(its header in, until it is folded in) holds the window now.

2. A worker sitting out (late for a round) while every other worker has gone: the run
waits, and its 'waiting' line said "waiting for one to join" with a worker connected. It
names the one sitting out now, and what to do; a restart of that worker (the same id)
trains from the next round.

One shepherd in this process, real `pcp-tui worker` processes, a peer in this process
that speaks the real protocol over 127.0.0.1.
"""

from __future__ import annotations

import signal
import subprocess

import numpy as np
import pytest
import trio

from pcp_tui import protocol
from pcp_tui.app.api_bodies import workers_json
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.testing import (
    PEER_ERRORS,
    faulty_worker_command,
    pause_after_round,
    ready_peer,
    round_start,
    run_shepherd,
    until,
)
from pcp_tui.training.build import build_workload

from .conftest import small_config, worker_env

PER_STEP = 4 * 32  # batch rows x tokens a row: small_config's batch 4, sequence 32

TRICKLE_SECONDS = 1.0  # each heartbeat's last byte waits this long (--upload-grace is 10 s)


async def trickling_peer(port: int, seen: dict) -> None:
    """Take round 1's start, then send heartbeats one after another, each held a second before
    its last byte, until told to stop; never a result."""
    stream = await ready_peer(port, "trickler")
    beat = b"".join(map(bytes, protocol.encode_once(protocol.Heartbeat(0.0)).buffers))
    async with stream.stream:
        await round_start(stream)
        seen["trickled"] = 0
        try:
            async with trio.open_nursery() as reading:
                # it takes what it is sent (round 1's update), as a worker does: one that
                # does not read is cut off for that ("download too slow"), not tested here
                reading.start_soon(_drain, stream)
                while "stop" not in seen:  # all but its last byte at once: always "arriving"
                    await stream.stream.send_all(beat[:-1])
                    await trio.sleep(TRICKLE_SECONDS)
                    await stream.stream.send_all(beat[-1:])
                    seen["trickled"] += 1
                reading.cancel_scope.cancel()
        except* PEER_ERRORS:
            seen["cut off"] = True


async def _drain(stream) -> None:
    while True:
        await stream.receive()


@pytest.mark.e2e
def test_trickled_heartbeats_do_not_hold_a_round_and_a_late_worker_is_named(spawn_worker):
    config = small_config(
        validate="off",  # its peers answer with zeros: the claim is timing, not their weight
        workers=2,
        rounds=3,
        inner_steps=4,
        straggler_factor=2.0,
        # round 1's window; the trickler, sitting out, is cut off as hung 2 windows after it
        # closes (`sitting_out.hung_reason`), and the scenario must name it before that
        straggler_min_seconds=10.0,
    )
    shepherd = Shepherd(config, build_workload(config, shards=2))
    state, seen = shepherd.state, {}
    pause_after_round(shepherd, 1)

    def events(kind):
        return [e for e in state.events if e.kind == kind]

    async def scenario(port):
        steady = spawn_worker(port, "--id", "steady")
        async with trio.open_nursery() as peers:
            peers.start_soon(trickling_peer, port, seen)
            # before: round 1 never closed (the hang guard failed after 60 s)
            await until(lambda: state.status == "paused" and len(state.history) == 1, polls=1200)
            seen["trickled at the close"] = seen["trickled"]
            seen["reason"] = state.workers["trickler"].reason
            seen["api"] = {w["id"]: w for w in workers_json(state)["workers"]}
            steady.send_signal(signal.SIGKILL)
            await until(lambda: events("lost"))
            shepherd.resume()
            await until(lambda: any("no worker is ready" in e.message for e in events("waiting")))
            await until(lambda: seen["trickled"] > seen["trickled at the close"])
            assert "cut off" not in seen  # it trickles on, connected: not why the round closed
            seen["stop"] = True  # the peer hangs up mid-heartbeat; the same id comes back
        await until(lambda: state.workers["trickler"].state == "lost")
        spawn_worker(port, "--id", "trickler")
        await until(lambda: state.status == "done")

    run_shepherd(shepherd, scenario)
    (dropped,) = events("stragglers")
    assert dropped.workers == ["trickler"]
    sitting_out = "late for round 1: sits new rounds out until that result comes"
    assert seen["reason"] == seen["api"]["trickler"]["reason"] == sitting_out
    (waiting,) = [e.message for e in events("waiting") if "no worker is ready" in e.message]
    assert "(trickler) sits out, late for round 1" in waiting
    assert "restart it" in waiting
    assert [r.worker_ids for r in state.history] == [("steady",), ("trickler",), ("trickler",)]


async def fast_liar(port: int, seen: dict) -> None:
    """Answer every roundStart at once with a well-formed result of zeros, claiming the steps,
    tokens and (little) compute time an honest worker would."""
    stream = await ready_peer(port, "liar")
    async with stream.stream:
        try:
            while True:
                start = await stream.receive()
                if start.kind != "roundStart":
                    continue
                zeros = seen.setdefault(
                    "zeros", {n: np.zeros_like(v) for n, v in start.tensors.items()}
                )
                steps = start.body.inner_steps
                answer = protocol.RoundResult(
                    round=start.body.round,
                    tokens=steps * PER_STEP,
                    losses=(3.0,) * steps,
                    compute_seconds=0.01,
                    inner_steps=steps,
                )
                await stream.send(answer, zeros)
        except PEER_ERRORS:
            return


@pytest.mark.e2e
def test_a_fast_liar_does_not_push_a_slower_honest_worker_out_of_the_run(spawn_worker):
    """Before: the liar answered round 1 at once, so the window was the floor (2 s); the honest
    worker (its first round on this connection, so no time of its own yet) took longer, was
    dropped, and sat out while the liar alone closed every other round within milliseconds:
    the run ended having counted none of the honest worker's results. Its progress reports
    (step k of H after t seconds: H/k x t in all) now count as its own time, up to factor
    times the round's window."""
    config = small_config(
        validate="off",  # its peers answer with zeros: the claim is timing, not their weight
        workers=2,
        rounds=2,
        inner_steps=5,
        chunk_steps=1,
        straggler_factor=4.0,
        straggler_min_seconds=2.0,
    )
    shepherd = Shepherd(config, build_workload(config, shards=2))
    seen = {}

    async def scenario(port):
        # 5 chunks of at least 0.5 s: past the floor, its first progress report well inside it
        spawn = faulty_worker_command(port, "pace", "--id", "honest", seconds=0.5)
        process = subprocess.Popen(spawn, env=worker_env(), stdout=subprocess.DEVNULL)
        try:
            async with trio.open_nursery() as peers:
                peers.start_soon(fast_liar, port, seen)
                await until(lambda: shepherd.state.status == "done", polls=1200)
                peers.cancel_scope.cancel()
        finally:
            process.kill()
            await trio.to_thread.run_sync(process.wait)

    run_shepherd(shepherd, scenario)
    history = shepherd.state.history
    assert [sorted(r.worker_ids) for r in history] == [["honest", "liar"]] * 2
    assert [r.round_seconds > 5 * 0.5 for r in history] == [True, True]  # past the floor
    assert not [e for e in shepherd.state.events if e.kind == "stragglers"]


@pytest.mark.e2e
def test_progress_without_results_loses_the_round_then_the_shard():
    """Issue 25: a peer that reports "step 1 of H" early in each round and answers zeros late
    held every round until its answer (41 s for 2-3 s), its zeros counted. Now its zeros are
    refused (validation, the default), the rounds after that wait for it only the quorum's
    pace times --straggler-factor (not the 60 s floor, not its projection), and after
    `UNPROVEN_ROUNDS` rounds with nothing counted its connection ends and its shard is
    orphaned for the next worker. The honest worker is in every round."""
    # round 1 refuses the drag's zeros, rounds 2-4 go without a result of its counted, and
    # it is lost (its shard orphaned) once round 4 settles (the watchdog polls every second,
    # the steady worker's rounds take one at least): rounds 5-7 are slack
    config = small_config(workers=2, rounds=7, inner_steps=4, chunk_steps=1)
    shepherd = Shepherd(config, build_workload(config, shards=2))
    state = shepherd.state

    async def scenario(port):
        # the honest worker's rounds take a second at least (4 chunks of 0.25 s): the rounds
        # after the drag is dropped outlast the watchdog's polls
        steady = faulty_worker_command(port, "pace", "--id", "steady", seconds=0.25)
        drag = faulty_worker_command(port, "drag", "--id", "drag", first=0.5, answer=8.0)
        processes = [
            subprocess.Popen(command, env=worker_env(), stdout=subprocess.DEVNULL)
            for command in (steady, drag)
        ]
        try:
            await until(lambda: state.status == "done", polls=2400)  # a hang guard
        finally:
            for process in processes:
                process.kill()
                await trio.to_thread.run_sync(process.wait)

    run_shepherd(shepherd, scenario)
    refused = [e for e in state.events if e.kind == "bad_result"]
    assert refused and {e.worker for e in refused} == {"drag"}
    assert {e.refusal for e in refused} == {"no_gain"}
    lost = [e for e in state.events if e.kind == "lost" and e.fields().get("worker") == "drag"]
    shown = [(e.kind, e.message) for e in state.events if e.kind not in ("progress",)]
    assert lost, "\n".join(f"{k}: {m}" for k, m in shown)
    assert "no result counted in 3 rounds since one was refused" in lost[0].message
    orphaned = [e for e in state.events if e.kind == "shard_orphaned"]
    # under load the rounds may last long enough for the drag to come back and lose its shard
    # again: each time it is the drag's
    assert orphaned and {e.worker for e in orphaned} == {"drag"}, [e.worker for e in orphaned]
    assert all("steady" in r.worker_ids for r in state.history)
    assert len(state.history) == 7
