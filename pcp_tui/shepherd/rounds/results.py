"""One DiLoCo round on the shepherd: who takes part, what came back, timings."""

from __future__ import annotations

import collections
import contextlib
import math
import statistics
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import trio

from pcp_tui import protocol
from pcp_tui.config.service import NetworkConfig
from pcp_tui.contract.connection import LINK_ERRORS
from pcp_tui.diloco.aggregate import Aggregate
from pcp_tui.diloco.partial import Entry
from pcp_tui.diloco.screening import BadResult, Refusal, ResultScreen, check_token_count
from pcp_tui.diloco.validation import Assignment, Kept
from pcp_tui.shepherd.run.events import ResultRefused, RoundWaiting, Stragglers
from pcp_tui.shepherd.run.history import RoundRecord
from pcp_tui.shepherd.run.state import RunState

if TYPE_CHECKING:
    from pcp_tui.shepherd.rounds.checks import Check
    from pcp_tui.shepherd.serving.connection import WorkerLink

__all__ = [
    "BadResult",
    "OpenRounds",
    "Round",
    "collect",
    "data_parallel_bytes",
    "note_refusal",
    "straggler_window",
    "tell_refused",
    "utilization",
]

# Results smaller than this are screened and folded in on the event loop: that takes
# well under a millisecond, less than handing them to a thread and back (~0.2 ms).
INLINE_BYTES = 4 * 2**20

# How often the straggler window looks again at a worker it cannot time yet (its
# roundStart still on its way, or its result arriving).
RECHECK_SECONDS = 0.5


def utilization(
    compute_seconds: Mapping[str, float], round_seconds: float
) -> tuple[float, dict[str, float]]:
    """(the run's, each worker's) share of the round's wall time spent computing.

    A worker's is its own compute seconds / the round's wall seconds (round start
    to close, on the shepherd's clock); the run's is total compute / (contributors
    x round seconds), so a round whose workers all idled half the time is 0.5
    however many there were. Each share is clipped to [0, 1]: the compute time is
    what the worker reports, and a clock that runs fast, or a worker that lies,
    must not show more than the round's wall time. No contributors, or a round of
    zero seconds, is (0.0, {}).
    """
    if not compute_seconds or round_seconds <= 0:
        return 0.0, {}
    each = {w: min(max(s / round_seconds, 0.0), 1.0) for w, s in compute_seconds.items()}
    return sum(each.values()) / len(each), each


def data_parallel_bytes(parameter_count: int, inner_steps: int, contributors: int) -> int:
    """Bytes synchronous data parallelism would exchange for the same tokens as one round.

    Data parallelism syncs after every step: each worker sends its float32 gradient
    (4 bytes a parameter) and gets the average back, so 2 x 4 x parameters a worker
    a step, for the round's `inner_steps` and `contributors`. Divided by the bytes
    DiLoCo really exchanged it is the saving the issue's "x fewer bytes than DP" means.
    """
    return 2 * 4 * parameter_count * inner_steps * contributors


def note_refusal(
    state: RunState,
    link: WorkerLink,
    number: int,
    fragment: int,
    exc: BadResult,
    open_rounds: OpenRounds,
) -> None:
    """What a refused result of `link`'s (round `number`, `fragment`) does to its sender, as
    the screen refuses it or its check, one round later: a `bad_result` event; it buys no
    time of its own (`Round.usual_seconds`), and the rounds after it do not wait for it until
    one of its results counts (`sitting_out.py`), the ones open now (`open_rounds`) included.
    The worker is told with `tell_refused`."""
    link.rounds.answer_seconds.pop(fragment, None)
    link.rounds.unproven = max(link.rounds.unproven, 1)
    link.rounds.missed = True  # its work vouches for its slot no more (`slots`)
    state.refusals[link.worker_id] += 1  # trust comes back slower each time (`settled`)
    link.rounds.trusted, link.rounds.counted = False, 0
    link.rounds.refused_round = max(link.rounds.refused_round, number)
    link.view.reason = f"result refused: {exc}"
    state.emit(
        ResultRefused(
            f"refused worker {link.view.index}'s round {number} result: {exc}",
            worker=link.worker_id,
            round=number,
            refusal=exc.refusal,
        )
    )
    open_rounds.reconsider(link.worker_id)


