"""How a round's pseudo-gradients become one: robust against a minority of workers.

`mean` is DiLoCo's token-weighted mean (`outer.PseudoGradientMean`): any one
worker moves it as far as it likes. The others bound what a minority can do:

- `centered-clip` (the default; Karimireddy, He and Jaggi 2021, "Learning from
  history for Byzantine robust optimization"): every result is pulled back to
  within a radius of the previous round's aggregate before the token-weighted
  mean, so a worker moves the round by at most radius x its token share. The
  radius is `CLIP_FACTOR` x the median, over the last CLIP_ROUNDS rounds, of
  each round's median distance of its results from their center, divided by its
  `step_scale` (the sum of the inner learning rates of the round: updates grow
  with warm-up and shrink with decay): medians of whole rounds, which neither a
  minority nor the order results arrive in can move. Before that, each result's
  norm is capped at `NORM_CAP_FACTOR` x the last round's median norm (per unit
  of its Σ lr): a worker that sends its own Δ scaled up to the inner-optimizer
  bound points where an honest result points, and the ball alone let it count
  at twice the median distance from the center. It streams (one running sum
  plus the center: two model-sized buffers), like the mean, and splits over
  relays (`partial.py`).
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
from collections.abc import Iterable, Mapping

import numpy as np

from pcp_tui.diloco import fused
from pcp_tui.diloco.outer import PseudoGradientMean
from pcp_tui.diloco.partial import Partial, distance, norm_and_distance

CLIP_FACTOR = 2.0  # clip radius: this many times the median distance of recent results
CLIP_ROUNDS = 3  # rounds whose median distances the radius is the median of
NORM_CAP_FACTOR = 1.1  # norm cap: this many times the median norm of the last round's results
NORM_CAP_ROUNDS = 1  # rounds whose median norms the cap is the median of
TRIM = 0.2  # trimmed mean: the fraction of results dropped at each end, per coordinate
WEIGHTED_CHUNK = 2**16  # coordinates a weighted median or trimmed mean takes at a time
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


class CenteredClip:
    """Token-weighted mean of results capped in norm and clipped to a ball around the
    previous aggregate.

    A result Δ_k of norm n_k is first scaled to at most the norm cap c,
    a_k = min(1, c / n_k); at distance d_k of a_k·Δ_k from the center v it counts as
    v + (a_k·Δ_k − v)·s_k with s_k = min(1, radius / d_k). Streamed as
    Σ w_k a_k s_k Δ_k + v·Σ w_k (1 − s_k): one running sum (a `partial.Partial`, which
    a relay's partial of the same round merges into), the center added at the end.
    A round without earlier distances from a center (the run's first two: the
    first has no center, its distances are norms; or the first after resuming a
    checkpoint that predates this state) holds its results until it closes and
    takes the cap and then the radius from their own medians: k model-sized copies,
    those rounds only.

    The thresholds are functions of the set of earlier rounds' results, never of the
    order they came in: each round (its results merged from every partial) adds the
    median of its distances to a history of CLIP_ROUNDS rounds, and the radius is
    `factor` x the median of that history; and the median of its norms, per unit of
    step_scale, to a history of NORM_CAP_ROUNDS, and the cap is `norm_factor` x that.
    A minority of a round's results cannot move its median far, whenever they arrive;
    a window of the latest arrivals let the last ones set it.

    Why a cap as well as the ball: a worker that sends its own Δ scaled up (to the
    inner-optimizer bound, the most the screen lets through) points downhill, so
    validation keeps it, and the ball let it count at `factor` x the median distance
    from the center, along its own direction: +9.5% final eval (1 worker of 5) and
    +14.4% (1 of 3) at the CLI's settings (`benchmarks/bench_byzantine.py`); capped,
    +0.7% and -0.0%. Honest norms lie close together (AdamW's steps are normalized):
    within ±2% of the median on like shards, up to 17% over it on a shard of other
    text; and they shrink from round to round in warm-up, so a longer history than
    the last round is looser (NORM_CAP_ROUNDS = 1), and a factor of 1 would scale the
    upper half of the honest results every round (docs/security.md, point 2).

    The center is the previous aggregate scaled to this round's learning rate:
    v · step_scale / (its round's step_scale). Unscaled, a round whose Σ lr fell
    by more than about half (decay's tail, warm-up's peak behind it) found every
    honest result far from a center too large for it and pulled them all back
    toward it, repeating part of the larger step before.
    """

    def __init__(
        self,
        names: tuple[str, ...],
        factor: float = CLIP_FACTOR,
        rounds: int = CLIP_ROUNDS,
        norm_factor: float = NORM_CAP_FACTOR,
    ):
        self._names = names
        self._factor, self._norm_factor = factor, norm_factor
        self._sum: dict[str, np.ndarray] = {}  # the partial's buffers, kept from round to round
        self.threads = fused.THREADS  # threads of each fold and of the close
        self._medians: collections.deque[float] = collections.deque(maxlen=rounds)
        self._norms: collections.deque[float] = collections.deque(maxlen=NORM_CAP_ROUNDS)
        # key -> (result, weight, norm, distance): a round's results without thresholds yet
        self._held: dict[str, tuple[dict[str, np.ndarray], float, float, float]] = {}
        self.center: dict[str, np.ndarray] | None = None
        self.center_scale = 0.0  # the step_scale of the round the center comes from (0: unknown)
        self.radius = math.inf
        self.norm_cap = math.inf
        self.step_scale = 1.0  # what this round's updates scale with (Σ inner lr); set per round
        self.partial = Partial(names, buffers=self._sum)
        self._centered = False  # this round's center is scaled to its step_scale
        self._closed = False

    @property
    def total_weight(self) -> float:
        return self.partial.weight + sum(weight for _, weight, *_ in self._held.values())

    @property
    def folds(self) -> bool:
        """Whether this round folds results as they come (its radius and norm cap are known:
        earlier rounds' results); one without them holds its results whole, takes no partials."""
        return self._history

    @property
    def contributors(self) -> int:
        return len(self.partial.results) + len(self._held)

    @property
    def _history(self) -> bool:
        """Whether earlier rounds set this round's radius and norm cap (else it holds its
        results, and takes the cap, and the radius if it has no history of its own, from
        them)."""
        return bool(self._medians and self._norms)

    def reset(self) -> None:
        """Start a round: its radius and norm cap come from the results of earlier rounds."""
        self._held, self._centered, self._closed = {}, False, False
        self.radius = self._threshold(self._factor, self._medians) if self._medians else math.inf
        self.norm_cap = math.inf
        if self._history:
            self.norm_cap = self._threshold(self._norm_factor, self._norms)
        self.partial = self._partial(self._sum)

    def restart_inner(self) -> None:
        """The workers' inner optimizers start afresh (`--resume` on fresh worker processes:
        fresh AdamW moments move each coordinate by about the learning rate: 1.7-1.9x the
        last round's norm per unit of lr in `benchmarks/bench_resume_clip.py`, where the cap
        from before scaled every honest result of the round by 0.6): the next round takes its
        norm cap from its own results, as a run's first rounds do."""
        self._norms.clear()

    def open_partial(self) -> Partial:
        """An empty partial of this round (its center, radius and step scale), for a relay to
        fold its workers' results into and hand to `merge`."""
        self._scale_center()
        return self._partial(None)

    def _partial(self, buffers: dict[str, np.ndarray] | None) -> Partial:
        return Partial(
            self._names,
            center=self.center,
            radius=self.radius,
            norm_cap=self.norm_cap,
            step_scale=self.step_scale,
            buffers=buffers,
            threads=self.threads,
        )

    def _scale_center(self) -> None:
        """Bring the center to this round's step_scale (once a round)."""
        if self._centered:
            return
        self._centered = True
        if self.center is not None and self.center_scale > 0 and self.step_scale > 0:
            ratio = np.float32(self.step_scale / self.center_scale)
            if ratio != 1:
                for value in self.center.values():
                    np.multiply(value, ratio, out=value)
        self.center_scale = self.step_scale

    def _threshold(self, factor: float, relative: Iterable[float]) -> float:
        """`factor` x the median of `relative` (per step_scale) at this round's step_scale."""
        typical = statistics.median(relative) * self.step_scale
        return factor * typical if typical > 0 else math.inf  # a zero median says nothing

    def _open(self) -> None:
        if self._closed:
            raise ValueError("the round is closed: a late result does not count")
        self._scale_center()

    def add(
        self,
        pseudo_gradient: Mapping[str, np.ndarray],
        weight: float,
        key: str = "",
        share: float = 1.0,
    ) -> None:
        """Fold one result in (or hold it, in a round without history). `key` names it (a
        second result of one key is refused), by default its place in the round; its
        `weight` holds its `share` (`CoordinateWise.add`) already."""
        if weight <= 0:
            raise ValueError("a pseudo-gradient needs a positive weight (tokens)")
        self._open()
        key = key or f"#{self.contributors}"
        if not self._history:
            if key in self.partial.results or key in self._held:
                raise ValueError(f"result {key!r} is already folded into this round")
            result = {n: np.array(pseudo_gradient[n], np.float32) for n in self._names}
            self._held[key] = (result, weight, *norm_and_distance(result, self.center))
            return
        self.partial.threads = self.threads
        self.partial.add(key, pseudo_gradient, weight)

    def merge(self, partial: Partial) -> None:
        """Fold in a partial of this round's results (`open_partial`'s, from a relay).

        ValueError in a round without history (its radius is not known until it
        closes: its results come whole) or for a result folded in already.
        """
        self._open()
        if not self._history:
            raise ValueError("a round without a radius yet takes whole results, not partials")
        self.partial.merge(partial)

    def finish(self) -> list[float]:
        """Close the round; returns the factor each result was scaled by, in the order added.

        Adds the center's share to the sum, then remembers the aggregate (the next
        center) and the median of the round's distances (the next radius).
        """
        self._open()
        self._closed = True
        if self._held:
            self._close_held()
        if not self.partial.results:
            raise ValueError("no pseudo-gradient was added")
        self._norms.append(statistics.median(e.norm for e in self.partial.results.values()))
        sums = self.partial.sums
        share = None  # the center's share, added to the sum in the same pass as the new center
        if self.center is None:  # the first round's distances are norms: no history for later
            self.center = {n: np.empty_like(v) for n, v in sums.items()}
        else:
            distances = [entry.distance for entry in self.partial.results.values()]
            self._medians.append(statistics.median(distances))
            weight = self.partial.center_weight
            share = np.float32(weight) if weight > 0 else None
        rows = [(sums[n], self.center[n]) for n in self._names]
        fused.over_chunks(fused.center_chunk, rows, (share, self.scale), self.threads)
        return [entry.scale for entry in self.partial.results.values()]

    def _close_held(self) -> None:
        """Fold the held results with the round's own norm cap, from their norms, and its
        radius: from the history if there is one, else from their distances once capped."""
        per_scale = self.step_scale if self.step_scale > 0 else math.inf
        self.norm_cap = self._threshold(
            self._norm_factor, [n / per_scale for *_, n, _ in self._held.values()]
        )
        gaps = {}
        for key, (result, _, norm, gap) in self._held.items():
            capped = norm > self.norm_cap
            gaps[key] = distance(result, self.center, self.norm_cap / norm) if capped else gap
        if not self._medians:
            self.radius = self._threshold(self._factor, [gap / per_scale for gap in gaps.values()])
        self.partial = self._partial(self._sum)
        for key, (result, weight, norm, _) in self._held.items():
            self.partial.add(key, result, weight, gap=gaps[key], norm=norm)
        self._held = {}

    @property
    def sums(self) -> Mapping[str, np.ndarray]:
        return self.partial.sums

    @property
    def scale(self) -> np.float32:
        if not self.contributors:
            raise ValueError("no pseudo-gradient was added")
        return np.float32(1.0 / self.total_weight)

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Center and the recent rounds' median distances, for the checkpoint (so `--resume`
        screens at once)."""
        if self.center is None:
            return {}
        arrays = {f"aggregate.center[{n!r}]": v for n, v in self.center.items()}
        arrays["aggregate.round_distances"] = np.array(self._medians, np.float64)
        arrays["aggregate.round_norms"] = np.array(self._norms, np.float64)
        arrays["aggregate.center_scale"] = np.array([self.center_scale], np.float64)
        return arrays

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Take the state back; a checkpoint without it (older) starts without a history.

        A checkpoint from before the history was kept by rounds holds the latest
        distances (`aggregate.distances`): their median stands for one round.
        """
        keys = {n: f"aggregate.center[{n!r}]" for n in self._names}
        if not all(key in arrays for key in keys.values()):
            self.center, self.center_scale = None, 0.0
            self._medians.clear()
            self._norms.clear()
            return
        self.center = {n: np.array(arrays[key], np.float32) for n, key in keys.items()}
        self._medians.clear()
        medians = np.ravel(arrays.get("aggregate.round_distances", []))
        if not medians.size and np.size(arrays.get("aggregate.distances", [])):
            medians = np.array([np.median(arrays["aggregate.distances"])])
        self._medians.extend(float(x) for x in medians)
        self._norms.clear()  # a checkpoint from before the cap: its first round holds its results
        self._norms.extend(float(x) for x in np.ravel(arrays.get("aggregate.round_norms", [])))
        # a checkpoint from before the center was scaled: take the center as it is
        saved = np.ravel(arrays.get("aggregate.center_scale", []))
        self.center_scale = float(saved[0]) if saved.size else 0.0


class CoordinateWise:
    """Per-coordinate median or trimmed mean over every result of the round.

    Holds each result until the round ends: k model-sized float32 copies for k
    results (token counts are not used: a count is a claim, and a weighted median
    would let the largest claim win). Each result weighs its share of its address's
    weight (`--weight-per address`, `rounds/results.weight_shares`): without that a
    token holder's 3 of 5 ids from one address were 3 of the 5 values every coordinate's
    median took, whatever the address rule said.
    """

    def __init__(self, names: tuple[str, ...], kind: str, trim: float = TRIM):
        if kind not in ("median", "trimmed-mean"):
            raise ValueError(f"unknown coordinate-wise aggregate {kind!r}")
        self._names, self.kind, self._trim = names, kind, trim
        self._results: list[dict[str, np.ndarray]] = []
        self._shares: list[float] = []
        self._aggregate: dict[str, np.ndarray] = {}
        self.contributors = 0

    def reset(self) -> None:
        self._results, self._shares = [], []
        self.contributors = 0

    def add(
        self,
        pseudo_gradient: Mapping[str, np.ndarray],
        weight: float,
        key: str = "",
        share: float = 1.0,
    ) -> None:
        """Hold a copy of the result until the round closes, weighing `share` (its key is not
        needed: the round takes one result a worker; its token `weight` is not used)."""
        if weight <= 0 or share <= 0:
            raise ValueError("a pseudo-gradient needs a positive weight (tokens)")
        self._results.append({n: np.array(pseudo_gradient[n], np.float32) for n in self._names})
        self._shares.append(share)
        self.contributors += 1

    def finish(self) -> list[float]:
        """Form the aggregate and let go of the results (none is scaled: returns [])."""
        if not self._results:
            raise ValueError("no pseudo-gradient was added")
        count = len(self._results)
        cut = int(self._trim * count) if self.kind == "trimmed-mean" else 0
        shares = np.array(self._shares)
        for name in self._names:
            stacked = np.stack([result[name] for result in self._results])
            if np.any(shares != shares[0]):  # ids of one address share one weight
                self._aggregate[name] = _weighted(stacked, shares, cut / count, self.kind)
            elif self.kind == "median":
                self._aggregate[name] = np.median(stacked, axis=0).astype(np.float32)
            else:
                ordered = np.sort(stacked, axis=0)[cut : count - cut]
                self._aggregate[name] = ordered.mean(axis=0, dtype=np.float32)
        self._results, self._shares = [], []
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


def _weighted(stacked: np.ndarray, weights: np.ndarray, trim: float, kind: str) -> np.ndarray:
    """Per coordinate of `stacked` (one result a row), the median or trimmed mean of its
    values, each value weighing its row's weight: the median is the value at half the total
    weight (the mean of two where half falls between them), the trimmed mean drops `trim`
    of the total weight at each end (a value cut part way counts in part). With equal
    weights they are `np.median` and the mean of all but the int(trim x k) lowest and
    highest values. Taken `WEIGHTED_CHUNK` coordinates at a time: its sort order and sums
    are float64 and int64, several times the results' own size if taken whole."""
    flat = stacked.reshape(len(stacked), -1)
    out = np.empty(flat.shape[1], np.float32)
    for start in range(0, flat.shape[1], WEIGHTED_CHUNK):
        part = flat[:, start : start + WEIGHTED_CHUNK]
        out[start : start + part.shape[1]] = _weighted_part(part, weights, trim, kind)
    return out.reshape(stacked.shape[1:])


def _weighted_part(stacked: np.ndarray, weights: np.ndarray, trim: float, kind: str) -> np.ndarray:
    order = np.argsort(stacked, axis=0, kind="stable")
    values = np.take_along_axis(stacked, order, axis=0).astype(np.float64)
    upper = np.cumsum(weights[order], axis=0)  # each sorted value's weight ends here
    total = float(weights.sum())
    if kind == "median":
        half = total / 2
        at = np.argmax(upper >= half, axis=0)[None]
        low = np.take_along_axis(values, at, axis=0)[0]
        high = np.take_along_axis(values, np.minimum(at + 1, len(weights) - 1), axis=0)[0]
        tie = np.take_along_axis(upper, at, axis=0)[0] == half
        return np.where(tie, (low + high) / 2, low)
    cut = trim * total
    lower = upper - weights[order]
    kept = np.clip(np.minimum(upper, total - cut) - np.maximum(lower, cut), 0.0, None)
    return (values * kept).sum(axis=0) / kept.sum(axis=0)


Aggregate = PseudoGradientMean | CenteredClip | CoordinateWise


def make_aggregate(kind: str, names: tuple[str, ...]) -> Aggregate:
    """The aggregator `--aggregate kind` names, for parameters `names`."""
    if kind == "mean":
        return PseudoGradientMean(names)
    if kind == "centered-clip":
        return CenteredClip(names)
    return CoordinateWise(names, kind)
