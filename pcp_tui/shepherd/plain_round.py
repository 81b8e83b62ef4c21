"""One plain DiLoCo round on the shepherd, from the round start to its history record.

A round sends the global parameters θ to every ready worker (with its inner
steps H_k under --adaptive-steps), waits for their pseudo-gradients Δ_k
(`rounds.collect`: --round-timeout, --min-workers, stragglers), forms the
robust mean the results were folded into as they came (`rounds.Round.add`),
and applies the outer step to θ in place. `record_round` then turns the round into
the `RoundRecord` the history keeps; Streaming DiLoCo rounds
(`shepherd/fragments.py`) are recorded the same way.

The run around the rounds (admission, the rounds loop, checkpoints, goodbye)
is `coordinator.Shepherd`'s; this module holds no state across rounds beyond
what it was built with (the run's aggregate, screen, outer optimizer, pacing).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping

import numpy as np
import trio

from pcp_tui import protocol
from pcp_tui.config import RunConfig
from pcp_tui.contract import plan as contract
from pcp_tui.diloco.aggregate import Aggregate, CenteredClip, distance, inner_update_bound
from pcp_tui.diloco.outer import OuterOptimizer
from pcp_tui.diloco.screening import NormGuard, ResultScreen
from pcp_tui.shepherd.connection import CONNECTION_ERRORS, WorkerLink
from pcp_tui.shepherd.pacing import StepPacing
from pcp_tui.shepherd.pool import WorkerPool
from pcp_tui.shepherd.rounds import Round, collect
from pcp_tui.shepherd.state import RoundRecord, RunState
from pcp_tui.training.export import InnerOptimizer
from pcp_tui.training.workload import Workload


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
    return result_lr_sum(config, 1, start=(number - 1) * steps)(steps)


def result_lr_sum(
    config: RunConfig, per_step: int, *, start: int | None = None, end: int | None = None
) -> Callable[[int], float]:
    """tokens → Σ inner lr over the run's steps a result of that many tokens covers.

    The steps begin at global step `start` (a plain round's result) or end at
    `end` (a fragment's, sent after step `end`); one step is `per_step` tokens.
    A result's norm scales with this sum, which is how `NormGuard` compares
    results of warm-up, of decay and of fewer steps. With --adaptive-steps a
    fragment's send point moves with the worker's H_k; `end` is the plan's.
    """
    schedule = inner_optimizer(config).schedule()

    @functools.lru_cache(maxsize=16)
    def covered(tokens: int) -> float:
        steps = max(tokens // per_step, 1)
        first, last = (start, start + steps) if start is not None else (max(end - steps, 0), end)
        return float(np.sum(schedule(np.arange(first, last))))

    return covered


def result_screen(
    config: RunConfig, workload: Workload, shapes: Mapping[str, tuple]
) -> ResultScreen:
    """The screen every result passes before it is averaged: shapes, tokens, norms.

    A result may report at most the tokens of H inner steps of the plan's batches;
    robust aggregates also check norms against the round's `update_bound`.
    """
    rows = not isinstance(workload.shards[0], np.ndarray)  # see training.shards.shard_plan
    batch_kind = protocol.BatchKind.ROWS if rows else protocol.BatchKind.WINDOWS
    per_row = contract.tokens_per_row(batch_kind, config.data.seq_len)
    return ResultScreen(
        dict(shapes),
        max_tokens=config.inner.steps * config.data.batch_size * per_row,
        norms=None if config.outer.aggregate == "mean" else NormGuard(factor=math.inf),
    )


class PlainRound:
    """Runs plain DiLoCo rounds with the run's aggregate, screen, outer optimizer and pacing."""

    def __init__(
        self,
        config: RunConfig,
        state: RunState,
        pool: WorkerPool,
        *,
        mean: Aggregate,
        screen: ResultScreen,
        outer: OuterOptimizer,
        pacing: StepPacing | None,
    ):
        self.config, self.state, self.pool = config, state, pool
        self.mean, self.screen, self.outer, self.pacing = mean, screen, outer, pacing

    async def run(
        self, number: int, params: dict[str, np.ndarray], param_names: list[str]
    ) -> Round | None:
        """Round `number`: θ out, Δ_k in, outer step on `params` in place; None without results."""
        links = self.pool.ready_links()
        self.screen.bound = await trio.to_thread.run_sync(update_bound, self.config, params)
        per_step = self.screen.max_tokens // self.config.inner.steps
        start = (number - 1) * self.config.inner.steps
        self.screen.lr_sum = result_lr_sum(self.config, per_step, start=start)
        if self.screen.validator is not None:
            self.screen.validator.begin(number, params)
        if isinstance(self.mean, CenteredClip):  # warm-up and decay move its radius
            self.mean.step_scale = await trio.to_thread.run_sync(round_lr_sum, self.config, number)
        current = Round(
            number,
            [link.worker_id for link in links],
            self.mean,
            self.screen,
            connections={link.worker_id: link for link in links},
        )
        current.bytes_at_start = (self.state.bytes_sent, self.state.bytes_received)
        self.pool.round = current
        self.state.round = number
        await self._start_and_collect(current, links, {n: params[n] for n in param_names})
        await current.close()  # a result still being folded in finishes first
        self.pool.round = None
        if not current.contributors:
            return None
        if self.pacing is not None:
            self.pacing.observe(current)
        await self._outer_step(current, params)
        return current

    async def _start_and_collect(
        self, current: Round, links: list[WorkerLink], tensors: dict
    ) -> None:
        """Send every link its roundStart (θ, and its H_k under --adaptive-steps) at once, and
        collect results from the round's start: --round-timeout counts from there, and a
        roundStart still on its way when the round closes is a straggler's, cut off."""
        pacing = self.pacing  # --adaptive-steps
        steps = pacing.steps_for(current.participants, current.connections) if pacing else {}
        async with trio.open_nursery() as nursery:
            for link in links:
                link.view.state, link.view.round, link.view.step = "syncing", current.number, 0
                body = protocol.RoundStart(
                    round=current.number,
                    inner_steps=steps.get(link.worker_id, self.config.inner.steps),
                )
                nursery.start_soon(_send_round_start, link, body, tensors, current)
            self.pool.sit_out(current, await collect(current, self.config.network, self.state))
            if set(current.participants) - set(current.contributors):
                # a worker whose result counts has its roundStart, even if the task that
                # sent it has not resumed yet: cancel only when the round closed without some
                nursery.cancel_scope.cancel()

    async def _outer_step(self, current: Round, params: dict[str, np.ndarray]) -> None:
        """Finish the round's mean (said in a `result_clipped` event per clipped result),
        then apply the outer optimizer to `params` in place."""
        mean = current.mean  # the outer step forms the mean from the sums as it goes
        scales = await trio.to_thread.run_sync(mean.finish)
        for worker_id, clip in zip(current.contributors, scales, strict=False):
            if clip == 1.0:
                continue
            self.state.emit(
                "result_clipped",
                f"round {current.number}: worker {self.state.workers[worker_id].index}'s result "
                f"was scaled by {clip:.3g} to the clip radius {mean.radius:.4g}",
                worker=worker_id,
                round=current.number,
                scale=clip,
            )
        await trio.to_thread.run_sync(self.outer.apply, params, mean.sums, mean.scale)


async def _send_round_start(
    link: WorkerLink, body: protocol.RoundStart, tensors: dict, current: Round
) -> None:
    link.claims.ask(body.inner_steps)  # what its result may claim (`shepherd/claims.py`)
    try:
        await link.send(body, tensors)
    except CONNECTION_ERRORS:
        current.finish(link.worker_id)  # the connection task reports the loss


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
    state.emit("round", f"round {current.number} done", record=entry)
    return entry
