"""Weigh each pseudo-gradient by what it does to the loss on batches the shepherd picks.

Norm screens and robust aggregates judge a result by its distance to the others,
which says nothing about its direction: a sign-flipped result sits as far from the
center as an honest one, and tiny results from several ids shrink any radius that
counts them. This module checks a result against what it claims to be, the
outcome of H inner steps on the worker's assigned batches (Templar's "Gauntlet",
Lidin et al. 2025, scores a peer's pseudo-gradient by the loss before and after
applying it on data the validator picks; proof-of-learning work, Jia et al. 2021,
checks a claimed update by replaying the data that produced it):

    gain_k = L(θ; V_k) − L(θ − Δ_k; V_k)

V_k is drawn from the batches worker k trained on this round, known to the
shepherd from the plan, the run's seed and the sample stream (slot, round,
chunk). θ − Δ_k is the worker's own end point, so an honest result lowers these
losses by what its H steps did; a sign flip, a random direction or an overshoot
raises them; a vanishing result lowers them by almost nothing.

A result is refused (`BadResult`, `Refusal.NO_GAIN`) only if it does not lower
that loss by more than `MIN_GAIN` of it *and* its reverse θ + Δ_k does at least
as well as θ − Δ_k. The second half is what keeps honest results in: an honest
worker's end point can sit higher than θ on its own batches (measured: round 8 of
`tests/test_elastic.py`'s 2-worker run, 3.173 → 3.320, both workers; the outer
step had overshot along the direction the workers' kept AdamW moments still
pushed, and the next round's loss spiked), but its direction is still downhill:
L(θ + Δ) − L(θ − Δ) ≈ 2 g·Δ, the curvature that made the step overshoot cancels.
A sign flip is exactly the honest result's reverse, so it is refused whenever the
honest one would pass this half; a vanishing result moves neither loss. A result
that leaves its own batches' loss over `BLOW_UP` times higher (or non-finite) is
refused whatever its reverse does (`Refusal.BLOWN_UP`: the inner training diverged,
`shepherd/rounds/divergence.py` reads it). One that passes keeps its token weight.
The shepherd runs these checks after the round's outer step, while the next
round trains, and takes a refused result out of its round's step then
(`shepherd/rounds/checks.py`).

Streaming DiLoCo scores each fragment's results with the fragment's own validator,
the same way: Δ_f names fragment f's tensors only, and θ − Δ_f moves those alone.
θ is what the worker held outside f's own progress when it sent Δ_f: fragment f's
global value as it was sent (it changes only at f's own sync), the new global
values of the fragments before f (the worker merged them before f's send point;
f's check starts once their outer steps are done) and the round's start for the
later ones (all read from copies: outer steps write in place). Scored
with the earlier fragments at the round's start instead, honest fragment results
were refused (inner SGD at lr 0.1, the paper's mix at α = 0: 3 of 16 in 4 rounds;
none so; docs/security.md has the rest). V_f is drawn from the worker's steps of
this round before f's send step (the `Assignment`'s steps): Δ_f covers those,
plus the previous round's steps after f's send, not drawn.

Weights scaled by the gain against recent gains (tokens x min(1, gain / reference),
refusing gains under a tenth of it) were tried and taken out: in a run that converges fast
(the MLP example) honest gains shrink more than tenfold within a few rounds, and
honest results were refused against the earlier, larger ones; and an overscaled
update that overfits its own batches raised the reference itself.
Scoring also on unseen rows of the worker's shard, and taking a result at the scale they
support, was measured against Δ scaled to the inner-optimizer bound and not kept: in the
warm-up rounds the larger step lowers the loss on every row, and a check one round late
lets the first overscaled step in (docs/security.md, `benchmarks/bench_overshoot.py`).

Cost, on the shepherd's device: two passes of the exported `score_loss` graph over
R = --validate-rows rows (θ and θ − Δ_k on V_k) per result, plus one
subtraction the size of the result; a third (θ + Δ_k) only for a result that does
not lower the loss. R, not the run's batch size, sets the cost: GPT-2 124M at 64 x 1024
a batch took 47–63 s of a 64-core CPU a result over one whole batch (issue 29's run). A
fragment result costs the same two passes of the whole model (F results a worker a
round: F times a plain round's scoring), and a streaming round one model-sized copy.
"""

