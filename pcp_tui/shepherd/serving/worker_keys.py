"""--worker-keys: the keys the operator issued, re-read whenever the file changes.

Revoking a key is removing its line. The file is looked at (one `stat`) at every
handshake, before every round and at every result, and read again when it changed: a
removed key's worker cannot join again, and a connected one is dropped before the next
round (`WorkerPool.drop_revoked`), or as its result comes (that result is not taken).
No signal is needed, and none can be missed.

A line the shepherd cannot use is fatal when it starts (exit 2, the operator is at
hand); later, only that line is left out, and the run's events say which: the lines
that still hold keep their workers, and a removed line always revokes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from stat import S_ISREG

from pcp_tui import protocol
from pcp_tui.config import ConfigError
from pcp_tui.contract import keys

# a line is about 100 characters: room for thousands of keys, and read (on the event loop,
# at a handshake or before a round) in a fraction of a second
MAX_CHARS = 1024 * 1024
SHOWN = 3  # the lines left out that a re-read's event names, of however many
_NO_KEY = (
    "this shepherd admits only workers holding a key it issued (--worker-keys): start the "
    "worker with --key FILE (pcp-tui keygen --out FILE makes one and prints the line the "
    "operator adds)"
)


class WorkerKeys:
    """The issued keys of one --worker-keys file, kept current (see the module)."""

    def __init__(
        self,
        path: str,
        on_reread: Callable[[str], object] = lambda message: None,
        *,
        channel: str = "",
    ):
        """Read `path`; ConfigError (what to fix) if it cannot be read or a line is not a key.

        `on_reread(message)` is told, each time the file is read again, how many keys it
        now holds and which lines were left out. `channel`: this shepherd's certificate
        fingerprint ("" without TLS), which a hello's signature must cover.
        """
        self.path, self.channel = path, channel
        self._on_reread = on_reread
        self._missing = ""  # why the file could not be read, when it could not
        self._seen, issued = self._read()
        if issued is None:
            raise ConfigError(f"cannot read --worker-keys {path}: {self._missing}")
        if issued.problems:
            raise ConfigError(f"--worker-keys {issued.problems[0]}")
        if not issued.names:
            raise ConfigError(
                f"--worker-keys {path} holds no key: add one 'ssh-ed25519 KEY NAME' line per "
                "worker (pcp-tui keygen --out FILE prints it)"
            )
        self._names = issued.names

    def names(self) -> dict[bytes, str]:
        """Worker id by public key, as the file says now (read again if it changed)."""
        seen, issued = self._read(unless=self._seen)
        if seen == self._seen:
            return self._names
        self._seen = seen
        if issued is None:  # gone or unreadable: nobody holds a key until it is back
            self._names = {}
            self._on_reread(
                f"--worker-keys {self.path} cannot be read ({self._missing}): no worker is "
                "admitted, and connected ones leave before the next round, until it can"
            )
            return self._names
        self._names = issued.names
        problems = issued.problems
        more = f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
        left_out = f"; left out: {'; '.join(problems[:SHOWN])}{more}" if problems else ""
        self._on_reread(
            f"--worker-keys {self.path} read again: {len(issued.names)} key(s){left_out}"
        )
        return self._names

    def refusal(
        self, hello: protocol.WorkerHello, nonce: bytes, channel: str | None = None
    ) -> str | None:
        """Why `hello` (on the connection whose challenge is `nonce`) may not join; None if its
        key is issued to its worker id and signed this connection's challenge. `channel`: the
        certificate fingerprint the worker saw where it is not this shepherd's (a relay's)."""
        if not hello.public_key or not hello.signature:
            return _NO_KEY
        public = bytes(hello.public_key)
        shown = keys.fingerprint(public) if len(public) == keys.PUBLIC_KEY_BYTES else "(malformed)"
        name = self.names().get(public)
        if name is None:
            return (
                f"key {shown} is not in this shepherd's --worker-keys (never issued, or revoked): "
                "ask the operator to add its line (pcp-tui keygen printed it)"
            )
        if name != hello.worker_id:
            return (
                f"key {shown} is issued to worker id {name!r}, not {hello.worker_id!r}: one key "
                f"joins as one id; start the worker with --id {name}"
            )
        if not keys.verify_hello(
            public,
            hello.signature,
            nonce,
            hello.worker_id,
            hello.attach_index,
            self.channel if channel is None else channel,
        ):
            return (
                f"the hello's signature is not key {shown}'s over this connection's challenge "
                "and this shepherd's certificate: sign with the private key of that public key "
                "(--key), on the connection it is for (a worker that was shown another "
                "certificate reached another host first, which relayed it here: another "
                "shepherd, or a proxy that ends TLS, where TLS must end at this shepherd)"
            )
        return None

    def revoked(self, public: bytes, worker_id: str) -> str | None:
        """Why a connected worker admitted with key `public` as `worker_id` must leave; None if
        that key is still issued to that id."""
        name = self.names().get(public)
        if name == worker_id:
            return None
        if name is None:
            return f"its key {keys.fingerprint(public)} was removed from --worker-keys {self.path}"
        return f"its key {keys.fingerprint(public)} is now issued to {name!r} in {self.path}"

    def _read(
        self, unless: tuple[int, ...] | None = None
    ) -> tuple[tuple[int, ...], keys.IssuedKeys | None]:
        """(the file's identity and times, its keys) — its keys None if it cannot be read, and
        not read at all when the first is `unless` (it did not change)."""
        try:
            stat = os.stat(self.path)
        except OSError as exc:
            self._missing = exc.strerror or str(exc)
            return (), None
        seen = (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
        if seen == unless:
            return seen, None
        if not S_ISREG(stat.st_mode):  # a pipe's open or read would stop the event loop
            self._missing = "it is not a regular file (a pipe or <(...) is read once, then empty)"
            return seen, None
        # utf-8-sig: a byte order mark (Windows editors write one) is not line 1's text; a byte
        # that is not UTF-8 spoils its line only (surrogateescape: a character no line takes)
        try:
            with open(self.path, encoding="utf-8-sig", errors="surrogateescape") as file:
                text = file.read(MAX_CHARS + 1)
        except OSError as exc:
            self._missing = exc.strerror or str(exc)
            return seen, None
        if len(text) > MAX_CHARS:  # never a part: a cut line could name another id
            self._missing = f"it is over {MAX_CHARS} characters; is it the right file?"
            return seen, None
        return seen, keys.parse_worker_keys(text, self.path)
