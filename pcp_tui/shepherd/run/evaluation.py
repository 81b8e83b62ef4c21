"""The held-out eval of a run's rounds, off the rounds' path: `HeldOutEval`.

A shepherd on a CPU machine evaluating GPT-2 124M (eight batches of 64x1024)
takes about two minutes, and the workers used to wait for it after every round.
Now the eval of round r runs in a worker thread on a copy of θ taken as the
round ends, while round r + 1 trains; its loss is attached to round r's history
entry when it arrives (`RunState.evaluated`: an `evaluated` event). While one
eval still runs, the next round's is skipped (one `eval_skipped` warning per
run names `--eval-every`). The run's last round is evaluated in full before
the run ends, and so is any eval still running: its final eval loss is
the same however long the evals took. Where the run validates results after
their round (`shepherd/rounds/checks.py`), the eval of round r waits for round
r's checks and evaluates θ as they leave it (refused results taken out).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping

import numpy as np
import trio

from pcp_tui.shepherd.run.events import EvalSkipped
from pcp_tui.shepherd.run.state import RunState

Evaluate = Callable[[Mapping[str, np.ndarray]], float]  # θ -> the mean held-out loss
Settled = Callable[[], Awaitable[Mapping[str, np.ndarray]]]  # a round's corrected tensors


class HeldOutEval:
    """Evaluates the rounds `every` asks for (and the last, `last_round`) for `state`.

    `evaluate` runs in a thread; `copy` makes the snapshot it reads (the next
    round's outer step updates θ in place); `diverged(round, loss)` is told of a
    non-finite loss that arrives after its round.
    """

    def __init__(
        self,
        evaluate: Evaluate,
        copy: Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]],
        state: RunState,
        *,
        every: int,
        last_round: int,
        diverged: Callable[[int, float], None],
    ):
        self._evaluate, self._copy, self._state = evaluate, copy, state
        self._diverged = diverged
        self.every, self.last_round = every, last_round
        self._running: trio.Event | None = None  # set when the eval in flight ends
        self._running_round: int | None = None
        self._warned = False
        self.skipped: list[int] = []  # rounds whose eval was skipped, oldest first

    def due(self, number: int) -> bool:
        """Whether round `number` is one --eval-every evaluates (the last one always is)."""
        return number % self.every == 0 or number == self.last_round

    async def final(self, number: int, params: Mapping[str, np.ndarray]) -> float:
        """Round `number`'s eval, awaited (after any still running): the run's last round."""
        await self.idle()
        return await trio.to_thread.run_sync(self._evaluate, params)

    async def start(
        self,
        number: int,
        params: Mapping[str, np.ndarray],
        nursery: trio.Nursery,
        settled: Settled | None = None,
    ) -> None:
        """Start round `number`'s eval in `nursery` on a copy of `params`, or skip it while
        the previous one still runs. Returns once the copy is taken. `settled()` gives the
        tensors the round's loss-delta checks corrected, once they end
        (`shepherd/rounds/checks.py`): the eval is of θ as they leave it."""
        if self._running is not None:
            self.skipped.append(number)
            if not self._warned:
                self._warned = True
                self._state.emit(
                    EvalSkipped(
                        f"round {number}'s eval skipped: round {self._running_round}'s still "
                        "runs (the held-out eval takes longer than a round); evaluate less "
                        f"often with --eval-every (now {self.every}) or fewer --eval-batches; "
                        "this warning is not repeated",
                        round=number,
                    )
                )
            return
        snapshot = await trio.to_thread.run_sync(self._copy, params)
        self._running, self._running_round = trio.Event(), number
        nursery.start_soon(self._run, number, snapshot, settled)

    async def idle(self) -> None:
        """Wait until no eval is running (its loss attached to its round)."""
        if self._running is not None:
            await self._running.wait()

    async def _run(
        self, number: int, snapshot: dict[str, np.ndarray], settled: Settled | None
    ) -> None:
        assert self._running is not None
        try:
            if settled is not None:
                snapshot.update(await settled())
            loss = await trio.to_thread.run_sync(self._evaluate, snapshot)
            self._state.evaluated(number, loss)
            if not math.isfinite(loss):
                self._diverged(number, loss)
        finally:
            self._running.set()
            self._running, self._running_round = None, None
