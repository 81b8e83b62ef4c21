"""Loss-delta validation scores real results of the real exported graphs by what they do.

The tiny model, its exported `train_chunk` and `eval_loss` (what a worker and the
shepherd run), real pseudo-gradients of one round from two workers' assigned batches.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcp_tui.backends import select_backend
from pcp_tui.diloco.screening import BadResult
from pcp_tui.diloco.validation import (
    AssignedBatches,
    Assignment,
    LossDeltaValidator,
    eval_loss,
)
from pcp_tui.shepherd.rounds.engine import inner_optimizer
from pcp_tui.shepherd.run.graphs import GraphLibrary
from pcp_tui.testing._inprocess import worker_batches
from pcp_tui.training.build import build_workload

from .conftest import small_config

STEPS = 4


@pytest.fixture(scope="module")
def run():
    """(config, workload, graphs, backend, θ, {index: Δ of round 1}) at chunk_steps 1, no warm-up."""
    config = small_config(workers=2, inner_steps=STEPS, chunk_steps=1, warmup_steps=0)
    workload = build_workload(config, shards=2)
    graphs = GraphLibrary.for_run(config, workload, inner_optimizer(config)).export_main()
    backend = select_backend("cpu")
    train = backend.load("train_chunk", graphs.train_chunk).call
    init = backend.load("init_opt_state", graphs.init_opt_state).call
    names = graphs.param_names
    theta = {n: np.array(p, np.float32) for n, p in workload.params.items()}
    deltas = {}
    for index in (0, 1):
        flat, state = tuple(theta[n] for n in names), init(tuple(theta[n] for n in names))
        for step, batch in enumerate(worker_batches(workload, config, index, 1, STEPS)):
            flat, state, _ = train(flat, state, batch[None], np.int32(step))
        deltas[index] = {n: theta[n] - np.asarray(v) for n, v in zip(names, flat, strict=True)}
    return config, workload, graphs, backend, theta, deltas


def _validator(run) -> tuple[LossDeltaValidator, AssignedBatches]:
    config, workload, graphs, backend, theta, _ = run
    batches = AssignedBatches(
        workload.shards,
        count=workload.eval_batch_count,
        chunk_steps=graphs.chunk_steps,
        batch_size=config.data.batch_size,
        seq_len=config.data.seq_len,
        seed=config.model.seed,
    )
    loss = eval_loss(backend.load("eval_loss", graphs.eval_loss).call, graphs.param_names)
    validator = LossDeltaValidator(loss, batches)
    validator.begin(1, theta)
    return validator, batches


def _times(delta, factor):
    return {n: v * np.float32(factor) for n, v in delta.items()}


def test_the_batches_scored_are_ones_the_worker_trained_on(run):
    config, workload, *_ = run
    _, batches = _validator(run)
    trained = worker_batches(workload, config, 1, 3, STEPS)
    picked = batches(Assignment(index=1, shard=1, steps=STEPS), 3)
    assert picked.shape == (workload.eval_batch_count, *trained[0].shape)
    # two batches spread over four steps: the first and the last
    np.testing.assert_array_equal(picked, np.stack([trained[0], trained[STEPS - 1]]))


def test_an_honest_result_counts_in_full_and_a_flipped_or_vanishing_one_is_refused(run):
    *_, deltas = run
    validator, _ = _validator(run)
    claim = Assignment(index=0, shard=0, steps=STEPS)
    for attack in (_times(deltas[0], -1.0), _times(deltas[0], 1e-12)):
        with pytest.raises(BadResult, match="a result must lower it"):
            validator.weigh(attack, 100, claim)
    assert validator.weigh(deltas[0], 100, claim) == 100.0
    # another worker's honest result, scored on its own batches
    assert validator.weigh(deltas[1], 100, Assignment(index=1, shard=1, steps=STEPS)) == 100.0
