"""The round engine: one DiLoCo round on the shepherd, plain and streaming alike.

Plain DiLoCo is Streaming DiLoCo with one fragment (every parameter) and no
overlap, so there is one round here. The model is partitioned into fragments
(`diloco/streaming.partition`; one for plain DiLoCo), each with its own
aggregate, screen and outer optimizer state. A round sends every ready worker
its roundStart (θ, or `continued` to a worker that holds every fragment's
global value already) with its H_k under --adaptive-steps; then, per fragment
and concurrently: the fragment's results are collected (`rounds.collect`:
--round-timeout, --min-workers, stragglers) and folded in as they come
(`rounds.Round.add`), its outer step runs, and its new global value goes back
to every worker of the round (with --compression as its change, encoded once).
A fragment with no result keeps its global value and is sent back as it is.
Where the run validates results (`--validate loss-delta`), each fragment's
results are checked after its step, while the next round trains, and a
refusal is taken out of that step before the next one (`checks.py`).

`record_round` turns the round into the `RoundRecord` the history keeps. The
run around the rounds (admission, the rounds loop, checkpoints, goodbye) is
`coordinator.Shepherd`'s; the connections are `pool.WorkerPool`'s, which folds
each result into the `OpenRounds` this engine opens.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
import trio

from pcp_tui import protocol
from pcp_tui.config import RunConfig
from pcp_tui.contract import plan as contract
from pcp_tui.diloco import fused
from pcp_tui.diloco.aggregate import (
    Aggregate,
    CenteredClip,
    PseudoGradientMean,
    distance,
    inner_update_bound,
    make_aggregate,
)
from pcp_tui.diloco.outer import OuterOptimizer
from pcp_tui.diloco.partial import Entry, Partial
from pcp_tui.diloco.screening import NormGuard, ResultScreen
from pcp_tui.diloco.streaming import Fragments, Schedule, partition
from pcp_tui.shepherd.rounds import sitting_out
from pcp_tui.shepherd.rounds.checks import Before, Check, Correction, Verdict
from pcp_tui.shepherd.rounds.pacing import StepPacing
from pcp_tui.shepherd.rounds.results import OpenRounds, Round, collect, weight_shares
from pcp_tui.shepherd.run.events import RelayFoldLost, ResultClipped, RoundDone
from pcp_tui.shepherd.run.history import RoundRecord
from pcp_tui.shepherd.run.state import RunState, WorkerState
from pcp_tui.shepherd.serving.connection import CONNECTION_ERRORS, WorkerLink
from pcp_tui.shepherd.serving.relays import Relays
from pcp_tui.training.export import InnerOptimizer
from pcp_tui.training.workload import Workload

log = logging.getLogger(__name__)
# how long a relay's fold waits for the notices of the results in it that are still on their
# way (sent before its answer, on the same link)
NOTICE_SECONDS = 2.0


def inner_optimizer(config: RunConfig) -> InnerOptimizer:
    """The workers' inner optimizer as the run's config sets it (exported into the graphs)."""
    return InnerOptimizer(
        name=config.inner.optimizer,
        lr=config.inner.lr,
        warmup_steps=config.inner.warmup_steps,
        decay_steps=(
            config.outer.rounds * config.inner.steps if config.inner.optimizer == "adamw" else 0
        ),
        weight_decay=config.inner.weight_decay,
        grad_clip=config.inner.grad_clip,
    )


def update_bound(config: RunConfig, params: Mapping[str, np.ndarray]) -> float:
    """The largest pseudo-gradient norm an honest worker can send this round."""
    return inner_update_bound(
        config.inner.optimizer,
        config.inner.lr,
        config.inner.steps,
        sum(p.size for p in params.values()),
        distance(params, None),
        weight_decay=config.inner.weight_decay,
        grad_clip=config.inner.grad_clip,
    )


def round_lr_sum(config: RunConfig, number: int) -> float:
    """Σ of the inner learning rate over round `number`'s steps: what its updates scale with."""
    steps = config.inner.steps
    return result_lr_sum(config, 1, end=number * steps)(steps)


