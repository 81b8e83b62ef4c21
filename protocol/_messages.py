"""Typed PCP messages: one frozen dataclass per Envelope union member, and their closed sets.

Both sides build and read these objects, never dicts: a field a peer left out
reads as the schema's default, a value out of its closed set or beyond its
bound is refused at decode as a `MalformedMessage` naming the field. Python
names are the schema's in snake_case (`worker_id` is `workerId`); `KIND` is the
union member, so a message's kind follows from its type.

Bounds live on the fields (`_text`, `_items`, `_finite`), next to the type, so
there is one place to read what a peer may send. A list bound may name a
`Limits` attribute instead of a number: the receiver sets that one (a
shepherd caps `losses` at the round's inner steps).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._errors import MalformedMessage
from ._schema import SCHEMA

ID_CHARS = 128  # ids, names, versions, host names
REASON_CHARS = 4096  # human-readable reasons and error messages
TENSOR_NAME_CHARS = 256
MAX_SHARDING_RULES = 256  # rules of a plan's sharding section


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


# Python enum -> its schema enum; checked below so that the two never drift apart.
_SCHEMA_ENUMS: dict[type[enum.Enum], Any] = {
    Platform: SCHEMA.Platform,
    Runtime: SCHEMA.Runtime,
    Phase: SCHEMA.Phase,
    BatchKind: SCHEMA.BatchKind,
    ShardingMode: SCHEMA.ShardingMode,
    ParamLayout: SCHEMA.ParamLayout,
    Quantization: SCHEMA.Quantization,
    ErrorCode: SCHEMA.ErrorCode,
}
_BY_WIRE_VALUE: dict[type[enum.Enum], dict[int, enum.Enum]] = {}
for _python, _schema_enum in _SCHEMA_ENUMS.items():
    _enumerants = dict(_schema_enum.schema.enumerants)
    if set(_enumerants) != {member.value for member in _python}:
        raise RuntimeError(f"pcp.capnp and protocol.{_python.__name__} disagree; fix one of them")
    _BY_WIRE_VALUE[_python] = {number: _python(name) for name, number in _enumerants.items()}


def _text(chars: int = ID_CHARS, default: str = "") -> Any:
    return field(default=default, metadata={"chars": chars})


def _items(bound: int | str, *, chars: int = ID_CHARS, default: tuple = ()) -> Any:
    return field(default=default, metadata={"items": bound, "chars": chars})


def _finite(default: float = 0.0) -> Any:
    return field(default=default, metadata={"finite": True})


def _within(low: float, high: float, default: float) -> Any:
    """A finite number in [low, high]; anything else is refused at decode."""
    return field(default=default, metadata={"finite": True, "range": (low, high)})


class Body:
    """Base of every message body; `KIND` is its member of the Envelope union."""

    KIND: ClassVar[str]


@dataclass(frozen=True)
class BackendInfo:
    """What a worker runs on, as it reports it in its hello."""

    platform: Platform = Platform.CPU
    device_kind: str = _text()
    device_count: int = 0
    memory_bytes: int = 0
    jax_version: str = _text()
    runtime: Runtime = Runtime.XLA
    target: str = _text()


@dataclass(frozen=True)
class Hello(Body):
    """shepherd -> worker, first on a connection: versions and the join-token challenge."""

    KIND: ClassVar[str] = "hello"
    supported_versions: tuple[int, ...] = _items(16)
    nonce: bytes = field(default=b"", metadata={"bytes": 64})
    run_id: str = _text()
    software: str = _text()


@dataclass(frozen=True)
class WorkerHello(Body):
    """worker -> shepherd: who it is, what it runs on, and its proof of the token."""

    KIND: ClassVar[str] = "workerHello"
    supported_versions: tuple[int, ...] = _items(16)
    worker_id: str = _text()
    hostname: str = _text()
    backend: BackendInfo = field(default_factory=BackendInfo)
    proof: bytes = field(default=b"", metadata={"bytes": 64})
    software: str = _text()
    attach_index: int = 0  # > 0: an extra connection of a striped session (protocol 4)
    attach_proof: bytes = field(default=b"", metadata={"bytes": 64})


@dataclass(frozen=True)
class Welcome(Body):
    """shepherd -> worker: admitted; its index (and so its shard) and the heartbeat interval."""

    KIND: ClassVar[str] = "welcome"
    worker_index: int = 0
    run_id: str = _text()
    heartbeat_seconds: float = _finite(2.0)
    streams: int = 0  # > 1: connections to stripe the session over (protocol 4; 0, 1: one)
    session_key: bytes = field(default=b"", metadata={"bytes": 64})


@dataclass(frozen=True)
class GraphInfo:
    """One exported graph in a plan: its name, platforms, and the tensor carrying its bytes."""

    name: str = _text()
    platforms: tuple[Platform, ...] = _items(16)
    tensor: str = _text(TENSOR_NAME_CHARS)


@dataclass(frozen=True)
class ShardingRule:
    """Parameters whose names match `pattern` (fnmatch) get `layout`."""

    pattern: str = _text(TENSOR_NAME_CHARS)
    layout: ParamLayout = ParamLayout.REPLICATED


@dataclass(frozen=True)
class Sharding:
    """How a worker with several devices places parameters: the first matching rule, else `mode`."""

    mode: ShardingMode = ShardingMode.DATA
    rules: tuple[ShardingRule, ...] = _items(MAX_SHARDING_RULES)


@dataclass(frozen=True)
class Fragment:
    """Streaming DiLoCo: the tensors of one fragment, synced together."""

    tensors: tuple[str, ...] = _items("max_tensors", chars=TENSOR_NAME_CHARS)


@dataclass(frozen=True)
class Plan(Body):
    """shepherd -> worker: everything a worker needs to train, no model code.

    Graph bytes and the data shard ride as tensors named here. The rules across
    fields (token arithmetic, which tensors a result carries) are in
    `pcp_tui.contract.plan`, which both sides use.
    """

    KIND: ClassVar[str] = "plan"
    run_id: str = _text()
    model_name: str = _text()
    param_count: int = 0
    graphs: tuple[GraphInfo, ...] = _items(8)
    param_names: tuple[str, ...] = _items("max_tensors", chars=TENSOR_NAME_CHARS)
    inner_steps: int = 0
    chunk_steps: int = 0
    batch_size: int = 0
    seq_len: int = 0
    seed: int = 0
    shard_tensor: str = _text(TENSOR_NAME_CHARS)
    shard_fingerprint: str = _text()
    worker_slot: int = 0
    compression: Quantization = Quantization.NONE
    batch_kind: BatchKind = BatchKind.WINDOWS
    data_tensors: tuple[str, ...] = _items(64, chars=TENSOR_NAME_CHARS)
    tokens_per_row: int = 0
    sharding: Sharding = field(default_factory=Sharding)
    fragments: tuple[Fragment, ...] = _items("max_tensors")  # empty: plain DiLoCo
    overlap_steps: int = 0
    mix_alpha: float = _finite(0.0)


@dataclass(frozen=True)
class Ready(Body):
    """worker -> shepherd: the plan's graphs compiled; rounds may start."""

    KIND: ClassVar[str] = "ready"
    compile_seconds: float = _finite()
    platform: Platform = Platform.CPU


