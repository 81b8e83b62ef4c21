"""`MessageStream`: whole PCP messages sent and received over a trio byte stream.

The bytes are `_codec`'s (`encode`, and `read_message`, the one receive path
`decode` uses too); this module adds what a live connection needs on top: a
send lock, one receiver at a time, byte counts and liveness for watchdogs, a
gate before big payloads, and striping a conversation over several
connections (`stripe`, see `_striped`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import trio

from ._chunked import THREADS
from ._codec import (
    OFFLOAD_BYTES,
    Encoded,
    HeaderCheck,
    Limits,
    Message,
    PayloadGate,
    encode_once,
    read_message,
)
from ._errors import ConnectionClosed, ProtocolError
from ._messages import REASON_CHARS, Body, Error, ErrorCode
from ._readers import StreamReader
from ._striped import PIECE_BYTES, Prefixed, StripedStream

_SMALL_BUFFER = 64 * 1024  # buffers below this are joined into one send_all


class MessageStream:
    """Sends and receives whole PCP messages over a trio byte stream (usually TCP).

    One task may send while another receives. Sends are serialised by a lock;
    concurrent receives raise trio.BusyResourceError. A receive that fails or
    is cancelled part-way through a frame leaves the stream out of sync, so
    every later receive raises ConnectionClosed: close it and reconnect.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        limits: Limits = Limits(),  # noqa: B008
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`clock`: what `last_activity` and `partial_message` read (a virtual one in tests)."""
        self.stream = stream
        self.limits = limits
        self.clock = clock
        # what this connection's peer may send, checked before payloads (see HeaderCheck)
        self.check_header: HeaderCheck | None = None
        # called with ("sent" | "received", message) after each whole message (a trace, say)
        self.observer: Callable[[str, Message], None] | None = None
        # threads that decode one big quantized tensor, in chunks (`_dequantize`): the same
        # bits on any number; 1 keeps a receive to one thread besides the event loop's
        self.decode_threads = THREADS
        self.bytes_sent = 0
        self.bytes_received = 0
        self._reader = StreamReader(stream, clock)
        self._send_lock = trio.Lock()
        self._receiving = False
        self._broken: str | None = None

    async def send(
        self,
        body: Body,
        tensors=None,
        *,
        quantization: str = "none",
        block_size: int = 256,
    ) -> int:
        """Encode and write one message; returns the bytes written.

        trio.BrokenResourceError / ClosedResourceError pass through if the
        connection is gone; ValueError for a body or tensor that cannot be encoded.
        """

        def build():
            return encode_once(body, tensors, quantization=quantization, block_size=block_size)

        big = quantization != "none" and _tensor_bytes(tensors) > OFFLOAD_BYTES
        return await self.send_encoded(await trio.to_thread.run_sync(build) if big else build())

    async def send_encoded(self, message: Encoded) -> int:
        """Write a message encoded beforehand (`encode_once`, `encode_change`); the bytes written.

        The same `Encoded` may go to any number of streams: its buffers are only read.
        Errors as `send`.
        """
        total = message.wire_bytes
        async with self._send_lock:
            # a transport that takes a message's buffers at once (a relay's channel) frames
            # them together; any other is written buffer by buffer
            send_parts = getattr(self.stream, "send_parts", None)
            if send_parts is not None:
                await send_parts(list(_coalesce(message.buffers)))
                self.bytes_sent += total
            else:
                for chunk in _coalesce(message.buffers):
                    await self.stream.send_all(chunk)
                    self.bytes_sent += memoryview(chunk).nbytes
        if self.observer is not None:
            self.observer("sent", Message(message.body, dict(message.tensors), wire_bytes=total))
        return total

    async def receive(self, *, before_payload: PayloadGate | None = None) -> Message:
        """Read the next whole message; raises ProtocolError subclasses on bad or missing bytes.

        `before_payload(kind, nbytes)`, if given, is awaited once the message's
        header has been read and checked and before its `nbytes` (> 0) of tensor
        payload are. A receiver of many big messages uses it to bound how many it
        holds in memory at once: while it waits, the sender waits in TCP flow
        control and nothing is allocated for the payload.
        """
        if self._broken:
            raise ConnectionClosed(f"stream is unusable after an earlier failure: {self._broken}")
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this MessageStream")
        self._receiving = True
        reader = self._reader
        reader.start_frame()
        try:
            message = await read_message(
                reader,
                self.limits,
                offload=True,
                threads=self.decode_threads,
                before_payload=before_payload,
                check_header=self.check_header,
            )
        except BaseException as exc:
            if isinstance(exc, ProtocolError) or reader.frame_consumed:
                self._broken = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise
        finally:
            self.bytes_received += reader.frame_consumed
            self._receiving = False
        if self.observer is not None:
            self.observer("received", message)
        return message

    def stripe(self, extra: list[MessageStream], *, piece_bytes: int = PIECE_BYTES) -> None:
        """From the next byte on, carry this conversation over this stream's transport and the
        transports of `extra` (in that order), as one `StripedStream`; both sides call it at
        the same point of the conversation (after the handshake says so).

        Bytes already read ahead on any of them stay first in line on their connection.
        Call it between messages, with no send or receive in progress on any of them.
        """
        streams = [self, *extra]
        if any(stream._receiving or stream.sending for stream in streams):
            raise RuntimeError("stripe() while a message is being sent or received")
        transports = [stream._unread() for stream in streams]
        activity = self._reader.last_activity
        self.stream = StripedStream(transports, piece_bytes=piece_bytes)
        self._reader = StreamReader(self.stream, self.clock)
        self._reader.last_activity = activity

    def _unread(self) -> trio.abc.Stream:
        """The transport, with any bytes the reader took ahead of the last message put back."""
        pending = bytes(self._reader._pending)
        return Prefixed(self.stream, pending) if pending else self.stream

    @property
    def sending(self) -> bool:
        """Whether a message is being written now (e.g. a long upload)."""
        return self._send_lock.locked()

    @property
    def last_activity(self) -> float:
        """The clock's time when bytes last arrived, also in the middle of a message.

        A peer sending a 500 MB message over a slow link is silent in whole
        messages for minutes, but not in bytes: liveness checks read this.
        """
        return self._reader.last_activity

    @property
    def partial_message(self) -> tuple[float, int] | None:
        """(the clock's time when its first bytes were taken, bytes taken so far) of the
        message being received; None between messages.

        Lets a receiver require a minimum rate of a message in progress: a peer
        that sends one byte a second is active, but never finishes.
        """
        if not self._receiving or self._reader.frame_started is None:
            return None
        return self._reader.frame_started, self._reader.frame_consumed

    async def send_error(self, code: ErrorCode | str, message: str) -> None:
        """Best effort: tell the peer why we are about to close; silent if it is already gone."""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.send(Error(ErrorCode(code), message[:REASON_CHARS]))

    async def aclose(self) -> None:
        await self.stream.aclose()


def _tensor_bytes(tensors) -> int:
    return sum(np.asarray(array).nbytes for array in (tensors or {}).values())


def _coalesce(buffers: Iterable[bytes | memoryview]) -> Iterator[bytes | memoryview]:
    """Join runs of small buffers into one write; hand big ones over as they are (no copy)."""
    small: list[bytes | memoryview] = []
    for buffer in buffers:
        if memoryview(buffer).nbytes < _SMALL_BUFFER:
            small.append(buffer)
            continue
        if small:
            yield b"".join(small)
            small = []
        yield buffer
    if small:
        yield b"".join(small)
