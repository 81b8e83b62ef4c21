"""A real `pcp-tui worker` that misbehaves in one chosen way, for tests and benchmarks.

    python -m pcp_tui.testing.faulty_worker FAULT [--PARAMETER VALUE ...] -- <pcp-tui worker arguments>

The product has no "be faulty" switch: this module runs the ordinary
`pcp-tui worker` entry point with a `worker.rounds.Faults` of its own, the hooks
the worker consults at fixed points of its round (before a round, after each
compiled chunk, on each result's tensors). Everything a fault does not touch
(handshake, heartbeats, training, compression) is the shipped code.
`pcp_tui.testing.faulty_worker_command` builds the command line.

FAULTS, the registry, names each fault and its parameters (defaults in brackets):

  stall    --round [2] --seconds [10]: sleep SECONDS before training round ROUND
           (the round number the shepherd sends, from 1). Heartbeats go on, so
           only a round timeout or the operator can tell it from a slow machine.
  slow     --factor [2] --hold [0]: every compiled chunk takes FACTOR times as long (it
           sleeps the difference): a slower machine, for the adaptive rounds. With
           --hold R, round R waits (heartbeats on, no progress) until the process gets
           SIGUSR1: a test's go, so the round misses its window whatever the load.
  pace     --seconds [0.5]: every compiled chunk takes at least SECONDS (it sleeps the
           rest): a slow machine whose pace does not depend on this one's load.
  nan      every value of every result it sends is NaN.
  scale    --factor [100] --results [0]: its r-th result is FACTOR·Δ for r < RESULTS,
           honest after (0: every result). The attacks of a token holder that trains
           honestly and tampers with its pseudo-gradient Δ (token count and losses
           stay honest): --factor 1e6 is a blow-up, -1 a sign flip (it pushes the
           model back the way honest workers move it), 1e-6 a vanishing result
           (several ids of it drag a median of norms down), --factor 1e6 --results 1
           a blow-up in the first result only.
  ratchet  --factor [3]: its r-th result (from 0) is FACTOR^r·Δ, which walks up any
           bound the shepherd learns from history.
  drag     --first [3] --answer [40]: the slow-progress staller (issue 25). Each round
           its first chunk's progress report goes out FIRST seconds after the round
           starts (step k of H: a pace of H/k x FIRST), the next chunk ends ANSWER
           seconds after it, and the result is zeros: progress without results.

A result fault counts the results this process has sent (one per fragment),
across reconnects.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import trio

from pcp_tui.app.cli import main as pcp_tui_main
from pcp_tui.worker.rounds import Faults

__all__ = ["FAULTS", "Fault", "Parameter", "main"]

#: How a result fault changes one tensor: (r, the r-th result's array) → what is sent.
Tamper = Callable[[int, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Parameter:
    """One `--name VALUE` of a fault: its default (whose type parses the value) and help."""

    default: int | float
    help: str


@dataclass(frozen=True)
class Fault:
    """One named misbehaviour: what it does, its parameters, and `make(**parameters)`, which
    builds the `Faults` the worker consults."""

    summary: str
    parameters: dict[str, Parameter]
    make: Callable[..., Faults]


class Stall(Faults):
    """Sleep `seconds` before training round `round`, in the round's own task."""

    def __init__(self, *, round: int, seconds: float):
        self.round, self.seconds = round, seconds

    async def before_round(self, number: int) -> None:
        if number == self.round:
            await trio.sleep(self.seconds)


class Slow(Faults):
    """Every compiled chunk takes `factor` times as long: a slower machine (it sleeps the rest).
    Round `hold` (0: none) starts training only once SIGUSR1 has come."""

    def __init__(self, *, factor: float, hold: int = 0):
        self.factor, self.hold = factor, hold
        self._go = threading.Event()
        if hold:
            signal.signal(signal.SIGUSR1, lambda signum, frame: self._go.set())

    async def before_round(self, number: int) -> None:
        while number == self.hold and not self._go.is_set():
            await trio.sleep(0.05)

    def after_chunk(self, seconds: float) -> None:
        time.sleep((self.factor - 1) * seconds)


class Pace(Faults):
    """Every compiled chunk takes at least `seconds` (it sleeps the rest)."""

    def __init__(self, *, seconds: float):
        self.seconds = seconds

    def after_chunk(self, seconds: float) -> None:
        time.sleep(max(self.seconds - seconds, 0.0))