@dataclass(frozen=True)
class RoundStart(Body):
    """shepherd -> worker; the global parameters ride as tensors."""

    KIND: ClassVar[str] = "roundStart"
    round: int = 0
    inner_steps: int = 0
    continued: bool = False  # streaming: no tensors; go on from the worker's own parameters


@dataclass(frozen=True)
class WorkerStats:
    """What a worker measures about itself, sent with its progress (protocol 3).

    Zero memory means the worker could not measure it; a gpu_utilization of -1
    means not measured (no NVML, or not an NVIDIA device).
    """

    steps: int = 0
    tokens: int = 0
    memory_in_use_bytes: int = 0
    memory_peak_bytes: int = 0
    memory_limit_bytes: int = 0
    gpu_utilization: float = _within(-1.0, 1.0, -1.0)


@dataclass(frozen=True)
class Progress(Body):
    """worker -> shepherd, a few per second at most: where its round is, and its statistics."""

    KIND: ClassVar[str] = "progress"
    round: int = 0
    step: int = 0
    total_steps: int = 0
    loss: float = _finite()
    tokens_per_second: float = _finite()
    phase: Phase = Phase.COMPILING
    stats: WorkerStats = field(default_factory=WorkerStats)


@dataclass(frozen=True)
class RoundResult(Body):
    """worker -> shepherd; the pseudo-gradient (global - local) rides as tensors.

    `losses` is bounded by the receiver's `Limits.max_losses`; whether each loss
    is finite is the result screen's call (a refused result, not a broken peer).
    """

    KIND: ClassVar[str] = "roundResult"
    round: int = 0
    tokens: int = 0
    losses: tuple[float, ...] = _items("max_losses")
    compute_seconds: float = _finite()
    inner_steps: int = 0


@dataclass(frozen=True)
class FragmentResult(Body):
    """Streaming, worker -> shepherd: one fragment's pseudo-gradient rides as tensors.

    `tokens` is what the pseudo-gradient trained on (its weight in the mean);
    `losses`, `compute_seconds` and `inner_steps` cover the steps since the
    worker's previous fragmentResult, so a run's results count each step once.
    """

    KIND: ClassVar[str] = "fragmentResult"
    round: int = 0
    fragment: int = 0
    tokens: int = 0
    losses: tuple[float, ...] = _items("max_losses")
    compute_seconds: float = _finite()
    inner_steps: int = 0


