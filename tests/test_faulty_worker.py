"""`pcp_tui.testing.faulty_worker`: its command line, and what each result fault sends.

The faults run end to end in the tests that need them (test_byzantine, test_security,
test_elastic, test_cli_errors); here, in this process, the tampering itself is checked
against a stream that records what it was asked to send.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from pcp_tui import protocol
from pcp_tui.contract.connection import Connection
from pcp_tui.testing import faulty_worker, faulty_worker_command, worker_command


def test_the_command_is_the_worker_command_after_the_fault_and_its_parameters():
    command = faulty_worker_command(4000, "stall", "--id", "w1", token="t", round=2, seconds=5)
    fault_part = [sys.executable, "-m", "pcp_tui.testing.faulty_worker", "stall"]
    fault_part += ["--round", "2", "--seconds", "5", "--"]
    assert command == [*fault_part, *worker_command(4000, "--id", "w1", token="t")[4:]]


def test_an_unknown_fault_or_parameter_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="no fault 'evil'"):
        faulty_worker_command(4000, "evil")
    with pytest.raises(ValueError, match="takes no round"):
        faulty_worker_command(4000, "scale", round=2)


class RecordingStream:  # what a Connection touches on its MessageStream, recording sends
    def __init__(self):
        self.sent: list[tuple[protocol.Body, dict | None]] = []
        self.last_activity = 0.0
        self.check_header = None

    async def send(self, body, tensors=None, **options):
        self.sent.append((body, tensors))
        return 0


async def _send_results(results: int) -> list[np.ndarray]:
    """Send a heartbeat, then `results` round results of Δ = 1; the Δ each one carried."""
    stream = RecordingStream()
    sender = Connection(stream, "worker")
    await sender.send(protocol.Heartbeat(0.0))
    for number in range(1, results + 1):
        await sender.send(protocol.RoundResult(round=number), {"w": np.ones(3, np.float32)})
    assert stream.sent[0] == (protocol.Heartbeat(0.0), None)  # other messages pass untouched
    return [tensors["w"] for _, tensors in stream.sent[1:]]


@pytest.fixture
def fresh_sender(monkeypatch):
    """Undo the fault's patch of the worker's sender when the test ends."""
    monkeypatch.setattr(Connection, "send", Connection.send)


@pytest.mark.parametrize(
    ("fault", "parameters", "factors"),
    [
        ("scale", {"factor": 1e6, "results": 0}, [1e6, 1e6, 1e6]),
        ("scale", {"factor": -1.0, "results": 0}, [-1, -1, -1]),
        ("scale", {"factor": 1e6, "results": 1}, [1e6, 1, 1]),
        ("ratchet", {"factor": 3.0}, [1, 3, 9]),
    ],
)
async def test_a_result_fault_scales_the_r_th_result_as_documented(
    fresh_sender, fault, parameters, factors
):
    faulty_worker.FAULTS[fault].inject(**parameters)
    sent = await _send_results(3)
    for delta, factor in zip(sent, factors, strict=True):
        np.testing.assert_array_equal(delta, np.full(3, factor, np.float32))


async def test_nan_poisons_every_value(fresh_sender):
    faulty_worker.FAULTS["nan"].inject()
    assert all(np.isnan(delta).all() for delta in await _send_results(2))
