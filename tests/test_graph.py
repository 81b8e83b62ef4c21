"""The exported graphs compute what the model code computes."""

from __future__ import annotations

import fcntl
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pcp_tui.backends import GraphError, select_backend
from pcp_tui.backends._iree import serial_scatters
from pcp_tui.backends._jax import _compile_lock_path, _compiling_alone
from pcp_tui.training.build import build_workload
from pcp_tui.training.export import InnerOptimizer, build_graphs
from pcp_tui.training.shards import sample_batches

from .conftest import small_config


@pytest.fixture(scope="module")
def workload():
    return build_workload(small_config(), shards=2)


def _graphs(workload, inner: InnerOptimizer | None = None, chunk=3):
    inner = inner or InnerOptimizer(name="adamw", lr=1e-3)
    return build_graphs(
        workload.loss_fn,
        workload.params,
        workload.batch_spec,
        inner=inner,
        chunk_steps=chunk,
        eval_batches=len(workload.eval_tokens),
        platforms=("cpu",),
    )


def test_exported_eval_loss_matches_direct_jax(workload):
    graphs = _graphs(workload)
    evaluate = select_backend("cpu").load("eval_loss", graphs.eval_loss)
    flat = tuple(workload.params[n] for n in graphs.param_names)
    exported = float(evaluate.call(flat, workload.eval_tokens))
    loss = jax.jit(workload.loss_fn)
    direct = float(np.mean([loss(workload.params, b) for b in workload.eval_tokens]))
    assert exported == pytest.approx(direct, rel=1e-5)
    assert exported == pytest.approx(
        np.log(256), abs=0.3
    )  # an untrained byte model is near uniform


def _optax_reference(inner: InnerOptimizer, first_step: int) -> optax.GradientTransformation:
    """The inner optimizer as plain optax would write it, its schedule shifted to `first_step`."""

    def lr(count):
        return inner.schedule()(count + first_step)

    decay = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    if inner.name == "adamw":
        step = optax.adamw(
            lr, b1=inner.b1, b2=inner.b2, weight_decay=inner.weight_decay, mask=decay
        )
    else:
        step = optax.sgd(lr)
    return optax.chain(optax.clip_by_global_norm(inner.grad_clip), step)


_chunks: dict = {}


def _compiled_chunk(workload, inner: InnerOptimizer):
    """The exported and compiled train_chunk (and init) of `inner`, once per optimizer: the
    first step is an argument of the graph, so both cases of one optimizer share it."""
    if inner not in _chunks:
        graphs = _graphs(workload, inner, chunk=3)
        backend = select_backend("cpu")
        train = backend.load("train_chunk", graphs.train_chunk, donate_argnums=(0, 1))
        _chunks[inner] = (graphs, train, backend.load("init_opt_state", graphs.init_opt_state))
    return _chunks[inner]


@pytest.mark.parametrize(
    ("name", "first_step"), [("adamw", 0), ("adamw", 7), ("sgd", 0), ("sgd", 11)]
)
def test_exported_train_chunk_matches_optax_loop(workload, name, first_step):
    """A fresh optimizer state started at global step `first_step` takes exactly the steps of
    optax.adamw / optax.sgd whose schedule is read at the run's step, not the worker's own:
    that is what keeps a late joiner or a reconnected worker on the run's warm-up and decay."""
    inner = InnerOptimizer(name=name, lr=3e-3, warmup_steps=4, decay_steps=20)
    graphs, train, init = _compiled_chunk(workload, inner)
    batches = sample_batches(
        workload.shards[0], steps=3, batch_size=4, seq_len=32, seed=0, stream=(0, 1, 0)
    )
    flat = tuple(jnp.asarray(workload.params[n]) for n in graphs.param_names)
    new_flat, _, losses = train.call(flat, init.call(flat), batches, np.int32(first_step))

    tx = _optax_reference(inner, first_step)
    params = {n: jnp.asarray(v) for n, v in workload.params.items()}
    state = tx.init(params)
    expected_losses = []
    value_and_grad = jax.jit(jax.value_and_grad(workload.loss_fn))
    for batch in batches:
        value, grads = value_and_grad(params, batch)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        expected_losses.append(float(value))
    np.testing.assert_allclose(np.asarray(losses), expected_losses, rtol=1e-5)
    # Adam divides by sqrt(v): float rounding in a near-zero gradient moves a weight by a
    # visible fraction of one step, so compare against the step size, not machine epsilon.
    for name_, value in zip(graphs.param_names, new_flat, strict=True):
        np.testing.assert_allclose(
            np.asarray(value), np.asarray(params[name_]), rtol=1e-4, atol=inner.lr * 1e-2
        )
    assert losses[-1] < losses[0]


