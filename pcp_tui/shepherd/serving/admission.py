"""The shepherd's front door: everything that happens before a peer is admitted.

An unauthenticated peer gets little: a bounded number of connections per
address and in total, a deadline for the whole handshake (TLS included, so a
peer that trickles bytes is dropped as surely as one that says nothing), and
tight message limits so it cannot make the shepherd allocate big buffers.
Refusals are logged, but at most a few per address per minute: a flood of bad
handshakes becomes one summary line, not a flooded terminal.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from pcp_tui import protocol
from pcp_tui.config import ConfigError, RunConfig
from pcp_tui.config.service import NetworkConfig
from pcp_tui.contract.connection import LINK_ERRORS, Refused
from pcp_tui.contract.tls import ServerTLS
from pcp_tui.contract.trace import MessageTrace
from pcp_tui.shepherd.run.events import PeerRefused, WorkerKeysRead
from pcp_tui.shepherd.run.state import RunState
from pcp_tui.shepherd.serving.connection import Hello, handshake
from pcp_tui.shepherd.serving.worker_keys import WorkerKeys

# Before the token is proven: a hello is a few hundred bytes and carries no tensor.
PRE_AUTH_LIMITS = protocol.Limits(
    max_message_bytes=64 * 1024,
    max_segments=4,
    max_tensors=0,
    max_tensor_bytes=0,
    max_total_tensor_bytes=0,
    traversal_limit_words=8 * 1024,
    nesting_limit=16,
)
# After it: the codec's defaults, sized for graphs, shards and parameters.
ADMITTED_LIMITS = protocol.Limits()
# A TLS connection opens with a handshake record (content type 22); anything else is not TLS.
_TLS_HANDSHAKE_RECORD = b"\x16"
_FIRST_BYTES = 16 * 1024
log = logging.getLogger(__name__)  # every refusal, for --log-level info (events are rate-limited)

# Heartbeats a connection may miss before a newcomer with its id (a worker's, a relay's) is
# told to retry (busy) rather than refused for good (idInUse): a live twin misses none.
MISSED_BEATS = 2
TLS_ONLY = (
    "this shepherd speaks TLS only: join with the --tls-fingerprint/--tls-ca from its join command"
)


class RefusalLog:
    """Emits "refused" events, at most `per_host` per address (and `total` overall) per window.

    Beyond that, refusals are counted and summarised once per window, e.g.
    "refused 1.2.3.4: … and 120 more in the last 60 s (last: bad token)".
    Memory is bounded too: past `max_hosts` addresses, the rest share one tally.
    """

    def __init__(
        self,
        state: RunState,
        *,
        per_host: int = 5,
        total: int = 50,
        window: float = 60.0,
        max_hosts: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._state = state
        self._per_host, self._total, self._window, self._max_hosts = (
            per_host,
            total,
            window,
            max_hosts,
        )
        self._clock = clock
        self._window_start = clock()
        self._shown: collections.Counter[str] = collections.Counter()
        self._suppressed: dict[str, list] = {}  # host -> [count, last reason]

    def refused(
        self, host: str, peer: str, reason: str, *, verb: str = "refused", code: str = ""
    ) -> None:
        self._roll()
        if self._shown[host] < self._per_host and sum(self._shown.values()) < self._total:
            self._shown[host] += 1
            log.info("%s %s: %s", verb, peer, reason)
            self._state.emit(PeerRefused(f"{verb} {peer}: {reason}", peer=peer, code=code))
            return
        log.debug("%s %s: %s (not shown: too many refusals)", verb, peer, reason)
        if host not in self._suppressed and len(self._suppressed) >= self._max_hosts:
            host = "other addresses"
        tally = self._suppressed.setdefault(host, [0, ""])
        tally[0] += 1
        tally[1] = reason

    def flush(self) -> None:
        """Emit one summary per address whose refusals were not shown one by one."""
        for host, (count, reason) in self._suppressed.items():
            self._state.emit(
                PeerRefused(
                    f"refused {host}: … and {count} more in the last {self._window:.0f} s (last: {reason})",
                    peer=host,
                    suppressed=count,
                )
            )
        self._suppressed.clear()
        self._shown.clear()
        self._window_start = self._clock()

    def _roll(self) -> None:
        if self._clock() - self._window_start >= self._window:
            self.flush()

    async def run(self) -> None:
        """Flush once per window until cancelled, and a last time at the end of the run."""
        try:
            while True:
                await trio.sleep(self._window)
                self._roll()
        finally:
            self.flush()


def held(
    what: str, who: str, holder: str, silent: float, network: NetworkConfig, *, paused: bool = False
) -> tuple[protocol.ErrorCode, str]:
    """Why a newcomer may not take `what` (a worker's id, a relay's name) that a connection from
    `holder` holds, silent for `silent` s: while it is heard from (or `paused`: busy on its own
    behalf), for good (idInUse: a twin); once its heartbeats stopped, retryable (busy): likely
    this very `who`, restarted (a reboot, a partition) while its old connection hangs
    half-open, which is dropped once its silence reaches --heartbeat-timeout."""
    timeout = network.heartbeat_timeout
    if not paused and MISSED_BEATS * network.heartbeat_seconds < silent:
        return protocol.ErrorCode.BUSY, (
            f"{what} is still held by an earlier connection from {holder}, silent for "
            f"{silent:.0f} s; it is let in once that connection has been silent for "
            f"{timeout:g} s (--heartbeat-timeout): retrying"
        )
    return protocol.ErrorCode.ID_IN_USE, (
        f"{what} is in use by a live connection from {holder}; start this {who} with another "
        f"--id, or stop the other one (a reconnect is let in once the old connection has been "
        f"silent for {timeout:g} s)"
    )


@dataclass
class Admitted:
    stream: protocol.MessageStream
    hello: Hello
    peer: str


class Admission:
    """Runs the pre-authentication part of every connection for the shepherd."""

    def __init__(
        self,
        state: RunState,
        *,
        token: str,
        run_id: str,
        tls: ServerTLS | None = None,
        timeout: float = 10.0,
        max_per_host: int = 8,
        max_pending: int = 64,
        refusals: RefusalLog | None = None,
        trace: MessageTrace | None = None,
        worker_keys: WorkerKeys | None = None,
    ):
        self._token, self._run_id, self._tls = token, run_id, tls
        self.worker_keys = worker_keys  # --worker-keys: each worker signs with a key issued to it
        self.trace = trace  # --trace: every message of every connection, from its hello
        self.timeout, self.max_per_host, self.max_pending = timeout, max_per_host, max_pending
        self.refusals = refusals or RefusalLog(state)
        self._pending: collections.Counter[str] = collections.Counter()

    @classmethod
    def for_run(
        cls, config: RunConfig, state: RunState, *, run_id: str, tls: ServerTLS | None
    ) -> Admission:
        """The admission `config.security` sets (limits, deadline), with --trace if asked for."""
        security = config.security
        if not security.token:  # the launchers always set one (--token, $PCP_TOKEN or random)
            raise ConfigError("the shepherd needs a join token: pass --token or set $PCP_TOKEN")
        return cls(
            state,
            token=security.token,
            run_id=run_id,
            tls=tls,
            timeout=security.handshake_timeout,
            max_per_host=security.max_handshakes_per_host,
            max_pending=security.max_handshakes,
            trace=_open_trace(config.operator.trace),
            worker_keys=(
                WorkerKeys(
                    security.worker_keys,
                    on_reread=lambda message: state.emit(WorkerKeysRead(message)),
                    channel=tls.fingerprint if tls is not None else "",
                )
                if security.worker_keys
                else None
            ),
        )

    @property
    def pending(self) -> int:
        return sum(self._pending.values())

    async def admit(
        self,
        raw: trio.abc.Stream,
        *,
        peer: str | None = None,
        tls: bool = True,
        channel: str | None = None,
    ) -> Admitted | None:
        """Handshake with a fresh connection; None (connection closed, refusal logged) if it fails.

        `peer`: who it is, where the stream cannot say (a relay's channel: the relay's name
        and the worker's address); `tls`: False for a relay's channel (inside the relay's
        link, TLS or not); `channel`: the certificate the worker saw, where not this
        shepherd's (a relay's).
        """
        peer = peer or peer_name(raw)
        host = peer.rpartition(":")[0] or peer
        if self._pending[host] >= self.max_per_host or self.pending >= self.max_pending:
            busy = (
                f"{self._pending[host]} from this address"
                if self._pending[host] >= self.max_per_host
                else f"{self.pending} in all"
            )
            why = f"too many unfinished handshakes ({busy})"
            self.refusals.refused(host, peer, why, verb="closed", code="busy")
            if not tls:  # a relay's channel: told, so its worker retries the relay (`Busy`)
                await _tell_busy(raw, f"the shepherd has {why}: retrying")
            await trio.aclose_forcefully(raw)
            return None
        self._pending[host] += 1
        transport: trio.abc.Stream = raw
        deadline = trio.current_time() + self.timeout
        try:
            if self._tls is not None and tls:
                opened = await self._open_tls(self._tls, raw, deadline)
                if isinstance(opened, str):
                    await self._refuse_plain_peer(raw, host, peer, opened)
                    return None
                transport = opened
            with trio.fail_at(deadline):
                stream = protocol.MessageStream(transport, PRE_AUTH_LIMITS, clock=trio.current_time)
                stream.observer = self.trace.observer(peer) if self.trace else None
                hello = await handshake(
                    stream,
                    token=self._token,
                    run_id=self._run_id,
                    keys=self.worker_keys,
                    channel=channel,
                )
        except Refused as exc:
            self.refusals.refused(host, peer, exc.reason, code=exc.code)
            await _close(transport)
            return None
        except (
            trio.TooSlowError,
            protocol.ProtocolError,
            trio.BrokenResourceError,
            trio.ClosedResourceError,
        ) as exc:
            self.refusals.refused(
                host,
                peer,
                _drop_reason(
                    exc, self.timeout, transport is not raw or self._tls is None or not tls
                ),
                verb="dropped",
            )
            if isinstance(exc, protocol.ProtocolError) and not isinstance(
                exc, protocol.ConnectionClosed
            ):
                with trio.move_on_after(1):  # say why, if the peer still listens
                    await stream.send_error(exc.code, str(exc))
            await _close(transport)
            return None
        finally:
            self._pending[host] -= 1
            if not self._pending[host]:
                del self._pending[host]
        stream.limits = ADMITTED_LIMITS
        return Admitted(stream, hello, peer)

    async def _open_tls(
        self, tls: ServerTLS, raw: trio.abc.Stream, deadline: float
    ) -> trio.abc.Stream | str:
        """The TLS stream; or, when the peer does not open with a TLS record, why not.

        A worker started without --tls-* sends nothing: it waits for the
        shepherd's hello. Silence until the deadline is therefore answered
        like plain bytes are, in plain PCP, so that worker learns what to do.
        """
        first = None
        with trio.move_on_at(deadline):
            first = await raw.receive_some(_FIRST_BYTES)
        if first is None:
            return f"sent nothing within {self.timeout:g} s, as a worker without TLS does"
        if first[:1] != _TLS_HANDSHAKE_RECORD:
            return "the peer speaks plain PCP" if first else "closed before the TLS handshake"
        with trio.fail_at(deadline):
            return await tls.accept(protocol.Prefixed(raw, first))

    async def _refuse_plain_peer(
        self, raw: trio.abc.Stream, host: str, peer: str, why: str
    ) -> None:
        self.refusals.refused(
            host,
            peer,
            f"TLS handshake failed ({why}); told it to join with --tls-fingerprint or --tls-ca",
            verb="dropped",
            code="authFailed",
        )
        with trio.move_on_after(1):  # final for the worker: its handshake ends on authFailed
            await protocol.MessageStream(raw, PRE_AUTH_LIMITS).send_error("authFailed", TLS_ONLY)
        await _close(raw)


def _drop_reason(exc: BaseException, timeout: float, past_tls: bool) -> str:
    if isinstance(exc, trio.TooSlowError):
        return f"handshake not finished within {timeout:g} s"
    if not past_tls:
        return f"TLS handshake failed ({exc.__cause__ or exc})"
    return f"during handshake: {exc}"


async def _close(stream: trio.abc.Stream) -> None:
    """Close without waiting on the peer (a TLS close_notify to a full buffer would)."""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await trio.aclose_forcefully(stream)


async def _tell_busy(stream: trio.abc.Stream, why: str) -> None:
    """Say `busy` on a relay's channel (its link's frames are cheap; a flood of sockets is
    closed unanswered): the worker's relay is up, and the worker tries it again rather than
    the shepherd itself, which is as busy."""
    with trio.move_on_after(1.0):
        with contextlib.suppress(*LINK_ERRORS):
            await protocol.MessageStream(stream).send_error(protocol.ErrorCode.BUSY, why)


def peer_name(stream: trio.abc.Stream) -> str:
    socket = getattr(stream, "socket", None)  # a SocketStream has one; other streams, none
    if socket is None:
        return "unknown peer"
    try:
        host, port = socket.getpeername()[:2]
    except OSError:
        return "unknown peer"
    return f"{host}:{port}"


def network_of(peer: str) -> str:
    """The network one share of weight belongs to under `--weight-per address`: a peer's
    IPv4 address, or its IPv6 /64 (what one subscriber is given); `peer` is `peer_name`'s
    "host:port" (for a relayed worker, its relay's: what a relay reports is its word)."""
    host = peer.rpartition(":")[0] or peer
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # "unknown peer": a group of its own kind
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def _open_trace(path: str | None) -> MessageTrace | None:
    """The --trace file, opened for the run; ConfigError (what to fix) if it cannot be written."""
    if not path:
        return None
    try:
        return MessageTrace(path)
    except OSError as exc:
        raise ConfigError(f"cannot write --trace {path} ({exc.strerror or exc})") from None
