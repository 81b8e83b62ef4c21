"""Loss-delta validation off the rounds' path: round r's results are checked while r + 1 trains.

Validation (`diloco/validation.py`) runs the model on the shepherd, two or three
forward passes over --eval-batches batches per result: on a CPU shepherd of a GPU
worker training GPT-2 124M, 30-50 s a round, for a worker that computes 1.4 s of
it (utilization 6-11%; 54-70% with --validate off). So a round's results pass
the cheap screens (names, shapes, finiteness, norms, tokens) as they arrive and
are folded in at once (`results.Round.add` keeps them); the round's outer step
goes out to the workers; and then its loss-delta check (`Check`) runs in a
thread, against θ as the round began (the workers' start: a copy, as the outer
steps write θ in place), while the next round trains.

Before round r + 1's outer step of a fragment, the engine joins round r's check
of it. If the check refused results, round r's outer step is recomputed without
them (`recompute`): the same aggregate, folded from its state as round r began
with the counted results in the order they came, and the same outer optimizer
from its state before round r's step, on θ before that step. The fragment's
tensors have not moved since round r's step (only its own step writes them), so
the result replaces θ and the optimizer state: they are then what a run that
refused those results as they came would hold, to the bit (`tests/
test_validation.py`). For Nesterov and SGD that is the same as adding the
difference of the two steps, which is linear in the aggregate, but without its
rounding. The aggregate's state (centered clip's center and history of median
distances, hence its radius) is replaced the same way, and round r + 1's results,
folded in as they came against the uncorrected center and radius, are folded
again against the corrected ones before its step (`RoundEngine._refold`): given
the same results, round r + 1's step is then the one a run that refused round
r's results as they came would take. What is not undone is that round r + 1's
workers trained from the uncorrected θ. With --compression, round r + 1's update
travels as its change from what the workers hold (the uncorrected θ), so it
carries the correction to them.

Only results of trusted workers go this way: until a result of a worker's has
counted, and again after one is refused (probation), its results are scored as
they come, before they are folded in, as every result once was
(`results.Round.suspect`). An attacker's result then reaches a step unchecked
only if it sent results that counted first, and then once before its probation.
A refusal is reported (`bad_result`, probation: `results.note_refusal`) as the
check ends, a round after the result came; the round's history entry then counts
only the results that passed (`RunState.count`). A round whose every result a check
refuses is not repeated: its step is undone and the run goes on. If round r's
check still runs when round r + 1's fragment closes, the step waits for it:
every result is checked, and the only stall left is a check longer than a whole
round. The run's last round is checked before the run ends, and a checkpoint
waits for the checks of the rounds it saves (`RoundEngine.settle`); the held-out
eval of round r evaluates θ as its check leaves it (`corrected`).

Memory: the round's results are held until their check ends (they were dropped
once folded in), plus copies of θ at the round's start, of each fragment's outer
state before its step, and of the aggregate's state (centered clip's center):
three model-sized copies a round, taken over the outer step's threads.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from pcp_tui.diloco.aggregate import Aggregate, CenteredClip
from pcp_tui.diloco.outer import OuterOptimizer
from pcp_tui.diloco.screening import BadResult
from pcp_tui.diloco.validation import Kept, LossDeltaValidator
from pcp_tui.shepherd.rounds.results import OpenRounds, note_refusal, tell_refused
from pcp_tui.shepherd.run.state import RunState

if TYPE_CHECKING:
    from pcp_tui.shepherd.serving.connection import WorkerLink


@dataclass
class Before:
    """A fragment as its round's outer step found it: what the step is recomputed from.

    Owned by the check: `recompute` consumes the optimizer state."""

    params: Mapping[str, np.ndarray]  # its tensors before the step (θ_r, corrected if it was)
    outer_state: Any  # its outer optimizer's state before the step (a copy; None: no step yet)
    aggregate: Mapping[str, np.ndarray]  # its aggregate's `state_arrays` as the round began
    step_scale: float  # the aggregate's step scale that round (centered clip)


@dataclass(frozen=True)
class Verdict:
    """A settled round: whose results count, and who sent results that were all refused."""

    number: int
    counted: list[str]
    uncounted: list[str]


@dataclass(frozen=True)
class Correction:
    """A fragment after its round's outer step without the refused results."""

    params: dict[str, np.ndarray]  # its tensors
    outer_state: Any  # its outer optimizer's state
    aggregate: dict[str, np.ndarray]  # its aggregate's `state_arrays` (centered clip's center)


