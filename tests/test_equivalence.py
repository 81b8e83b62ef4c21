"""DiLoCo with H=1, inner SGD and outer SGD at lr 1 is synchronous data parallelism.

Two real workers (`Worker`, in this process) train through real sockets; the shepherd's final
parameters must equal the one-page DiLoCo of `pcp_tui.diloco.reference` on the
same batches, and that must equal plain SGD on the union of the two workers'
batches. This pins the token-weighted averaging and the outer step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pcp_tui.diloco import reference
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.testing import local_workers, run_shepherd, worker_batches
from pcp_tui.training.build import build_workload

from .conftest import small_config

LR = 0.5
ROUNDS = 3


def _synchronous_sgd(workload, config) -> dict[str, np.ndarray]:
    params = {n: jnp.asarray(v) for n, v in workload.params.items()}
    grad = jax.jit(jax.grad(workload.loss_fn))
    for number in range(1, ROUNDS + 1):
        union = np.concatenate(
            [worker_batches(workload, config, slot, number, 1)[0] for slot in range(2)]
        )
        g = grad(params, union)
        params = {n: params[n] - LR * g[n] for n in params}
    return {n: np.asarray(v) for n, v in params.items()}


def _reference_diloco(workload, config) -> dict[str, np.ndarray]:
    tokens = float(config.data.batch_size * config.data.seq_len)
    rounds = [
        [(worker_batches(workload, config, slot, number, 1), tokens) for slot in range(2)]
        for number in range(1, ROUNDS + 1)
    ]
    return reference.diloco(
        workload.loss_fn,
        workload.params,
        rounds,
        inner=optax.sgd(LR),
        outer=reference.outer_optimizer("sgd", lr=1.0),
    )


def test_two_workers_equal_synchronous_sgd():
    config = small_config(
        rounds=ROUNDS,
        inner_steps=1,
        chunk_steps=1,
        inner_optimizer="sgd",
        inner_lr=LR,
        warmup_steps=0,
        grad_clip=0.0,
        outer_optimizer="sgd",
        outer_lr=1.0,
        aggregate="mean",  # the token-weighted mean DiLoCo defines; robust ones differ on purpose
        workers=2,
        eval_every=ROUNDS,
    )
    workload = build_workload(config, shards=2)
    shepherd = Shepherd(config, workload)

    run_shepherd(shepherd, local_workers(2))
    assert [r.workers for r in shepherd.state.history] == [2] * ROUNDS
    expected = _reference_diloco(workload, config)
    synchronous = _synchronous_sgd(workload, config)
    moved = 0.0
    for name, value in expected.items():
        np.testing.assert_allclose(value, synchronous[name], rtol=2e-5, atol=2e-6, err_msg=name)
        np.testing.assert_allclose(shepherd.params[name], value, rtol=2e-5, atol=2e-6, err_msg=name)
        moved = max(moved, float(np.abs(value - workload.params[name]).max()))
    assert moved > 1e-3  # the parameters really changed: the check is not vacuous
