"""Models a run can train. One file per model family; GPT-2 is the only one so far."""

from pcp_tui.training.models.gpt2 import (
    PRESETS,
    GPTConfig,
    apply,
    flops_per_token,
    generate,
    init,
    loss,
    param_count,
)

__all__ = [
    "GPTConfig",
    "PRESETS",
    "init",
    "apply",
    "loss",
    "param_count",
    "flops_per_token",
    "generate",
]
