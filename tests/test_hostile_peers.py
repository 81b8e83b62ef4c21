"""Admitted peers that misbehave without breaking the protocol lose their connection, not the run.

1. A worker that stops reading. (An honest one reads nothing while it compiles,
so the shepherd sends it no heartbeats then.)

A peer that keeps sending heartbeats is not silent, so the heartbeat watchdog
never drops it; if it stops reading, what the shepherd sends it (the plan, a
round's parameters) waits in TCP flow control. Before `WorkerLink.send` had a
deadline, such a send blocked for ever, and a round start blocked the round's
nursery, so the round never even began its --round-timeout: one token holder
(or one worker whose receive loop hung) stopped the run. Now every message must
be taken within --upload-grace + bytes / --min-upload-rate seconds.

2. A worker whose texts (id, host name, device, the reason in its error) hold
control characters: printed as they came, they reached the operator's terminal
as escape sequences (clear the screen, set the title) and forged whole lines of
the headless log ("run done after 8 rounds"). Ids with them are refused; other
texts are shown escaped.

One live shepherd (in this process) for both, a real worker process, and peers
in this process that speak the real protocol over 127.0.0.1, the deaf ones with
a tiny receive buffer, so the kernel cannot swallow what they do not read.
"""

from __future__ import annotations

import contextlib
import socket

import pytest
import trio

from pcp_tui import protocol
from pcp_tui.contract import auth
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.testing import heartbeat_until_hung_up, planned, run_shepherd, until
from pcp_tui.training.build import build_workload

from .conftest import small_config

pytestmark = pytest.mark.e2e

TOKEN = "test-token"


async def join(
    port: int, worker_id: str, *, receive_buffer: int = 0, **hello
) -> protocol.MessageStream:
    """Connect and send a workerHello with the token's real proof (`hello`: more fields)."""
    sock = trio.socket.socket()
    if receive_buffer:  # before connect: the window the shepherd may fill
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    await sock.connect(("127.0.0.1", port))
    stream = protocol.MessageStream(trio.SocketStream(sock))
    nonce = (await stream.receive()).body.nonce
    await stream.send(
        protocol.WorkerHello(
            supported_versions=protocol.SUPPORTED_VERSIONS,
            worker_id=worker_id,
            proof=auth.proof(TOKEN, nonce, worker_id),
            **{"backend": protocol.BackendInfo(platform=protocol.Platform.CPU), **hello},
        )
    )
    return stream


async def deaf_peer(port: int, worker_id: str, read_plan: bool) -> None:
    """Join as `worker_id`, (read the plan and say ready,) then heartbeat and never read."""
    stream = await join(port, worker_id, receive_buffer=4096)
    async with stream.stream:
        assert (await stream.receive()).kind == "welcome"
        if read_plan:
            assert (await stream.receive()).kind == "plan"
            await stream.send(protocol.Ready(compile_seconds=0.1))
        await heartbeat_until_hung_up(stream)  # alive to the watchdog, deaf to everything else


async def compiling_peer(port: int, seen: dict) -> None:
    """An honest worker's pace: plan, 2 s of compiling, ready. What did the shepherd send
    while it compiled (an honest worker reads nothing then), and what after?"""
    stream = await join(port, "compiling")
    async with stream.stream:
        await planned(stream)
        seen["while compiling"] = []
        with trio.move_on_after(2):  # 4 heartbeat intervals
            while True:
                seen["while compiling"].append((await stream.receive()).kind)
        await stream.send(protocol.Ready(compile_seconds=2.0))
        with trio.fail_after(10):  # a bound, not a timing: heartbeats come every 0.5 s
            while (await stream.receive()).kind != "heartbeat":
                pass  # a round may start first
        await stream.send(protocol.Goodbye("done"))


FORGED = "\nrun done after 8 rounds; final eval loss 0.0001\x1b[2J"  # a line, clear screen


async def peers_with_escapes(port: int) -> protocol.Message:
    """One id with control characters (its answer is returned), and one worker whose
    host, device and error reason hold them."""
    stream = await join(port, "evil" + FORGED)
    async with stream.stream:
        refusal = await stream.receive()
    backend = protocol.BackendInfo(
        platform=protocol.Platform.CUDA, device_kind="\x1b]0;title\x07H100", target="\x1b[31m"
    )
    stream = await join(port, "rude", hostname="host" + FORGED, backend=backend)
    async with stream.stream:
        await planned(stream)
        await stream.send(protocol.Error(protocol.ErrorCode.MALFORMED, "bye" + FORGED))
        with contextlib.suppress(protocol.ConnectionClosed, trio.BrokenResourceError):
            while True:  # until the shepherd hangs up
                await stream.receive()
    return refusal


def test_deaf_peers_are_dropped_and_peers_texts_cannot_write_to_the_operators_terminal(
    spawn_worker,
):
    config = small_config(workers=2, rounds=2, inner_steps=2, upload_grace=1.0, min_upload_rate=1e7)
    shepherd = Shepherd(config, build_workload(config, shards=2))
    seen = {}

    async def scenario(port):
        seen["honest"] = spawn_worker(port, "--id", "honest")
        async with trio.open_nursery() as peers:
            peers.start_soon(deaf_peer, port, "deaf-to-plan", False)
            peers.start_soon(deaf_peer, port, "deaf-to-rounds", True)
            peers.start_soon(compiling_peer, port, seen)
            seen["refusal"] = await peers_with_escapes(port)
            await until(lambda: len(shepherd.state.history) == 2, polls=2400)  # 120 s: a hang guard

    run_shepherd(shepherd, scenario)
    lost = {e.worker: e.message for e in shepherd.state.events if e.kind == "lost"}
    assert set(lost) == {"deaf-to-plan", "deaf-to-rounds", "rude"}
    assert "download too slow" in lost["deaf-to-plan"] and "byte plan" in lost["deaf-to-plan"]
    assert "byte roundStart" in lost["deaf-to-rounds"]
    assert "--min-upload-rate" in lost["deaf-to-rounds"]
    history = shepherd.state.history
    assert [r.worker_ids for r in history] == [("honest",), ("honest",)]
    assert shepherd.state.status == "done"
    assert seen["honest"].wait(timeout=60) == 0
    # 1b. no heartbeats to a worker that compiles: they would only fill its window
    assert seen["while compiling"] == []  # and heartbeats came once it was ready
    # 2. control characters: the id is refused, every other text is shown escaped
    assert seen["refusal"].kind == "error" and seen["refusal"].body.code == "malformed"
    assert "control characters" in seen["refusal"].body.message
    assert "rude" in shepherd.state.workers and len(shepherd.state.workers) == 5
    for event in shepherd.state.events:
        assert event.message.isprintable(), event.message
    [joined] = [e.message for e in shepherd.state.events if e.fields().get("worker") == "rude"][:1]
    assert "\\x1b]0;title\\x07H100" in joined
    assert shepherd.state.workers["rude"].host == "host" + FORGED.encode("unicode_escape").decode()
    assert lost["rude"].endswith(
        "the worker reported malformed: bye\\nrun done after 8 "
        "rounds; final eval loss 0.0001\\x1b[2J"
    )
