"""The message trace (`--trace FILE`): both sides of a real run log the same conversation."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from pcp_tui import protocol
from pcp_tui.contract.trace import MessageTrace
from pcp_tui.testing import (
    QUICK_FLAGS,
    ShepherdProcess,
    WorkerProcesses,
    shepherd_command,
    worker_env,
)

FIELDS = {"time", "peer", "direction", "kind", "round", "tensors", "bytes", "since_previous"}


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.e2e
def test_shepherd_and_worker_trace_the_same_conversation(tmp_path):
    shepherd_trace, worker_trace = tmp_path / "shepherd.trace", tmp_path / "worker.trace"
    shepherd = ShepherdProcess(
        "--workers",
        "1",
        "--rounds",
        "2",
        *QUICK_FLAGS,
        "--trace",
        str(shepherd_trace),
        env=worker_env(),
    )
    try:
        port = shepherd.port
        with WorkerProcesses() as workers:
            worker = workers.spawn(port, "--id", "w0", "--trace", str(worker_trace))
            assert shepherd.finish() == 0, shepherd.output
            assert worker.wait() == 0
    finally:
        shepherd.kill()
    ours, theirs = _lines(shepherd_trace), _lines(worker_trace)
    assert all(set(row) == FIELDS for row in ours + theirs)  # no tensor contents, ever
    opening = [(r["direction"], r["kind"]) for r in ours[:4]]
    assert opening == [
        ("sent", "hello"),
        ("received", "workerHello"),
        ("sent", "welcome"),
        ("sent", "plan"),
    ]
    assert (theirs[0]["direction"], theirs[0]["kind"]) == ("received", "hello")
    assert {r["peer"] for r in theirs} == {f"127.0.0.1:{port}"}
    assert theirs[0]["since_previous"] is None and theirs[1]["since_previous"] >= 0

    def rounds(rows, direction, kind):
        return [r["round"] for r in rows if (r["direction"], r["kind"]) == (direction, kind)]

    assert rounds(ours, "sent", "roundStart") == rounds(theirs, "received", "roundStart") == [1, 2]
    assert rounds(ours, "received", "roundResult") == rounds(theirs, "sent", "roundResult")
    first, second = [r for r in ours if r["kind"] == "roundStart"]
    assert first["tensors"] > 0 and first["bytes"] > first["tensors"] * 4  # θ goes out once
    assert second["tensors"] == 0  # continued: the worker holds θ from round 1's update
    updates = [r for r in ours if r["kind"] == "fragmentUpdate"]
    assert [r["round"] for r in updates] == [1, 2] == rounds(theirs, "received", "fragmentUpdate")
    assert all(r["tensors"] == first["tensors"] for r in updates)
    assert ours[-1]["kind"] == "goodbye" and theirs[-1]["kind"] == "goodbye"


def test_the_trace_rotates_instead_of_growing(tmp_path):
    path = tmp_path / "run.trace"
    trace = MessageTrace(str(path), max_bytes=2000)
    message = protocol.Message(
        protocol.Heartbeat(1.0), {"w": np.zeros(4, np.float32)}, wire_bytes=64
    )
    for _ in range(100):
        trace.write("127.0.0.1:1", "sent", message)
    trace.close()
    rotated = tmp_path / "run.trace.1"
    assert path.stat().st_size <= 2000 and rotated.stat().st_size <= 2000
    assert _lines(path)[-1]["kind"] == "heartbeat" and _lines(rotated)


@pytest.mark.e2e
def test_an_unwritable_trace_is_a_one_line_error(tmp_path):
    result = subprocess.run(
        shepherd_command(0, "--trace", str(tmp_path / "missing" / "run.trace")),
        env=worker_env(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().startswith("pcp-tui: error: cannot write --trace")
    assert len(result.stderr.strip().splitlines()) == 1
