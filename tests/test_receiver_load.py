"""The shepherd's own load is not counted against an upload (`uploads.ReceiverLoad`)."""

from __future__ import annotations

import trio
import trio.testing

from pcp_tui.shepherd.serving.uploads import FLOOR_SHARE, PEER_UPLOADS, TICK_SECONDS, ReceiverLoad


def test_seconds_the_event_loop_was_blocked_count_as_the_receivers():
    """On trio's clock, as the shepherd reads it: the clock jumps `blocked` seconds while no
    task runs (the loop busy with one piece of work), and the ticker wakes that late."""
    load = ReceiverLoad()
    blocked = 0.5
    clock = trio.testing.MockClock(autojump_threshold=0)

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load.run)
            await trio.sleep(2.5 * TICK_SECONDS)  # mid-tick: the ticker sleeps until 3 ticks
            since = trio.current_time()
            clock.jump(blocked)  # the loop runs nothing else: no upload is read meanwhile
            await trio.sleep(2 * TICK_SECONDS)  # the ticker wakes late, and says so
            nursery.cancel_scope.cancel()
        return since

    since = trio.run(main, clock=clock)
    # all of it but the part of the tick the ticker slept anyway (from 2 ticks to 3)
    assert load.busy_since(since) == (since + blocked) - 2 * TICK_SECONDS - TICK_SECONDS
    assert load.busy_since(since + blocked + 1) == 0.0  # nothing is busy in the future


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