async def tell_refused(link: WorkerLink, exc: BadResult) -> None:
    """Tell the worker on `link` why its result was refused (a lost link is its own business:
    the connection task reports it)."""
    with contextlib.suppress(*LINK_ERRORS):
        await link.send(protocol.Error(protocol.ErrorCode.BAD_RESULT, f"result refused: {exc}"))


class OpenRounds:
    """The rounds results are folded into now: one per fragment while a round runs.

    The round engine opens them (`rounds`, for the round's length); the pool
    routes each result to its fragment's (`of`) and takes a lost worker out of
    them (`finish`). Both are given the same instance when they are built.
    """

    def __init__(self) -> None:
        self.rounds: list[Round] = []

    def of(self, fragment: int) -> Round | None:
        """Fragment `fragment`'s open round, or None between rounds."""
        return self.rounds[fragment] if 0 <= fragment < len(self.rounds) else None

    def finish(self, worker_id: str, connection: object) -> None:
        """The worker on `connection` is gone: it is out of every open round it was sent."""
        for current in self.rounds:
            if current.bound_to(worker_id, connection):  # not a replaced connection's successor
                current.finish(worker_id)

    def reconsider(self, worker_id: str) -> None:
        """`worker_id`'s window may be shorter now (a result of its was refused, or it reported
        progress): every open round it is pending in looks at it again (`_until_overdue`)."""
        for current in self.rounds:
            if worker_id in current.pending:
                current.reconsider(worker_id)


def weight_shares(networks: Mapping[str, str]) -> dict[str, float]:
    """Worker id -> the share of its tokens' weight its result gets, for workers whose ids map
    to the network they connected from (`--weight-per address`): the k ids of one network
    each get k_min / k, k_min the fewest ids any network sends, so every network weighs what
    k_min ids weigh and a token holder gains nothing by joining as more ids. Only shares
    under 1 are listed: none where every network sends as many ids (one machine's run, or
    an id each), so such a run folds exactly as by ids."""
    counts = collections.Counter(networks.values())
    fewest = min(counts.values(), default=1)
    return {w: fewest / counts[n] for w, n in networks.items() if counts[n] > fewest}