@dataclass(frozen=True)
class FragmentUpdate(Body):
    """Streaming, shepherd -> worker: one fragment's new global value rides as tensors."""

    KIND: ClassVar[str] = "fragmentUpdate"
    round: int = 0
    fragment: int = 0
    change: bool = False  # tensors: the change since the fragment's last global value


@dataclass(frozen=True)
class Heartbeat(Body):
    """Either way, while nothing else is sent: the peer is alive."""

    KIND: ClassVar[str] = "heartbeat"
    sent_at: float = _finite()


@dataclass(frozen=True)
class Error(Body):
    """Why the sender is about to close the connection (or refused one result: badResult)."""

    KIND: ClassVar[str] = "error"
    code: ErrorCode = ErrorCode.UNKNOWN
    message: str = _text(REASON_CHARS)


@dataclass(frozen=True)
class Goodbye(Body):
    """The sender closes the connection on purpose; `reason` is for people.

    `resumable` (shepherd -> worker): the run stopped before its end and its checkpoint
    lets `--resume` continue it, so the worker reconnects rather than exits.
    """

    KIND: ClassVar[str] = "goodbye"
    reason: str = _text(REASON_CHARS)
    resumable: bool = False


# --------------------------------------------------------------------------- wire


def camel(name: str) -> str:
    """The schema's name of a Python field: `worker_id` -> `workerId`."""
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def write(builder, value) -> None:
    """Set every field of the dataclass `value` on the Cap'n Proto struct `builder`."""
    hints = _hints(type(value))
    for item in dataclasses.fields(value):
        wire, data, hint = camel(item.name), getattr(value, item.name), hints[item.name]
        if dataclasses.is_dataclass(hint):
            write(builder.init(wire), data)
        elif typing.get_origin(hint) is tuple:
            element = typing.get_args(hint)[0]
            items = builder.init(wire, len(data))
            for index, entry in enumerate(data):
                if dataclasses.is_dataclass(element):
                    write(items[index], entry)
                else:
                    items[index] = _scalar(element, entry)
        else:
            setattr(builder, wire, _scalar(hint, data))


def _scalar(hint, data):
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(data).value  # also accepts the member's value, refuses anything else
    return data


def read(cls: type, reader, limits, where: str):
    """The dataclass `cls` from a Cap'n Proto struct reader, every bound checked."""
    hints = _hints(cls)
    values = {}
    for item in dataclasses.fields(cls):
        wire = camel(item.name)
        values[item.name] = _read_value(
            hints[item.name], getattr(reader, wire), item.metadata, limits, f"{where}.{wire}"
        )
    return cls(**values)


def _read_value(hint, raw, meta, limits, where: str):
    if dataclasses.is_dataclass(hint):
        return read(hint, raw, limits, where)
    if typing.get_origin(hint) is tuple:
        bound = meta["items"]
        cap = getattr(limits, bound) if isinstance(bound, str) else bound
        if len(raw) > cap:
            raise MalformedMessage(f"{where} has {len(raw)} entries; the limit is {cap}")
        element = typing.get_args(hint)[0]
        item_meta = {"chars": meta.get("chars", ID_CHARS)}
        return tuple(
            _read_value(element, entry, item_meta, limits, f"{where}[{index}]")
            for index, entry in enumerate(raw)
        )
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        member = _BY_WIRE_VALUE[hint].get(raw.raw)
        if member is None:
            raise MalformedMessage(f"{where} is {raw.raw}, not a known {hint.__name__}")
        return member
    if hint is str:
        return _checked_text(raw, meta.get("chars", ID_CHARS), where)
    if hint is bytes:
        data = bytes(raw)
        if len(data) > meta["bytes"]:
            raise MalformedMessage(f"{where} is {len(data)} bytes; the limit is {meta['bytes']}")
        return data
    if hint is bool:
        return bool(raw)
    if hint is float:
        number = float(raw)
        if meta.get("finite") and not math.isfinite(number):
            raise MalformedMessage(f"{where} is {number}; it must be a finite number")
        low, high = meta.get("range", (-math.inf, math.inf))
        if not low <= number <= high:
            raise MalformedMessage(f"{where} is {number}; it must be within [{low}, {high}]")
        return number
    return int(raw)


def _checked_text(raw, chars: int, where: str) -> str:
    text = str(raw)
    if len(text) > chars:
        raise MalformedMessage(f"{where} is {len(text)} characters; the limit is {chars}")
    return text


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
        FragmentResult,
        FragmentUpdate,
    )
}
