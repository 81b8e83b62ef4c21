"""`pcp-tui sample`: let a person read what a checkpoint has learned."""

from __future__ import annotations

import jax
import numpy as np

from pcp_tui.config import ConfigError, RunConfig, flat_names
from pcp_tui.shepherd.run import checkpoint
from pcp_tui.training.build import model_config
from pcp_tui.training.corpus import decode_tokens, encode_text

SAMPLE_HINT = "pass the --checkpoint-dir of a run, or one of its round-NNNNNN directories"


def sample_text(
    directory: str,
    prompt: str,
    *,
    tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
) -> str:
    """Continue `prompt` with the latest checkpoint in `directory` (byte-level GPT-2 models).

    `directory` is a run's --checkpoint-dir or one of its round directories.
    ConfigError when the checkpoint holds a model this cannot sample from.
    """
    from pcp_tui.training.models import gpt2

    saved = checkpoint.load_latest(directory, hint=SAMPLE_HINT)
    options = saved.meta.get("config", {})
    if options.get("model") not in gpt2.PRESETS or "wte" not in saved.params:
        raise ConfigError(
            f"sample generates text from a GPT-2 checkpoint; {saved.path} holds model "
            f"{saved.meta.get('model') or options.get('model') or 'unknown'} "
            f"(--model {options.get('model')}): load its params.safetensors with your own code"
        )
    known = {k: v for k, v in options.items() if k in flat_names(RunConfig) and k != "platforms"}
    config = RunConfig(**known)
    vocab = int(saved.params["wte"].shape[0])
    if vocab != 256:
        raise ConfigError(
            f"{saved.path} uses a {vocab}-token vocabulary; sample decodes byte-level models only"
        )
    gpt = model_config(config.replace(attention="xla"), vocab)
    params = {n: jax.numpy.asarray(v) for n, v in saved.params.items()}
    prompt_tokens = encode_text(prompt) if prompt else np.array([10], np.uint8)
    out = gpt2.generate(
        gpt,
        params,
        prompt_tokens.astype(np.int32),
        tokens,
        temperature=temperature,
        top_k=top_k,
        key=jax.random.PRNGKey(seed),
    )
    return decode_tokens(out)