class Round:
    """Collects results for one round number (one fragment's); late or foreign ones are refused."""

    def __init__(
        self,
        number: int,
        participants: list[str],
        mean: Aggregate,
        screen: ResultScreen | None,
        *,
        connections: Mapping[str, WorkerLink] | None = None,
        fragment: int = 0,
        send_steps: Mapping[str, int] | None = None,
        shares: Mapping[str, float] | None = None,
        view: Callable[[], Awaitable[Mapping[str, np.ndarray]]] | None = None,
        started: float = 0.0,
    ):
        self.number = number
        self.fragment = fragment  # the fragment this Round collects (plain DiLoCo: 0, the model)
        # worker id -> the inner steps of this round before its result for this fragment
        # leaves (the schedule's send step for its H_k): validation draws its batches there
        self.send_steps = dict(send_steps or {})
        # worker id -> the share of its tokens' weight its result gets (`RoundEngine._shares`:
        # ids of one network share one weight); 1.0 where absent
        self.shares = dict(shares or {})
        # the results folded in, in that order, for their loss-delta check (validated rounds)
        self.kept: list[Kept] = []
        # θ as the workers held it for this round's results (`RoundCopies.view`): a result
        # from a worker on probation is scored against it before it is folded in
        self._view = view
        self.checks: list[Check] = []  # a round's summary: its checks, started after its steps
        self.grace = math.inf  # set as it closes: how long its stragglers may go quiet (`collect`)
        # worker id -> the connection its roundStart went to: only that one may answer
        self.connections = dict(connections) if connections is not None else None
        self.participants = set(participants)
        self.pending = set(participants)
        self.mean = mean  # the run's buffers, emptied for this round
        self.mean.reset()
        self._screen = screen
        self.started = started  # trio's clock as it opened (the engine's; 0 in unit tests)
        self.losses: list[float] = []
        self.tokens = 0
        self.bytes_saved = 0  # float32 bytes the results would have taken, minus their wire bytes
        self.compute_seconds: dict[str, float] = {}
        self.tokens_by_worker: dict[str, int] = {}
        self.steps_by_worker: dict[str, int] = {}  # inner steps each result reports
        self.largest_result = 0  # wire bytes of the largest result folded in
        self.fragment_results: tuple[int, ...] = ()  # streaming: results per fragment
        self.arrivals: dict[str, float] = {}
        self.answered: dict[str, float] = {}  # when each result was folded in (trio's clock)
        # workers whose result is in `add` (waiting its turn, screened, folded in): it counts
        # unless refused, so the round neither closes without it nor calls it a straggler
        self.folding: set[str] = set()
        self.contributors: list[str] = []
        self.bytes_at_start = (0, 0)
        self.done = trio.Event()
        self._changed = trio.Event()  # set (and renewed) whenever a worker leaves `pending`
        # pending workers whose windows may be shorter since the straggler wait last looked
        self.reconsidered: set[str] = set()
        self._lock = trio.Lock()  # one result is screened and folded in at a time
        self._closed = False
        # relays that fold their workers' results of this round (`Relays.open_fold`); their
        # notices count while it is open, and after it closes until their folds are merged
        self.relay_folds: list[str] = []
        self.folded: dict[str, Entry] = {}  # worker id -> its relay's numbers for its result
        self.relay_folded = 0  # results relays folded (`combined`: every fragment's)
        self._merging = False

    def accepts(self, worker_id: str, round_number: int, connection: object = None) -> bool:
        """Whether a result for `round_number` from `worker_id` on `connection` may count.

        Binding results to the connection that got the roundStart means a result
        cannot be replayed, or counted twice, from another connection with the same id.
        While the relays' folds close (`_merging`), a participant cut as a straggler may
        still count: its relay folded its result before the close reached it, and its fold
        holds it (`add` takes only notices then).
        """
        late = self._merging and worker_id in self.participants - set(self.contributors)
        return (
            round_number == self.number
            and (worker_id in self.pending or late)
            and self.bound_to(worker_id, connection)
        )

    def bound_to(self, worker_id: str, connection: object) -> bool:
        """Whether `connection` is the one this round's roundStart for `worker_id` went to."""
        return self.connections is None or self.connections.get(worker_id) is connection

    @property
    def validated(self) -> bool:
        """Whether this round's results are checked by loss-delta validation after it closes
        (`shepherd/rounds/checks.py`): a result folded in counts only once its check passes."""
        return self._screen is not None and self._screen.validator is not None

    async def add(self, worker_id: str, message: protocol.Message) -> bool:
        """Screen one result and fold it into the running mean (off the event loop if it is big).

        BadResult if it is refused; False if the round closed while it waited
        its turn (it is then not counted). The screens here are the cheap ones
        (names, shapes, finiteness, norms, token count); a validated round keeps
        the result (`kept`) for its loss-delta check, which runs after the round's
        outer step, while the next round trains (`checks.py`); a worker's results are
        scored before they are folded in, as every result once was, until one of them has
        counted, and again on probation (one was refused, none counted since): an
        attacker's step is then never folded in unchecked, unless it sent honest results
        first. The worker's connection
        is paused while its result is screened and folded in: the shepherd reads
        nothing more from it meanwhile, and that silence is the shepherd's own.
        """
        body = message.body
        assert isinstance(body, protocol.RoundResult), "the pool hands over results only"
        link = (self.connections or {}).get(worker_id)
        self.folding.add(worker_id)
        try:
            if body.folded:  # its relay folded it (`open_fold`): its numbers, no tensors
                async with self._lock:
                    if self._closed and not self._merging:
                        return False
                    tokens, losses = self._take_notice(worker_id, body)
                    self.contributors.append(worker_id)
                return self._took(worker_id, message, tokens, losses)
            scored_against = None
            # a first result, or one on probation (`note_refusal`): checked before it counts.
            # Not paused: the view waits for the earlier fragments' steps, which an honest
            # worker's result never waits for (it merged them before sending this one)
            if self._view is not None and link is not None and self.suspect(link):
                scored_against = await self._view()
            with link.paused() if link is not None else contextlib.nullcontext():
                async with self._lock:
                    if self._closed:
                        return False
                    small = sum(t.nbytes for t in message.tensors.values()) < INLINE_BYTES
                    if small and scored_against is None:
                        tokens, losses = self._screen_and_fold(worker_id, message, None)
                    else:  # big, or scored by the model
                        tokens, losses = await trio.to_thread.run_sync(
                            self._screen_and_fold, worker_id, message, scored_against
                        )
                    self.contributors.append(worker_id)  # the order folded in (`Aggregate.finish`)
        finally:
            self.folding.discard(worker_id)
        return self._took(worker_id, message, tokens, losses)

    def _took(
        self, worker_id: str, message: protocol.Message, tokens: int, losses: list[float]
    ) -> bool:
        """What a result folded in (here or by its relay) adds to the round's record."""
        body = message.body
        assert isinstance(body, protocol.RoundResult)
        self.tokens += tokens
        self.tokens_by_worker[worker_id] = tokens
        self.steps_by_worker[worker_id] = body.inner_steps
        self.largest_result = max(self.largest_result, message.wire_bytes)
        self.bytes_saved += max(
            sum(t.nbytes for t in message.tensors.values()) - message.wire_bytes, 0
        )
        self.losses.extend(losses)
        self.compute_seconds[worker_id] = body.compute_seconds
        self.arrivals[worker_id] = trio.current_time() - self.started
        self.answered[worker_id] = trio.current_time()
        self.finish(worker_id)
        return True

    @staticmethod
    def suspect(link: WorkerLink) -> bool:
        """Whether `link`'s results are checked before they count: none of its results has
        counted yet, or one was refused since (probation)."""
        return not link.rounds.trusted or link.rounds.unproven > 0

    def _screen_and_fold(
        self,
        worker_id: str,
        message: protocol.Message,
        scored_against: Mapping[str, np.ndarray] | None,
    ) -> tuple[int, list[float]]:
        body = message.body
        assert isinstance(body, protocol.RoundResult) and self._screen is not None
        self._screen.check(message.tensors, body.tokens)
        tokens = body.tokens
        if tokens <= 0:
            raise BadResult("a round result must report a positive token count")
        losses = list(body.losses)
        if not all(math.isfinite(x) for x in losses):
            raise BadResult("reported losses hold NaN or Inf", Refusal.NON_FINITE)
        share = self.shares.get(worker_id, 1.0)  # of its tokens' weight (`RoundEngine._shares`)
        weight = tokens * share  # validation refuses a result or keeps this weight
        if self.validated:  # checked once the round's outer step is done (`checks.py`)
            view = (self.connections or {})[worker_id].view
            assert view.shard is not None, "a worker in a round trains a shard"
            claim = Assignment(view.index, view.shard, self.send_steps[worker_id])
            if scored_against is not None:  # BadResult unless it lowers the loss
                validator = self._screen.validator
                assert validator is not None
                weight = share * validator.score(
                    message.tensors, tokens, claim, number=self.number, params=scored_against
                )
            checked = scored_against is not None
            self.kept.append(Kept(worker_id, message.tensors, weight, claim, checked, share))
        self.mean.add(message.tensors, weight, key=worker_id, share=share)
        return tokens, losses

    def _take_notice(self, worker_id: str, body: protocol.RoundResult) -> tuple[int, list[float]]:
        """A relay's notice that it folded `worker_id`'s result: checked as far as the numbers
        go (the tensors stayed at the relay, screened there as here), its norm counted toward
        the screen's baseline; BadResult where it disagrees with this round."""
        screen = self._screen
        assert screen is not None
        if not self.relay_folds or self.validated:
            raise BadResult("its relay folded it, but this round opened no fold there")
        tokens = check_token_count(body.tokens, screen.max_tokens)
        weight = tokens * self.shares.get(worker_id, 1.0)
        if body.weight != weight:
            raise BadResult(f"its relay weighed it {body.weight:g}, not its tokens' {weight:g}")
        screen.norms.judge(body.norm, screen.lr_sum(tokens) if screen.lr_sum else 1.0)
        # its notice's numbers (the norm per step scale comes with its relay's fold)
        self.folded[worker_id] = Entry(body.weight, body.scale, body.distance, math.nan)
        return tokens, list(body.losses)

    async def close(self) -> None:
        """Fold nothing in after this: waits for a result being folded in, refuses later ones;
        notices of results its relays folded still count until `merged`."""
        async with self._lock:
            self._closed = True
            self._merging = bool(self.relay_folds)

    async def noticed(self, workers: set[str], deadline: float) -> None:
        """Until every one of `workers` (a relay's fold holds their results) has its notice
        taken, or `deadline`: notices sent before the fold's answer may still be on their way."""
        while not workers <= self.folded.keys() and trio.current_time() < deadline:
            with trio.move_on_at(deadline):
                await self._changed.wait()

    def merged(self, refused: set[str]) -> None:
        """The relays' folds are in: later notices are late; `refused` (in a fold that was
        not merged) count for nothing."""
        self._merging = False
        self.folded = {w: entry for w, entry in self.folded.items() if w not in refused}
        self.contributors = [w for w in self.contributors if w not in refused]
        self.tokens = sum(self.tokens_by_worker[w] for w in self.contributors)

    def finish(self, worker_id: str) -> None:
        """The worker is out of this round (returned, refused or lost)."""
        self.pending.discard(worker_id)
        if not self.pending:
            self.done.set()
        self._changed.set()
        self._changed = trio.Event()

    def reconsider(self, worker_id: str) -> None:
        """`worker_id`'s window may be shorter now: the straggler wait looks at it again."""
        self.reconsidered.add(worker_id)
        self._changed.set()
        self._changed = trio.Event()

    async def results(self, count: int) -> None:
        """Return once `count` results are folded in, or nobody is pending."""
        while len(self.contributors) < count and not self.done.is_set():
            await self._changed.wait()

    async def changed(self, deadline: float) -> None:
        """Return when a worker leaves `pending` or is `reconsider`ed, or at `deadline`
        (trio's clock)."""
        with trio.move_on_at(deadline):
            await self._changed.wait()

    def delivered(self, worker_id: str) -> float | None:
        """When this round's roundStart had all gone out to `worker_id` (trio's clock), or
        None while it is on its way (or the round has no connections)."""
        link = (self.connections or {}).get(worker_id)
        return None if link is None else link.rounds.delivered_at.get(self.number)

    def usual_seconds(self, worker_id: str) -> float:
        """How long `worker_id` takes, by what it has shown on its connection: its latest
        result for this kind of round (this fragment) from its roundStart's delivery, counted
        or late, or this round as its progress reports project it, whichever is longer; 0.0
        if neither (a fragment's is projected at the round's whole length: more, not less)."""
        link = (self.connections or {}).get(worker_id)
        if link is None:
            return 0.0
        return max(
            link.rounds.answer_seconds.get(self.fragment, 0.0),
            link.rounds.projected_seconds(self.number),
        )

    def promise_ends(self, worker_id: str) -> float:
        """When `worker_id`'s progress projection for this round stops counting towards its
        own time (`WorkerRounds.promise_ends`: a promise not kept), or inf."""
        link = (self.connections or {}).get(worker_id)
        return math.inf if link is None else link.rounds.promise_ends(self.number)

    def unproven(self, worker_id: str) -> bool:
        """Whether a result of `worker_id`'s was refused and none counted since (`WorkerLink.
        unproven`): once the quorum is in, the round waits for it no longer than for the
        quorum's own pace (`_until_overdue`)."""
        link = (self.connections or {}).get(worker_id)
        return link is not None and link.rounds.unproven > 0

    def stranger(self, worker_id: str) -> float | None:
        """How long the round waits for `worker_id` once the quorum is in, at most, if its
        connection has shown nothing yet (no training progress, no result timed: nothing that
        gives it a time of its own, `usual_seconds`), else None: --straggler-factor times
        what it took from its welcome to saying ready (plan download and compile; the
        shepherd's clock), which covers an honest newcomer's first chunk (it then reports
        progress and is timed by its own pace). Token holders that said ready at once and
        never trained were sent every round beside the honest workers and held each for the
        floor (60 s) while the honest ones answered in 3. That time counts for the first
        round the connection is sent only (0 after, and in a repeat of it): a peer that
        delayed saying ready and never trained bought it back in every round it joined."""
        link = (self.connections or {}).get(worker_id)
        if link is None or link.rounds.progress is not None or link.rounds.answer_seconds:
            return None
        first, delivered = link.rounds.first_delivered, self.delivered(worker_id)
        later = first is not None and delivered is not None and first < delivered
        if link.ready_at is None or later:
            return 0.0
        return max(link.ready_at - link.admitted_at, 0.0)

    def receiving(self, worker_id: str) -> bool:
        """Whether a result of `worker_id`'s is arriving on its round's connection (its header
        is in: --min-upload-rate, not the straggler window, bounds the rest) or being folded in.

        Only a result counts: a peer that trickles other messages (heartbeats, each just
        within the upload rule, one after another) would otherwise be waited for for ever."""
        link = (self.connections or {}).get(worker_id)
        return worker_id in self.folding or (link is not None and link.rounds.result_arriving)

    def record(
        self,
        eval_loss: float | None,
        bytes_sent: int,
        bytes_received: int,
        *,
        parameter_count: int = 0,
        inner_steps: int = 0,
        seconds: float | None = None,
    ) -> RoundRecord:
        """The round as history keeps it; `bytes_*` are the run's totals now.

        `parameter_count` and `inner_steps` size what data parallelism would have
        sent (`data_parallel_bytes`); `seconds` is the round's wall time, measured
        from `started` to now unless given (tests give it to check exact values).
        """
        if seconds is None:
            seconds = trio.current_time() - self.started
        compute, communication, straggler = self.timings(seconds)
        contributed = {w: self.compute_seconds[w] for w in self.contributors}
        run_utilization, worker_utilization = utilization(contributed, seconds)
        sent0, received0 = self.bytes_at_start
        return RoundRecord(
            round=self.number,
            train_loss=float(np.mean(self.losses)) if self.losses else float("nan"),
            eval_loss=eval_loss,
            round_seconds=seconds,
            compute_seconds=compute,
            communication_seconds=communication,
            straggler_seconds=straggler,
            tokens=self.tokens,
            tokens_per_second=self.tokens / seconds if seconds > 0 else 0.0,
            bytes_sent=bytes_sent - sent0,
            bytes_received=bytes_received - received0,
            bytes_saved=self.bytes_saved,
            workers=len(self.contributors),
            worker_ids=tuple(self.contributors),
            utilization=run_utilization,
            worker_utilization=worker_utilization,
            bytes_data_parallel=data_parallel_bytes(
                parameter_count, inner_steps, len(self.contributors)
            ),
            largest_result_bytes=self.largest_result,
            fragment_results=self.fragment_results,
            relay_folded=self.relay_folded,
        )

    def timings(self, total: float) -> tuple[float, float, float]:
        """(compute, communication, straggler) seconds of this round."""
        if not self.arrivals:
            return 0.0, 0.0, total
        compute = max(self.compute_seconds.values(), default=0.0)
        times = sorted(self.arrivals.values())
        straggler = times[-1] - statistics.median(times)
        communication = max(total - compute - straggler, 0.0)
        return compute, communication, straggler


