"""Saving the run after a round, off the round's path: `CheckpointWriter`.

The shepherd copies its parameters and optimizer state (the next round's outer
step updates them in place) and hands the copies to a task in the run's nursery,
which writes them (`checkpoint.save`) while the next round trains. At most one
write is in flight: a second checkpoint waits for the first. A failed write never
ends the run: it is a `checkpoint_failed` event, and the previous checkpoint stays
the latest.

Its meta's `eval_loss` is the eval of the parameters it saves: the write waits for
that round's held-out eval (off the round's path), unless the next checkpoint is
asked for first; then it takes the newest eval there is, and `eval_round` says which
round's parameters that loss is of, as it always does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import trio

from pcp_tui.shepherd.run import checkpoint
from pcp_tui.shepherd.run.events import Checkpoint, CheckpointFailed
from pcp_tui.shepherd.run.state import RunState

# (parameters, optimizer state arrays): copies the writer may keep while training goes on.
Snapshot = Callable[[], tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]


class CheckpointWriter:
    """Writes one run's checkpoints into `directory`, one at a time, reporting to `state`."""

    def __init__(self, directory: str | None, state: RunState):
        self.directory = directory
        self._state = state
        self._written = trio.Event()  # set while no checkpoint write is in flight
        self._written.set()
        self.saved: int | None = None  # the round of the last checkpoint this run wrote
        self._evaluating = trio.CancelScope()  # a write waiting for its round's eval

    async def save(
        self,
        number: int,
        meta: dict[str, Any],
        snapshot: Snapshot,
        nursery: trio.Nursery,
        evaluated: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Take `snapshot()` (in a thread) and start writing it as round `number`'s checkpoint,
        its meta's `eval_loss` and `eval_round` added once `evaluated()` (the eval in flight
        has ended) returns, or once the next checkpoint is asked for.

        Returns once the copy is taken, not written: the write runs in `nursery`.
        """
        directory = self.directory
        assert directory is not None, "only a run with a checkpoint directory saves"
        self._evaluating.cancel()  # the round's path never waits for an eval
        await self._written.wait()
        params, arrays = await trio.to_thread.run_sync(snapshot)
        self._written, self._evaluating = trio.Event(), trio.CancelScope()
        nursery.start_soon(self._write, directory, number, params, arrays, meta, evaluated)

    async def idle(self) -> None:
        """Wait until no write is in flight (before the run reports it is done)."""
        await self._written.wait()

    async def _write(
        self,
        directory: str,
        number: int,
        params: dict,
        arrays: dict,
        meta: dict,
        evaluated: Callable[[], Awaitable[None]] | None,
    ) -> None:
        try:
            if evaluated is not None:
                with self._evaluating:
                    await evaluated()
            eval_round, eval_loss = self._state.eval_at(number)
            meta = {**meta, "eval_loss": eval_loss, "eval_round": eval_round}
            path = await trio.to_thread.run_sync(
                lambda: checkpoint.save(
                    directory, round=number, params=params, outer_state=arrays, meta=meta
                )
            )
        except checkpoint.CheckpointError as exc:
            self._state.emit(CheckpointFailed(str(exc), round=number))
            return
        finally:
            self._written.set()
        self.saved = number
        self._state.emit(
            Checkpoint(
                f"checkpoint of round {number} saved to {path}",
                round=number,
                path=str(path),
            )
        )
