"""JAX backend: runs `jax.export` artifacts on CPU, CUDA, ROCm or Metal."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._base import RUNTIMES, Backend, BackendInfo, BackendUnavailable, GraphError, LoadedGraph
from ._iree import INSTALL_HINT, IreeBackend

# What `jax.devices(x)` calls each platform, and what a user installs to get it.
# Metal plugins name their platform differently: Apple's jax-metal and metaljax "METAL"/"metal",
# jax-mps and its forks "mps"; the first one installed wins.
_JAX_PLATFORM = {"cpu": ("cpu",), "cuda": ("cuda",), "rocm": ("rocm",), "metal": ("METAL", "mps")}
_INSTALL_HINT = {
    "cpu": "pip install jax jaxlib",
    "cuda": "pip install 'jax[cuda12]' (or jax[cuda13]) on a machine with an NVIDIA GPU and driver",
    "rocm": "pip install jax-rocm7-plugin jax-rocm7-pjrt (see JAX's ROCm install notes) on an AMD GPU",
    "metal": "pip install metaljax (or jax-mps) on an Apple-silicon Mac, or run --runtime iree",
}
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
    """One JAX platform; uses its first device."""

    def __init__(self, platform: str):
        import jax

        if platform not in _JAX_PLATFORM:
            raise BackendUnavailable(
                f"unknown backend {platform!r}; choose one of {sorted(_JAX_PLATFORM)}"
            )
        devices, problem = [], ""
        for name in _JAX_PLATFORM[platform]:
            try:
                devices = jax.devices(name)
                break
            except RuntimeError as exc:
                problem = problem or str(exc)
        if not devices:
            raise BackendUnavailable(
                f"backend {platform!r} is not available here ({problem}). "
                f"To use it: {_INSTALL_HINT[platform]}"
            )
        self._jax = jax
        self._platform = platform
        self._device = devices[0]
        # Device-to-host copies land in page-locked host memory where the device has it:
        # several times faster than into pageable memory, and numpy reads it in place.
        self._pinned_host = _pinned_host(self._device) if platform != "cpu" else None
        # kept - after for lists of device arrays, written over `kept`
        self._subtract = jax.jit(
            lambda before, after: [b - a for b, a in zip(before, after, strict=True)],
            donate_argnums=0,
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

    def load(
        self, name: str, serialized: bytes, *, donate_argnums: Sequence[int] = ()
    ) -> LoadedGraph:
        """Deserialize and compile ahead of time, so the first call runs at full speed."""
        from jax import export

        try:
            exported = export.deserialize(bytearray(serialized))
        except Exception as exc:  # flatbuffers/MLIR raise many types on bad bytes
            raise GraphError(f"graph {name!r} is not a valid jax.export artifact: {exc}") from exc
        wanted = _EXPORT_PLATFORM[self._platform]
        if wanted not in exported.platforms:
            raise GraphError(
                f"graph {name!r} was lowered for {', '.join(exported.platforms)}, not {wanted}; "
                f"the shepherd must export for this worker's platform"
            )
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

    def to_device(self, arrays: Sequence[np.ndarray]) -> list[Any]:
        # one call per array: measured faster on an H100 than one batched call for GPT-2's 148
        return [self._jax.device_put(a, self._device) for a in arrays]

    def to_host(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        if self._pinned_host is None:
            return [np.asarray(a) for a in self._jax.device_get(list(arrays))]
        return [np.asarray(a) for a in self._jax.device_put(list(arrays), self._pinned_host)]

    def keep(self, host: Sequence[np.ndarray], device: Sequence[Any]) -> Any:
        if self._platform == "cpu":  # the host arrays are as close as a device copy, and free
            return super().keep(host, device)
        return list(self._jax.device_put(list(device), self._device, may_alias=False))

    def difference(self, kept: Any, after: Sequence[Any]) -> list[np.ndarray]:
        if self._platform == "cpu":
            return super().difference(kept, after)
        # on the device, so that only the difference crosses to the host
        with self._jax.default_device(self._device):
            return self.to_host(self._subtract(kept, list(after)))


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
    try:
        stats = device.memory_stats() or {}
    except Exception:  # CPU and some plugins do not implement memory_stats
        stats = {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def select_backend(
    name: str = "auto",
    runtime: str = "auto",
    *,
    cache_dir: str | os.PathLike | None = None,
    iree_flags: Sequence[str] = (),
) -> Backend:
    """Pick a backend and the runtime that runs graphs on it.

    `name` auto prefers cuda, rocm, metal, then cpu through XLA (with `runtime`
    iree: vulkan, metal, then cpu). `runtime` auto is XLA where JAX serves the
    platform and IREE where only IREE does (vulkan; metal without a JAX plugin).
    `cache_dir` holds IREE's compiled modules (XLA's cache is global:
    `enable_compilation_cache`); `iree_flags` go to IREE's compiler (e.g.
    `--iree-vulkan-target=ampere` for GPU-specific code).
    """
    if runtime not in ("auto", *RUNTIMES):
        raise BackendUnavailable(f"unknown runtime {runtime!r}; choose one of {RUNTIMES}")
    if name == "auto":
        order = ("vulkan", "metal") if runtime == "iree" else ("cuda", "rocm", "metal")
        for platform in order:
            try:
                return select_backend(platform, runtime, cache_dir=cache_dir, iree_flags=iree_flags)
            except BackendUnavailable:
                continue
        return select_backend("cpu", runtime, cache_dir=cache_dir, iree_flags=iree_flags)
    if runtime == "iree" or (runtime == "auto" and name not in _JAX_PLATFORM):
        return IreeBackend(name, cache_dir=cache_dir, flags=iree_flags)
    if runtime == "auto" and name == "metal":
        try:
            return JaxBackend(name)
        except BackendUnavailable as exc:
            try:
                return IreeBackend(name, cache_dir=cache_dir, flags=iree_flags)
            except BackendUnavailable:
                raise exc from None
    if name not in _JAX_PLATFORM:
        raise BackendUnavailable(
            f"JAX (--runtime xla) has no {name} platform; run {name} with --runtime iree "
            f"({INSTALL_HINT})"
        )
    return JaxBackend(name)
