"""Checks each side runs on tensors from the other before using them.

The shepherd screens pseudo-gradients beyond their names, shapes and
finiteness (`rounds.check_pseudo_gradient`): one whose global L2 norm is
absurd next to the recently accepted ones would wreck the model even though
every number in it is finite. The worker screens the parameters of a round
start: they must be exactly the plan's tensors, with the shapes the compiled
graph takes, and finite.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .rounds import BadResult

NORM_FACTOR = 10.0  # refuse a norm above this many times the median of recent accepted ones
NORM_BASELINE = 2  # accepted norms needed before the check applies
NORM_WINDOW = 8  # recent accepted norms the median is taken over (a few rounds)


def global_norm(tensors: Mapping[str, np.ndarray]) -> float:
    """L2 norm over all tensors together (inf if it overflows: that is absurd anyway)."""
    total = 0.0
    with np.errstate(over="ignore"):
        for array in tensors.values():
            norm = float(np.linalg.norm(np.ravel(array).astype(np.float32, copy=False)))
            total += norm * norm
    return math.sqrt(total)


class NormGuard:
    """Remembers the norms of recently accepted pseudo-gradients and refuses outliers.

    The window is short so that norms may drift over a run (warm-up, decay)
    while a single update ten times larger than its peers is still caught.
    """

    def __init__(
        self, factor: float = NORM_FACTOR, baseline: int = NORM_BASELINE, window: int = NORM_WINDOW
    ):
        self.factor, self.baseline = factor, baseline
        self._recent: collections.deque[float] = collections.deque(maxlen=window)

    def check(self, tensors: Mapping[str, np.ndarray]) -> float:
        """The pseudo-gradient's global norm; BadResult if it is not finite or absurdly large."""
        norm = global_norm(tensors)
        if not math.isfinite(norm):
            raise BadResult("its global L2 norm overflows float32")
        if len(self._recent) >= self.baseline:
            typical = statistics.median(self._recent)
            if (
                typical > 0 and norm > self.factor * typical
            ):  # a zero median (lr 0 at warm-up start) says nothing
                raise BadResult(
                    f"its global L2 norm {norm:.4g} is over {self.factor:g}x the median "
                    f"{typical:.4g} of recently accepted results"
                )
        return norm

    def accept(self, norm: float) -> None:
        """Record the norm of a result that was averaged in."""
        self._recent.append(norm)


def check_token_count(reported: object, most: int) -> None:
    """BadResult unless 0 < tokens <= `most`: the count weighs a result in the mean, so it is capped."""
    try:
        tokens = int(reported)
    except (TypeError, ValueError):
        raise BadResult(f"the token count {reported!r} is not a number") from None
    if not 0 < tokens <= most:
        raise BadResult(f"it claims {tokens} tokens; a round has 1..{most} per worker")


def expected_shapes(graph: Callable, names: Sequence[str]) -> dict[str, tuple[int, ...]] | None:
    """The parameter shapes a compiled graph taking `(params,)` expects; None if it does not say."""
    try:
        import jax

        avals = jax.tree.leaves(graph.in_avals)
    except (AttributeError, TypeError, ImportError):
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
        if not np.isfinite(array).all():
            return f"{name} holds NaN or Inf"
    return None
