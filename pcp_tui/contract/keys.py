"""Worker keys: Ed25519 credentials an operator issues to workers, one key to one worker id.

The shared join token says only "one of us"; a run with `--worker-keys FILE` also asks
each worker to sign its hello with a key the operator listed, so a token holder cannot
join as more ids than it was given keys. The files are OpenSSH's: a private key as
`pcp-tui keygen` or `ssh-keygen -t ed25519 -N ''` writes it, and public lines as in
`authorized_keys` (`ssh-ed25519 AAAA... NAME`), NAME being the worker id the key is
issued to.

The signature covers the connection's fresh nonce (the same challenge the token's proof
answers), the worker id, the attach index and the channel: the SHA-256 of the TLS
certificate the worker was shown ("" over plain TCP). A captured signature is worthless
on another connection, a key signs for its one id only, and a shepherd (or anyone the
worker was made to trust) that relays a worker's handshake to another shepherd gets a
signature for its own certificate, which the other refuses. Over plain TCP nothing binds
the signature to a shepherd: run keyed workers over TLS.
"""

from __future__ import annotations

import base64
import hashlib
import os
import platform
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pcp_tui import __version__, protocol
from pcp_tui.config import ConfigError
from pcp_tui.contract import auth

KEY_TYPE = "ssh-ed25519"
PUBLIC_KEY_BYTES = 32
_SIGNED = b"pcp-tui workerHello\x00"  # what a hello signature is, never another message's
_NAME_CHARS = 128  # a worker id's bound (protocol.ID_CHARS)


