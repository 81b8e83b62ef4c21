"""A custom model for pcp-tui: a 2-layer MLP classifying a synthetic data set.

    pcp-tui demo --model examples/mlp_model.py:build --workers 2 --headless --batch-size 32

The shepherd imports this file; workers never see it. They get the exported
training graph and their rows of the data set.
"""

import jax
import jax.numpy as jnp
import numpy as np

import pcp_tui

FEATURES, HIDDEN, CLASSES = 16, 64, 4
TRAIN_ROWS, VAL_ROWS = 8192, 1024


def synthetic_data(seed: int) -> pcp_tui.Dataset:
    """Points labelled by a random teacher network: learnable, but not linearly.

    The teacher's first layer is scaled by 1/sqrt(FEATURES), so its tanh works
    in its smooth range: unscaled, it saturates into 32 sharp hyperplanes that
    this student cannot fit past a loss of about 0.75, and then has nothing left
    to learn but noise.
    """
    rng = np.random.default_rng(seed)
    teacher_in = rng.normal(size=(FEATURES, 32)) / np.sqrt(FEATURES)
    teacher_out = rng.normal(size=(32, CLASSES))
    x = rng.normal(size=(TRAIN_ROWS + VAL_ROWS, FEATURES)).astype(np.float32)
    y = np.argmax(np.tanh(x @ teacher_in) @ teacher_out, axis=1).astype(np.int32)
    return pcp_tui.Dataset(
        train={"x": x[:TRAIN_ROWS], "y": y[:TRAIN_ROWS]},
        val={"x": x[TRAIN_ROWS:], "y": y[TRAIN_ROWS:]},
    )


def init(key: jax.Array) -> dict[str, jax.Array]:
    """Weights of unit scale; `loss` applies each layer's 1/sqrt(fan-in).

    AdamW moves every weight by about the learning rate each step, whatever its
    scale. Weights initialised at 1/sqrt(fan-in) (0.25 and 0.125 here) would
    move by 1-2% a step at the default inner lr; once the model has learned
    what it can, those steps are mostly noise, and DiLoCo's outer momentum adds
    them up round after round: the loss rose from round 4 on. Stored at unit
    scale, the same steps are 4-8x smaller next to the weights they change.
    """
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (FEATURES, HIDDEN)),
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, CLASSES)),
        "b2": jnp.zeros(CLASSES),
    }


def loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    """Mean cross-entropy; batch["x"] is float32[B, 16], batch["y"] int32[B]."""
    hidden = jax.nn.gelu(batch["x"] @ params["w1"] / jnp.sqrt(FEATURES) + params["b1"])
    logits = hidden @ params["w2"] / jnp.sqrt(HIDDEN) + params["b2"]
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, batch["y"][:, None], axis=1))


def build(config) -> pcp_tui.ModelSpec:
    """config: the run's pcp_tui RunConfig (seed, batch_size, ...)."""
    return pcp_tui.ModelSpec(
        name="mlp-16x64x4", init=init, loss=loss, data=synthetic_data(config.model.seed)
    )
