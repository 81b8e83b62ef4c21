"""Adaptive inner steps (--adaptive-steps): a round does not wait for its slowest worker.

Plain DiLoCo gives every worker H inner steps, so a worker half as fast as the
others makes all of them idle for half of every round. Here each worker's round
is sized to its measured speed instead: the fastest trains H steps, a worker at
half its speed H / 2 (whole chunks, one at least), so all finish at about the
same time, and the token-weighted mean (`diloco/aggregate.py`) counts each
result for the tokens it trained on. This is the dynamic local updates of
asynchronous Local-SGD (Liu et al. 2024, "Asynchronous Local-SGD Training for
Language Modeling", DyLU): steps in proportion to speed, results by tokens.
A worker's speed is its last result's inner steps over its compute seconds; a
worker not yet measured trains H.
"""

from __future__ import annotations

from collections.abc import Iterable

from pcp_tui.shepherd.rounds import Round


class StepPacing:
    """Each worker's inner steps for the next round, from the speeds its results showed."""

    def __init__(self, inner_steps: int, chunk: int):
        self.inner_steps, self.chunk = inner_steps, chunk
        self.speeds: dict[str, float] = {}  # worker id -> inner steps per compute second

    def observe(self, current: Round) -> None:
        """Remember the speed each contributor of `current` trained at."""
        for worker in current.contributors:
            steps, seconds = current.steps_by_worker[worker], current.compute_seconds[worker]
            if steps > 0 and seconds > 0:
                self.speeds[worker] = steps / seconds

    def steps_for(self, workers: Iterable[str]) -> dict[str, int]:
        """worker id -> its inner steps: H for the fastest (and the unmeasured), fewer for slower."""
        workers = list(workers)
        known = [self.speeds[w] for w in workers if w in self.speeds]
        fastest = max(known, default=0.0)
        steps = {}
        for worker in workers:
            if worker not in self.speeds or fastest <= 0:
                steps[worker] = self.inner_steps
                continue
            share = self.inner_steps * self.speeds[worker] / fastest
            steps[worker] = max(self.chunk, int(share // self.chunk) * self.chunk)
        return steps
