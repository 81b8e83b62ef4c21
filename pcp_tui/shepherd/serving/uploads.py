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
import statistics
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
# What the shepherd's peers show it can take in: the rates of its latest result uploads. Once
# PEER_UPLOADS of them are in, an upload is judged against PEER_SHARE of their median when that
# is below --min-upload-rate (a shepherd that takes everyone's results slowly, whatever the
# reason, does not drop the one it takes as slowly as the rest), never below FLOOR_SHARE of it.
UPLOAD_RATES = 32
PEER_UPLOADS = 4
PEER_SHARE = 0.25
FLOOR_SHARE = 1 / 16


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
        )  # (trio.current_time(), busy_total then), one per tick
        self._deadlines: set[trio.CancelScope] = set()  # sends whose deadline the load moves
        # bytes/s of the latest result uploads, from their slot to their last byte
        self.upload_rates: collections.deque[float] = collections.deque(maxlen=UPLOAD_RATES)

    def uploaded(self, nbytes: int, since: float, until: float) -> None:
        """A result upload of `nbytes` ran from `since` to `until` (`trio.current_time()`)."""
        seconds = until - since - self.busy_since(since)
        if nbytes > 0 and seconds > 0:
            self.upload_rates.append(nbytes / seconds)

    def required_rate(self, configured: float) -> float:
        """The rate an upload must average: --min-upload-rate, or less where the latest uploads
        all ran slower (PEER_SHARE of their median, at least FLOOR_SHARE of the option)."""
        if len(self.upload_rates) < PEER_UPLOADS:
            return configured
        peers = PEER_SHARE * statistics.median(self.upload_rates)
        return min(configured, max(peers, FLOOR_SHARE * configured))

    async def run(self) -> None:
        """Sample the load until cancelled (the shepherd's nursery runs it)."""
        while True:
            before = trio.current_time()
            await trio.sleep(TICK_SECONDS)
            now = trio.current_time()
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
        """Seconds the loop was busy since `since` (`trio.current_time()`), to the tick."""
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
    memory slot (`upload_since` is set then), as waiting for one is not slowness,
    and it does not run while the shepherd itself was too busy to read (`load`): a
    congested shepherd must not drop honest workers for its own load. Where the latest
    uploads all ran under the option's rate, the bound is a share of theirs
    (`ReceiverLoad.required_rate`): the shepherd takes everyone in slowly, so the one
    upload as slow as the rest is not the peer's fault; a trickler is still far below.
    """
    partial = link.stream.partial_message
    if partial is None:
        return ""
    started, received = partial
    since = max(started, link.upload_since)
    elapsed = trio.current_time() - since
    busy = load.busy_since(since) if load is not None else 0.0
    rate, grace = config.security.min_upload_rate, config.security.upload_grace
    required = load.required_rate(rate) if load is not None else rate
    if received >= required * (elapsed - busy - grace):
        return ""
    spent = f", {busy:.0f} s of them with the shepherd busy" if busy >= 0.5 else ""
    if required < rate:
        return (
            f"upload too slow: {received} bytes in {elapsed:.0f} s{spent}, under {required:.3g} B/s "
            f"({PEER_SHARE:g} of the median of the latest uploads, as they are under "
            f"--min-upload-rate {rate:g} B/s) after --upload-grace {grace:g} s"
        )
    return (
        f"upload too slow: {received} bytes in {elapsed:.0f} s{spent}, under --min-upload-rate "
        f"{rate:g} B/s after --upload-grace {grace:g} s"
    )


class ResultSlot:
    """One round result's claim on the shepherd's memory, from its header to its fold; while
    it lasts the link's `result_arriving` is set."""

    def __init__(self, slots: trio.Semaphore, link: WorkerLink, load: ReceiverLoad | None = None):
        self._slots, self._link, self._load = slots, link, load
        self._held = False
        self._since, self._bytes_before = 0.0, 0  # when its slot came, and the link's bytes then

    async def admit(self, kind: str, nbytes: int) -> None:
        """`before_payload` hook: a round result's payload waits for a free slot."""
        if kind != "roundResult":
            return
        self._link.rounds.result_arriving = True  # the straggler window waits for it (`rounds.py`)
        try:
            with self._link.paused():  # waiting for a slot is neither silence nor slowness
                await self._slots.acquire()
        finally:
            self._link.upload_since = trio.current_time()  # the upload-rate clock starts now
        self._held = True
        self._since, self._bytes_before = self._link.upload_since, self._link.view.bytes_in

    def release(self) -> None:
        """After the message was handled (a result folded in, or refused): free the slot."""
        self._link.rounds.result_arriving = False
        if self._held:
            self._held = False
            self._slots.release()
            view = self._link.view  # its last byte came when it was last heard
            if self._load is not None and view.bytes_in > self._bytes_before:
                self._load.uploaded(
                    view.bytes_in - self._bytes_before, self._since, self._link.upload_since
                )
