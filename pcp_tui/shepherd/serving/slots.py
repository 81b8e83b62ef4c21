"""Who holds an admitted-connection slot: a worker that is not ready gives its slot up.

The shepherd serves at most --max-worker-connections admitted connections. A token
holder that joins, reads the plan and never says ready held a slot for as long as it
liked: four of them held every slot of a `--workers 2` run, and the honest workers
heard `busy` on every retry. Two rules bound that:

- a connection that has not said ready --ready-timeout seconds after its welcome is
  dropped (the watchdog's `not_ready_reason`); the default, 600 s, fits slow honest
  compiles (measured on a loaded 2-core CPU at the CLI's defaults, batch 16 x 128 in
  chunks of 10 steps: the tiny GPT-2's train_chunk 26 s, GPT-2 124M's 125 s);
- when every slot is taken, a newcomer waits in line (not refused) for the connection
  that has gone longest without saying ready to pass `evictable_after(ready_timeout)`
  seconds, and takes its slot (`slot_to_take`, `next_to_free`): 45 s, or a quarter of
  --ready-timeout if that is less. Squatters that are put out join again behind it, so
  they delay an honest worker by about that grace, not by --ready-timeout. As many
  newcomers may wait as there are slots. An honest worker moved while it compiles loses
  little: it finishes compiling, keeps the compiled graphs, and is ready as soon as it
  is back in;
- saying ready costs nothing: four squatters that said ready at once and never answered
  a round held every slot, and round 1 waited for them, for ever. So a ready connection
  that was sent a round keeps its slot from a newcomer for --ready-timeout from its first
  `roundStart` (an honest worker's first round) unless a result of its has been taken
  into a round (screened and folded in; or its worker contributed before a reconnect).
  A ready worker not yet sent a round (it waits for the next one), and one that has
  delivered, are never moved.

Times are trio's clock (`trio.current_time`), as the link's `admitted_at` is.
"""

from __future__ import annotations

from collections.abc import Iterable

from pcp_tui.shepherd.serving.connection import WorkerLink

EVICTABLE_AFTER = 45.0  # seconds a connection that is not ready keeps its slot from a newcomer


def evictable_after(ready_timeout: float) -> float:
    """Seconds a connection not yet ready keeps its slot from a newcomer."""
    return min(EVICTABLE_AFTER, ready_timeout / 4)


def not_ready_reason(link: WorkerLink, ready_timeout: float, now: float) -> str:
    """Why `link` loses its slot for not saying ready in time, or ""."""
    waited = now - link.admitted_at
    if link.ready.is_set() or waited <= ready_timeout:
        return ""
    return (
        f"not ready {waited:.0f} s after its welcome (--ready-timeout {ready_timeout:g} s): "
        "its slot goes to another worker"
    )


def _free_at(link: WorkerLink, ready_timeout: float) -> float | None:
    """When a newcomer may take `link`'s slot (trio's clock), or None: never (closed, ready
    and not yet sent a round, or a result of its was taken)."""
    if link.closed:
        return None
    if not link.ready.is_set():
        return link.admitted_at + evictable_after(ready_timeout)
    # a result taken here, or before a reconnect
    earned = link.rounds.results_taken or link.view.rounds_contributed
    first = link.rounds.first_delivered
    if not earned and first is not None:  # sent rounds, and nothing to show for them
        return first + ready_timeout
    return None


def slot_to_take(
    links: Iterable[WorkerLink], now: float, ready_timeout: float
) -> WorkerLink | None:
    """The open connection a newcomer may take the slot of, or None: of those past `_free_at`,
    the one that got there first (then the one welcomed first)."""
    due = [
        (free_at, link.admitted_at, index, link)
        for index, link in enumerate(links)
        if (free_at := _free_at(link, ready_timeout)) is not None and free_at <= now
    ]
    return min(due, default=(None,) * 4)[3]


def next_to_free(links: Iterable[WorkerLink], ready_timeout: float) -> float | None:
    """When the first open connection passes `_free_at` (trio's clock), or None if none will."""
    return min(
        (at for link in links if (at := _free_at(link, ready_timeout)) is not None),
        default=None,
    )
