"""The interface every place that runs a graph implements."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

PLATFORMS = ("cpu", "cuda", "rocm", "metal", "vulkan")
RUNTIMES = ("xla", "iree")  # XLA through JAX, or IREE compiling the graph's StableHLO


class BackendUnavailable(RuntimeError):
    """The asked-for backend cannot run here; the message says what to install."""


class GraphError(RuntimeError):
    """A serialized graph could not be loaded or does not fit this backend."""


@dataclass(frozen=True)
class BackendInfo:
    platform: str  # cpu | cuda | rocm | metal | vulkan
    device_kind: str  # e.g. "NVIDIA H100 80GB HBM3" or "cpu"
    device_count: int
    memory_bytes: int
    jax_version: str
    runtime: str = "xla"  # xla | iree
    target: str = (
        ""  # what the runtime compiles for: the XLA platform, or IREE's e.g. "vulkan-spirv"
    )

    def describe(self) -> str:
        via = f" ({self.runtime} {self.target})" if self.runtime != "xla" else ""
        if self.platform == "cpu":
            return f"cpu{via}"
        count = f" x{self.device_count}" if self.device_count > 1 else ""
        return f"{self.platform} {self.device_kind}{count}{via}"


Axis = int | None  # the axis of an array split over a backend's devices; None: a copy on each


@dataclass(frozen=True)
class MemoryUse:
    """Device memory now, at its peak, and in all (bytes); 0 where the device cannot say."""

    in_use: int = 0
    peak: int = 0
    limit: int = 0


@dataclass
class LoadedGraph:
    """A compiled-on-first-call graph and what it expects."""

    name: str
    platforms: tuple[str, ...]
    in_avals: tuple[Any, ...]
    out_avals: tuple[Any, ...]
    call: Callable[..., Any]
    # on a backend of several devices: per flat input, the axis split over them (None: a copy)
    input_axes: tuple[Axis, ...] | None = None


class Backend(abc.ABC):
    """Loads serialized graphs and moves arrays between host and device."""

    @property
    @abc.abstractmethod
    def info(self) -> BackendInfo: ...

    @abc.abstractmethod
    def load(
        self,
        name: str,
        serialized: bytes,
        *,
        donate_argnums: Sequence[int] = (),
        own: bool = False,
    ) -> LoadedGraph:
        """Deserialize a graph; GraphError if it was not exported for this platform and device count.

        A graph someone else sent must call nothing outside itself but what our exports
        call (UntrustedGraph, see `_vouch`); `own`: this process exported it itself (the
        shepherd's eval), so a user's model may use any op its runtime has.
        """

    @abc.abstractmethod
    def to_device(
        self, arrays: Sequence[np.ndarray], axes: Sequence[Axis] | None = None
    ) -> list[Any]:
        """Host arrays onto the device(s); `axes` (several devices only) as a graph's `input_axes`."""

    @abc.abstractmethod
    def to_host(self, arrays: Sequence[Any]) -> list[np.ndarray]: ...

    def memory_use(self) -> MemoryUse:
        """How much device memory the worker uses; all zero where it cannot be measured."""
        return MemoryUse()

    def keep(self, host: Sequence[np.ndarray], device: Sequence[Any]) -> Any:
        """Hold on to a round's starting parameters (`device` is about to be donated to training).

        `host` and `device` hold the same values; what comes back is only for `difference`.
        """
        return list(host)

    def difference(self, kept: Any, after: Sequence[Any]) -> list[np.ndarray]:
        """`kept - after` per array, as host arrays; `kept` is consumed (it may be overwritten)."""
        return [
            np.subtract(k, a, out=k if k.flags.writeable else None)
            for k, a in zip(kept, self.to_host(after), strict=True)
        ]

    # Streaming DiLoCo sends and merges fragments while training goes on; these three
    # let a backend keep the device busy through them (the base class goes through the host).

    def snapshot(self, device: Sequence[Any]) -> Any:
        """Hold `device`'s values now, to read with `fetch` after they are donated to training.

        Taking it must cost the training loop next to nothing; the base class
        copies to the host at once, a device backend copies on the device.
        """
        return [np.array(a, copy=True) for a in self.to_host(device)]  # never a view of them

    def fetch(self, snapshot: Any) -> list[np.ndarray]:
        """A `snapshot`'s values as host arrays (waits for its copy; run it off the training loop)."""
        return list(snapshot)

    def stage(self, host: Sequence[np.ndarray], axes: Sequence[Axis] | None = None) -> Any:
        """Host arrays made ready for `blend` ahead of time (a device backend uploads them now)."""
        return [np.asarray(a, np.float32) for a in host]

    def blend(
        self,
        local: Sequence[Any],
        staged: Any,
        alpha: float,
        axes: Sequence[Axis] | None = None,
    ) -> list[Any]:
        """α·local + (1 − α)·staged per array (float32), as device arrays placed like `local`.

        α = 0 is the staged values themselves, bit for bit.
        """
        if alpha == 0.0:
            host = list(staged)
        else:
            a, b = np.float32(alpha), np.float32(1) - np.float32(alpha)
            host = [a * x + b * y for x, y in zip(self.to_host(local), staged, strict=True)]
        return self.to_device(host) if axes is None else self.to_device(host, axes)

    def shift(
        self,
        local: Sequence[Any],
        staged: Any,
        scale: float,
        axes: Sequence[Axis] | None = None,
    ) -> list[Any]:
        """local + scale·staged per array (float32), as device arrays placed like `local`.

        A Streaming DiLoCo carry merge: `staged` holds G − θ_sent, and scale is 1 − α.
        """
        s = np.float32(scale)
        host = [x + s * y for x, y in zip(self.to_host(local), staged, strict=True)]
        return self.to_device(host) if axes is None else self.to_device(host, axes)


def deserialize(name: str, serialized: bytes) -> Any:
    """The `jax.export.Exported` in `serialized`; GraphError if the bytes are not one."""
    from jax import export

    try:
        return export.deserialize(bytearray(serialized))
    except Exception as exc:  # flatbuffers/MLIR raise many types on bad bytes
        raise GraphError(f"graph {name!r} is not a valid jax.export artifact: {exc}") from exc


def signature(name: str, serialized: bytes) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(flat input avals, flat output avals) of a serialized graph, read without compiling it."""
    exported = deserialize(name, serialized)
    return tuple(exported.in_avals), tuple(exported.out_avals)
