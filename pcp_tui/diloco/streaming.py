"""Streaming DiLoCo's arithmetic: which tensors form each fragment, when each is synced, how it merges.

Douillard et al. 2025, "Streaming DiLoCo with overlapping communication"
(arXiv 2501.18512). The parameters are cut into F fragments of whole tensors;
fragment p is synchronised once every H inner steps, at its own point of the
round, so at most one fragment's pseudo-gradient travels at a time (peak
bytes in flight fall by about F). Within a round of H steps, fragment p

- is *sent* after step `(p + 1) * H / F - τ`: the worker sends
  Δ_p = (fragment p's global value at its last sync) − (its local value now)
  and keeps training;
- is *merged* after step `(p + 1) * H / F`, τ steps later: the shepherd's new
  global value G_p has come back, the worker merges it in (below) and
  remembers G_p as the fragment's last global.

τ (`--overlap-steps`) is how many inner steps the exchange may take without
the worker waiting. The paper's merge (`--overlap-merge mix`) is
θ_p ← α θ_p + (1 − α) G_p: α (`--mix-alpha`) keeps that share of the local
fragment (α = 0 replaces it, as torchft does).
The last fragment merges at step H, so every round ends with every fragment
synchronised, and F = 1, τ = 0, α = 0 is exactly plain DiLoCo.

The paper's mix throws away the τ overlap steps' progress (α = 0) or half of
it along with half of the worker's drift from the global value (α = 0.5). The
carry merge (`--overlap-merge carry`) keeps it: θ_p ← θ_p + (1 − α)(G_p − θ_sent),
the new global value plus what the worker trained since it sent Δ_p (α = 0).
That progress is part of the worker's next Δ_p, so every step counts once, one
round late, as it does in plain DiLoCo's next round. It is the default, with
α = 0. On the H100 (docs/quality.md: H = 40, F = 4, τ = 5, int8, two seeds)
streaming ended +1.72% behind plain DiLoCo's eval loss on the embedded corpus
with the paper's mix at α = 0.5 and +0.48% with carry at α = 0.

Pure Python: the shepherd, the worker and `reference.py` use the same functions.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from pcp_tui.contract.plan import (
    Fragments,  # the schedule's rules live with the plan's and the options'
)


def partition(shapes: Mapping[str, tuple[int, ...]], count: int) -> Fragments:
    """Cut the tensors `shapes` names into `count` fragments of about equal size.

    Whole tensors only. The largest tensor goes to the lightest fragment first
    (longest-processing-time order), which keeps the largest fragment, and so
    the peak bytes in flight, close to total / count; embeddings are tensors
    like any other. Names within a fragment keep `shapes`' sorted order; the
    result depends on names and shapes only, so both sides can recompute it.
    """
    names = sorted(shapes)
    if not 1 <= count <= len(names):
        raise ValueError(
            f"{count} fragments of {len(names)} tensors: --streaming-fragments must be "
            f"between 1 and the model's tensor count ({len(names)})"
        )
    sizes = {n: int(np.prod(shapes[n], dtype=np.int64)) for n in names}
    loads = [0] * count
    members: list[list[str]] = [[] for _ in range(count)]
    for name in sorted(names, key=lambda n: (-sizes[n], n)):
        lightest = min(range(count), key=lambda p: (loads[p], p))
        loads[lightest] += sizes[name]
        members[lightest].append(name)
    return tuple(tuple(sorted(m)) for m in members)


class Event(enum.Enum):
    """What a worker does to a fragment at a point of the round."""

    SEND = "send"  # send the fragment's pseudo-gradient, keep training
    MERGE = "merge"  # wait for the fragment's new global value and mix it in


@dataclass(frozen=True)
class Schedule:
    """When, within a round of `inner_steps`, each of `fragments` is sent and merged."""

    inner_steps: int  # H
    fragments: int  # F
    overlap: int  # τ

    def merge_step(self, fragment: int) -> int:
        """After which inner step of the round fragment `fragment` merges its global value."""
        return (fragment + 1) * self.inner_steps // self.fragments

    def send_step(self, fragment: int) -> int:
        """After which inner step of the round fragment `fragment`'s pseudo-gradient leaves."""
        return self.merge_step(fragment) - self.overlap

    def events(self) -> list[tuple[int, Event, int]]:
        """(step, event, fragment) in the order a worker meets them; a send before a merge."""
        points = [(self.send_step(p), 0, Event.SEND, p) for p in range(self.fragments)]
        points += [(self.merge_step(p), 1, Event.MERGE, p) for p in range(self.fragments)]
        return [(step, event, p) for step, _, event, p in sorted(points)]


def carry_scale(alpha: float) -> np.float32:
    """1 − α in float32, as every carry merge computes it (the worker and the reference)."""
    return np.float32(1) - np.float32(alpha)


def carry(local: ArrayLike, global_: ArrayLike, sent: ArrayLike, alpha: float) -> np.ndarray:
    """local + (1 − α)(global − sent), in float32: the carry merge (`sent`: θ at the send point).

    The shift global − sent is formed first, on the host, as the worker does.
    """
    shift = np.asarray(global_, np.float32) - np.asarray(sent, np.float32)
    return np.asarray(local, np.float32) + carry_scale(alpha) * shift


def mix(local: ArrayLike, global_: ArrayLike, alpha: float) -> np.ndarray:
    """α local + (1 − α) global, in float32: a fragment's merge (α = 0 takes the global value)."""
    if alpha == 0.0:
        return np.array(global_, np.float32)
    a = np.float32(alpha)
    return a * np.asarray(local, np.float32) + (np.float32(1) - a) * np.asarray(global_, np.float32)
