"""Typed PCP messages: one frozen dataclass per Envelope union member, and their closed sets.

Both sides build and read these objects, never dicts: a field a peer left out
reads as the schema's default, a value out of its closed set or beyond its
bound is refused at decode as a `MalformedMessage` naming the field. Python
names are the schema's in snake_case (`worker_id` is `workerId`); `KIND` is the
union member, so a message's kind follows from its type.

This module is the index of the message layer; each part lives by family:

- `_fields`: the bounds a field may carry (`_text`, `_items`, `_finite`, `_within`) and `Body`
- `_enums`: the closed sets (`Platform`, `Phase`, `ErrorCode`, ...), checked against the schema
- `_session`: handshake, heartbeat, error and goodbye (`Hello`, `WorkerHello`, `Welcome`, ...)
- `_plan`: the plan a worker trains from (`Plan`, `GraphInfo`, `Sharding`, `Fragment`) and `Ready`
- `_rounds`: a round's start, progress and result, plain and streaming (`RoundStart`, ...)
- `_structs`: dataclass <-> Cap'n Proto struct (`write`, `read`, every bound checked)

A new message is a dataclass in its family's module plus an entry in `BODY_TYPES`.
"""

from __future__ import annotations

from ._enums import (
    BatchKind,
    ErrorCode,
    OverlapMerge,
    ParamLayout,
    Phase,
    Platform,
    Quantization,
    RelayOp,
    Runtime,
    ShardingMode,
)
from ._fields import ID_CHARS, MAX_SHARDING_RULES, REASON_CHARS, TENSOR_NAME_CHARS, Body
from ._plan import Fragment, GraphInfo, Plan, Ready, Sharding, ShardingRule
from ._rounds import (
    Fold,
    Folded,
    FragmentUpdate,
    Progress,
    RoundResult,
    RoundStart,
    WorkerStats,
)
from ._session import (
    BackendInfo,
    Error,
    Goodbye,
    Heartbeat,
    Hello,
    RelayFrame,
    Welcome,
    WorkerHello,
)
from ._structs import camel, read, write

BODY_TYPES: dict[str, type] = {
    cls.KIND: cls
    for cls in (
        Hello,
        WorkerHello,
        Welcome,
        Plan,
        Ready,
        RoundStart,
        Progress,
        RoundResult,
        Heartbeat,
        Error,
        Goodbye,
        FragmentUpdate,
        RelayFrame,
        Fold,
        Folded,
    )
}

__all__ = [
    "BODY_TYPES",
    "ID_CHARS",
    "MAX_SHARDING_RULES",
    "REASON_CHARS",
    "TENSOR_NAME_CHARS",
    "BackendInfo",
    "BatchKind",
    "Body",
    "Error",
    "ErrorCode",
    "Fold",
    "Folded",
    "Fragment",
    "FragmentUpdate",
    "Goodbye",
    "GraphInfo",
    "Heartbeat",
    "Hello",
    "ParamLayout",
    "Phase",
    "Plan",
    "Platform",
    "Progress",
    "Quantization",
    "Ready",
    "RelayFrame",
    "RelayOp",
    "RoundResult",
    "RoundStart",
    "Runtime",
    "Sharding",
    "OverlapMerge",
    "ShardingMode",
    "ShardingRule",
    "Welcome",
    "WorkerHello",
    "WorkerStats",
    "camel",
    "read",
    "write",
]
