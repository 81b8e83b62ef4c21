"""A worker's round: train H_k steps, sending and merging every fragment once, on a schedule.

The plan names the fragments (tensor names, computed once on the shepherd;
plain DiLoCo has one, every parameter) and τ and α;
`diloco/streaming.Schedule` says after which inner step each fragment is sent
and merged. A round goes:

    train to fragment 0's send point → send Δ_0 in the background → train τ
    steps → wait for G_0 (usually already here) and merge it (mix, or carry:
    `diloco/streaming.py`) → ... → fragment F−1 merges after step H.

Plain DiLoCo is the one-fragment schedule with τ = 0: train H steps, send Δ,
take the new global value θ as it comes back (α = 0), exactly.

Parameters, the inner optimizer state and each fragment's last global value
live from round to round: a `roundStart(continued)` carries no tensors. A
full roundStart (first round, reconnect, a missed update) starts over from
the parameters it carries. Compute, device transfers and checks run in
threads, so the session's heartbeats keep flowing meanwhile.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from pcp_tui import protocol
from pcp_tui.backends import Backend
from pcp_tui.contract import plan as contract
from pcp_tui.contract.checks import expected_shapes, round_start_problem
from pcp_tui.contract.connection import Connection
from pcp_tui.diloco import fused
from pcp_tui.diloco.streaming import Event, Schedule, carry_scale
from pcp_tui.training import shards
from pcp_tui.worker.stats import WorkerCounters

log = logging.getLogger(__name__)

PROGRESS_INTERVAL = 0.25  # seconds between progress messages, at most


class RoundRefused(Exception):
    """What the shepherd sent for a round cannot be trained on; the message says why."""


@dataclass
class Training:
    """The received plan as this worker runs it: the plan itself, its shard, its compiled graphs."""

    plan: protocol.Plan
    shard: np.ndarray | tuple[np.ndarray, ...]  # token windows, or row-indexed arrays
    train_chunk: Callable
    init_opt_state: Callable
    param_axes: tuple | None = None  # on a worker of several devices: each one's split axis


@dataclass
class InnerState:
    """The inner optimizer's state, kept across reconnects to one run (`Worker._enter_run`)."""

    opt_state: Any = None


