"""A worker id belongs to one live connection; a result to the connection its round went to.

A live shepherd on 127.0.0.1, real worker processes, and peers in this test process that
speak the real protocol (handshake with the token's proof, then `MessageStream`).
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import trio

from pcp_tui import protocol
from pcp_tui.diloco.outer import PseudoGradientMean
from pcp_tui.diloco.screening import ResultScreen
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.shepherd.rounds.results import Round
from pcp_tui.testing import join_as, memory_link, run_shepherd, until
from pcp_tui.training.build import build_workload

from .conftest import small_config

pytestmark = pytest.mark.e2e


def _kinds(shepherd, kind: str) -> list:
    return [e for e in shepherd.state.events if e.kind == kind]


def _exit_code(process: subprocess.Popen, guard: float = 120.0) -> int | None:
    """`process`'s exit code, or None (and it is killed) if it is still running after `guard` s.

    A hang guard, not a timing: a refused twin exits at once; one let in would wait for
    rounds of a paused run for ever.
    """
    try:
        return process.wait(timeout=guard)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None


def test_a_live_workers_id_cannot_be_taken_by_a_peer_or_a_twin(spawn_worker):
    config = small_config(workers=1, rounds=3, inner_steps=5)
    shepherd = Shepherd(config, build_workload(config, shards=1))
    seen = {}

    async def scenario(port):
        shepherd.pause()  # before round 1: "w" joins, then sits idle, heartbeating: alive
        honest = spawn_worker(port, "--id", "w")
        seen["honest"] = honest
        # (pausing once a round was seen raced the run: 3 rounds of 5 steps could all end
        # within one poll, the honest worker was told goodbye and the twin was let in)
        await until(lambda: shepherd.state.status == "paused")  # set once "w" is ready
        stream, seen["hijack"] = await join_as(port, "w")
        await stream.aclose()
        twin = spawn_worker(port, "--id", "w")
        seen["twin_code"] = await trio.to_thread.run_sync(_exit_code, twin)
        seen["twin_output"] = twin.stdout.read()
        if seen["twin_code"] is None:  # the twin was let in: say why the honest one was gone
            honest.kill()
            seen["honest_output"] = honest.stdout.read()
        shepherd.resume()

    run_shepherd(shepherd, scenario)
    assert seen["hijack"].kind == "error" and seen["hijack"].body.code == "idInUse"
    assert "another --id" in seen["hijack"].body.message
    assert seen["twin_code"] is not None, (
        f"the twin was let in; the honest worker's output: {seen.get('honest_output')!r}"
    )
    assert seen["twin_code"] != 0
    assert "idInUse" in seen["twin_output"] and "not retrying" in seen["twin_output"]
    history = shepherd.state.history
    assert [r.worker_ids for r in history] == [("w",)] * 3  # the honest worker kept its rounds
    assert seen["honest"].wait(timeout=60) == 0  # and was told goodbye
    refused = [e.fields().get("code") for e in _kinds(shepherd, "refused")]
    assert refused == ["idInUse", "idInUse"]
    assert not _kinds(shepherd, "late_result")


def test_a_silent_connection_is_replaced_by_a_reconnect_and_its_round_is_not_replayed():
    """A connection that fell silent is dead: the same id reconnects. A result for the
    round whose roundStart went to the old connection is not counted from the new one,
    and ends it (no worker sends one; the unit test below pins the round's own binding)."""
    config = small_config(workers=1, rounds=1, inner_steps=5, heartbeat_timeout=2.0)
    shepherd = Shepherd(config, build_workload(config, shards=1))
    seen = {}

    async def scenario(port):
        first, welcome = await join_as(port, "r")
        assert welcome.kind == "welcome"
        await first.receive()  # the plan
        await first.send(protocol.Ready(compile_seconds=0.0))
        start = await first.receive()
        while start.kind != "roundStart":
            start = await first.receive()
        shepherd.pause()  # round 1 gets no result: it is not started again meanwhile
        early, seen["while_alive"] = await join_as(port, "r")
        await early.aclose()
        # `first` now says nothing: once silent past the heartbeat timeout it is dead
        await until(lambda: shepherd.state.workers["r"].state == "lost")
        second, seen["reconnect"] = await join_as(port, "r")
        await second.receive()  # the plan
        await second.send(protocol.Ready(compile_seconds=0.0))
        params = {name: np.zeros_like(p) for name, p in start.tensors.items()}
        replay = protocol.RoundResult(round=1, tokens=1, losses=(1.0,), inner_steps=5)
        await second.send(replay, params)
        await until(lambda: len(_kinds(shepherd, "lost")) == 2)  # the replay ends `second`
        shepherd.request_stop("test over")
        await first.aclose()
        await second.aclose()

    run_shepherd(shepherd, scenario)
    assert seen["while_alive"].body.code == "idInUse"
    assert seen["reconnect"].kind == "welcome"
    assert seen["reconnect"].body.worker_index == 0  # the same worker, back
    assert not shepherd.state.history  # the replayed round 1 result was not counted
    assert not _kinds(shepherd, "late_result")  # nor dropped quietly, once per copy:
    assert _kinds(shepherd, "lost")[1].message.endswith(
        "sent a result for round 1, but round 1's roundStart went to another connection or "
        "to none: a worker answers only the rounds it was sent"
    )


async def test_a_round_counts_a_result_only_from_the_connection_it_started_on():
    shapes = {"w": (3,)}
    original, other = memory_link("a"), memory_link("a")  # two connections of worker a

    current = Round(
        1,
        ["a"],
        PseudoGradientMean(("w",)),
        ResultScreen(shapes, max_tokens=100),
        connections={"a": original},
    )
    assert not current.accepts("a", 1, other)
    assert not current.accepts("a", 2, original)
    assert current.accepts("a", 1, original)
    body = protocol.RoundResult(round=1, tokens=10, losses=(1.0,), inner_steps=1)
    message = protocol.Message(body, {"w": np.ones(3, np.float32)})
    assert await current.add("a", message)
    assert not current.accepts("a", 1, original)  # and only once


def test_admitted_connections_are_capped_and_the_extra_is_told_busy():
    """Both slots held by workers that are ready: no slot can free, so the extra hears `busy`
    at once (one held by a connection that is not ready would be given up to it after a
    while: tests/test_hostile_squatters.py)."""
    config = small_config(workers=1, rounds=1, max_worker_connections=2)
    shepherd = Shepherd(config, build_workload(config, shards=1))
    answers = []

    async def scenario(port):
        streams = []
        for worker_id in ("a", "b", "c"):
            if worker_id == "c":
                await until(
                    lambda: all(shepherd.state.workers[w].state != "compiling" for w in "ab")
                )
            stream, answer = await join_as(port, worker_id)
            streams.append(stream)
            answers.append(answer)
            if answer.kind == "welcome":
                assert (await stream.receive()).kind == "plan"
                await stream.send(protocol.Ready(compile_seconds=0.1))
        shepherd.request_stop("test over")
        for stream in streams:
            await stream.aclose()

    run_shepherd(shepherd, scenario)
    assert [a.kind for a in answers] == ["welcome", "welcome", "error"]
    assert answers[2].body.code == "busy"
    assert "--max-worker-connections" in answers[2].body.message
    assert config.replace(max_worker_connections=0).worker_connections == 3  # --workers + 2


def test_a_worker_whose_id_is_held_retries_only_if_it_was_admitted_before():
    """Never admitted: two workers share an --id by mistake, the refusal is final. Admitted
    before: the live connection is likely its own, cut off; it retries until that one is
    dropped as silent, then trains."""
    from pcp_tui.config import WorkerConfig
    from pcp_tui.worker.client import IdInUse, Worker

    config = small_config(workers=1, rounds=2, inner_steps=5, heartbeat_timeout=2.0)
    shepherd = Shepherd(config, build_workload(config, shards=1))
    seen = {}

    async def scenario(port):
        held, welcome = await join_as(port, "w")  # holds "w", then falls silent
        assert welcome.kind == "welcome"
        as_w = WorkerConfig(
            connect=f"127.0.0.1:{port}", token="test-token", backend="cpu", worker_id="w"
        )
        twin = Worker(as_w)
        with pytest.raises(IdInUse, match="another --id"):
            await twin.run()
        returning = Worker(as_w, max_backoff=0.5)
        returning.status.worker_index = 0  # as after its first welcome
        await returning.run()
        seen["state"] = returning.status.state
        await held.aclose()

    run_shepherd(shepherd, scenario)
    assert seen["state"] == "done"
    assert [r.worker_ids for r in shepherd.state.history] == [("w",), ("w",)]
    refused = [e.fields().get("code") for e in _kinds(shepherd, "refused")]
    assert refused[:2] == ["idInUse", "idInUse"], [e.message for e in _kinds(shepherd, "refused")]


def test_a_reconnected_worker_keeps_the_rounds_it_contributed():
    """Red team: a reconnect made a new table row with `rounds_contributed` 0: the API and
    the `pcp_worker_rounds_contributed` counter went back to 0, and the slot rule that
    spares a worker whose results counted before a reconnect (`slots._earned`) never held."""
    from pcp_tui.config import WorkerConfig
    from pcp_tui.testing import pause_after_round
    from pcp_tui.worker.client import Worker

    config = small_config(workers=1, rounds=3, inner_steps=5)
    shepherd = Shepherd(config, build_workload(config, shards=1))
    pause_after_round(shepherd, 1)
    counts = []

    async def scenario(port):
        as_w = WorkerConfig(
            connect=f"127.0.0.1:{port}",
            token="test-token",
            backend="cpu",
            worker_id="w",
            reconnect=False,
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(Worker(as_w).run)
            await until(lambda: shepherd.state.status == "paused")
            nursery.cancel_scope.cancel()  # the worker goes; it comes back as "w"
        await until(lambda: shepherd.state.workers["w"].state in ("lost", "left"))
        counts.append(shepherd.state.workers["w"].rounds_contributed)
        shepherd.resume()
        await Worker(as_w).run()

    run_shepherd(shepherd, scenario)
    assert [r.worker_ids for r in shepherd.state.history] == [("w",)] * 3
    assert counts == [1]
    assert shepherd.state.workers["w"].rounds_contributed == 3