def test_graph_bytes_are_not_pickles_and_wrong_platform_is_refused(workload):
    graphs = build_graphs(
        workload.loss_fn,
        workload.params,
        workload.batch_spec,
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


@pytest.mark.parametrize("lookup", ["gather", "onehot"])
def test_iree_gpu_friendly_export_has_no_scatter_and_no_scalar_select(lookup):
    """What makes IREE slow on a GPU, checked in the StableHLO every worker gets.

    A scatter-add with repeating indices (the gradient of a gather) runs in one GPU thread
    under IREE; --token-lookup onehot takes it out. A select on one boolean (optax's
    gradient clipping) makes IREE wait for the GPU mid-step to read it; the exported
    clipping multiplies by a factor instead, for every lookup.
    """
    workload = build_workload(small_config(token_lookup=lookup), shards=1)
    graphs = _graphs(workload, InnerOptimizer(name="adamw", lr=1e-3, grad_clip=1.0), chunk=1)
    text = jax.export.deserialize(bytearray(graphs.train_chunk)).mlir_module()
    assert serial_scatters(text) == (2 if lookup == "gather" else 0)  # embedding, loss target
    assert "stablehlo.sqrt" in text  # the global norm is there: clipping was exported
    assert not re.search(r"stablehlo\.select .*: tensor<i1>, tensor<\d", text)


def test_an_unrolled_chunk_has_no_loop_and_the_same_steps(workload):
    """scan_unroll=chunk_steps leaves IREE straight-line code it records once (no loop)."""
    inner = InnerOptimizer(name="adamw", lr=1e-3)
    batches = sample_batches(
        workload.shards[0], steps=2, batch_size=4, seq_len=32, seed=0, stream=(0, 1, 0)
    )
    backend = select_backend("cpu")
    flat = tuple(jnp.asarray(workload.params[n]) for n in sorted(workload.params))
    results = []
    for unroll in (1, 2):
        graphs = build_graphs(
            workload.loss_fn, workload.params, workload.batch_spec, inner=inner,
            chunk_steps=2, eval_batches=1, platforms=("cpu",), scan_unroll=unroll,
        )  # fmt: skip
        text = jax.export.deserialize(bytearray(graphs.train_chunk)).mlir_module()
        assert ("stablehlo.while" in text) == (unroll == 1)
        init = backend.load("init_opt_state", graphs.init_opt_state)
        train = backend.load("train_chunk", graphs.train_chunk)
        results.append(np.asarray(train.call(flat, init.call(flat), batches, np.int32(0))[2]))
    np.testing.assert_array_equal(results[1], results[0])


def test_one_process_at_a_time_compiles_a_graph_into_the_cache():
    """Workers started together each compiled the same graph cold, at once. While one compiles
    a graph into the on-disk cache (this test run's, tests/conftest.py), that graph's lock is
    held: another process waits for it, then loads the executable from the cache. Another
    graph's lock is free meanwhile, and the lock is free again once the compile is over."""

    def held(graph: bytes) -> bool:
        """Whether another process would wait to compile `graph` now."""
        path = _compile_lock_path(graph)
        assert path is not None
        with open(path, "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False

    with _compiling_alone(b"graph a"):
        assert held(b"graph a") and not held(b"graph b")
    assert not held(b"graph a")
