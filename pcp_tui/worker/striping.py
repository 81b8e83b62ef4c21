"""The worker's side of a striped session (the shepherd's `--streams K`).

A welcome with `streams` = K > 1 asks for K - 1 more connections. The worker
opens them all at once, each through the shepherd's front door like its first
(TLS, the join token) plus a proof made with the welcome's session key, then
waits on the first connection for the shepherd's second welcome, which
settles it: K, and the session continues over one `protocol.StripedStream`; or
1, and it continues on the first connection alone. A worker that cannot open
them (a firewall, a connection limit) says why in its log and trains anyway.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from pcp_tui import protocol
from pcp_tui.contract.connection import LINK_ERRORS, ConnectionEnded, ConnectionLost, expect
from pcp_tui.contract.tls import shown_fingerprint

ATTACH_SECONDS = 10.0  # for each extra connection, from connect to its hello sent
AT_ONCE = 4  # extra connections in their handshake at once (the shepherd caps those per address)
MAX_STREAMS = 64  # a welcome asking for more is not from a sane shepherd
log = logging.getLogger(__name__)


class Dialer(Protocol):
    """What `attach` needs of the worker (`worker.client.Worker` is one): a connection to
    the shepherd opened by `deadline`, and the worker's hello for a connection's challenge."""

    async def _open(self, deadline: float) -> trio.abc.Stream: ...

    def _hello(
        self, nonce: bytes, *, channel: str, attach_index: int = 0, session_key: bytes = b""
    ) -> protocol.WorkerHello: ...


async def attach(worker: Dialer, main: protocol.MessageStream, welcome: protocol.Welcome) -> int:
    """Open the extra connections `welcome` asks for, then stripe `main` over them if the
    shepherd's second welcome says so; returns the connections that carry the session."""
    wanted = welcome.streams
    if wanted > MAX_STREAMS or not welcome.session_key:
        raise protocol.MalformedMessage(
            f"the welcome asks for {wanted} connections (at most {MAX_STREAMS}, with a session key)"
        )
    extra: dict[int, protocol.MessageStream] = {}
    problems: list[str] = []
    limiter = trio.CapacityLimiter(AT_ONCE)
    try:
        async with trio.open_nursery() as nursery:
            for index in range(1, wanted):
                nursery.start_soon(
                    _attach_one, worker, index, welcome.session_key, extra, problems, limiter
                )
        settled = (await expect(main, "welcome")).body
        assert isinstance(settled, protocol.Welcome), "expect checked its kind"
        if settled.streams <= 1:
            why = "; ".join(sorted(problems)) or "the shepherd did not get them all in time"
            log.warning("continuing on one connection: %s", why)
            return 1
        if settled.streams != wanted or len(extra) != wanted - 1:
            raise ConnectionLost(
                f"the shepherd striped the session over {settled.streams} connections, "
                f"but this worker attached {len(extra) + 1} of {wanted}"
            )
        main.stripe([extra.pop(index) for index in range(1, wanted)])
        log.info("session striped over %d connections", wanted)
        return wanted
    finally:
        for stream in extra.values():  # unused: a fallback, or the session ended
            await trio.aclose_forcefully(stream.stream)


async def _attach_one(
    worker: Dialer,
    index: int,
    session_key: bytes,
    extra: dict[int, protocol.MessageStream],
    problems: list[str],
    limiter: trio.CapacityLimiter,
) -> None:
    """Open extra connection `index` and present the session proof; record why not if it fails."""
    stream = None
    try:
        async with limiter:
            with trio.fail_after(ATTACH_SECONDS):
                deadline = trio.current_time() + ATTACH_SECONDS
                stream = protocol.MessageStream(await worker._open(deadline))
                hello = (await expect(stream, "hello")).body
                assert isinstance(hello, protocol.Hello), "expect checked its kind"
                await stream.send(
                    worker._hello(
                        hello.nonce,
                        channel=shown_fingerprint(stream.stream),
                        attach_index=index,
                        session_key=session_key,
                    )
                )
        extra[index] = stream
    except (ConnectionEnded, trio.TooSlowError, *LINK_ERRORS) as exc:
        problems.append(f"connection {index + 1}: {exc or 'timed out'}")
        if stream is not None:
            await trio.aclose_forcefully(stream.stream)
