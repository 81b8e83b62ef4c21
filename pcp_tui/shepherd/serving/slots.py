"""Who holds an admitted-connection slot: a worker that is not ready gives its slot up.

The shepherd serves at most --max-worker-connections admitted connections. A token
holder that joins, reads the plan and never says ready held a slot for as long as it
liked: four of them held every slot of a `--workers 2` run, and the honest workers
heard `busy` on every retry. These rules bound that:

- a connection that has not said ready --ready-timeout seconds after its welcome is
  dropped (the watchdog's `not_ready_reason`); the default, 600 s, fits slow honest
  compiles (measured on a loaded 2-core CPU at the CLI's defaults, batch 16 x 128 in
  chunks of 10 steps: the tiny GPT-2's train_chunk 26 s, GPT-2 124M's 125 s);
- when every slot is taken, a newcomer waits in line (not refused) for the connection
  that has gone longest without earning its slot to pass its bound (`slot_to_take`,
  `next_to_free`), and takes its slot. A connection not ready: `evictable_after(
  ready_timeout)` after its welcome, 45 s or a quarter of --ready-timeout if that is
  less (the grace). Squatters that are put out join again behind it, so they delay an
  honest worker by about that grace, not by --ready-timeout. As many newcomers may wait
  as there are slots. An honest worker moved while it compiles loses little: it
  finishes compiling, keeps the compiled graphs, and is ready as soon as it is back in;
- saying ready costs nothing: four squatters that said ready at once and never answered
  a round held every slot, and round 1 waited for them, for ever. A ready connection
  that was sent a round and has shown nothing since (no training progress, no result)
  keeps its slot from a newcomer for `SlotRules.silent_seconds` from its first
  `roundStart`: the grace, or --straggler-factor times the slowest answer the run has
  measured (the latest result of any open connection taken into a round, from its
  roundStart's delivery; a late one does not count: any peer can send one), if longer.
  An honest worker's first round shows progress or a result within that: its peers'
  pace times the factor the straggler window gives it too, and, before any result, the
  grace (its first chunk, not its compile: that came before ready). One
  that has reported progress, none of it taken into a round, keeps it longer only while
  that progress keeps its promise (`kept`: twice the round it projects, at most
  --ready-timeout from its first `roundStart`) and no round has closed without its
  result; one that sent a result (late, or being checked) keeps it --ready-timeout (the
  straggler window, `sitting_out` and the unproven rule bound what it holds a round);
- a ready connection not yet sent a round waits for the next one and is not moved,
  unless fewer than --workers open connections have been sent a round or earned their
  slot: then the run needs its slot, and it keeps it `silent_seconds` from saying ready
  (a peer that says ready and leaves whenever a round comes held its slot so for ever);
- one whose result was taken into a round (screened and folded in; or its worker
  contributed before a reconnect) has earned its slot and is never moved.

A ready connection that has shown nothing and holds a round (the round waits for its
result) while another ready connection waits for that round is taken out of that round at
the same bound and sits rounds out until its result comes (`holding_reason`; streaming:
its last fragment's, `sitting_out.caught_up`). Its connection stays: an honest worker whose
first chunk outlasted the grace lost it, joined again silent, and lost it again while a
token holder kept a fresh ready id waiting. Two ids that said ready at once were round 1's
only workers at `--workers 2`, the honest workers found free slots, nobody waited in line,
and round 1 waited for them for ever: this rule ends that. The rounds do their part: once
the quorum is in, a round waits for one that has shown nothing only --straggler-factor
times the quorum's time (`rounds.results.Round.stranger`), and a round repeated for want of
any result waits for the newcomers compiling at that moment, each at most the grace
(`WorkerPool.compiling_ready`): the squatters that rejoined and said ready at once were that
repeat's only workers while the honest newcomers compiled for 2 s.

Worst case, every slot of a `--workers 2` run taken by peers that say ready, never train
and join again at once (under the same ids or new ones; no rule here reads an id): the
grace for a slot, the honest workers' compile (at most the grace), then one round plus
--straggler-factor times its quorum's time. Measured (`bench_squatters.py --ready
--rounds 2`, the defaults): the honest run ended 52.7 s after its workers started beside
four (11.5 s without; 183.8 s before these rules), 56.4 s (8.9 s) once a silent holder
sits rounds out instead of losing its connection. A peer that reports progress it does
not make kept its slot --ready-timeout from its first `roundStart`, and two such ids that
were round 1's only workers held it for ever; now its promise, at most --ready-timeout,
and once a round closed without its result (its straggler window) no longer than one
that showed nothing.

Times are trio's clock (`trio.current_time`), as the link's `admitted_at` is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pcp_tui.config import RunConfig
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


def holding_reason(
    link: WorkerLink,
    silent: Callable[[], float],
    now: float,
    *,
    holds_a_round: Callable[[], bool],
    ready_timeout: float,
) -> str:
    """Why `link` is taken out of a round it holds and shows nothing for, or "" (the pool
    then lets it sit rounds out: `WorkerPool._holding`).

    `holds_a_round()`: an open round waits for its result while a ready connection waits
    for a round it is not in. Two token holders that said ready at once were round 1's only
    workers at `--workers 2`; the honest workers found free slots (no newcomer waited in
    line to move them out), and round 1 waited for them for ever. The bound is the one a
    newcomer in line has (`_free_at`): `silent()` (`SlotRules.silent_seconds`) from its
    first roundStart with nothing earned, longer while its progress keeps its promise
    (`kept`). Both callables read every link, so they are asked only once the link's own
    state allows it (the watchdog asks each link every second)."""
    first = link.rounds.first_delivered
    if first is None or _earned(link):
        return ""
    # `silent()` is at least the grace: below the bound that needs no other link, nothing
    # reads every link (each link's watchdog asked it every second, so round 1 of N workers
    # cost N² steps: a quarter of a 4,000-worker run's CPU)
    if now < first + kept(link, lambda: evictable_after(ready_timeout), ready_timeout):
        return ""
    if now < first + kept(link, silent, ready_timeout):
        return ""
    if not holds_a_round():
        return ""
    what = "no result taken" if link.rounds.shown_work else "no progress and no result"
    return (
        f"{what} {now - first:.0f} s after its first roundStart, while a ready worker waits "
        "for that round (it sits rounds out until that result comes)"
    )


def kept(link: WorkerLink, silent: Callable[[], float], ready_timeout: float) -> float:
    """Seconds from its first roundStart a ready connection, nothing of it taken into a
    round, keeps its slot from a newcomer (and holds a round while a ready worker waits):
    `silent()` (`SlotRules.silent_seconds`), or while its progress keeps its promise and no
    round has closed without its result (`WorkerRounds.vouched_until`) if longer, at most
    --ready-timeout. Progress that never becomes a result buys no more than the promise it
    made: a peer that reported "step 1 of H" and never answered kept its slot --ready-timeout
    from its first roundStart (and a round it alone was sent, for ever). One that sent a
    result (late, or being checked into a round) is not taken out of a round (inf): honest
    workers whose first chunk outlasted the grace sat out, sent it late, and would lose the
    repeated round again while a token holder kept a fresh ready id waiting."""
    first = link.rounds.first_delivered
    assert first is not None, "asked of a connection that was sent a round"
    vouched = link.rounds.vouched_until()
    if vouched == math.inf:  # it sent a result: not moved out of a round (`_free_at` caps it)
        return math.inf
    return max(silent(), min(vouched - first, ready_timeout))


@dataclass(frozen=True)
class SlotRules:
    """The run's settings the slot rules read (`of` a RunConfig)."""

    ready_timeout: float  # --ready-timeout
    straggler_factor: float  # --straggler-factor
    workers: int  # --workers

    @classmethod
    def of(cls, config: RunConfig) -> SlotRules:
        return cls(
            config.security.ready_timeout,
            config.network.straggler_factor,
            config.network.workers,
        )

    def silent_seconds(self, links: Iterable[WorkerLink]) -> float:
        """How long a ready connection that shows nothing keeps its slot from a newcomer:
        the grace, or --straggler-factor times the slowest latest answer of an open link
        (from its roundStart's delivery) that was taken into a round, if longer: a late or
        refused result is any token holder's to send, as late as it likes."""
        measured = max(
            (s for link in links if not link.closed for s in link.rounds.taken_seconds.values()),
            default=0.0,
        )
        return max(evictable_after(self.ready_timeout), self.straggler_factor * measured)