def recompute(
    before: Before,
    counted: Sequence[Kept],
    aggregate: Aggregate,
    outer: OuterOptimizer,
) -> Correction:
    """The round's outer step as it would have been with only `counted`, in their order.

    `aggregate` and `outer` are fresh ones of the run's kinds: they take `before`'s
    state, as the live ones held it, and fold and step with the same arithmetic.
    """
    params = {n: np.array(v, np.float32) for n, v in before.params.items()}
    outer.state = before.outer_state
    if not counted:  # no step: the state stays as the round found it
        return Correction(params, outer.state, dict(before.aggregate))
    aggregate.load_state_arrays(before.aggregate)
    if isinstance(aggregate, CenteredClip):
        aggregate.step_scale = before.step_scale
    aggregate.reset()
    for kept in counted:
        aggregate.add(kept.tensors, kept.weight, key=kept.worker_id, share=kept.share)
    aggregate.finish()
    outer.apply(params, aggregate.sums, aggregate.scale)
    return Correction(params, outer.state, aggregate.state_arrays())


class Check:
    """Round `number`'s loss-delta check of fragment `fragment`'s results (`kept`), in a thread.

    `view()` is θ as the workers held it for this fragment's results (waits for the
    earlier fragments' steps); `before` what the round's step is recomputed from;
    `aggregate()` and `outer()` make fresh ones of the run's kinds; a refusal cuts its
    sender's window in the rounds open now (`open_rounds`). `done` is set once
    the check has ended, its refusals noted and its `correction` (if any) made.
    """

    def __init__(
        self,
        number: int,
        fragment: int,
        kept: Sequence[Kept],
        validator: LossDeltaValidator,
        view: Callable[[], Awaitable[Mapping[str, np.ndarray]]],
        before: Before,
        *,
        aggregate: Callable[[], Aggregate],
        outer: Callable[[], OuterOptimizer],
        links: Mapping[str, WorkerLink],
        state: RunState,
        open_rounds: OpenRounds,
    ):
        self.number, self.fragment, self.kept = number, fragment, tuple(kept)
        self._validator, self._view, self._before = validator, view, before
        self._aggregate, self._outer = aggregate, outer
        self._links, self._state, self._open = links, state, open_rounds
        self.refused: list[tuple[Kept, BadResult]] = []
        self.correction: Correction | None = None
        self.done = trio.Event()

    @property
    def counted(self) -> list[str]:
        """The workers whose results passed (valid once `done`)."""
        refused = {kept.worker_id for kept, _ in self.refused}
        return [kept.worker_id for kept in self.kept if kept.worker_id not in refused]

    async def run(self) -> None:
        """Score every kept result; recompute the step without the refused ones; report them."""
        try:
            params = await self._view()
            self.refused = await trio.to_thread.run_sync(self._judge, params)
            if self.refused:
                refused = {kept.worker_id for kept, _ in self.refused}
                counted = [kept for kept in self.kept if kept.worker_id not in refused]
                self.correction = await trio.to_thread.run_sync(
                    recompute, self._before, counted, self._aggregate(), self._outer()
                )
            for kept, exc in self.refused:
                if (link := self._links.get(kept.worker_id)) is not None:
                    note_refusal(self._state, link, self.number, self.fragment, exc, self._open)
        finally:
            self.done.set()
            self._before = None  # type: ignore[assignment]  # its copies are not needed now
        for kept, exc in self.refused:
            if (link := self._links.get(kept.worker_id)) is not None:
                await tell_refused(link, exc)

    def _judge(self, params: Mapping[str, np.ndarray]) -> list[tuple[Kept, BadResult]]:
        refused = []
        for kept in self.kept:
            if kept.checked:  # scored as it came (`Round.add`: its sender was on probation)
                continue
            try:
                self._validator.score(
                    kept.tensors,
                    int(kept.weight),
                    kept.assignment,
                    number=self.number,
                    params=params,
                )
            except BadResult as exc:
                refused.append((kept, exc))
        return refused


async def corrected(checks: Sequence[Check]) -> dict[str, np.ndarray]:
    """The tensors `checks` corrected, once they have ended: with θ as their round left it,
    θ as they leave it (the held-out eval of the round evaluates that)."""
    tensors: dict[str, np.ndarray] = {}
    for check in checks:
        await check.done.wait()
        if check.correction is not None:
            tensors.update(check.correction.params)
    return tensors
