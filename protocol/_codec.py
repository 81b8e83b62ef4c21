"""Encoding and decoding PCP messages; `_stream.MessageStream` carries them on trio streams.

A message on the wire is one Cap'n Proto `Envelope` in standard stream framing
(uint32 segment count - 1, uint32 segment sizes in words, padding to 8 bytes,
segments), followed by the raw payload of every tensor its header lists, in
order. Big tensors never pass through a Cap'n Proto `Data` field: building and
copying those ran at 0.17 GB/s, while raw payloads go to and from the socket
with no extra copy on the send side and one on the receive side.

Reading is written once, as `read_message`, against a tiny reader interface;
`MessageStream.receive` (`_stream`) feeds it from a trio stream, `decode` from a buffer.
Every length is checked against `Limits` before anything of that size is
allocated, and every failure caused by the peer's bytes is a `ProtocolError`.
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import capnp
import numpy as np

from ._chunked import THREADS
from ._dequantize import dequantize_chunked
from ._errors import (
    FrameTooLarge,
    MalformedMessage,
    VersionMismatch,
)
from ._messages import BODY_TYPES, Body, read, write
from ._overlap import DecodeBehind
from ._readers import BufferReader, run_sync
from ._schema import Envelope
from ._tensors import DTYPES, QUANTIZATIONS, TensorSpec, check_header, prepare

# One protocol version until a release: a peer of another version is refused at its
# first message (`VersionMismatch`), with advice on which side to upgrade.
PROTOCOL_VERSION = 6
SUPPORTED_VERSIONS: tuple[int, ...] = (PROTOCOL_VERSION,)
# awaited with (kind, payload bytes) before a message's tensor payload is read
PayloadGate = Callable[[str, int], Awaitable[None]]
# called with (body, tensor specs, frame bytes) once a header is read, before any payload byte is;
# raises a ProtocolError to refuse the message (e.g. tensors a kind may not carry)
HeaderCheck = Callable[[Body, tuple[TensorSpec, ...], int], None]

OFFLOAD_BYTES = 8 * 2**20  # (de)quantizing arrays above this (decoded) size runs in a thread
_PEER_CAPNP_ERRORS = (capnp.KjException, RuntimeError, ValueError, TypeError, OverflowError)


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts; all lengths are checked before allocating."""

    max_message_bytes: int = 64 * 2**20  # the Cap'n Proto part (segment table + segments)
    max_segments: int = 64
    max_tensors: int = 4096
    max_tensor_bytes: int = 2**33  # one payload
    max_total_tensor_bytes: int = 2**34  # all payloads of one message
    traversal_limit_words: int = 8 * 2**20
    nesting_limit: int = 32
    max_losses: int = 2**16  # entries of a roundResult's `losses`


B = TypeVar("B", bound=Body)


@dataclass
class Message:
    """One decoded message: its typed body (see `_messages`) plus its decoded tensors."""

    body: Body
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    version: int = PROTOCOL_VERSION
    wire_bytes: int = 0

    @property
    def kind(self) -> str:
        """The Envelope union member, e.g. "roundResult"."""
        return self.body.KIND

    def body_as(self, kind: type[B]) -> B:
        """The body, typed as the `kind` the receiver expects; MalformedMessage if it is
        another (a receiver that checked `message.kind` first never sees that)."""
        if not isinstance(self.body, kind):
            raise MalformedMessage(f"expected {kind.KIND}, got {self.kind}")
        return self.body


# --------------------------------------------------------------------------- encode


def encode(
    body: Body,
    tensors: Mapping[str, np.ndarray] | None = None,
    *,
    quantization: str = "none",
    block_size: int = 256,
    version: int = PROTOCOL_VERSION,
) -> list[bytes | memoryview]:
    """The buffers of one message, to be written in order: the framed envelope, then payloads.

    Unquantized payloads are zero-copy views of the arrays (which must stay
    unchanged until written). `quantization` applies to floating tensors only.
    The envelope carries `version` (tests stamp another to see it refused).
    ValueError for something that is not a message body, an unknown quantization or
    an unsendable tensor: those are bugs on the sending side, not protocol errors.
    """
    return list(
        encode_once(
            body, tensors, quantization=quantization, block_size=block_size, version=version
        ).buffers
    )


@dataclass(frozen=True)
class Encoded:
    """One message encoded once, to be written as it is to any number of streams.

    `MessageStream.send_encoded` writes `buffers` (the framed envelope, then the
    payloads); every peer gets the same bytes, made once: a fragment update to k
    workers is quantized once, not k times. `tensors` are the arrays it was made
    from, for observers (a trace counts them); `specs` describe the payloads.
    Unquantized payloads are views of those arrays: keep them unchanged until sent.
    """

    body: Body
    specs: tuple[TensorSpec, ...]
    buffers: tuple[bytes | memoryview, ...]
    tensors: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def wire_bytes(self) -> int:
        """Bytes this message takes on the wire."""
        return sum(memoryview(buffer).nbytes for buffer in self.buffers)

    def with_body(self, body: Body) -> Encoded:
        """The same tensors under another body (each worker's roundStart): a new envelope,
        the very same payload buffers, so a relay repeats them instead of carrying them again
        (`pcp_tui/contract/channels.py`)."""
        check_body(body, "none")
        return Encoded(
            body,
            self.specs,
            (_build_frame(body, list(self.specs), PROTOCOL_VERSION), *self.buffers[1:]),
            self.tensors,
        )

    @property
    def decoded_bytes(self) -> int:
        """Bytes of its tensors as decoded (float32 for a quantized float32 tensor)."""
        return sum(spec.count * DTYPES[spec.dtype].itemsize for spec in self.specs)


