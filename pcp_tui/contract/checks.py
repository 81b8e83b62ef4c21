"""Checks each side runs on tensors from the other before using them.

Finiteness and the norm come from one pass over each tensor: a sum of squares
is finite exactly when every value is finite and the sum does not overflow, so
the element-wise `isfinite` pass (and its boolean temporary) runs only on a
tensor whose sum of squares is not finite, to tell which of the two it is.
The worker screens a round start's parameters with `round_start_problem`;
the shepherd's screening of results (`pcp_tui.diloco.screening`) builds on the same norms.
Before that, the worker checks the plan: its tensors from their headers
(`plan_tensors_problem`), then its numbers against the graphs it ships (`graphs_problem`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from pcp_tui import protocol


def squared_norm(array: np.ndarray) -> float:
    """The square of a tensor's float32 L2 norm (inf or nan when it is not finite or overflows).

    Computed as `np.linalg.norm` does, a float32 dot product of the flattened
    tensor with itself, so a norm is the same number as before it was fused
    with the finiteness check.
    """
    with np.errstate(over="ignore"):  # overflow to inf is the answer, not an accident
        flat = np.ravel(array).astype(np.float32, copy=False)
        norm = float(np.sqrt(flat.dot(flat)))
    return norm * norm


def is_finite(array: np.ndarray, squared: float | None = None) -> bool:
    """Whether every value of `array` is finite; `squared` (its `squared_norm`) spares a pass."""
    if squared is None:
        squared = squared_norm(array)
    return math.isfinite(squared) or bool(np.isfinite(array).all())


def expected_shapes(graph: Callable, names: Sequence[str]) -> dict[str, tuple[int, ...]] | None:
    """The parameter shapes a compiled graph taking `(params,)` expects; None if it does not say."""
    in_avals = getattr(graph, "in_avals", None)  # a backend's LoadedGraph has them
    if in_avals is None:
        return None
    try:
        import jax

        avals = jax.tree.leaves(in_avals)
    except (TypeError, ImportError):
        return None
    if len(avals) != len(names):
        return None
    return {name: tuple(aval.shape) for name, aval in zip(names, avals, strict=True)}


def round_start_problem(
    tensors: Mapping[str, np.ndarray],
    names: Sequence[str],
    shapes: Mapping[str, tuple[int, ...]] | None,
) -> str | None:
    """Why the parameters of a roundStart cannot be trained on, or None when they can."""
    if set(tensors) != set(names):
        missing = sorted(set(names) - set(tensors))[:3]
        extra = sorted(set(tensors) - set(names))[:3]
        return f"its parameters do not match the plan (missing {missing}, unexpected {extra})"
    for name in names:
        array = tensors[name]
        if shapes is not None and tuple(array.shape) != tuple(shapes[name]):
            return f"{name} has shape {tuple(array.shape)}, the compiled graph takes {tuple(shapes[name])}"
        if array.dtype.kind != "f":
            return f"{name} has dtype {array.dtype}, expected floating point"
        if not is_finite(array):
            return f"{name} holds NaN or Inf"
    return None


def plan_tensors_problem(
    plan: protocol.Plan, specs: Sequence[protocol.TensorSpec], memory_bytes: int
) -> str | None:
    """Why a plan's tensors, known from their headers before any payload byte, cannot be
    taken, or None: each is one the plan names (graph bytes, the shard's data), graph bytes
    are flat uint8, and all of them fit in half of this worker's `memory_bytes`."""
    graphs = {graph.tensor for graph in plan.graphs}
    data = ({plan.shard_tensor} if plan.batch_kind == protocol.BatchKind.WINDOWS else set()) | set(
        plan.data_tensors
    )
    extra = [spec.name for spec in specs if spec.name not in graphs | data]
    if extra:
        return f"the plan carries tensors it does not name: {extra[:3]}"
    for spec in specs:
        if spec.name in graphs and (spec.dtype != "uint8" or len(spec.shape) != 1):
            return f"graph tensor {spec.name!r} is {spec.dtype}{list(spec.shape)}, not flat uint8"
    total = sum(spec.payload_bytes for spec in specs)
    if total > memory_bytes // 2:
        return (
            f"the plan's tensors take {total / 1e9:.2f} GB, more than half of this "
            f"worker's {memory_bytes / 1e9:.2f} GB"
        )
    return None


def graphs_problem(
    plan: protocol.Plan,
    tensors: Mapping[str, np.ndarray],
    signatures: Mapping[str, tuple[Sequence, Sequence]],
) -> str | None:
    """Why the plan does not fit its graphs, or None; `signatures` maps each graph's name to its
    (flat input avals, flat output avals), as read from the artifact before it compiles.

    The plan's numbers (batch size, chunk steps, sequence length, parameters) size what the
    worker allocates for every chunk; the graph was built for its own. A plan that says
    more than its graph takes would allocate for nothing, or fail in the middle of a round.
    """
    init_in, init_out = signatures["init_opt_state"]
    train_in, _ = signatures["train_chunk"]
    params = len(plan.param_names)
    if len(init_in) != params:
        return f"the plan names {params} parameters; its init_opt_state graph takes {len(init_in)}"
    count = sum(math.prod(aval.shape) for aval in init_in)
    if count != plan.param_count:
        return f"the plan counts {plan.param_count} parameter values; its graphs take {count}"
    state = params + len(init_out)
    shapes = lambda avals: [tuple(aval.shape) for aval in avals]  # noqa: E731
    if len(train_in) < state + 2 or shapes(train_in[:state]) != shapes(init_in) + shapes(init_out):
        return "its train_chunk graph does not take the parameters and state init_opt_state makes"
    batches = train_in[state:-1]
    if plan.batch_kind == protocol.BatchKind.WINDOWS:
        expected = [(plan.chunk_steps, plan.batch_size, plan.seq_len + 1)]
        shard = tensors[plan.shard_tensor]
        if shard.ndim != 1 or shard.dtype.kind not in "iu" or len(shard) < plan.seq_len + 2:
            return (
                f"its shard is {shard.dtype}{list(shard.shape)}: it must be integer tokens, "
                f"at least {plan.seq_len + 2} of them"
            )
    else:
        expected = [
            (plan.chunk_steps, plan.batch_size, *tensors[name].shape[1:])
            for name in plan.data_tensors
        ]
    if shapes(batches) != expected:
        return (
            f"the plan's batches ({plan.chunk_steps} steps of {plan.batch_size} rows) would be "
            f"shaped {expected}; its train_chunk graph takes {shapes(batches)}"
        )
    return None
