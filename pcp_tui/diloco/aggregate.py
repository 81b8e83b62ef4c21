"""How a round's pseudo-gradients become one: robust against a minority of workers.

`mean` is DiLoCo's token-weighted mean (`outer.PseudoGradientMean`): any one
worker moves it as far as it likes. The others bound what a minority can do:

- `centered-clip` (the default; Karimireddy, He and Jaggi 2021, "Learning from
  history for Byzantine robust optimization"): every result is pulled back to
  within a radius of the previous round's aggregate before the token-weighted
  mean, so a worker moves the round by at most radius x its token share. The
  radius is `CLIP_FACTOR` x the median distance of recent results from their
  center, each divided by its round's `step_scale` (the sum of the inner
  learning rates of the round: updates grow with warm-up and shrink with decay):
  a median that a minority cannot move. It streams (one running sum plus the
  center: two model-sized buffers), like the mean.
- `median` and `trimmed-mean` (Yin et al. 2018, "Byzantine-robust distributed
  learning"): per coordinate over the round's results, ignoring token counts.
  They need every result at once: k model-sized float32 copies for k results.

On top of any of them, `inner_update_bound` refuses (in the screen) a result
that no honest inner optimizer can produce, from the very first result of a run.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Mapping

import numpy as np

from pcp_tui.diloco import fused
from pcp_tui.diloco.fused import CHUNK
from pcp_tui.diloco.outer import PseudoGradientMean

CLIP_FACTOR = 2.0  # clip radius: this many times the median distance of recent results
CLIP_WINDOW = 32  # recent distances the median is taken over (a few rounds of results)
TRIM = 0.2  # trimmed mean: the fraction of results dropped at each end, per coordinate
BOUND_MARGIN = 1.01  # float32 rounding of θ − θ_k on top of the exact bound


def inner_update_bound(
    name: str,
    lr: float,
    steps: int,
    param_count: int,
    param_norm: float,
    *,
    weight_decay: float = 0.0,
    grad_clip: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.95,
) -> float:
    """The largest L2 norm an honest worker's pseudo-gradient can have (inf if unbounded).

    AdamW: per coordinate |m̂_t / √v̂_t| is at most
    (1-b1)/√(1-b2) · √(Σ_{k<t} (b1²/b2)^k) · √(1-b2^t)/(1-b1^t) (Cauchy-Schwarz on
    the moment sums; Kingma and Ba 2015, §2.1, bound the same step), and decoupled
    weight decay adds lr·wd·|θ|. SGD after global-norm clipping moves at most lr·clip
    a step. `lr` is the schedule's peak, so warm-up and decay only loosen the bound.
    The bound holds whatever the data: it refuses a result that did not come from
    the plan's optimizer, never an honest one.
    """
    if name == "sgd":
        return lr * grad_clip * steps * BOUND_MARGIN if grad_clip > 0 else math.inf
    ratio = b1 * b1 / b2
    if ratio >= 1:
        return math.inf
    per_coordinate, series = 0.0, 0.0
    for t in range(1, steps + 1):
        series += ratio ** (t - 1)
        factor = (1 - b1) / math.sqrt(1 - b2) * math.sqrt(series)
        per_coordinate = max(per_coordinate, factor * math.sqrt(1 - b2**t) / (1 - b1**t))
    moved, norm = 0.0, param_norm
    for _ in range(steps):
        step = lr * (per_coordinate * math.sqrt(param_count) + weight_decay * norm)
        moved, norm = moved + step, norm + step
    return moved * BOUND_MARGIN


def distance(tensors: Mapping[str, np.ndarray], center: Mapping[str, np.ndarray] | None) -> float:
    """L2 distance between two pseudo-gradients (the norm of the first if `center` is None).

    Each cache-sized piece is a float32 BLAS dot (its rounding is ~1e-7 of the
    piece's sum), and the pieces add up in float64. Converting every piece to
    float64 first made this the shepherd's largest cost on a 124M-parameter
    model (about 2 s per result, on the round's critical path).
    """
    total = 0.0
    scratch = np.empty(CHUNK if center is not None else 0, np.float32)
    for name, array in tensors.items():
        flat = np.ravel(np.asarray(array, np.float32))
        reference = None if center is None else np.ravel(np.asarray(center[name], np.float32))
        for start in range(0, flat.size, CHUNK):
            part = flat[start : start + CHUNK]
            if reference is not None:
                part = np.subtract(part, reference[start : start + CHUNK], out=scratch[: part.size])
            total += float(np.dot(part, part))
    return math.sqrt(total)


class CenteredClip:
    """Token-weighted mean of results clipped to a ball around the previous aggregate.

    A result Δ_k at distance d_k from the center v counts as
    v + (Δ_k − v)·s_k with s_k = min(1, radius / d_k). Streamed as
    Σ w_k s_k Δ_k + v·Σ w_k (1 − s_k): one running sum, the center added at the end.
    A round without earlier distances from a center (the run's first two: the
    first has no center, its distances are norms; or the first after resuming a
    checkpoint that predates this state) holds its results until it closes and
    takes the radius from their own median: k model-sized copies, those rounds only.

    The center is the previous aggregate scaled to this round's learning rate:
    v · step_scale / (its round's step_scale). Unscaled, a round whose Σ lr fell
    by more than about half (decay's tail, warm-up's peak behind it) found every
    honest result far from a center too large for it and pulled them all back
    toward it, repeating part of the larger step before.
    """

    def __init__(
        self, names: tuple[str, ...], factor: float = CLIP_FACTOR, window: int = CLIP_WINDOW
    ):
        self._names = names
        self._factor = factor
        self._sum = PseudoGradientMean(names)
        self._recent: collections.deque[float] = collections.deque(maxlen=window)
        self._round: list[float] = []
        self._held: list[tuple[dict[str, np.ndarray], float]] = []
        self._scales: list[float] = []
        self.center: dict[str, np.ndarray] | None = None
        self.center_scale = 0.0  # the step_scale of the round the center comes from (0: unknown)
        self.radius = math.inf
        self.step_scale = 1.0  # what this round's updates scale with (Σ inner lr); set per round
        self.total_weight = 0.0
        self._center_weight = 0.0
        self.contributors = 0

    @property
    def threads(self) -> int:
        """Threads of each fold and of the close (`fused.over_chunks`)."""
        return self._sum.threads

    @threads.setter
    def threads(self, count: int) -> None:
        self._sum.threads = count

    def reset(self) -> None:
        """Start a round: its radius comes from the distances of earlier rounds."""
        self._sum.reset()
        self._round, self._held, self._scales = [], [], []
        self.total_weight = self._center_weight = 0.0
        self.contributors = 0
        self.radius = self._radius(self._recent) if self._recent else math.inf

    def _scale_center(self) -> None:
        """Bring the center to this round's step_scale (once a round, with its first result).

        A model-sized multiply: it runs where results are folded in (a worker thread for
        large ones), not when the round is set up on the event loop.
        """
        if self.center is not None and self.center_scale > 0 and self.step_scale > 0:
            ratio = np.float32(self.step_scale / self.center_scale)
            if ratio != 1:
                for value in self.center.values():
                    np.multiply(value, ratio, out=value)
        self.center_scale = self.step_scale

    def _radius(self, relative_distances) -> float:
        typical = statistics.median(relative_distances) * self.step_scale
        return self._factor * typical if typical > 0 else math.inf  # a zero median says nothing

    def add(self, pseudo_gradient: Mapping[str, np.ndarray], weight: float) -> None:
        """Fold one result in (or hold it, in a round without history)."""
        if weight <= 0:
            raise ValueError("a pseudo-gradient needs a positive weight (tokens)")
        result = {n: pseudo_gradient[n] for n in self._names}
        if self.contributors == 0:
            self._scale_center()
        gap = distance(result, self.center)
        self._round.append(gap / self.step_scale if self.step_scale > 0 else 0.0)
        self.contributors += 1
        if not self._recent:
            self._held.append(({n: np.array(v, np.float32) for n, v in result.items()}, weight))
            return
        self._fold(result, weight, gap)

    def _fold(self, result: Mapping[str, np.ndarray], weight: float, gap: float) -> None:
        scale = min(1.0, self.radius / gap) if gap > 0 else 1.0
        self._sum.add(result, weight * scale)
        self.total_weight += weight
        self._center_weight += weight * (1.0 - scale)
        self._scales.append(scale)

    def finish(self) -> list[float]:
        """Close the round; returns the factor each result was scaled by, in the order added.

        Adds the center's share to the sum, then remembers the aggregate (the next
        center) and the round's distances (the next radius).
        """
        if self._held:
            self.radius = self._radius(self._round)
            for (result, weight), relative in zip(self._held, self._round, strict=True):
                self._fold(result, weight, relative * self.step_scale)
            self._held = []
        sums = self._sum.sums
        share = None  # the center's share, added to the sum in the same pass as the new center
        if self.center is None:  # the first round's distances are norms: no history for later
            self.center = {n: np.empty_like(v) for n, v in sums.items()}
        else:
            self._recent.extend(self._round)
            share = np.float32(self._center_weight) if self._center_weight > 0 else None
        rows = [(sums[n], self.center[n]) for n in self._names]
        fused.over_chunks(fused.center_chunk, rows, (share, self.scale), self.threads)
        return self._scales

    @property
    def sums(self) -> Mapping[str, np.ndarray]:
        return self._sum.sums

    @property
    def scale(self) -> np.float32:
        if not self.contributors:
            raise ValueError("no pseudo-gradient was added")
        return np.float32(1.0 / self.total_weight)

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Center and recent distances, for the checkpoint (so `--resume` screens at once)."""
        if self.center is None:
            return {}
        arrays = {f"aggregate.center[{n!r}]": v for n, v in self.center.items()}
        arrays["aggregate.distances"] = np.array(self._recent, np.float64)
        arrays["aggregate.center_scale"] = np.array([self.center_scale], np.float64)
        return arrays

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Take the state back; a checkpoint without it (older) starts without a history."""
        keys = {n: f"aggregate.center[{n!r}]" for n in self._names}
        if not all(key in arrays for key in keys.values()):
            return
        self.center = {n: np.array(arrays[key], np.float32) for n, key in keys.items()}
        self._recent.clear()
        self._recent.extend(float(x) for x in np.ravel(arrays.get("aggregate.distances", [])))
        # a checkpoint from before the center was scaled: take the center as it is
        saved = np.ravel(arrays.get("aggregate.center_scale", []))
        self.center_scale = float(saved[0]) if saved.size else 0.0


class CoordinateWise:
    """Per-coordinate median or trimmed mean over every result of the round.

    Holds each result until the round ends: k model-sized float32 copies for k
    results (token counts are not used: a count is a claim, and a weighted median
    would let the largest claim win).
    """

    def __init__(self, names: tuple[str, ...], kind: str, trim: float = TRIM):
        if kind not in ("median", "trimmed-mean"):
            raise ValueError(f"unknown coordinate-wise aggregate {kind!r}")
        self._names, self.kind, self._trim = names, kind, trim
        self._results: list[dict[str, np.ndarray]] = []
        self._aggregate: dict[str, np.ndarray] = {}
        self.contributors = 0

    def reset(self) -> None:
        self._results = []
        self.contributors = 0

    def add(self, pseudo_gradient: Mapping[str, np.ndarray], weight: float) -> None:
        """Hold a copy of the result until the round closes."""
        if weight <= 0:
            raise ValueError("a pseudo-gradient needs a positive weight (tokens)")
        self._results.append({n: np.array(pseudo_gradient[n], np.float32) for n in self._names})
        self.contributors += 1

    def finish(self) -> list[float]:
        """Form the aggregate and let go of the results (none is scaled: returns [])."""
        if not self._results:
            raise ValueError("no pseudo-gradient was added")
        count = len(self._results)
        cut = int(self._trim * count) if self.kind == "trimmed-mean" else 0
        for name in self._names:
            stacked = np.stack([result[name] for result in self._results])
            if self.kind == "median":
                self._aggregate[name] = np.median(stacked, axis=0).astype(np.float32)
            else:
                ordered = np.sort(stacked, axis=0)[cut : count - cut]
                self._aggregate[name] = ordered.mean(axis=0, dtype=np.float32)
        self._results = []
        return []

    @property
    def sums(self) -> Mapping[str, np.ndarray]:
        return self._aggregate

    @property
    def scale(self) -> np.float32:
        return np.float32(1)

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Nothing to restore: each round stands alone."""


Aggregate = PseudoGradientMean | CenteredClip | CoordinateWise


def make_aggregate(kind: str, names: tuple[str, ...]) -> Aggregate:
    """The aggregator `--aggregate kind` names, for parameters `names`."""
    if kind == "mean":
        return PseudoGradientMean(names)
    if kind == "centered-clip":
        return CenteredClip(names)
    return CoordinateWise(names, kind)
