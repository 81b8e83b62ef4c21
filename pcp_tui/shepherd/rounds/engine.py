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

`record_round` turns the round into the `RoundRecord` the history keeps. The
run around the rounds (admission, the rounds loop, checkpoints, goodbye) is
`coordinator.Shepherd`'s; the connections are `pool.WorkerPool`'s, which folds
each result into the `OpenRounds` this engine opens.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping

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
from pcp_tui.diloco.screening import NormGuard, ResultScreen
from pcp_tui.diloco.streaming import Fragments, Schedule, partition
from pcp_tui.shepherd.rounds import sitting_out
from pcp_tui.shepherd.rounds.pacing import StepPacing
from pcp_tui.shepherd.rounds.results import OpenRounds, Round, collect
from pcp_tui.shepherd.run.events import ResultClipped, RoundDone
from pcp_tui.shepherd.run.history import RoundRecord
from pcp_tui.shepherd.run.state import RunState, WorkerState
from pcp_tui.shepherd.serving.connection import CONNECTION_ERRORS, WorkerLink
from pcp_tui.training.export import InnerOptimizer
from pcp_tui.training.workload import Workload

log = logging.getLogger(__name__)


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
    schedule = inner_optimizer(config).schedule()

    @functools.lru_cache(maxsize=16)
    def covered(tokens: int) -> float:
        steps = max(tokens // per_step, 1)
        return float(np.sum(schedule(np.arange(max(end - steps, 0), end))))

    return covered


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

    # -- a round ------------------------------------------------------------------

    async def run(self, number: int, links: list[WorkerLink]) -> Round | None:
        """Round `number` with the workers of `links`; the Round its record is made from, or
        None without any result."""
        bound = await trio.to_thread.run_sync(update_bound, self.config, self.params)
        ids = [link.worker_id for link in links]
        connections = {link.worker_id: link for link in links}
        h = self.config.inner.steps
        steps = self.pacing.steps_for(ids, connections) if self.pacing else {}
        views = await self._scored_against()
        stepped = [trio.Event() for _ in self.fragments]  # each fragment's outer step is done
        rounds = []
        for p, (aggregate, screen) in enumerate(zip(self.aggregates, self.screens, strict=True)):
            # fragment p's results cover the steps since its last send: they scale with
            # their Σ lr (round 1: the (p + 1) H / F - τ steps of warm-up's start)
            screen.bound = bound
            screen.norms.begin_round()  # the screen's baseline: earlier rounds' norms, as a set
            end = (number - 1) * h + self.schedule.send_step(p)
            screen.lr_sum = result_lr_sum(self.config, self.per_step, end=end)
            if screen.validator is not None:  # scores results against θ as p's send finds it
                screen.validator.begin(number, views[p])
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
                    after=stepped[:p],
                )
            )
        started = time.monotonic()
        at_start = (self.state.bytes_sent, self.state.bytes_received)
        self._open.rounds = rounds
        self.state.round = number
        failed: set[WorkerLink] = set()
        # --round-timeout counts from here: each fragment's results are collected while
        # the roundStarts go out, and a roundStart still on its way when a fragment closes
        # is cancelled (its link ends: the worker would wait for that fragment's update)
        starts = RoundStarts(links, number)
        try:
            async with trio.open_nursery() as nursery:
                for link in links:
                    nursery.start_soon(
                        self._start,
                        link,
                        number,
                        steps.get(link.worker_id, h),
                        rounds,
                        starts,
                        failed,
                    )
                for p in range(len(self.fragments)):
                    nursery.start_soon(self._sync, p, rounds[p], links, starts, failed, stepped[p])
        finally:
            self._open.rounds = []
        self.in_sync = {link for link in links if link not in failed and not link.closed}
        if not any(r.contributors for r in rounds):
            return None
        summary = combined(number, rounds, started, at_start, self.per_step)
        if self.pacing is not None:
            self.pacing.observe(summary)
        return summary

    def _schedule(self, steps: int) -> Schedule:
        """The schedule of a worker's round of `steps` inner steps (H_k under --adaptive-steps)."""
        return dataclasses.replace(self.schedule, inner_steps=steps)

    async def _scored_against(self) -> list[Mapping[str, np.ndarray]]:
        """Per fragment p, θ as validation scores p's results against: what a worker held
        outside p's own progress when it sent them.

        That is the round's start for fragments p and later (p's own changes only at
        its own outer step, after its results), and the new global value for earlier
        ones: a worker merges those before p's send point (`Round.after` waits for
        their steps). The outer steps write `params` in place, over threads, and a
        later fragment can step while p's results are still scored, so later
        fragments are read from a copy made now: all but fragment 0's tensors, once a
        round (none in plain rounds).
        """
        if all(screen.validator is None for screen in self.screens):
            return [self.params] * len(self.fragments)
        later = {n: self.params[n] for names in self.fragments[1:] for n in names}
        start = await trio.to_thread.run_sync(copy_tensors, later)
        views: list[Mapping[str, np.ndarray]] = []
        for p in range(len(self.fragments)):
            live = {n for names in self.fragments[: p + 1] for n in names}
            views.append({n: v if n in live else start[n] for n, v in self.params.items()})
        return views

    async def _start(
        self,
        link: WorkerLink,
        number: int,
        steps: int,
        rounds: list[Round],
        starts: RoundStarts,
        failed: set[WorkerLink],
    ) -> None:
        """Send round `number`'s start (`steps` inner steps) to `link`, parameters unless in sync,
        through `starts` (`RoundStarts`: a closing fragment cancels it there)."""
        continued = link in self.in_sync
        body = protocol.RoundStart(round=number, inner_steps=steps, continued=continued)
        tensors = {} if continued else self.params
        link.view.state, link.view.round, link.view.step = WorkerState.SYNCING, number, 0
        link.rounds.claims.ask(steps)  # what its results may claim (`shepherd/rounds/claims.py`)
        try:
            await starts.send(link, body, tensors)
        except CONNECTION_ERRORS:
            failed.add(link)
            for current in rounds:  # the connection task reports the loss
                current.finish(link.worker_id)

    async def _sync(
        self,
        p: int,
        current: Round,
        links: list[WorkerLink],
        starts: RoundStarts,
        failed: set[WorkerLink],
        stepped: trio.Event,
    ) -> None:
        """Fragment p: collect its results, take its outer step (then set `stepped`), send
        its global value back.

        `starts` (`RoundStarts`): a worker still taking its roundStart when the fragment
        closes is a straggler, cut off; it would wait for this fragment's update.
        """
        sitting_out.sit_out(current, await collect(current, self.config.network, self.state))
        failed.update(await starts.settle(current.contributors))
        await current.close()  # a result still being folded in finishes first
        collected = time.monotonic()
        mean = None
        if current.contributors:
            mean = current.mean
            scales = await trio.to_thread.run_sync(mean.finish)
            self._say_clipped(current, scales)
        update = await trio.to_thread.run_sync(self._step, p, current.number, mean)
        stepped.set()
        done = time.monotonic()
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
            time.monotonic() - done,
        )

    def _say_clipped(self, current: Round, scales: list[float]) -> None:
        """A `result_clipped` event for each result centered clip scaled down."""
        if not isinstance(current.mean, CenteredClip):
            return  # only centered clip scales results
        radius = current.mean.radius
        part = f", fragment {current.fragment}" if len(self.fragments) > 1 else ""
        for worker_id, scale in zip(current.contributors, scales, strict=False):
            if scale != 1.0:
                self.state.emit(
                    ResultClipped(
                        f"round {current.number}{part}: worker "
                        f"{self.state.workers[worker_id].index}'s result was scaled by "
                        f"{scale:.3g} to the clip radius {radius:.4g}",
                        worker=worker_id,
                        round=current.number,
                        scale=scale,
                    )
                )

    def _step(self, p: int, number: int, mean: Aggregate | None) -> protocol.Encoded:
        """Fragment p's outer step (if `mean` has results) and its update, encoded once for
        every worker (in a thread: a model-sized copy and passes over the fragment).

        With --compression the update travels as its change since the fragment's
        last global value, encoded like the pseudo-gradients (the paper's
        compressed outer exchange). The shepherd keeps old + decode(encode(change)),
        the very float32 sum every worker forms, so both sides hold the same bits:
        `protocol.encode_change` writes it over `params` as it encodes, chunk by
        chunk (tests/test_encode_change.py checks the bits).
        """
        own = {n: self.params[n] for n in self.fragments[p]}
        old = copy_tensors(own) if self.compression != "none" else {}
        if mean is not None:
            self.outer.apply(p, self.params, mean.sums, mean.scale)
        if not old:
            return protocol.encode_once(protocol.FragmentUpdate(round=number, fragment=p), own)
        body = protocol.FragmentUpdate(round=number, fragment=p, change=True)
        return protocol.encode_change(body, own, old, quantization=self.compression)


