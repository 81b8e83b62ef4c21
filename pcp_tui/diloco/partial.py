"""One round's results folded into a partial that merges: the one fold of every aggregate.

Given the round's center v, norm cap c and radius r (centered clip; the mean has
none of them), a result Δ_k of weight w_k and norm n_k is first scaled to at most the
cap, a_k = min(1, c / n_k), and then, at distance d_k of a_k·Δ_k from v, counts as
v + (a_k·Δ_k − v)·s_k with s_k = min(1, r / d_k). A subset of the round's results
folds into

    Σ w_k a_k s_k Δ_k,   Σ w_k,   Σ w_k (1 − s_k),
    and per result (w_k, a_k s_k, d_k / step_scale, n_k / step_scale)

and two such partials of the same round merge by adding the sums and joining the
per-result entries (a result in both is refused). Merging is associative and
commutative up to float32 summation order, so a relay can fold its workers' results
and the root merge the relays' partials: the root's own fold is one more partial.
The round's aggregate is (Σ w a s Δ + v·Σ w (1 − s)) / Σ w; the per-result distances
and norms are what the next round's radius and cap are taken from
(`aggregate.CenteredClip`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pcp_tui.diloco import fused
from pcp_tui.diloco.fused import CHUNK


def distance(
    tensors: Mapping[str, np.ndarray],
    center: Mapping[str, np.ndarray] | None,
    scale: float = 1.0,
) -> float:
    """L2 distance of `scale` x the first pseudo-gradient from the second (its norm if
    `center` is None).

    Each cache-sized piece is a float32 BLAS dot (its rounding is ~1e-7 of the
    piece's sum), and the pieces add up in float64. Converting every piece to
    float64 first made this the shepherd's largest cost on a 124M-parameter
    model (about 2 s per result, on the round's critical path).
    """
    return _measure(tensors, center, scale)[1]


def norm_and_distance(
    tensors: Mapping[str, np.ndarray], center: Mapping[str, np.ndarray] | None
) -> tuple[float, float]:
    """The pseudo-gradient's L2 norm and its `distance` from `center`, in one pass."""
    return _measure(tensors, center, 1.0)


def _measure(
    tensors: Mapping[str, np.ndarray], center: Mapping[str, np.ndarray] | None, scale: float
) -> tuple[float, float]:
    squares, gaps = 0.0, 0.0
    factor = np.float32(scale)
    scratch = np.empty(CHUNK if center is not None or factor != 1 else 0, np.float32)
    for name, array in tensors.items():
        flat = np.ravel(np.asarray(array, np.float32))
        reference = None if center is None else np.ravel(np.asarray(center[name], np.float32))
        for start in range(0, flat.size, CHUNK):
            part = flat[start : start + CHUNK]
            norm_part = float(np.dot(part, part))
            squares += norm_part
            if factor != 1:
                part = np.multiply(part, factor, out=scratch[: part.size])
            if reference is not None:
                part = np.subtract(part, reference[start : start + CHUNK], out=scratch[: part.size])
            gaps += float(np.dot(part, part)) if reference is not None or factor != 1 else norm_part
    return math.sqrt(squares), math.sqrt(gaps)


@dataclass(frozen=True)
class Entry:
    """One folded result: its weight, the factor its Δ counts with (norm cap and clip), its
    distance from the center (once capped) and its norm, each per step_scale."""

    weight: float
    scale: float
    distance: float
    norm: float


class Partial:
    """Some of one round's results, folded with the round's center, norm cap and radius; merges.

    `measure`: take each result's norm and distance from the center (centered clip
    needs them; the plain mean skips the pass). `buffers`: float32 arrays to sum into,
    reused from round to round (a fresh model-sized array costs page faults).
    """

    def __init__(
        self,
        names: tuple[str, ...],
        *,
        center: Mapping[str, np.ndarray] | None = None,
        radius: float = math.inf,
        norm_cap: float = math.inf,
        step_scale: float = 1.0,
        measure: bool = True,
        buffers: dict[str, np.ndarray] | None = None,
        threads: int = fused.THREADS,
    ):
        self.names = names
        self.center, self.radius, self.step_scale = center, radius, step_scale
        self.norm_cap = norm_cap
        self.measure = measure
        self.sums: dict[str, np.ndarray] = buffers if buffers is not None else {}
        self.threads = threads
        self.weight = 0.0  # Σ w
        self.center_weight = 0.0  # Σ w (1 − s): the center's share of the aggregate
        self.results: dict[str, Entry] = {}  # in the order folded in (merged ones after)

    def add(
        self,
        key: str,
        pseudo_gradient: Mapping[str, np.ndarray],
        weight: float,
        *,
        gap: float | None = None,
        norm: float | None = None,
    ) -> float:
        """Fold result `key` in with `weight`; the factor its Δ counts with. `norm` and `gap`:
        its norm and its distance from the center once scaled to the norm cap, if both are
        taken already. ValueError for a key already folded in."""
        if weight <= 0:
            raise ValueError("a pseudo-gradient needs a positive weight (tokens)")
        if key in self.results:
            raise ValueError(f"result {key!r} is already folded into this round")
        arrays = [np.ascontiguousarray(pseudo_gradient[n], np.float32) for n in self.names]
        if self.measure and norm is None:
            tensors = dict(zip(self.names, arrays, strict=True))
            norm, gap = norm_and_distance(tensors, self.center)
            if norm > self.norm_cap:
                gap = distance(tensors, self.center, self.norm_cap / norm)
        norm, gap = norm or 0.0, gap or 0.0
        capped = min(1.0, self.norm_cap / norm) if norm > 0 else 1.0
        clipped = min(1.0, self.radius / gap) if gap > 0 else 1.0
        scale = capped * clipped
        rows = [(self._buffer(n, a.shape), a) for n, a in zip(self.names, arrays, strict=True)]
        first = not self.results  # the sum starts as the first result times its weight
        fused.over_chunks(fused.fold_chunk, rows, (np.float32(weight * scale), first), self.threads)
        self.weight += weight
        self.center_weight += weight * (1.0 - clipped)
        per = self.step_scale if self.step_scale > 0 else math.inf  # lr 0: nothing to compare
        self.results[key] = Entry(weight, scale, gap / per, norm / per)
        return scale

    def merge(self, other: Partial) -> None:
        """Add `other` (the same round's, disjoint results) into this one.

        ValueError if it was folded with another radius, norm cap or step scale, or holds a
        result this one holds already (one result counts once, however it came).
        """
        theirs = (other.radius, other.norm_cap, other.step_scale)
        if theirs != (self.radius, self.norm_cap, self.step_scale):
            raise ValueError(
                f"a partial folded with radius {other.radius:.6g}, norm cap "
                f"{other.norm_cap:.6g} and step scale {other.step_scale:.6g} is not of this "
                f"round (radius {self.radius:.6g}, norm cap {self.norm_cap:.6g}, step scale "
                f"{self.step_scale:.6g})"
            )
        twice = sorted(self.results.keys() & other.results.keys())
        if twice:
            raise ValueError(f"results {twice[:3]} are already folded into this round")
        if not other.results:
            return
        rows = [(self._buffer(n, other.sums[n].shape), other.sums[n]) for n in self.names]
        first = not self.results
        fused.over_chunks(fused.fold_chunk, rows, (np.float32(1), first), self.threads)
        self.weight += other.weight
        self.center_weight += other.center_weight
        self.results.update(other.results)

    def _buffer(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        total = self.sums.get(name)
        if total is None or total.shape != shape:
            total = self.sums[name] = np.empty(shape, np.float32)
        return total
