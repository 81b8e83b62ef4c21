"""DiLoCo in one page: the algorithm the shepherd and workers run, written to be read.

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
Language Models". Every round r:

1. each worker k starts from the global parameters θ and takes H steps of an
   inner optimizer (AdamW) on its own data: θ_k;
2. it returns the pseudo-gradient Δ_k = θ − θ_k and the tokens it trained on, n_k;
3. the shepherd averages them, weighted by tokens: Δ = Σ n_k Δ_k / Σ n_k;
4. and treats Δ as a gradient for an outer optimizer (Nesterov momentum,
   lr 0.7, momentum 0.9): θ ← outer_step(θ, Δ).

With H = 1, inner SGD and outer SGD at lr 1 a round is one step of synchronous
data parallelism on the union of the workers' batches.

This file is the oracle of the tests (tests/test_equivalence.py,
tests/test_round_arithmetic.py); the distributed version is spread over the
worker (`worker/client.py` runs the exported inner steps), the shepherd
(`shepherd/rounds/results.py` screens and folds results, `diloco/aggregate.py` and
`diloco/outer.py` average and step in place on host buffers) and the wire.
It runs on one machine, in plain JAX and optax, a worker at a time.

`streaming_diloco` below is Streaming DiLoCo (Douillard et al. 2025) on the
same page: fragments synced on a staggered schedule, overlapped with τ inner
steps, merged with α (`diloco/streaming.py` holds the schedule and the mix).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pcp_tui.diloco import streaming

Params = dict[str, jax.Array]
LossFn = Callable[[Params, jax.Array], jax.Array]


def inner_steps(
    loss_fn: LossFn,
    params: Params,
    batches: Sequence[jax.Array],
    inner: optax.GradientTransformation,
) -> Params:
    """A worker's round: one inner-optimizer step per batch, from fresh optimizer state."""
    state = inner.init(params)
    for batch in batches:
        params, state = inner_step(loss_fn, inner, params, state, batch)
    return params


@functools.partial(jax.jit, static_argnums=(0, 1))
def inner_step(
    loss_fn: LossFn,
    inner: optax.GradientTransformation,
    params: Params,
    state: optax.OptState,
    batch: jax.Array,
) -> tuple[Params, optax.OptState]:
    """One inner-optimizer step, compiled once per model and optimizer as the worker runs it
    (op by op, each of its few hundred operations compiles on its own: 10x longer)."""
    updates, state = inner.update(jax.grad(loss_fn)(params, batch), state, params)
    return optax.apply_updates(params, updates), state


def pseudo_gradient(start: Params, end: Params) -> Params:
    """Δ = θ − θ_k: points the way a gradient does (the outer step subtracts it)."""
    return jax.tree.map(jnp.subtract, start, end)


def weighted_mean(pseudo_gradients: Sequence[Params], tokens: Sequence[float]) -> Params:
    """Σ n_k Δ_k / Σ n_k: a worker counts as much as the tokens it trained on."""
    total = float(sum(tokens))
    return jax.tree.map(
        lambda *deltas: sum(n * d for n, d in zip(tokens, deltas, strict=True)) / total,
        *pseudo_gradients,
    )


def outer_optimizer(kind: str = "nesterov", lr: float = 0.7, momentum: float = 0.9):
    """The outer optimizer: optax SGD, with Nesterov momentum (DiLoCo) or without."""
    if kind == "nesterov":
        return optax.sgd(lr, momentum=momentum, nesterov=True)
    if kind == "sgd":
        return optax.sgd(lr)
    raise ValueError(f"unknown outer optimizer {kind!r} (nesterov | sgd)")


def outer_step(
    params: Params, state: optax.OptState, delta: Params, outer: optax.GradientTransformation
) -> tuple[Params, optax.OptState]:
    """θ ← θ + outer update(Δ): Δ is the gradient the outer optimizer descends."""
    updates, state = outer.update(delta, state, params)
    return optax.apply_updates(params, updates), state


