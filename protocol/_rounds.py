"""The messages of a round: its start, a worker's progress, and its result.

A round: `RoundStart` (the global parameters as tensors, or none when the
worker holds them: `continued`), `Progress` while the worker trains, and per
fragment of the plan one `RoundResult` (its pseudo-gradient) and one
`FragmentUpdate` (its new global value). Plain DiLoCo is the one-fragment case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from ._enums import Phase
from ._fields import TENSOR_NAME_CHARS, Body, _finite, _items, _within


@dataclass(frozen=True)
class RoundStart(Body):
    """shepherd -> worker; the global parameters ride as tensors."""

    KIND: ClassVar[str] = "roundStart"
    round: int = 0
    inner_steps: int = 0
    continued: bool = False  # no tensors: go on from the worker's own (global) parameters


@dataclass(frozen=True)
class WorkerStats:
    """What a worker measures about itself, sent with its progress (protocol 3).

    Zero memory means the worker could not measure it; a gpu_utilization of -1
    means not measured (no NVML, or not an NVIDIA device).
    """

    steps: int = 0
    tokens: int = 0
    memory_in_use_bytes: int = 0
    memory_peak_bytes: int = 0
    memory_limit_bytes: int = 0
    gpu_utilization: float = _within(-1.0, 1.0, -1.0)


@dataclass(frozen=True)
class Progress(Body):
    """worker -> shepherd, a few per second at most: where its round is, and its statistics."""

    KIND: ClassVar[str] = "progress"
    round: int = 0
    step: int = 0
    total_steps: int = 0
    loss: float = _finite()
    tokens_per_second: float = _finite()
    phase: Phase = Phase.COMPILING
    stats: WorkerStats = field(default_factory=WorkerStats)


@dataclass(frozen=True)
class RoundResult(Body):
    """worker -> shepherd at a fragment's send point: its pseudo-gradient rides as tensors.

    Plain DiLoCo is the one-fragment case: fragment 0 is the whole model, sent
    after the round's last step. `tokens` is what the pseudo-gradient trained on
    (its weight in the mean); `losses`, `compute_seconds` and `inner_steps` cover
    the steps since the worker's previous result, so a run's results count each
    step once. `losses` is bounded by the receiver's `Limits.max_losses`; a NaN loss
    is refused at decode (`NonFinite`), which the shepherd reads as that worker diverging.
    """

    KIND: ClassVar[str] = "roundResult"
    round: int = 0
    tokens: int = 0
    losses: tuple[float, ...] = _items("max_losses")
    compute_seconds: float = _finite()
    inner_steps: int = 0
    fragment: int = 0  # index into the plan's fragments
    # relay -> shepherd: the relay folded it (`Fold`); no tensors ride
    folded: bool = False
    weight: float = _finite()
    scale: float = _finite()
    distance: float = _finite()
    norm: float = _finite()


@dataclass(frozen=True)
class Fold(Body):
    """shepherd -> relay: fold (or, `close`, stop folding and answer `Folded`) a round's
    fragment results of the relay's workers with the round's numbers; the clip's center
    rides as tensors."""

    KIND: ClassVar[str] = "fold"
    round: int = 0
    fragment: int = 0
    close: bool = False
    radius: float = math.inf
    step_scale: float = 1.0
    measure: bool = False
    max_tokens: int = 0
    bound: float = math.inf
    norm_typical: float = 0.0
    norm_factor: float = math.inf
    per_step: int = 1
    lr_sums: tuple[float, ...] = _items(2**16)  # Σ inner lr over a result of lr_steps[i] steps
    share_workers: tuple[str, ...] = _items(2**20)
    shares: tuple[float, ...] = _items(2**20)
    lr_steps: tuple[int, ...] = _items(2**16)
    names: tuple[str, ...] = _items(2**16, chars=TENSOR_NAME_CHARS)  # the fragment's parameters
    dims: tuple[int, ...] = _items(2**20)  # their shapes' dims, `ranks[i]` each, in order
    ranks: tuple[int, ...] = _items(2**16)
    norm_cap: float = math.inf  # centered clip's cap on a result's norm


@dataclass(frozen=True)
class Folded(Body):
    """relay -> shepherd: its workers' results of a round's fragment folded (Σ w·s·Δ as
    tensors), Σ w, Σ w (1 - s), and whose results they are."""

    KIND: ClassVar[str] = "folded"
    round: int = 0
    fragment: int = 0
    weight: float = _finite()
    center_weight: float = _finite()
    workers: tuple[str, ...] = _items(2**20)
    weights: tuple[float, ...] = _items(2**20)  # each result's weight, scale and distance
    scales: tuple[float, ...] = _items(2**20)
    distances: tuple[float, ...] = _items(2**20)
    norms: tuple[float, ...] = _items(2**20)  # each one's norm per unit of step scale


@dataclass(frozen=True)
class FragmentUpdate(Body):
    """shepherd -> worker once a fragment's outer step is done: its new global value rides
    as tensors (plain DiLoCo: the whole model, once a round)."""

    KIND: ClassVar[str] = "fragmentUpdate"
    round: int = 0
    fragment: int = 0
    change: bool = False  # tensors: the change since the fragment's last global value
