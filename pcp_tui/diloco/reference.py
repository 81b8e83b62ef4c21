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
(`shepherd/rounds.py` screens and folds results, `diloco/aggregate.py` and
`diloco/outer.py` average and step in place on host buffers) and the wire.
It runs on one machine, in plain JAX and optax, a worker at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

Params = dict[str, jax.Array]
LossFn = Callable[[Params, jax.Array], jax.Array]


def inner_steps(
    loss_fn: LossFn,
    params: Params,
    batches: Sequence[jax.Array],
    inner: optax.GradientTransformation,
) -> Params:
    """A worker's round: one inner-optimizer step per batch, from fresh optimizer state."""
    grad = jax.grad(loss_fn)
    state = inner.init(params)
    for batch in batches:
        updates, state = inner.update(grad(params, batch), state, params)
        params = optax.apply_updates(params, updates)
    return params


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
