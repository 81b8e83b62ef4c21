"""`pcp_tui.testing.faulty_worker`: its command line, and what each result fault sends.

The faults run end to end in the tests that need them (test_byzantine, test_security,
test_elastic, test_cli_errors); here, in this process, each fault's hooks (the
`worker.rounds.Faults` the worker consults) are checked for what they do.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from pcp_tui.testing import faulty_worker, faulty_worker_command, worker_command
from pcp_tui.worker.rounds import Faults


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


def _results(faults, results: int) -> list[np.ndarray]:
    """What a worker with `faults` sends for `results` results of Δ = 1, one after another."""
    return [faults.result({"w": np.ones(3, np.float32)})["w"] for _ in range(results)]


@pytest.mark.parametrize(
    ("fault", "parameters", "factors"),
    [
        ("scale", {"factor": 1e6, "results": 0}, [1e6, 1e6, 1e6]),
        ("scale", {"factor": -1.0, "results": 0}, [-1, -1, -1]),
        ("scale", {"factor": 1e6, "results": 1}, [1e6, 1, 1]),
        ("ratchet", {"factor": 3.0}, [1, 3, 9]),
    ],
)
def test_a_result_fault_scales_the_r_th_result_as_documented(fault, parameters, factors):
    sent = _results(faulty_worker.FAULTS[fault].make(**parameters), 3)
    for delta, factor in zip(sent, factors, strict=True):
        np.testing.assert_array_equal(delta, np.full(3, factor, np.float32))


def test_nan_poisons_every_value():
    assert all(np.isnan(delta).all() for delta in _results(faulty_worker.FAULTS["nan"].make(), 2))


def test_the_honest_worker_consults_hooks_that_change_nothing():
    honest = Faults()
    tensors = {"w": np.ones(3, np.float32)}
    assert honest.result(tensors) is tensors


def test_pace_and_slow_stretch_a_chunk_to_what_they_say():
    """The chunk hooks sleep the rest of the chunk's time (timed with the clock they sleep on)."""
    for fault, parameters, took, least in [
        ("pace", {"seconds": 0.05}, 0.01, 0.04),
        ("slow", {"factor": 3.0}, 0.02, 0.04),
    ]:
        hooks = faulty_worker.FAULTS[fault].make(**parameters)
        started = time.perf_counter()
        hooks.after_chunk(took)
        assert time.perf_counter() - started >= least
