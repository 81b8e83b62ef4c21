"""The shepherd's side of one worker connection: handshake, sends, liveness."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import trio

from pcp_tui import __version__, protocol
from pcp_tui.contract import auth
from pcp_tui.shepherd.state import RunState, WorkerView

HANDSHAKE_SECONDS = 10.0
# What a send or receive raises when the peer broke the protocol or the connection is gone.
CONNECTION_ERRORS = (protocol.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError)


class Refused(Exception):
    """A peer was turned away for good (bad token, wrong version, bad hello)."""

    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


class WorkerLost(Exception):
    """A connected worker went away or broke the protocol."""


@dataclass
class Hello:
    worker_id: str
    hostname: str
    backend: (
        str  # described for people: "cpu", "cuda NVIDIA H100 ...", "vulkan ... (iree vulkan-spirv)"
    )
    platform: protocol.Platform
    runtime: protocol.Runtime = protocol.Runtime.XLA


class WorkerLink:
    """One admitted worker: its stream, its view in RunState, a send lock."""

    def __init__(
        self,
        stream: protocol.MessageStream,
        view: WorkerView,
        state: RunState,
        platform: protocol.Platform,
        runtime: protocol.Runtime = protocol.Runtime.XLA,
    ):
        self.stream = stream
        self.view = view
        self.platform = platform
        self.runtime = runtime  # with platform: which export this worker's plan carries
        self._state = state
        self._send_lock = trio.Lock()
        self.ready = trio.Event()
        self.closed = False
        self.lost_reason = ""
        self.error_code: str = ""  # sent to the peer with lost_reason when its fault ends the link
        self.admitting = False  # a round result's header is in; its payload waits for memory

    @property
    def worker_id(self) -> str:
        return self.view.worker_id

    async def send(self, body: protocol.Body, tensors=None, **options) -> int:
        async with self._send_lock:
            sent = await self.stream.send(body, tensors, **options)
        self.view.bytes_out += sent
        self._state.bytes_sent += sent
        return sent

    async def receive(
        self, *, before_payload: protocol.PayloadGate | None = None
    ) -> protocol.Message:
        message = await self.stream.receive(before_payload=before_payload)
        self.view.bytes_in += message.wire_bytes
        self._state.bytes_received += message.wire_bytes
        self.view.last_heard = time.monotonic()
        return message

    def silent_for(self) -> float:
        """Seconds since the worker last sent a byte (a message may still be arriving)."""
        return time.monotonic() - max(self.view.last_heard, self.stream.last_activity)

    async def close(self, reason: str) -> None:
        """Say goodbye (best effort, bounded in time) and close."""
        if self.closed:
            return
        self.closed = True
        with trio.move_on_after(2):
            with contextlib.suppress(*CONNECTION_ERRORS):
                await self.send(protocol.Goodbye(reason))
        await self.stream.aclose()


async def handshake(stream: protocol.MessageStream, *, token: str, run_id: str) -> Hello:
    """Challenge the peer: it must answer with HMAC(token, nonce, id).

    Raises Refused with an error already sent to the peer when it fails.
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
        raise Refused("versionMismatch", str(exc)) from None
    body = message.body
    if not isinstance(body, protocol.WorkerHello):
        reason = f"expected workerHello, got {message.kind}"
        await stream.send_error("malformed", reason)
        raise Refused("malformed", reason)
    worker_id = body.worker_id
    if not worker_id:
        await stream.send_error("malformed", "workerHello has no workerId")
        raise Refused("malformed", "workerHello has no workerId")
    if not auth.verify(token, nonce, worker_id, body.proof):
        reason = "wrong or missing join token"
        await stream.send_error(
            "authFailed",
            f"{reason}: start the worker with the --token the shepherd printed (or PCP_TOKEN)",
        )
        raise Refused("authFailed", reason)
    backend = body.backend
    described = backend.platform.value
    if backend.platform != protocol.Platform.CPU:
        described = f"{backend.platform.value} {backend.device_kind}".strip()
    if backend.runtime != protocol.Runtime.XLA:
        described += f" ({backend.runtime.value} {backend.target})".replace(" )", ")")
    return Hello(
        worker_id=worker_id,
        hostname=body.hostname,
        backend=described,
        platform=backend.platform,
        runtime=backend.runtime,
    )


def _version_advice(exc: protocol.VersionMismatch) -> str:
    """The mismatch told from the worker's side: both versions, and which side to upgrade."""
    ours = ", ".join(map(str, exc.supported))
    theirs = ", ".join(map(str, exc.peer_versions)) or "none"
    older = (
        "this shepherd"
        if exc.peer_versions and min(exc.peer_versions) > max(exc.supported)
        else "this worker"
    )
    return (
        f"protocol version mismatch: the shepherd (pcp-tui {__version__}) speaks protocol version {ours}, "
        f"this worker speaks {theirs}; upgrade pcp-tui on {older} (reinstall it from a newer checkout)"
    )
