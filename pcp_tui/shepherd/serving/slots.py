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
  they delay an honest worker by about that grace, not by --ready-timeout. Ready workers
  are never moved; as many newcomers may wait as there are slots. An honest worker
  moved while it compiles loses little: it finishes compiling, keeps the compiled
  graphs, and is ready as soon as it is back in.

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


def slot_to_take(links: Iterable[WorkerLink], now: float, grace: float) -> WorkerLink | None:
    """The open connection a newcomer may take the slot of, or None: the one welcomed longest
    ago of those still not ready `grace` seconds after their welcome."""
    waiting = [
        link
        for link in links
        if not link.closed and not link.ready.is_set() and now - link.admitted_at >= grace
    ]
    return min(waiting, key=lambda link: link.admitted_at, default=None)


def next_to_free(links: Iterable[WorkerLink], grace: float) -> float | None:
    """When the first open connection that is not ready passes its grace (trio's clock), or
    None if every open connection is ready."""
    return min(
        (link.admitted_at + grace for link in links if not link.closed and not link.ready.is_set()),
        default=None,
    )
