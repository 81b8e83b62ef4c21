"""Join tokens: a worker proves it knows the token without sending it."""

from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 32


def new_token() -> str:
    """24 URL-safe characters, never starting with "-" (pasted after `--token`, such a token
    read as a flag: `error: argument --token: expected one argument`)."""
    while (token := secrets.token_urlsafe(18)).startswith("-"):
        pass
    return token


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(token: str, nonce: bytes, worker_id: str) -> bytes:
    """HMAC-SHA256 over the shepherd's fresh nonce and the worker's id.

    A captured proof is useless on another connection (new nonce) and the
    token itself never crosses the wire.
    """
    message = nonce + b"\x00" + worker_id.encode()
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def verify(token: str, nonce: bytes, worker_id: str, claimed: bytes) -> bool:
    return hmac.compare_digest(proof(token, nonce, worker_id), bytes(claimed))


def new_session_key() -> bytes:
    """A per-session secret the shepherd hands one admitted worker (in its welcome)."""
    return secrets.token_bytes(NONCE_BYTES)


def attach_proof(session_key: bytes, nonce: bytes, worker_id: str, index: int) -> bytes:
    """HMAC-SHA256 proving that extra connection `index` belongs to the session that got
    `session_key`: the token alone (which every worker has) cannot attach to another's session."""
    message = nonce + b"\x00" + worker_id.encode() + b"\x00" + str(index).encode()
    return hmac.new(session_key, message, hashlib.sha256).digest()


def verify_attach(
    session_key: bytes, nonce: bytes, worker_id: str, index: int, claimed: bytes
) -> bool:
    return hmac.compare_digest(attach_proof(session_key, nonce, worker_id, index), bytes(claimed))
