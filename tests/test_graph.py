"""The exported graphs compute what the model code computes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from backends import GraphError, select_backend
from pcp_tui.data import sample_batches
from pcp_tui.graph import InnerOptimizer, build_graphs
from pcp_tui.task import build_task

from .conftest import small_config


@pytest.fixture(scope="module")
def task():
    return build_task(small_config(), shards=2)


def _graphs(task, inner: InnerOptimizer | None = None, chunk=3):
    inner = inner or InnerOptimizer(name="adamw", lr=1e-3)
    return build_graphs(
        task.loss_fn,
        task.params,
        task.batch_spec,
        inner=inner,
        chunk_steps=chunk,
        eval_batches=len(task.eval_tokens),
        platforms=("cpu",),
    )


def test_exported_eval_loss_matches_direct_jax(task):
    graphs = _graphs(task)
    evaluate = select_backend("cpu").load("eval_loss", graphs.eval_loss)
    flat = tuple(task.params[n] for n in graphs.param_names)
    exported = float(evaluate.call(flat, task.eval_tokens))
    loss = jax.jit(task.loss_fn)
    direct = float(np.mean([loss(task.params, b) for b in task.eval_tokens]))
    assert exported == pytest.approx(direct, rel=1e-5)
    assert exported == pytest.approx(
        np.log(256), abs=0.3
    )  # an untrained byte model is near uniform


def test_exported_train_chunk_matches_optax_loop(task):
    inner = InnerOptimizer(name="adamw", lr=3e-3, warmup_steps=2, decay_steps=20)
    graphs = _graphs(task, inner, chunk=3)
    backend = select_backend("cpu")
    train = backend.load("train_chunk", graphs.train_chunk, donate_argnums=(0, 1))
    init = backend.load("init_opt_state", graphs.init_opt_state)
    batches = sample_batches(
        task.shards[0], steps=3, batch_size=4, seq_len=32, seed=0, stream=(0, 1, 0)
    )
    flat = tuple(jnp.asarray(task.params[n]) for n in graphs.param_names)
    new_flat, _, losses = train.call(flat, init.call(flat), batches)

    tx = inner.build()
    params = {n: jnp.asarray(v) for n, v in task.params.items()}
    state = tx.init(params)
    expected_losses = []
    value_and_grad = jax.jit(jax.value_and_grad(task.loss_fn))
    for batch in batches:
        value, grads = value_and_grad(params, batch)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        expected_losses.append(float(value))
    np.testing.assert_allclose(np.asarray(losses), expected_losses, rtol=1e-5)
    # Adam divides by sqrt(v): float rounding in a near-zero gradient moves a weight by a
    # visible fraction of one step, so compare against the step size, not machine epsilon.
    for name, value in zip(graphs.param_names, new_flat, strict=True):
        np.testing.assert_allclose(
            np.asarray(value), np.asarray(params[name]), rtol=1e-4, atol=inner.lr * 1e-2
        )
    assert losses[-1] < losses[0]


def test_graph_bytes_are_not_pickles_and_wrong_platform_is_refused(task):
    graphs = build_graphs(
        task.loss_fn,
        task.params,
        task.batch_spec,
        inner=InnerOptimizer(),
        chunk_steps=1,
        eval_batches=1,
        platforms=("cuda",),
    )
    assert not graphs.train_chunk.startswith(b"\x80")  # pickle protocol marker
    with pytest.raises(GraphError, match="lowered for cuda, not cpu"):
        select_backend("cpu").load("train_chunk", graphs.train_chunk)
    with pytest.raises(GraphError, match="not a valid jax.export artifact"):
        select_backend("cpu").load("train_chunk", b"definitely not a graph")
