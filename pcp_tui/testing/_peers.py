"""Hand-written protocol peers that join a real shepherd over TCP: what hostile-peer tests
share (a raw connection, a hello with the token's real proof, a peer ready for round 1)."""

from __future__ import annotations

import socket

import trio

from pcp_tui import protocol
from pcp_tui.contract import auth
from pcp_tui.testing._inprocess import heartbeat_until_hung_up

#: what a peer's connection may end with when the shepherd hangs up on it
PEER_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, protocol.ProtocolError)


async def join_as(port: int, worker_id: str, token: str = "test-token"):
    """Handshake as `worker_id` with the token's real proof; (stream, the shepherd's answer)."""
    stream = protocol.MessageStream(await trio.open_tcp_stream("127.0.0.1", port))
    hello = (await stream.receive()).body
    assert isinstance(hello, protocol.Hello), f"expected the shepherd's hello, got {hello!r}"
    await stream.send(
        protocol.WorkerHello(
            supported_versions=protocol.SUPPORTED_VERSIONS,
            worker_id=worker_id,
            proof=auth.proof(token, hello.nonce, worker_id),
            backend=protocol.BackendInfo(platform=protocol.Platform.CPU),
        )
    )
    return stream, await stream.receive()


async def connect_peer(port: int, receive_buffer: int = 0) -> tuple[protocol.MessageStream, bytes]:
    """A connection past the shepherd's hello: (the stream, this connection's nonce)."""
    sock = trio.socket.socket()
    if receive_buffer:  # before connect: the window the shepherd may fill
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    await sock.connect(("127.0.0.1", port))
    stream = protocol.MessageStream(trio.SocketStream(sock))
    hello = (await stream.receive()).body
    assert isinstance(hello, protocol.Hello), f"expected the shepherd's hello, got {hello!r}"
    return stream, hello.nonce


def peer_hello(
    worker_id: str, nonce: bytes, token: str = "test-token", **fields
) -> protocol.WorkerHello:
    """A CPU worker's hello for `nonce` with the token's real proof; `fields` override."""
    fields.setdefault("supported_versions", protocol.SUPPORTED_VERSIONS)
    return protocol.WorkerHello(
        worker_id=worker_id,
        proof=auth.proof(token, nonce, worker_id),
        backend=protocol.BackendInfo(platform=protocol.Platform.CPU),
        **fields,
    )


async def planned(stream: protocol.MessageStream) -> protocol.Message:
    """The welcome, then the plan, returned. A shepherd of --streams N asks a worker to
    stripe in its welcome; this peer opens no extra connections, so a second welcome
    (once the shepherd has waited for them) settles on this one alone, before the plan."""
    welcome = await stream.receive()
    assert welcome.kind == "welcome", welcome.kind
    plan = await stream.receive()
    if plan.kind == "welcome" and welcome.body_as(protocol.Welcome).streams > 1:
        plan = await stream.receive()
    assert plan.kind == "plan", plan.kind
    return plan


async def ready_peer(port: int, worker_id: str) -> protocol.MessageStream:
    """A peer past welcome and plan that said it is ready (on one connection)."""
    stream, nonce = await connect_peer(port)
    await stream.send(peer_hello(worker_id, nonce))
    await planned(stream)
    await stream.send(protocol.Ready(compile_seconds=0.1))
    return stream


async def round_start(stream: protocol.MessageStream) -> protocol.Message:
    """Heartbeats (alive to the watchdog while the honest worker compiles) until round 1 starts."""
    async with trio.open_nursery() as alive:
        alive.start_soon(heartbeat_until_hung_up, stream)
        start = await stream.receive()
        while start.kind != "roundStart":
            start = await stream.receive()
        alive.cancel_scope.cancel()
    return start
