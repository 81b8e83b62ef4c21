"""Which workload a run trains: a GPT-2 preset on a corpus, or a user's model file.

The only place the shepherd turns a `RunConfig` into model code and data
(`build_workload`); workers get the exported graphs and their shard instead.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pcp_tui.config import RunConfig
from pcp_tui.training.corpus import eval_batches, load_corpus, split_shards
from pcp_tui.training.model_file import build_custom_workload, is_model_file
from pcp_tui.training.models import gpt2
from pcp_tui.training.workload import Workload


def preset_name(model: str) -> str:
    """What a GPT-2 preset is called in the dashboard, metrics and checkpoints: gpt2-tiny, gpt2."""
    return model if model.startswith("gpt2") else f"gpt2-{model}"


def model_config(config: RunConfig, vocab_size: int) -> gpt2.GPTConfig:
    if config.model.name not in gpt2.PRESETS:
        raise ValueError(
            f"unknown model {config.model.name!r}; presets: {', '.join(gpt2.PRESETS)}, or a model file path.py:build"
        )
    preset = gpt2.PRESETS[config.model.name]
    return dataclasses.replace(
        preset,
        vocab_size=max(vocab_size, preset.vocab_size) if vocab_size > 256 else vocab_size,
        block_size=max(preset.block_size, config.data.seq_len),
        compute_dtype=config.model.compute_dtype,
        attention=config.model.attention,
        token_lookup=config.model.token_lookup,
    )


def build_workload(config: RunConfig, shards: int) -> Workload:
    """Load the corpus, cut `shards` disjoint training shards, initialise the model.

    `config.model.name` is a GPT-2 preset or a model file (``path.py:build``, see `custom`).
    """
    if is_model_file(config.model.name):
        return build_custom_workload(config, shards)
    corpus = load_corpus(config.data.path, max_bytes=config.data.max_bytes)
    gpt = model_config(config, corpus.vocab_size)
    params = jax.jit(gpt2.init, static_argnums=0)(gpt, jax.random.PRNGKey(config.model.seed))
    host_params = {name: np.asarray(value, np.float32) for name, value in params.items()}
    evals = eval_batches(
        corpus.val,
        batch_size=config.data.batch_size,
        seq_len=config.data.seq_len,
        max_batches=config.evaluation.batches,
    )
    return Workload(
        name=preset_name(config.model.name),
        params=host_params,
        loss_fn=lambda p, tokens: gpt2.loss(gpt, p, tokens),
        batch_spec=jax.ShapeDtypeStruct(
            (config.data.batch_size, config.data.seq_len + 1), jnp.int32
        ),
        corpus=corpus,
        shards=split_shards(corpus.train, shards),
        eval_tokens=evals,
        tokens_per_step=config.data.batch_size * config.data.seq_len,
        flops_per_token=gpt2.flops_per_token(gpt, config.data.seq_len),
        compute_dtype=gpt.compute_dtype,
    )