def diloco(
    loss_fn: LossFn,
    params: dict[str, np.ndarray],
    rounds: Sequence[Sequence[tuple[Sequence[jax.Array], float]]],
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
) -> dict[str, np.ndarray]:
    """Run DiLoCo: `rounds[r]` holds, per worker, its batches for the round and its tokens."""
    theta = {n: jnp.asarray(v, jnp.float32) for n, v in params.items()}
    state = outer.init(theta)
    for workers in rounds:
        deltas = [
            pseudo_gradient(theta, inner_steps(loss_fn, theta, batches, inner))
            for batches, _ in workers
        ]
        delta = weighted_mean(deltas, [tokens for _, tokens in workers])
        theta, state = outer_step(theta, state, delta, outer)
    return {n: np.asarray(v) for n, v in theta.items()}


def streaming_diloco(
    loss_fn: LossFn,
    params: dict[str, np.ndarray],
    rounds: Sequence[Sequence[tuple[Sequence[jax.Array], float]]],
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    fragments: streaming.Fragments,
    overlap: int,
    alpha: float,
    merge: str = "mix",
) -> dict[str, np.ndarray]:
    """Run Streaming DiLoCo: `rounds[r]` holds, per worker, its batches and its tokens.

    The workers step in lockstep. Each keeps its own parameters θ_k, inner
    optimizer state and copy g_k of every fragment's last global value, from
    round to round. At fragment p's send point every worker forms
    Δ_p = g_k,p − θ_k,p; their mean, weighted by the tokens each trained since
    its previous send of p, goes through fragment p's own outer optimizer; τ
    steps later each worker merges the new global value in (`merge`: "mix" or
    "carry", `streaming.mix` / `streaming.carry`). A worker's round
    may have fewer batches than another's (--adaptive-steps): its schedule is
    scaled to its own count H_k, and its tokens a step are its tokens / H_k.
    """

    theta = {n: jnp.asarray(v, jnp.float32) for n, v in params.items()}
    outer_states = [outer.init({n: theta[n] for n in names}) for names in fragments]
    workers = len(rounds[0])
    local = [dict(theta) for _ in range(workers)]
    last_global = [dict(theta) for _ in range(workers)]
    states = [inner.init(theta) for _ in range(workers)]
    since = [[0.0] * len(fragments) for _ in range(workers)]  # tokens since each fragment's send
    sent_at: list[dict] = [{} for _ in range(workers)]  # θ_k at the send point (carry merge)
    for batches_of in rounds:
        # the same (event, fragment) order on every worker: τ < H_k / F keeps sends and merges apart
        plans = [
            streaming.Schedule(len(b), len(fragments), overlap).events() for b, _ in batches_of
        ]
        step = [0] * workers
        for i, (_, event, p) in enumerate(plans[0]):
            for k, (batches, tokens) in enumerate(batches_of):
                at = plans[k][i][0]
                for batch in batches[step[k] : at]:
                    local[k], states[k] = inner_step(loss_fn, inner, local[k], states[k], batch)
                since[k] = [n + (at - step[k]) * tokens / len(batches) for n in since[k]]
                step[k] = at
            names = fragments[p]
            if event is streaming.Event.SEND:
                sent = [{n: last_global[k][n] - local[k][n] for n in names} for k in range(workers)]
                for k in range(workers):
                    sent_at[k].update({n: np.asarray(local[k][n]) for n in names})
                delta = weighted_mean(sent, [since[k][p] for k in range(workers)])
                for k in range(workers):
                    since[k][p] = 0.0
                new, outer_states[p] = outer_step(
                    {n: theta[n] for n in names}, outer_states[p], delta, outer
                )
                theta.update(new)
            else:
                for k in range(workers):
                    for n in names:
                        merged = (
                            streaming.carry(local[k][n], theta[n], sent_at[k][n], alpha)
                            if merge == "carry"
                            else streaming.mix(local[k][n], theta[n], alpha)
                        )
                        local[k][n] = jnp.asarray(merged)
                        last_global[k][n] = theta[n]
    return {n: np.asarray(v) for n, v in theta.items()}
