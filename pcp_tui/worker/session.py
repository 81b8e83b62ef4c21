"""The worker's side of the link: connect, handshake, one admitted session, goodbye.

`Session.run` connects to the shepherd (TCP, or TLS), proves the join token
in the handshake, and serves the admitted connection: the watchdog and
heartbeats (`Connection.alive`), the receive loop that hands round starts to
the training task, and the goodbye or error that ends it. A connection lost
after a welcome is retried within --give-up-after (`reconnect.Reconnect`); a
refusal is final. What the worker does with the plan and the rounds is its
subclass's, `client.Worker`: `Session` calls it through the hooks below
(`_enter_run`, `_compile`, `_train_rounds`, `_deliver_fragment_update`).
"""

from __future__ import annotations

import logging
import os
import platform as host_platform
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import trio

from pcp_tui import protocol
from pcp_tui.backends import Backend
from pcp_tui.config import WorkerConfig
from pcp_tui.contract import keys
from pcp_tui.contract import plan as contract
from pcp_tui.contract.connection import (
    LINK_ERRORS,
    Busy,
    Connection,
    ConnectionEnded,
    ConnectionLost,
    IdInUse,
    Refused,
    RunOver,
    RunResumable,
    ended_by,
    expect_hello,
    goodbye_ended,
    shown,
    silence_timeout,
)
from pcp_tui.contract.connection import expect as _expect
from pcp_tui.contract.tls import ClientTLS, shown_fingerprint
from pcp_tui.contract.trace import MessageTrace
from pcp_tui.worker import striping
from pcp_tui.worker.reconnect import Reconnect, dial
from pcp_tui.worker.site import Site

MIN_HEARTBEAT_SECONDS, MAX_HEARTBEAT_SECONDS = 0.05, 60.0  # what a welcome may set
# connection-level diagnostics (--log-level, --log-file), under the name the worker's
# log lines have always carried
log = logging.getLogger("pcp_tui.worker.client")


# `busy` answers in a row after which a worker tries its next --connect address: a relay
# whose shepherd is busy is tried again (the shepherd directly is as busy), but one that
# says busy for ever (broken, or hostile) holds its workers no longer than this
BUSY_TRIES = 3


class CannotRun(Refused):
    """This worker cannot compile or run the plan's graphs: it tells the shepherd and leaves.

    Reconnecting would fetch the same graphs and fail the same way.
    """

    def __init__(self, reason: str):
        super().__init__(reason, code=protocol.ErrorCode.UNSUPPORTED_BACKEND.value)


@dataclass
class WorkerStatus:
    """What the worker's own status line shows."""

    state: str = "connecting"
    shepherd: str = ""
    worker_index: int | None = None
    round: int = 0
    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    tokens_per_second: float = 0.0
    message: str = ""
    listeners: list[Callable[[WorkerStatus], None]] = field(default_factory=list, repr=False)

    def update(self, **changes) -> None:
        for key, value in changes.items():
            setattr(self, key, value)
        for listener in self.listeners:
            listener(self)