from __future__ import annotations

import math
import secrets
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pcp_tui import protocol
from pcp_tui.diloco.screening import BadResult, Refusal
from pcp_tui.training import shards

if TYPE_CHECKING:
    from pcp_tui.config import RunConfig
    from pcp_tui.training.workload import Workload

# refuse a result that lowers the loss on its own batches by less than this of it: above the
# float32 noise of two evaluations (~1e-7), far below what H honest steps do to their own batches
MIN_GAIN = 1e-5
# a result that leaves its own batches' loss this many times higher diverged (`Refusal.BLOWN_UP`)
BLOW_UP = 2.0

#: (params, batches [N, ...] as the eval graph takes them) → mean loss
Loss = Callable[[Mapping[str, np.ndarray], Any], float]


@dataclass(frozen=True)
class Assignment:
    """What a result trained on: the worker's index (its sample stream), its data shard, and
    its steps of the round before the result left (H_k; a fragment's: its send step)."""

    index: int
    shard: int
    steps: int


@dataclass(frozen=True)
class Kept:
    """A result folded into its round before its check (`shepherd/rounds/checks.py`): its
    sender, tensors, weight in the aggregate (its tokens x its share) and what it trained on."""

    worker_id: str
    tensors: Mapping[str, np.ndarray]
    weight: float
    assignment: Assignment
    checked: bool = False  # scored before it was folded in (its sender was on probation)
    share: float = 1.0  # of its address's weight (`--weight-per address`): `Aggregate.add`