def encode_once(
    body: Body,
    tensors: Mapping[str, np.ndarray] | None = None,
    *,
    quantization: str = "none",
    block_size: int = 256,
    version: int = PROTOCOL_VERSION,
) -> Encoded:
    """`encode` as an `Encoded`: made once, sent to many (`MessageStream.send_encoded`)."""
    check_body(body, quantization)
    specs, payloads = [], []
    for name, array in (tensors or {}).items():
        check_name(name)
        spec, payload = prepare(name, array, quantization, block_size)
        specs.append(spec)
        payloads.append(payload)
    return assemble(body, specs, payloads, dict(tensors or {}), version)


def check_body(body: object, quantization: str) -> None:
    """ValueError unless `body` is a message body and `quantization` one the wire knows."""
    if not isinstance(body, Body) or BODY_TYPES.get(body.KIND) is not type(body):
        raise ValueError(f"encode takes a message body (protocol.Hello, ...), got {body!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose from {QUANTIZATIONS}")


def check_name(name: object) -> None:
    """ValueError unless `name` can name a tensor on the wire."""
    if not isinstance(name, str) or not 1 <= len(name) <= 256:
        raise ValueError(f"tensor names must be strings of 1..256 characters, got {name!r}")


def assemble(
    body: Body,
    specs: list[TensorSpec],
    payloads: list,
    tensors: Mapping[str, np.ndarray],
    version: int = PROTOCOL_VERSION,
) -> Encoded:
    """The `Encoded` message of `body` and prepared tensor payloads (`specs` in order)."""
    frame = _build_frame(body, specs, version)
    return Encoded(body, tuple(specs), (frame, *payloads), tensors)


def _build_frame(body: Body, specs: list[TensorSpec], version: int) -> bytes:
    try:
        envelope = Envelope.new_message()
        envelope.version = version
        write(envelope.init(body.KIND), body)
        headers = envelope.init("tensors", len(specs))
        for header, spec in zip(headers, specs, strict=True):
            for key, value in spec.to_wire().items():
                setattr(header, key, value)
        return envelope.to_bytes()
    except (capnp.KjException, AttributeError, TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"cannot encode {body.KIND}: {_describe(exc)}") from None


# --------------------------------------------------------------------------- decode


def decode(data: bytes | bytearray | memoryview, limits: Limits = Limits()) -> Message:  # noqa: B008
    """Decode exactly one whole message from `data`.

    Raises only ProtocolError subclasses on bad input: MalformedMessage for
    garbage, truncation or trailing bytes, FrameTooLarge beyond `limits`,
    VersionMismatch for a version this side does not speak. Tensors are copies.
    """
    reader = BufferReader(data)
    message = run_sync(read_message(reader, limits, offload=False, threads=THREADS))
    if reader.remaining:
        raise MalformedMessage(f"{reader.remaining} extra bytes after the message")
    return message


async def read_message(
    reader,
    limits: Limits,
    *,
    offload: bool,
    threads: int,
    before_payload: PayloadGate | None = None,
    check_header: HeaderCheck | None = None,
) -> Message:
    """Read one message through `reader`; the single implementation of the receive path.

    A big quantized tensor is decoded over up to `threads` threads
    (`dequantize_chunked`); with `offload`, in a thread while the next payload
    is read (`_overlap.DecodeBehind`).
    """
    frame, body, version, specs = await read_head(reader, limits, check_header)
    payload_bytes = sum(spec.payload_bytes for spec in specs)
    reader.expect(payload_bytes)
    if before_payload is not None and payload_bytes:
        await before_payload(body.KIND, payload_bytes)
    tensors = dict.fromkeys(spec.name for spec in specs)  # wire order, filled as decoded
    behind = DecodeBehind(tensors, threads)
    try:
        for spec in specs:
            payload = np.empty(spec.payload_bytes, np.uint8)
            await reader.read_into(payload.data)
            decoded_bytes = spec.count * DTYPES[spec.dtype].itemsize  # what sending offloads by
            if offload and spec.quantization != "none" and decoded_bytes > OFFLOAD_BYTES:
                await behind.start(payload, spec)  # decodes while the next payload arrives
            else:
                tensors[spec.name] = dequantize_chunked(payload, spec, threads)
        await behind.finish()
    finally:
        await behind.settle()
    wire_bytes = len(frame) + sum(spec.payload_bytes for spec in specs)
    decoded = {name: array for name, array in tensors.items() if array is not None}
    assert len(decoded) == len(tensors), "every tensor is decoded once `behind` has finished"
    return Message(body, decoded, version, wire_bytes)


