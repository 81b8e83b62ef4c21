"""One byte stream over several connections, for links where one TCP stream cannot keep up.

A TCP stream moves at most its window per round trip: 4 MiB at 100 ms is about
335 Mbit/s, however fast the link. `StripedStream` puts K connected streams
behind one `trio.abc.Stream`: the byte stream is cut into pieces of
`piece_bytes` at fixed offsets, and piece i travels on stream i mod K. Both
sides know K and the piece size, so no byte of framing is added and the codec
above it (`MessageStream`) does not change: the receiver reads piece i from
stream i mod K, in order, and each stream carries its pieces in order.

A send drives all K streams at once (one task each, for the duration of the
send), so K windows are in flight together. A failure of any one stream ends
the whole striped stream: the others are closed too, so the peer notices on
whichever stream it reads, and every later call raises BrokenResourceError. A
stream that is reset or closed while idle is found by `idle_problem`, which
peeks (never reads) at the streams no piece is due on; the connection that owns
the striped stream calls it now and then (`contract.connection`'s `alive`) and
ends it with `fail`. A connection cut silently (no reset, no close) shows nothing
until a send or a receive reaches it.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence

import trio

PIECE_BYTES = 256 * 1024  # both sides must agree; large enough to keep syscalls few
_RECEIVE_BYTES = 64 * 1024  # receive_some(None) reads at most this much


class StripedStream(trio.abc.Stream):
    """A byte stream over `streams` (all connected to the same peer, in the same order there).

    Use it as any trio stream. One task may send while another receives;
    concurrent sends (or receives) raise trio.BusyResourceError. A send that is
    cancelled part-way leaves the K streams out of step, so it breaks the stream.
    """

    def __init__(self, streams: Sequence[trio.abc.Stream], *, piece_bytes: int = PIECE_BYTES):
        if not streams:
            raise ValueError("a StripedStream needs at least one stream")
        if piece_bytes < 1:
            raise ValueError(f"piece_bytes must be positive, got {piece_bytes}")
        self.streams = tuple(streams)
        self.piece_bytes = piece_bytes
        self._sent = 0  # offset of the next byte to send in the striped byte stream
        self._received = 0  # offset of the next byte to receive
        self._sending = self._receiving = False
        self._closed = False
        self._broken: str | None = None

    def _where(self, offset: int) -> tuple[int, int]:
        """(stream index, bytes left in its piece) for the byte at `offset`."""
        piece, into = divmod(offset, self.piece_bytes)
        return piece % len(self.streams), self.piece_bytes - into

    def _check(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("this striped stream was closed")
        if self._broken is not None:
            raise trio.BrokenResourceError(f"striped stream broken earlier: {self._broken}")

    def _split(self, view: memoryview) -> list[list[memoryview]]:
        """`view` cut at piece boundaries, as the slices each stream sends, in order."""
        slices: list[list[memoryview]] = [[] for _ in self.streams]
        offset, done = self._sent, 0
        while done < view.nbytes:
            index, left = self._where(offset)
            size = min(left, view.nbytes - done)
            slices[index].append(view[done : done + size])
            offset, done = offset + size, done + size
        return slices

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send `data`, each stream its own pieces, all streams at once."""
        if self._sending:
            raise trio.BusyResourceError("another task is already sending on this stream")
        self._check()
        view = memoryview(data).cast("B")
        busy = [
            (stream, pieces)
            for stream, pieces in zip(self.streams, self._split(view), strict=True)
            if pieces
        ]
        failures: list[Exception] = []
        finished = False
        self._sending = True
        try:
            if len(busy) == 1:
                await _send_pieces(*busy[0], failures)
            else:
                async with trio.open_nursery() as nursery:
                    for stream, pieces in busy:
                        nursery.start_soon(_send_pieces, stream, pieces, failures, nursery)
            finished = not failures
        finally:
            self._sending = False
            if not finished:  # failed or cancelled part-way: the streams are out of step
                await self._break(failures[0] if failures else "a send was cancelled part-way")
        if failures:
            self._raise(failures[0])
        self._sent += view.nbytes

    async def wait_send_all_might_not_block(self) -> None:
        self._check()
        await self.streams[self._where(self._sent)[0]].wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        """Up to `max_bytes` from the stream that carries the next piece; b"" once any stream
        ends (the peer closed; a truncated message is then the reader's to report)."""
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this stream")
        self._check()
        if max_bytes is not None and max_bytes < 1:
            raise ValueError("max_bytes must be at least 1")
        index, left = self._where(self._received)
        self._receiving = True
        try:
            chunk = await self.streams[index].receive_some(min(max_bytes or _RECEIVE_BYTES, left))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            await self._break(exc)
            self._raise(exc)
        finally:
            self._receiving = False
        self._received += len(chunk)
        return chunk

    def idle_problem(self) -> str | None:
        """Why a connection that no piece is due on now has failed, if one has: reset, or
        closed by the peer; None while every one looks healthy. Peeks at each socket without
        waiting or reading, so it never competes with the task that receives."""
        if self._closed or self._broken is not None:
            return None
        due = self._where(self._received)[0]  # the receiving task watches that one itself
        for index, stream in enumerate(self.streams):
            fd = _socket_fd(stream) if index != due else None
            if fd is None:
                continue
            try:
                with socket.socket(fileno=os.dup(fd)) as probe:  # a dup: closing it closes no link
                    waiting = probe.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue  # open, and nothing sent ahead on it: healthy
            except OSError as exc:
                return f"connection {index + 1} of {len(self.streams)} failed while idle ({exc})"
            if not waiting:
                return f"connection {index + 1} of {len(self.streams)} was closed by the peer"
        return None

    async def fail(self, why: str) -> None:
        """End the striped stream for `why` (an `idle_problem`): every stream is closed, so a
        task waiting to receive or send gets BrokenResourceError naming it."""
        await self._break(why)

    async def _break(self, why: BaseException | str) -> None:
        """After a failure the streams are out of step: close them all now, so the peer's reads
        and writes on every one of them end too."""
        if self._broken is None and not self._closed:
            self._broken = str(why) or type(why).__name__
            for stream in self.streams:
                await trio.aclose_forcefully(stream)

    def _raise(self, exc: Exception) -> None:
        """A stream's failure as the striped stream's: closed here, or broken."""
        if self._closed:
            raise trio.ClosedResourceError("this striped stream was closed") from exc
        # the first failure, not this one: after it, another task's read ends with "another
        # task closed this fd", which says nothing of what went wrong
        why = self._broken or str(exc) or type(exc).__name__
        # not chained: a reader that reports `__cause__` (the codec does) names the striping
        raise trio.BrokenResourceError(
            f"one of the {len(self.streams)} striped connections failed: {why}"
        ) from None

    async def aclose(self) -> None:
        """Close every stream (concurrently: a TLS goodbye on one must not hold the others)."""
        self._closed = True
        async with trio.open_nursery() as nursery:
            for stream in self.streams:
                nursery.start_soon(_close_quietly, stream)


