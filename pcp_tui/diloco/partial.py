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

from pcp_tui.contract.checks import is_finite
from pcp_tui.diloco import fused
from pcp_tui.diloco.fused import CHUNK

# how far past the radius a received partial's mean may lie before it is pulled back: float32
# rounding of an honest relay's sums, far above it, and far below anything a lie gains
BALL_SLACK = 1e-3


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
        self.clipped = 1.0  # a received partial pulled back onto the clip's ball by this factor

    @classmethod
    def received(
        cls,
        shapes: Mapping[str, tuple[int, ...]],
        sums: Mapping[str, np.ndarray],
        entries: Mapping[str, Entry],
        *,
        center_weight: float,
        center: Mapping[str, np.ndarray] | None = None,
        radius: float = math.inf,
        norm_cap: float = math.inf,
        step_scale: float = 1.0,
    ) -> Partial:
        """A partial folded elsewhere (a relay's: its sums and entries), to `merge` into this
        round's. ValueError where its parts do not agree: sums not of `shapes` in float32, a
        weight not positive, a factor that is not min(1, cap / norm) · min(1, radius /
        distance), a center's weight that is not Σ w (1 − the clip's part of it).

        With a `center` and a radius its mean is held to the clip's ball: an honest partial's
        mean (Σ w a s Δ + v Σ w (1 − s)) / Σ w is a convex combination of points within the
        radius of v, so it lies within it too (to float32 rounding, `BALL_SLACK`). One
        outside is pulled back onto it (`clipped`: the factor): whatever a relay puts in its
        sums moves the round by at most the radius times its results' weight share, as one
        clipped result of that weight could."""
        names = tuple(shapes)
        if entries and any(
            n not in sums or sums[n].shape != tuple(shapes[n]) or sums[n].dtype != np.float32
            for n in names
        ):
            raise ValueError("its sums are not this round's parameters in float32")
        if entries and not all(is_finite(sums[n]) for n in names):  # NaN is inside every
            raise ValueError("its sums are not finite")  # ball; Inf pulled back is NaN
        partial = cls(names, radius=radius, norm_cap=norm_cap, step_scale=step_scale, measure=False)
        centered = 0.0
        for key, entry in entries.items():
            norm, gap = entry.norm * step_scale, entry.distance * step_scale
            capped, clipped = partial._factors(norm, gap)
            if not entry.weight > 0 or not math.isclose(
                entry.scale, capped * clipped, rel_tol=1e-9
            ):
                raise ValueError(
                    f"result {key!r}: weight {entry.weight}, factor {entry.scale} at norm "
                    f"{norm:.6g} (cap {norm_cap:.6g}), distance {gap:.6g} (radius {radius:.6g})"
                )
            centered += entry.weight * (1.0 - clipped)
        weight = math.fsum(entry.weight for entry in entries.values())
        if not math.isclose(center_weight, centered, rel_tol=1e-9, abs_tol=1e-12 * weight):
            raise ValueError(f"its center's weight {center_weight:.9g} is not {centered:.9g}")
        partial.sums = {n: np.array(sums[n], np.float32) for n in names} if entries else {}
        partial.weight, partial.center_weight = weight, centered
        partial.results = dict(entries)
        if entries and center is not None and math.isfinite(radius):
            partial._hold_to_ball(center, weight - centered)
        return partial

    def _factors(self, norm: float, gap: float) -> tuple[float, float]:
        """(the norm cap's factor, the clip's) for a result of `norm` at `gap` from the center
        once capped: its Δ counts with their product, the center with 1 − the clip's."""
        capped = min(1.0, self.norm_cap / norm) if norm > 0 else 1.0
        clipped = min(1.0, self.radius / gap) if gap > 0 else 1.0
        return capped, clipped

    def _hold_to_ball(self, center: Mapping[str, np.ndarray], inside: float) -> None:
        """Pull the mean back onto the clip's ball if it lies outside (`received`); `inside`:
        Σ w s, the weight of the results' own parts (the center holds the rest)."""
        gap = 0.0
        for name, total in self.sums.items():
            off = np.ravel(total).astype(np.float64) - np.ravel(center[name]) * inside
            gap += float(np.dot(off, off))
        gap = math.sqrt(gap) / self.weight  # |mean − v|
        if gap > self.radius * (1.0 + BALL_SLACK):
            self.clipped = self.radius / gap
            for name, total in self.sums.items():
                at = np.asarray(center[name], np.float64) * inside
                np.copyto(total, (at + (total - at) * self.clipped).astype(np.float32))

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
        capped, clipped = self._factors(norm, gap)
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
