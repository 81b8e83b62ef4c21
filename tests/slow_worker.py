"""A real `pcp-tui worker` that stalls before sending one round's result.

Test-only: the product has no 'be slow' switch. Usage:
    python -m tests.slow_worker ROUND SECONDS -- <pcp-tui worker arguments>
"""

from __future__ import annotations

import sys

import trio

from pcp_tui.app.cli import main
from pcp_tui.worker import client as worker


def _stall_in(round_number: int, seconds: float) -> None:
    original = worker.Worker._train_round

    async def train_round(self, sender, message):
        if message.body.round == round_number:
            await trio.sleep(seconds)
        await original(self, sender, message)

    worker.Worker._train_round = train_round


if __name__ == "__main__":
    split = sys.argv.index("--")
    _stall_in(int(sys.argv[1]), float(sys.argv[2]))
    sys.exit(main(["worker", *sys.argv[split + 1 :]]))