async def collect(current: Round, network: NetworkConfig, state: RunState) -> list[str]:
    """Wait for `current`'s results, then close it without whoever is still out.

    The round waits for all results, at most --round-timeout; once --min-workers
    are in (the quorum), each other worker has `straggler_window` from its own
    roundStart's delivery, so a peer that heartbeats but never answers costs
    a round a bounded delay, not the run. A result already arriving is waited
    for (the upload rate bounds it), and a round that times out with fewer than
    --min-workers waits on for them. The rest are dropped as stragglers, said
    in a `stragglers` event; their results, if they come, are `late_result`s. Returns
    the stragglers' ids.
    """
    began = trio.current_time()
    quorum = min(network.min_workers, len(current.participants))
    window, windowed = math.inf, False
    timeout = network.round_timeout if network.round_timeout > 0 else math.inf
    with trio.move_on_after(timeout):
        await _quorum(current, network, state, began, quorum)
        if network.straggler_factor > 0 and not current.done.is_set():
            window = straggler_window(current, network, began, quorum)
            # no floor for a worker on probation: factor times the quorum's own time
            short = network.straggler_factor * quorum_seconds(current, began, quorum)
            await _until_overdue(current, window, network.straggler_factor, min(short, window))
            windowed = True
        else:
            await current.done.wait()
    if current.done.is_set():
        return []
    if len(current.contributors) < network.min_workers:
        state.emit(
            RoundWaiting(
                f"round {current.number}: timeout with {len(current.contributors)} result(s); "
                f"waiting for --min-workers {network.min_workers}",
            )
        )
        await current.results(network.min_workers)
    late = sorted(current.pending - current.folding)  # a result being folded in still counts
    for worker_id in late:
        current.finish(worker_id)
    # how long a straggler may sit out without a sign of its round (`sitting_out.hung_reason`)
    current.grace = (window if windowed else network.round_timeout) * max(
        network.straggler_factor, 1.0
    )
    if late:
        why = (
            f"after the straggler window of {window:.3g} s (--straggler-factor "
            f"{network.straggler_factor:g} times the quorum's time, at least "
            f"--straggler-min-seconds {network.straggler_min_seconds:g}; or factor times a "
            "worker's own time, from its latest result or its progress, if longer, up to "
            "factor² times the window; one whose last result was refused, or that has shown "
            "nothing yet, factor times the quorum's time or, in its first round, its own "
            "time to ready, no floor); "
            "--adaptive-steps gives slower workers fewer steps"
            if windowed
            else f"at --round-timeout {network.round_timeout:g} s"
        )
        state.emit(
            Stragglers(
                f"round {current.number} closed without {', '.join(late)} {why}",
                workers=late,
            )
        )
    return late


