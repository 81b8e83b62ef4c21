"""Where graphs run: one small interface and its JAX implementation."""

from ._base import (
    PLATFORMS,
    Backend,
    BackendInfo,
    BackendUnavailable,
    GraphError,
    LoadedGraph,
    MemoryUse,
)
from ._jax import JaxBackend, enable_compilation_cache, select_backend

__all__ = [
    "PLATFORMS",
    "Backend",
    "BackendInfo",
    "BackendUnavailable",
    "GraphError",
    "JaxBackend",
    "LoadedGraph",
    "MemoryUse",
    "enable_compilation_cache",
    "select_backend",
]
