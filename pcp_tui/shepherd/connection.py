"""The shepherd's side of one worker connection: the handshake, and the link it opens."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import trio

from pcp_tui import __version__, protocol
from pcp_tui.contract import auth
from pcp_tui.contract.connection import LINK_ERRORS, Connection, Refused
from pcp_tui.shepherd.state import RunState, WorkerView

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
    versions: tuple[int, ...] = ()  # the protocol versions the worker speaks
    nonce: bytes = b""  # this connection's challenge (an attach proof covers it too)
    attach_index: int = 0  # > 0: an extra connection for the worker's striped session
    attach_proof: bytes = b""


class WorkerLink(Connection):
    """One admitted worker: its connection, its view in RunState (whose bytes and
    last-heard time it keeps), and whether it is ready for rounds."""

    def __init__(
        self,
        stream: protocol.MessageStream,
        view: WorkerView,
        state: RunState,
        platform: protocol.Platform,
        runtime: protocol.Runtime = protocol.Runtime.XLA,
    ):
        super().__init__(stream, "shepherd", log=log, name=f"worker {view.index}: ")
        self.view = view
        self.platform = platform
        self.runtime = runtime  # with platform: which export this worker's plan carries
        self._state = state
        self.ready = trio.Event()
        self.ended = trio.Event()  # set once the connection is closed (its server task ends)
        self.versions: tuple[int, ...] = ()  # the protocol versions the worker speaks
        # while the worker is asked to open more connections (shepherd.striping)
        self.attachments = None

    @property
    def worker_id(self) -> str:
        return self.view.worker_id

    def on_sent(self, nbytes: int) -> None:
        self.view.bytes_out += nbytes
        self._state.bytes_sent += nbytes

    def on_received(self, message: protocol.Message) -> None:
        self.view.bytes_in += message.wire_bytes
        self._state.bytes_received += message.wire_bytes
        self.view.last_heard = time.monotonic()


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
    if not auth.verify(token, nonce, worker_id, body.proof):
        reason = "wrong or missing join token"
        await stream.send_error(
            "authFailed",
            f"{reason}: start the worker with the --token the shepherd printed (or PCP_TOKEN)",
        )
        raise Refused(reason, code="authFailed")
    backend = body.backend
    devices = max(backend.device_count, 1)  # a worker that does not say runs on one
    described = backend.platform.value
    if backend.platform != protocol.Platform.CPU:
        described = f"{backend.platform.value} {backend.device_kind}".strip()
    if devices > 1:
        described = f"{described} x{devices}"
    if backend.runtime != protocol.Runtime.XLA:
        described += f" ({backend.runtime.value} {backend.target})".replace(" )", ")")
    return Hello(
        worker_id,
        body.hostname,
        described,
        backend.platform,
        devices,
        backend.runtime,
        versions=body.supported_versions,
        nonce=nonce,
        attach_index=body.attach_index,
        attach_proof=body.attach_proof,
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
