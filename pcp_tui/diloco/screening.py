"""What a round result must pass before the shepherd averages it in.

The shepherd screens a pseudo-gradient's names, shapes and finiteness, and
beyond that its global L2 norm: one that is absurd next to the recent ones
would wreck the model even though every number in it is finite.

Norms are compared per unit of inner learning rate (the norm over Σ lr of the
steps the result covers): warm-up, decay and results that cover fewer steps
(a streaming fragment's first round: (p + 1) H / F − τ steps) then stay
comparable. Compared as they are, a fragment whose first result trained 5
steps at the start of warm-up had every later, honest result refused as
"over 10x the median", and it never moved again.
"""

from __future__ import annotations

import collections
import enum
import math
import statistics
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, SupportsInt

import numpy as np

from pcp_tui.contract.checks import is_finite, squared_norm

if TYPE_CHECKING:
    from pcp_tui.diloco.validation import LossDeltaValidator


class Refusal(enum.StrEnum):
    """Why a result was refused, for what acts on it (`shepherd/rounds/divergence.py`): the message
    is for people, this is for code."""

    MISFIT = "misfit"  # not the plan's tensors, a token count out of range, an outlying norm
    NON_FINITE = "non_finite"  # NaN or Inf in its tensors, its norm or its reported losses
    NO_GAIN = "no_gain"  # validation: it does not move the loss on its own batches down
    BLOWN_UP = "blown_up"  # validation: it leaves its own batches' loss many times higher


class BadResult(ValueError):
    """A round result that must not be averaged in (wrong tensors, NaN, Inf), and why."""

    def __init__(self, message: str, refusal: Refusal = Refusal.MISFIT):
        super().__init__(message)
        self.refusal = refusal


NORM_FACTOR = 10.0  # refuse a norm above this many times the median of recent ones
NORM_ROUNDS = 3  # rounds whose median norms the baseline is the median of


def global_norm(tensors: Mapping[str, np.ndarray]) -> float:
    """L2 norm over all tensors together (inf if it overflows: that is absurd anyway)."""
    return math.sqrt(sum(squared_norm(array) for array in tensors.values()))


def check_pseudo_gradient(
    tensors: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]
) -> float:
    """Refuse a pseudo-gradient that does not match the plan or is not finite.

    Returns its `global_norm` (from the same pass), for `NormGuard.judge`.
    """
    if set(tensors) != set(shapes):
        missing = sorted(set(shapes) - set(tensors))[:3]
        extra = sorted(set(tensors) - set(shapes))[:3]
        raise BadResult(
            f"tensor names do not match the plan (missing {missing}, unexpected {extra})"
        )
    squares = {}
    for name, expected in shapes.items():
        array = tensors[name]
        if tuple(array.shape) != tuple(expected):
            raise BadResult(
                f"{name} has shape {tuple(array.shape)}, the plan says {tuple(expected)}"
            )
        if array.dtype.kind != "f":
            raise BadResult(f"{name} has dtype {array.dtype}, expected floating point")
        squares[name] = squared_norm(array)  # inf if it overflows: NormGuard.judge refuses that
        if not is_finite(array, squares[name]):
            raise BadResult(f"{name} holds NaN or Inf", Refusal.NON_FINITE)
    return math.sqrt(sum(squares[name] for name in tensors))  # summed in global_norm's order


