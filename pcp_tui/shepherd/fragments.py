"""Streaming DiLoCo on the shepherd: a round synchronises the model one fragment at a time.

`Shepherd._run_round` hands a round to `FragmentSync.run_round` when
`--streaming-fragments` is 2 or more. The round then holds one `Round` per
fragment (its own aggregate, screen and outer optimizer state): results for
fragment p arrive at p's point of the workers' rounds
(`diloco/streaming.Schedule`), are screened and averaged as plain rounds'
are, and p's outer step runs as soon as they are in (or the round timeout
closes p), while the workers keep training; the new global value of p goes
back to every worker of the round (with --compression, as its change encoded
the same way: see `_change`). A fragment with no result keeps its global
value, and is sent back as it is.

A worker that received every fragment of the last round holds the global
parameters (mixed into its own) and starts the next round with a bare
`roundStart(continued)`; any other (a newcomer, a reconnect, one whose update
failed) gets the full parameters, as in plain DiLoCo.

With --adaptive-steps a roundStart carries the worker's own H_k
(`shepherd/pacing.py`), and the worker scales its schedule to it. Each
fragment's aggregate (centered clip's center and radius history) checkpoints
beside its outer state (`FragmentSync.state_arrays`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping

import numpy as np
import trio

from pcp_tui import protocol
from pcp_tui.config import RunConfig
from pcp_tui.diloco import fused
from pcp_tui.diloco.aggregate import CenteredClip, PseudoGradientMean, make_aggregate
from pcp_tui.diloco.outer import OuterOptimizer
from pcp_tui.diloco.screening import NormGuard, ResultScreen
from pcp_tui.diloco.streaming import Fragments, Schedule, partition
from pcp_tui.shepherd.connection import CONNECTION_ERRORS, WorkerLink
from pcp_tui.shepherd.plain_round import result_lr_sum, update_bound
from pcp_tui.shepherd.rounds import Round, collect

log = logging.getLogger(__name__)


class FragmentedOuter:
    """One outer optimizer per fragment; their states checkpoint as one pytree, `[p]` first.

    Same interface as `OuterOptimizer` for checkpoints (`state_arrays`,
    `load_state_arrays`): fragment p's leaves are named `[p]` + the key path
    its own optimizer gives them, e.g. `[1][0].trace['wte']`.
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
            prefix = f"[{p}]"
            own = {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
            try:
                part.load_state_arrays({n: params[n] for n in names}, own)
            except ValueError as exc:
                raise ValueError(
                    f"fragment {p}: {exc} (was the checkpoint written with the same "
                    "--streaming-fragments?)"
                ) from None


class FragmentSync:
    """The shepherd's Streaming DiLoCo: partition, per-fragment state, and the round."""

    def __init__(self, config: RunConfig, shapes: Mapping[str, tuple[int, ...]], max_tokens: int):
        self.fragments = partition(shapes, config.inner.streaming_fragments)
        self.outer = FragmentedOuter(config, self.fragments)
        robust = config.outer.aggregate != "mean"
        self.aggregates = [
            make_aggregate(config.outer.aggregate, names) for names in self.fragments
        ]
        self.screens = [
            ResultScreen(
                {n: shapes[n] for n in names},
                max_tokens=max_tokens,
                norms=NormGuard(factor=math.inf) if robust else None,
            )
            for names in self.fragments
        ]
        self.in_sync: set[WorkerLink] = set()  # hold every fragment's current global value
        self.compression = config.outer.compression
        self.tokens_per_step = max_tokens // config.inner.steps

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Each fragment's aggregation state (centered clip's center and radius history).

        Named `[p]` + the names the fragment's aggregate gives them, e.g.
        `[1]aggregate.distances`: beside `FragmentedOuter`'s in the checkpoint, so
        that `--resume` clips each fragment from its own history at once, as the
        uninterrupted run would have.
        """
        return {
            f"[{p}]{name}": value
            for p, aggregate in enumerate(self.aggregates)
            for name, value in aggregate.state_arrays().items()
        }

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Take `state_arrays`' names back; a fragment without them (older checkpoint) starts bare."""
        for p, aggregate in enumerate(self.aggregates):
            prefix = f"[{p}]"
            aggregate.load_state_arrays(
                {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
            )

    async def run_round(self, shepherd, number: int) -> Round | None:
        """Run round `number` fragment by fragment; the combined Round, or None without results."""
        links = shepherd.pool.ready_links()
        bound = await trio.to_thread.run_sync(update_bound, shepherd.config, shepherd.params)
        ids = [link.worker_id for link in links]
        connections = {link.worker_id: link for link in links}
        rounds = []
        config, h, per_step = shepherd.config, shepherd.config.inner.steps, self.tokens_per_step
        schedule = Schedule(h, len(self.fragments), config.inner.overlap_steps)
        for p, (aggregate, screen) in enumerate(zip(self.aggregates, self.screens, strict=True)):
            # fragment p's results cover the steps since its last send: they scale with
            # their Σ lr (round 1: the (p + 1) H / F - τ steps of warm-up's start)
            screen.bound = bound
            screen.lr_sum = result_lr_sum(
                config, per_step, end=(number - 1) * h + schedule.send_step(p)
            )
            if isinstance(aggregate, CenteredClip):  # its radius scales the same way
                aggregate.step_scale = await trio.to_thread.run_sync(screen.lr_sum, h * per_step)
            rounds.append(
                Round(number, ids, aggregate, screen, connections=connections, fragment=p)
            )
        started, at_start = (
            time.monotonic(),
            (shepherd.state.bytes_sent, shepherd.state.bytes_received),
        )
        shepherd.pool.fragment_rounds = rounds
        shepherd.state.round = number
        failed: set[WorkerLink] = set()
        pacing = shepherd.pacing  # --adaptive-steps
        steps = pacing.steps_for(ids, connections) if pacing else {}
        # --round-timeout counts from here: each fragment's results are collected while
        # the roundStarts go out, and a roundStart still on its way when a fragment closes
        # is cancelled (its link ends: the worker would wait for that fragment's update)
        starts = RoundStarts(links, number)
        async with trio.open_nursery() as nursery:
            for link in links:
                h = steps.get(link.worker_id, config.inner.steps)
                nursery.start_soon(self._start, shepherd, link, number, h, rounds, starts, failed)
            for p in range(len(self.fragments)):
                nursery.start_soon(self._sync, shepherd, p, rounds[p], links, starts, failed)
        shepherd.pool.fragment_rounds = []
        self.in_sync = {link for link in links if link not in failed and not link.closed}
        if not any(r.contributors for r in rounds):
            return None
        summary = combined(number, rounds, started, at_start, self.tokens_per_step)
        if shepherd.pacing is not None:
            shepherd.pacing.observe(summary)
        return summary

    async def _start(
        self, shepherd, link: WorkerLink, number: int, steps: int, rounds, starts, failed
    ) -> None:
        """Send round `number`'s start (`steps` inner steps) to `link`, parameters unless in sync,
        through `starts` (`RoundStarts`: a closing fragment cancels it there)."""
        continued = link in self.in_sync
        body = protocol.RoundStart(round=number, inner_steps=steps, continued=continued)
        tensors = {} if continued else {n: shepherd.params[n] for n in shepherd.graphs.param_names}
        link.view.state, link.view.round, link.view.step = "syncing", number, 0
        link.claims.ask(steps)  # what its fragment results may claim (`shepherd/claims.py`)
        try:
            await starts.send(link, body, tensors)
        except CONNECTION_ERRORS:
            failed.add(link)
            for current in rounds:  # the connection task reports the loss
                current.finish(link.worker_id)

    async def _sync(self, shepherd, p: int, current: Round, links, starts, failed) -> None:
        """Fragment p: collect its results, take its outer step, send its global value back.

        `starts` (`RoundStarts`): a worker still taking its roundStart when the fragment
        closes is a straggler, cut off as in a plain round; it would wait for this
        fragment's update.
        """
        shepherd.pool.sit_out(
            current, await collect(current, shepherd.config.network, shepherd.state)
        )
        failed.update(await starts.settle(current.contributors))
        await current.close()
        collected = time.monotonic()
        mean = None
        if current.contributors:
            mean = current.mean
            scales = await trio.to_thread.run_sync(mean.finish)
            for worker_id, scale in zip(current.contributors, scales, strict=False):
                if scale != 1.0:
                    shepherd.state.emit(
                        "result_clipped",
                        f"round {current.number}, fragment {p}: worker "
                        f"{shepherd.state.workers[worker_id].index}'s result was scaled by "
                        f"{scale:.3g} to the clip radius {mean.radius:.4g}",
                        worker=worker_id,
                        round=current.number,
                        scale=scale,
                    )
        update = await trio.to_thread.run_sync(self._step, p, current.number, shepherd.params, mean)
        stepped = time.monotonic()
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
            stepped - collected,
            time.monotonic() - stepped,
        )

    def _step(self, p: int, number: int, params: dict, mean) -> protocol.Encoded:
        """Fragment p's outer step (if `mean` has results) and its update, encoded once for
        every worker (in a thread: a model-sized copy and passes over the fragment)."""
        names = self.fragments[p]
        old = _copy({n: params[n] for n in names}) if self.compression != "none" else {}
        if mean is not None:
            self.outer.apply(p, params, mean.sums, mean.scale)
        if old:
            return self._change(p, number, old, params)
        body = protocol.FragmentUpdate(round=number, fragment=p)
        return protocol.encode_once(body, {n: params[n] for n in names})

    def _change(self, p: int, number: int, old: dict, params: dict) -> protocol.Encoded:
        """The compressed form of fragment p's outer step, and the global value made exactly it.

        With --compression the update travels as its change since the fragment's
        last global value, encoded like the pseudo-gradients (the paper's
        compressed outer exchange). The shepherd keeps old + decode(encode(change)),
        the very float32 sum every worker forms, so both sides hold the same bits:
        `protocol.encode_change` writes it over `params` as it encodes, chunk by
        chunk, without decoding the bytes (tests/test_encode_change.py checks the bits).
        """
        body = protocol.FragmentUpdate(round=number, fragment=p, change=True)
        names = self.fragments[p]
        return protocol.encode_change(
            body, {n: params[n] for n in names}, old, quantization=self.compression
        )


class RoundStarts:
    """The roundStarts of one streaming round, each in a scope a closing fragment can cancel."""

    def __init__(self, links: list[WorkerLink], number: int):
        self._scopes = {link: trio.CancelScope() for link in links}
        self._ended = {link: trio.Event() for link in links}
        self.number = number

    async def send(self, link: WorkerLink, body: protocol.RoundStart, tensors: dict) -> None:
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
        return self.number in link.round_delivered


async def _send_update(link: WorkerLink, update: protocol.Encoded, failed: set) -> None:
    """Send a fragment update, the same bytes to every worker; a lost link joins `failed`."""
    try:
        await link.send_encoded(update)
    except CONNECTION_ERRORS:
        failed.add(link)  # the connection task reports the loss; next round: full parameters


def _copy(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
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
    summary.fragment_results = tuple(len(r.contributors) for r in rounds)
    return summary
