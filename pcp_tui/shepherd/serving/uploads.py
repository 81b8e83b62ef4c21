"""How the shepherd takes round results in: memory slots, and a minimum upload rate.

A round result is model-sized. The shepherd reads its header first (`MessageStream`'s
`before_payload` hook), then makes its payload wait for one of RESULTS_IN_MEMORY
slots: a hundred workers finishing together cost eight model copies, not a hundred,
while the rest wait in TCP flow control. A peer that trickles bytes would hold a slot
for ever: `upload_too_slow` is the rule the link's watchdog applies to it.
"""

from __future__ import annotations

import time

import trio

from pcp_tui.config import RunConfig
from pcp_tui.shepherd.serving.connection import WorkerLink

# Round results received but not yet folded into the mean, across all workers: the
# shepherd holds at most this many model-sized copies however many workers there are.
# The others wait in TCP flow control, their headers read, their payloads not yet.
# A slot is held from a result's header to its fold, so a slow uploader holds one for its
# whole upload: enough slots that a few slow links do not queue the fast ones.
RESULTS_IN_MEMORY = 8


def upload_too_slow(link: WorkerLink, config: RunConfig) -> str:
    """Why the message arriving on `link` is too slow to wait for, or "".

    After --upload-grace seconds a message must average --min-upload-rate, so an
    upload of n bytes has grace + n / rate seconds at most: trickling bytes keeps a
    connection active, not alive. The clock starts again when a result gets its
    memory slot (`view.last_heard` is set then), as waiting for one is not slowness.
    """
    partial = link.stream.partial_message
    if partial is None:
        return ""
    started, received = partial
    elapsed = time.monotonic() - max(started, link.view.last_heard)
    rate, grace = config.security.min_upload_rate, config.security.upload_grace
    if received >= rate * (elapsed - grace):
        return ""
    return (
        f"upload too slow: {received} bytes in {elapsed:.0f} s, under --min-upload-rate "
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
