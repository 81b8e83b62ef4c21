"""GPT-2 in plain JAX: a config, `init`, `apply`, `loss`, read top to bottom.

Parameters are one flat dict of float32 arrays with dotted names
("wte", "h.0.attn.c_attn.w", ..., "ln_f.scale"), so they travel over the wire
and into checkpoints as named tensors with no tree machinery. The language-model
head is tied to the token embedding (logits = x @ wte.T), as in GPT-2.

With compute_dtype="bfloat16" the parameters stay float32 (the optimizer and
the DiLoCo outer step see full precision) and are cast to bfloat16 inside
`apply`; layer norms, the softmax inside attention and the loss run in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, jax.Array]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128  # longest context; sizes the position embedding
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    compute_dtype: str = "float32"  # float32 | bfloat16 (params stay float32)
    attention: str = "xla"  # xla | cudnn: the jax.nn.dot_product_attention implementation
    token_lookup: str = "gather"  # gather | onehot: how token rows are picked (see `_embed`)


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=128),
    "small": GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=8, n_embd=256),
    "gpt2": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


@partial(jax.jit, static_argnames="config")
def init(config: GPTConfig, key: jax.Array) -> Params:
    """GPT-2 initialisation: N(0, 0.02) weights, residual projections scaled by
    1/sqrt(2 * n_layer) so the residual stream's variance does not grow with
    depth, zero biases, unit layer-norm scales."""
    c, layers = config.n_embd, config.n_layer
    if c % config.n_head:
        raise ValueError(f"n_embd ({c}) must be a multiple of n_head ({config.n_head})")
    # One draw for every normal weight, then slices: a draw per tensor would
    # compile a sampler per shape, which makes initialisation slow on CPU.
    n_normal = (config.vocab_size + config.block_size) * c + layers * 12 * c * c
    noise = jax.random.normal(key, (n_normal,), jnp.float32)
    offset = 0
    residual_std = 0.02 / math.sqrt(2 * layers)

    def normal(shape: tuple[int, ...], std: float = 0.02) -> jax.Array:
        nonlocal offset
        size = math.prod(shape)
        offset += size
        return std * noise[offset - size : offset].reshape(shape)

    def ones(size: int) -> jax.Array:
        return jnp.ones((size,), jnp.float32)

    def zeros(size: int) -> jax.Array:
        return jnp.zeros((size,), jnp.float32)

    params: Params = {
        "wte": normal((config.vocab_size, c)),
        "wpe": normal((config.block_size, c)),
    }
    for i in range(layers):
        p = f"h.{i}."
        params |= {
            p + "ln_1.scale": ones(c),
            p + "ln_1.bias": zeros(c),
            p + "attn.c_attn.w": normal((c, 3 * c)),
            p + "attn.c_attn.b": zeros(3 * c),
            p + "attn.c_proj.w": normal((c, c), residual_std),
            p + "attn.c_proj.b": zeros(c),
            p + "ln_2.scale": ones(c),
            p + "ln_2.bias": zeros(c),
            p + "mlp.c_fc.w": normal((c, 4 * c)),
            p + "mlp.c_fc.b": zeros(4 * c),
            p + "mlp.c_proj.w": normal((4 * c, c), residual_std),
            p + "mlp.c_proj.b": zeros(c),
        }
    params |= {"ln_f.scale": ones(c), "ln_f.bias": zeros(c)}
    return params


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    # x + (-mean), not x - mean: the same numbers (IEEE subtraction is addition of the negation),
    # but the gradient then sums before it negates. Summed after the negation, IREE fuses the two
    # into a reduction of `acc - g`, which has no identity value and fails to compile for
    # metal-spirv and targeted vulkan-spirv ("Failed to get an identity value for the reduction").
    centered = x32 + -x32.mean(-1, keepdims=True)
    var = jnp.square(centered).mean(-1, keepdims=True)
    return (centered * jax.lax.rsqrt(var + 1e-5) * scale + bias).astype(x.dtype)


TOKEN_LOOKUPS = ("gather", "onehot")


def _embed(config: GPTConfig, table: jax.Array, tokens: jax.Array) -> jax.Array:
    """Rows of the token embedding for int32 tokens[B, T]: table[tokens].

    The gradient of a gather is a scatter-add whose indices repeat (a token occurs
    many times in a batch). XLA runs that in parallel; IREE cannot split such a
    scatter and runs it in ONE GPU thread: B*T*n_embd dependent read-modify-writes,
    most of a step's time on a GPU through Vulkan (docs/performance.md, section 7).
    token_lookup="onehot" keeps the forward gather (the same numbers) and takes the
    gradient as one_hot(tokens)^T @ grad, a matmul every runtime splits; it costs
    2*B*T*vocab*n_embd FLOPs, small at vocab 256, a tenth of the step at GPT-2's 50,304.
    """
    if config.token_lookup == "onehot":
        return _embed_onehot_grad(table, tokens)
    return table[tokens]


@jax.custom_vjp
def _embed_onehot_grad(table: jax.Array, tokens: jax.Array) -> jax.Array:
    return table[tokens]


def _embed_forward(table: jax.Array, tokens: jax.Array) -> tuple[jax.Array, tuple]:
    return table[tokens], (table, tokens)


def _embed_backward(residuals: tuple, grad: jax.Array) -> tuple[jax.Array, None]:
    table, tokens = residuals
    hot = jax.nn.one_hot(tokens, table.shape[0], dtype=grad.dtype)
    table_grad = jnp.einsum("btv,btc->vc", hot, grad, precision=jax.lax.Precision.HIGHEST)
    return table_grad.astype(table.dtype), None


_embed_onehot_grad.defvjp(_embed_forward, _embed_backward)


def _attention(config: GPTConfig, p: Params, prefix: str, x: jax.Array) -> jax.Array:
    b, t, c = x.shape
    qkv = x @ p[prefix + "c_attn.w"] + p[prefix + "c_attn.b"]
    q, k, v = (qkv.reshape(b, t, 3, config.n_head, c // config.n_head)[:, :, i] for i in range(3))
    y = jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn" if config.attention == "cudnn" else None
    )
    return y.reshape(b, t, c) @ p[prefix + "c_proj.w"] + p[prefix + "c_proj.b"]


def _mlp(p: Params, prefix: str, x: jax.Array) -> jax.Array:
    h = jax.nn.gelu(x @ p[prefix + "c_fc.w"] + p[prefix + "c_fc.b"], approximate=True)
    return h @ p[prefix + "c_proj.w"] + p[prefix + "c_proj.b"]


def _logits(config: GPTConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """Logits [B, T, vocab] in the compute dtype for int32 tokens[B, T], T <= block_size."""
    t = tokens.shape[1]
    if t > config.block_size:
        raise ValueError(f"sequence length {t} is longer than block_size {config.block_size}")
    if config.attention not in ("xla", "cudnn"):
        raise ValueError(f"attention must be 'xla' or 'cudnn', got {config.attention!r}")
    if config.token_lookup not in TOKEN_LOOKUPS:
        raise ValueError(
            f"token_lookup must be one of {TOKEN_LOOKUPS}, got {config.token_lookup!r}"
        )
    if config.attention == "cudnn" and config.compute_dtype == "float32":
        raise ValueError(
            "cuDNN attention needs compute_dtype='bfloat16' (it has no float32 kernel)"
        )
    dtype = jnp.dtype(config.compute_dtype)
    p = {name: value.astype(dtype) for name, value in params.items()}
    x = _embed(config, p["wte"], tokens) + p["wpe"][:t]
    for i in range(config.n_layer):
        h = f"h.{i}."
        x = x + _attention(
            config, p, h + "attn.", _layer_norm(x, p[h + "ln_1.scale"], p[h + "ln_1.bias"])
        )
        x = x + _mlp(p, h + "mlp.", _layer_norm(x, p[h + "ln_2.scale"], p[h + "ln_2.bias"]))
    x = _layer_norm(x, p["ln_f.scale"], p["ln_f.bias"])
    return x @ p["wte"].T


def apply(config: GPTConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """Logits float32[B, T, vocab] for int32 tokens[B, T], T <= block_size."""
    return _logits(config, params, tokens).astype(jnp.float32)


def loss(config: GPTConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (float32) of int32 tokens[B, T+1]:
    inputs tokens[:, :-1], targets tokens[:, 1:].

    Written as logsumexp(logits) - logit[target] on logits in the compute
    dtype: the float32 upcast fuses into the reduction, so no float32
    [B, T, vocab] array (3.3 GB per step for GPT-2 at 16 x 1024) is written
    and read back, forward or backward.

    With token_lookup="onehot" the target's logit is summed out of a one-hot
    product (the same number: every other term is an exact zero), so its gradient
    is a product too, not a scatter (see `_embed`).
    """
    logits = _logits(config, params, tokens[:, :-1])
    normalizer = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    if config.token_lookup == "onehot":
        hot = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1], dtype=logits.dtype)
        target = jnp.sum(logits * hot, axis=-1).astype(jnp.float32)
    else:
        target = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
        target = target.astype(jnp.float32)
    return jnp.mean(normalizer - target)


