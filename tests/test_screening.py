"""What each side checks before using the other side's tensors."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pcp_tui.contract.checks import expected_shapes, round_start_problem
from pcp_tui.diloco.screening import NormGuard, check_token_count, global_norm
from pcp_tui.shepherd.rounds.results import BadResult

SHAPES = {"w": (3, 4), "b": (4,)}


def update(scale: float, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        name: (scale * rng.standard_normal(shape)).astype(np.float32)
        for name, shape in SHAPES.items()
    }


def test_global_norm_is_the_l2_norm_of_everything():
    tensors = {"a": np.array([3.0], np.float32), "b": np.array([[4.0]], np.float32)}
    assert global_norm(tensors) == pytest.approx(5.0)


def test_norm_check_needs_a_round_of_baseline_then_refuses_outliers():
    guard = NormGuard(factor=10)
    guard.begin_round()
    for norm in (1.0, 1000.0, 1.2):  # round 1: no baseline yet, anything finite passes
        assert guard.judge(norm) == norm
    guard.begin_round()  # the baseline: round 1's median, 1.2, however its results came in
    assert guard.typical == 1.2
    assert guard.judge(3.0) == 3.0  # drift well within 10x is fine
    with pytest.raises(BadResult, match=r"over 10x the median"):
        guard.judge(12.5)
    guard.check(update(0.0))  # a tiny update cannot blow the model up: not refused


def test_norm_baseline_follows_a_drift_over_rounds():
    guard = NormGuard(factor=10, rounds=3)
    judged, truth = [], []
    for round_number in range(30):  # warm-up: every round's updates are 2x the last one's
        guard.begin_round()
        for worker in range(2):
            tensors = update(2.0**round_number, seed=10 * round_number + worker)
            judged.append(guard.check(tensors))  # none refused: the baseline follows the drift
            truth.append(
                math.sqrt(sum(float(np.sum(t.astype(np.float64) ** 2)) for t in tensors.values()))
            )
    assert judged == pytest.approx(truth, rel=1e-6)  # the norms it judged are the updates' own
    assert judged[-1] > 1e6 * guard.factor * judged[0]  # far past what one fixed baseline allows


def test_norms_are_judged_per_unit_of_learning_rate():
    guard = NormGuard(factor=10)
    for seed in range(2):  # 5 steps at the start of warm-up: Σ lr is tiny, so is the norm
        guard.check(update(0.01, seed=seed), scale=0.001)
    guard.begin_round()
    assert guard.check(update(5.0, seed=2), scale=1.0) > 0  # 40 steps at full rate: alike
    with pytest.raises(BadResult, match=r"over 10x the median"):
        guard.check(update(5.0, seed=3), scale=0.001)  # the same norm from a step at lr 0.001
    assert guard.judge(1e30, scale=0.0) == 1e30  # lr 0 moves nothing: nothing to compare


def test_when_every_result_moves_at_once_the_baseline_follows_instead_of_refusing_forever():
    guard = NormGuard(factor=10, rounds=3)
    for seed in range(2):  # two rounds of two workers
        guard.begin_round()
        for worker in range(2):
            guard.check(update(1.0, seed=2 * seed + worker))
    refused = []
    for seed in range(2, 6):  # every worker's norm is 50x what it was (say, a new lr)
        guard.begin_round()
        for worker in range(2):
            try:
                guard.check(update(50.0, seed=2 * seed + worker))
            except BadResult:
                refused.append(seed)
    assert refused == [2, 2, 3, 3]  # two rounds, until the new norms are the history's majority


def test_an_overflowing_norm_is_refused_even_without_a_baseline():
    with pytest.raises(BadResult, match="overflows"):
        NormGuard().check({"w": np.full((4,), 3e38, np.float32)})


def test_round_start_must_match_the_plan_and_be_finite():
    names = ("w", "b")
    good = update(1.0)
    assert round_start_problem(good, names, SHAPES) is None
    assert round_start_problem(good, names, None) is None
    assert "missing ['b']" in round_start_problem({"w": good["w"]}, names, SHAPES)
    assert "unexpected ['x']" in round_start_problem({**good, "x": good["b"]}, names, SHAPES)
    assert "shape (4, 3)" in round_start_problem({**good, "w": good["w"].T}, names, SHAPES)
    assert "dtype int32" in round_start_problem({**good, "b": np.zeros(4, np.int32)}, names, SHAPES)
    poisoned = {**good, "b": np.array([0, np.nan, 0, 0], np.float32)}
    assert round_start_problem(poisoned, names, SHAPES) == "b holds NaN or Inf"


def test_expected_shapes_come_from_the_compiled_graph():
    params = (jnp.zeros((3, 4)), jnp.zeros(4))
    compiled = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p)).lower(params).compile()
    assert expected_shapes(compiled, ("w", "b")) == SHAPES
    assert expected_shapes(compiled, ("w",)) is None  # does not fit the plan: names-only checks
    assert expected_shapes(len, ("w", "b")) is None


def test_a_result_cannot_claim_more_tokens_than_a_round_has():
    check_token_count(640, most=640)  # the weight of a result in the mean is its token count
    for claimed in (641, 10**12, 0, -5, "many"):
        with pytest.raises(BadResult):
            check_token_count(claimed, most=640)
