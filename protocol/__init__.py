"""PCP wire codec: Cap'n Proto envelopes with raw tensor payloads, framed on trio streams.

The schema (`pcp.capnp`) is the contract; this package is the only code that
turns it into bytes and back. It never imports `pcp_tui` or `backends`.

    stream = protocol.MessageStream(tcp_stream)
    await stream.send("roundStart", {"round": 3, "innerSteps": 50}, params)
    message = await stream.receive()   # Message(kind, body, tensors, version, wire_bytes)
"""

from ._codec import (
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Limits,
    Message,
    MessageStream,
    PayloadGate,
    decode,
    encode,
)
from ._errors import (
    ConnectionClosed,
    FrameTooLarge,
    MalformedMessage,
    ProtocolError,
    VersionMismatch,
)
from ._schema import ERROR_CODES, KINDS
from ._tensors import DTYPES, QUANTIZATIONS

__all__ = [
    "DTYPES",
    "ERROR_CODES",
    "KINDS",
    "PROTOCOL_VERSION",
    "QUANTIZATIONS",
    "SUPPORTED_VERSIONS",
    "ConnectionClosed",
    "FrameTooLarge",
    "Limits",
    "MalformedMessage",
    "Message",
    "MessageStream",
    "PayloadGate",
    "ProtocolError",
    "VersionMismatch",
    "decode",
    "encode",
]
