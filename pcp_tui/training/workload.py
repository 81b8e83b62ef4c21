"""What a run trains: initial parameters, a loss, batches and data shards.

`pcp_tui.training.build` makes one from a GPT-2 preset or a user's model file;
the shepherd exports its graphs and ships its shards. Workers never import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import jax
import numpy as np

from pcp_tui.training.corpus import Corpus, RowData

# one inner step's batch, as the workload's loss takes it: a jax.Array, or a tuple of them
Batch = TypeVar("Batch")


@dataclass
class Workload(Generic[Batch]):
    name: str
    params: dict[str, np.ndarray]
    loss_fn: Callable[[dict[str, jax.Array], Batch], jax.Array]
    batch_spec: Any  # one inner step's batch: int32[B, T+1], or a tuple of [B, ...] for rows
    corpus: Corpus | RowData
    shards: list[np.ndarray] | list[dict[str, np.ndarray]]
    eval_tokens: Any  # [N, B, T+1], or a tuple of [N, B, ...] for rows
    tokens_per_step: int
    flops_per_token: float
    # the dtype `loss_fn` casts every parameter to as it starts (a preset's --compute-dtype):
    # a worker of several devices gathers parameters and reduces gradients in it
    compute_dtype: str = "float32"

    @property
    def param_count(self) -> int:
        return int(sum(p.size for p in self.params.values()))

    @property
    def eval_batch_count(self) -> int:
        return len(jax.tree.leaves(self.eval_tokens)[0])

    @property
    def data_summary(self) -> str:
        corpus = self.corpus
        if isinstance(corpus, RowData):
            return corpus.summary
        return f"corpus {corpus.name}: {len(corpus.train):,} train / {len(corpus.val):,} held-out tokens"
