"""JAX backend: runs `jax.export` artifacts on CPU, CUDA, ROCm or Metal."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._base import (
    Axis,
    Backend,
    BackendInfo,
    BackendUnavailable,
    GraphError,
    LayoutFor,
    LoadedGraph,
    MemoryUse,
    deserialize,
)
from ._host import host_memory, process_memory
from ._vouch import vouch

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
# The name of the device axis of a multi-device backend's mesh (data parallel and FSDP both use it).
MESH_AXIS = "data"
# The name jax.export uses for a platform when lowering.
_EXPORT_PLATFORM = {"cpu": "cpu", "cuda": "cuda", "rocm": "rocm", "metal": "metal"}


def enable_compilation_cache(path: str | os.PathLike) -> None:
    """Keep compiled executables on disk so a restart does not recompile the same graph."""
    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.fspath(path))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class JaxBackend(Backend):
    """One JAX platform, over `devices` of its local devices (None: all of them).

    With one device, graphs run there exactly as exported. With several, they
    form a one-axis mesh (`MESH_AXIS`) and a graph loaded with a `layout` runs
    on all of them: XLA's SPMD partitioner splits the single-device graph by
    the layout's input and output placements and inserts the collectives.
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
        devices = found[: devices or len(found)]
        self._jax = jax
        self._platform = platform
        self._device = devices[0]
        # several devices: one mesh axis; graphs loaded with a layout are split over it
        self._mesh = (
            jax.sharding.Mesh(np.array(devices), (MESH_AXIS,)) if len(devices) > 1 else None
        )
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
            device_count=len(devices),
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
    def mesh(self) -> Any:
        """The `jax.sharding.Mesh` of this backend's devices, or None for one device."""
        return self._mesh

    def load(
        self,
        name: str,
        serialized: bytes,
        *,
        donate_argnums: Sequence[int] = (),
        layout: LayoutFor | None = None,
        own: bool = False,
    ) -> LoadedGraph:
        """Deserialize and compile ahead of time, so the first call runs at full speed.

        `layout` places the graph on this backend's mesh (ignored with one device);
        `own` as `Backend.load`.
        """
        exported = deserialize(name, serialized)
        wanted = _EXPORT_PLATFORM[self._platform]
        if wanted not in exported.platforms:
            raise GraphError(
                f"graph {name!r} was lowered for {', '.join(exported.platforms)}, not {wanted}; "
                f"the shepherd must export for this worker's platform"
            )
        if not own:
            vouch(name, exported, wanted)  # before anything compiles: what it calls out to
        if self._mesh is not None and layout is not None:
            jitted, specs = self._on_mesh(name, exported, donate_argnums, layout)
        else:
            jitted = self._jax.jit(exported.call, donate_argnums=tuple(donate_argnums))
            specs = [self._jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported.in_avals]
        args, kwargs = self._jax.tree.unflatten(exported.in_tree, specs)
        try:
            with self._jax.default_device(self._device):
                compiled = jitted.lower(*args, **kwargs).compile()
        except Exception as exc:  # XLA reports unsupported ops etc. with many types
            raise GraphError(f"graph {name!r} does not compile on {self._platform}: {exc}") from exc
        return LoadedGraph(
            name=name,
            platforms=tuple(exported.platforms),
            in_avals=tuple(exported.in_avals),
            out_avals=tuple(exported.out_avals),
            call=compiled,
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

    def _on_mesh(
        self, name: str, exported: Any, donate_argnums: Sequence[int], layout_for: LayoutFor
    ) -> tuple[Any, list[Any]]:
        """A jit of `exported` with the layout's shardings, and its sharded input specs.

        The artifact was exported for one device; given shardings for its
        inputs and outputs, XLA's SPMD partitioner splits it over the mesh
        (per-device shards of the batch, all-reduced gradients; all-gathers
        before the use of an FSDP-sharded parameter).
        """
        jax = self._jax
        shapes = lambda avals: tuple(tuple(a.shape) for a in avals)  # noqa: E731
        layout = layout_for(shapes(exported.in_avals), shapes(exported.out_avals))
        sides = (
            ("input", exported.in_avals, layout.inputs),
            ("output", exported.out_avals, layout.outputs),
        )
        placed: dict[str, list[Any]] = {}
        for side, avals, axes in sides:
            if len(axes) != len(avals):
                raise GraphError(
                    f"graph {name!r} has {len(avals)} {side}s; its layout places {len(axes)}"
                )
            for index, (aval, axis) in enumerate(zip(avals, axes, strict=True)):
                problem = self._axis_problem(tuple(aval.shape), axis)
                if problem:
                    raise GraphError(f"graph {name!r}: {side} {index} {problem}")
            placed[side] = [
                self._sharding(axis, len(a.shape)) for a, axis in zip(avals, axes, strict=True)
            ]
        specs = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
            for a, sharding in zip(exported.in_avals, placed["input"], strict=True)
        ]
        args, _ = jax.tree.unflatten(exported.in_tree, placed["input"])
        outputs = jax.tree.unflatten(exported.out_tree, placed["output"])
        jitted = jax.jit(
            exported.call,
            in_shardings=tuple(args),
            out_shardings=outputs,
            donate_argnums=tuple(donate_argnums),
        )
        return jitted, specs

    def _axis_problem(self, shape: tuple[int, ...], axis: Axis) -> str | None:
        """Why `shape` cannot be split on `axis` over this mesh, or None."""
        if axis is None:
            return None
        if not 0 <= axis < len(shape):
            return f"of shape {list(shape)} has no axis {axis} to split over the devices"
        if shape[axis] % self._mesh.size:
            return (
                f"of shape {list(shape)} cannot be split evenly on axis {axis} "
                f"over {self._mesh.size} devices"
            )
        return None

    def _sharding(self, axis: Axis, ndim: int) -> Any:
        """The mesh sharding that splits `axis` (None: a full copy on every device)."""
        P = self._jax.sharding.PartitionSpec
        spec = (
            P() if axis is None else P(*([None] * axis), MESH_AXIS, *([None] * (ndim - axis - 1)))
        )
        return self._jax.sharding.NamedSharding(self._mesh, spec)

    def to_device(
        self, arrays: Sequence[np.ndarray], axes: Sequence[Axis] | None = None
    ) -> list[Any]:
        """Host arrays onto the first device, or with `axes` over the mesh, each split on its axis.

        Without `axes` they are for a graph loaded without a layout, which runs on the first device.
        """
        if self._mesh is None or axes is None:
            # one call per array: measured faster on an H100 than one batched call for GPT-2's 148
            return [self._jax.device_put(a, self._device) for a in arrays]
        return [
            self._jax.device_put(a, self._sharding(axis, np.ndim(a)))
            for a, axis in zip(arrays, axes, strict=True)
        ]

    def to_host(self, arrays: Sequence[Any]) -> list[np.ndarray]:
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
