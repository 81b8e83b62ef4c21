"""One DiLoCo round on the shepherd: who takes part, what came back, timings."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping

import numpy as np
import trio

import protocol

from .diloco import PseudoGradientMean


class BadResult(ValueError):
    """A round result that must not be averaged in (wrong tensors, NaN, Inf)."""


def check_pseudo_gradient(
    tensors: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """Refuse a pseudo-gradient that does not match the plan or is not finite."""
    if set(tensors) != set(shapes):
        missing = sorted(set(shapes) - set(tensors))[:3]
        extra = sorted(set(tensors) - set(shapes))[:3]
        raise BadResult(
            f"tensor names do not match the plan (missing {missing}, unexpected {extra})"
        )
    for name, expected in shapes.items():
        array = tensors[name]
        if tuple(array.shape) != tuple(expected):
            raise BadResult(
                f"{name} has shape {tuple(array.shape)}, the plan says {tuple(expected)}"
            )
        if array.dtype.kind != "f":
            raise BadResult(f"{name} has dtype {array.dtype}, expected floating point")
        if not np.isfinite(array).all():
            raise BadResult(f"{name} holds NaN or Inf")


class Round:
    """Collects results for one round number; late or foreign results are refused."""

    def __init__(self, number: int, participants: list[str], names: tuple[str, ...]):
        self.number = number
        self.participants = set(participants)
        self.pending = set(participants)
        self.mean = PseudoGradientMean(names)
        self.started = time.monotonic()
        self.losses: list[float] = []
        self.tokens = 0
        self.bytes_saved = 0  # float32 bytes the results would have taken, minus their wire bytes
        self.compute_seconds: dict[str, float] = {}
        self.arrivals: dict[str, float] = {}
        self.contributors: list[str] = []
        self.bytes_at_start = (0, 0)
        self.done = trio.Event()
        self._lock = trio.Lock()

    def accepts(self, worker_id: str, round_number: int) -> bool:
        return round_number == self.number and worker_id in self.pending

    async def add(self, worker_id: str, message: protocol.Message) -> None:
        """Fold one validated result into the running mean (off the event loop)."""
        body = message.body
        tokens = int(body.get("tokens", 0))
        if tokens <= 0:
            raise BadResult("a round result must report a positive token count")
        losses = [float(x) for x in body.get("losses", [])]
        if not all(math.isfinite(x) for x in losses):
            raise BadResult("reported losses hold NaN or Inf")
        async with self._lock:
            await trio.to_thread.run_sync(self.mean.add, message.tensors, float(tokens))
        self.tokens += tokens
        self.bytes_saved += max(
            sum(t.nbytes for t in message.tensors.values()) - message.wire_bytes, 0
        )
        self.losses.extend(losses)
        self.compute_seconds[worker_id] = float(body.get("computeSeconds", 0.0))
        self.arrivals[worker_id] = time.monotonic() - self.started
        self.contributors.append(worker_id)
        self.finish(worker_id)

    def finish(self, worker_id: str) -> None:
        """The worker is out of this round (returned, refused or lost)."""
        self.pending.discard(worker_id)
        if not self.pending:
            self.done.set()

    def timings(self, total: float) -> tuple[float, float, float]:
        """(compute, communication, straggler) seconds of this round."""
        if not self.arrivals:
            return 0.0, 0.0, total
        compute = max(self.compute_seconds.values(), default=0.0)
        times = sorted(self.arrivals.values())
        straggler = times[-1] - statistics.median(times)
        communication = max(total - compute - straggler, 0.0)
        return compute, communication, straggler