def _earned(link: WorkerLink) -> bool:
    """A result of its was taken into a round here, or its worker's before a reconnect."""
    return bool(link.rounds.results_taken or link.view.rounds_contributed)


def _free_at(link: WorkerLink, rules: SlotRules, silent: float, needed: bool) -> float | None:
    """When a newcomer may take `link`'s slot (trio's clock), or None: never (closed, earned,
    or ready and its first roundStart not yet delivered while the run has `--workers` sent
    or earned). `silent`: `SlotRules.silent_seconds`; `needed`: fewer than --workers open
    links were sent a round or earned their slot."""
    if link.closed or _earned(link):
        return None
    if not link.ready.is_set():
        return link.admitted_at + evictable_after(rules.ready_timeout)
    first = link.rounds.first_delivered
    if first is None:  # ready, waiting for its first round
        return link.ready_at + silent if needed and link.ready_at is not None else None
    return first + min(
        kept(link, lambda: silent, rules.ready_timeout), max(rules.ready_timeout, silent)
    )


def _due(
    links: Iterable[WorkerLink], rules: SlotRules
) -> list[tuple[float, float, int, WorkerLink]]:
    """(free_at, admitted_at, order, link) of every open link that will free, unsorted."""
    links = list(links)
    silent = rules.silent_seconds(links)
    working = sum(
        1 for link in links if not link.closed and (_earned(link) or link.rounds.sent_a_round)
    )
    needed = working < rules.workers
    return [
        (free_at, link.admitted_at, index, link)
        for index, link in enumerate(links)
        if (free_at := _free_at(link, rules, silent, needed)) is not None
    ]


def slot_to_take(links: Iterable[WorkerLink], now: float, rules: SlotRules) -> WorkerLink | None:
    """The open connection a newcomer may take the slot of, or None: of those past `_free_at`,
    the one that got there first (then the one welcomed first)."""
    due = [entry for entry in _due(links, rules) if entry[0] <= now]
    return min(due, default=(None,) * 4)[3]


def next_to_free(links: Iterable[WorkerLink], rules: SlotRules) -> float | None:
    """When the first open connection passes `_free_at` (trio's clock), or None if none will."""
    return min((entry[0] for entry in _due(links, rules)), default=None)
