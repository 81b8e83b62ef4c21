"""Who holds an admitted-connection slot: a worker that is not ready gives its slot up.

The shepherd serves at most --max-worker-connections admitted connections. A token
holder that joins, reads the plan and never says ready held a slot for as long as it
liked: four of them held every slot of a `--workers 2` run, and the honest workers
heard `busy` on every retry. Two rules bound that:

- a connection that has not said ready --ready-timeout seconds after its welcome is
  dropped (the watchdog's `not_ready_reason`); the default fits slow honest compiles
  (measured on a loaded 2-core CPU: the tiny GPT-2 in seconds, GPT-2 124M in minutes);
- when every slot is taken, a newcomer takes the slot of the connection that has gone
  longest without saying ready, once that has had `EVICTABLE_AFTER` seconds
  (`slot_to_take`). So squatters delay an honest worker by about that plus its own
  retry wait, not by --ready-timeout. Ready workers are never moved. An honest worker
  moved while it compiles loses little: it finishes compiling, keeps the compiled
  graphs, and is ready as soon as it is back in.

Times are trio's clock (`trio.current_time`), as the link's `admitted_at` is.
"""

from __future__ import annotations

from collections.abc import Iterable

from pcp_tui.shepherd.connection import WorkerLink

EVICTABLE_AFTER = 30.0  # seconds a connection that is not ready keeps its slot from a newcomer


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
