"""A round folded flat equals the round folded in partials merged at the root (relays).

The round's thresholds (centered clip's norm cap and radius, the norm screen's baseline) are
functions of the set of earlier rounds' results, never of their arrival order, and the
aggregate of a round does not depend on how its results were split over partials, the
order they were folded in, or the order the partials were merged, beyond float32
summation order.

The tolerance is the truth's: both folds form the same float32 products
w_k·s_k·Δ_k (the scale s_k and float32(w_k·s_k) are computed alike for a result
wherever it is folded; merging multiplies by 1, exactly), and differ only in the
order those n terms are added. Any order of adding n floats is within (n − 1)·u·Σ|x|
of the exact sum (u = 2^-24, Higham, "Accuracy and Stability of Numerical
Algorithms", §4.2), so two orders are within 2(n − 1)·u·Σ|x|; adding the center's
share and scaling by 1/Σw round once each. So, per coordinate,
|flat − tree| ≤ (2n + 4)·u·(Σ|w s Δ| + |Σw(1 − s)·v|) / Σw.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcp_tui.diloco.aggregate import CenteredClip
from pcp_tui.diloco.outer import PseudoGradientMean
from pcp_tui.diloco.partial import Entry, Partial
from pcp_tui.diloco.screening import BadResult, NormGuard

NAMES = ("b", "w")
U = 2.0**-24
CENTER = np.array([0.5, -1.0, 2.0, 0.0, 0.25, -0.5, 1.0, 3.0, -2.0], np.float32)
PROPERTY = settings(max_examples=120, deadline=None)


def tensors(values) -> dict[str, np.ndarray]:
    values = np.asarray(values, np.float32)
    return {"b": values[:1].copy(), "w": values[1:].reshape(2, -1).copy()}


def flat(arrays) -> np.ndarray:
    return np.concatenate([np.ravel(arrays[n]) for n in NAMES]).astype(np.float64)


def clip_with_history(radius_per_scale: float = 3.0, cap_per_scale: float = 12.0) -> CenteredClip:
    """A centered clip two rounds into a run: a center, and a radius and a norm cap from one
    earlier round (the cap scales some plain results of `rounds` down, and every liar's)."""
    clip = CenteredClip(NAMES, factor=2.0, norm_factor=1.0)
    center = tensors(CENTER)
    clip.load_state_arrays(
        {f"aggregate.center[{n!r}]": v for n, v in center.items()}
        | {
            "aggregate.round_distances": np.array([radius_per_scale / 2]),
            "aggregate.round_norms": np.array([cap_per_scale]),
            "aggregate.center_scale": np.array([1.0]),
        }
    )
    return clip


@st.composite
def rounds(draw, most: int = 24):
    """A round's results (some far out: a liar's), integer token weights, a partition of them
    over relays (group 0: straight to the root) and two arrival orders."""
    count = draw(st.integers(2, most))
    values = st.floats(-8, 8, allow_nan=False, width=32)
    results = [
        np.array(draw(st.lists(values, min_size=9, max_size=9)), np.float32)
        * np.float32(draw(st.sampled_from([1.0, 1.0, 1.0, 1e3])))
        for _ in range(count)
    ]
    weights = draw(st.lists(st.integers(1, 4096), min_size=count, max_size=count))
    relays = draw(st.integers(1, 6))
    groups = draw(st.lists(st.integers(0, relays), min_size=count, max_size=count))
    first = draw(st.permutations(range(count)))
    second = draw(st.permutations(range(count)))
    merge_order = draw(st.permutations(range(1, relays + 1)))
    return results, [float(w) for w in weights], groups, first, second, merge_order


def fold_flat(aggregate, results, weights, order) -> None:
    aggregate.reset()
    for i in order:
        aggregate.add(tensors(results[i]), weights[i], key=f"worker-{i}")
    aggregate.finish()


def fold_tree(aggregate, results, weights, groups, order, merge_order, partial) -> None:
    """Group 0 folds at the root as results come; each other group in a partial (a relay's),
    merged at the root in `merge_order`."""
    aggregate.reset()
    partials = {g: partial(aggregate) for g in merge_order}
    for i in order:
        if groups[i] == 0:
            aggregate.add(tensors(results[i]), weights[i], key=f"worker-{i}")
        else:
            partials[groups[i]].add(f"worker-{i}", tensors(results[i]), weights[i])
    for g in merge_order:
        aggregate.merge(partials[g])
    aggregate.finish()


def tolerance(results, weights, scales, center_weight, center, total) -> np.ndarray:
    terms = sum(
        abs(float(np.float32(w * s))) * np.abs(flat(tensors(r)))
        for r, w, s in zip(results, weights, scales, strict=True)
    )
    share = abs(float(np.float32(center_weight))) * np.abs(center)
    return (2 * len(results) + 4) * U * (terms + share) / total


@PROPERTY
@given(rounds())
def test_centered_clip_through_partials_equals_the_flat_fold(case):
    results, weights, groups, first, second, merge_order = case
    flat_clip, tree_clip = clip_with_history(), clip_with_history()
    fold_flat(flat_clip, results, weights, first)
    fold_tree(tree_clip, results, weights, groups, second, merge_order, CenteredClip.open_partial)
    # each result is judged alike wherever it was folded: weight, scale and distance, exactly
    assert flat_clip.partial.results == tree_clip.partial.results
    assert flat_clip.total_weight == tree_clip.total_weight  # integer tokens: exact in float64
    assert flat_clip.partial.center_weight == pytest.approx(
        tree_clip.partial.center_weight, rel=1e-12
    )
    entries = [flat_clip.partial.results[f"worker-{i}"] for i in range(len(results))]
    bound = tolerance(
        results,
        weights,
        [e.scale for e in entries],
        flat_clip.partial.center_weight,
        flat(tensors(CENTER)),
        flat_clip.total_weight,
    )
    assert np.all(np.abs(flat(flat_clip.center) - flat(tree_clip.center)) <= bound)
    # the next round's radius comes from the round's set of distances: exactly equal
    flat_clip.reset(), tree_clip.reset()
    assert flat_clip.radius == tree_clip.radius and math.isfinite(flat_clip.radius)


@PROPERTY
@given(rounds())
def test_the_mean_through_partials_equals_the_flat_fold(case):
    results, weights, groups, first, second, merge_order = case
    flat_mean, tree_mean = PseudoGradientMean(NAMES), PseudoGradientMean(NAMES)
    fold_flat(flat_mean, results, weights, first)
    fold_tree(
        tree_mean,
        results,
        weights,
        groups,
        second,
        merge_order,
        lambda mean: Partial(NAMES, measure=False),
    )
    assert flat_mean.total_weight == tree_mean.total_weight
    bound = tolerance(results, weights, [1.0] * len(results), 0.0, 0.0, flat_mean.total_weight)
    got = [flat(m.sums) * float(m.scale) for m in (flat_mean, tree_mean)]
    assert np.all(np.abs(got[0] - got[1]) <= bound)


@PROPERTY
@given(st.lists(rounds(most=12), min_size=3, max_size=5))
def test_thresholds_depend_on_the_rounds_results_not_their_order(history):
    """Over several rounds, two arrival orders give the same norm baseline and refusals each
    round, exactly (norms do not depend on the order), and the same radius up to what the
    centers' float32 summation order moves it: a distance moves by at most the centers'
    distance δ (triangle inequality), so does a median of distances and a median of
    medians; the radius (2 x that) by at most 2·max δ, plus the float32 dots' rounding of
    the distances (a few u of the radius)."""
    clips = [clip_with_history(), clip_with_history()]
    guards = [NormGuard(factor=10), NormGuard(factor=10)]
    apart = [0.0]  # the centers' distance after each round
    for results, weights, _, first, second, _ in history:
        refused = []
        for clip, guard, order in zip(clips, guards, (first, second), strict=True):
            guard.begin_round()
            clip.reset()
            out = set()
            for i in order:
                try:
                    guard.check(tensors(results[i]), scale=0.5)
                except BadResult:
                    out.add(i)
                clip.add(tensors(results[i]), weights[i], key=f"worker-{i}")
            clip.finish()
            refused.append(out)
        assert refused[0] == refused[1]
        assert guards[0].typical == guards[1].typical
        assert clips[0].norm_cap == clips[1].norm_cap  # norms do not depend on the center
        radius = clips[0].radius
        assert abs(radius - clips[1].radius) <= 2 * max(apart) + 16 * U * radius
        if max(apart) == 0:  # the same center and radius: the same entries, to the bit
            assert clips[0].partial.results == clips[1].partial.results
        apart.append(float(np.linalg.norm(flat(clips[0].center) - flat(clips[1].center))))


def test_a_result_counts_once_however_it_comes():
    clip = clip_with_history()
    clip.reset()
    relay = clip.open_partial()
    relay.add("worker-1", tensors(CENTER + 1), 10.0)
    with pytest.raises(ValueError, match="already folded"):
        relay.add("worker-1", tensors(CENTER + 2), 10.0)  # a second copy at the relay
    clip.add(tensors(CENTER + 1), 10.0, key="worker-1")  # it reached the root straight too
    with pytest.raises(ValueError, match="already folded"):
        clip.merge(relay)
    assert clip.total_weight == 10.0  # the refused merge changed nothing


def test_a_partial_of_another_round_or_after_the_close_is_refused():
    clip = clip_with_history()
    clip.reset()
    stale = clip.open_partial()
    stale.add("worker-2", tensors(CENTER), 1.0)
    clip.add(tensors(CENTER + 1), 1.0, key="worker-1")
    clip.finish()
    with pytest.raises(ValueError, match="closed"):
        clip.merge(stale)  # late: the round is closed
    with pytest.raises(ValueError, match="closed"):
        clip.add(tensors(CENTER), 1.0, key="worker-3")
    clip.reset()  # the next round has another radius: the old partial is not of it
    with pytest.raises(ValueError, match="not of this round"):
        clip.merge(stale)


def test_a_round_without_a_radius_takes_whole_results_only():
    clip = CenteredClip(NAMES)
    clip.reset()
    with pytest.raises(ValueError, match="without a radius"):
        clip.merge(clip.open_partial())


def received_under(clip: CenteredClip, sums, entries, center_weight: float) -> Partial:
    """`Partial.received` with `clip`'s round: its center, radius, norm cap and step scale."""
    return Partial.received(
        {n: v.shape for n, v in clip.center.items()},
        sums,
        entries,
        center_weight=center_weight,
        center=clip.center,
        radius=clip.radius,
        norm_cap=clip.norm_cap,
        step_scale=clip.step_scale,
    )


def test_a_partial_received_from_a_relay_is_checked_against_its_own_numbers():
    """A relay's partial (`Partial.received`) merges only if its numbers agree: each factor is
    min(1, cap / norm) · min(1, radius / distance), the center's weight is Σ w (1 − the
    clip's part), the sums are this round's parameters. One that agrees merges as the
    relay's own fold would, its sums unchanged."""
    clip = clip_with_history()
    clip.reset()
    relay = clip.open_partial()
    for key, values in (("a", CENTER + 0.1), ("b", CENTER + 5.0)):
        relay.add(key, tensors(values), 2.0)
    entries = dict(relay.results)

    def received(entries=entries, center_weight=relay.center_weight, sums=relay.sums):
        return received_under(clip, sums, entries, center_weight)

    assert entries["b"].scale < 1.0  # clipped: the check reads the radius
    honest = received()
    assert honest.clipped == 1.0
    assert all(np.array_equal(honest.sums[n], relay.sums[n]) for n in NAMES)
    clip.merge(honest)
    assert clip.partial.weight == relay.weight
    with pytest.raises(ValueError, match="factor 1.0"):
        received(entries={**entries, "b": dataclasses.replace(entries["b"], scale=1.0)})
    with pytest.raises(ValueError, match="center's weight"):
        received(center_weight=relay.center_weight + 1.0)
    with pytest.raises(ValueError, match="parameters"):
        received(sums={"b": relay.sums["b"]})


def test_a_relay_that_lies_in_its_sums_moves_the_round_at_most_the_radius_times_its_share():
    """Its entries agree (they are its workers' notices), but its sums are whatever it likes:
    the root holds the partial's mean to the clip's ball around the center, so the round's
    aggregate moves by at most radius × that partial's share of the weight."""
    clip = clip_with_history()
    clip.reset()
    relay = clip.open_partial()
    relay.add("a", tensors(CENTER + 0.1), 2.0)
    relay.add("b", tensors(CENTER - 0.1), 2.0)
    lie = {n: np.full_like(v, 1e6) for n, v in relay.sums.items()}
    partial = received_under(clip, lie, dict(relay.results), relay.center_weight)
    assert partial.clipped < 1e-5
    clip.merge(partial)
    clip.add(tensors(CENTER), 4.0, key="honest")  # an honest result at the center, as heavy
    clip.finish()
    moved = np.linalg.norm(flat(clip.sums) * float(clip.scale) - CENTER)
    assert moved <= clip.radius * 0.5 * (1 + 1e-3)  # the radius × its half of the weight


@pytest.mark.parametrize("lie", [math.nan, math.inf])
def test_a_relay_whose_sums_are_not_finite_is_refused(lie):
    """A sum that is not finite has no distance from the center to hold to the ball (NaN
    compares false, and Inf pulled back is Inf · 0): taken, it would make the model NaN. Such
    a partial is refused, as one whose entries disagree is; with the mean too (a worker's
    result that is not finite is refused, so its relay's may not be either)."""
    clip = clip_with_history()
    clip.reset()
    relay = clip.open_partial()
    relay.add("a", tensors(CENTER + 0.1), 2.0)
    sums = {n: v.copy() for n, v in relay.sums.items()}
    sums["w"][0, 0] = lie
    with pytest.raises(ValueError, match="not finite"):
        received_under(clip, sums, dict(relay.results), relay.center_weight)
    plain = {"a": Entry(2.0, 1.0, 0.0, 0.0)}  # the mean's: no ball, the same refusal
    shapes = {n: v.shape for n, v in relay.sums.items()}
    with pytest.raises(ValueError, match="not finite"):
        Partial.received(shapes, sums, plain, center_weight=0.0)
