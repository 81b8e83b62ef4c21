"""One worker connection's part in the rounds: what it was sent, what it answered, how fast.

The connection (`serving.connection.WorkerLink`) moves bytes within deadlines; the rounds
read and write this record (`link.rounds`): the straggler window (`results.collect`) times a
worker from its roundStart's delivery, a straggler sits rounds out (`sitting_out`), and a
result is taken once, for a round this connection was sent.
"""

from __future__ import annotations

import math

import trio

from pcp_tui import protocol
from pcp_tui.contract.connection import ConnectionLost
from pcp_tui.shepherd.rounds.claims import ResultClaims

# roundStart delivery times a record keeps: a late result is timed from its own round's
ROUNDS_REMEMBERED = 8
# a progress projection counts until this many times itself has passed since its roundStart's
# delivery (`projected_seconds`): room for an honest pace's noise, no more
PROMISE_SLACK = 2.0


class WorkerRounds:
    """A connection's record in the rounds; times are on trio's clock."""

    def __init__(self) -> None:
        # a round it was dropped from as a straggler, its result not yet in (0: none): it
        # sits new rounds out until then, so a hung peer delays one round, not every one
        self.behind = 0
        self.behind_since, self.behind_grace = 0.0, math.inf  # see `sitting_out.hung_reason`
        # rounds since a result of its was refused, none counted since (0: none refused): it
        # is not waited for, and past `sitting_out.UNPROVEN_ROUNDS` its connection ends
        self.unproven = 0
        # whether a result of its has counted (checked, where the run validates): until
        # then, and on probation, its results are checked before they count (`Round.add`)
        self.trusted = False
        # results counted since its last refusal, and that refusal's round: after k refusals
        # (`RunState.refusals`) it is trusted again only after 2^k of rounds after the last
        self.counted, self.refused_round = 0, 0
        self.results_taken = 0  # results screened and folded into a round (`slots`: a slot earned)
        # a round closed without its result (`sitting_out.sit_out`; until that result comes)
        # or refused one: what it showed (progress, a result) did not become a result within
        # its window, and vouches for it no more (`vouched_until`)
        self.missed = False
        self.results_sent = 0  # results it sent on this connection, a repeated round's too
        # when each recent round's roundStart had all gone out, and how long its latest
        # result took from there, per fragment (the straggler window, `results.collect`)
        self.delivered_at: dict[int, float] = {}
        self.first_delivered: float | None = None  # its first roundStart's (`slots`)
        self.answer_seconds: dict[int, float] = {}
        # the same, of its latest result taken into a round (`slots`: a late or refused one,
        # which any peer can send, must not stretch how long a silent peer keeps its slot)
        self.taken_seconds: dict[int, float] = {}
        # its latest training progress: (round, step, of steps, when), from which a worker
        # with no result yet has a time of its own (`projected_seconds`)
        self.progress: tuple[int, int, int, float] | None = None
        # a result's header is in and it is not yet folded in (`uploads.ResultSlot`): the
        # window waits for it; for no other message, or trickled heartbeats would hold it
        self.result_arriving = False
        # what its results may claim; sized by `worker_plan.bind_to_plan` (no result comes before)
        self.claims = ResultClaims(tokens_per_step=0)
        self._started: set[int] = set()  # rounds whose roundStart went out on this connection
        self._results: set[tuple[int, int]] = set()  # (round, fragment) of every result sent

    @property
    def shown_work(self) -> bool:
        """Whether it reported training progress or sent a result (counted, late or refused)
        on this connection (`slots`: one that shows nothing keeps its slot less long)."""
        return self.progress is not None or bool(self._results)

    def vouched_until(self) -> float:
        """Until when (trio's clock) its shown work vouches for it (`slots`): its latest
        progress report's promise (PROMISE_SLACK times the round's time it projects, from that
        roundStart's delivery); -inf without one, or once a round closed without its result
        or refused one (`missed`); inf once it sent a result (slots caps that at
        --ready-timeout, as before). A peer that reported "step 1 of H" and never answered
        kept its slot --ready-timeout from its first roundStart, and held a round only such
        peers were sent for ever (no window closes a round before its first result)."""
        if self.missed:
            return -math.inf
        if self.results_sent:  # being checked into a round, or late (it did come)
            return math.inf
        if self.progress is None:
            return -math.inf
        number, step, steps, when = self.progress
        delivered = self.delivered_at.get(number)
        if delivered is None:
            return -math.inf
        return delivered + PROMISE_SLACK * max(when - delivered, 0.0) * steps / step

    @property
    def sent_a_round(self) -> bool:
        """Whether a roundStart went out (or is going out) on this connection."""
        return bool(self._started)

    def started(self, number: int) -> None:
        """Round `number`'s roundStart is going out here: its results may come (a repeated
        round, no result counted, is answered again: one result per start)."""
        self._started.add(number)
        self._results = {sent for sent in self._results if sent[0] != number}

    def delivered(self, number: int) -> None:
        """Round `number`'s roundStart has all gone out: its results' time counts from now."""
        self.delivered_at[number] = trio.current_time()
        if self.first_delivered is None:
            self.first_delivered = self.delivered_at[number]
        for old in [n for n in self.delivered_at if n < number - ROUNDS_REMEMBERED]:
            del self.delivered_at[old]

    def note_result(self, body: protocol.RoundResult, running: int) -> None:
        """Raise ConnectionLost for a result no worker sends: one for a round that has not
        started (`running` is the latest that has), one for a round whose roundStart this
        connection never got (a worker's results go out on the connection its round came
        on: one that reconnects drops the round it was in), or a second for the same round
        (and fragment). Each would be dropped, but a peer that sends them without end would
        write a `late_result` line in the log for every copy (every round, every fragment,
        again from each new connection)."""
        fragment = body.fragment
        part = f" fragment {fragment}" if self.claims.fragments > 1 else ""
        if body.round > running:
            raise ConnectionLost(
                f"sent a result for round {body.round}{part} while round {running} runs: "
                "a worker answers only the rounds it was sent"
            )
        if body.round not in self._started:
            raise ConnectionLost(
                f"sent a result for round {body.round}{part}, but round {body.round}'s "
                "roundStart went to another connection or to none: a worker answers only "
                "the rounds it was sent"
            )
        if (body.round, fragment) in self._results:
            raise ConnectionLost(
                f"sent its result for round {body.round}{part} twice: a worker sends each "
                "result once; this peer is not a pcp-tui worker, or a broken one"
            )
        self._results.add((body.round, fragment))
        self.results_sent += 1

    def answered(self, number: int, fragment: int) -> None:
        """A result for round `number` (of `fragment`) came in, counted or late: remember
        how long it took from its roundStart's delivery."""
        delivered = self.delivered_at.get(number)
        if delivered is not None:
            self.answer_seconds[fragment] = trio.current_time() - delivered

    def took(self, fragment: int) -> None:
        """Its result (of `fragment`) just `answered` was screened and folded into a round."""
        self.results_taken += 1
        if fragment in self.answer_seconds:
            self.taken_seconds[fragment] = self.answer_seconds[fragment]

    def progressed(self, body: protocol.Progress) -> None:
        """A training progress report came in (one the rate limit took): note where it is."""
        if body.phase is protocol.Phase.TRAINING and 0 < body.step <= body.total_steps:
            self.progress = (body.round, body.step, body.total_steps, trio.current_time())

    def projected_seconds(self, number: int) -> float:
        """How long round `number` takes this worker from its roundStart's delivery, as its
        latest progress report in that round projects it (H/k x the time to step k); 0.0
        without one, or once PROMISE_SLACK times that has passed without its result: a
        projection is a promise, and one not kept buys nothing more (a peer that reported
        "step 1 of H" and then nothing held round 1 for factor² windows). What the worker
        says: `results` bounds what it may buy."""
        projected, _ = self._promise(number)
        return projected

    def promise_ends(self, number: int) -> float:
        """When (trio's clock) round `number`'s projection stops counting (`projected_seconds`),
        or inf without one that counts now: the straggler wait looks at its worker again then."""
        _, ends = self._promise(number)
        return ends

    def _promise(self, number: int) -> tuple[float, float]:
        """(`projected_seconds`, `promise_ends`) of round `number`."""
        delivered = self.delivered_at.get(number)
        if self.progress is None or delivered is None:
            return 0.0, math.inf
        round_number, step, steps, when = self.progress
        if round_number != number:
            return 0.0, math.inf
        projected = max(when - delivered, 0.0) * steps / step
        ends = delivered + PROMISE_SLACK * projected
        if trio.current_time() >= ends:
            return 0.0, math.inf
        return projected, ends
