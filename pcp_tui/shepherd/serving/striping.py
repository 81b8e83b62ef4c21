"""Striping a worker's session over several TCP connections (`--streams K`).

One TCP stream moves at most its window per round trip, so over a long fat
link a 500 MB exchange crawls on one connection. With K > 1 the welcome asks a
worker that speaks protocol 4 to open K - 1 more connections. Each one passes
admission like any connection (TLS, the join token) and then proves, with the
session key from the welcome, that it belongs to this worker's session: an
HMAC over the connection's own nonce, so another token holder cannot attach to
a session it did not open, and a captured proof is useless on a new connection.

The shepherd waits `--handshake-timeout` for all of them, then sends a second
welcome on the worker's first connection that settles it: `streams` = K, and
from the next byte on both sides speak through one `protocol.StripedStream`
over the K connections in index order; or `streams` = 1 (some did not arrive:
a firewall, a connection limit), and the session carries on over the first
connection alone, as without the option.
"""

from __future__ import annotations

import dataclasses
import logging

import trio

from pcp_tui import protocol
from pcp_tui.contract import auth
from pcp_tui.shepherd.serving.connection import Hello, WorkerLink

log = logging.getLogger(__name__)


class Attachments:
    """The extra connections one welcomed worker was asked to open, as they arrive."""

    def __init__(self, worker_id: str, session_key: bytes, wanted: int):
        self.worker_id, self.session_key, self.wanted = worker_id, session_key, wanted
        self.streams: dict[int, protocol.MessageStream] = {}
        self.complete = trio.Event()
        self.open = True

    def offer(self, hello: Hello, stream: protocol.MessageStream) -> str | None:
        """Take connection `hello.attach_index`; or why not (the caller refuses it)."""
        index = hello.attach_index
        if not self.open:
            return "the session stopped taking extra connections (too late)"
        if hello.worker_id != self.worker_id:
            return f"this session is worker {self.worker_id!r}'s, not {hello.worker_id!r}'s"
        if not 1 <= index <= self.wanted:
            return f"attach index {index} is not within 1..{self.wanted}"
        if index in self.streams:
            return f"connection {index} of this session is already attached"
        if not auth.verify_attach(
            self.session_key, hello.nonce, hello.worker_id, index, hello.attach_proof
        ):
            return "wrong session proof: only the welcomed connection's worker may attach"
        self.streams[index] = stream
        if len(self.streams) == self.wanted:
            self.complete.set()
        return None


async def welcome(
    link: WorkerLink, welcome: protocol.Welcome, wanted: int, *, wait: float = 10.0
) -> int:
    """Send `welcome`, striping the session over `wanted` connections if the worker attaches
    them within `wait` seconds; returns how many carry it now. Raises `LINK_ERRORS` as
    `link.send` does."""
    if wanted <= 1:
        await link.send(welcome)
        return 1
    key = auth.new_session_key()
    pending = link.attachments = Attachments(link.worker_id, key, wanted - 1)
    try:
        await link.send(dataclasses.replace(welcome, streams=wanted, session_key=key))
        with trio.move_on_after(wait):
            await pending.complete.wait()
        pending.open = False
        used = wanted if pending.complete.is_set() else 1
        await link.send(dataclasses.replace(welcome, streams=used))
        if used > 1:
            link.stream.stripe([pending.streams.pop(index) for index in range(1, wanted)])
            log.info("worker %d: session striped over %d connections", link.view.index, used)
        else:
            log.warning(
                "worker %d: %d of %d extra connections attached within %g s; "
                "continuing on one connection",
                link.view.index,
                len(pending.streams),
                wanted - 1,
                wait,
            )
        return used
    finally:
        link.attachments = None
        pending.open = False
        for stream in pending.streams.values():  # unused: a fallback, or the session ended
            await trio.aclose_forcefully(stream.stream)
