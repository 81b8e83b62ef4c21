"""Admitted peers that upload results slowly cannot hold a round hostage.

A live `pcp-tui shepherd` process, a real worker, and peers in this test process that
hold the token and speak the real protocol: each starts a round result and trickles it.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import trio

from pcp_tui import protocol
from pcp_tui.shepherd.serving.pool import RESULTS_IN_MEMORY
from pcp_tui.testing import join_as, read_metrics, round_workers
from pcp_tui.training.build import build_workload

from .conftest import small_config

pytestmark = pytest.mark.e2e


async def start_result(port: int, worker_id: str):
    """Join, say ready, then send a round result's header (the plan's tensors, the most a
    result may hold) and, of its payload, only a first byte."""
    stream, welcome = await join_as(port, worker_id, token="test-token")
    assert welcome.kind == "welcome", welcome.body
    await stream.receive()  # the plan
    await stream.send(protocol.Ready(compile_seconds=0.0))
    params = build_workload(small_config(), shards=1).params
    zeros = {name: np.zeros(p.shape, np.float32) for name, p in params.items()}
    body = protocol.RoundResult(round=1, tokens=1, losses=(1.0,), inner_steps=5)
    frame, *payloads = protocol.encode(body, zeros)
    await stream.stream.send_all(bytes(frame))
    return stream, bytes(memoryview(payloads[0])[:1])


async def trickle(stream: protocol.MessageStream, first: bytes, closed: list[str]) -> None:
    """Send a byte every half second until the shepherd hangs up."""
    try:
        while True:
            await stream.stream.send_all(first)
            await trio.sleep(0.5)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        closed.append("closed")
    finally:
        await trio.aclose_forcefully(stream.stream)


def test_trickling_uploads_are_dropped_and_the_honest_round_goes_on(
    shepherds, spawn_worker, tmp_path
):
    path = tmp_path / "m.jsonl"
    tricklers = RESULTS_IN_MEMORY  # enough to hold every result slot
    shepherd = shepherds(
        *("--workers", "1", "--rounds", "2", "--inner-steps", "5", "--metrics", str(path)),
        *("--max-worker-connections", str(tricklers + 2), "--upload-grace", "1"),
    )
    closed: list[str] = []

    async def attack():
        async with trio.open_nursery() as nursery:
            for index in range(tricklers):
                stream, first = await start_result(shepherd.port, f"trickler-{index}")
                nursery.start_soon(trickle, stream, first, closed)

    trio.run(attack)  # returns once the shepherd has hung up on every one
    peak_kib = _peak_rss_kib(shepherd.process.pid)  # still waiting for its worker: alive
    spawn_worker(shepherd.port, token="test-token")  # every result slot is free again for it
    assert shepherd.finish() == 0, shepherd.output
    assert len(closed) == tricklers  # every one was hung up on
    assert round_workers(path) == [1, 1]  # the honest worker's rounds went on
    lost = {row["worker"]: row["message"] for row in read_metrics(path) if row["event"] == "lost"}
    assert sorted(lost) == [f"trickler-{index}" for index in range(tricklers)]
    # too slow either way: the one a round started with may hit its roundStart's deadline
    # first (on a loaded machine the upload clock leaves out the seconds the shepherd was busy)
    assert all(re.search("(up|down)load too slow", message) for message in lost.values()), lost
    print(f"shepherd peak RSS under {tricklers} trickled uploads: {peak_kib / 1024:.0f} MiB")


def _peak_rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))
