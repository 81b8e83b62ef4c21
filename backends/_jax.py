"""JAX backend: runs `jax.export` artifacts on CPU, CUDA, ROCm or Metal."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; each process compiles on its own
    fcntl = None  # type: ignore[assignment]

from ._base import (
    Axis,
    Backend,
    BackendInfo,
    BackendUnavailable,
    GraphError,
    LoadedGraph,
    MemoryUse,
    deserialize,
)
from ._host import host_memory, process_memory
from ._vouch import vouch

if TYPE_CHECKING:  # jax is imported when a backend is made: importing this module stays cheap
    from jax.sharding import Mesh

# What `jax.devices(x)` calls each platform, and what a user installs to get it.
# Metal plugins name their platform differently: Apple's jax-metal and metaljax "METAL"/"metal",
# jax-mps and its forks "mps"; the first one installed wins.
JAX_PLATFORMS = {"cpu": ("cpu",), "cuda": ("cuda",), "rocm": ("rocm",), "metal": ("METAL", "mps")}
_INSTALL_HINT = {
    "cpu": "pip install jax jaxlib",
    "cuda": "pip install 'jax[cuda12]' (or jax[cuda13]) on a machine with an NVIDIA GPU and driver",
    "rocm": "pip install jax-rocm7-plugin jax-rocm7-pjrt (see JAX's ROCm install notes) on an AMD GPU",
    "metal": "pip install metaljax (or jax-mps) on an Apple-silicon Mac, or run --runtime iree",
}
# The name of the device axis of a multi-device backend's mesh (data parallel and FSDP both use
# it): the axis a multi-device export's shardings name (`pcp_tui.training.export.MESH_AXIS`).
MESH_AXIS = "data"
# The name jax.export uses for a platform when lowering.
_EXPORT_PLATFORM = {"cpu": "cpu", "cuda": "cuda", "rocm": "rocm", "metal": "metal"}


def enable_compilation_cache(path: str | os.PathLike) -> None:
    """Keep compiled executables on disk so a restart does not recompile the same graph."""
    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.fspath(path))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # JAX's own variable wins: the test suite keeps every graph (most compile in < 0.5 s)
    least = os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(least))


#: the longest a graph's compile waits for another process compiling the same graph
COMPILE_WAIT_SECONDS = 300.0


def _compile_lock_path(serialized: bytes) -> str | None:
    """The file whose lock a process holds while it compiles `serialized` into the on-disk
    cache; None without a persistent cache (a site's processes keep none)."""
    import jax

    directory = getattr(jax.config, "jax_compilation_cache_dir", None)
    if not directory or not getattr(jax.config, "jax_enable_compilation_cache", False):
        return None
    return os.path.join(directory, f"compiling-{hashlib.sha256(serialized).hexdigest()[:32]}.lock")


@contextlib.contextmanager
def _compiling_alone(serialized: bytes) -> Iterator[None]:
    """Compile as the only process of this host compiling `serialized` into the on-disk cache.

    Workers started together (one per GPU, or a test's two) each compiled the same graph cold,
    at once: N times the work of one compile. A process that finds another compiling it waits
    (a file lock, released by the kernel however its holder ends; at most
    COMPILE_WAIT_SECONDS, for a holder stopped mid-compile), and its own compile is then a
    cache hit. Threads of one process wait for each other too (each opens the file anew).
    """
    path = _compile_lock_path(serialized)
    try:
        lock = open(path, "a") if path is not None else None  # noqa: SIM115 (closed below)
    except OSError:  # a cache this process cannot write to: nothing to wait for
        lock = None
    if lock is None or fcntl is None:
        yield
        return
    with lock:
        deadline = time.monotonic() + COMPILE_WAIT_SECONDS
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:  # compile anyway
                    break
                time.sleep(0.05)
            except OSError:  # a file system without locks: compile anyway
                break
        yield  # closing the file releases the lock


class JaxBackend(Backend):
    """One JAX platform, over `devices` of its local devices (None: all of them).

    With one device, graphs run there exactly as exported. With several, they
    form a one-axis mesh (`MESH_AXIS`), and runs graphs exported for that many
    devices: the artifact says where each input and output lives and holds
    its own per-device computation and collectives.
    """

    def __init__(self, platform: str, devices: int | None = None):
        import jax

        if platform not in JAX_PLATFORMS:
            raise BackendUnavailable(
                f"unknown backend {platform!r}; choose one of {sorted(JAX_PLATFORMS)}"
            )
        found, problem = [], ""
        for name in JAX_PLATFORMS[platform]:
            try:
                found = jax.devices(name)
                break
            except RuntimeError as exc:
                problem = problem or str(exc)
        if not found:
            raise BackendUnavailable(
                f"backend {platform!r} is not available here ({problem}). "
                f"To use it: {_INSTALL_HINT[platform]}"
            )
        if devices is not None and not 1 <= devices <= len(found):
            raise BackendUnavailable(
                f"--devices {devices}: this host has {len(found)} {platform} device(s); "
                f"pass --devices {len(found)} or fewer, or --devices all"
            )
        used = found[: devices or len(found)]
        self._jax = jax
        self._platform = platform
        # this process's first device (in a site, `used` spans every process's: pcp_tui's site.py)
        self._device = next(d for d in used if d.process_index == jax.process_index())
        # several devices: one mesh axis, over which graphs exported for that many devices run
        self._mesh = jax.sharding.Mesh(np.array(used), (MESH_AXIS,)) if len(used) > 1 else None
        # Device-to-host copies land in page-locked host memory where the device has it:
        # several times faster than into pageable memory, and numpy reads it in place.
        self._pinned_host = _pinned_host(self._device) if platform != "cpu" else None
        # kept - after for lists of device arrays, written over `kept`
        self._subtract = jax.jit(
            lambda before, after: [b - a for b, a in zip(before, after, strict=True)],
            donate_argnums=0,
        )
        # a Streaming DiLoCo merge: alpha * local + (1 - alpha) * new, one jit per alpha
        self._blend = jax.jit(
            lambda local, new, alpha: [
                alpha * x + (np.float32(1) - alpha) * y for x, y in zip(local, new, strict=True)
            ],
            static_argnums=2,
        )
        # a carry merge: local + scale * shift, one jit per scale
        self._shift = jax.jit(
            lambda local, shift, scale: [x + scale * y for x, y in zip(local, shift, strict=True)],
            static_argnums=2,
        )
        self._info = BackendInfo(
            platform=platform,
            device_kind=str(self._device.device_kind),
            device_count=len(used),
            memory_bytes=_device_memory(self._device),
            jax_version=jax.__version__,
            runtime="xla",
            target=platform,
        )

    @property
    def info(self) -> BackendInfo:
        return self._info

    @property
    def device(self) -> Any:
        return self._device

    @property
    def mesh(self) -> Mesh | None:
        """The `jax.sharding.Mesh` of this backend's devices, or None for one device."""
        return self._mesh

    def load(
        self,
        name: str,
        serialized: bytes,
        *,
        donate_argnums: Sequence[int] = (),
        own: bool = False,
    ) -> LoadedGraph:
        """Deserialize and compile ahead of time, so the first call runs at full speed.

        A graph exported for N devices runs on a backend of N devices, each
        input and output placed as the artifact says; GraphError otherwise.
        `own` as `Backend.load`.
        """
        jax = self._jax
        exported = deserialize(name, serialized)
        wanted = _EXPORT_PLATFORM[self._platform]
        if wanted not in exported.platforms:
            raise GraphError(
                f"graph {name!r} was lowered for {', '.join(exported.platforms)}, not {wanted}; "
                f"the shepherd must export for this worker's platform"
            )
        if not own:
            vouch(name, exported, wanted)  # before anything compiles: what it calls out to
        devices = self._mesh.size if self._mesh is not None else 1
        if exported.nr_devices != devices:
            raise GraphError(
                f"graph {name!r} was exported for {exported.nr_devices} device(s), this worker "
                f"runs on {devices}; the shepherd exports for the device count a worker's hello "
                "reports: upgrade the shepherd, or restart this worker with --devices 1"
            )
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported.in_avals]
        input_axes: tuple[Axis, ...] | None = None
        if self._mesh is None:
            jitted = jax.jit(exported.call, donate_argnums=tuple(donate_argnums))
        else:
            copy = self._sharding(None, 0)  # a scalar's placement is left unsaid: a copy on each
            ins = [at or copy for at in exported.in_shardings_jax(self._mesh)]
            outs = [at or copy for at in exported.out_shardings_jax(self._mesh)]
            args, _ = jax.tree.unflatten(exported.in_tree, ins)
            jitted = jax.jit(
                exported.call,
                in_shardings=tuple(args),
                out_shardings=jax.tree.unflatten(exported.out_tree, outs),
                donate_argnums=tuple(donate_argnums),
            )
            specs = [
                jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=at)
                for s, at in zip(specs, ins, strict=True)
            ]
            input_axes = tuple(_split_axis(at) for at in ins)
        args, kwargs = jax.tree.unflatten(exported.in_tree, specs)
        try:
            with _compiling_alone(serialized), jax.default_device(self._device):
                compiled = jitted.lower(*args, **kwargs).compile()
        except Exception as exc:  # XLA reports unsupported ops etc. with many types
            raise GraphError(f"graph {name!r} does not compile on {self._platform}: {exc}") from exc
        return LoadedGraph(
            name=name,
            platforms=tuple(exported.platforms),
            in_avals=tuple(exported.in_avals),
            out_avals=tuple(exported.out_avals),
            call=compiled,
            input_axes=input_axes,
        )

    def memory_use(self) -> MemoryUse:
        """The device allocator's numbers (`memory_stats()`); on CPU, this process's resident memory.

        XLA's CPU client keeps no allocator statistics (`memory_stats()` is
        None there): the CPU "device" is host memory, so the process's own
        resident set (now, and its peak from `getrusage`) is the honest stand-in.
        """
        try:
            stats = self._device.memory_stats() or {}
        except Exception:  # CPU and some plugins do not implement memory_stats
            stats = {}
        if "bytes_in_use" in stats:
            return MemoryUse(
                in_use=int(stats["bytes_in_use"]),
                peak=int(stats.get("peak_bytes_in_use", stats["bytes_in_use"])),
                limit=int(stats.get("bytes_limit", 0)),
            )
        if self._platform != "cpu":
            return MemoryUse()
        return process_memory(self._info.memory_bytes)

    def _sharding(self, axis: Axis, ndim: int) -> Any:
        """The mesh sharding that splits `axis` (None: a full copy on every device)."""
        assert self._mesh is not None, "a sharding needs this worker's mesh (several devices)"
        P = self._jax.sharding.PartitionSpec
        spec = (
            P() if axis is None else P(*([None] * axis), MESH_AXIS, *([None] * (ndim - axis - 1)))
        )
        return self._jax.sharding.NamedSharding(self._mesh, spec)

    def to_device(
        self, arrays: Sequence[np.ndarray], axes: Sequence[Axis] | None = None
    ) -> list[Any]:
        """Host arrays onto the first device, or with `axes` over the mesh, each split on its axis.

        Without `axes` they are for a one-device graph, which runs on the first device.
        """
        if self._mesh is None or axes is None:
            # one call per array: measured faster on an H100 than one batched call for GPT-2's 148
            return [self._jax.device_put(a, self._device) for a in arrays]
        return [
            self._jax.device_put(a, self._sharding(axis, np.ndim(a)))
            for a, axis in zip(arrays, axes, strict=True)
        ]

    def to_host(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        if any(
            not getattr(a, "is_fully_addressable", True) and not a.is_fully_replicated
            for a in arrays
        ):
            # a site's mesh spans other processes' devices: a collective, which every process
            # of the site runs for the same arrays (pcp_tui/worker/site.py)
            from jax.experimental import multihost_utils

            return [
                np.asarray(a) for a in multihost_utils.process_allgather(list(arrays), tiled=True)
            ]
        if self._pinned_host is None or self._mesh is not None:  # a mesh gathers its shards
            return [np.asarray(a) for a in self._jax.device_get(list(arrays))]
        return [np.asarray(a) for a in self._jax.device_put(list(arrays), self._pinned_host)]

    def keep(self, host: Sequence[np.ndarray], device: Sequence[Any]) -> Any:
        if self._platform == "cpu":  # the host arrays are as close as a device copy, and free
            return super().keep(host, device)
        return self._copy_on_device(device)

    def difference(self, kept: Any, after: Sequence[Any]) -> list[np.ndarray]:
        if self._platform == "cpu":
            return super().difference(kept, after)
        if self._mesh is not None:  # shard by shard where the arrays live, then gathered
            return self.to_host(self._subtract(kept, list(after)))
        # on the device, so that only the difference crosses to the host
        with self._jax.default_device(self._device):
            return self.to_host(self._subtract(kept, list(after)))

    def snapshot(self, device: Sequence[Any]) -> Any:
        if self._platform == "cpu":  # a host copy is as cheap as a device one
            return super().snapshot(device)
        return self._copy_on_device(device)

    def fetch(self, snapshot: Any) -> list[np.ndarray]:
        if self._platform == "cpu":
            return super().fetch(snapshot)
        return self.to_host(snapshot)

    def stage(self, host: Sequence[np.ndarray], axes: Sequence[Axis] | None = None) -> Any:
        host = [np.asarray(a, np.float32) for a in host]
        return self.to_device(host) if axes is None else self.to_device(host, axes)

    def blend(
        self,
        local: Sequence[Any],
        staged: Any,
        alpha: float,
        axes: Sequence[Axis] | None = None,
    ) -> list[Any]:
        if alpha == 0.0:
            return list(staged)
        return self._blend(list(local), list(staged), np.float32(alpha))

    def shift(
        self,
        local: Sequence[Any],
        staged: Any,
        scale: float,
        axes: Sequence[Axis] | None = None,
    ) -> list[Any]:
        return self._shift(list(local), list(staged), np.float32(scale))

    def _copy_on_device(self, device: Sequence[Any]) -> list[Any]:
        """Copies of `device` placed as they are (dispatched, not waited for)."""
        if self._mesh is not None:  # a copy placed as the original, shard by shard
            return [self._jax.device_put(a, a.sharding, may_alias=False) for a in device]
        return list(self._jax.device_put(list(device), self._device, may_alias=False))


def _split_axis(sharding: Any) -> Axis:
    """The axis `sharding` splits over the mesh, or None for a copy on every device."""
    return next((axis for axis, name in enumerate(sharding.spec) if name is not None), None)


def _pinned_host(device: Any) -> Any:
    """A sharding that puts arrays in the device's page-locked host memory, or None."""
    import jax

    try:
        kinds = {memory.kind for memory in device.addressable_memories()}
    except (AttributeError, NotImplementedError, RuntimeError):  # plugins without memory spaces
        return None
    if "pinned_host" not in kinds:
        return None
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def _device_memory(device: Any) -> int:
    """The device's memory limit as its allocator reports it, else this machine's memory."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # CPU and some plugins do not implement memory_stats
        stats = {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return host_memory()
