"""Where graphs run: one small interface, run by XLA (through JAX) or by IREE."""

from ._base import (
    PLATFORMS,
    RUNTIMES,
    Axis,
    Backend,
    BackendInfo,
    BackendUnavailable,
    GraphError,
    LoadedGraph,
    MemoryUse,
    signature,
)
from ._iree import SOURCE_PLATFORM, IreeBackend, compile_stablehlo
from ._iree import TARGETS as IREE_TARGETS
from ._jax import JaxBackend, enable_compilation_cache
from ._select import select_backend
from ._vouch import CUDNN_ATTENTION_CALLS, UntrustedGraph, allowed_calls

__all__ = [
    "CUDNN_ATTENTION_CALLS",
    "PLATFORMS",
    "RUNTIMES",
    "SOURCE_PLATFORM",
    "IREE_TARGETS",
    "IreeBackend",
    "compile_stablehlo",
    "Axis",
    "Backend",
    "BackendInfo",
    "BackendUnavailable",
    "GraphError",
    "JaxBackend",
    "LoadedGraph",
    "MemoryUse",
    "enable_compilation_cache",
    "select_backend",
    "signature",
    "UntrustedGraph",
    "allowed_calls",
]
