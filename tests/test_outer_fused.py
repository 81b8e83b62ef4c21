"""The fused outer step (`diloco/fused.py`) against optax's own update: the same bits.

optax runs op by op on XLA's CPU runtime, which flushes subnormals to zero;
the fused step runs numpy in cache-sized chunks over threads. The cases below
cover chunks that take the fast path, chunks with values near and below
float32's smallest normal (the flushing path), a trace decaying without
gradient, tensors smaller and larger than a chunk, and 1 or 3 threads.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcp_tui.diloco import fused
from pcp_tui.diloco.aggregate import CenteredClip
from pcp_tui.diloco.outer import OuterOptimizer

SHAPES = {"wte": (3, fused.CHUNK + 123), "bias": (7,), "w": (fused.CHUNK // 2,)}


def _gradient(rng, regime: str) -> dict[str, np.ndarray]:
    """Gradient sums: normal values; 30% tiny (2^-150..2^-60) or small (2^-126..2^-120) ones; zeros."""
    out = {}
    for name, shape in SHAPES.items():
        values = rng.standard_normal(shape).astype(np.float32) * np.float32(1e-3)
        if regime in ("tiny", "small"):  # small: normal values whose products may not be
            low, high = (-150, -60) if regime == "tiny" else (-126, -120)
            tiny = np.exp2(rng.uniform(low, high, shape)).astype(np.float32)
            values = np.where(rng.random(shape) < 0.3, tiny * np.sign(values), values)
        elif regime == "zero":
            values = np.zeros(shape, np.float32)
        out[name] = values.astype(np.float32)
    return out


def _bits(arrays) -> dict[str, bytes]:
    return {n: np.ascontiguousarray(np.asarray(v)).tobytes() for n, v in arrays.items()}


@pytest.mark.parametrize(
    ("kind", "lr", "momentum", "threads"),
    [
        ("nesterov", 0.7, 0.9, 1),
        ("nesterov", 0.7, 0.9, 3),
        ("nesterov", 1e-3, 0.3, 3),
        ("sgd", 0.7, 0.9, 1),
        ("sgd", 1e-4, 0.9, 3),
    ],
)
def test_fused_step_is_optax_to_the_bit(kind, lr, momentum, threads):
    rng = np.random.default_rng(7)
    params = {
        n: rng.standard_normal(s).astype(np.float32) * np.float32(0.02) for n, s in SHAPES.items()
    }
    params["bias"][:3] = [0.0, 2.0**-130, -(2.0**-110)]  # subnormal and small parameters too
    by_optax, fused_step = (OuterOptimizer(kind, lr, momentum) for _ in range(2))
    theirs, ours = (
        {n: v.copy() for n, v in params.items()},
        {n: v.copy() for n, v in params.items()},
    )
    # small normal values from a zero trace (their products go subnormal), a small trace
    # decaying, tiny and subnormal values, then normal ones and their trace decaying
    regimes = ["small", "zero", "small", "zero", "tiny", "tiny", "zero", "normal", "zero"]
    scales = [np.float32(x) for x in (1, 0.5, 1, 0.5, 1e-20, 2.0**-40, 0.5, 1 / 3, 0.5)]
    for regime, scale in zip(regimes, scales, strict=True):
        sums = _gradient(rng, regime)
        by_optax.apply_optax(theirs, sums, scale)
        fused_step.apply(ours, sums, scale, threads=threads)
        assert _bits(ours) == _bits(theirs), regime
        assert _bits(fused_step.state_arrays()) == _bits(by_optax.state_arrays()), regime


def test_tiny_case_would_catch_numpy_gradual_underflow():
    """The flush matters: plain numpy keeps subnormals XLA zeroes, so without it the test fails."""
    smallest = {"w": np.full(4, 2.0**-126, np.float32)}  # float32's smallest normal
    zero = {"w": np.zeros(4, np.float32)}
    results = []
    for step in ("apply_optax", "apply"):
        outer, params = OuterOptimizer(), {"w": np.ones(4, np.float32)}
        getattr(outer, step)(params, smallest, np.float32(1))  # trace = 2^-126
        getattr(outer, step)(params, zero, np.float32(1))  # trace = 0.9 x 2^-126: subnormal
        results.append(_bits(outer.state_arrays()))
    assert results[0] == results[1]
    plain = np.float32(0.9) * smallest["w"]
    assert plain.any() and results[0] == _bits({"[0].trace['w']": np.zeros(4, np.float32)})


def test_centered_clip_close_over_threads_is_the_plain_arithmetic():
    rng = np.random.default_rng(3)
    names = tuple(sorted(SHAPES))
    clips = [CenteredClip(names) for _ in range(2)]
    center = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    for clip, threads in zip(clips, (1, 3), strict=True):
        clip.load_state_arrays(
            {f"aggregate.center[{n!r}]": v for n, v in center.items()}
            | {"aggregate.distances": np.full(4, 1.0), "aggregate.round_norms": np.full(1, 1e9)}
        )
        clip.threads = threads
        clip.reset()
        for _ in range(3):  # results far from the center: clipped, so the center gets a share
            clip.add(_gradient(np.random.default_rng(5), "normal") | {"w": center["w"] + 9}, 10.0)
    expected = {n: v.copy() for n, v in clips[0].sums.items()}
    weight, scale = np.float32(clips[0].partial.center_weight), clips[0].scale
    assert weight > 0
    for name in names:
        expected[name] += center[name] * weight
        expected[name] = expected[name] * scale
    for clip in clips:
        clip.finish()
        assert _bits(clip.center) == _bits(expected)


def test_a_gradient_of_another_shape_is_refused_not_half_applied():
    outer, params = OuterOptimizer(), {"w": np.ones(fused.CHUNK + 5, np.float32)}
    with pytest.raises(ValueError, match="one size"):
        outer.apply(params, {"w": np.ones(fused.CHUNK, np.float32)}, np.float32(1))
    assert (params["w"] == 1).all()
