"""A test-only worker that steers instead of crashing: `python -m tests.byzantine_worker ATTACK <worker args>`.

It trains honestly, then tampers with the pseudo-gradient it returns (the token
count and everything else stay honest). The product has no such switch; like
tests/evil_worker.py this wraps the real worker from outside.

ATTACK is one of:
  sign-flip   -Δ: pushes the model back the way honest workers move it
  scaled      100·Δ
  ratchet     3^r·Δ in its r-th round: walks any bound learned from history up
  tiny        1e-6·Δ: started under several ids, it makes honest results look far out
  first-blowup  1e6·Δ in its first round, honest after
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np

from pcp_tui.app.cli import main
from pcp_tui.worker import client as worker

ATTACKS: dict[str, Callable[[int], float]] = {  # the factor Δ is multiplied by in round r (0-based)
    "sign-flip": lambda r: -1.0,
    "scaled": lambda r: 100.0,
    "ratchet": lambda r: 3.0**r,
    "tiny": lambda r: 1e-6,
    "first-blowup": lambda r: 1e6 if r == 0 else 1.0,
}


def tamper_results(factor: Callable[[int], float]) -> None:
    honest_train_round = worker.Worker._train_round
    sent = 0

    async def train_round(self, sender, message):
        honest_send = sender.send

        async def send(kind, body, tensors=None, **options):
            nonlocal sent
            if kind == "roundResult":
                scale = np.float32(factor(sent))
                tensors = {name: array * scale for name, array in tensors.items()}
                sent += 1
            return await honest_send(kind, body, tensors, **options)

        sender.send = send
        try:
            await honest_train_round(self, sender, message)
        finally:
            sender.send = honest_send

    worker.Worker._train_round = train_round


if __name__ == "__main__":
    tamper_results(ATTACKS[sys.argv[1]])
    sys.exit(main(["worker", *sys.argv[2:]]))