class Faults:
    """Where a worker can be made to misbehave, for tests and benchmarks.

    The worker consults these at fixed points of its round; this base class is
    the honest worker (every hook does nothing). `pcp_tui.testing.faulty_worker`
    subclasses it; the product never does.
    """

    async def before_round(self, number: int) -> None:
        """Called as round `number` starts, in the round's own task."""

    def after_chunk(self, seconds: float) -> None:
        """Called in the compute thread after a compiled chunk that took `seconds`."""

    def result(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The pseudo-gradient tensors a result will carry; returns what is sent instead."""
        return tensors


class RoundTrainer:
    """One worker's rounds under one plan: parameters, last global values, the schedule."""

    def __init__(
        self,
        training: Training,
        backend: Backend,
        counters: WorkerCounters,
        inner: InnerState,
        *,
        status: Callable[..., None],
        worker_index: Callable[[], int | None],
        faults: Faults | None = None,
    ):
        self.training, self.plan = training, training.plan
        self.backend, self.counters, self.inner = backend, counters, inner
        self._status, self._worker_index = status, worker_index  # index: set once welcomed
        self.faults = faults or Faults()
        self.fragments = contract.fragments(self.plan)
        self.updates = FragmentUpdates(self.fragments)
        self._index = {name: i for i, name in enumerate(self.plan.param_names)}
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self.params: list | None = None  # on the device, from round to round
        self.last_global: dict[str, np.ndarray] = {}
        self._since_sync = [0] * len(self.fragments)  # steps each fragment's Δ trained on
        self._unreported: list[float] = []  # losses of steps no result has carried yet
        self._unreported_seconds = 0.0
        self._round_ended: float | None = None  # when the last round ended, for `Pauses`

    async def train_round(self, sender: Connection, message: protocol.Message) -> None:
        """Round `message.body.round`: train H_k steps, sending and merging every fragment once.

        H_k is the roundStart's inner steps (the plan's H unless --adaptive-steps
        sized this worker's round to its speed); the schedule scales with it, so
        fragment p still syncs at (p + 1) / F of the round, as on every other worker.

        The training loop itself only dispatches: at a send point it takes a
        snapshot of the fragment (a device copy), and a background exchange reads
        it to the host, forms Δ_p, sends it, waits for G_p, checks it and stages it
        on the device; at the merge point the loop merges the staged G_p in. What
        the loop still waits for is logged per round (`Pauses`). RoundRefused if
        the roundStart or an update cannot be trained on.
        """
        start = message.body
        assert isinstance(start, protocol.RoundStart), "the receive loop hands over roundStarts"
        number, steps = start.round, start.inner_steps or self.plan.inner_steps
        problem = contract.round_steps_problem(self.plan, steps)
        if problem is not None:
            raise RoundRefused(f"roundStart refused: {problem}")
        await self.faults.before_round(number)
        ended, self._round_ended = self._round_ended, None
        pauses = Pauses(number, between=0.0 if ended is None else time.perf_counter() - ended)
        params, step = await self._start(start, message.tensors), 0
        self.params = None  # donated to the chunks; set again when the round is done
        schedule = Schedule(steps, len(self.fragments), self.plan.overlap_steps)
        exchanges: dict[int, Exchange] = {}
        refusal = None  # a fragment update's problem: the round ends, the shepherd hears why
        async with trio.open_nursery() as background:
            for at, event, p in schedule.events():
                if at > step:
                    began = time.perf_counter()
                    params = await self._train(sender, number, steps, params, step, at)
                    pauses.training += time.perf_counter() - began
                    step = at
                began = time.perf_counter()
                if event is Event.SEND:
                    exchanges[p] = Exchange(self, sender, number, p, self._result(number, p))
                    snapshot = self._snapshot(p, params)
                    background.start_soon(exchanges[p].run, snapshot)
                    pauses.sends += time.perf_counter() - began
                    continue
                self._status(state="syncing")
                exchange = exchanges.pop(p)
                staged = await exchange.staged()
                pauses.waits += time.perf_counter() - began
                pauses.exchange(exchange.phases)
                if isinstance(staged, str):
                    refusal = staged
                    background.cancel_scope.cancel()  # the other exchanges end with the round
                    break
                began = time.perf_counter()
                params = await trio.to_thread.run_sync(self._merge, p, params, staged)
                pauses.merges += time.perf_counter() - began
        if refusal is not None:
            raise RoundRefused(f"fragmentUpdate refused: {refusal}")
        self.params = params
        self._round_ended = time.perf_counter()
        log.info("%s", pauses)
        self._status(state="idle")

    async def _start(self, start: protocol.RoundStart, tensors: dict[str, np.ndarray]) -> list:
        """The round's parameters on the device: ours for a continued round, else those it
        carries; RoundRefused if they cannot be trained on."""
        if start.continued:
            if self.params is None:
                raise RoundRefused(
                    "roundStart refused: continued, but this worker holds no parameters yet"
                )
            return self.params
        problem = await trio.to_thread.run_sync(self._round_start_problem, tensors)
        if problem is not None:
            raise RoundRefused(f"roundStart refused: {problem}")
        params = await trio.to_thread.run_sync(self._upload, tensors)
        if self.inner.opt_state is None:
            self.inner.opt_state = await trio.to_thread.run_sync(
                self.training.init_opt_state, tuple(params)
            )
        self.last_global = {n: np.array(tensors[n], np.float32) for n in self._index}
        self._since_sync = [0] * len(self.fragments)
        self._unreported, self._unreported_seconds = [], 0.0
        return params

    def _round_start_problem(self, tensors: dict[str, np.ndarray]) -> str | None:
        names = self.plan.param_names
        if self._shapes is None:
            self._shapes = expected_shapes(self.training.init_opt_state, names)
        return round_start_problem(tensors, names, self._shapes)

    def _upload(self, tensors: dict[str, np.ndarray]) -> list:
        """The round's parameters on the device (donated to training)."""
        host = [np.asarray(tensors[n], np.float32) for n in self.plan.param_names]
        axes = self.training.param_axes
        return self.backend.to_device(host) if axes is None else self.backend.to_device(host, axes)

    async def _train(
        self, sender: Connection, number: int, steps: int, params: list, start: int, stop: int
    ) -> list:
        """Inner steps [start, stop) of round `number` (of `steps`), in the plan's compiled
        chunks, reporting progress (skipped while a fragment uploads: training does not wait
        for a progress line)."""
        plan, k = self.plan, self.plan.chunk_steps
        self._status(state="training", round=number, step=start, total_steps=steps, message="")
        began = time.perf_counter()
        opt_state = self.inner.opt_state
        self.inner.opt_state = None  # donated to the chunks below; set again when they are done
        per_step = plan.batch_size * plan.tokens_per_row
        losses: list[float] = []
        last_progress = 0.0
        chunks = range(start // k, stop // k)
        for chunk in chunks:
            batches = shards.sample_shard(
                plan.batch_kind,
                self.training.shard,
                steps=k,
                batch_size=plan.batch_size,
                seq_len=plan.seq_len,
                seed=plan.seed,
                stream=(self._worker_index() or 0, number, chunk),  # unique per worker and chunk
            )
            # the run's step: rounds are H steps apart in the schedule, however many this one has
            first_step = (number - 1) * plan.inner_steps + chunk * k
            params, opt_state, chunk_losses = await trio.to_thread.run_sync(
                self._run_chunk, params, opt_state, batches, first_step
            )
            losses.extend(float(x) for x in chunk_losses)
            self.counters.trained(len(chunk_losses), len(chunk_losses) * per_step)
            tps = len(losses) * per_step / (time.perf_counter() - began)
            self._status(step=start + len(losses), loss=losses[-1], tokens_per_second=tps)
            now = time.monotonic()
            if not math.isfinite(losses[-1]) or sender.stream.sending:
                continue  # a diverged loss is for the result (the shepherd refuses it)
            if now - last_progress >= PROGRESS_INTERVAL or chunk == chunks[-1]:
                last_progress = now
                progress = protocol.Progress(
                    number,
                    start + len(losses),
                    steps,
                    losses[-1],
                    tps,
                    protocol.Phase.TRAINING,
                    self.counters.snapshot(),
                )
                await sender.send(progress)
        self.inner.opt_state = opt_state
        self._unreported.extend(losses)
        self._unreported_seconds += time.perf_counter() - began
        self._since_sync = [n + len(losses) for n in self._since_sync]
        return params

    def _run_chunk(self, params: list, opt_state, batches: np.ndarray, first_step: int):
        started = time.perf_counter()
        chunk = run_chunk(self.training.train_chunk, params, opt_state, batches, first_step)
        self.faults.after_chunk(time.perf_counter() - started)
        return chunk

    def _snapshot(self, p: int, params: list) -> object:
        """Fragment p's local values now, held past their donation to the next chunk."""
        return self.backend.snapshot([params[self._index[n]] for n in self.fragments[p]])

    def delta(self, p: int, snapshot: object) -> tuple[dict, dict | None]:
        """Δ_p = fragment p's global value at its last sync − its local value at the send point.

        Also the local values themselves when the plan carries the overlap's
        progress over (the merge needs them), else None.
        """
        names = self.fragments[p]
        local = dict(zip(names, self.backend.fetch(snapshot), strict=True))
        delta = {n: self.last_global[n] - local[n] for n in names}
        carry = self.plan.overlap_merge is protocol.OverlapMerge.CARRY
        return self.faults.result(delta), local if carry else None

    def _result(self, number: int, p: int) -> protocol.RoundResult:
        per_step = self.plan.batch_size * self.plan.tokens_per_row
        result = protocol.RoundResult(
            round=number,
            fragment=p,
            tokens=self._since_sync[p] * per_step,
            losses=tuple(self._unreported),
            compute_seconds=self._unreported_seconds,
            inner_steps=len(self._unreported),
        )
        self._since_sync[p] = 0
        self._unreported, self._unreported_seconds = [], 0.0
        return result

    def prepare(self, p: int, update: protocol.Message, sent: dict | None) -> tuple | str:
        """Fragment p's new global value G_p, checked and staged for the merge; or the problem.

        G_p is the update itself, or (`change`, compressed runs) the last global
        value plus the decoded change: the very sum the shepherd keeps. It
        becomes fragment p's last global value at the merge. With `sent` (the
        local values at the send point: the carry merge) what is staged is the
        shift G_p − θ_sent instead.
        """
        names = self.fragments[p]
        shapes = {n: tuple(self.last_global[n].shape) for n in names}
        problem = round_start_problem(update.tensors, names, shapes)
        if problem is not None:
            return problem
        body = update.body
        assert isinstance(body, protocol.FragmentUpdate), "FragmentUpdates holds only these"
        if body.change:
            new = add_changes({n: self.last_global[n] for n in names}, update.tensors)
        else:
            new = {n: np.asarray(update.tensors[n], np.float32) for n in names}
        staged = [new[n] if sent is None else new[n] - sent[n] for n in names]
        return new, self.backend.stage(staged, self._axes(p))

    def _merge(self, p: int, params: list, staged: tuple) -> list:
        """Fragment p's merge on the device; G_p becomes its last global value.

        The paper's mix, θ_p ← α θ_p + (1 − α) G_p, or the carry merge,
        θ_p ← θ_p + (1 − α)(G_p − θ_sent): the global value plus the τ overlap
        steps' own progress (`diloco/streaming.py`).
        """
        names = self.fragments[p]
        new, on_device = staged
        local = [params[self._index[n]] for n in names]
        alpha, axes = self.plan.mix_alpha, self._axes(p)
        if self.plan.overlap_merge is protocol.OverlapMerge.CARRY:
            placed = self.backend.shift(local, on_device, float(carry_scale(alpha)), axes)
        else:
            placed = self.backend.blend(local, on_device, alpha, axes)
        params = list(params)
        for name, array in zip(names, placed, strict=True):
            params[self._index[name]] = array
            self.last_global[name] = new[name]
        return params

    def _axes(self, p: int) -> list | None:
        """Fragment p's tensors' mesh axes (a worker over several devices), or None."""
        axes = self.training.param_axes
        return None if axes is None else [axes[self._index[n]] for n in self.fragments[p]]


def run_chunk(train_chunk: Callable, params, opt_state, batches: np.ndarray, first_step: int):
    """One compiled chunk of inner steps from global step `first_step`: (params, opt_state,
    losses), the losses on the host (which waits for the device)."""
    params, opt_state, losses = train_chunk(
        tuple(params), tuple(opt_state), batches, np.int32(first_step)
    )
    return list(params), list(opt_state), np.asarray(losses)


class FragmentUpdates:
    """Fragment updates the shepherd sent, held until their merge points ask for them.

    `deliver` runs on the receive loop and checks what a header can say (the
    fragment exists, its tensors are the fragment's); the values are checked
    at the merge. A shepherd that sends more than two rounds' worth ahead is
    broken, and the connection ends.
    """

    def __init__(self, fragments: tuple[tuple[str, ...], ...]):
        self.fragments = fragments
        self._held: dict[tuple[int, int], protocol.Message] = {}
        self._arrived = trio.Event()

    def deliver(self, message: protocol.Message) -> None:
        body = message.body
        assert isinstance(body, protocol.FragmentUpdate), "the receive loop hands over these"
        if body.fragment >= len(self.fragments):
            raise protocol.MalformedMessage(
                f"fragmentUpdate for fragment {body.fragment}; the plan has {len(self.fragments)}"
            )
        if set(message.tensors) != set(self.fragments[body.fragment]):
            raise protocol.MalformedMessage(
                f"fragmentUpdate {body.fragment} does not carry exactly its fragment's tensors"
            )
        if len(self._held) >= 2 * len(self.fragments):
            raise protocol.MalformedMessage("the shepherd sent fragment updates nobody asked for")
        self._held[(body.round, body.fragment)] = message
        self._arrived.set()

    async def take(self, number: int, fragment: int) -> protocol.Message:
        """Fragment `fragment`'s update for round `number`, once it is here."""
        while (number, fragment) not in self._held:
            self._arrived = trio.Event()
            await self._arrived.wait()
        for key in [k for k in self._held if k[0] < number]:  # stale rounds' leftovers
            del self._held[key]
        return self._held.pop((number, fragment))


def add_changes(last: dict[str, np.ndarray], changes: dict[str, np.ndarray]) -> dict:
    """Each fragment tensor's new global value, `last + change`, as float32 arithmetic gives it.

    A decoded change is a fresh array the update owns: where it is a C-contiguous,
    writable float32 array (as the decoder makes it) and `last` is float32 too, the
    sum is written over it a cache-sized chunk at a time over the outer step's
    threads (`fused.over_chunks`), making no model-sized temporary; otherwise a new
    array. The same bits either way: one float32 addition a value.
    """
    new, rows = {}, []
    for name, base in last.items():
        change = changes[name]
        if _addable_in_place(base, change):
            rows.append((base, change))
            new[name] = change
        else:
            new[name] = base + change
    fused.over_chunks(_add_chunk, rows, ())
    return new


def _addable_in_place(base: np.ndarray, change: np.ndarray) -> bool:
    float32 = np.dtype(np.float32)
    return (
        isinstance(change, np.ndarray)
        and isinstance(base, np.ndarray)
        and change.dtype == float32
        and base.dtype == float32
        and change.shape == base.shape
        and change.flags.c_contiguous
        and change.flags.writeable
        and base.flags.c_contiguous
    )


def _add_chunk(scratch, base: np.ndarray, change: np.ndarray) -> None:
    np.add(base, change, out=change)


class Exchange:
    """One fragment's trip, in the background of training: Δ_p up, G_p back, staged.

    `staged()` is what the merge point waits for: the staged G_p, or a problem
    (a string) with the update, which ends the round with a refusal.
    """

    def __init__(
        self,
        rounds: RoundTrainer,
        sender: Connection,
        number: int,
        p: int,
        result: protocol.RoundResult,
    ):
        self.rounds = rounds
        self.sender = sender
        self.number = number
        self.p = p
        self.result = result  # the RoundResult that carries Δ_p
        self._done = trio.Event()
        self._staged: tuple | str = "the exchange did not finish"
        # seconds of: reading Δ_p, sending it, waiting for G_p (the shepherd and the link), staging
        self.phases: tuple[float, ...] = ()

    async def run(self, snapshot: object) -> None:
        rounds, p = self.rounds, self.p
        marks = [time.perf_counter()]
        delta, sent = await trio.to_thread.run_sync(rounds.delta, p, snapshot)
        del snapshot
        marks.append(time.perf_counter())
        await self.sender.send(self.result, delta, quantization=rounds.plan.compression)
        del delta
        marks.append(time.perf_counter())
        update = await rounds.updates.take(self.number, p)
        marks.append(time.perf_counter())
        self._staged = await trio.to_thread.run_sync(rounds.prepare, p, update, sent)
        marks.append(time.perf_counter())
        self.phases = tuple(b - a for a, b in zip(marks, marks[1:], strict=False))
        self._done.set()

    async def staged(self) -> tuple | str:
        await self._done.wait()
        return self._staged


@dataclass
class Pauses:
    """Where one round's wall time went, as the training loop saw it."""

    round: int
    between: float  # from the last round's end to this round's start (waiting for roundStart)
    training: float = 0.0
    sends: float = 0.0  # taking the fragments' snapshots
    waits: float = 0.0  # waiting for fragment updates (τ too short for the link)
    merges: float = 0.0
    slowest: tuple[float, ...] = ()  # the longest exchange's phases (see `Exchange.phases`)

    def exchange(self, phases: tuple[float, ...]) -> None:
        if sum(phases) > sum(self.slowest):
            self.slowest = phases

    def __str__(self) -> str:
        read, send, back, stage = self.slowest or (0.0,) * 4
        return (
            f"round {self.round}: training {self.training:.2f} s; the loop waited "
            f"{self.sends + self.waits + self.merges:.2f} s (snapshots {self.sends:.2f}, "
            f"fragment updates {self.waits:.2f}, merges {self.merges:.2f}), and "
            f"{self.between:.2f} s for the round to start; the slowest exchange took "
            f"{sum(self.slowest):.2f} s (reading Δ {read:.2f}, sending it {send:.2f}, "
            f"the update back {back:.2f}, staging it {stage:.2f})"
        )
