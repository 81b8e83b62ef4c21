"""DiLoCo's shepherd side: average pseudo-gradients, take the outer step.

Each worker returns Δ_k = θ − θ_k after H inner steps. The shepherd forms the
token-weighted mean Δ = Σ w_k Δ_k / Σ w_k and treats it as a gradient for an
outer optimizer (Nesterov momentum, lr 0.7, momentum 0.9 in the paper). With
H = 1, inner SGD and outer SGD at lr 1 this is exactly synchronous data
parallelism, the baseline every DiLoCo claim is compared with.

Both run in place on float32 buffers kept from round to round, a cache-sized
chunk at a time: a round's arithmetic is a few passes over memory, with no
model-sized temporaries to allocate (a fresh 500 MB array costs more in page
faults than the arithmetic on it) and no copies into and out of a JAX device.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

CHUNK = 1 << 18  # elements per step of the in-place loops: 1 MiB of float32 stays in cache


def _chunks(size: int):
    for start in range(0, size, CHUNK):
        yield slice(start, min(start + CHUNK, size))


def scaled_add(total: np.ndarray, array: np.ndarray, weight: np.float32, scratch: np.ndarray):
    """`total += array * weight` in place, with the same float32 roundings, without a temporary.

    `scratch` holds at least min(CHUNK, total.size) float32 values.
    """
    if total.size <= CHUNK:  # small enough that the temporary is cheap and stays in cache
        total += array * weight
        return
    flat_total, flat = total.reshape(-1), array.reshape(-1)
    for part in _chunks(flat_total.size):
        product = scratch[: part.stop - part.start]
        np.multiply(flat[part], weight, out=product)
        np.add(flat_total[part], product, out=flat_total[part])


class PseudoGradientMean:
    """Streaming token-weighted mean: one running sum, never every worker's copy.

    The sum's buffers are reused after `reset`, so a run allocates them once.
    """

    def __init__(self, names: tuple[str, ...]):
        self._names = names
        self._sum: dict[str, np.ndarray] = {}
        self._scratch = np.empty(0, np.float32)
        self.total_weight = 0.0
        self.contributors = 0

    def reset(self) -> None:
        """Forget the pseudo-gradients added so far (the buffers stay)."""
        self.total_weight = 0.0
        self.contributors = 0

    def add(self, pseudo_gradient: Mapping[str, np.ndarray], weight: float) -> None:
        """Fold one result in with weight `weight` (its tokens)."""
        if weight <= 0:
            raise ValueError("a pseudo-gradient needs a positive weight (tokens)")
        scale = np.float32(weight)
        for n in self._names:
            array = np.asarray(pseudo_gradient[n], np.float32)
            total = self._sum.get(n)
            if total is None or total.shape != array.shape:
                total = self._sum[n] = np.empty(array.shape, np.float32)
            if self.contributors == 0:
                np.multiply(array, scale, out=total)
            else:
                scaled_add(total, array, scale, self._scratch_for(array.size))
        self.total_weight += weight
        self.contributors += 1

    def finish(self) -> list[float]:
        """Nothing to do (no result is scaled): the outer step forms the mean as it goes."""
        return []

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The mean keeps nothing from round to round."""
        return {}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Nothing to restore."""

    def _scratch_for(self, size: int) -> np.ndarray:
        if self._scratch.size < min(size, CHUNK):
            self._scratch = np.empty(min(size, CHUNK), np.float32)
        return self._scratch

    @property
    def scale(self) -> np.float32:
        """What turns the running sum into the mean: 1 / total weight, in float32."""
        if not self.contributors:
            raise ValueError("no pseudo-gradient was added")
        return np.float32(1.0 / self.total_weight)

    @property
    def sums(self) -> Mapping[str, np.ndarray]:
        """The token-weighted running sums (valid until the next `reset` and `add`)."""
        if not self.contributors:
            raise ValueError("no pseudo-gradient was added")
        return self._sum

    def mean(self) -> dict[str, np.ndarray]:
        scale = self.scale
        return {n: v * scale for n, v in self._sum.items()}


class OuterOptimizer:
    """The outer step on the shepherd: SGD, or SGD with Nesterov momentum, over float32 dicts.

    The update is optax's `sgd(lr, momentum, nesterov=True)`: trace = Δ + μ·trace,
    θ += −lr·(Δ + μ·trace). It runs in numpy, one rounding per operation, where
    XLA would fuse each multiply-add into one rounding: results agree with the
    optax version to float32 rounding (a few ulp), not bit for bit. The state is
    named as optax names it, so checkpoints of either version load in the other.
    """

    def __init__(self, kind: str = "nesterov", lr: float = 0.7, momentum: float = 0.9):
        if kind not in ("nesterov", "sgd"):
            raise ValueError(f"unknown outer optimizer {kind!r} (nesterov | sgd)")
        self.kind = kind
        self._step_size = np.float32(-lr)
        self._momentum = np.float32(momentum)
        self.trace: dict[str, np.ndarray] | None = None  # Nesterov's momentum buffer
        self._scratch = np.empty((2, 0), np.float32)

    def step(
        self, params: Mapping[str, np.ndarray], pseudo_gradient: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """New parameters after one outer step on `pseudo_gradient` (the inputs are left alone)."""
        new_params = {n: np.array(p, np.float32) for n, p in params.items()}
        self.apply(new_params, pseudo_gradient, np.float32(1))
        return new_params

    def apply(
        self,
        params: Mapping[str, np.ndarray],
        gradient_sum: Mapping[str, np.ndarray],
        scale: np.float32,
    ) -> None:
        """One outer step in place on `params` (float32), with the gradient `gradient_sum * scale`.

        `PseudoGradientMean.sums` and `.scale` go in as they are: the mean is
        formed chunk by chunk inside the step, rounded exactly as `mean()` would.
        """
        for name, param in params.items():
            if (
                param.dtype != np.float32
                or not param.flags.c_contiguous
                or not param.flags.writeable
            ):
                raise ValueError(f"{name}: the outer step updates writable float32 C-order arrays")
        nesterov = self.kind == "nesterov"
        if nesterov and self.trace is None:
            self.trace = {n: np.zeros(np.shape(p), np.float32) for n, p in params.items()}
        for name, param in params.items():
            flat = param.reshape(-1)
            if not flat.size:
                continue
            gradient_flat = np.asarray(gradient_sum[name], np.float32).reshape(-1)
            gradient, update = self._scratch_for(flat.size)
            trace = self.trace[name].reshape(-1) if nesterov else None
            for part in _chunks(flat.size):
                g, u = gradient[: part.stop - part.start], update[: part.stop - part.start]
                np.multiply(gradient_flat[part], scale, out=g)
                if nesterov:
                    t = trace[part]
                    np.multiply(t, self._momentum, out=t)
                    np.add(g, t, out=t)  # trace = g + μ·trace
                    np.multiply(t, self._momentum, out=u)
                    np.add(g, u, out=u)  # update direction g + μ·trace
                    g = u
                np.multiply(g, self._step_size, out=u)
                np.add(flat[part], u, out=flat[part])

    def _scratch_for(self, size: int) -> np.ndarray:
        if self._scratch.shape[1] < min(size, CHUNK):
            self._scratch = np.empty((2, min(size, CHUNK)), np.float32)
        return self._scratch

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The optimizer state as named arrays (for checkpoints)."""
        if self.trace is None:
            return {}
        return {_trace_key(n): v for n, v in self.trace.items()}

    def load_state_arrays(
        self, params: Mapping[str, np.ndarray], arrays: Mapping[str, np.ndarray]
    ) -> None:
        if self.kind != "nesterov":
            return
        missing = [_trace_key(n) for n in params if _trace_key(n) not in arrays]
        if missing:
            raise ValueError(f"checkpoint lacks outer optimizer state {missing[:3]}")
        trace = {n: np.array(arrays[_trace_key(n)], np.float32) for n in params}
        wrong = [n for n, p in params.items() if trace[n].shape != np.shape(p)]
        if wrong:
            raise ValueError(f"checkpoint's outer optimizer state does not fit {wrong[:3]}")
        self.trace = trace


def _trace_key(name: str) -> str:
    """The momentum buffer's name in optax's state tree (`jax.tree_util.keystr` of its path)."""
    return f"[0].trace[{name!r}]"