class AssignedBatches:
    """R rows of the batches a worker trained on in a round, drawn as the worker draws them.

    The R rows come from R steps spread over the assignment's steps, one row of each step's
    batch, which row drawn from the shepherd's own randomness (`rng`; the OS's by default) as
    the result is scored: the worker, which knows its batches from the plan and the seed,
    cannot know which rows will judge it, so a result must lower the loss on all of them.
    """

    def __init__(
        self,
        shard_data: list[Any],
        *,
        rows: int,
        chunk_steps: int,
        batch_size: int,
        seq_len: int,
        seed: int,
        rng: np.random.Generator | None = None,
    ):
        self._shards = [
            shard if isinstance(shard, np.ndarray) else tuple(shard.values())
            for shard in shard_data
        ]
        self.rows, self.chunk_steps = rows, chunk_steps
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self._rng = rng if rng is not None else np.random.default_rng(secrets.randbits(128))
        self._drawing = threading.Lock()  # a Generator is not for two threads at once

    @classmethod
    def for_run(
        cls,
        config: RunConfig,
        workload: Workload,
        chunk_steps: int,
        rng: np.random.Generator | None = None,
    ) -> AssignedBatches:
        """The rows of a run's workers, --validate-rows of them a result, as `config` and the
        exported graphs' `chunk_steps` draw them (`rng` as the constructor's)."""
        return cls(
            workload.shards,
            rows=config.outer.validate_rows,
            chunk_steps=chunk_steps,
            batch_size=config.data.batch_size,
            seq_len=config.data.seq_len,
            seed=config.model.seed,
            rng=rng,
        )

    def __call__(self, assignment: Assignment, number: int) -> Any:
        """[1, R, ...] rows (a tuple of them for a rows dataset): one of each of R steps spread
        over the assignment's steps of round `number`, as `score_loss` takes them."""
        shard = self._shards[assignment.shard]
        kind = (
            protocol.BatchKind.WINDOWS if isinstance(shard, np.ndarray) else protocol.BatchKind.ROWS
        )
        steps = max(assignment.steps, 1)
        picked = np.linspace(0, steps - 1, self.rows).round().astype(int)
        with self._drawing:  # a round's check thread and a probation's scoring may both draw
            rows = self._rng.integers(self.batch_size, size=self.rows)
        chunks: dict[int, Any] = {}
        for step in picked:
            chunk = int(step) // self.chunk_steps
            if chunk not in chunks:
                chunks[chunk] = shards.sample_shard(
                    kind,
                    shard,
                    steps=self.chunk_steps,
                    batch_size=self.batch_size,
                    seq_len=self.seq_len,
                    seed=self.seed,
                    stream=(assignment.index, number, chunk),
                )
        at = [(chunks[int(s) // self.chunk_steps], int(s) % self.chunk_steps) for s in picked]
        if kind == protocol.BatchKind.WINDOWS:
            return np.stack([batches[i][r] for (batches, i), r in zip(at, rows, strict=True)])[None]
        return tuple(
            np.stack([batches[k][i][r] for (batches, i), r in zip(at, rows, strict=True)])[None]
            for k in range(len(shard))
        )


class LossDeltaValidator:
    """Scores a round's results by the loss change they cause; refuses those that go nowhere.

    `score(pseudo_gradient, tokens, assignment, number=, params=)` per result, against the
    parameters its round started from; it keeps no state of a round, so checks of two rounds
    (or a probation's scoring beside a round's check) may run at once.
    """

    def __init__(
        self,
        loss: Loss,
        batches: Callable[[Assignment, int], Any],
        *,
        min_gain: float = MIN_GAIN,
    ):
        self._loss, self._batches = loss, batches
        self.min_gain = min_gain
        self.passes = 0  # eval-graph calls made (two a result, three for one that lowers none)

    def _moved(self, params, pseudo_gradient, sign: int, batches) -> float:
        """The loss at θ + sign·Δ on `batches`, the tensors Δ does not name as θ has them."""
        step = np.add if sign > 0 else np.subtract
        moved = dict(params)
        moved.update({n: step(params[n], d, dtype=np.float32) for n, d in pseudo_gradient.items()})
        self.passes += 1
        return self._loss(moved, batches)

    def score(
        self,
        pseudo_gradient: Mapping[str, np.ndarray],
        tokens: int,
        assignment: Assignment,
        *,
        number: int,
        params: Mapping[str, np.ndarray],
    ) -> float:
        """The result's weight in the mean, scored against round `number`'s starting `params`
        (every tensor; a result moves those it names): BadResult if it raises or keeps the
        loss on its own batches while its reverse does at least as well, or blows it up."""
        batches = self._batches(assignment, number)
        self.passes += 1
        before = self._loss(params, batches)
        after = self._moved(params, pseudo_gradient, -1, batches)
        if not math.isfinite(after) or after > BLOW_UP * abs(before):
            raise BadResult(
                f"applied to the round's parameters it changes the loss on its own batches "
                f"from {before:.4g} to {after:.4g}, over {BLOW_UP:g}x: its training diverged",
                Refusal.BLOWN_UP,
            )
        tolerance = self.min_gain * abs(before)
        if before - after > tolerance:
            return float(tokens)
        reverse = self._moved(params, pseudo_gradient, +1, batches)
        if reverse - after > tolerance:  # downhill, overshooting: as an honest end point can
            return float(tokens)
        raise BadResult(
            f"applied to the round's parameters it changes the loss on its own batches "
            f"from {before:.4g} to {after:.4g}, and its reverse to {reverse:.4g}; a result "
            f"must lower it, or at least do better than its reverse, by over "
            f"{self.min_gain:g} of it",
            Refusal.NO_GAIN,
        )


def eval_loss(graph_call: Callable[..., Any], names: tuple[str, ...]) -> Loss:
    """A `Loss` over the exported eval graph (`training/export.py` `eval_loss`)."""

    def loss(params: Mapping[str, np.ndarray], batches: Any) -> float:
        return float(graph_call(tuple(params[n] for n in names), batches))

    return loss
