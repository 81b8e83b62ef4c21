"""The shepherd's own load is not counted against an upload (`uploads.ReceiverLoad`)."""

from __future__ import annotations

import time

import trio

from pcp_tui.shepherd.uploads import TICK_SECONDS, ReceiverLoad


def test_seconds_the_event_loop_was_blocked_count_as_the_receivers():
    load = ReceiverLoad()
    blocked = 0.5

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load.run)
            await trio.sleep(2 * TICK_SECONDS)
            since = time.monotonic()
            time.sleep(blocked)  # the loop runs nothing else: no upload is read meanwhile
            await trio.sleep(2 * TICK_SECONDS)  # the ticker wakes late, and says so
            nursery.cancel_scope.cancel()
        return since

    since = trio.run(main)
    # at least the blocked time (a loaded machine only adds to it), all of it since `since`
    assert load.busy_since(since) >= blocked
    assert load.busy_since(time.monotonic() + 1) == 0.0  # nothing is busy in the future