class NormGuard:
    """Remembers the norms of recent rounds' pseudo-gradients and refuses outliers.

    A norm is judged per unit of learning rate (`scale`: Σ inner lr over the
    steps the result covers; 1 when the caller has no schedule), against the
    round's baseline: the median, over the last `rounds` rounds, of each round's
    median norm, fixed when the round begins (`begin_round`). So the baseline is a
    function of the set of earlier rounds' results, never of the order they came
    in: a window of the latest arrivals let the slowest few set the next screen.
    The first round has no baseline (the plan's bound still applies). Every judged
    norm counts toward its round's median, refused ones too: when every honest
    result moves at once (a learning rate raised on `--resume`, a new phase of
    training), the baseline follows within a few rounds instead of refusing
    everyone forever, and a minority of outliers cannot move the median far.
    """

    def __init__(self, factor: float = NORM_FACTOR, rounds: int = NORM_ROUNDS):
        self.factor = factor
        self._medians: collections.deque[float] = collections.deque(maxlen=rounds)
        # this round's judged norms per unit of lr (a relay's join them: docs/relays.md)
        self.round_norms: list[float] = []
        self.typical = 0.0  # this round's baseline per unit of lr (0: none yet)

    def begin_round(self) -> None:
        """Close the round judged so far (its median joins the history); fix the baseline."""
        if self.round_norms:
            self._medians.append(statistics.median(self.round_norms))
            self.round_norms = []
        self.typical = statistics.median(self._medians) if self._medians else 0.0

    def check(self, tensors: Mapping[str, np.ndarray], scale: float = 1.0) -> float:
        """The pseudo-gradient's global norm; BadResult if it is not finite or absurdly large."""
        return self.judge(global_norm(tensors), scale)

    def judge(self, norm: float, scale: float = 1.0) -> float:
        """`norm`, unless it is not finite or absurdly large next to earlier rounds (BadResult)."""
        if not math.isfinite(norm):
            raise BadResult("its global L2 norm overflows float32", Refusal.NON_FINITE)
        if not scale > 0:  # lr 0 (warm-up's first step) moves nothing: nothing to compare
            return norm
        relative = norm / scale
        self.round_norms.append(relative)
        typical = self.typical
        if typical > 0 and relative > self.factor * typical:  # a zero median says nothing
            raise BadResult(
                f"its global L2 norm {norm:.4g} is over {self.factor:g}x the median of recent "
                f"rounds ({typical * scale:.4g} for the learning rate of the steps it covers)"
            )
        return norm


def check_token_count(reported: object, most: int) -> int:
    """The token count; BadResult unless 0 < tokens <= `most`: the count weighs a result in the
    mean, so it is capped."""
    try:
        if not isinstance(reported, SupportsInt | str):
            raise TypeError(reported)
        tokens = int(reported)
    except (TypeError, ValueError):
        raise BadResult(f"the token count {reported!r} is not a number") from None
    if not 0 < tokens <= most:
        raise BadResult(f"it claims {tokens} tokens; a round has 1..{most} per worker")
    return tokens


class ResultScreen:
    """Everything a round result must pass before it is averaged in, in the order it is checked."""

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        max_tokens: int,
        norms: NormGuard | None = None,
        bound: float = math.inf,
    ):
        self.shapes = dict(shapes)
        self.max_tokens = max_tokens
        self.norms = norms or NormGuard()
        self.bound = bound  # the largest norm an honest worker can send; set every round
        # Σ inner lr over the steps a result of so many tokens covers; set every round
        self.lr_sum: Callable[[int], float] | None = None
        # weighs a result by the loss change it causes (`validation.py`); set once the
        # shepherd's eval graph is compiled, None where the run does not validate
        self.validator: LossDeltaValidator | None = None

    def check(self, tensors: Mapping[str, np.ndarray], tokens: object) -> float:
        """The result's global norm; BadResult for wrong tensors, NaN/Inf, a bad token count or norm."""
        norm = check_pseudo_gradient(tensors, self.shapes)
        count = check_token_count(tokens, self.max_tokens)
        most = self.bound
        if math.isfinite(norm) and norm > most:  # an overflow is reported as one below
            raise BadResult(
                f"its global L2 norm {norm:.4g} is over {most:.4g}, the most the plan's inner "
                "optimizer can move the parameters in a round"
            )
        scale = self.lr_sum(count) if self.lr_sum is not None else 1.0
        return self.norms.judge(norm, scale)
