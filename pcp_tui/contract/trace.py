"""The message trace: one JSON line per Cap'n Proto message a side sends or receives.

For "what was the last thing said before it hung?": the shepherd and the
worker each write (`--trace FILE`) the time, peer, direction, kind, round,
tensor count, wire bytes and the seconds since that peer's previous message.
Tensor contents never go in. The file is bounded: past `max_bytes` it moves
to FILE.1 (replacing an older one) and a new FILE starts.

    jq -c 'select(.peer == "127.0.0.1:40123")' run.trace | tail -n 5
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import IO

from pcp_tui import protocol

__all__ = ["MessageTrace"]

_PEERS_REMEMBERED = 4096  # for since_previous; a flood of short connections cannot grow it


class MessageTrace:
    """Appends trace lines to `path`, flushed at once (a hang leaves the last line on disk).

    Raises OSError when the file cannot be opened. A later write error (a full
    disk) turns tracing off rather than disturbing the connection it observes.
    """

    def __init__(self, path: str, *, max_bytes: int = 64 * 2**20):
        self.path = path
        self.max_bytes = max_bytes
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the run
        self._previous: OrderedDict[str, float] = OrderedDict()

    def observer(self, peer: str) -> Callable[[str, protocol.Message], None]:
        """What a `MessageStream` to or from `peer` calls with ("sent" | "received", message)."""
        return lambda direction, message: self.write(peer, direction, message)

    def write(self, peer: str, direction: str, message: protocol.Message) -> None:
        if self._file is None:
            return
        now = time.time()
        previous = self._previous.pop(peer, None)
        self._previous[peer] = now
        if len(self._previous) > _PEERS_REMEMBERED:
            self._previous.popitem(last=False)
        row = {
            "time": round(now, 6),
            "peer": peer,
            "direction": direction,
            "kind": message.kind,
            "round": getattr(message.body, "round", None),
            "tensors": len(message.tensors),
            "bytes": message.wire_bytes,
            "since_previous": None if previous is None else round(now - previous, 6),
        }
        line = json.dumps(row) + "\n"
        try:
            if self._file.tell() + len(line) > self.max_bytes:
                self._rotate(self._file)
            self._file.write(line)
            self._file.flush()
        except OSError:
            self.close()

    def _rotate(self, full: IO[str]) -> None:
        full.close()
        os.replace(self.path, f"{self.path}.1")
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
