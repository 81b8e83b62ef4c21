"""The shepherd's own load is not counted against an upload (`uploads.ReceiverLoad`)."""

from __future__ import annotations

import time

import trio

from pcp_tui.shepherd.serving.uploads import FLOOR_SHARE, PEER_UPLOADS, TICK_SECONDS, ReceiverLoad


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
    # the blocked time but the tick it began in (a loaded machine only adds to it)
    assert load.busy_since(since) >= blocked - TICK_SECONDS
    assert load.busy_since(time.monotonic() + 1) == 0.0  # nothing is busy in the future


def test_the_rate_bound_follows_what_the_latest_uploads_show_down_to_a_floor():
    option = 1e6
    load = ReceiverLoad()
    for _ in range(PEER_UPLOADS - 1):
        load.uploaded(400_000, since=10.0, until=11.0)  # 0.4 MB/s each
    assert load.required_rate(option) == option  # too few uploads to say anything yet
    load.uploaded(400_000, since=10.0, until=11.0)
    assert load.required_rate(option) == 0.25 * 400_000  # all take it in slowly: a share of it
    for _ in range(32):
        load.uploaded(1_000, since=10.0, until=11.0)  # a majority of trickled uploads
    assert load.required_rate(option) == FLOOR_SHARE * option  # cannot drag the bound lower
    for _ in range(32):
        load.uploaded(50_000_000, since=10.0, until=11.0)
    assert load.required_rate(option) == option  # fast uploads: the option's rate
