"""The messages that open, keep and close a connection: handshake, heartbeat, error, goodbye.

A shepherd opens with `Hello` (versions and the join-token challenge), the
worker answers `WorkerHello` (who it is, its `BackendInfo`, its proof) and is
admitted with `Welcome`. `Heartbeat` keeps a quiet connection alive; `Error`
and `Goodbye` say why a side is about to close it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ._enums import ErrorCode, Platform, RelayOp, Runtime
from ._fields import REASON_CHARS, Body, _finite, _items, _text

MAX_SITE_PROCESSES = 1024  # hosts a site's hello may name


@dataclass(frozen=True)
class BackendInfo:
    """What a worker runs on, as it reports it in its hello."""

    platform: Platform = Platform.CPU
    device_kind: str = _text()
    device_count: int = 0
    memory_bytes: int = 0
    jax_version: str = _text()
    runtime: Runtime = Runtime.XLA
    target: str = _text()
    process_count: int = 0  # a site of several processes (jax.distributed); 0, 1: one
    hostnames: tuple[str, ...] = _items(MAX_SITE_PROCESSES)  # each process's, process 0 first


@dataclass(frozen=True)
class Hello(Body):
    """shepherd -> worker, first on a connection: versions and the join-token challenge."""

    KIND: ClassVar[str] = "hello"
    supported_versions: tuple[int, ...] = _items(16)
    nonce: bytes = field(default=b"", metadata={"bytes": 64})
    run_id: str = _text()
    software: str = _text()


@dataclass(frozen=True)
class WorkerHello(Body):
    """worker -> shepherd: who it is, what it runs on, its proof of the token and (for a
    shepherd with --worker-keys) its key's signature of the same challenge."""

    KIND: ClassVar[str] = "workerHello"
    supported_versions: tuple[int, ...] = _items(16)
    worker_id: str = _text()
    hostname: str = _text()
    backend: BackendInfo = field(default_factory=BackendInfo)
    proof: bytes = field(default=b"", metadata={"bytes": 64})
    software: str = _text()
    attach_index: int = 0  # > 0: an extra connection of a striped session (protocol 4)
    attach_proof: bytes = field(default=b"", metadata={"bytes": 64})
    public_key: bytes = field(default=b"", metadata={"bytes": 32})  # --worker-keys: its key
    signature: bytes = field(default=b"", metadata={"bytes": 64})  # and its Ed25519 signature
    relay: bool = False  # a relay, which carries its workers' connections once welcomed
    relay_fingerprint: str = _text()  # a relay: its workers' TLS certificate's ("" none)


@dataclass(frozen=True)
class Welcome(Body):
    """shepherd -> worker: admitted; its index (and so its shard) and the heartbeat interval."""

    KIND: ClassVar[str] = "welcome"
    worker_index: int = 0
    run_id: str = _text()
    heartbeat_seconds: float = _finite(2.0)
    streams: int = 0  # > 1: connections to stripe the session over (protocol 4; 0, 1: one)
    session_key: bytes = field(default=b"", metadata={"bytes": 64})
    key_checked: bool = False  # the hello's signature was checked (--worker-keys)


@dataclass(frozen=True)
class Heartbeat(Body):
    """Either way, while nothing else is sent: the peer is alive."""

    KIND: ClassVar[str] = "heartbeat"
    sent_at: float = _finite()


@dataclass(frozen=True)
class Error(Body):
    """Why the sender is about to close the connection (or refused one result: badResult)."""

    KIND: ClassVar[str] = "error"
    code: ErrorCode = ErrorCode.UNKNOWN
    message: str = _text(REASON_CHARS)


@dataclass(frozen=True)
class Goodbye(Body):
    """The sender closes the connection on purpose; `reason` is for people.

    `resumable` (shepherd -> worker): the run stopped before its end and its checkpoint
    lets `--resume` continue it, so the worker reconnects rather than exits.
    """

    KIND: ClassVar[str] = "goodbye"
    reason: str = _text(REASON_CHARS)
    resumable: bool = False


@dataclass(frozen=True)
class RelayFrame(Body):
    """relay <-> shepherd: one step of one worker's channel (`RelayOp`); data rides as a tensor."""

    KIND: ClassVar[str] = "relayFrame"
    channel: int = 0
    op: RelayOp = RelayOp.OPEN
    value: int = 0
    text: str = _text(REASON_CHARS)
    kept: tuple[int, ...] = _items(4096)  # data, repeat: kept buffers whose bytes go in
    kept_at: tuple[int, ...] = _items(4096)  # where each goes: after this many of its own bytes