def generate() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def write_private_key(key: Ed25519PrivateKey, path: str) -> None:
    """Write `key` to a new file `path`, readable by its owner only (0600); ConfigError if
    the file exists (a key is never overwritten) or cannot be written."""
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(
            f"{path} exists: pcp-tui never overwrites a key; pass another --out or remove it"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot write {path} ({exc.strerror or exc})") from None
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def load_private_key(path: str) -> Ed25519PrivateKey:
    """The Ed25519 key in OpenSSH file `path`; ConfigError (what to do) if it is not one."""
    try:
        with open(path, "rb") as file:
            data = file.read(64 * 1024)
    except OSError as exc:
        raise ConfigError(f"cannot read --key {path} ({exc.strerror or exc})") from None
    try:
        key = serialization.load_ssh_private_key(data, password=None)
    except TypeError:
        raise ConfigError(
            f"--key {path} is protected by a passphrase: pcp-tui reads unencrypted keys "
            "(make one with pcp-tui keygen, or remove the passphrase: ssh-keygen -p -N '' -f FILE)"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise ConfigError(
            f"--key {path} is not an OpenSSH private key: make one with pcp-tui keygen --out FILE"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(
            f"--key {path} is not an Ed25519 key: make one with pcp-tui keygen --out FILE"
        )
    return key


def public_bytes(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    """The 32 bytes of a public key (of a private key's public half), as a hello carries it."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_line(key: Ed25519PrivateKey, name: str) -> str:
    """`ssh-ed25519 AAAA... NAME`: the line the operator puts in --worker-keys for this key."""
    blob = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return f"{blob.decode()} {name}"


def fingerprint(public: bytes) -> str:
    """`SHA256:...` as `ssh-keygen -l` shows the key whose 32 public bytes are `public`."""
    blob = _ssh_string(KEY_TYPE.encode()) + _ssh_string(public)
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def _ssh_string(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def _signed(nonce: bytes, worker_id: str, attach_index: int, channel: str) -> bytes:
    return b"\x00".join(
        (_SIGNED + nonce, worker_id.encode(), str(attach_index).encode(), channel.encode())
    )


def sign_hello(
    key: Ed25519PrivateKey, nonce: bytes, worker_id: str, attach_index: int, channel: str
) -> bytes:
    """The hello's signature on connection `nonce` for `worker_id` (64 bytes), over the
    shepherd certificate's `channel` fingerprint as the worker saw it ("": plain TCP)."""
    return key.sign(_signed(nonce, worker_id, attach_index, channel))


def verify_hello(
    public: bytes,
    signature: bytes,
    nonce: bytes,
    worker_id: str,
    attach_index: int,
    channel: str,
) -> bool:
    """Whether `signature` is `public`'s over this connection's nonce, id, attach index
    and this shepherd's certificate fingerprint (`channel`, "" over plain TCP)."""
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public)).verify(
            bytes(signature), _signed(nonce, worker_id, attach_index, channel)
        )
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class IssuedKeys:
    """What a --worker-keys file says: worker id by public key, and the lines it could not use."""

    names: dict[bytes, str]
    problems: tuple[str, ...] = ()


def parse_worker_keys(text: str, path: str) -> IssuedKeys:
    """The keys of a --worker-keys file's `text`: one `ssh-ed25519 AAAA... NAME` a line, blank
    lines and `#` comments aside. A line that is not one, and both lines of a key or a name
    given twice (one key is one id), are left out and named in `problems`."""
    names: dict[bytes, str] = {}
    lines: dict[bytes, int] = {}
    by_name: dict[str, int] = {}
    problems: list[str] = []
    ambiguous: set[bytes] = set()
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        where = f"{path} line {number}"
        parsed = _parse_line(words)
        if isinstance(parsed, str):
            problems.append(f"{where}: {parsed}")
            continue
        public, name = parsed
        if public in lines:
            problems.append(f"{where}: the key of line {lines[public]} again (one key, one id)")
            ambiguous.add(public)
            continue
        if name in by_name:
            problems.append(f"{where}: {name!r} was issued a key on line {by_name[name]} already")
            ambiguous.update(k for k, n in names.items() if n == name)
            continue
        names[public], lines[public], by_name[name] = name, number, number
    return IssuedKeys({k: n for k, n in names.items() if k not in ambiguous}, tuple(problems))


def name_problem(name: str) -> str | None:
    """What keeps `name` from being a key's worker id (one word a line can hold); None if fine."""
    if not name or not name.isprintable() or any(c.isspace() for c in name):
        return "a key's name is its worker id: printable characters, no spaces"
    if len(name) > _NAME_CHARS:
        return f"a key's name is its worker id: at most {_NAME_CHARS} characters"
    return None


def _parse_line(words: list[str]) -> tuple[bytes, str] | str:
    """(public key bytes, name) of one line's words, or what is wrong with them."""
    if words[0] != KEY_TYPE:
        return f"wants {KEY_TYPE} keys (pcp-tui keygen writes them), got {words[0][:32]!r}"
    if len(words) != 3:
        return f"wants '{KEY_TYPE} KEY NAME', NAME being the worker id the key is issued to"
    name = words[2]
    problem = name_problem(name)
    if problem is not None:
        return problem
    try:
        blob = base64.b64decode(words[1], validate=True)
    except ValueError:  # binascii.Error, or a character beyond ASCII ("AAAA…" pasted)
        return "the key is not base64"
    kind = _ssh_string(KEY_TYPE.encode())
    if not blob.startswith(kind) or blob[len(kind) :][:4] != PUBLIC_KEY_BYTES.to_bytes(4, "big"):
        return f"the key is not an {KEY_TYPE} public key"
    public = blob[len(kind) + 4 :]
    if len(public) != PUBLIC_KEY_BYTES:
        return f"the key is not an {KEY_TYPE} public key"
    return public, name


def signed_hello(
    token: str,
    key: Ed25519PrivateKey | None,
    nonce: bytes,
    worker_id: str,
    *,
    channel: str,
    attach_index: int = 0,
    session_key: bytes = b"",
    **fields: Any,
) -> protocol.WorkerHello:
    """The hello of `worker_id` (a worker's, or a relay's with `relay=True`) on a connection
    whose challenge is `nonce` and whose shepherd showed the certificate `channel` ("": plain
    TCP): the token's proof, with `key` its signature, with `attach_index` the proof that it
    belongs to the session of `session_key`; `fields`: the rest of the message."""
    return protocol.WorkerHello(
        supported_versions=protocol.SUPPORTED_VERSIONS,
        worker_id=worker_id,
        hostname=platform.node()[: protocol.ID_CHARS],
        proof=auth.proof(token, nonce, worker_id),
        software=f"pcp-tui {__version__}",
        attach_index=attach_index,
        attach_proof=(
            auth.attach_proof(session_key, nonce, worker_id, attach_index) if attach_index else b""
        ),
        public_key=public_bytes(key) if key else b"",
        signature=sign_hello(key, nonce, worker_id, attach_index, channel) if key else b"",
        **fields,
    )
