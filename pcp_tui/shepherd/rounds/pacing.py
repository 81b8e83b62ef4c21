"""Adaptive inner steps (--adaptive-steps): a round does not wait for its slowest worker.

Plain DiLoCo gives every worker H inner steps, so a worker half as fast as the
others makes all of them idle for half of every round. Here each worker's round
is sized to its measured speed instead: the fastest trains H steps, a worker at
half its speed H / 2 (whole chunks, one at least), so all finish at about the
same time, and the token-weighted mean (`diloco/aggregate.py`) counts each
result for the tokens it trained on. This is the dynamic local updates of
asynchronous Local-SGD (Liu et al. 2024, "Asynchronous Local-SGD Training for
Language Modeling", DyLU): steps in proportion to speed, results by tokens.

A worker's speed is an exponentially weighted mean of its rounds' inner steps
per compute second (`SpeedEstimate`): one slow round (a GC pause, a shared GPU)
moves it by `SMOOTHING` of the difference, not all the way, so it does not halve
the worker's next round; a lasting change still shows within a few rounds. The
first measurement on a connection is taken as it is: a worker that reconnects
(maybe on other hardware: a hello describes its machine, once per connection)
starts its estimate over, and trains H until it is measured there, as a worker
not yet measured does.

With Streaming DiLoCo (`--streaming-fragments F`) the worker's fragment schedule
is scaled to its steps H_k (`diloco/streaming.Schedule(H_k, F, τ)`): fragment p
is still sent and merged once a round, at the same fraction (p + 1) / F of every
worker's round, so the workers' results for p arrive together and p takes one
outer step a round, as with a fixed H. H_k is then a multiple of F chunks (each
fragment's share whole chunks) with τ below its share (see `StepPacing.for_config`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping

from pcp_tui.config.run import InnerConfig, schedule_problem
from pcp_tui.shepherd.rounds.record import WorkerRounds
from pcp_tui.shepherd.rounds.results import Round

SMOOTHING = 0.3  # weight of a round's measured speed in a worker's estimate


class SpeedEstimate:
    """One worker's inner steps per compute second: an exponentially weighted mean over rounds."""

    def __init__(self, smoothing: float = SMOOTHING):
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing {smoothing} must be in (0, 1]")
        self.smoothing = smoothing
        self.value: float | None = None  # None: not measured on this connection yet
        self._session: weakref.ref | None = None

    def update(self, speed: float, session: object | None = None) -> float:
        """Fold in one round's speed measured on `session` (its connection); the new estimate.

        A session other than the last one's (a reconnect) starts the estimate over
        from `speed`, as does the first measurement; None means "the same session".
        """
        if not self._measured_on(session):
            self.value = None
            self._session = weakref.ref(session)
        if self.value is None:
            self.value = speed
        else:
            self.value += self.smoothing * (speed - self.value)
        return self.value

    def on(self, session: object | None) -> float | None:
        """The estimate if it was measured on `session` (None: whichever), else None."""
        return self.value if self._measured_on(session) else None

    def _measured_on(self, session: object | None) -> bool:
        if session is None:
            return True
        return self._session is not None and self._session() is session


class StepPacing:
    """Each worker's inner steps for the next round, from the speeds its results showed."""

    def __init__(
        self, inner_steps: int, quantum: int, least: int | None = None, smoothing: float = SMOOTHING
    ):
        if inner_steps % quantum:
            raise ValueError(f"H = {inner_steps} is not a multiple of the step quantum {quantum}")
        self.inner_steps, self.quantum = inner_steps, quantum
        self.least = least or quantum  # the fewest steps a round may have
        self.smoothing = smoothing
        self.speeds: dict[str, SpeedEstimate] = {}  # worker id -> its estimate

    @classmethod
    def for_config(cls, inner: InnerConfig) -> StepPacing:
        """The pacing `inner` can schedule: whole chunks; with streaming, a whole fragment schedule.

        Streaming needs each of the F fragment shares of H_k to be whole chunks and
        longer than τ (`schedule_problem`), so H_k steps in multiples of F chunks
        and is at least the smallest such multiple that schedules.
        """
        if not inner.streaming:
            return cls(inner.steps, inner.chunk)
        quantum = inner.chunk * inner.streaming_fragments
        least = next(
            steps
            for steps in range(quantum, inner.steps + 1, quantum)
            if schedule_problem(steps, inner.streaming_fragments, inner.overlap_steps, inner.chunk)
            is None
        )
        return cls(inner.steps, quantum, least)

    def observe(self, current: Round) -> None:
        """Fold the speed each contributor of `current` trained at into its estimate."""
        connections = current.connections or {}
        for worker in current.contributors:
            steps, seconds = current.steps_by_worker[worker], current.compute_seconds[worker]
            self.measure(worker, steps, seconds, connections.get(worker))

    def measure(
        self, worker: str, steps: int, seconds: float, connection: object | None = None
    ) -> None:
        """Fold one result's speed (`steps` in `seconds`, on `connection`) into `worker`'s
        estimate. Late results count too: a worker too slow for the straggler window is
        measured by the result that came late, so its next round is sized to its speed
        instead of H again (it would only be late again).

        `seconds` is what the worker says it computed for; on a connection that measured
        its answer (`WorkerRounds.answer_seconds`: from its roundStart's delivery to its
        result's arrival, the shepherd's own clock) the longer of the two counts. A claim
        of 1% of its real time made the worker 100x the fastest, and every honest worker
        trained one chunk a round; now a claim can make a worker no faster than its
        results arrive."""
        record = getattr(connection, "rounds", None)  # a WorkerLink's record in the rounds
        answered = record.answer_seconds if isinstance(record, WorkerRounds) else {}
        if answered:
            seconds = max(seconds, max(answered.values()))
        if steps > 0 and seconds > 0:
            estimate = self.speeds.setdefault(worker, SpeedEstimate(self.smoothing))
            estimate.update(steps / seconds, connection)

    def speed(self, worker: str, connection: object | None = None) -> float | None:
        """The worker's estimated inner steps per compute second on `connection`; None if not
        measured there (a worker that reconnected is measured afresh)."""
        estimate = self.speeds.get(worker)
        return None if estimate is None else estimate.on(connection)

    def steps_for(
        self, workers: Iterable[str], connections: Mapping[str, object] | None = None
    ) -> dict[str, int]:
        """worker id -> its inner steps: H for the fastest (and the unmeasured), fewer for slower.

        `connections` (worker id -> the connection its roundStart goes to): a worker
        whose estimate was measured on another connection counts as unmeasured.
        """
        workers, connections = list(workers), connections or {}
        speeds = {w: self.speed(w, connections.get(w)) for w in workers}
        fastest = max((s for s in speeds.values() if s is not None), default=0.0)
        steps = {}
        for worker in workers:
            speed = speeds[worker]
            if speed is None or fastest <= 0:
                steps[worker] = self.inner_steps
                continue
            # the ratio first: H x s / s can round to just under H, and the floor below
            # would then take a whole quantum from the fastest worker (1 speed in 40)
            share = self.inner_steps * (speed / fastest)
            steps[worker] = max(self.least, int(share // self.quantum) * self.quantum)
        return steps
