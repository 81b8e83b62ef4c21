"""The closed sets of PCP messages, as Python enums checked against the schema's enums.

A value is its schema enumerant's name (`Quantization.INT8_BLOCK` is
`int8Block`). At import the two sets are compared, so `pcp.capnp` and this file
never drift apart; `BY_WIRE_VALUE` maps a wire number back to its member for
`_structs.read`, which refuses a number no member has.
"""

from __future__ import annotations

import enum
from typing import Any

from ._schema import SCHEMA


class Platform(enum.StrEnum):
    """Where a worker runs its graphs; the platforms a graph is exported for."""

    CPU = "cpu"
    CUDA = "cuda"
    ROCM = "rocm"
    METAL = "metal"
    VULKAN = "vulkan"


class Runtime(enum.StrEnum):
    """What compiles and runs a worker's graphs: XLA through JAX, or IREE from their StableHLO."""

    XLA = "xla"
    IREE = "iree"


class Phase(enum.StrEnum):
    """What a worker says it is doing; the only states its progress can show."""

    COMPILING = "compiling"
    TRAINING = "training"
    SYNCING = "syncing"
    IDLE = "idle"


class BatchKind(enum.StrEnum):
    """How a worker draws batches from its shard: LM windows of tokens, or rows of arrays."""

    WINDOWS = "windows"
    ROWS = "rows"


class OverlapMerge(enum.StrEnum):
    """How a Streaming DiLoCo worker merges a fragment's new global value after τ overlap steps."""

    MIX = "mix"  # the paper's: α local + (1 − α) global; the overlap's progress is mixed away
    CARRY = "carry"  # local + (1 − α)(global − local at the send): keeps the overlap's steps (5)


class ShardingMode(enum.StrEnum):
    """Where a multi-device worker puts parameters no sharding rule names."""

    DATA = "data"  # a copy on every device (data parallel)
    FSDP = "fsdp"  # matrices split across the devices, vectors copied


class ParamLayout(enum.StrEnum):
    """How a multi-device worker places one parameter (and its optimizer state)."""

    REPLICATED = "replicated"
    FSDP = "fsdp"


class Quantization(enum.StrEnum):
    """How tensor payloads are packed (see `_tensors`); a plan's `compression` is one."""

    NONE = "none"
    BFLOAT16 = "bfloat16"
    INT8_BLOCK = "int8Block"
    INT4_BLOCK = "int4Block"  # protocol version 4


class ErrorCode(enum.StrEnum):
    """Why a side is about to close a connection (the `error` message's code)."""

    UNKNOWN = "unknown"
    VERSION_MISMATCH = "versionMismatch"
    AUTH_FAILED = "authFailed"
    MALFORMED = "malformed"
    TOO_LARGE = "tooLarge"
    BAD_RESULT = "badResult"
    INTERNAL = "internal"
    SHUTTING_DOWN = "shuttingDown"
    TIMEOUT = "timeout"
    BUSY = "busy"
    UNSUPPORTED_BACKEND = "unsupportedBackend"
    ID_IN_USE = "idInUse"  # another live connection holds this worker id
    UNAVAILABLE = "unavailable"  # a relay that cannot carry a worker now: the next address


class RelayOp(enum.StrEnum):
    """What a relay frame does to its channel (`RelayFrame`, `pcp_tui/contract/channels.py`)."""

    OPEN = "open"
    DATA = "data"
    CLOSE = "close"
    CREDIT = "credit"
    KEEP = "keep"
    REPEAT = "repeat"
    FORGET = "forget"


# Python enum -> its schema enum; checked below so that the two never drift apart.
_SCHEMA_ENUMS: dict[type[enum.Enum], Any] = {
    Platform: SCHEMA.Platform,
    Runtime: SCHEMA.Runtime,
    Phase: SCHEMA.Phase,
    BatchKind: SCHEMA.BatchKind,
    OverlapMerge: SCHEMA.OverlapMerge,
    ShardingMode: SCHEMA.ShardingMode,
    ParamLayout: SCHEMA.ParamLayout,
    Quantization: SCHEMA.Quantization,
    ErrorCode: SCHEMA.ErrorCode,
    RelayOp: SCHEMA.RelayOp,
}
BY_WIRE_VALUE: dict[type[enum.Enum], dict[int, enum.Enum]] = {}
for _python, _schema_enum in _SCHEMA_ENUMS.items():
    _enumerants = dict(_schema_enum.schema.enumerants)
    if set(_enumerants) != {member.value for member in _python}:
        raise RuntimeError(f"pcp.capnp and protocol.{_python.__name__} disagree; fix one of them")
    BY_WIRE_VALUE[_python] = {number: _python(name) for name, number in _enumerants.items()}
