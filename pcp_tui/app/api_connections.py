"""The operator API's connections: hypercorn serves each, at most `MAX_CONNECTIONS` at once.

hypercorn's own `serve` accepts every connection it can and bounds each only by
its `read_timeout`, so clients from many hosts holding connections open could
take the shepherd's file descriptors, which its workers' connections need too.
Here the API's listener is served by this module's accept loop: a connection
beyond the cap is answered `503 Service Unavailable` (with `Retry-After`) at
once and closed, without reading a byte of it; one within the cap is handed to
hypercorn's connection server (`hypercorn.trio.tcp_server.TCPServer`, the class
its `serve` uses for each connection), so HTTP parsing, keep-alive and timeouts
stay hypercorn's.
"""

from __future__ import annotations

import contextlib
import socket

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext

MAX_CONNECTIONS = 64  # open API connections at once; more are answered 503 and closed
BUSY_SECONDS = 1.0  # how long a 503 may take to write (a TLS handshake first) before the close
_BUSY_BODY = b'{"error": "busy: too many open connections to the operator API; retry"}\n'
BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"content-type: application/json\r\n"
    b"content-length: " + str(len(_BUSY_BODY)).encode() + b"\r\n"
    b"retry-after: 1\r\n"
    b"connection: close\r\n\r\n" + _BUSY_BODY
)


class CappedServer:
    """Serve an ASGI app on a listening socket with hypercorn, `limit` connections at once."""

    def __init__(self, app, config: HypercornConfig, limit: int = MAX_CONNECTIONS):
        self.app, self.config, self.limit = ASGIWrapper(app), config, limit
        self.open = 0  # connections being served now
        self.turned_away = 0  # connections answered 503
        self._context = WorkerContext(None)

    async def serve(self, sock: socket.socket, closed: trio.Event) -> None:
        """Accept on `sock` until `closed` is set; connections in flight then get
        hypercorn's `graceful_timeout` to finish."""
        listener: trio.abc.Listener[trio.abc.Stream]
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        ssl_context = self.config.create_ssl_context()
        if ssl_context is not None:
            listener = trio.SSLListener(listener, ssl_context, https_compatible=True)
        async with listener, trio.open_nursery() as connections:
            async with trio.open_nursery() as accepting:
                accepting.start_soon(_cancel_when_set, closed, accepting.cancel_scope)
                await trio.serve_listeners(
                    self._connection, [listener], handler_nursery=connections
                )
            await self._context.terminated.set()  # hypercorn closes idle keep-alive connections
            connections.cancel_scope.deadline = trio.current_time() + self.config.graceful_timeout

    async def _connection(self, stream: trio.abc.Stream) -> None:
        if self.open >= self.limit:
            self.turned_away += 1
            with trio.move_on_after(BUSY_SECONDS), contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(BUSY_RESPONSE)
            await trio.aclose_forcefully(stream)
            return
        self.open += 1
        counted = _Counted(stream, self._release)
        try:
            # hypercorn annotates the stream as SSLStream, but serves a plain one too (it reads
            # `.socket` when `.transport_stream` is absent): the annotation is narrower than the code
            await TCPServer(self.app, self.config, self._context, {}, counted)  # type: ignore[arg-type]
        finally:
            counted.release()

    def _release(self) -> None:
        self.open -= 1


class _Counted:
    """A connection's stream that gives its slot back as soon as its client is gone.

    hypercorn's connection task outlives a client that closed (it waits out
    `keep_alive_timeout`, 5 s), so counting tasks would turn clients away for a
    connection that no longer exists: the slot is released at end of file, a
    read that failed or was cancelled (the read timeout), or the close.
    Everything else is the stream's own.
    """

    def __init__(self, stream: trio.abc.Stream, release):
        self._stream, self._release = stream, release

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        try:
            data = await self._stream.receive_some(max_bytes)
        except BaseException:
            self.release()
            raise
        if not data:
            self.release()
        return data

    async def aclose(self) -> None:
        self.release()
        await self._stream.aclose()


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
