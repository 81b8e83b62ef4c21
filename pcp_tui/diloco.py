"""DiLoCo's shepherd side: average pseudo-gradients, take the outer step.

Each worker returns Δ_k = θ − θ_k after H inner steps. The shepherd forms the
token-weighted mean Δ = Σ w_k Δ_k / Σ w_k and treats it as a gradient for an
outer optimizer (Nesterov momentum, lr 0.7, momentum 0.9 in the paper). With
H = 1, inner SGD and outer SGD at lr 1 this is exactly synchronous data
parallelism, the baseline every DiLoCo claim is compared with.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
import optax


class PseudoGradientMean:
    """Streaming token-weighted mean: one running sum, never every worker's copy."""

    def __init__(self, names: tuple[str, ...]):
        self._names = names
        self._sum: dict[str, np.ndarray] | None = None
        self.total_weight = 0.0
        self.contributors = 0

    def add(self, pseudo_gradient: Mapping[str, np.ndarray], weight: float) -> None:
        if weight <= 0:
            raise ValueError("a pseudo-gradient needs a positive weight (tokens)")
        if self._sum is None:
            self._sum = {
                n: np.asarray(pseudo_gradient[n], np.float32) * np.float32(weight)
                for n in self._names
            }
        else:
            for n in self._names:
                # in place: no second model-sized buffer per worker
                self._sum[n] += np.asarray(pseudo_gradient[n], np.float32) * np.float32(weight)
        self.total_weight += weight
        self.contributors += 1

    def mean(self) -> dict[str, np.ndarray]:
        if self._sum is None:
            raise ValueError("no pseudo-gradient was added")
        scale = np.float32(1.0 / self.total_weight)
        return {n: v * scale for n, v in self._sum.items()}


class OuterOptimizer:
    """The outer step on the shepherd, over flat dicts of float32 arrays."""

    def __init__(self, kind: str = "nesterov", lr: float = 0.7, momentum: float = 0.9):
        if kind == "nesterov":
            self._tx = optax.sgd(lr, momentum=momentum, nesterov=True)
        elif kind == "sgd":
            self._tx = optax.sgd(lr)
        else:
            raise ValueError(f"unknown outer optimizer {kind!r} (nesterov | sgd)")
        self._step = jax.jit(self._apply)
        self.state = None

    def _apply(self, params, pseudo_gradient, state):
        updates, state = self._tx.update(pseudo_gradient, state, params)
        return optax.apply_updates(params, updates), state

    def step(
        self, params: Mapping[str, np.ndarray], pseudo_gradient: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        params = dict(params)
        if self.state is None:
            self.state = self._tx.init(params)
        new_params, self.state = self._step(params, dict(pseudo_gradient), self.state)
        return {n: np.asarray(v) for n, v in new_params.items()}

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The optimizer state as named arrays (for checkpoints)."""
        if self.state is None:
            return {}
        leaves = jax.tree_util.tree_flatten_with_path(self.state)[0]
        return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}

    def load_state_arrays(
        self, params: Mapping[str, np.ndarray], arrays: Mapping[str, np.ndarray]
    ) -> None:
        template = self._tx.init(dict(params))
        paths, tree = jax.tree_util.tree_flatten_with_path(template)
        missing = [
            jax.tree_util.keystr(p) for p, _ in paths if jax.tree_util.keystr(p) not in arrays
        ]
        if missing:
            raise ValueError(f"checkpoint lacks outer optimizer state {missing[:3]}")
        self.state = jax.tree_util.tree_unflatten(
            tree, [arrays[jax.tree_util.keystr(p)] for p, _ in paths]
        )
