"""Where graphs run: one small interface and its JAX implementation."""

from ._base import PLATFORMS, Backend, BackendInfo, BackendUnavailable, GraphError, LoadedGraph
from ._jax import JaxBackend, enable_compilation_cache, select_backend

__all__ = [
    "PLATFORMS",
    "Backend",
    "BackendInfo",
    "BackendUnavailable",
    "GraphError",
    "JaxBackend",
    "LoadedGraph",
    "enable_compilation_cache",
    "select_backend",
]
