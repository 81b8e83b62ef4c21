"""Checks each side runs on tensors from the other before using them.

Finiteness and the norm come from one pass over each tensor: a sum of squares
is finite exactly when every value is finite and the sum does not overflow, so
the element-wise `isfinite` pass (and its boolean temporary) runs only on a
tensor whose sum of squares is not finite, to tell which of the two it is.
The worker screens a round start's parameters with `round_start_problem`;
the shepherd's screening of results (`pcp_tui.diloco.screening`) builds on the same norms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np


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
