"""A test-only worker that poisons its pseudo-gradients: `python -m tests.evil_worker nan|huge <worker args>`.

The product has no "be evil" switch; this wraps the real worker from outside,
replacing what `_train_round` hands to the sender as the round result.
"""

from __future__ import annotations

import sys

import numpy as np

from pcp_tui.app.cli import main
from pcp_tui.worker import client as worker

POISONS = {
    "nan": lambda array: np.full_like(array, np.nan),
    "huge": lambda array: array * np.float32(1e6),
}


def poison_results(poison) -> None:
    honest_train_round = worker.Worker._train_round

    async def train_round(self, sender, message):
        honest_send = sender.send

        async def send(body, tensors=None, **options):
            if body.KIND == "roundResult":
                tensors = {name: poison(array) for name, array in tensors.items()}
            return await honest_send(body, tensors, **options)

        sender.send = send
        try:
            await honest_train_round(self, sender, message)
        finally:
            sender.send = honest_send

    worker.Worker._train_round = train_round


if __name__ == "__main__":
    poison_results(POISONS[sys.argv[1]])
    sys.exit(main(["worker", *sys.argv[2:]]))