async def _quorum(
    current: Round, network: NetworkConfig, state: RunState, began: float, quorum: int
) -> None:
    """Wait for `quorum` results. Short of them one straggler window after the first (as
    that result times it), say once whom the round waits for: no window closes a round
    before its quorum, so a peer that heartbeats but never answers holds it (with
    --min-workers as many as the workers, for ever) and the operator should know."""
    await current.results(min(quorum, 1))
    if network.straggler_factor > 0 and len(current.contributors) < quorum:
        window = straggler_window(current, network, began, 1)
        with trio.move_on_after(window):
            await current.results(quorum)
        if len(current.contributors) < quorum and not current.done.is_set():
            state.emit(
                RoundWaiting(
                    f"round {current.number} has {len(current.contributors)} of the {quorum} "
                    f"results --min-workers asks for, {window:.3g} s (the straggler window) "
                    f"after the first; waiting for {', '.join(sorted(current.pending))} (restart "
                    "a worker that hangs, or lower --min-workers; --round-timeout bounds a round)",
                )
            )
    await current.results(quorum)


def straggler_window(current: Round, network: NetworkConfig, began: float, quorum: int) -> float:
    """Seconds the round gives every worker for its result, from its roundStart's delivery:
    the quorum-th fastest result's time times --straggler-factor, at least
    --straggler-min-seconds. A worker's time runs from its own delivery (or `began`), so a
    far worker's slower download is not counted against it; `_until_overdue` stretches the
    window for a worker whose own results take longer."""
    quorum_time = quorum_seconds(current, began, quorum)
    return max(network.straggler_min_seconds, network.straggler_factor * quorum_time)


