"""A worker that stops reading loses its connection, not the run.

A peer that keeps sending heartbeats is not silent, so the heartbeat watchdog
never drops it; if it stops reading, what the shepherd sends it (the plan, a
round's parameters) waits in TCP flow control. Before `WorkerLink.send` had a
deadline, such a send blocked for ever, and a round start blocked the round's
nursery, so the round never even began its --round-timeout: one token holder
(or one worker whose receive loop hung) stopped the run. Now every message must
be taken within --upload-grace + bytes / --min-upload-rate seconds.

A live shepherd (in this process), a real worker process, and two peers in
this process that speak the real protocol over 127.0.0.1 with a tiny receive
buffer, so the kernel cannot swallow what they do not read.
"""

from __future__ import annotations

import socket
import time

import pytest
import trio

from pcp_tui import protocol
from pcp_tui.contract import auth
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.testing import run_shepherd, until
from pcp_tui.training.build import build_workload

from .conftest import small_config

pytestmark = pytest.mark.e2e

TOKEN = "test-token"


async def deaf_peer(port: int, worker_id: str, read_plan: bool) -> None:
    """Join as `worker_id`, (read the plan and say ready,) then heartbeat and never read."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    await sock.connect(("127.0.0.1", port))
    stream = protocol.MessageStream(trio.SocketStream(sock))
    async with stream.stream:
        hello = (await stream.receive()).body
        await stream.send(
            protocol.WorkerHello(
                supported_versions=protocol.SUPPORTED_VERSIONS,
                worker_id=worker_id,
                proof=auth.proof(TOKEN, hello.nonce, worker_id),
                backend=protocol.BackendInfo(platform=protocol.Platform.CPU),
            )
        )
        assert (await stream.receive()).kind == "welcome"
        if read_plan:
            assert (await stream.receive()).kind == "plan"
            await stream.send(protocol.Ready(compile_seconds=0.1))
        try:
            while True:  # alive to the watchdog, deaf to everything else
                await stream.send(protocol.Heartbeat(time.time()))
                await trio.sleep(0.2)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # the shepherd hung up on us


def test_peers_that_stop_reading_are_dropped_and_the_run_goes_on(spawn_worker):
    config = small_config(workers=2, rounds=2, inner_steps=2, upload_grace=1.0)
    shepherd = Shepherd(config, build_workload(config, shards=2))
    seen = {}

    async def scenario(port):
        async with trio.open_nursery() as peers:
            peers.start_soon(deaf_peer, port, "deaf-to-plan", False)
            peers.start_soon(deaf_peer, port, "deaf-to-rounds", True)
            await until(lambda: "deaf-to-rounds" in shepherd.state.workers)
            seen["honest"] = spawn_worker(port, "--id", "honest")
            await until(lambda: len(shepherd.state.history) == 2, polls=2400)  # 120 s: a hang guard

    run_shepherd(shepherd, scenario)
    lost = {e.data["worker"]: e.message for e in shepherd.state.events if e.kind == "lost"}
    assert set(lost) == {"deaf-to-plan", "deaf-to-rounds"}
    assert "download too slow" in lost["deaf-to-plan"] and "byte plan" in lost["deaf-to-plan"]
    assert "byte roundStart" in lost["deaf-to-rounds"]
    assert "--min-upload-rate" in lost["deaf-to-rounds"]
    history = shepherd.state.history
    assert [r.worker_ids for r in history] == [("honest",), ("honest",)]
    assert shepherd.state.status == "done"
    assert seen["honest"].wait(timeout=60) == 0
