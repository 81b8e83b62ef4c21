"""The shepherd's bound on round results held in memory at once (unit logic, virtual clock)."""

from __future__ import annotations

import contextlib

import trio
import trio.testing

from pcp_tui.shepherd.rounds.record import WorkerRounds
from pcp_tui.shepherd.run.state import WorkerView
from pcp_tui.shepherd.serving.uploads import ResultSlot


class _Link:  # what a slot touches on a WorkerLink: its view, its record, `paused`, its upload clock
    def __init__(self, name: str):
        self.view = WorkerView(worker_id=name, index=0, host="h", backend="cpu")
        self.rounds = WorkerRounds()
        self.is_paused = False
        self.upload_since = 0.0

    @contextlib.contextmanager
    def paused(self):
        self.is_paused = True
        try:
            yield
        finally:
            self.is_paused = False


async def test_results_beyond_the_slots_wait_and_small_messages_never_do(autojump_clock):
    slots = trio.Semaphore(1)
    first, second = _Link("a"), _Link("b")
    held = ResultSlot(slots, first)
    await held.admit("roundResult", 10**9)
    await ResultSlot(slots, second).admit("progress", 10)  # no payload budget needed
    waiting = ResultSlot(slots, second)
    admitted = trio.Event()

    async def second_result():
        await waiting.admit("roundResult", 10**9)
        admitted.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second_result)
        await trio.testing.wait_all_tasks_blocked()
        assert not admitted.is_set() and second.is_paused  # waiting, and not "silent"
        held.release()
        held.release()  # a second release is a no-op, not a second free slot
        await admitted.wait()
    assert not second.is_paused and slots.value == 0
    waiting.release()
    assert slots.value == 1
