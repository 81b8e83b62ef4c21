"""The shepherd's side of one worker connection: the handshake, and the link it opens."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import trio

from pcp_tui import __version__, protocol
from pcp_tui.contract import auth
from pcp_tui.contract.channels import Channel
from pcp_tui.contract.connection import (
    LINK_ERRORS,
    Connection,
    ConnectionLost,
    Refused,
    shown,
)
from pcp_tui.contract.plan import Stage
from pcp_tui.shepherd.rounds.record import WorkerRounds
from pcp_tui.shepherd.run.state import RunState, WorkerView
from pcp_tui.shepherd.serving.progress_rate import ProgressRate

if TYPE_CHECKING:
    from pcp_tui.shepherd.serving.striping import Attachments
    from pcp_tui.shepherd.serving.uploads import ReceiverLoad
    from pcp_tui.shepherd.serving.worker_keys import WorkerKeys

log = logging.getLogger(__name__)  # connection-level diagnostics (--log-level)

HANDSHAKE_SECONDS = 10.0
CONNECTION_ERRORS = LINK_ERRORS  # the name the coordinator knows them by


@dataclass
class Hello:
    worker_id: str
    hostname: str
    backend: str  # described for people: "cpu", "cuda NVIDIA H100 ...", "cpu x4", "vulkan ... (iree vulkan-spirv)"
    platform: protocol.Platform
    devices: int = 1  # local devices the worker trains on as one (a JAX mesh)
    runtime: protocol.Runtime = protocol.Runtime.XLA
    processes: int = 1  # a site's (multi-controller JAX), one a host; `devices` over them all
    hosts: tuple[str, ...] = ()  # a site's processes' hosts, process 0's first
    nonce: bytes = b""  # this connection's challenge (an attach proof covers it too)
    attach_index: int = 0  # > 0: an extra connection for the worker's striped session
    attach_proof: bytes = b""
    public_key: bytes = b""  # --worker-keys: the key it was admitted with (revocable)
    relay: bool = False  # a relay (`pcp-tui relay`): its link carries its workers' connections
    relay_fingerprint: str = ""  # a relay: the certificate its workers see (their keys sign it)


class SendTooSlow(trio.BrokenResourceError):
    """A message to a worker was not taken in its time (`WorkerLink.send`); the link is closed.

    A `trio.BrokenResourceError`, so every sender that already handles a broken
    link (round starts, fragment updates, heartbeats) handles this one too.
    """


class WorkerLink(Connection):
    """One admitted worker: its connection, its view in RunState (whose bytes and
    last-heard time it keeps), and whether it is ready for rounds.

    Every message to the worker must be taken within `send_grace` + its bytes /
    `min_send_rate` seconds (the shepherd's --upload-grace and --min-upload-rate,
    the rule a result upload meets the other way). A peer that stops reading but
    keeps sending heartbeats is not silent, so only this catches it; without it a
    round start to it would block for ever, and with it the round. An honest worker
    does not read while it compiles (it may take minutes), so it gets no heartbeats
    until it is ready: they would fill its window and trip the deadline.
    """

    def __init__(
        self,
        stream: protocol.MessageStream,
        view: WorkerView,
        state: RunState,
        platform: protocol.Platform,
        runtime: protocol.Runtime = protocol.Runtime.XLA,
        *,
        min_send_rate: float = math.inf,
        send_grace: float = math.inf,
        load: ReceiverLoad | None = None,
    ):
        # trio's clock, as every deadline of the shepherd's (a virtual one in a simulation)
        super().__init__(
            stream, "shepherd", log=log, name=f"worker {view.index}: ", clock=trio.current_time
        )
        self.view = view
        self.platform = platform
        self.runtime = runtime  # with platform: which export this worker's plan carries
        self._state = state
        self.ready = trio.Event()
        self.admitted_at = trio.current_time()  # for the slot rules (shepherd.slots)
        self.ready_at: float | None = None  # when it said ready (trio's clock; `slots` too)
        self.rounds = WorkerRounds()  # its part in the rounds: sent, answered, timed
        self.min_send_rate, self.send_grace = min_send_rate, send_grace
        self.load = load  # the shepherd's own load: a send's deadline leaves its busy seconds out
        self.failure: ConnectionLost | None = None  # why this side ended the link, if it did
        self._turn = trio.Lock()  # messages wait their turn here, outside their deadline
        self.ended = trio.Event()  # set once the connection is closed (its server task ends)
        # while the worker is asked to open more connections (shepherd.striping)
        self.attachments: Attachments | None = None
        self.progress = ProgressRate()  # progress messages beyond a few a second are dropped
        self.public_key = b""  # --worker-keys: the key it joined with (`WorkerPool.drop_revoked`)
        # trio's clock when the upload-rate clock last started: a whole message came in, or a
        # result got its memory slot (`uploads.upload_too_slow`; bytes of a message do not)
        self.upload_since = trio.current_time()

    async def send(self, body: protocol.Body, tensors=None, **options) -> int:
        """`Connection.send` within the link's deadline; SendTooSlow (link closed) past it.

        The deadline counts from when the message's turn comes, not while it waits
        behind another (a heartbeat behind a long plan is not late). A message cut
        off mid-frame leaves the stream unusable, so the link is closed at once; so is
        a link whose message (but a heartbeat) is cancelled: a round that closes at its
        --round-timeout stops the roundStarts still on their way.
        """
        if self.failure is not None:
            raise SendTooSlow(self.failure.reason)
        if isinstance(body, protocol.Heartbeat) and self.stage is not Stage.READY:
            return 0  # it compiles and does not read: heartbeats would only fill its window
        nbytes = sum(np.asarray(t).nbytes for t in (tensors or {}).values())
        return await self._within_deadline(
            body, nbytes, lambda: super(WorkerLink, self).send(body, tensors, **options)
        )

    async def send_encoded(self, message: protocol.Encoded) -> int:
        """`send` for a message encoded beforehand: the same deadline, from its decoded bytes
        (as `send` counts a quantized message), the same cut-off."""
        return await self._within_deadline(
            message.body,
            message.decoded_bytes,
            lambda: super(WorkerLink, self).send_encoded(message),
        )

    async def _within_deadline(self, body: protocol.Body, nbytes: int, send) -> int:
        """Await `send()` once this message's turn comes, within `send_grace` + `nbytes` /
        `min_send_rate` seconds; past it (or cancelled mid-message) the link is cut off."""
        if self.failure is not None:
            raise SendTooSlow(self.failure.reason)
        if isinstance(body, protocol.RoundStart):
            self.rounds.started(body.round)  # its results may come (`WorkerRounds.note_result`)
        async with self._turn:
            seconds = self.send_grace + nbytes / self.min_send_rate
            began = trio.current_time()
            try:
                with (
                    trio.move_on_after(seconds) as scope,
                    self.load.stretched(scope) if self.load else contextlib.nullcontext(),
                ):
                    sent = await send()
                    if isinstance(body, protocol.RoundStart):
                        self.rounds.delivered(body.round)
                    return sent
            except trio.Cancelled:
                # part of it may have gone out (a heartbeat is cancelled only as the link ends)
                if self.failure is None and not isinstance(body, protocol.Heartbeat):
                    await self._cut_off(
                        f"the worker had not taken all of a {nbytes}-byte {body.KIND} when the "
                        "shepherd stopped sending it (its round closed at --round-timeout, or "
                        "the run ended); it reconnects and trains from the next round"
                    )
                raise
            reason = (
                f"download too slow: the worker did not take a {nbytes}-byte {body.KIND} in "
                f"{trio.current_time() - began:.0f} s (--upload-grace {self.send_grace:g} s, then "
                f"--min-upload-rate {self.min_send_rate:g} B/s); a worker must keep reading"
            )
            await self._cut_off(reason)
            raise SendTooSlow(reason)

    async def _cut_off(self, reason: str) -> None:
        """End the link after a message was cut off part-way: the stream is out of frame."""
        self.failure = ConnectionLost(reason, code=protocol.ErrorCode.TIMEOUT.value)
        self.closed = True
        with trio.CancelScope(shield=True):  # half a frame went out: nothing more to say
            await trio.aclose_forcefully(self.stream.stream)

    def silent_for(self) -> float:
        """`Connection.silent_for`, less the seconds the shepherd itself was too busy to read
        (`uploads.ReceiverLoad`): a congested shepherd does not hear heartbeats it has not read."""
        channel = self.stream.stream  # a relay vouches for its workers: its link's silence
        silent = channel.link_silence() if isinstance(channel, Channel) else super().silent_for()
        if self.load is None or silent <= 0:
            return silent
        return max(silent - self.load.busy_since(trio.current_time() - silent), 0.0)

    @property
    def worker_id(self) -> str:
        return self.view.worker_id

    def on_sent(self, nbytes: int) -> None:
        self.view.bytes_out += nbytes
        self._state.bytes_sent += nbytes

    def on_received(self, message: protocol.Message) -> None:
        self.view.bytes_in += message.wire_bytes
        self._state.bytes_received += message.wire_bytes
        self.view.last_heard = time.monotonic()  # shown (the dashboard's clock)
        self.upload_since = trio.current_time()


async def handshake(
    stream: protocol.MessageStream,
    *,
    token: str,
    run_id: str,
    keys: WorkerKeys | None = None,
    channel: str | None = None,
) -> Hello:
    """Challenge the peer: it must answer with HMAC(token, nonce, id), and with `keys`
    (--worker-keys) also sign the same nonce and id with a key issued to that id.

    A worker of another protocol version is refused here, with advice on which
    side to upgrade. Raises Refused with an error already sent to the peer when it fails.
    """
    nonce = auth.new_nonce()
    await stream.send(
        protocol.Hello(
            supported_versions=protocol.SUPPORTED_VERSIONS,
            nonce=nonce,
            run_id=run_id,
            software=f"pcp-tui {__version__}",
        )
    )
    try:
        message = await stream.receive()
    except protocol.VersionMismatch as exc:
        await stream.send_error("versionMismatch", _version_advice(exc))
        raise Refused(str(exc), code="versionMismatch") from None
    body = message.body
    if not isinstance(body, protocol.WorkerHello):
        reason = f"expected workerHello, got {message.kind}"
        await stream.send_error("malformed", reason)
        raise Refused(reason, code="malformed")
    worker_id = body.worker_id
    if not worker_id:
        await stream.send_error("malformed", "workerHello has no workerId")
        raise Refused("workerHello has no workerId", code="malformed")
    if not worker_id.isprintable():
        reason = (
            f"workerHello's workerId {shown(worker_id)} holds control characters; "
            "start the worker with an --id of letters, digits and punctuation"
        )
        await stream.send_error("malformed", reason)
        raise Refused(reason, code="malformed")
    if not auth.verify(token, nonce, worker_id, body.proof):
        reason = "wrong or missing join token"
        await stream.send_error(
            "authFailed",
            f"{reason}: start the {'relay' if body.relay else 'worker'} with the --token the "
            "shepherd printed (or PCP_TOKEN)",
        )
        raise Refused(reason, code="authFailed")
    unsigned = keys.refusal(body, nonce, channel) if keys is not None else None
    if unsigned is not None:
        await stream.send_error("authFailed", unsigned)
        raise Refused(unsigned, code="authFailed")
    backend = body.backend
    devices = max(backend.device_count, 1)  # a worker that does not say runs on one
    described = backend.platform.value
    if backend.platform != protocol.Platform.CPU:
        described = f"{backend.platform.value} {shown(backend.device_kind)}".strip()
    processes = max(backend.process_count, 1)
    if devices > 1:
        described = f"{described} x{devices}"
    if processes > 1:  # a site: its processes' hosts, or (a site tried on one host) its processes
        hosts = len(set(backend.hostnames))
        described += f" on {hosts} hosts" if hosts > 1 else f" in {processes} processes"
    if backend.runtime != protocol.Runtime.XLA:
        described += f" ({backend.runtime.value} {shown(backend.target)})".replace(" )", ")")
    return Hello(
        worker_id,
        shown(body.hostname),
        described,
        backend.platform,
        devices,
        backend.runtime,
        processes=processes,
        hosts=tuple(shown(h) for h in backend.hostnames),
        nonce=nonce,
        attach_index=body.attach_index,
        attach_proof=body.attach_proof,
        public_key=bytes(body.public_key) if keys is not None else b"",
        relay=body.relay,
        relay_fingerprint=shown(body.relay_fingerprint),
    )


def _version_advice(exc: protocol.VersionMismatch) -> str:
    """The mismatch told from the worker's side: both versions, and which side to upgrade."""
    ours, theirs = _versions(exc.supported), _versions(exc.peer_versions)
    older = (
        "this shepherd"
        if exc.peer_versions and min(exc.peer_versions) > max(exc.supported)
        else "this worker"
    )
    return (
        f"protocol version mismatch: the shepherd (pcp-tui {__version__}) speaks protocol {ours}, "
        f"this worker speaks {theirs}; upgrade pcp-tui on {older} (reinstall it from a newer checkout)"
    )


def _versions(numbers: tuple[int, ...]) -> str:
    """'version 3', 'versions 2 and 3', or 'no version'."""
    if not numbers:
        return "no version"
    if len(numbers) == 1:
        return f"version {numbers[0]}"
    return f"versions {', '.join(map(str, numbers[:-1]))} and {numbers[-1]}"
