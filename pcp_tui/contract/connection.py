"""One admitted connection, as both sides hold it: sends, receives, liveness, goodbye.

The shepherd (`pcp_tui.shepherd.serving.connection.WorkerLink`, one per worker) and the
worker (one per session with its shepherd) speak the same conversation after the
handshake, so they share one class for it:

- `send`: from any task (heartbeat, progress, round, result): the stream's one
  send lock keeps a message's bytes from interleaving with another's;
- `receive`: enforces `contract.RECEIVES` from each message's header, before any
  payload byte is read: a peer that speaks out of turn ends its connection;
- `alive`: heartbeats on the run's interval (the shepherd's config; the worker
  takes it from the welcome) and a watchdog that ends the connection after the
  silence timeout. Silence is counted in bytes, not messages: a 500 MB result
  arriving over a slow link for minutes is not silence;
- `close`: a best-effort goodbye (and the error that ended the connection, if the
  peer should hear it), bounded in time, then the socket closes.

The error taxonomy is the same for both sides (`ConnectionEnded` and its three
kinds): `Refused` is final (bad token, wrong version, unusable plan or backend:
retrying gets the same answer), `ConnectionLost` is not (the link broke, went
silent or the peer broke the protocol: the worker reconnects, the shepherd hands
the worker's shard on), `RunOver` is the shepherd's goodbye. A goodbye that says the
run can be resumed is `RunResumable`, a ConnectionLost: the worker comes back.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Literal

import trio

from pcp_tui import protocol
from pcp_tui.contract.plan import Stage, out_of_turn

# What a send or receive raises when the peer broke the protocol or the link is gone.
LINK_ERRORS = (protocol.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError)
CLOSE_SECONDS = 2.0  # a goodbye waits at most this long for a peer that does not read
WATCHDOG_POLLS = 4  # the watchdog looks this many times per timeout (at least once a second)

log = logging.getLogger(__name__)

# Error codes the peer will send again on every reconnect: stop and tell the person why.
_FINAL_ERRORS = frozenset(
    {
        protocol.ErrorCode.AUTH_FAILED,
        protocol.ErrorCode.VERSION_MISMATCH,
        protocol.ErrorCode.UNSUPPORTED_BACKEND,
    }
)


class ConnectionEnded(Exception):
    """Why a connection ended; `reason` is the sentence to show a person."""

    def __init__(self, reason: str, *, code: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.code = code  # a protocol.ErrorCode value, or "" when there is none to name


class Refused(ConnectionEnded):
    """Final: the peer was turned away (or turned us away) for good; do not retry.

    `code` is the protocol error code sent or received (authFailed, versionMismatch...).
    """


class IdInUse(Refused):
    """Another live connection holds this worker's id.

    Final for a worker that was never admitted (two workers started with one --id);
    a worker that was admitted before retries, as the live connection is likely its
    own, cut off, until the shepherd notices it is silent.
    """


class ConnectionLost(ConnectionEnded):
    """The link broke, went silent, or the peer broke the protocol: reconnect.

    `code`, when set, is what this side tells the peer on close (malformed, timeout...).
    """


class Busy(ConnectionLost):
    """The peer answered and asked to be tried again later (`busy`): a worker retries the same
    address. Behind a relay that is the shepherd's answer, and the next address (the
    shepherd itself) would be as busy: 1,000 workers that dialled their relays at once
    met the shepherd's handshake cap and fell over to it directly, and the tree was gone."""


class RunOver(ConnectionEnded):
    """The shepherd said goodbye: the run is finished."""


class RunResumable(ConnectionLost):
    """The shepherd stopped before the run's end and a `--resume` can continue it: reconnect.

    A ConnectionLost, so the worker's reconnect loop (bounded by --give-up-after)
    takes it: the restarted shepherd is welcome to the same worker.
    """


def silence_timeout(heartbeat_seconds: float) -> float:
    """How long a worker (or relay) waits on a silent shepherd before it counts the link as
    lost: ten of the run's heartbeats, at least 10 s (one late beat is not a dead link)."""
    return max(10.0, 10 * heartbeat_seconds)


