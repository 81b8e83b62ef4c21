"""Workers that sit rounds out: dropped as stragglers, owing an old round's result.

A round that closes without a worker (`rounds.collect`: its straggler window or
--round-timeout) leaves it still on that round: sending it the next one would
only make that round wait out its window again. So it sits new rounds out
(`WorkerPool.ready_links` skips it) until a result of its for that round, or a
later one, comes in (`caught_up`; streaming: its last fragment's), late or not.
Meanwhile it still gets that round's fragment updates, so it ends the round as it
would have. One that shows no sign of that round for long enough counts as hung
(`hung_reason`, a rule the connection's watchdog applies), and its connection
ends: progress reports put that off, up to `SIT_OUT_GRACES` graces in all.

A worker whose result was refused (it did no work: zeros, a flip) is waited for
by the rounds after it only --straggler-factor times the quorum's time, without
the window's floor or a time of its own (`rounds.Round.unproven`), until one of
its results counts; after `UNPROVEN_ROUNDS` rounds without one its connection ends
(`unproven_reason`) and its shard goes to the next worker to join. A peer that
reported progress and answered zeros at its window's end held every round that
long (41 s for 2-3 s); one that reported progress and never answered kept its
shard untrained for the rest of the run.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import trio

from pcp_tui.shepherd.rounds.checks import Verdict
from pcp_tui.shepherd.rounds.record import WorkerRounds
from pcp_tui.shepherd.rounds.results import Round
from pcp_tui.shepherd.run.state import RunState
from pcp_tui.shepherd.serving.connection import WorkerLink

# rounds a worker goes on after a refused result without one counted, the refusal's included
UNPROVEN_ROUNDS = 3
# graces (--straggler-factor windows) a worker may sit out while it reports progress
SIT_OUT_GRACES = 3


def sit_out(current: Round, worker_ids: list[str]) -> None:
    """`worker_ids`, dropped from `current` as stragglers, sit new rounds out until a result
    of theirs for it (or later) comes in; their rows say why."""
    for worker_id in worker_ids:
        link = (current.connections or {}).get(worker_id)
        if isinstance(link, WorkerLink) and not link.closed:
            link.rounds.behind = current.number
            link.rounds.missed = True  # its work vouches for its slot no more (`slots`)
            link.rounds.behind_since, link.rounds.behind_grace = trio.current_time(), current.grace
            link.view.reason = (
                f"late for round {current.number}: sits new rounds out until that result comes"
            )


def settled(state: RunState, links: Iterable[WorkerLink], verdict: Verdict) -> None:
    """Round `verdict.number`'s results are settled: those of `verdict.counted` count. Their
    senders are waited for again; every other worker on probation has gone one more round
    without a counted result (`count_unproven`). A sender refused k times (`RunState.
    refusals`) is trusted (`results.Round.suspect`: its results folded in unchecked) once
    2^k of its results have counted since its last refusal: an attacker that flips whenever
    it is trusted taints 2 rounds' steps, then 2 more after 4 honest ones, 2 after 16...,
    not two of every four rounds. A round before its last refusal (its verdict settles
    late: checks run a round behind) does not count towards that."""
    links = list(links)
    for link in links:
        rounds = link.rounds
        if link.worker_id in verdict.counted and verdict.number > rounds.refused_round:
            rounds.unproven, rounds.counted = 0, rounds.counted + 1
            rounds.trusted = rounds.counted >= 2 ** state.refusals[link.worker_id]
            link.view.reason = ""
    count_unproven(links, verdict.counted)


def count_unproven(links: Iterable[WorkerLink], counted: Collection[str]) -> None:
    """A round closed, counting the results of `counted` (worker ids): each worker on
    probation (a refused result, none counted since) that is not among them, in the round
    or sitting it out, has one more round against it."""
    for link in links:
        if link.rounds.unproven and link.worker_id not in counted:
            link.rounds.unproven += 1


def unproven_reason(rounds: WorkerRounds) -> str:
    """Why a worker whose results stopped counting loses its connection (and its shard), or
    ""."""
    if rounds.unproven <= UNPROVEN_ROUNDS:
        return ""
    return (
        f"no result counted in {rounds.unproven - 1} rounds since one was refused; its "
        "shard goes to the next worker to join (it may reconnect)"
    )


def caught_up(link: WorkerLink, number: int, fragment: int) -> bool:
    """A result for round `number`, `fragment`, came from `link`: whether it sat out and is
    now back. It is back with its result of the plan's last fragment (plain DiLoCo: its one)
    for the round it sits out, or a later one: its round ends there, on the worker too. A
    streaming worker taken back with its first fragment's result was sent the repeat of
    that round (the same number) while it still trained the old one, whose later fragment
    results were then taken as the repeat's: scored against the repeat's parameters and
    refused, or waiting there for the repeat's first fragment, which the worker had not
    trained yet, while the shepherd read nothing more from it (silent, lost)."""
    last = link.rounds.claims.fragments - 1
    if link.rounds.behind and number >= link.rounds.behind and fragment == last:
        link.rounds.behind = 0
        link.rounds.missed = False  # its work came, late: it vouches for it again (`slots`)
        link.view.reason = ""
        return True
    return False


def waiting_line(links: list[WorkerLink]) -> str:
    """The connected workers that sit rounds out, for a 'waiting' line; "" if none: a run
    whose last workers all sit out waits for their late results."""
    late = [link for link in links if link.rounds.behind and not link.closed]
    return "; ".join(
        f"worker {link.view.index} ({link.worker_id}) sits out, late for round "
        f"{link.rounds.behind}: it trains again once that result comes (if it hangs, restart "
        "it: it rejoins for the next round)"
        for link in late
    )


def hung_reason(rounds: WorkerRounds) -> str:
    """Why a worker sitting out (`sit_out`) counts as hung, or "".

    It had its round's straggler window to answer; if it then sends no progress report
    for that round for --straggler-factor windows more, it is not slow but stuck.
    Ending its connection frees its shard for the next worker to join, and a worker
    whose round can be cancelled reconnects and trains from the next round; one that
    keeps reporting progress may sit out up to `SIT_OUT_GRACES` of those (before, as
    long as it liked: a peer reporting progress and never answering kept its shard).
    """
    if not rounds.behind:
        return ""
    now = trio.current_time()
    if now - rounds.behind_since > SIT_OUT_GRACES * rounds.behind_grace:
        return (
            f"no result for round {rounds.behind} in {now - rounds.behind_since:.0f} s since "
            f"its round closed without it, progress or not ({SIT_OUT_GRACES} x "
            f"--straggler-factor times its window: {SIT_OUT_GRACES * rounds.behind_grace:.3g} "
            "s); it may reconnect and train from the next round, and its shard goes to the "
            "next worker to join"
        )
    last = rounds.behind_since
    progress = rounds.progress
    if progress is not None and progress[0] == rounds.behind:
        last = max(last, progress[3])
    quiet = now - last
    if quiet <= rounds.behind_grace:
        return ""
    return (
        f"hung: no result and no progress for round {rounds.behind} in {quiet:.0f} s since its "
        f"round closed without it (--straggler-factor times its window: "
        f"{rounds.behind_grace:.3g} s); it may reconnect and train from the next round, and "
        "its shard goes to the next worker to join"
    )
