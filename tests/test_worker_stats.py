"""A worker's own statistics: counted steps and tokens, measured memory, unmeasured GPU use."""

from __future__ import annotations

import sys

from pcp_tui import protocol
from pcp_tui.backends import JaxBackend
from pcp_tui.worker.stats import GpuUtilization, WorkerCounters


def test_a_cpu_worker_counts_what_it_trained_and_measures_its_memory():
    counters = WorkerCounters(JaxBackend("cpu"))
    counters.trained(5, 5 * 8 * 32)
    counters.trained(5, 5 * 8 * 32)
    stats = counters.snapshot()
    assert (stats.steps, stats.tokens) == (10, 10 * 8 * 32)
    assert 0 < stats.memory_in_use_bytes <= stats.memory_peak_bytes < stats.memory_limit_bytes
    assert stats.gpu_utilization == -1.0  # a CPU has no NVML utilization: not measured
    assert (
        protocol.decode(b"".join(protocol.encode(protocol.Progress(stats=stats)))).body.stats
        == stats
    )


def test_without_nvml_gpu_utilization_is_unknown_not_zero(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as if nvidia-ml-py were not installed
    gpu = GpuUtilization("cuda")
    assert gpu.read() is None
    assert gpu.read() is None  # and it does not try again on every progress message