def shown(text: str) -> str:
    """A peer's text, safe to print: control characters escaped as Python writes them.

    A peer's texts reach the operator's terminal (a worker's in the shepherd's headless
    log, a shepherd's errors and goodbyes in the worker's last line) and files; raw, an
    escape sequence could clear the screen or retitle it, and a newline could forge a
    whole log line. The ESC character becomes the four characters
    `\\x1b`, a newline the two characters `\\n`.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def goodbye_ended(goodbye: protocol.Goodbye) -> ConnectionEnded:
    """What the shepherd's goodbye means: RunResumable when it says so, else RunOver."""
    if goodbye.resumable:
        return RunResumable(f"the shepherd stopped ({shown(goodbye.reason)})")
    return RunOver(shown(goodbye.reason))


def lost(exc: BaseException) -> ConnectionLost:
    """A `LINK_ERRORS` error as a ConnectionLost, keeping the protocol error's code."""
    if isinstance(exc, ConnectionLost):
        return exc
    code = getattr(exc, "code", "")
    code = "" if code == "unknown" or not isinstance(exc, protocol.ProtocolError) else code
    error = ConnectionLost(str(exc) or type(exc).__name__, code=code)
    error.__cause__ = exc
    return error


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first exception inside `group`, however deeply nested."""
    first = group.exceptions[0]
    return _first(first) if isinstance(first, BaseExceptionGroup) else first


def ended_by(
    error: protocol.Error, peer: str = "the shepherd", who: str = "worker"
) -> ConnectionEnded:
    """What an error message from the peer means: Refused if retrying cannot fix it.
    `who`: what this side is, as the refusal names it (a worker, a relay)."""
    message = shown(error.message)
    if error.code == protocol.ErrorCode.ID_IN_USE:
        return IdInUse(f"{peer} refused this {who} ({error.code.value}): {message}")
    if error.code in _FINAL_ERRORS:
        return Refused(
            f"{peer} refused this {who} ({error.code.value}): {message}",
            code=error.code.value,
        )
    lost = Busy if error.code == protocol.ErrorCode.BUSY else ConnectionLost
    return lost(f"{peer} reported an error ({error.code.value}): {message}")


class Connection:
    """One admitted peer's message stream, from the welcome to the goodbye.

    `side` ("shepherd" or "worker") names the receiving side's row of
    `contract.RECEIVES`; `stage` says where the conversation is (set it to READY
    when the worker's graphs are compiled). Heartbeats are logged (debug) to the
    owner's `log`, after `name` ("worker 3: "). `clock` is for tests on trio's
    virtual clock (`trio.current_time`).

    Subclasses count what passes through `on_sent` and `on_received`.
    """

    def __init__(
        self,
        stream: protocol.MessageStream,
        side: Literal["shepherd", "worker"],
        *,
        log: logging.Logger = log,
        name: str = "",
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stream = stream
        self.side = side
        self._log, self._name = log, name
        self.stage = Stage.PLANNED
        self.closed = False  # no longer in use (the shepherd marks a replaced link so too)
        # Extra header check (after the stage's): body, tensor specs, frame bytes -> raise.
        self.check_tensors: protocol.HeaderCheck | None = None
        self._clock = clock
        self._heard = clock()
        self._activity = stream.last_activity
        self._paused = 0
        self._said_goodbye = False
        stream.check_header = self._check_header

    # -- accounting hooks ----------------------------------------------------

    def on_sent(self, nbytes: int) -> None:
        """Called after each whole message sent; `nbytes` on the wire."""

    def on_received(self, message: protocol.Message) -> None:
        """Called after each whole message received, before the caller sees it."""

    # -- messages -------------------------------------------------------------

    async def send(self, body: protocol.Body, tensors=None, **options) -> int:
        """Send one message (options as `MessageStream.send`); the bytes written.

        Raises one of `LINK_ERRORS` when the link is gone. Safe from concurrent tasks:
        `MessageStream.send` holds its lock while it writes, and there is no other.
        """
        sent = await self.stream.send(body, tensors, **options)
        self.on_sent(sent)
        return sent

    async def send_encoded(self, message: protocol.Encoded) -> int:
        """Send a message encoded beforehand (the same bytes to many peers); as `send`."""
        sent = await self.stream.send_encoded(message)
        self.on_sent(sent)
        return sent

    async def receive(
        self, *, before_payload: protocol.PayloadGate | None = None
    ) -> protocol.Message:
        """The next message; one of `LINK_ERRORS` when the link broke or the peer broke the
        protocol (a kind out of turn is a MalformedMessage, raised before its payload)."""
        message = await self.stream.receive(before_payload=before_payload)
        self.heard()
        self.on_received(message)
        return message

    def _check_header(self, body: protocol.Body, specs, frame_bytes: int) -> None:
        problem = out_of_turn(self.side, body.KIND, self.stage)
        if problem is not None:
            raise protocol.MalformedMessage(problem)
        if self.check_tensors is not None:
            self.check_tensors(body, specs, frame_bytes)

    # -- liveness ---------------------------------------------------------------

    def heard(self) -> None:
        """The peer is alive now (a whole message came, or a wait we imposed ended)."""
        self._heard = self._clock()

    def silent_for(self) -> float:
        """Seconds since the peer last sent a byte (a message may still be arriving).

        Reads `MessageStream.last_activity` as a change marker, not as a time, so
        the connection's clock may differ from the stream's.
        """
        activity = self.stream.last_activity
        if activity != self._activity:
            self._activity = activity
            self.heard()
        return self._clock() - self._heard

    @property
    def is_paused(self) -> bool:
        return self._paused > 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within: this side holds the peer back on purpose (it does not read while it
        compiles, or a result waits for memory), so the peer's silence is not counted.
        On leaving, the silence clock starts again."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.heard()

    @contextlib.asynccontextmanager
    async def alive(
        self,
        *,
        heartbeat_seconds: float,
        timeout: float,
        too_slow: Callable[[], str] | None = None,
    ) -> AsyncIterator[trio.Nursery]:
        """Heartbeats every `heartbeat_seconds` and a watchdog around the body.

        The watchdog ends the body once the peer is silent for `timeout` s, or
        when `too_slow()` returns a reason (the shepherd's upload-rate rule); then
        this raises ConnectionLost with code `timeout`. A `LINK_ERRORS` error from
        the body comes out as ConnectionLost too; other errors pass unchanged (not
        wrapped in an exception group). The body may start tasks of its own in the
        nursery it gets: they end with it, and theirs come out as a group, but one of
        link errors alone (a result's send that met a shepherd gone) as ConnectionLost.
        """
        ended: Exception | None = None
        watchdog: list[str] = []
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._heartbeats, heartbeat_seconds)
                nursery.start_soon(
                    self._watchdog, timeout, too_slow, nursery.cancel_scope, watchdog
                )
                if isinstance(self.stream.stream, protocol.StripedStream):  # --streams K
                    nursery.start_soon(
                        _watch_idle_connections, self.stream.stream, heartbeat_seconds
                    )
                try:
                    yield nursery
                except LINK_ERRORS as exc:
                    ended = lost(exc)
                except Exception as exc:  # noqa: BLE001 - re-raised below, outside the nursery
                    ended = exc
                nursery.cancel_scope.cancel()
        except ExceptionGroup as group:  # a task the body started: its send met a broken link
            broken, other = group.split(LINK_ERRORS)
            if other is not None or broken is None:
                raise
            raise lost(_first(broken)) from None
        if ended is not None:
            raise ended
        if watchdog:
            raise ConnectionLost(watchdog[0], code=protocol.ErrorCode.TIMEOUT.value)

    async def _heartbeats(self, interval: float) -> None:
        with contextlib.suppress(*LINK_ERRORS):  # the receiving task reports a broken link
            while True:
                await trio.sleep(interval)
                sent = await self.send(protocol.Heartbeat(time.time()))
                self._log.debug("%ssent heartbeat (%d bytes)", self._name, sent)

    async def _watchdog(
        self,
        timeout: float,
        too_slow: Callable[[], str] | None,
        scope: trio.CancelScope,
        why: list[str],
    ) -> None:
        self.heard()  # count from the start of the watch, not from the handshake
        while True:
            await trio.sleep(min(1.0, timeout / WATCHDOG_POLLS))
            if self.is_paused:
                continue
            silent = self.silent_for()
            if silent > timeout:
                why.append(f"silent for {silent:.0f} s (heartbeat timeout {timeout:.0f} s)")
            elif too_slow is not None and (reason := too_slow()):
                why.append(reason)
            if why:
                scope.cancel()
                return

    # -- the end ------------------------------------------------------------------

    async def close(
        self,
        reason: str,
        *,
        error: ConnectionEnded | None = None,
        resumable: bool = False,
        goodbye: bool = True,
    ) -> None:
        """Say goodbye (after `error`, if it has a code the peer should hear) and close.

        `resumable` (the shepherd's side): the run stopped before its end with a
        checkpoint to resume from, so the worker should come back (`protocol.Goodbye`).
        `goodbye=False` sends only the error: the shepherd ending one connection while
        the run goes on must not say goodbye, which a worker reads as "the run is over"
        and exits for good, instead of reconnecting.

        Best effort and bounded by CLOSE_SECONDS: a peer that is gone or does not
        read cannot hold this side. Safe to call twice; call it shielded from
        cancellation when the surrounding scope may be cancelled.
        """
        if self._said_goodbye:
            return
        self.closed = self._said_goodbye = True
        with trio.move_on_after(CLOSE_SECONDS), contextlib.suppress(*LINK_ERRORS):
            if error is not None and error.code:
                why = error.reason[: protocol.REASON_CHARS]
                await self.send(protocol.Error(protocol.ErrorCode(error.code), why))
            if goodbye:
                await self.send(protocol.Goodbye(reason[: protocol.REASON_CHARS], resumable))
        with contextlib.suppress(*LINK_ERRORS):
            await self.stream.aclose()


# The most a worker waits for the shepherd's hello (a shepherd speaks first, at once; a TLS
# shepherd tells a plain worker so after its --handshake-timeout, 10 s by default).
HELLO_SECONDS = 60.0


async def expect_hello(stream: protocol.MessageStream, address: str) -> protocol.Message:
    """The shepherd's hello, the first message of a connection; ConnectionLost, saying what to
    check, when whatever answers at `address` is no shepherd.

    Something else on that port (a web server, SSH, the operator API) says nothing,
    which held the worker in its handshake for all of --give-up-after (30 minutes),
    sends bytes that are no PCP frame, which read as a bare "frame claims 759714644
    segments", or closes the connection, which read as a bare "peer closed the connection".
    """
    hint = "is --connect the address in the shepherd's join command?"
    with trio.move_on_after(HELLO_SECONDS):
        try:
            return await expect(stream, "hello", peer=address)  # a relay's error comes here
        except (protocol.FrameTooLarge, protocol.MalformedMessage) as exc:
            raise ConnectionLost(f"{address} does not speak PCP ({exc}): {hint}") from None
        except protocol.ConnectionClosed:
            raise ConnectionLost(
                f"{address} closed the connection before its hello (a shepherd with too many "
                f"unfinished handshakes does that; if it goes on: {hint})"
            ) from None
    raise ConnectionLost(f"no hello from {address} in {HELLO_SECONDS:.0f} s: {hint}")


async def expect(
    stream: protocol.MessageStream | Connection,
    kind: str,
    *,
    who: str = "worker",
    peer: str = "the shepherd",
) -> protocol.Message:
    """The next message from the shepherd, which must be a `kind`: an error or goodbye instead
    says why not (Refused, ConnectionLost or RunOver), anything else is a MalformedMessage.
    `who`: what this side is, `peer` who sent the error, as a refusal names them."""
    message = await stream.receive()
    if message.kind == kind:
        return message
    if isinstance(message.body, protocol.Error):
        raise ended_by(message.body, peer, who)
    if isinstance(message.body, protocol.Goodbye):
        raise goodbye_ended(message.body)
    raise protocol.MalformedMessage(f"expected {kind} from the shepherd, got {message.kind}")


async def _watch_idle_connections(striped: protocol.StripedStream, interval: float) -> None:
    """End `striped` once one of its connections that carries no piece now has been reset or
    closed (`StripedStream.idle_problem`) at two looks in a row, `interval` s apart.

    Otherwise that is noticed only when the next piece is due on it, maybe a whole round
    later. The second look is the grace a peer closing all its connections after a goodbye
    gets: the goodbye is read, and this task ended with the link, before then.
    """
    seen = None
    while True:
        await trio.sleep(interval)
        problem = striped.idle_problem()
        if problem is not None and seen is not None:
            await striped.fail(seen)
            return
        seen = problem
