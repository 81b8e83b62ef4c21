"""Where graphs run: one small interface and its JAX implementation."""

from ._base import (
    PLATFORMS,
    Axis,
    Backend,
    BackendInfo,
    BackendUnavailable,
    GraphError,
    Layout,
    LayoutFor,
    LoadedGraph,
)
from ._jax import JaxBackend, enable_compilation_cache, select_backend

__all__ = [
    "PLATFORMS",
    "Axis",
    "Backend",
    "BackendInfo",
    "BackendUnavailable",
    "GraphError",
    "JaxBackend",
    "Layout",
    "LayoutFor",
    "LoadedGraph",
    "enable_compilation_cache",
    "select_backend",
]