def param_count(params: Params) -> int:
    return int(sum(np.prod(value.shape) for value in params.values()))


def flops_per_token(config: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM-style: 6N + 12·L·d·T.

    N counts every parameter except the position embedding `wpe` (a lookup, no
    matmul); the tied token embedding stays in N because it is also the
    language-model head, a real [d, vocab] matmul. 12·L·d·T is the attention
    score and value matmuls at sequence length T (T = seq_len, not block_size).
    """
    c, layers = config.n_embd, config.n_layer
    per_layer = 12 * c * c + 13 * c  # c_attn, c_proj, c_fc, c_proj weights + biases + 2 layer norms
    n = layers * per_layer + config.vocab_size * c + 2 * c
    return float(6 * n + 12 * layers * c * seq_len)


@partial(jax.jit, static_argnums=(0, 5))
def _next_token(config, params, window, position, key, top_k, temperature):
    logits = apply(config, params, window)[:, position]
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits / temperature, axis=-1)


def generate(
    config: GPTConfig,
    params: Params,
    prompt_tokens: np.ndarray,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 40,
    key: jax.Array,
) -> np.ndarray:
    """Sample `max_new_tokens` after the prompt; returns prompt + new tokens.

    `prompt_tokens` is int[T] or int[B, T]; the result has the same rank. The
    forward pass always sees a window of exactly block_size tokens (right-padded,
    or the last block_size tokens once the text is longer), so it compiles once.
    """
    tokens = np.atleast_2d(np.asarray(prompt_tokens, np.int32))
    if tokens.shape[1] == 0:
        raise ValueError("generate needs a prompt of at least one token")
    top_k = min(top_k, config.vocab_size) if top_k else 0
    window_size = config.block_size
    for _ in range(max_new_tokens):
        context = tokens[:, -window_size:]
        window = np.zeros((tokens.shape[0], window_size), np.int32)
        window[:, : context.shape[1]] = context
        key, sample_key = jax.random.split(key)
        position = jnp.int32(context.shape[1] - 1)
        new = _next_token(
            config, params, window, position, sample_key, top_k, max(temperature, 1e-6)
        )
        tokens = np.concatenate([tokens, np.asarray(new, np.int32)[:, None]], axis=1)
    return tokens if np.ndim(prompt_tokens) == 2 else tokens[0]