class RoundStarts:
    """The roundStarts of one round, each in a scope a closing fragment can cancel."""

    def __init__(self, links: list[WorkerLink], number: int):
        self._scopes = {link: trio.CancelScope() for link in links}
        self._ended = {link: trio.Event() for link in links}
        self.number = number

    async def send(
        self, link: WorkerLink, body: protocol.RoundStart, tensors: Mapping[str, np.ndarray]
    ) -> None:
        """Send `link` its roundStart (CONNECTION_ERRORS as `WorkerLink.send` raises them)."""
        try:
            with self._scopes[link]:
                await link.send(body, tensors)
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
    if len(rounds) > 1:
        summary.fragment_results = tuple(len(r.contributors) for r in rounds)
    return summary


def record_round(
    state: RunState, config: RunConfig, current: Round, eval_loss: float | None
) -> RoundRecord:
    """Add round `current` to the history (and its workers' and shards' counts); emit `round`."""
    entry = current.record(
        eval_loss,
        state.bytes_sent,
        state.bytes_received,
        parameter_count=state.param_count,
        inner_steps=config.inner.steps,
    )
    trained = set()
    for worker_id in current.contributors:
        state.workers[worker_id].rounds_contributed += 1
        state.shards.trained(worker_id, current.tokens_by_worker[worker_id])
        trained.add(state.workers[worker_id].shard)
    untrained = tuple(s.index for s in state.shards.shards if s.index not in trained)
    entry = dataclasses.replace(entry, untrained_shards=untrained)
    state.history.append(entry)
    state.emit(RoundDone(f"round {current.number} done", record=entry))
    return entry
