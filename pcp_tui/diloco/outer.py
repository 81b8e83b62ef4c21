"""DiLoCo's shepherd side: average pseudo-gradients, take the outer step.

Each worker returns Δ_k = θ − θ_k after H inner steps. The shepherd forms the
token-weighted mean Δ = Σ w_k Δ_k / Σ w_k and treats it as a gradient for an
outer optimizer (Nesterov momentum, lr 0.7, momentum 0.9 in the paper). With
H = 1, inner SGD and outer SGD at lr 1 this is exactly synchronous data
parallelism, the baseline every DiLoCo claim is compared with.

The mean runs in place on float32 buffers kept from round to round, a
cache-sized chunk at a time: a pass over memory per result, with no model-sized
temporaries to allocate (a fresh 500 MB array costs more in page faults than
the arithmetic on it). The outer step is a library optimizer (optax), as in
`reference.py`: its state is optax's, and its arithmetic optax's chain op for
op, fused in place on the same host buffers (`fused.py`; `apply_optax` runs
optax's update itself, the oracle of the tests).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from pcp_tui.diloco import fused, reference
from pcp_tui.diloco.fused import CHUNK as CHUNK  # re-exported: the chunk of the in-place loops
from pcp_tui.diloco.partial import Partial


def scaled_add(
    total: np.ndarray, array: np.ndarray, weight: np.float32, threads: int = fused.THREADS
) -> None:
    """`total += array * weight` in place, with the same float32 roundings, without a temporary.

    A cache-sized chunk at a time, over `threads` threads (`fused.over_chunks`).
    """
    fused.over_chunks(fused.fold_chunk, [(total, array)], (weight, False), threads)


class PseudoGradientMean:
    """Streaming token-weighted mean: one running sum, never every worker's copy.

    The round's results fold into one `partial.Partial` without a center or a
    radius (the same fold centered clip and a relay use; a relay's partial merges
    in with `merge`). The sum's buffers are reused after `reset`, so a run
    allocates them once.
    """

    def __init__(self, names: tuple[str, ...]):
        self._names = names
        self._sum: dict[str, np.ndarray] = {}
        self.threads = fused.THREADS  # threads of each fold (`fused.over_chunks`)
        self.partial = Partial(names, measure=False, buffers=self._sum)

    def reset(self) -> None:
        """Forget the pseudo-gradients added so far (the buffers stay)."""
        self.partial = Partial(self._names, measure=False, buffers=self._sum, threads=self.threads)

    def add(
        self,
        pseudo_gradient: Mapping[str, np.ndarray],
        weight: float,
        key: str = "",
        share: float = 1.0,
    ) -> None:
        """Fold one result in with weight `weight` (its tokens, times its `share`: that is in
        it already); `key` names it (a second result of one key is refused), by default its
        place in the round."""
        self.partial.threads = self.threads
        self.partial.add(key or f"#{len(self.partial.results)}", pseudo_gradient, weight)

    def merge(self, partial: Partial) -> None:
        """Fold in a partial of this round's results (a relay's), folded without a center."""
        self.partial.merge(partial)

    @property
    def total_weight(self) -> float:
        return self.partial.weight

    @property
    def contributors(self) -> int:
        return len(self.partial.results)

    def finish(self) -> list[float]:
        """Nothing to do (no result is scaled): the outer step forms the mean as it goes."""
        return []

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The mean keeps nothing from round to round."""
        return {}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Nothing to restore."""

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
    """The outer step on the shepherd: an optax optimizer over the host's float32 parameters.

    `optax.sgd(lr, momentum, nesterov=True)` (DiLoCo) or plain `optax.sgd(lr)`,
    the very transformations of `reference.outer_optimizer`. Its state is a
    pytree, checkpointed leaf by leaf under `jax.tree_util.keystr` of its path
    (`[0].trace['wte']`): another optax chain is a matter of configuration, and
    checkpoints of the hand-written numpy step of before, which used the same
    names, load as they are. The step itself runs optax's arithmetic fused
    in place (`apply`; `apply_optax` is optax's update as it is, the same bits
    at several times the time: docs/performance.md, "The outer step, fused").
    """

    def __init__(self, kind: str = "nesterov", lr: float = 0.7, momentum: float = 0.9):
        self.kind, self.lr, self.momentum = kind, lr, momentum
        self.transform = reference.outer_optimizer(kind, lr, momentum)
        # the optax state (a chain's: a tuple), made on the first step (or loaded)
        self.state: tuple | None = None

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
        threads: int = fused.THREADS,
    ) -> None:
        """One outer step in place on `params` (float32), with the gradient `gradient_sum * scale`.

        `PseudoGradientMean.sums` and `.scale` go in as they are, rounded to the
        mean as `mean()` rounds it. The arithmetic is optax's own chain, op for
        op (`apply_optax` runs optax itself), fused into one pass over memory in
        cache-sized chunks over `threads` threads (`fused.py`): the same bits as
        `reference.outer_step`, without its six model-sized temporaries. optax
        jitted would fuse multiply-adds and differ by an ulp.
        """
        _check_writable(params)
        state = self._own_state(params)
        momentum, neg_lr = np.float32(self.momentum), np.float32(-self.lr)
        sums = {n: np.ascontiguousarray(gradient_sum[n], np.float32) for n in params}
        rows: list[tuple[np.ndarray, ...]]  # per parameter, the arrays its kernel reads
        constants: tuple  # the kernel's scalars
        if self.kind == "nesterov":
            trace = state[0].trace
            rows = [(params[n], trace[n], sums[n]) for n in params]
            constants = (scale, momentum, neg_lr, fused.small_bound(self.lr, self.momentum))
            fused.over_chunks(fused.nesterov_chunk, rows, constants, threads)
        else:
            rows = [(params[n], sums[n]) for n in params]
            constants = (scale, neg_lr, fused.small_bound(self.lr, 0.0))
            fused.over_chunks(fused.sgd_chunk, rows, constants, threads)

    def apply_optax(
        self,
        params: Mapping[str, np.ndarray],
        gradient_sum: Mapping[str, np.ndarray],
        scale: np.float32,
    ) -> None:
        """`apply` through optax's update itself, on XLA: the oracle of `apply`, and slower.

        The gradient and state go in as JAX arrays, so every op of optax's chain
        runs in XLA as in `reference.outer_step` (given numpy arrays, optax's
        lambdas would run in numpy, which keeps the subnormals XLA flushes);
        θ += update stays numpy's, as the shepherd's step always did. Kept for
        the tests and for `benchmarks/bench_outer_step.py`'s "before".
        """
        _check_writable(params)
        gradient = {
            n: jnp.asarray(np.multiply(gradient_sum[n], scale, dtype=np.float32)) for n in params
        }
        state = self.transform.init(gradient) if self.state is None else self.state
        state = jax.tree_util.tree_map(jnp.asarray, state)
        updates, self.state = self.transform.update(gradient, state)
        for name, param in params.items():
            np.add(param, np.asarray(updates[name]), out=param)

    def _own_state(self, params: Mapping[str, np.ndarray]) -> tuple:
        """Make the state (zeros on the first step) and hold its leaves as writable numpy arrays;
        returns it."""
        if self.state is None:  # from optax's shapes: no device array (on a GPU host, no GPU)
            self.state = jax.tree_util.tree_map(
                lambda leaf: np.zeros(leaf.shape, leaf.dtype), self._state_shapes(params)
            )
        leaves = jax.tree_util.tree_leaves(self.state)
        if not all(isinstance(leaf, np.ndarray) and leaf.flags.writeable for leaf in leaves):
            self.state = jax.tree_util.tree_map(lambda leaf: np.array(leaf, np.float32), self.state)
        return self.state

    def _state_shapes(self, params: Mapping[str, np.ndarray]):
        """optax's state for `params` as shapes and dtypes (`jax.eval_shape`: nothing allocated)."""
        specs = {n: jax.ShapeDtypeStruct(np.shape(p), np.float32) for n, p in params.items()}
        return jax.eval_shape(self.transform.init, specs)

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The optimizer state as arrays named by key path (for checkpoints)."""
        if self.state is None:
            return {}
        leaves = jax.tree_util.tree_flatten_with_path(self.state)[0]
        return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}

    def load_state_arrays(
        self, params: Mapping[str, np.ndarray], arrays: Mapping[str, np.ndarray]
    ) -> None:
        """Take the state back from `state_arrays`' names; ValueError if it lacks or misfits some."""
        template = self._state_shapes(params)
        leaves, tree = jax.tree_util.tree_flatten_with_path(template)
        names = [jax.tree_util.keystr(path) for path, _ in leaves]
        missing = [name for name in names if name not in arrays]
        if missing:
            raise ValueError(f"checkpoint lacks outer optimizer state {missing[:3]}")
        loaded = [np.array(arrays[name], np.float32) for name in names]
        wrong = [
            n for n, a, (_, t) in zip(names, loaded, leaves, strict=True) if a.shape != t.shape
        ]
        if wrong:
            raise ValueError(f"checkpoint's outer optimizer state does not fit {wrong[:3]}")
        self.state = jax.tree_util.tree_unflatten(tree, loaded)


def _check_writable(params: Mapping[str, np.ndarray]) -> None:
    for name, param in params.items():
        if param.dtype != np.float32 or not param.flags.writeable:
            raise ValueError(f"{name}: the outer step updates writable float32 arrays")
