"""The backend operations a streaming worker uses to send and merge fragments off the training loop.

`snapshot` must hold a fragment's values after training donates their
buffers to the next chunk; `blend` is the paper's merge θ ← αθ + (1 − α)G, which
must equal the host formula the shepherd's reference uses (`mix`), and be
G itself, bit for bit, at α = 0; `shift` is the carry merge θ + (1 − α)(G − θ_sent),
which must equal `carry`.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pcp_tui.backends import JaxBackend
from pcp_tui.backends._base import Backend
from pcp_tui.diloco.streaming import carry, carry_scale, mix

SHAPES = [(64, 32), (32,), (3, 5, 7)]


def _values(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]


class HostBackend(Backend):
    """The base class's host path, on arrays that live on the host."""

    info = load = None

    def to_device(self, arrays, axes=None):
        return [np.array(a) for a in arrays]

    def to_host(self, arrays):
        return list(arrays)


def _jax(device_copies: bool) -> JaxBackend:
    backend = JaxBackend("cpu")
    if device_copies:  # take the path a GPU takes: copies on the device, read later
        backend._platform = "device"
    return backend


@pytest.mark.parametrize("device_copies", [False, True], ids=["host-copy", "device-copy"])
def test_a_snapshot_survives_the_donation_of_what_it_copied(device_copies):
    backend = _jax(device_copies)
    original = _values(0)
    params = backend.to_device(original)
    snapshot = backend.snapshot(params)
    overwrite = jax.jit(lambda xs: [x * 0 - 1 for x in xs], donate_argnums=0)
    params = overwrite(params)  # the next chunk, donating the buffers
    assert all(np.all(np.asarray(p) == -1) for p in params)
    for held, value in zip(backend.fetch(snapshot), original, strict=True):
        np.testing.assert_array_equal(held, value)


@pytest.mark.parametrize("backend", [HostBackend(), JaxBackend("cpu")], ids=["host", "jax"])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.3])
def test_blend_is_the_mix_and_alpha_zero_is_the_new_value_exactly(backend, alpha):
    local, new = _values(1), _values(2)
    staged = backend.stage(new)
    blended = backend.to_host(backend.blend(backend.to_device(local), staged, alpha))
    for got, x, y in zip(blended, local, new, strict=True):
        assert got.dtype == np.float32
        if alpha == 0.0:
            np.testing.assert_array_equal(got, y)
        else:  # XLA may fuse a product into the sum: one rounding of the terms apart at most
            a, b = np.float32(alpha), np.float32(1) - np.float32(alpha)
            bound = np.finfo(np.float32).eps * (np.abs(a * x) + np.abs(b * y))
            assert np.all(np.abs(got - mix(x, y, alpha)) <= bound)
            assert not np.array_equal(got, y)


@pytest.mark.parametrize("backend", [HostBackend(), JaxBackend("cpu")], ids=["host", "jax"])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.3])
def test_shift_is_the_carry_merge_the_reference_computes(backend, alpha):
    sent, new, local = _values(3), _values(4), _values(5)
    shift = [g - s for g, s in zip(new, sent, strict=True)]  # what the worker stages
    moved = backend.shift(backend.to_device(local), backend.stage(shift), carry_scale(alpha))
    for got, x, g, s, d in zip(backend.to_host(moved), local, new, sent, shift, strict=True):
        assert got.dtype == np.float32
        expected = carry(x, g, s, alpha)
        if alpha in (0.0, 0.5):  # scaling by 1 or 1/2 is exact: the same bits as the host
            np.testing.assert_array_equal(got, expected)
        else:  # XLA may fuse the product into the sum: one rounding of the terms apart at most
            bound = np.finfo(np.float32).eps * (np.abs(x) + np.abs(carry_scale(alpha) * d))
            assert np.all(np.abs(got - expected) <= bound)
