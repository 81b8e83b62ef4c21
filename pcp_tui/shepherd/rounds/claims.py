"""What a worker's results may claim: no more than the roundStarts asked of its connection.

A result carries numbers the shepherd cannot see being made: the inner steps
it trained, the tokens those steps read (its weight in the token-weighted
mean, and in the shard ledger), and the compute seconds they took (the
worker's speed under --adaptive-steps, and the utilization columns). An
honest worker's numbers follow from what it was asked, so the shepherd bounds
each claim by that, per connection, and ends a connection whose claim is out
of bounds (`ConnectionLost`, with the reason):

- steps: the steps all its results reported never exceed the steps its
  roundStarts asked for (H_k each under --adaptive-steps, H otherwise);
- tokens: a result covers the steps since its fragment's previous result (plain
  DiLoCo: its round's), so its tokens are at most the steps reported since then
  (what the worker's own count, `worker/rounds.py`, is);
- compute seconds: never negative, and all reported on a connection fit in the
  wall time since its first roundStart (with `CLOCK_SLACK`, for two clocks).

What cannot be bounded this way: a worker claiming *less* compute time than it
took (so it looks faster, and --adaptive-steps gives the others fewer steps).
The shepherd's clock sees the result arrive, not when its computing began:
docs/faults.md says what that costs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pcp_tui import protocol
from pcp_tui.contract.connection import ConnectionLost

CLOCK_SLACK = (1.0, 0.01)  # (seconds, fraction of the wall time) the worker's clock may gain


class ResultClaims:
    """One connection's ledger: the steps asked of it, and the steps, tokens and seconds claimed."""

    def __init__(
        self,
        tokens_per_step: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        fragments: int = 1,
    ):
        self.tokens_per_step = tokens_per_step
        self.fragments = fragments  # the plan's: results name theirs where there are several
        self.asked = 0  # inner steps the roundStarts sent on this connection asked for
        self.reported = 0  # inner steps its results reported
        self.compute_seconds = 0.0  # compute seconds its results reported
        self._clock = clock
        self._first_asked: float | None = None
        self._reported_at: dict[int, int] = {}  # fragment -> `reported` after its last result

    def ask(self, steps: int) -> None:
        """A roundStart asking for `steps` inner steps goes out (call before sending it)."""
        if self._first_asked is None:
            self._first_asked = self._clock()
        self.asked += steps

    def check(self, body: protocol.RoundResult) -> None:
        """Count the result's claims; ConnectionLost if one is more than was asked or possible."""
        if self.asked == 0:
            return  # no roundStart went out here: no round takes it (a `late_result`, dropped)
        part = f", fragment {body.fragment}" if self.fragments > 1 else ""
        where = f"its result for round {body.round}{part}"
        self.reported += body.inner_steps
        if self.reported > self.asked:
            _refuse(
                f"{where} brings the inner steps it reported on this connection to "
                f"{self.reported}, but its roundStarts asked for {self.asked}"
            )
        covered = self.reported - self._reported_at.get(body.fragment, 0)
        self._reported_at[body.fragment] = self.reported
        most = covered * self.tokens_per_step
        if body.tokens > most:
            _refuse(
                f"{where} claims {body.tokens} tokens; the {covered} inner steps it covers "
                f"read {most}"
            )
        self._check_seconds(where, body.compute_seconds)

    def _check_seconds(self, where: str, seconds: float) -> None:
        if seconds < 0:
            _refuse(f"{where} claims {seconds:g} compute seconds")
        self.compute_seconds += seconds
        since = self._clock() - (self._first_asked or self._clock())
        fixed, rate = CLOCK_SLACK
        if self.compute_seconds > since * (1 + rate) + fixed:
            _refuse(
                f"{where} brings its compute time on this connection to "
                f"{self.compute_seconds:.1f} s, but its first roundStart went out {since:.1f} s ago"
            )


def _refuse(claim: str) -> None:
    raise ConnectionLost(
        f"{claim}: a worker reports what it was asked to train; this peer is not a pcp-tui "
        "worker, or a broken one",
        code=protocol.ErrorCode.BAD_RESULT.value,
    )