async def read_head(
    reader, limits: Limits, check_header: HeaderCheck | None = None
) -> tuple[bytearray, Body, int, list[TensorSpec]]:
    """A message's framed envelope as it came, its body, version and checked tensor specs;
    its payloads (`TensorSpec.payload_bytes` each, in order) are the reader's next bytes.
    `read_message` goes on to decode them; a relay may pass them on as they are."""
    frame = await _read_frame(reader, limits)
    body, version, specs = _parse_frame(frame, limits)
    if check_header is not None:
        check_header(body, tuple(specs), len(frame))
    return frame, body, version, specs


async def _read_frame(reader, limits: Limits) -> bytearray:
    """The framed envelope (segment table + segments), sizes checked before the body is read."""
    first = await reader.read_exact(4)
    (segments_minus_one,) = struct.unpack("<I", first)
    segments = segments_minus_one + 1
    if segments > limits.max_segments:
        raise FrameTooLarge(f"frame claims {segments} segments; the limit is {limits.max_segments}")
    table_bytes = (4 + 4 * segments + 7) // 8 * 8
    rest = await reader.read_exact(table_bytes - 4)
    words = struct.unpack_from(f"<{segments}I", rest)
    frame_bytes = table_bytes + 8 * sum(words)
    if frame_bytes > limits.max_message_bytes:
        raise FrameTooLarge(
            f"frame claims {frame_bytes} bytes ({sum(words)} words); the limit is {limits.max_message_bytes}"
        )
    reader.expect(frame_bytes - table_bytes)
    frame = bytearray(frame_bytes)
    frame[:4], frame[4:table_bytes] = first, rest
    await reader.read_into(memoryview(frame)[table_bytes:])
    return frame


def _parse_frame(frame: bytearray, limits: Limits) -> tuple[Body, int, list[TensorSpec]]:
    """Typed body, version and checked tensor specs of a framed envelope."""
    try:
        with Envelope.from_bytes(
            frame,
            traversal_limit_in_words=limits.traversal_limit_words,
            nesting_limit=limits.nesting_limit,
        ) as envelope:
            version = envelope.version
            if version not in SUPPORTED_VERSIONS:  # before anything else: newer peers may add kinds
                raise VersionMismatch(_peer_versions(envelope, version), SUPPORTED_VERSIONS)
            kind = _kind(envelope)
            body = read(BODY_TYPES[kind], getattr(envelope, kind), limits, kind)
            raw_headers = _raw_headers(envelope, limits)
    except _PEER_CAPNP_ERRORS as exc:
        raise MalformedMessage(f"not a valid PCP envelope: {_describe(exc)}") from None
    return body, version, _check_headers(raw_headers, limits)


def _kind(envelope) -> str:
    try:
        return envelope.which()
    except capnp.KjException:
        raise MalformedMessage(
            "unknown message kind (a union member this version does not know)"
        ) from None


def _peer_versions(envelope, version: int) -> tuple[int, ...]:
    """What the peer says it speaks: hello/workerHello list it, other messages only carry theirs."""
    try:
        kind = envelope.which()
        if kind in ("hello", "workerHello"):
            return tuple(getattr(envelope, kind).supportedVersions) or (version,)
    except _PEER_CAPNP_ERRORS:
        pass
    return (version,)


def _raw_headers(envelope, limits: Limits) -> list[dict]:
    """Tensor headers as plain values, enums left as raw ints so unknown ones can be named."""
    headers = envelope.tensors
    if len(headers) > limits.max_tensors:
        raise FrameTooLarge(
            f"message carries {len(headers)} tensors; the limit is {limits.max_tensors}"
        )
    return [
        {
            "name": header.name,
            "dtype": header.dtype.raw,
            "shape": list(header.shape),
            "quantization": header.quantization.raw,
            "payloadBytes": header.payloadBytes,
            "blockSize": header.blockSize,
        }
        for header in headers
    ]


def _check_headers(raw_headers: list[dict], limits: Limits) -> list[TensorSpec]:
    specs, names, total = [], set(), 0
    for raw in raw_headers:
        spec = check_header(raw, limits)
        if spec.name in names:
            raise MalformedMessage(f"tensor name {spec.name!r} appears twice")
        names.add(spec.name)
        total += spec.payload_bytes
        if total > limits.max_total_tensor_bytes:
            raise FrameTooLarge(
                f"tensor payloads exceed {limits.max_total_tensor_bytes} bytes in one message"
            )
        specs.append(spec)
    return specs


def _describe(exc: BaseException) -> str:
    """A one-line reason: KjException text carries a C++ stack we do not want in error messages."""
    text = getattr(exc, "description", None) or str(exc)
    return text.split("\nstack:")[0].strip() or type(exc).__name__


# --------------------------------------------------------------------------- readers
# `read_message` needs three things from its source: `read_exact(n)` for the
# small segment table, `read_into(view)` to fill preallocated buffers, and
# `expect(n)` to refuse early what a bounded source can never supply.
