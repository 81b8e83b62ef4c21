"""Reading IREE device arrays back to the host, also where a Vulkan driver refuses IREE's reader."""

from __future__ import annotations

from typing import Any

import numpy as np


def to_host_array(array: Any) -> np.ndarray:
    """A numpy copy of an IREE device array (a numpy array passes through)."""
    if isinstance(array, np.ndarray):
        return array
    try:
        return np.asarray(array.to_host())
    except ValueError as exc:
        if "minImportedHostPointerAlignment" not in str(exc):
            raise
    return _host_through_staging(array)


def _host_through_staging(array: Any) -> np.ndarray:
    """Read a device array back through a host-visible staging buffer of IREE's own.

    Where a Vulkan driver can import host memory, IREE 3.13's `DeviceArray.to_host`
    makes a numpy array the copy's target, and drivers that want it page-aligned
    refuse numpy's allocation ("minImportedHostPointerAlignment 4096"): seen with
    Mesa's llvmpipe, whose AMD (RADV) and Intel (ANV) drivers import host memory
    the same way. IREE's staged path, the one NVIDIA's driver gets, needs no import.
    IREE keeps the array's buffer private (`_buffer_view`, `_device`): no public way in.
    """
    import iree.runtime as runtime

    view, device = array._buffer_view, array._device
    source = view.get_buffer()
    staging = device.allocator.allocate_buffer(
        memory_type=int(runtime.MemoryType.HOST_LOCAL | runtime.MemoryType.DEVICE_VISIBLE),
        allowed_usage=int(runtime.BufferUsage.TRANSFER_TARGET | runtime.BufferUsage.MAPPING_SCOPED),
        allocation_size=source.byte_length(),
    )
    copied = device.create_semaphore(0)
    device.queue_copy(
        source,
        staging,
        wait_semaphores=runtime.HalFence.create_at(copied, 0),
        signal_semaphores=runtime.HalFence.create_at(copied, 1),
    )
    runtime.HalFence.create_at(copied, 1).wait()
    dtype = runtime.HalElementType.map_to_dtype(view.element_type)
    return np.array(staging.map().asarray(view.shape, dtype))  # a copy: the mapping ends here
