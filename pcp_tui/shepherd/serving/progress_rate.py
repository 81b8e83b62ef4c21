"""How many progress messages a worker's connection may send: a rate, and a flood that ends it.

A worker sends progress a few times a second (`worker/client.py`:
`PROGRESS_INTERVAL`, plus one at the end of each compiled call it makes). Each
message the shepherd takes moves the worker's row in the dashboard and adds a
point to the loss chart's history, so a peer sending valid progress without
pause would make the shepherd do that work, and fill the chart with values of
its choice, as fast as it can send. `ProgressRate` takes up to `RATE` a second
(`BURST` at once) and drops the rest unread beyond their decoding; a
connection whose dropped messages outrun `FLOOD_RATE` a second (`FLOOD_BURST`
at once) ends (`ConnectionLost`): no worker sends that many.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pcp_tui import protocol
from pcp_tui.contract.connection import ConnectionLost

RATE, BURST = 20.0, 40  # progress messages taken a second, and at once
FLOOD_RATE, FLOOD_BURST = 200.0, 1000  # dropped ones a second, and at once, before it ends


class TokenBucket:
    """`rate` tokens a second, at most `burst` kept; `take` spends one if there is one."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]):
        self.rate, self.burst, self._clock = rate, burst, clock
        self._tokens, self._at = float(burst), clock()

    def take(self) -> bool:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


class ProgressRate:
    """One connection's progress messages: taken within the rate, dropped beyond, ended past a flood."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._taken = TokenBucket(RATE, BURST, clock)
        self._flood = TokenBucket(FLOOD_RATE, FLOOD_BURST, clock)
        self.dropped = 0

    def admit(self) -> bool:
        """Whether to take the progress message just received; ConnectionLost for a flood."""
        if self._taken.take():
            return True
        self.dropped += 1
        if not self._flood.take():
            raise ConnectionLost(
                f"sent progress messages far faster than {RATE:g} a second ({self.dropped} "
                "dropped): a worker sends a few a second; this peer is not a pcp-tui worker, "
                "or a broken one",
                code=protocol.ErrorCode.MALFORMED.value,
            )
        return False
