"""The worker: trains its shard with the graphs the shepherd's plan ships.

It runs no model code and unpickles nothing: everything it executes is a
`jax.export` artifact from the plan. `Worker` is a `session.Session` (the
connection, handshake, receive loop and reconnects) that loads and compiles
the plan and trains the rounds it is handed. Compute, device transfers and
the checks of a round's parameters run in threads (`trio.to_thread`), so
heartbeats and progress keep flowing while they run.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import trio

from pcp_tui import protocol
from pcp_tui.backends import Backend, GraphError, UntrustedGraph, select_backend, signature
from pcp_tui.config import WorkerConfig
from pcp_tui.contract import plan as contract
from pcp_tui.contract.checks import expected_shapes, graphs_problem, round_start_problem
from pcp_tui.contract.connection import (
    LINK_ERRORS,
    Connection,
    ConnectionLost,
    IdInUse,
    Refused,
)
from pcp_tui.contract.tls import ClientTLS
from pcp_tui.contract.trace import MessageTrace
from pcp_tui.training import shards
from pcp_tui.training.sharding import LayoutError
from pcp_tui.worker.mesh import GraphLayouts
from pcp_tui.worker.session import CannotRun, Session, WorkerStatus
from pcp_tui.worker.stats import WorkerCounters
from pcp_tui.worker.streaming import StreamingRounds

# the names callers import from here; the connection's live in worker/session.py
__all__ = [
    "CannotRun",
    "ConnectionLost",
    "IdInUse",
    "Refused",
    "Training",
    "Worker",
    "WorkerStatus",
]

PROGRESS_INTERVAL = 0.25  # seconds between progress messages, at most
log = logging.getLogger(__name__)  # --log-level, --log-file (worker/session.py logs here too)


@dataclass
class Training:
    """The received plan as this worker runs it: the plan itself, its shard, its compiled graphs."""

    plan: protocol.Plan
    shard: np.ndarray | tuple[np.ndarray, ...]  # token windows, or row-indexed arrays
    train_chunk: Callable
    init_opt_state: Callable
    param_axes: tuple | None = None  # on a worker of several devices: see worker.mesh


class Worker(Session):
    """A worker: a session to the shepherd that compiles the plan and trains its rounds."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        backend: Backend | None = None,
        tls: ClientTLS | None = None,
        trace: MessageTrace | None = None,
        max_backoff: float = 30.0,
    ):
        """A worker with `config`'s settings; `config.connection.token` must be set.

        `backend` overrides `config.compute.backend` with one already built;
        `tls` and `trace` are built from the config by the caller (`launch.run_worker`),
        which turns their errors into exit codes.
        """
        compute = config.compute
        backend = backend or select_backend(
            compute.backend,
            compute.device_count,
            runtime=compute.runtime,
            cache_dir=compute.compile_cache or None,
            iree_flags=tuple(shlex.split(compute.iree_flags)),
        )
        super().__init__(config, backend, tls=tls, trace=trace, max_backoff=max_backoff)
        self.counters = WorkerCounters(self.backend)  # steps, tokens, memory: sent with progress
        self._plan: Training | None = None
        self.run_id: str | None = None  # the run the per-run state below belongs to
        self._opt_state = None  # the inner optimizer's, kept across reconnects to one run
        self._compiled: dict[bytes, tuple[Callable, Callable, tuple | None]] = {}
        self._streaming: StreamingRounds | None = None  # the plan names fragments

    def _enter_run(self, run_id: str) -> None:
        """Keep the per-run state (the inner optimizer's) only for the run it belongs to.

        A shepherd resumed from its checkpoint keeps its run id; one started afresh
        has a new one, and AdamW moments from another run would steer this one.
        """
        if run_id == self.run_id:
            if self._opt_state is not None:
                log.info("back in run %s: keeping the inner optimizer state", run_id)
            return
        if self.run_id is not None:
            log.info(
                "joined run %s (was run %s): starting with a fresh inner optimizer state",
                run_id,
                self.run_id,
            )
        self.run_id, self._opt_state = run_id, None

    async def _compile(self, connection: Connection, plan_message: protocol.Message) -> None:
        started = time.perf_counter()
        self._plan = await trio.to_thread.run_sync(self._load_plan, plan_message)
        seconds = time.perf_counter() - started
        await connection.send(
            protocol.Ready(seconds, protocol.Platform(self.backend.info.platform))
        )
        stats = self.counters.snapshot()  # memory after compiling, before any round
        await connection.send(protocol.Progress(phase=protocol.Phase.IDLE, stats=stats))
        self.status.update(
            state="idle", message=f"compiled in {seconds:.1f} s; waiting for a round"
        )

    def _deliver_fragment_update(self, message: protocol.Message) -> None:
        if self._streaming is None:
            raise protocol.MalformedMessage("a fragmentUpdate, but the plan has no fragments")
        self._streaming.updates.deliver(message)

    def _load_plan(self, message: protocol.Message) -> Training:
        plan, tensors = message.body, message.tensors
        problem = contract.plan_problem(plan, tensors)
        if problem is not None:
            raise protocol.MalformedMessage(problem)
        try:
            _, shard = shards.shard_from_plan(plan, tensors)
        except shards.DataError as exc:
            raise protocol.MalformedMessage(str(exc)) from None
        graphs = {g.name: tensors[g.tensor].tobytes() for g in plan.graphs}
        try:  # before anything is compiled or allocated for it, also for a compiled graph
            signatures = {name: signature(name, graphs[name]) for name in contract.GRAPHS}
        except GraphError as exc:
            raise protocol.MalformedMessage(str(exc)) from None
        problem = graphs_problem(plan, tensors, signatures)
        if problem is not None:
            raise protocol.MalformedMessage(problem)
        key = graphs["train_chunk"] + graphs["init_opt_state"]
        if key not in self._compiled:  # a reconnect to the same run reuses compiled graphs
            layouts = self._layouts(plan)
            try:
                train = self._load(graphs, "train_chunk", layouts, donate_argnums=(0, 1))
                init = self._load(graphs, "init_opt_state", layouts)
            except LayoutError as exc:
                raise protocol.MalformedMessage(str(exc)) from None
            except UntrustedGraph as exc:  # final: the worker says why and exits
                raise CannotRun(str(exc)) from None
            except GraphError as exc:
                info = self.backend.info
                raise CannotRun(
                    f"{exc}; this worker runs {info.describe()} ({info.runtime}): "
                    "try another --runtime or --backend"
                ) from None
            axes = layouts.param_axes if layouts is not None else None
            self._compiled = {key: (train.call, init.call, axes)}
            self._opt_state = None
        train_chunk, init_opt_state, axes = self._compiled[key]
        self._streaming = StreamingRounds(self, plan) if plan.fragments else None
        return Training(plan, shard, train_chunk, init_opt_state, axes)

    def _layouts(self, plan: protocol.Plan) -> GraphLayouts | None:
        """Where the graphs' arrays go on this worker's devices; None with one device."""
        devices = self.backend.info.device_count
        if devices == 1:
            return None
        try:
            return GraphLayouts(plan, devices)
        except LayoutError as exc:  # this worker's --devices cannot run this run's batches
            raise Refused(str(exc)) from None

    def _load(self, graphs: dict[str, bytes], name: str, layouts: GraphLayouts | None, **options):
        if layouts is not None:  # only then: a one-device backend need not know layouts
            options["layout"] = layouts.of(name)
        return self.backend.load(name, graphs[name], **options)

    async def _train_rounds(
        self, connection: Connection, rounds: trio.MemoryReceiveChannel
    ) -> None:
        with contextlib.suppress(*LINK_ERRORS):  # the receive loop reports a broken link
            async for message in rounds:
                await self._train_round(connection, message)

    async def refuse(self, connection: Connection, reason: str) -> None:
        """A broken or tampered shepherd: say why and hang up (the receive loop sees it)."""
        self.status.update(message=f"refused: {reason}")
        await connection.send(protocol.Error(protocol.ErrorCode.MALFORMED, reason))
        await connection.stream.aclose()

    async def _train_round(self, connection: Connection, message: protocol.Message) -> None:
        if self._streaming is not None:  # Streaming DiLoCo: worker/streaming.py
            await self._streaming.train_round(connection, message)
            return
        training, plan = self._plan, self._plan.plan
        problem = await trio.to_thread.run_sync(self._round_start_problem, message.tensors)
        if problem is not None:
            await self.refuse(connection, f"roundStart refused: {problem}")
            return
        number = message.body.round
        steps = message.body.inner_steps or plan.inner_steps
        started = time.perf_counter()
        params, kept = await trio.to_thread.run_sync(self._upload, message.tensors)
        if self._opt_state is None:
            self._opt_state = await trio.to_thread.run_sync(training.init_opt_state, tuple(params))
        self.status.update(state="training", round=number, step=0, total_steps=steps, message="")
        params, losses = await self._train_chunks(connection, number, steps, params, started)
        compute = time.perf_counter() - started
        self.status.update(state="syncing")
        difference = await trio.to_thread.run_sync(self.backend.difference, kept, params)
        del params, kept
        result = protocol.RoundResult(
            round=number,
            tokens=len(losses) * plan.batch_size * plan.tokens_per_row,
            losses=tuple(losses),
            compute_seconds=compute,
            inner_steps=len(losses),
        )
        await connection.send(
            result,
            dict(zip(plan.param_names, difference, strict=True)),
            quantization=plan.compression,
        )
        self.status.update(state="idle")

    def _round_start_problem(self, tensors: dict[str, np.ndarray]) -> str | None:
        names = self._plan.plan.param_names
        return round_start_problem(
            tensors, names, expected_shapes(self._plan.init_opt_state, names)
        )

    def _upload(self, tensors: dict[str, np.ndarray]) -> tuple[list, object]:
        """The round's parameters on the device (donated to training) and θ kept for Δ = θ − θ_k."""
        host = [np.asarray(tensors[n], np.float32) for n in self._plan.plan.param_names]
        axes = self._plan.param_axes
        params = (
            self.backend.to_device(host) if axes is None else self.backend.to_device(host, axes)
        )
        return params, self.backend.keep(host, params)

    async def _train_chunks(
        self,
        connection: Connection,
        number: int,
        steps: int,
        params: list,
        started: float,
        chunks: range | None = None,
    ) -> tuple[list, list[float]]:
        """Run the round's inner steps chunk by chunk, reporting progress; (params, losses).

        `chunks`: which of the round's chunks (streaming trains a round in parts; then
        a progress message that would wait behind a fragment upload is skipped).
        """
        training, plan = self._plan, self._plan.plan
        opt_state = self._opt_state
        self._opt_state = None  # donated to the chunks below; set again when they are done
        losses: list[float] = []
        last_progress = 0.0
        streaming = chunks is not None
        chunks = chunks if streaming else range(max(steps // plan.chunk_steps, 1))
        done_before = chunks.start * plan.chunk_steps
        for chunk in chunks:
            batches = shards.sample_shard(
                plan.batch_kind,
                training.shard,
                steps=plan.chunk_steps,
                batch_size=plan.batch_size,
                seq_len=plan.seq_len,
                seed=plan.seed,
                stream=(self.status.worker_index, number, chunk),  # unique per worker and chunk
            )
            # the run's step: rounds are H steps apart in the schedule, however many this one has
            first_step = (number - 1) * plan.inner_steps + chunk * plan.chunk_steps
            params, opt_state, chunk_losses = await trio.to_thread.run_sync(
                _run_chunk, training.train_chunk, params, opt_state, batches, first_step
            )
            losses.extend(float(x) for x in chunk_losses)
            self.counters.trained(
                len(chunk_losses), len(chunk_losses) * plan.batch_size * plan.tokens_per_row
            )
            elapsed = time.perf_counter() - started
            tps = len(losses) * plan.batch_size * plan.tokens_per_row / elapsed
            self.status.update(
                step=done_before + len(losses), loss=losses[-1], tokens_per_second=tps
            )
            now = time.monotonic()
            if not math.isfinite(losses[-1]):
                continue  # a diverged loss is for the round result (the shepherd refuses it)
            if streaming and connection.stream.sending:
                continue  # a fragment is uploading: training does not wait for a progress line
            if now - last_progress >= PROGRESS_INTERVAL or chunk == chunks[-1]:
                last_progress = now
                progress = protocol.Progress(
                    number,
                    done_before + len(losses),
                    steps,
                    losses[-1],
                    tps,
                    protocol.Phase.TRAINING,
                    self.counters.snapshot(),
                )
                await connection.send(progress)
        self._opt_state = opt_state
        return params, losses


def _run_chunk(train_chunk: Callable, params, opt_state, batches: np.ndarray, first_step: int):
    params, opt_state, losses = train_chunk(
        tuple(params), tuple(opt_state), batches, np.int32(first_step)
    )
    return list(params), list(opt_state), np.asarray(losses)  # np.asarray waits for the device
