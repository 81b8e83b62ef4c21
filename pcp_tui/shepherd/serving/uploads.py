"""How the shepherd takes round results in: memory slots, and a minimum upload rate.

A round result is model-sized. The shepherd reads its header first (`MessageStream`'s
`before_payload` hook), then makes its payload wait for one of RESULTS_IN_MEMORY
slots: a hundred workers finishing together cost eight model copies, not a hundred,
while the rest wait in TCP flow control. A peer that trickles bytes would hold a slot
for ever: `upload_too_slow` is the rule the link's watchdog applies to it.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import math
import time
from collections.abc import Iterator

import trio

from pcp_tui.config import RunConfig
from pcp_tui.shepherd.serving.connection import WorkerLink

# Round results received but not yet folded into the mean, across all workers: the
# shepherd holds at most this many model-sized copies however many workers there are.
# The others wait in TCP flow control, their headers read, their payloads not yet.
# A slot is held from a result's header to its fold, so a slow uploader holds one for its
# whole upload: enough slots that a few slow links do not queue the fast ones.
RESULTS_IN_MEMORY = 8


# How often the receiver's load is sampled (`ReceiverLoad`), and for how long it is kept:
# longer than any upload is given (--upload-grace plus a result at --min-upload-rate).
TICK_SECONDS = 0.1
LOAD_SECONDS = 3600.0


class ReceiverLoad:
    """How much of each recent second the shepherd was too busy to read: its own load.

    A task sleeps TICK_SECONDS at a time; whatever it oversleeps, the event loop
    was running other work (sending round starts, decoding, folding), and no
    upload was read meanwhile. Those seconds are the receiver's, not the peer's:
    `upload_too_slow` does not count them against an upload. An idle shepherd
    oversleeps nothing, so a peer that trickles bytes into it is judged at the
    full --min-upload-rate; a congested one (hundreds of uploads, 2 cores) judges
    each upload only on the time it could have taken it in.
    """

    def __init__(self) -> None:
        self.busy_total = 0.0  # seconds the loop was busy, since this started
        self._marks: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=int(LOAD_SECONDS / TICK_SECONDS)
        )  # (time.monotonic(), busy_total then), one per tick
        self._deadlines: set[trio.CancelScope] = set()  # sends whose deadline the load moves

    async def run(self) -> None:
        """Sample the load until cancelled (the shepherd's nursery runs it)."""
        while True:
            before = time.monotonic()
            await trio.sleep(TICK_SECONDS)
            now = time.monotonic()
            busy = max(now - before - TICK_SECONDS, 0.0)
            self.busy_total += busy
            self._marks.append((now, self.busy_total))
            for scope in self._deadlines:
                scope.deadline += busy

    @contextlib.contextmanager
    def stretched(self, scope: trio.CancelScope) -> Iterator[None]:
        """Within: `scope`'s deadline (a message to a worker) moves on by every second the
        shepherd was busy, as the upload clock leaves them out."""
        self._deadlines.add(scope)
        try:
            yield
        finally:
            self._deadlines.discard(scope)

    def busy_since(self, since: float) -> float:
        """Seconds the loop was busy since `since` (`time.monotonic()`), to the tick."""
        index = bisect.bisect_left(self._marks, (since, -math.inf))
        if index >= len(self._marks):
            return 0.0
        before = self._marks[index - 1][1] if index > 0 else 0.0
        return self.busy_total - before


def upload_too_slow(link: WorkerLink, config: RunConfig, load: ReceiverLoad | None = None) -> str:
    """Why the message arriving on `link` is too slow to wait for, or "".

    After --upload-grace seconds a message must average --min-upload-rate, so an
    upload of n bytes has grace + n / rate seconds at most: trickling bytes keeps a
    connection active, not alive. The clock starts again when a result gets its
    memory slot (`view.last_heard` is set then), as waiting for one is not slowness,
    and it does not run while the shepherd itself was too busy to read (`load`): a
    congested shepherd must not drop honest workers for its own load.
    """
    partial = link.stream.partial_message
    if partial is None:
        return ""
    started, received = partial
    since = max(started, link.view.last_heard)
    elapsed = time.monotonic() - since
    busy = load.busy_since(since) if load is not None else 0.0
    rate, grace = config.security.min_upload_rate, config.security.upload_grace
    if received >= rate * (elapsed - busy - grace):
        return ""
    spent = f", {busy:.0f} s of them with the shepherd busy" if busy >= 0.5 else ""
    return (
        f"upload too slow: {received} bytes in {elapsed:.0f} s{spent}, under --min-upload-rate "
        f"{rate:g} B/s after --upload-grace {grace:g} s"
    )


class ResultSlot:
    """One round result's claim on the shepherd's memory, from its header to its fold; while
    it lasts the link's `result_arriving` is set."""

    def __init__(self, slots: trio.Semaphore, link: WorkerLink):
        self._slots, self._link = slots, link
        self._held = False

    async def admit(self, kind: str, nbytes: int) -> None:
        """`before_payload` hook: a round result's payload waits for a free slot."""
        if kind != "roundResult":
            return
        self._link.rounds.result_arriving = True  # the straggler window waits for it (`rounds.py`)
        try:
            with self._link.paused():  # waiting for a slot is neither silence nor slowness
                await self._slots.acquire()
        finally:
            self._link.view.last_heard = time.monotonic()  # the upload-rate clock starts now
        self._held = True

    def release(self) -> None:
        """After the message was handled (a result folded in, or refused): free the slot."""
        self._link.rounds.result_arriving = False
        if self._held:
            self._held = False
            self._slots.release()
