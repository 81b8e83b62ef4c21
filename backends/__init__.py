"""Where graphs run: one small interface, run by XLA (through JAX) or by IREE."""

from ._base import (
    PLATFORMS,
    RUNTIMES,
    Backend,
    BackendInfo,
    BackendUnavailable,
    GraphError,
    LoadedGraph,
)
from ._iree import SOURCE_PLATFORM, IreeBackend, compile_stablehlo
from ._iree import TARGETS as IREE_TARGETS
from ._jax import JaxBackend, enable_compilation_cache, select_backend

__all__ = [
    "PLATFORMS",
    "RUNTIMES",
    "SOURCE_PLATFORM",
    "IREE_TARGETS",
    "IreeBackend",
    "compile_stablehlo",
    "Backend",
    "BackendInfo",
    "BackendUnavailable",
    "GraphError",
    "JaxBackend",
    "LoadedGraph",
    "enable_compilation_cache",
    "select_backend",
]