def result_lr_sum(config: RunConfig, per_step: int, *, end: int) -> Callable[[int], float]:
    """tokens → Σ inner lr over the run's steps a result of that many tokens covers.

    A result is sent after global step `end` (its fragment's send point) and
    covers the steps before it; one step is `per_step` tokens. A result's norm
    scales with this sum, which is how `NormGuard` compares results of warm-up,
    of decay and of fewer steps. With --adaptive-steps a fragment's send point
    moves with the worker's H_k; `end` is the plan's.
    """
    optimizer = inner_optimizer(config)
    rates = _rates(optimizer, max(end, config.outer.rounds * config.inner.steps))

    @functools.lru_cache(maxsize=16)
    def covered(tokens: int) -> float:
        return float(np.sum(rates[max(end - max(tokens // per_step, 1), 0) : end]))

    return covered


@functools.lru_cache(maxsize=8)
def _rates(optimizer: InnerOptimizer, steps: int) -> np.ndarray:
    """The inner learning rate at each of the run's first `steps` global steps, evaluated once
    a run: evaluated per result length, each new length compiled the schedule's ops anew,
    about 0.4 s on the shepherd's event loop."""
    at = np.arange(steps)
    # a constant schedule returns one rate whatever it is asked: one per step
    return np.array(np.broadcast_to(optimizer.schedule()(at), at.shape))


def tokens_per_step(config: RunConfig, workload: Workload) -> int:
    """Tokens one inner step of one worker trains on (its batch of rows)."""
    rows = not isinstance(workload.shards[0], np.ndarray)  # see training.shards.shard_plan
    batch_kind = protocol.BatchKind.ROWS if rows else protocol.BatchKind.WINDOWS
    return config.data.batch_size * contract.tokens_per_row(batch_kind, config.data.seq_len)


class OuterSteps:
    """One outer optimizer per fragment; their states checkpoint as one pytree, `[p]` first.

    Fragment p's leaves are named `[p]` + the key path its own optimizer gives
    them, e.g. `[1][0].trace['wte']`.
    """

    def __init__(self, config: RunConfig, fragments: Fragments):
        self.fragments = fragments
        self.parts = [
            OuterOptimizer(config.outer.optimizer, config.outer.lr, config.outer.momentum)
            for _ in fragments
        ]

    def apply(
        self,
        fragment: int,
        params: Mapping[str, np.ndarray],
        gradient_sum: Mapping[str, np.ndarray],
        scale: np.float32,
    ) -> None:
        """Fragment `fragment`'s outer step, in place on its tensors of `params`."""
        own = {n: params[n] for n in self.fragments[fragment]}
        self.parts[fragment].apply(own, gradient_sum, scale)

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {
            f"[{p}]{name}": value
            for p, part in enumerate(self.parts)
            for name, value in part.state_arrays().items()
        }

    def load_state_arrays(
        self, params: Mapping[str, np.ndarray], arrays: Mapping[str, np.ndarray]
    ) -> None:
        """Each fragment's state from `state_arrays`' names; ValueError if one lacks or misfits."""
        for p, (part, names) in enumerate(zip(self.parts, self.fragments, strict=True)):
            try:
                part.load_state_arrays({n: params[n] for n in names}, _part(arrays, p))
            except ValueError as exc:
                raise ValueError(
                    f"fragment {p}: {exc} (was the checkpoint written with the same "
                    "--streaming-fragments?)"
                ) from None


def _part(arrays: Mapping[str, np.ndarray], p: int) -> dict[str, np.ndarray]:
    """Fragment p's arrays of a checkpoint's `[p]`-prefixed names, the prefix taken off."""
    prefix = f"[{p}]"
    return {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}


class RoundEngine:
    """The run's rounds: the partition, each fragment's aggregate, screen and outer state.

    Collaborators are given, not reached for: the `OpenRounds` the pool folds
    results into, the run's state (events, the history's counters) and
    --adaptive-steps' pacing; each round is given the links it goes to. The
    engine owns the global parameters `params` (float32, updated in place by
    the outer steps).
    """

    def __init__(
        self,
        config: RunConfig,
        state: RunState,
        params: dict[str, np.ndarray],
        *,
        open_rounds: OpenRounds,
        per_step: int,
        pacing: StepPacing | None = None,
    ):
        self.config, self.state, self.params = config, state, params
        self._open, self.pacing = open_rounds, pacing
        shapes = {n: tuple(p.shape) for n, p in params.items()}
        self.fragments = partition(shapes, config.inner.streaming_fragments)
        self.outer = OuterSteps(config, self.fragments)
        self.per_step = per_step
        self.max_tokens = config.inner.steps * per_step  # a result covers at most H steps
        robust = config.outer.aggregate != "mean"
        self.aggregates: list[Aggregate] = [
            make_aggregate(config.outer.aggregate, names) for names in self.fragments
        ]
        self.screens = [
            ResultScreen(
                {n: shapes[n] for n in names},
                max_tokens=self.max_tokens,
                norms=NormGuard(factor=math.inf) if robust else None,
            )
            for names in self.fragments
        ]
        self.in_sync: set[WorkerLink] = set()  # hold every fragment's current global value
        self.compression = config.outer.compression
        self.schedule = Schedule(config.inner.steps, len(self.fragments), config.inner.overlap)
        # per fragment, the last round's loss-delta check, until the next step joins it
        self._pending: list[Check | None] = [None] * len(self.fragments)
        # rounds not yet counted, oldest first (`verdicts`)
        self._settling: list[Settling] = []
        self._networks: collections.Counter[str] = collections.Counter()  # ids a network, logged

    # -- checkpoints ------------------------------------------------------------

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The outer optimizers' and the aggregates' state (centered clip's center and radius
        history), named `[p]` + their own names: `--resume` goes on as the run would have."""
        aggregates = {
            f"[{p}]{name}": value
            for p, aggregate in enumerate(self.aggregates)
            for name, value in aggregate.state_arrays().items()
        }
        return {**self.outer.state_arrays(), **aggregates}

    def load(self, params: Mapping[str, np.ndarray], arrays: Mapping[str, np.ndarray]) -> None:
        """Take a checkpoint's parameters and `state_arrays` back; ValueError if they misfit."""
        for name, value in params.items():
            self.params[name] = np.array(value, np.float32)
        self.outer.load_state_arrays(self.params, arrays)
        for p, aggregate in enumerate(self.aggregates):
            aggregate.load_state_arrays(_part(arrays, p))
            if isinstance(aggregate, CenteredClip):  # its workers may come back as new processes
                aggregate.restart_inner()

    # -- a round ------------------------------------------------------------------

    @property
    def validating(self) -> bool:
        """Whether the run checks results by loss-delta validation (`checks.py`)."""
        return any(screen.validator is not None for screen in self.screens)

    async def run(
        self,
        number: int,
        links: list[WorkerLink],
        checks: trio.Nursery | None = None,
        relays: Relays | None = None,
    ) -> Round | None:
        """Round `number` with the workers of `links`; the Round its record is made from, or
        None without any result. Its loss-delta checks run in `checks` (a nursery that
        outlives the round: the run's) after the round's outer steps (`checks.py`).
        `relays`: the relays that fold their workers' results where the round allows it
        (`_open_fold`), merged as each fragment closes."""
        bound = await trio.to_thread.run_sync(update_bound, self.config, self.params)
        ids = [link.worker_id for link in links]
        connections = {link.worker_id: link for link in links}
        shares = self._shares(links)
        h = self.config.inner.steps
        steps = self.pacing.steps_for(ids, connections) if self.pacing else {}
        stepped = [trio.Event() for _ in self.fragments]  # each fragment's outer step is done
        copies = None
        if self.validating:
            assert checks is not None, "a validated round's checks need a nursery"
            copies = RoundCopies(stepped, *await trio.to_thread.run_sync(self._round_copies))
        rounds = []
        opened = trio.current_time()
        for p, (aggregate, screen) in enumerate(zip(self.aggregates, self.screens, strict=True)):
            # fragment p's results cover the steps since its last send: they scale with
            # their Σ lr (round 1: the (p + 1) H / F - τ steps of warm-up's start)
            screen.bound = bound
            screen.norms.begin_round()  # the screen's baseline: earlier rounds' norms, as a set
            end = (number - 1) * h + self.schedule.send_step(p)
            screen.lr_sum = result_lr_sum(self.config, self.per_step, end=end)
            if isinstance(aggregate, CenteredClip):  # its radius scales the same way
                aggregate.step_scale = await trio.to_thread.run_sync(screen.lr_sum, self.max_tokens)
            # each worker's steps of this round before fragment p's send: what it trained on
            sends = {w: self._schedule(steps.get(w, h)).send_step(p) for w in ids}
            rounds.append(
                Round(
                    number,
                    ids,
                    aggregate,
                    screen,
                    connections=connections,
                    fragment=p,
                    send_steps=sends,
                    shares=shares,
                    view=functools.partial(copies.view, p) if copies is not None else None,
                    started=opened,
                )
            )
        folds = []  # each fragment's fold for the relays, where its round allows one
        if relays is not None and relays.live and copies is None:  # validation needs them whole
            for current in rounds:
                if (fold := await self._fold(current, steps)) is not None:
                    folds.append((*fold, current.relay_folds))
        at_start = (self.state.bytes_sent, self.state.bytes_received)
        self._open.rounds = rounds
        self.state.round = number
        failed: set[WorkerLink] = set()
        # --round-timeout counts from here: each fragment's results are collected while
        # the roundStarts go out, and a roundStart still on its way when a fragment closes
        # is cancelled (its link ends: the worker would wait for that fragment's update)
        starts = RoundStarts(links, number)
        started_checks: list[Check] = []
        try:
            async with trio.open_nursery() as nursery:
                # each relay's folds go before its workers' round starts (a result must find
                # its fold open); a stalled relay's link holds up its own workers only
                folded_by: dict[str, trio.Event] = {}
                if folds:
                    assert relays is not None
                    folded_by = {name: trio.Event() for name in relays.live}
                    nursery.start_soon(relays.open_folds, folds, folded_by)
                for link in links:
                    nursery.start_soon(
                        self._start,
                        link,
                        number,
                        steps.get(link.worker_id, h),
                        rounds,
                        starts,
                        failed,
                        folded_by.get(link.view.via),
                    )
                for p in range(len(self.fragments)):
                    sync = FragmentSync(rounds[p], links, starts, failed, stepped, copies, relays)
                    nursery.start_soon(self._sync, p, sync, checks, started_checks)
        finally:
            self._open.rounds = []
        self.in_sync = {link for link in links if link not in failed and not link.closed}
        contributors = list(dict.fromkeys(w for r in rounds for w in r.contributors))
        settling = Settling(number, checks=started_checks if copies else None)
        self._settling.append(settling)
        if not contributors:
            return None
        summary = combined(number, rounds, opened, at_start, self.per_step)
        summary.checks = started_checks
        settling.tokens = dict(summary.tokens_by_worker)
        # the shard each result trained: its sender's by the verdict, a round later under
        # validation, may be another (lost, a newcomer took its shard, back on another)
        settling.shards = {w: connections[w].view.shard for w in contributors}
        if self.pacing is not None:
            self.pacing.observe(summary)
        return summary

    def _round_copies(self) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
        """θ as a validated round begins, and each aggregate's state: what its checks score
        against and recompute from (copies: the outer steps write both in place)."""
        start = copy_tensors(self.params)
        return start, [copy_tensors(a.state_arrays()) for a in self.aggregates]

    def verdicts(self) -> list[Verdict]:
        """The rounds settled since the last call, oldest first. A round is settled as it
        closes, or, where the run validates, once its checks have ended (by the next round's
        outer steps, or `settle`); only then do its results count: towards their senders'
        rounds and their shards' progress, and in its history entry (`RunState.count`)."""
        settled = []
        while self._settling:
            oldest = self._settling[0]
            number, tokens, checks = oldest.number, oldest.tokens, oldest.checks
            if checks is not None and not all(check.done.is_set() for check in checks):
                break
            self._settling.pop(0)
            passed = set(tokens)
            if checks is not None:
                passed = {worker for check in checks for worker in check.counted}
            counted = [w for w in tokens if w in passed]
            verdict = Verdict(number, counted, [w for w in tokens if w not in passed])
            results = None
            if checks is not None and any(check.refused for check in checks):
                each = {check.fragment: len(check.counted) for check in checks}
                fragments = len(self.fragments)
                results = tuple(each.get(p, 0) for p in range(fragments)) if fragments > 1 else ()
            shards = {w: oldest.shards[w] for w in counted}
            self.state.count(number, {w: tokens[w] for w in counted}, results, shards=shards)
            settled.append(verdict)
        return settled

    async def settle(self) -> None:
        """Wait for every check still running and take its correction into θ now (the run's
        end, a checkpoint): the workers, which hold θ uncorrected, get all of it next round."""
        for p in range(len(self.fragments)):
            correction = await self._join(p)
            if correction is not None:
                await trio.to_thread.run_sync(self._correct, p, correction)
                self.in_sync = set()

    async def _join(self, p: int) -> Correction | None:
        """Wait for the last round's check of fragment p; its correction, if it refused any
        result (the aggregate's state is corrected here, before this round's step)."""
        check, self._pending[p] = self._pending[p], None
        if check is None:
            return None
        await check.done.wait()
        correction = check.correction
        if correction is not None:  # the aggregate's state as it would be without them
            self.aggregates[p].load_state_arrays(correction.aggregate)
        return correction

    def _refold(self, current: Round) -> None:
        """Fold `current`'s results again, in the order they came, into its aggregate as the
        last round's correction left it (centered clip: its center and radius; a
        coordinate-wise aggregate keeps nothing across rounds, the mean is not validated)."""
        aggregate = current.mean
        if isinstance(aggregate, CenteredClip):
            aggregate.reset()
            for kept in current.kept:
                aggregate.add(kept.tensors, kept.weight, key=kept.worker_id, share=kept.share)

    def _correct(self, p: int, correction: Correction) -> None:
        """Fragment p's tensors and outer state as its last step without the refused results
        (they have not moved since that step: only p's own step writes them)."""
        for name, value in correction.params.items():
            np.copyto(self.params[name], value)
        self.outer.parts[p].state = correction.outer_state

    def _shares(self, links: Sequence[WorkerLink]) -> dict[str, float]:
        """Each worker's share of its tokens' weight this round (`weight_shares`), under
        `--weight-per address` in an open run; logs the networks whose ids share one."""
        security = self.config.security
        if security.weight_per != "address" or security.worker_keys:
            return {}
        networks = {link.worker_id: link.view.network for link in links}
        counts = collections.Counter(networks.values())
        if counts != self._networks and len(set(counts.values())) > 1:
            fewest = min(counts.values())
            for network, ids in sorted(counts.items()):
                if ids > fewest:
                    log.info(
                        "%d ids from %s weigh as %d (--weight-per address)", ids, network, fewest
                    )
        self._networks = counts
        return weight_shares(networks)

    def _schedule(self, steps: int) -> Schedule:
        """The schedule of a worker's round of `steps` inner steps (H_k under --adaptive-steps)."""
        return dataclasses.replace(self.schedule, inner_steps=steps)

    async def _start(
        self,
        link: WorkerLink,
        number: int,
        steps: int,
        rounds: list[Round],
        starts: RoundStarts,
        failed: set[WorkerLink],
        fold_opened: trio.Event | None = None,
    ) -> None:
        """Send round `number`'s start (`steps` inner steps) to `link`, parameters unless in sync,
        through `starts` (`RoundStarts`: a closing fragment cancels it there); once its relay
        has this round's folds (`fold_opened`), for a worker behind one."""
        continued = link in self.in_sync
        body = protocol.RoundStart(round=number, inner_steps=steps, continued=continued)
        link.view.state, link.view.round, link.view.step = WorkerState.SYNCING, number, 0
        link.rounds.claims.ask(steps)  # what its results may claim (`shepherd/rounds/claims.py`)
        try:
            await starts.send(link, body, {} if continued else self.params, after=fold_opened)
        except CONNECTION_ERRORS:
            failed.add(link)
            for current in rounds:  # the connection task reports the loss
                current.finish(link.worker_id)

    async def _sync(
        self,
        p: int,
        sync: FragmentSync,
        checks: trio.Nursery | None,
        started_checks: list[Check],
    ) -> None:
        """Fragment p: collect its results, take its outer step (then set its `stepped`),
        start its results' check, send its global value back.

        The step first joins the last round's check of p (`checks.py`): the only wait
        for validation on a round's path. A worker still taking its roundStart when the
        fragment closes (`RoundStarts`) is a straggler, cut off; it would wait for this
        fragment's update.
        """
        current, links, failed = sync.round, sync.links, sync.failed
        sitting_out.sit_out(current, await collect(current, self.config.network, self.state))
        failed.update(await sync.starts.settle(current.contributors))
        await current.close()  # a result still being folded in finishes first
        if current.relay_folds and sync.relays is not None:
            await self._merge_folds(current, sync.relays)
        collected = trio.current_time()
        correction = await self._join(p)
        mean = None
        if current.contributors:
            mean = current.mean
            if correction is not None:
                await trio.to_thread.run_sync(self._refold, current)
            scales = await trio.to_thread.run_sync(mean.finish)
            self._say_clipped(current, scales)
        update, before = await trio.to_thread.run_sync(
            self._step, p, current.number, mean, correction, sync.copies
        )
        sync.stepped[p].set()
        if before is not None and sync.copies is not None and checks is not None:
            validator = self.screens[p].validator
            assert validator is not None, "a validated round has a validator for each fragment"
            names = self.fragments[p]
            check = Check(
                current.number,
                p,
                current.kept,
                validator,
                functools.partial(sync.copies.view, p),
                before,
                aggregate=functools.partial(make_aggregate, self.config.outer.aggregate, names),
                outer=functools.partial(
                    OuterOptimizer,
                    self.config.outer.optimizer,
                    self.config.outer.lr,
                    self.config.outer.momentum,
                ),
                links=current.connections or {},
                state=self.state,
                open_rounds=self._open,
            )
            started_checks.append(check)
            if all(kept.checked for kept in current.kept):  # scored as they came: settled now
                check.done.set()
            else:
                self._pending[p] = check
                checks.start_soon(check.run)
        done = trio.current_time()
        async with trio.open_nursery() as nursery:
            for link in links:
                if link not in failed:
                    nursery.start_soon(_send_update, link, update, failed)
        log.debug(
            "round %d, fragment %d: results in %.2f s after the round began, outer step "
            "%.2f s, update sent in %.2f s",
            current.number,
            p,
            collected - current.started,
            done - collected,
            trio.current_time() - done,
        )

    async def _fold(
        self, current: Round, steps: Mapping[str, int]
    ) -> tuple[protocol.Fold, Mapping[str, np.ndarray] | None] | None:
        """The fold (and the clip's center) that has the relays fold `current`'s results of
        their workers: with a mean, or centered clip once its radius and norm cap are known (a
        round without them takes results whole: None)."""
        aggregate, p = current.mean, current.fragment
        if isinstance(aggregate, CenteredClip) and aggregate.folds:
            center = aggregate.open_partial().center  # scaled to this round's step
            radius, cap, step_scale = aggregate.radius, aggregate.norm_cap, aggregate.step_scale
        elif isinstance(aggregate, PseudoGradientMean):
            center, radius, cap, step_scale = None, math.inf, math.inf, 1.0
        else:
            return None
        screen = self.screens[p]
        assert screen.lr_sum is not None, "a round's screen has its lr sums"
        lengths = sorted({*current.send_steps.values(), *steps.values(), self.config.inner.steps})
        sums = await trio.to_thread.run_sync(
            lambda: [screen.lr_sum(k * self.per_step) for k in lengths]  # type: ignore[misc]
        )
        shapes = [self.params[name].shape for name in self.fragments[p]]
        order = protocol.Fold(
            round=current.number,
            fragment=p,
            radius=radius,
            norm_cap=cap,
            step_scale=step_scale,
            measure=center is not None,
            max_tokens=screen.max_tokens,
            bound=screen.bound,
            norm_typical=screen.norms.typical,
            norm_factor=screen.norms.factor,
            per_step=self.per_step,
            lr_sums=tuple(sums),
            lr_steps=tuple(lengths),
            share_workers=tuple(current.shares),
            shares=tuple(current.shares.values()),
            names=self.fragments[p],
            dims=tuple(d for shape in shapes for d in shape),
            ranks=tuple(len(shape) for shape in shapes),
        )
        return order, center

    async def _merge_folds(self, current: Round, relays: Relays) -> None:
        """Close `current`'s folds at its relays and merge what they folded into its aggregate
        (their workers' notices counted them); a fold that does not agree with itself or with
        this round is refused, and its workers count for nothing."""
        aggregate = current.mean
        assert isinstance(aggregate, CenteredClip | PseudoGradientMean)
        clip = aggregate if isinstance(aggregate, CenteredClip) else None
        shapes = {n: self.params[n].shape for n in self.fragments[current.fragment]}
        links = current.connections or {}
        timeout = self.config.network.heartbeat_timeout
        answers = await relays.close_fold(
            current.number, current.fragment, current.relay_folds, timeout
        )
        refused: set[str] = set()
        for name, message in answers.items():
            body = message.body_as(protocol.Folded)
            try:
                lists = (body.workers, body.weights, body.scales, body.distances, body.norms)
                if len({len(numbers) for numbers in lists}) != 1:
                    raise ValueError("its lists of workers and numbers differ in length")
                numbers = zip(body.weights, body.scales, body.distances, body.norms, strict=True)
                entries = {w: Entry(*n) for w, n in zip(body.workers, numbers, strict=True)}
                await current.noticed(set(entries), trio.current_time() + NOTICE_SECONDS)
                for worker, entry in entries.items():  # each as its notice said, and its own
                    link, noticed = links.get(worker), current.folded.get(worker)
                    said = noticed and (noticed.weight, noticed.scale, noticed.distance)
                    ours = (entry.weight, entry.scale, entry.distance)
                    if said != ours or link is None or link.view.via != name:
                        raise ValueError(f"it holds a result of {worker!r} it sent no notice of")
                partial = await trio.to_thread.run_sync(
                    functools.partial(
                        Partial.received,
                        shapes,
                        message.tensors,
                        entries,
                        center_weight=body.center_weight,
                        center=clip.center if clip else None,
                        radius=clip.radius if clip else math.inf,
                        norm_cap=clip.norm_cap if clip else math.inf,
                        step_scale=clip.step_scale if clip else 1.0,
                    )
                )
                if partial.clipped < 1.0:
                    log.warning(
                        "round %d: relay %s's partial lay outside the clip's ball; scaled by %.3g",
                        current.number,
                        name,
                        partial.clipped,
                    )
                aggregate.merge(partial)
            except ValueError as exc:
                self._fold_lost(current, name, f"refused: {exc}", set(body.workers))
                refused |= set(body.workers)
        merged = aggregate.partial.results  # a worker whose fold never came counts for nothing
        unanswered = {w for w in current.folded if w not in merged and w not in refused}
        for name in current.relay_folds:
            if name not in answers and (
                theirs := {w for w in unanswered if links[w].view.via == name}
            ):
                why = f"no answer within {timeout:g} s (its link lost or stalled)"
                self._fold_lost(current, name, why, theirs)
        current.merged(refused | unanswered)

    def _fold_lost(self, current: Round, relay: str, why: str, workers: set[str]) -> None:
        """Say that a relay's fold of `current` did not count, and whose results it held."""
        noticed = len(workers & current.folded.keys())
        self.state.emit(
            RelayFoldLost(
                f"round {current.number}: relay {relay}'s fold of {noticed} results does not "
                f"count: {why}",
                relay=relay,
                round=current.number,
                workers=noticed,
            )
        )

    def _say_clipped(self, current: Round, scales: list[float]) -> None:
        """A `result_clipped` event for each result centered clip scaled down."""
        if not isinstance(current.mean, CenteredClip):
            return  # only centered clip scales results
        radius, cap = current.mean.radius, current.mean.norm_cap
        part = f", fragment {current.fragment}" if len(self.fragments) > 1 else ""
        # in the order folded in: here, then each relay's (keyed by worker id)
        for worker_id, scale in zip(current.mean.partial.results, scales, strict=False):
            if scale != 1.0 and worker_id in self.state.workers:
                self.state.emit(
                    ResultClipped(
                        f"round {current.number}{part}: worker "
                        f"{self.state.workers[worker_id].index}'s result was scaled by "
                        f"{scale:.3g} to the norm cap {cap:.4g} and the clip radius "
                        f"{radius:.4g}",
                        worker=worker_id,
                        round=current.number,
                        scale=scale,
                    )
                )

    def _step(
        self,
        p: int,
        number: int,
        mean: Aggregate | None,
        correction: Correction | None,
        copies: RoundCopies | None,
    ) -> tuple[protocol.Encoded, Before | None]:
        """Fragment p's outer step (if `mean` has results) and its update, encoded once for
        every worker (in a thread: a model-sized copy and passes over the fragment); and,
        in a validated round with results, what its check recomputes the step from.

        `correction` (the last round's check refused results) replaces p's tensors and
        outer state first. With --compression the update travels as its change since
        what the workers hold (the fragment's last global value as sent: before the
        correction, which the change then carries), encoded like the pseudo-gradients
        (the paper's compressed outer exchange). The shepherd keeps old +
        decode(encode(change)), the very float32 sum every worker forms, so both sides
        hold the same bits: `protocol.encode_change` writes it over `params` as it
        encodes, chunk by chunk (tests/test_encode_change.py checks the bits).
        """
        own = {n: self.params[n] for n in self.fragments[p]}
        old = copy_tensors(own) if self.compression != "none" else {}
        if correction is not None:
            self._correct(p, correction)
        before = None
        if mean is not None:
            if copies is not None:
                part = self.outer.parts[p]
                before = Before(
                    copy_tensors(own) if correction else {n: copies.start[n] for n in own},
                    None if part.state is None else copy_tree(part.state),
                    correction.aggregate if correction else copies.aggregates[p],
                    mean.step_scale if isinstance(mean, CenteredClip) else 1.0,
                )
            self.outer.apply(p, self.params, mean.sums, mean.scale)
        if not old:
            update = protocol.encode_once(protocol.FragmentUpdate(round=number, fragment=p), own)
        else:
            body = protocol.FragmentUpdate(round=number, fragment=p, change=True)
            update = protocol.encode_change(body, own, old, quantization=self.compression)
        if copies is not None and p < len(self.fragments) - 1:  # the later fragments' checks
            copies.new[p] = copy_tensors(own)
        return update, before


@dataclasses.dataclass
class Settling:
    """A closed round not yet counted (`RoundEngine.verdicts`): its contributors' tokens, the
    shard each trained (its link's, as the round ran), and its checks (None: not validated)."""

    number: int
    tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    shards: dict[str, int | None] = dataclasses.field(default_factory=dict)
    checks: list[Check] | None = None


@dataclasses.dataclass
class RoundCopies:
    """What a validated round's checks read, copied as the round began (the outer steps write
    θ and the aggregates in place): θ (`start`), each aggregate's state, and each fragment's
    tensors after its step (`new`, for the later fragments' checks: streaming)."""

    stepped: list[trio.Event]
    start: dict[str, np.ndarray]
    aggregates: list[dict[str, np.ndarray]]
    new: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.new = [{} for _ in self.stepped]

    async def view(self, p: int) -> dict[str, np.ndarray]:
        """θ as a worker held it when it sent fragment p's result: the earlier fragments'
        new global values (it merged them before p's send point), the round's start for the
        rest (p's own changes only at its own step). Waits for the earlier steps."""
        for q in range(p):
            await self.stepped[q].wait()
        view = dict(self.start)
        for q in range(p):
            view.update(self.new[q])
        return view


@dataclasses.dataclass
class FragmentSync:
    """What one fragment's sync of a round works with (`RoundEngine._sync`)."""

    round: Round
    links: list[WorkerLink]
    starts: RoundStarts
    failed: set[WorkerLink]
    stepped: list[trio.Event]
    copies: RoundCopies | None
    relays: Relays | None = None  # whose folds of this round's results it merges


class RoundStarts:
    """The roundStarts of one round, each in a scope a closing fragment can cancel."""

    def __init__(self, links: list[WorkerLink], number: int):
        self._scopes = {link: trio.CancelScope() for link in links}
        self._ended = {link: trio.Event() for link in links}
        self.number = number
        self._parameters: protocol.Encoded | None = None

    async def send(
        self,
        link: WorkerLink,
        body: protocol.RoundStart,
        tensors: Mapping[str, np.ndarray],
        *,
        after: trio.Event | None = None,
    ) -> None:
        """Send `link` its roundStart (CONNECTION_ERRORS as `WorkerLink.send` raises them),
        once `after` is set (its relay has the round's folds), unless cancelled first.

        The parameters are encoded once for the round and each worker's start carries the
        same payload buffers: a relay gets them once for all of its workers
        (`contract.channels`)."""
        try:
            with self._scopes[link]:
                if after is not None:
                    await after.wait()
                if not tensors:
                    await link.send(body)
                    return
                if self._parameters is None:
                    self._parameters = protocol.encode_once(body, tensors)
                await link.send_encoded(self._parameters.with_body(body))
        finally:
            self._ended[link].set()

    async def settle(self, contributed: list[str]) -> set[WorkerLink]:
        """The links cut off as a fragment closes with results from `contributed`.

        A roundStart still on its way is cancelled, unless its worker's result came
        (that worker has it, even if the task that sent it has not resumed); then
        each cancelled send is waited for. The cancel ended the link of one that had
        bytes left to send (`WorkerLink.send`); one whose last byte had gone out,
        its task not yet resumed, is delivered and its link stays. So whether an
        honest worker is cut off depends on the bytes sent, never on which task the
        scheduler ran first.
        """
        cancelled = [
            link
            for link in self._scopes
            if not self.delivered(link) and link.worker_id not in contributed
        ]
        for link in cancelled:
            self._scopes[link].cancel()
        for link in cancelled:
            await self._ended[link].wait()
        return {link for link in cancelled if not self.delivered(link)}

    def delivered(self, link: WorkerLink) -> bool:
        """Whether `link`'s whole roundStart went out (`WorkerLink.round_delivered`)."""
        return self.number in link.rounds.delivered_at


async def _send_update(link: WorkerLink, update: protocol.Encoded, failed: set[WorkerLink]) -> None:
    """Send a fragment update, the same bytes to every worker; a lost link joins `failed`."""
    try:
        await link.send_encoded(update)
    except CONNECTION_ERRORS:
        failed.add(link)  # the connection task reports the loss; next round: full parameters


def copy_tensors(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A copy of each tensor, chunk by chunk over the outer step's threads (on the 2-core
    CPU box a 124 MB fragment copied in 27 ms with `ndarray.copy`, in 13 ms so)."""
    copies = {n: np.empty_like(v, order="C") for n, v in tensors.items()}
    pairs = [[copies[n], np.ascontiguousarray(v)] for n, v in tensors.items()]
    fused.over_chunks(_copy_chunk, pairs, ())
    return copies


def copy_tree(tree):
    """A copy of a pytree of arrays (an outer optimizer's state), as `copy_tensors` copies."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    copies = copy_tensors({str(i): np.asarray(leaf) for i, leaf in enumerate(leaves)})
    return jax.tree_util.tree_unflatten(treedef, [copies[str(i)] for i in range(len(leaves))])


def _copy_chunk(scratch, target: np.ndarray, source: np.ndarray) -> None:
    np.copyto(target, source)


def combined(
    number: int, rounds: list[Round], started: float, at_start: tuple[int, int], per_step: int
) -> Round:
    """One Round holding what a round record needs from every fragment's results.

    A worker's tokens, steps and compute time are the sums of its fragment
    results (each covers the steps since its previous one); a worker counts
    as a contributor if any of its fragments was folded in.
    """
    summary = Round(number, [], PseudoGradientMean(()), None, connections=rounds[0].connections)
    summary.started, summary.bytes_at_start = started, at_start
    for current in rounds:
        summary.losses.extend(current.losses)
        summary.bytes_saved += current.bytes_saved
        summary.largest_result = max(summary.largest_result, current.largest_result)
        for worker in current.contributors:
            if worker not in summary.contributors:
                summary.contributors.append(worker)
            steps = summary.steps_by_worker.get(worker, 0) + current.steps_by_worker[worker]
            summary.steps_by_worker[worker] = steps
            summary.tokens_by_worker[worker] = steps * per_step
            summary.compute_seconds[worker] = (
                summary.compute_seconds.get(worker, 0.0) + current.compute_seconds[worker]
            )
            summary.arrivals[worker] = max(
                summary.arrivals.get(worker, 0.0), current.arrivals[worker]
            )
    summary.tokens = sum(summary.tokens_by_worker.values())
    summary.relay_folded = sum(len(current.folded) for current in rounds)
    if len(rounds) > 1:
        summary.fragment_results = tuple(len(r.contributors) for r in rounds)
    return summary


def record_round(
    state: RunState, config: RunConfig, current: Round, eval_loss: float | None
) -> RoundRecord:
    """Add round `current` to the history; emit `round`. Its results count towards their
    workers and shards once the round is settled (`RoundEngine.verdicts`)."""
    entry = current.record(
        eval_loss,
        state.bytes_sent,
        state.bytes_received,
        parameter_count=state.param_count,
        inner_steps=config.inner.steps,
    )
    views = [state.workers[worker_id] for worker_id in current.contributors]
    trained = {view.shard for view in views}
    untrained = tuple(s.index for s in state.shards.shards if s.index not in trained)
    relays = len({view.via for view in views if view.via})
    entry = dataclasses.replace(entry, untrained_shards=untrained, relays=relays)
    state.history.append(entry)
    state.emit(RoundDone(f"round {current.number} done", record=entry))
    return entry
