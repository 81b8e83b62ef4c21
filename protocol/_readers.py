"""The two readers `_codec.read_message` reads a frame through: a buffer or a trio stream.

`read_message` is written once against their small interface (`expect`,
`read_exact`, `read_into`): `decode` runs it over a `BufferReader` without an
event loop (`run_sync`), `MessageStream.receive` over a `StreamReader`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import trio

from ._errors import ConnectionClosed, MalformedMessage

_RECEIVE_CHUNK = 64 * 1024  # read-ahead for segment tables and small frames
_RECEIVE_BULK = 4 * 2**20  # largest receive_some when filling a payload
_YIELD_EVERY = 16 * 2**20  # a long payload read lets other tasks run this often


class BufferReader:
    """Reads a message out of a buffer; running out of bytes means a truncated message."""

    def __init__(self, data: bytes | bytearray | memoryview):
        self._view = memoryview(data).cast("B")
        self._position = 0

    @property
    def remaining(self) -> int:
        return self._view.nbytes - self._position

    def expect(self, nbytes: int) -> None:
        if nbytes > self.remaining:
            raise MalformedMessage(
                f"message truncated: {nbytes} more bytes needed, {self.remaining} left"
            )

    async def read_exact(self, nbytes: int) -> bytes:
        self.expect(nbytes)
        self._position += nbytes
        return bytes(self._view[self._position - nbytes : self._position])

    async def read_into(self, out: memoryview) -> None:
        self.expect(out.nbytes)
        self._position += out.nbytes
        out[:] = self._view[self._position - out.nbytes : self._position]


class StreamReader:
    """Reads frames off a trio stream, keeping bytes that arrived ahead of the current read.

    On a trio.SocketStream, payloads are read straight into their final buffer
    (one copy, kernel to array); other streams go through `receive_some`. `frame_consumed` counts bytes taken for the
    current frame, which tells a clean close between frames from a truncation.
    """

    def __init__(self, stream: trio.abc.Stream, clock: Callable[[], float] = time.monotonic):
        self._stream = stream
        self._clock = clock
        self._socket: trio.socket.SocketType | None = None
        if isinstance(stream, trio.SocketStream) and hasattr(os, "readv"):
            self._socket = stream.socket
        self._pending = bytearray()
        self.frame_consumed = 0
        self.frame_started: float | None = None  # when the current frame's first bytes were taken
        self.last_activity = clock()  # when bytes last arrived, mid-frame included

    def start_frame(self) -> None:
        self.frame_consumed = 0
        self.frame_started = None

    def expect(self, nbytes: int) -> None:
        """A stream cannot know what is coming: `Limits` bound what the caller allocates."""

    async def read_exact(self, nbytes: int) -> bytes:
        while len(self._pending) < nbytes:
            chunk = await self._receive_some(_RECEIVE_CHUNK)
            if not chunk:
                self._closed(nbytes - len(self._pending))
            self._pending += chunk
        data = bytes(self._pending[:nbytes])
        del self._pending[:nbytes]
        if self.frame_started is None:
            self.frame_started = self._clock()
        self.frame_consumed += nbytes
        return data

    async def read_into(self, out: memoryview) -> None:
        filled = min(len(self._pending), out.nbytes)
        out[:filled] = self._pending[:filled]
        del self._pending[:filled]
        self.frame_consumed += filled
        since_yield = 0
        while filled < out.nbytes:
            got = await self._receive_into(out[filled:])
            if not got:
                self._closed(out.nbytes - filled)
            filled += got
            self.frame_consumed += got
            since_yield += got
            if since_yield >= _YIELD_EVERY:
                since_yield = 0
                await trio.lowlevel.checkpoint()

    async def _receive_some(self, max_bytes: int) -> bytes | bytearray:
        try:
            chunk = await self._stream.receive_some(max_bytes)
        except trio.BrokenResourceError as exc:
            raise ConnectionClosed(f"connection lost: {exc.__cause__ or exc}") from exc
        self.last_activity = self._clock()
        return chunk

    async def _receive_into(self, out: memoryview) -> int:
        """Receive up to `out.nbytes` into `out`; 0 at end of stream.

        On a socket this reads the non-blocking fd directly (os.readv) and only
        waits through trio when the kernel buffer is empty: trio's own
        `recv_into` reschedules after every call, which is costly on fast links.
        Other streams pay one extra copy from `receive_some`.
        """
        if self._socket is None:
            chunk = await self._receive_some(min(out.nbytes, _RECEIVE_BULK))
            out[: len(chunk)] = chunk
            return len(chunk)
        while True:
            fd = self._socket.fileno()
            if fd < 0:
                raise trio.ClosedResourceError("this MessageStream's socket was closed")
            try:
                got = os.readv(fd, [out])
                self.last_activity = self._clock()
                return got
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self._socket)
            except OSError as exc:
                raise ConnectionClosed(f"connection lost: {exc}") from exc

    def _closed(self, missing: int) -> None:
        if self.frame_consumed == 0 and not self._pending:
            raise ConnectionClosed("peer closed the connection")
        raise ConnectionClosed(
            f"peer closed the connection mid-frame: message truncated, {missing} more bytes expected"
        )


def run_sync(coroutine):
    """Run a coroutine that never suspends (reading from a buffer) without an event loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("decoding from a buffer unexpectedly waited for I/O")
