"""The errors the wire codec raises: a small hierarchy that callers can act on.

Every failure caused by the bytes a peer sent is a `ProtocolError`. Its `code`
is the `ErrorCode` enumerant (see `pcp.capnp`) that the receiving side should
answer with before it closes the connection, so a handler can do::

    except protocol.ProtocolError as exc:
        await stream.send_error(exc.code, str(exc))
"""

from __future__ import annotations

from collections.abc import Iterable


class ProtocolError(Exception):
    """A peer sent bytes that break the PCP wire contract, or went away mid-conversation."""

    code: str = "unknown"


class VersionMismatch(ProtocolError):
    """The peer speaks no protocol version that this side speaks.

    `peer_versions` lists what the peer said it supports (its `supportedVersions`
    for hello/workerHello, else just the version stamped on its message);
    `supported` lists what this side speaks.
    """

    code = "versionMismatch"

    def __init__(self, peer_versions: Iterable[int], supported: Iterable[int]):
        self.peer_versions = tuple(int(v) for v in peer_versions)
        self.supported = tuple(int(v) for v in supported)
        super().__init__(_mismatch_text(self.peer_versions, self.supported))


def _mismatch_text(peer: tuple[int, ...], ours: tuple[int, ...]) -> str:
    older = ""
    if peer and ours:
        if max(peer) < min(ours):
            older = " (the peer looks older)"
        elif min(peer) > max(ours):
            older = " (this side looks older)"
    return (
        f"protocol version mismatch: the peer speaks {_versions(peer)}, this side speaks "
        f"{_versions(ours)}; upgrade pcp-tui on the older side{older}"
    )


def _versions(versions: tuple[int, ...]) -> str:
    return "version(s) " + ", ".join(map(str, versions)) if versions else "no version"


class FrameTooLarge(ProtocolError):
    """A frame, tensor count or tensor payload is beyond the receiver's `Limits`.

    Raised from the length fields alone, before anything of that size is
    allocated or read.
    """

    code = "tooLarge"


class MalformedMessage(ProtocolError):
    """The bytes are not a valid PCP message (bad Cap'n Proto, unknown enum, bad tensor header...)."""

    code = "malformed"


class NonFinite(MalformedMessage):
    """A number the message must hold finite (a loss, a time) is NaN or infinite, `field`
    naming it. A loss so is a diverged worker's (`is_loss`), told apart from other malformed
    bytes by its type and field, never by its text; any other is a peer breaking the rules."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field

    @property
    def is_loss(self) -> bool:
        """Whether the number is a training loss (a result's or a progress report's)."""
        return self.field.endswith(".loss") or ".losses[" in self.field


class ConnectionClosed(ProtocolError):
    """The peer closed the connection (cleanly between frames, or mid-frame: the message says which)."""

    code = "unknown"
