"""Which backend runs a worker's graphs: the platform and runtime asked for, or the best one here."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ._base import RUNTIMES, Backend, BackendUnavailable
from ._iree import INSTALL_HINT, IreeBackend
from ._jax import JAX_PLATFORMS, JaxBackend


def select_backend(
    name: str = "auto",
    devices: int | None = None,
    *,
    runtime: str = "auto",
    cache_dir: str | os.PathLike | None = None,
    iree_flags: Sequence[str] = (),
) -> Backend:
    """Pick a backend over `devices` local devices (None: all) and the runtime that runs graphs.

    `name` auto prefers cuda, rocm, metal, then cpu through XLA (with `runtime`
    iree: vulkan, metal, then cpu). `runtime` auto is XLA where JAX serves the
    platform and IREE where only IREE does (vulkan; metal without a JAX plugin);
    IREE runs on one device. `cache_dir` holds IREE's compiled modules (XLA's
    cache is global: `enable_compilation_cache`); `iree_flags` go to IREE's
    compiler (e.g. `--iree-vulkan-target=ampere` for GPU-specific code).
    """
    if runtime not in ("auto", *RUNTIMES):
        raise BackendUnavailable(f"unknown runtime {runtime!r}; choose one of {RUNTIMES}")
    if name == "auto":

        def on(platform: str) -> Backend:
            return select_backend(
                platform, devices, runtime=runtime, cache_dir=cache_dir, iree_flags=iree_flags
            )

        order = ("vulkan", "metal") if runtime == "iree" else ("cuda", "rocm", "metal")
        for platform in order:
            try:
                return on(platform)
            except BackendUnavailable:
                continue
        return on("cpu")

    def iree() -> IreeBackend:
        if devices not in (None, 1):
            raise BackendUnavailable(f"--runtime iree runs on one device, not --devices {devices}")
        return IreeBackend(name, cache_dir=cache_dir, flags=iree_flags)

    if runtime == "iree" or (runtime == "auto" and name not in JAX_PLATFORMS):
        return iree()
    if runtime == "auto" and name == "metal":
        try:
            return JaxBackend(name, devices)
        except BackendUnavailable as exc:
            try:
                return iree()
            except BackendUnavailable:
                raise exc from None
    if name not in JAX_PLATFORMS:
        raise BackendUnavailable(
            f"JAX (--runtime xla) has no {name} platform; run {name} with --runtime iree "
            f"({INSTALL_HINT})"
        )
    return JaxBackend(name, devices)