class Prefixed(trio.abc.Stream):
    """`stream` with bytes already read from it put back in front of what comes next."""

    def __init__(self, stream: trio.abc.Stream, first: bytes | bytearray):
        self.stream = stream
        self._first = first

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if not self._first:
            return await self.stream.receive_some(max_bytes)
        size = len(self._first) if max_bytes is None else max_bytes
        chunk, self._first = self._first[:size], self._first[size:]
        await trio.lowlevel.checkpoint()
        return chunk

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self.stream.aclose()


async def _send_pieces(
    stream: trio.abc.Stream,
    pieces: list[memoryview],
    failures: list[Exception],
    nursery: trio.Nursery | None = None,
) -> None:
    """Send one stream's pieces in order; a failure is recorded and stops the other streams."""
    try:
        for piece in pieces:
            await stream.send_all(piece)
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        failures.append(exc)
        if nursery is not None:
            nursery.cancel_scope.cancel()


def _socket_fd(stream: trio.abc.Stream) -> int | None:
    """The file descriptor of the TCP socket under `stream` (through TLS and `Prefixed`), or
    None for a stream that has none (an in-memory pair, say)."""
    current: trio.abc.Stream | None = stream
    for _ in range(4):  # a few wrappers deep at most
        if isinstance(current, trio.SocketStream):
            fd = current.socket.fileno()
            return fd if fd >= 0 else None
        current = getattr(current, "transport_stream", None) or getattr(current, "stream", None)
        if current is None:
            return None
    return None


async def _close_quietly(stream: trio.abc.Stream) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.aclose()
