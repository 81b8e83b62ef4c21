"""The in-place, chunked arithmetic of a round equals the plain numpy (and optax) computation."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from pcp_tui import protocol
from pcp_tui.backends import select_backend
from pcp_tui.backends._jax import _pinned_host
from pcp_tui.diloco import outer as diloco
from pcp_tui.diloco import reference as reference_diloco
from pcp_tui.diloco.outer import OuterOptimizer, PseudoGradientMean, scaled_add
from pcp_tui.diloco.screening import BadResult, ResultScreen, check_pseudo_gradient, global_norm
from pcp_tui.shepherd.rounds import results as round_results
from pcp_tui.shepherd.rounds.results import Round

# one tensor spans several chunks (and ends in a partial one), the others fit in one
SHAPES = {"big": (3, diloco.CHUNK + 1000), "w": (5, 7), "b": (7,), "scalar": ()}


def tensors(seed: int, scale: float = 1e-3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        n: np.array(rng.standard_normal(s, dtype=np.float32) * np.float32(scale), np.float32)
        for n, s in SHAPES.items()
    }


def test_scaled_add_rounds_exactly_like_the_plain_expression():
    total, array = tensors(1)["big"], tensors(2)["big"]
    expected = total + array * np.float32(3.5)
    scaled_add(total, array, np.float32(3.5), threads=3)
    np.testing.assert_array_equal(total, expected)


def test_streaming_mean_equals_the_plain_weighted_mean_and_reuses_its_buffers():
    results, weights = [tensors(seed) for seed in range(3)], [100.0, 300.0, 50.0]
    mean = PseudoGradientMean(tuple(SHAPES))
    for _ in range(2):  # the second round reuses the first round's buffers
        mean.reset()
        for result, weight in zip(results, weights, strict=True):
            mean.add(result, weight)
        for name in SHAPES:
            plain = results[0][name] * np.float32(weights[0])
            for result, weight in zip(results[1:], weights[1:], strict=True):
                plain = plain + result[name] * np.float32(weight)
            scale = np.float32(1.0 / sum(weights))
            np.testing.assert_array_equal(mean.sums[name], plain)
            np.testing.assert_array_equal(mean.mean()[name], plain * scale)
        assert mean.scale == np.float32(1.0 / sum(weights))


@pytest.mark.parametrize("kind", ["nesterov", "sgd"])
def test_outer_step_matches_optax(kind):
    params = tensors(10, scale=0.02)
    tx = reference_diloco.outer_optimizer(kind, lr=0.7, momentum=0.9)
    reference, state = dict(params), tx.init(params)
    outer = OuterOptimizer(kind, 0.7, 0.9)
    in_place = {n: p.copy() for n, p in params.items()}
    mean = PseudoGradientMean(tuple(SHAPES))
    for round_number in range(4):
        mean.reset()
        mean.add(tensors(20 + round_number), 120.0)
        mean.add(tensors(40 + round_number), 80.0)
        gradient = mean.mean()
        reference, state = reference_diloco.outer_step(reference, state, gradient, tx)
        outer.apply(in_place, mean.sums, mean.scale)
        for name in SHAPES:
            np.testing.assert_array_equal(in_place[name], reference[name])
    copy = OuterOptimizer(kind, 0.7, 0.9)
    copy.load_state_arrays(params, outer.state_arrays())
    stepped = copy.step(in_place, gradient)
    assert stepped["w"] is not in_place["w"]  # step() leaves its inputs alone
    outer.apply(in_place, gradient, np.float32(1))
    for name in SHAPES:
        np.testing.assert_array_equal(stepped[name], in_place[name])


def test_outer_state_is_named_as_optax_names_it():
    params = tensors(0)
    outer = OuterOptimizer("nesterov")
    outer.step(params, tensors(1))
    state = optax.sgd(0.7, momentum=0.9, nesterov=True).init(params)
    names = {
        jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]
    }
    assert set(outer.state_arrays()) == names
    with pytest.raises(ValueError, match="lacks outer optimizer state"):
        OuterOptimizer("nesterov").load_state_arrays(params, {})


def test_fused_screen_returns_the_global_norm_and_names_the_bad_tensor():
    shapes = {n: s for n, s in SHAPES.items()}
    good = tensors(3)
    assert check_pseudo_gradient(good, shapes) == pytest.approx(global_norm(good), rel=1e-12)
    poisoned = {**good, "b": np.array([0, np.nan, 0, 0, 0, 0, 0], np.float32)}
    with pytest.raises(BadResult, match="b holds NaN or Inf"):
        check_pseudo_gradient(poisoned, shapes)
    # finite values whose float32 sum of squares overflows: not NaN/Inf, but an absurd norm
    huge = {**good, "w": np.full((5, 7), 3e38, np.float32)}
    screen = ResultScreen(shapes, max_tokens=100)
    with pytest.raises(BadResult, match="overflows float32"):
        screen.check(huge, 10)
    # ... unless a tensor after it really holds an Inf: that is what gets reported
    with pytest.raises(BadResult, match="scalar holds NaN or Inf"):
        screen.check({**huge, "scalar": np.array(np.inf, np.float32)}, 10)
    with pytest.raises(BadResult, match="claims 101 tokens"):
        screen.check(good, 101)


@pytest.mark.parametrize("inline_bytes", [0, 2**40])  # folded in a thread, or on the loop
async def test_a_closed_round_folds_nothing_more(monkeypatch, inline_bytes):
    monkeypatch.setattr(round_results, "INLINE_BYTES", inline_bytes)
    mean = PseudoGradientMean(tuple(SHAPES))
    screen = ResultScreen(SHAPES, max_tokens=1000)

    def result(seed: int) -> protocol.Message:
        body = protocol.RoundResult(round=1, tokens=100, losses=(1.0,))
        return protocol.Message(body, tensors(seed))

    current = Round(1, ["a", "b"], mean, screen)
    assert await current.add("a", result(1))
    await current.close()
    assert not await current.add("b", result(2))
    assert current.contributors == ["a"] and mean.contributors == 1


@pytest.mark.parametrize("on_device", [False, True])
def test_backend_difference_is_the_numpy_difference(monkeypatch, on_device):
    backend = select_backend("cpu")
    if on_device:  # the accelerator path (device copy, subtraction on the device, pinned host)
        monkeypatch.setattr(backend, "_platform", "cuda")
        monkeypatch.setattr(backend, "_pinned_host", _pinned_host(backend.device))
    before, after = tensors(5), tensors(6)
    names = tuple(SHAPES)
    host = [before[n].copy() for n in names]
    kept = backend.keep(host, backend.to_device(host))
    difference = backend.difference(kept, backend.to_device([after[n] for n in names]))
    for name, value in zip(names, difference, strict=True):
        np.testing.assert_array_equal(value, before[name] - after[name])


def test_a_checkpoint_of_the_numpy_outer_step_of_before_loads():
    """Before optax ran it, the shepherd saved the momentum as `[0].trace['<name>']`."""
    params = tensors(0)
    before = {f"[0].trace[{name!r}]": tensors(5)[name] for name in SHAPES}
    outer = OuterOptimizer("nesterov")
    outer.load_state_arrays(params, before)
    for name, array in outer.state_arrays().items():
        np.testing.assert_array_equal(array, before[name])
