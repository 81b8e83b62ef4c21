"""GPT-2 model: sizes, shapes, initial loss, learning, causality, bfloat16, sampling."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pcp_tui.training.models import PRESETS, GPTConfig, flops_per_token, generate, init, param_count
from pcp_tui.training.models import apply as eager_apply
from pcp_tui.training.models import loss as eager_loss

TINY = PRESETS["tiny"]
# Even smaller than tiny, for tests that only check behaviour.
MICRO = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
# Compiled once per (config, shape): eager op-by-op execution is what makes model tests slow on CPU.
apply = jax.jit(eager_apply, static_argnums=0)
loss = jax.jit(eager_loss, static_argnums=0)


def random_tokens(config: GPTConfig, shape: tuple[int, ...], seed: int = 0) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(seed).integers(0, config.vocab_size, shape), jnp.int32)


def test_gpt2_preset_is_124m_with_tied_head():
    config = PRESETS["gpt2"]
    shapes = jax.eval_shape(lambda: init(config, jax.random.PRNGKey(0)))
    assert param_count(shapes) == 124_475_904  # nanoGPT's GPT-2 at vocab 50304, head tied to wte
    assert "lm_head.w" not in shapes and shapes["wte"].shape == (50304, 768)


def test_init_is_flat_float32_with_gpt2_scales():
    params = init(TINY, jax.random.PRNGKey(0))
    assert all(value.dtype == jnp.float32 for value in params.values())
    assert {"wte", "wpe", "h.0.ln_1.scale", "h.1.mlp.c_proj.w", "ln_f.bias"} <= set(params)
    assert (
        float(params["h.0.ln_1.scale"].min()) == 1.0
        and float(jnp.abs(params["h.0.attn.c_attn.b"]).max()) == 0
    )
    assert float(params["wte"].std()) == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * TINY.n_layer)
    assert float(params["h.0.mlp.c_proj.w"].std()) == pytest.approx(residual, rel=0.05)


def test_tiny_forward_shapes_and_initial_loss():
    params = init(TINY, jax.random.PRNGKey(0))
    tokens = random_tokens(TINY, (2, TINY.block_size + 1))
    logits = apply(TINY, params, tokens[:, :-1])
    assert logits.shape == (2, TINY.block_size, TINY.vocab_size) and logits.dtype == jnp.float32
    value = loss(TINY, params, tokens)
    assert value.shape == () and value.dtype == jnp.float32
    assert abs(float(value) - math.log(TINY.vocab_size)) < 0.1


def test_apply_rejects_sequences_longer_than_block_size():
    params = init(MICRO, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="block_size"):
        eager_apply(MICRO, params, random_tokens(MICRO, (1, MICRO.block_size + 1)))


def test_cudnn_attention_needs_bfloat16():
    config = dataclasses.replace(MICRO, attention="cudnn")
    params = init(MICRO, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="bfloat16"):
        eager_apply(config, params, random_tokens(MICRO, (1, 4)))


def test_adamw_overfits_a_repeated_batch():
    params = init(MICRO, jax.random.PRNGKey(1))
    batch = random_tokens(MICRO, (4, 17), seed=1)
    optimizer = optax.adamw(3e-3)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state):
        value, grads = jax.value_and_grad(lambda p: eager_loss(MICRO, p, batch))(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    first = None
    for _ in range(60):
        params, state, value = step(params, state)
        first = float(value) if first is None else first
    assert float(loss(MICRO, params, batch)) < 0.5 * first


def test_attention_is_causal():
    params = init(MICRO, jax.random.PRNGKey(2))
    tokens = random_tokens(MICRO, (1, 16), seed=2)
    t = 7
    changed = tokens.at[0, t + 1].set((tokens[0, t + 1] + 1) % MICRO.vocab_size)
    before, after = apply(MICRO, params, tokens), apply(MICRO, params, changed)
    np.testing.assert_array_equal(before[:, : t + 1], after[:, : t + 1])
    assert not np.allclose(before[:, t + 1], after[:, t + 1])


def test_bfloat16_compute_is_close_to_float32():
    params = init(TINY, jax.random.PRNGKey(3))
    tokens = random_tokens(TINY, (2, 65), seed=3)
    bf16 = dataclasses.replace(TINY, compute_dtype="bfloat16")
    full, half = loss(TINY, params, tokens), loss(bf16, params, tokens)
    assert half.dtype == jnp.float32 and apply(bf16, params, tokens[:, :-1]).dtype == jnp.float32
    assert abs(float(full) - float(half)) < 2e-2
    grads = jax.eval_shape(jax.grad(lambda p: eager_loss(bf16, p, tokens)), params)
    # params and their gradients stay float32
    assert all(g.dtype == jnp.float32 for g in grads.values())


def test_generate_length_and_valid_ids():
    params = init(MICRO, jax.random.PRNGKey(4))
    prompt = np.array([1, 2, 3], np.int32)
    out = generate(MICRO, params, prompt, 40, key=jax.random.PRNGKey(0))  # runs past block_size
    assert out.shape == (43,)
    np.testing.assert_array_equal(out[:3], prompt)
    assert out.min() >= 0 and out.max() < MICRO.vocab_size


def test_generate_top_k_one_is_greedy_and_batched():
    params = init(MICRO, jax.random.PRNGKey(5))
    prompt = np.array([[5, 6], [7, 8]], np.int32)
    a = generate(MICRO, params, prompt, 5, top_k=1, key=jax.random.PRNGKey(0))
    b = generate(MICRO, params, prompt, 5, top_k=1, key=jax.random.PRNGKey(9))
    assert a.shape == (2, 7)
    np.testing.assert_array_equal(a, b)
    logits = apply(MICRO, params, jnp.asarray(prompt))
    np.testing.assert_array_equal(a[:, 2], np.argmax(logits[:, -1], axis=-1))


def test_flops_per_token_is_palm_style():
    config = PRESETS["gpt2"]
    shapes = jax.eval_shape(lambda: init(config, jax.random.PRNGKey(0)))
    n = param_count(shapes) - config.block_size * config.n_embd  # all but wpe
    expected = 6 * n + 12 * config.n_layer * config.n_embd * 1024
    assert flops_per_token(config, 1024) == expected


def test_onehot_token_lookup_has_the_gathers_loss_and_a_matmul_gradient():
    """token_lookup="onehot" (for IREE GPU workers) computes the same loss as the gather, to
    the bit, and the same gradients to float32 reassociation (its embedding gradient sums the
    same rows in another order)."""
    onehot = dataclasses.replace(MICRO, token_lookup="onehot")
    params = init(MICRO, jax.random.PRNGKey(0))
    tokens = random_tokens(MICRO, (3, 17))
    gradient = jax.jit(jax.value_and_grad(eager_loss, argnums=1), static_argnums=0)
    value, grads = gradient(MICRO, params, tokens)
    value_1h, grads_1h = gradient(onehot, params, tokens)
    assert float(value_1h) == float(value)
    for name, grad in grads.items():
        np.testing.assert_allclose(grads_1h[name], grad, rtol=1e-5, atol=1e-7, err_msg=name)
    assert float(jnp.max(jnp.abs(grads["wte"]))) > 1e-3  # the embedding gradient is not all zero
    with pytest.raises(ValueError, match="token_lookup"):
        loss(dataclasses.replace(MICRO, token_lookup="scatter"), params, tokens)