class Session:
    """One worker's connections to its shepherd, from the first connect to the run's end."""

    def __init__(
        self,
        config: WorkerConfig,
        backend: Backend,
        *,
        tls: ClientTLS | None = None,
        trace: MessageTrace | None = None,
        max_backoff: float = 30.0,
        site: Site | None = None,
    ):
        """A session with `config.connection`'s settings, for a worker that runs `backend`;
        `site`: the processes it speaks for (process 0 of it: `worker/site.py`), else itself."""
        connection = config.connection
        # --connect: where to try, in turn: after a failed or lost connection, the next
        self.addresses = connection.addresses
        self._at = 0
        self._busy = 0  # `busy` answers in a row from this address (`BUSY_TRIES`)
        if not connection.token:
            raise ValueError("a worker needs the run's join token (WorkerConfig.token)")
        self.token = connection.token
        self.trace = trace  # --trace: every message to and from the shepherd
        self.tls = tls  # None: plain TCP
        self.source = connection.source_address  # the local address it dials from
        self.backend = backend  # what the hello describes
        # --key: every hello is signed with it (a shepherd with --worker-keys checks it)
        self.key = keys.load_private_key(connection.key) if connection.key else None
        self._key_unused_said = False  # a shepherd without --worker-keys: said once
        self.site = site or Site.alone()  # its followers get what says what to compute
        self.worker_id = connection.worker_id or (
            f"{host_platform.node() or 'worker'}-{os.getpid()}-{secrets.token_hex(2)}"
        )
        self.reconnect = Reconnect(  # give_up_after: seconds of trying to get (back) in
            give_up_after=connection.give_up_after,
            max_backoff=max_backoff,
            retry=connection.reconnect,
            on_wait=self._show_wait,
        )
        self.status = WorkerStatus(shepherd=f"{self.host}:{self.port}")
        self.heartbeat_seconds = 2.0  # the welcome says the run's interval
        self.heartbeat_timeout = 30.0

    @property
    def host(self) -> str:
        return self.addresses[self._at][0]

    @property
    def port(self) -> int:
        return self.addresses[self._at][1]

    async def run(self) -> None:
        """Train until the shepherd says goodbye. Raises Refused on a final refusal.

        Raises ConnectionLost once --give-up-after seconds of trying to get in (or
        back in, counted from the loss of a connection on which this worker was ready)
        pass without a welcome that leads to ready: see `Reconnect`.
        """
        lost = False
        while not await self.reconnect.run(self._attempt, rejoin=lost):
            lost = True  # a connection that worked was lost: a fresh budget to get back

    async def _attempt(self, deadline: float) -> bool:
        """One connection: True once the run is over, False when it was lost once this worker
        was ready; ConnectionLost when it failed before (`deadline` bounds the handshake).

        A welcome alone earns no fresh --give-up-after: a shepherd that welcomes and then
        fails every worker (a plan it cannot run, a goodbye at once) would otherwise be
        retried twice a second for ever. Losses before ready are retried within the budget,
        with its growing waits; a loss after ready starts a fresh one (see `run`).
        """
        try:
            stream = await self._connect(deadline)
        except ConnectionLost:
            self._next_address()
            raise
        messages = protocol.MessageStream(stream)
        if self.trace is not None:
            messages.observer = self.trace.observer(f"{self.host}:{self.port}")
        try:
            await self._join(messages, deadline)  # a ConnectionLost here is retried in the budget
            await self._session(messages)
        except RunOver as exc:  # why: finished, cancelled, diverged (the goodbye's reason)
            said = (
                f"the shepherd ended the run ({exc})" if str(exc) else "the shepherd ended the run"
            )
            log.info("%s", said)
            self.status.update(state="done", message=said)
            return True
        except _LostAfterWelcome as exc:
            if exc.ready and self.site.process_count > 1:  # its processes may be mid-round at
                raise ConnectionLost(  # different points: only a restart puts them in step
                    f"{exc.__cause__ or exc}; a site does not rejoin a run it was ready in: "
                    "restart every process of the site to rejoin"
                ) from exc
            if isinstance(exc.__cause__, RunResumable):
                done = self._shepherd_stopped(exc.__cause__)
            else:
                log.info("connection to %s:%d lost: %s", self.host, self.port, exc.__cause__)
                if not self.reconnect.retry:
                    raise ConnectionLost(str(exc)) from exc
                self.status.update(state="connecting", message=str(exc))
                done = False
            if not done:
                self._next_address()
            if not done and not exc.ready:  # welcomed, then failed: no fresh budget for that
                raise ConnectionLost(f"{exc}, before this worker was ready") from exc
            return done
        except Busy:  # it answered: the same address again (`Busy`), a few times
            self._busy += 1
            if self._busy >= BUSY_TRIES:  # one that says busy for ever holds no worker
                self._next_address()
            raise
        except ConnectionLost:  # before the welcome: the next address, if there is one
            self._next_address()
            raise
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)
                await trio.aclose_forcefully(messages.stream)  # all of them, when striped

    def _next_address(self) -> None:
        """Try the next --connect address (a relay's, the shepherd's) on the next attempt."""
        self._busy = 0
        if len(self.addresses) > 1:
            self._at = (self._at + 1) % len(self.addresses)
            self.status.update(shepherd=f"{self.host}:{self.port}")
            log.info("next try: %s:%d", self.host, self.port)

    def _shepherd_stopped(self, stopped: RunResumable) -> bool:
        """The shepherd stopped before the run's end and can resume it: True (done) only
        with --no-reconnect, else False: reconnect, as after a lost connection."""
        if not self.reconnect.retry:
            log.info("%s; the run can be resumed, but --no-reconnect: exiting", stopped)
            self.status.update(state="done", message=f"{stopped}; not reconnecting")
            return True
        message = (
            f"{stopped}; the run can be resumed: reconnecting, waiting for the shepherd to be "
            f"resumed, giving up in {_duration(self.reconnect.give_up_after)} (--give-up-after)"
        )
        log.info("%s", message)
        self.status.update(state="connecting", message=message)
        return False

    async def _connect(self, deadline: float) -> trio.abc.Stream:
        """A TCP (or TLS) stream to the shepherd, or ConnectionLost (Refused: TLS)."""
        self.status.update(state="connecting", message=f"to {self.host}:{self.port}")
        return await self._open(deadline)

    async def _open(self, deadline: float) -> trio.abc.Stream:  # striping's extra connections too
        return await dial(self.host, self.port, self.tls, deadline, self.source)

    async def _join(self, stream: protocol.MessageStream, deadline: float) -> None:
        """The handshake, until the welcome; ConnectionLost to retry, Refused if final."""
        try:
            with trio.fail_at(deadline):
                await self._handshake(stream)
        except trio.TooSlowError:
            raise ConnectionLost(
                f"connection lost (no welcome from {self.host}:{self.port} in time)"
            ) from None
        except IdInUse as exc:
            if self.status.worker_index is None:  # never admitted: a twin, not a reconnect
                raise
            raise ConnectionLost(str(exc)) from None
        except protocol.VersionMismatch as exc:
            raise Refused(str(exc)) from None
        except Busy:
            raise
        except (ConnectionLost, *LINK_ERRORS) as exc:
            raise ConnectionLost(f"connection lost ({exc})") from None

    def _show_wait(self, reason: str, seconds: float) -> None:
        self.status.update(state="connecting", message=f"{reason}; retrying in {seconds:.1f} s")

    async def _session(self, stream: protocol.MessageStream) -> NoReturn:
        """One admitted connection, from the plan to the goodbye; always ends by raising why.

        RunOver when the shepherd ends the run, ConnectionLost when the link breaks
        or goes silent, Refused when the shepherd turns this worker away for good.
        """
        connection = Connection(stream, "worker", log=log)
        connection.check_tensors = contract.worker_header_check(self.backend.info.memory_bytes)
        ended: ConnectionEnded | None = None
        ready = False
        try:
            async with connection.alive(
                heartbeat_seconds=self.heartbeat_seconds, timeout=self.heartbeat_timeout
            ) as tasks:
                plan_message = await _expect(connection, "plan")
                await self._to_site(plan_message)
                connection.stage = contract.Stage.READY
                self.status.update(state="compiling", message="compiling the training graph")
                with connection.paused():  # compiling does not read the socket: not silence
                    await self._compile(connection, plan_message)
                stream.limits = contract.worker_limits(plan_message.body_as(protocol.Plan))
                ready = True
                rounds_out, rounds_in = trio.open_memory_channel(1)
                tasks.start_soon(self._train_rounds, connection, rounds_in)
                await self._receive_loop(connection, rounds_out)
        except ConnectionLost as exc:
            ended = exc
            raise _LostAfterWelcome(f"connection lost ({exc})", ready=ready) from exc
        except ConnectionEnded as exc:
            ended = exc
            raise
        except Exception as exc:  # e.g. a site's collective with a process that is gone
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            ended = ConnectionEnded(f"the worker failed: {why}")
            raise
        finally:
            with trio.CancelScope(shield=True):  # tells the shepherd what it sent wrong, if it did
                lost = ended if isinstance(ended, ConnectionLost | CannotRun) else None
                await connection.close(str(ended or "the worker stopped"), error=lost)
        raise _LostAfterWelcome("connection lost (the session ended)", ready=ready)

    async def _handshake(self, stream: protocol.MessageStream) -> None:
        self.status.update(state="connecting", message="handshake")
        hello = await expect_hello(stream, f"{self.host}:{self.port}")
        nonce = hello.body_as(protocol.Hello).nonce
        await stream.send(self._hello(nonce, channel=shown_fingerprint(stream.stream)))
        welcome_message = await _expect(stream, "welcome")
        welcome = welcome_message.body_as(protocol.Welcome)
        interval = welcome.heartbeat_seconds  # the run's; a broken shepherd's is bounded
        self.heartbeat_seconds = min(max(interval, MIN_HEARTBEAT_SECONDS), MAX_HEARTBEAT_SECONDS)
        self.heartbeat_timeout = silence_timeout(self.heartbeat_seconds)
        log.info(
            "admitted by %s:%d (heartbeat every %g s)", self.host, self.port, self.heartbeat_seconds
        )
        if self.key is not None and not welcome.key_checked and not self._key_unused_said:
            self._key_unused_said = True
            log.warning(
                "%s:%d does not check worker keys (no --worker-keys): this worker's --key is "
                "unused there; the join token alone admitted it",
                self.host,
                self.port,
            )
        self._enter_run(welcome.run_id)
        await self._to_site(welcome_message)
        self.status.update(worker_index=welcome.worker_index, message="admitted")
        if welcome.streams > 1:
            await striping.attach(self, stream, welcome)

    def _hello(
        self, nonce: bytes, *, channel: str, attach_index: int = 0, session_key: bytes = b""
    ) -> protocol.WorkerHello:
        """This worker's hello for a connection whose challenge is `nonce` and whose shepherd
        showed the certificate of fingerprint `channel` ("": plain TCP); with `attach_index`,
        for extra connection `attach_index` of the session that got `session_key`."""
        info = self.backend.info
        backend = protocol.BackendInfo(
            platform=protocol.Platform(info.platform),
            device_kind=info.device_kind[: protocol.ID_CHARS],
            device_count=info.device_count,
            memory_bytes=info.memory_bytes,
            jax_version=info.jax_version,
            runtime=protocol.Runtime(info.runtime),
            target=info.target[: protocol.ID_CHARS],
            process_count=self.site.process_count,
            hostnames=tuple(h[: protocol.ID_CHARS] for h in self.site.hostnames),
        )
        return keys.signed_hello(
            self.token,
            self.key,
            nonce,
            self.worker_id,
            channel=channel,
            attach_index=attach_index,
            session_key=session_key,
            backend=backend,
        )

    async def _receive_loop(self, connection: Connection, rounds: trio.MemorySendChannel) -> None:
        """Hand round starts to the training task; end on the shepherd's goodbye or error.

        The connection refuses kinds out of turn (`contract.RECEIVES`) from their header.
        """
        while True:
            message = await connection.receive()
            body = message.body
            if isinstance(body, protocol.RoundStart):
                await self._to_site(message)
                await rounds.send(message)
            elif isinstance(body, protocol.FragmentUpdate):  # Streaming DiLoCo
                await self._to_site(message)
                self._deliver_fragment_update(message)
            elif isinstance(body, protocol.Goodbye):
                raise goodbye_ended(body)
            elif isinstance(body, protocol.Error):
                if body.code == protocol.ErrorCode.BAD_RESULT:
                    self.status.update(message=f"shepherd refused a result: {shown(body.message)}")
                    continue
                raise ended_by(body)

    async def _to_site(self, message: protocol.Message) -> None:
        """The site's other processes get `message` too (`worker/site.py`), in the order this
        process does; a site of one has none."""
        if self.site.process_count > 1:
            await trio.to_thread.run_sync(self.site.send, _encoded(message))

    # -- what the training side does (client.Worker) ----------------------------

    def _enter_run(self, run_id: str) -> None:
        """The welcome admitted this worker to run `run_id` (before any plan of it)."""
        raise NotImplementedError

    async def _compile(self, connection: Connection, plan_message: protocol.Message) -> None:
        """Load and compile the plan, then tell the shepherd this worker is ready."""
        raise NotImplementedError

    async def _train_rounds(
        self, connection: Connection, rounds: trio.MemoryReceiveChannel
    ) -> None:
        """Train every round start the receive loop hands over, until the channel closes."""
        raise NotImplementedError

    def _deliver_fragment_update(self, message: protocol.Message) -> None:
        """Hand a fragmentUpdate (Streaming DiLoCo) to the round that waits for it."""
        raise NotImplementedError


class _LostAfterWelcome(Exception):
    """An admitted connection was lost; `ready`: after the worker was ready for rounds, which
    gives it a fresh budget to come back."""

    def __init__(self, reason: str, *, ready: bool):
        super().__init__(reason)
        self.ready = ready


def _encoded(message: protocol.Message) -> bytes:
    """`message` as the shepherd sent it (its tensors as they were decoded)."""
    return b"".join(protocol.encode(message.body, message.tensors))


def _duration(seconds: float) -> str:
    """`30 min`, `45 s`, `2.5 h`: a wait as a person reads it."""
    if seconds >= 3600:
        return f"{seconds / 3600:g} h"
    if seconds >= 60:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"