class Tampered(Faults):
    """Every tensor of every result this worker sends passes through `tamper`."""

    def __init__(self, tamper: Tamper):
        self.tamper, self.sent = tamper, 0

    def result(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        changed = {name: self.tamper(self.sent, array) for name, array in tensors.items()}
        self.sent += 1
        return changed


class Drag(Faults):
    """Report the first chunk `first` s into each round, end the second `answer` s into it,
    and send zeros: a peer whose progress projects a long round and whose result is nothing."""

    def __init__(self, *, first: float, answer: float):
        self.first, self.answer = first, answer
        self.started, self.chunks = time.monotonic(), 0

    async def before_round(self, number: int) -> None:
        self.started, self.chunks = time.monotonic(), 0

    def after_chunk(self, seconds: float) -> None:
        self.chunks += 1
        until = self.started + (self.first if self.chunks == 1 else self.answer)
        if self.chunks <= 2:
            time.sleep(max(until - time.monotonic(), 0.0))

    def result(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: np.zeros_like(array) for name, array in tensors.items()}


def poison_with_nan() -> Faults:
    """Every value of every result is NaN."""
    return Tampered(lambda r, array: np.full_like(array, np.nan))


def scale(*, factor: float, results: int) -> Faults:
    """The first `results` results (every one if 0) times `factor`."""
    scaled = np.float32(factor)
    return Tampered(lambda r, array: array * scaled if results == 0 or r < results else array)


def ratchet(*, factor: float) -> Faults:
    """The r-th result (from 0) times `factor`**r."""
    return Tampered(lambda r, array: array * np.float32(factor**r))


FAULTS: dict[str, Fault] = {
    "stall": Fault(
        "sleep before training one round; heartbeats go on",
        {
            "round": Parameter(2, "the round to stall (the shepherd's number, from 1)"),
            "seconds": Parameter(10.0, "how long to sleep before training it"),
        },
        Stall,
    ),
    "slow": Fault(
        "compute FACTOR times slower than this machine can (a slower machine)",
        {
            "factor": Parameter(2.0, "how many times as long each compiled chunk takes"),
            "hold": Parameter(0, "the round that waits for SIGUSR1 (0: none)"),
        },
        Slow,
    ),
    "pace": Fault(
        "every compiled chunk takes at least SECONDS (a slow machine, whatever the load)",
        {"seconds": Parameter(0.5, "the least time a chunk takes")},
        Pace,
    ),
    "nan": Fault("send results whose every value is NaN", {}, poison_with_nan),
    "scale": Fault(
        "send FACTOR·Δ instead of the pseudo-gradient Δ",
        {
            "factor": Parameter(100.0, "1e6: blow-up, -1: sign flip, 1e-6: vanishing"),
            "results": Parameter(0, "tamper with the first RESULTS results only (0: all)"),
        },
        scale,
    ),
    "ratchet": Fault(
        "send FACTOR^r·Δ in the r-th result (from 0)",
        {"factor": Parameter(3.0, "the growth per result")},
        ratchet,
    ),
    "drag": Fault(
        "report progress FIRST s into each round, answer zeros ANSWER s into it",
        {
            "first": Parameter(3.0, "when the first chunk's progress report goes out"),
            "answer": Parameter(40.0, "when the second chunk ends (the result follows)"),
        },
        Drag,
    ),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pcp_tui.testing.faulty_worker",
        description=__doc__.splitlines()[0],
        epilog="after the fault and its parameters: -- <pcp-tui worker arguments>",
    )
    faults = parser.add_subparsers(dest="fault", required=True, metavar="FAULT")
    for name, fault in FAULTS.items():
        options = faults.add_parser(name, help=fault.summary, description=fault.summary)
        for parameter, spec in fault.parameters.items():
            options.add_argument(
                f"--{parameter}",
                type=type(spec.default),
                default=spec.default,
                help=f"{spec.help} (default {spec.default})",
            )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `pcp-tui worker` with what follows `--`, with the fault named before it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    split = argv.index("--") if "--" in argv else len(argv)
    chosen = vars(parser.parse_args(argv[:split]))  # --help stops here
    if split == len(argv):
        parser.error("put the pcp-tui worker arguments after `--`")
    faults = FAULTS[chosen.pop("fault")].make(**chosen)
    return pcp_tui_main(["worker", *argv[split + 1 :]], faults=faults)


if __name__ == "__main__":
    sys.exit(main())