def quorum_seconds(current: Round, began: float, quorum: int) -> float:
    """The quorum-th fastest counted result's time from its roundStart's delivery (or
    `began`); 0.0 without one."""
    times = sorted(
        current.answered[w] - (current.delivered(w) or began) for w in current.contributors
    )
    return times[min(quorum, len(times)) - 1] if times else 0.0


async def _until_overdue(
    current: Round, window: float, factor: float, probation: float | None = None
) -> None:
    """Return when nobody is pending, or every pending worker is past its window and not
    uploading. A worker's window is the round's, or `factor` times its own time if that is
    longer (`Round.usual_seconds`: its latest result's, or this round's as its progress
    projects it): peers that answer at once (honest or not) shorten the round's, never
    the one an honest worker's own pace has earned. Its own time counts up to `factor`
    times the round's window (so at most factor² x it in all): one result sent hours late,
    or each sent at its window's end, would otherwise buy a window of any length. A worker
    whose roundStart is still on its way has not started its window. One whose last result
    was refused (`Round.unproven`) gets `probation` (factor times the quorum's time, no
    floor, nothing of its own): a peer that answered zeros at its window's end held every
    round that long. One whose connection has shown nothing yet gets that or factor times
    its own welcome-to-ready time if longer in its first round, within the window
    (`Round.stranger`)."""
    while not current.done.is_set():
        now = trio.current_time()
        current.reconsidered.clear()  # each pending worker is looked at now
        waiting: list[str] = []  # not overdue yet: no window started, uploading, or due later
        wake = math.inf
        for worker in current.pending:
            due = _due(current, worker, window, factor, probation)
            if due is None:
                waiting.append(worker)
                wake = min(wake, now + RECHECK_SECONDS)
            elif due > now:
                waiting.append(worker)
                wake = min(wake, due, current.promise_ends(worker))
        if not waiting:
            return
        # Only a waiting worker's leaving, or the clock, can make every pending worker
        # overdue: until then a result's arrival does not look at every pending worker again
        # (each arrival did, so a round of N results took N² steps). A worker whose window
        # may have shortened (a refusal, its progress: `Round.reconsider`) is looked at alone
        # and can bring the clock's time forward; so can a broken promise (its projection).
        gone, waits = 0, set(waiting)
        while not current.done.is_set() and trio.current_time() < wake:
            while gone < len(waiting) and waiting[gone] not in current.pending:
                gone += 1
            if gone == len(waiting):
                break
            if current.reconsidered:  # an overdue one's progress changes nothing here
                worker = current.reconsidered.pop()
                if worker in waits and worker in current.pending:
                    due = _due(current, worker, window, factor, probation)
                    if due is not None:
                        wake = min(wake, due, current.promise_ends(worker))
                continue
            await current.changed(wake)


def _due(
    current: Round, worker: str, window: float, factor: float, probation: float | None
) -> float | None:
    """When `worker`'s window in `current` ends (`_until_overdue`), or None while its
    roundStart is on its way or its result is arriving."""
    delivered = current.delivered(worker)
    if delivered is None or current.receiving(worker):
        return None
    if current.unproven(worker):  # its last result did no work
        return delivered + (window if probation is None else probation)
    joined = current.stranger(worker)
    if joined is not None and probation is not None:  # nothing shown yet
        return delivered + min(window, max(probation, factor * joined))
    own = min(current.usual_seconds(worker), factor * window)
    return delivered + max(window, factor * own)
