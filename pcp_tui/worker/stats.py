"""What a worker measures about itself and sends with its progress: steps, tokens, memory, GPU use.

Device memory comes from the backend (JAX's `device.memory_stats()`, or the
process's resident memory on CPU). GPU utilization comes from NVML when the
optional `nvidia-ml-py` package is importable and the device is an NVIDIA
GPU; otherwise it is reported as not measured (-1), never as a made-up zero.
Nothing here may end the worker: a measurement that fails is reported as unknown.
"""

from __future__ import annotations

import logging
from typing import Any

from pcp_tui import protocol
from pcp_tui.backends import Backend

log = logging.getLogger(__name__)


class GpuUtilization:
    """The NVIDIA device's busy share (0..1) through NVML, or None when it cannot be read.

    NVML is opened once, on first use; a missing package, a missing driver
    library or a failing call turns this off for good with one log line.
    """

    def __init__(self, platform: str, device_index: int = 0):
        self._wanted = platform == "cuda"
        self._device_index = device_index
        self._handle: Any = None
        self._nvml: Any = None

    def read(self) -> float | None:
        if not self._wanted:
            return None
        try:
            if self._handle is None:
                import pynvml  # from the optional nvidia-ml-py package

                pynvml.nvmlInit()
                self._nvml = pynvml
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(self._device_index)
            return min(
                max(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100, 0.0), 1.0
            )
        except Exception as exc:  # ImportError, NVMLError_*: GPU utilization stays unknown
            log.info("no GPU utilization (pip install nvidia-ml-py to get it): %s", exc)
            self._wanted = False
            return None


class WorkerCounters:
    """Steps and tokens trained since the worker started, and a snapshot of its statistics."""

    def __init__(self, backend: Backend, gpu: GpuUtilization | None = None):
        self._backend = backend
        self._gpu = gpu or GpuUtilization(backend.info.platform, _device_index(backend))
        self.steps = 0
        self.tokens = 0

    def trained(self, steps: int, tokens: int) -> None:
        self.steps += steps
        self.tokens += tokens

    def snapshot(self) -> protocol.WorkerStats:
        """The statistics as the wire carries them; unknown memory is 0, unknown GPU use -1."""
        try:
            memory = self._backend.memory_use()
        except Exception as exc:  # a plugin's allocator query failing must not end training
            log.info("device memory unknown: %s", exc)
            memory = None
        utilization = self._gpu.read()
        return protocol.WorkerStats(
            steps=self.steps,
            tokens=self.tokens,
            memory_in_use_bytes=memory.in_use if memory else 0,
            memory_peak_bytes=memory.peak if memory else 0,
            memory_limit_bytes=memory.limit if memory else 0,
            gpu_utilization=-1.0 if utilization is None else utilization,
        )


def _device_index(backend: Backend) -> int:
    """The NVML index of the backend's device (JAX's local id for CUDA), 0 if unknown."""
    device = getattr(backend, "device", None)
    index = getattr(device, "local_hardware_id", None)
    if index is None:
        index = getattr(device, "id", 0)
    return int(index) if isinstance(index, int) else 0
