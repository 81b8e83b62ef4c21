"""PCP wire codec: Cap'n Proto envelopes with raw tensor payloads, framed on trio streams.

The schema (`pcp.capnp`) is the contract; this package is the only code that
turns it into bytes and back. It never imports `pcp_tui` or `backends`.

    stream = protocol.MessageStream(tcp_stream)
    await stream.send(protocol.RoundStart(round=3, inner_steps=50), params)
    message = await stream.receive()   # Message(body, tensors, version, wire_bytes); .kind
    stream.decode_threads = 4          # threads that decode one big quantized tensor (bit-equal)
    striped = protocol.MessageStream(protocol.StripedStream([tcp0, tcp1, tcp2, tcp3]))
    if isinstance(message.body, protocol.RoundResult): ...
    # one message to many peers, encoded once; with a change, params <- old + decoded change
    update = protocol.encode_change(body, params, old, quantization="int8Block")
    await stream.send_encoded(update)

Message bodies are frozen dataclasses (`_messages`), checked field by field at
decode; closed sets (`Phase`, `Platform`, `Runtime`, `BatchKind`, `ErrorCode`,
`Quantization`, `OverlapMerge`) are enums in the schema and here.
"""

from ._change import encode_change
from ._codec import (
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Encoded,
    HeaderCheck,
    Limits,
    Message,
    PayloadGate,
    decode,
    encode,
    encode_once,
    read_head,
)
from ._dequantize import dequantize_chunked
from ._errors import (
    ConnectionClosed,
    FrameTooLarge,
    MalformedMessage,
    NonFinite,
    ProtocolError,
    VersionMismatch,
)
from ._messages import (
    BODY_TYPES,
    ID_CHARS,
    REASON_CHARS,
    BackendInfo,
    BatchKind,
    Body,
    Error,
    ErrorCode,
    Fold,
    Folded,
    Fragment,
    FragmentUpdate,
    Goodbye,
    GraphInfo,
    Heartbeat,
    Hello,
    OverlapMerge,
    ParamLayout,
    Phase,
    Plan,
    Platform,
    Progress,
    Quantization,
    Ready,
    RelayFrame,
    RelayOp,
    RoundResult,
    RoundStart,
    Runtime,
    Sharding,
    ShardingMode,
    ShardingRule,
    Welcome,
    WorkerHello,
    WorkerStats,
)
from ._readers import StreamReader
from ._schema import ERROR_CODES, KINDS
from ._stream import MessageStream
from ._striped import PIECE_BYTES, Prefixed, StripedStream
from ._tensors import DTYPES, QUANTIZATIONS, TensorSpec

__all__ = [
    "BODY_TYPES",
    "DTYPES",
    "ERROR_CODES",
    "ID_CHARS",
    "KINDS",
    "PIECE_BYTES",
    "PROTOCOL_VERSION",
    "QUANTIZATIONS",
    "REASON_CHARS",
    "SUPPORTED_VERSIONS",
    "BackendInfo",
    "BatchKind",
    "Body",
    "ConnectionClosed",
    "Encoded",
    "Error",
    "ErrorCode",
    "GraphInfo",
    "Fragment",
    "Fold",
    "Folded",
    "FragmentUpdate",
    "Goodbye",
    "HeaderCheck",
    "Heartbeat",
    "Hello",
    "ParamLayout",
    "Phase",
    "Plan",
    "Prefixed",
    "Platform",
    "Runtime",
    "Progress",
    "Quantization",
    "Ready",
    "RelayFrame",
    "RelayOp",
    "RoundResult",
    "RoundStart",
    "Sharding",
    "StripedStream",
    "OverlapMerge",
    "ShardingMode",
    "ShardingRule",
    "StreamReader",
    "TensorSpec",
    "Welcome",
    "WorkerHello",
    "WorkerStats",
    "FrameTooLarge",
    "Limits",
    "MalformedMessage",
    "NonFinite",
    "Message",
    "MessageStream",
    "PayloadGate",
    "ProtocolError",
    "VersionMismatch",
    "decode",
    "encode",
    "encode_change",
    "dequantize_chunked",
    "encode_once",
    "read_head",
]
