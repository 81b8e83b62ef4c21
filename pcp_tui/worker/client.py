"""The worker: joins a shepherd, compiles the shipped graphs, trains its shard.

It runs no model code and unpickles nothing: everything it executes is a
`jax.export` artifact from the plan. Compute, device transfers and the checks
of a round's parameters run in threads (`trio.to_thread`), so heartbeats and
progress keep flowing while they run.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import platform as host_platform
import secrets
import shlex
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import trio

from pcp_tui import __version__, protocol
from pcp_tui.backends import Backend, GraphError, select_backend
from pcp_tui.config import WorkerConfig
from pcp_tui.contract import auth
from pcp_tui.contract import plan as contract
from pcp_tui.contract.checks import expected_shapes, round_start_problem
from pcp_tui.contract.connection import (
    LINK_ERRORS,
    Connection,
    ConnectionEnded,
    ConnectionLost,
    IdInUse,
    Refused,
    RunOver,
    RunResumable,
    ended_by,
    expect_hello,
    goodbye_ended,
)
from pcp_tui.contract.connection import expect as _expect
from pcp_tui.contract.tls import ClientTLS, TLSRefused
from pcp_tui.contract.trace import MessageTrace
from pcp_tui.training import shards
from pcp_tui.training.sharding import LayoutError
from pcp_tui.worker import striping
from pcp_tui.worker.mesh import GraphLayouts
from pcp_tui.worker.reconnect import Reconnect, connect_failure
from pcp_tui.worker.stats import WorkerCounters
from pcp_tui.worker.streaming import StreamingRounds

PROGRESS_INTERVAL = 0.25  # seconds between progress messages, at most
MIN_HEARTBEAT_SECONDS, MAX_HEARTBEAT_SECONDS = 0.05, 60.0  # what a welcome may set
log = logging.getLogger(__name__)  # connection-level diagnostics (--log-level, --log-file)


class CannotRun(Refused):
    """This worker cannot compile or run the plan's graphs: it tells the shepherd and leaves.

    Reconnecting would fetch the same graphs and fail the same way.
    """

    def __init__(self, reason: str):
        super().__init__(reason, code=protocol.ErrorCode.UNSUPPORTED_BACKEND.value)


@dataclass
class WorkerStatus:
    """What the worker's own status line shows."""

    state: str = "connecting"
    shepherd: str = ""
    worker_index: int | None = None
    round: int = 0
    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    tokens_per_second: float = 0.0
    message: str = ""
    listeners: list[Callable[[WorkerStatus], None]] = field(default_factory=list, repr=False)

    def update(self, **changes) -> None:
        for key, value in changes.items():
            setattr(self, key, value)
        for listener in self.listeners:
            listener(self)


@dataclass
class Training:
    """The received plan as this worker runs it: the plan itself, its shard, its compiled graphs."""

    plan: protocol.Plan
    shard: np.ndarray | tuple[np.ndarray, ...]  # token windows, or row-indexed arrays
    train_chunk: Callable
    init_opt_state: Callable
    param_axes: tuple | None = None  # on a worker of several devices: see worker.mesh


class Worker:
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
        connection = config.connection
        host, port = connection.address
        self.host, self.port, self.token = host, port, connection.token
        self.trace = trace  # --trace: every message to and from the shepherd
        self.tls = tls  # None: plain TCP
        compute = config.compute
        self.backend = backend or select_backend(
            compute.backend,
            compute.device_count,
            runtime=compute.runtime,
            cache_dir=compute.compile_cache or None,
            iree_flags=tuple(shlex.split(compute.iree_flags)),
        )
        self.counters = WorkerCounters(self.backend)  # steps, tokens, memory: sent with progress
        self.worker_id = connection.worker_id or (
            f"{host_platform.node() or 'worker'}-{os.getpid()}-{secrets.token_hex(2)}"
        )
        self.reconnect = Reconnect(  # give_up_after: seconds of trying to get (back) in
            give_up_after=connection.give_up_after,
            max_backoff=max_backoff,
            retry=connection.reconnect,
            on_wait=self._show_wait,
        )
        self.status = WorkerStatus(shepherd=f"{host}:{port}")
        self.heartbeat_seconds = 2.0  # the welcome says the run's interval
        self.heartbeat_timeout = 30.0
        self._plan: Training | None = None
        self.run_id: str | None = None  # the run the per-run state below belongs to
        self._opt_state = None  # the inner optimizer's, kept across reconnects to one run
        self._compiled: dict[bytes, tuple[Callable, Callable, tuple | None]] = {}
        self._streaming: StreamingRounds | None = None  # the plan names fragments

    async def run(self) -> None:
        """Train until the shepherd says goodbye. Raises Refused on a final refusal.

        Raises ConnectionLost once --give-up-after seconds of trying to get in (or
        back in, counted from the loss of an admitted connection) pass without a
        welcome: see `Reconnect`.
        """
        lost = False
        while not await self.reconnect.run(self._attempt, pause_first=lost):
            lost = True  # an admitted connection was lost: a fresh budget to get back

    async def _attempt(self, deadline: float) -> bool:
        """One connection: True once the run is over, False when it was lost after a
        welcome; ConnectionLost when it failed before one (`deadline` bounds that part)."""
        stream = await self._connect(deadline)
        messages = protocol.MessageStream(stream)
        if self.trace is not None:
            messages.observer = self.trace.observer(f"{self.host}:{self.port}")
        try:
            await self._join(messages, deadline)  # a ConnectionLost here is retried in the budget
            await self._session(messages)
        except RunOver:
            log.info("the shepherd ended the run")
            self.status.update(state="done", message="the shepherd ended the run")
            return True
        except _LostAfterWelcome as exc:
            if isinstance(exc.__cause__, RunResumable):
                return self._shepherd_stopped(exc.__cause__)
            log.info("connection to %s:%d lost: %s", self.host, self.port, exc.__cause__)
            if not self.reconnect.retry:
                raise ConnectionLost(str(exc)) from exc
            self.status.update(state="connecting", message=str(exc))
            return False
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)
                await trio.aclose_forcefully(messages.stream)  # all of them, when striped

    def _shepherd_stopped(self, stopped: RunResumable) -> bool:
        """The shepherd stopped before the run's end and can resume it: True (done) only
        with --no-reconnect, else False: reconnect, as after a lost connection."""
        if not self.reconnect.retry:
            log.info("%s; the run can be resumed, but --no-reconnect: exiting", stopped)
            self.status.update(state="done", message=f"{stopped}; not reconnecting")
            return True
        message = f"{stopped}; the run can be resumed: reconnecting"
        log.info("%s", message)
        self.status.update(state="connecting", message=message)
        return False

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

    async def _connect(self, deadline: float) -> trio.abc.Stream:
        """A TCP (or TLS) stream to the shepherd, or ConnectionLost (Refused: TLS)."""
        self.status.update(state="connecting", message=f"connecting to {self.host}:{self.port}")
        return await self._open(deadline)

    async def _open(self, deadline: float) -> trio.abc.Stream:
        try:
            with trio.fail_at(deadline):
                stream = await trio.open_tcp_stream(self.host, self.port)
                if self.tls is not None:
                    stream = await self.tls.connect(stream, self.host)
                return stream
        except TLSRefused as exc:
            raise Refused(str(exc)) from None
        except socket.gaierror as exc:
            raise ConnectionLost(
                f"the shepherd's name {self.host!r} did not resolve ({exc.strerror})"
            ) from None
        except (OSError, trio.TooSlowError) as exc:
            why = "timed out" if isinstance(exc, trio.TooSlowError) else connect_failure(exc)
            raise ConnectionLost(f"cannot reach {self.host}:{self.port} ({why})") from None

    async def _join(self, stream: protocol.MessageStream, deadline: float) -> None:
        """The handshake, until the welcome; ConnectionLost to retry, Refused if final."""
        try:
            with trio.fail_at(deadline):
                await self._handshake(stream)
        except trio.TooSlowError:
            raise ConnectionLost(
                f"connection lost (no welcome from {self.host}:{self.port} in time)"
            ) from None
        except IdInUse as exc:
            if self.status.worker_index is None:  # never admitted: a twin, not a reconnect
                raise
            raise ConnectionLost(str(exc)) from None
        except protocol.VersionMismatch as exc:
            raise Refused(str(exc)) from None
        except (ConnectionLost, *LINK_ERRORS) as exc:
            raise ConnectionLost(f"connection lost ({exc})") from None

    def _show_wait(self, reason: str, seconds: float) -> None:
        self.status.update(state="connecting", message=f"{reason}; retrying in {seconds:.1f} s")

    async def _session(self, stream: protocol.MessageStream) -> None:
        """One admitted connection, from the plan to the goodbye; always ends by raising why.

        RunOver when the shepherd ends the run, ConnectionLost when the link breaks
        or goes silent, Refused when the shepherd turns this worker away for good.
        """
        connection = Connection(stream, "worker", log=log)
        ended: ConnectionEnded | None = None
        try:
            async with connection.alive(
                heartbeat_seconds=self.heartbeat_seconds, timeout=self.heartbeat_timeout
            ) as tasks:
                plan_message = await _expect(connection, "plan")
                connection.stage = contract.Stage.READY
                self.status.update(state="compiling", message="compiling the training graph")
                with connection.paused():  # compiling does not read the socket: not silence
                    await self._compile(connection, plan_message)
                rounds_out, rounds_in = trio.open_memory_channel(1)
                tasks.start_soon(self._train_rounds, connection, rounds_in)
                await self._receive_loop(connection, rounds_out)
        except ConnectionLost as exc:
            ended = exc
            raise _LostAfterWelcome(f"connection lost ({exc})") from exc
        except ConnectionEnded as exc:
            ended = exc
            raise
        finally:
            with trio.CancelScope(shield=True):  # tells the shepherd what it sent wrong, if it did
                lost = ended if isinstance(ended, ConnectionLost | CannotRun) else None
                await connection.close(str(ended or "the worker stopped"), error=lost)
        raise _LostAfterWelcome("connection lost (the session ended)")

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

    async def _handshake(self, stream: protocol.MessageStream) -> None:
        self.status.update(state="connecting", message="handshake")
        hello = await expect_hello(stream, f"{self.host}:{self.port}")
        await stream.send(self._hello(hello.body.nonce))
        welcome = await _expect(stream, "welcome")
        interval = welcome.body.heartbeat_seconds  # the run's; a broken shepherd's is bounded
        self.heartbeat_seconds = min(max(interval, MIN_HEARTBEAT_SECONDS), MAX_HEARTBEAT_SECONDS)
        self.heartbeat_timeout = max(10.0, 10 * self.heartbeat_seconds)
        log.info(
            "admitted by %s:%d (heartbeat every %g s)", self.host, self.port, self.heartbeat_seconds
        )
        self._enter_run(welcome.body.run_id)
        self.status.update(worker_index=welcome.body.worker_index, message="admitted")
        if welcome.body.streams > 1:
            await striping.attach(self, stream, welcome.body)

    def _hello(
        self, nonce: bytes, *, attach_index: int = 0, session_key: bytes = b""
    ) -> protocol.WorkerHello:
        """This worker's hello for a connection whose challenge is `nonce`; with `attach_index`,
        for extra connection `attach_index` of the session that got `session_key`."""
        info = self.backend.info
        backend = protocol.BackendInfo(
            platform=protocol.Platform(info.platform),
            device_kind=info.device_kind[: protocol.ID_CHARS],
            device_count=info.device_count,
            memory_bytes=info.memory_bytes,
            jax_version=info.jax_version,
            runtime=protocol.Runtime(info.runtime),
            target=info.target[: protocol.ID_CHARS],
        )
        return protocol.WorkerHello(
            supported_versions=protocol.SUPPORTED_VERSIONS,
            worker_id=self.worker_id,
            hostname=host_platform.node()[: protocol.ID_CHARS],
            backend=backend,
            proof=auth.proof(self.token, nonce, self.worker_id),
            software=f"pcp-tui {__version__}",
            attach_index=attach_index,
            attach_proof=(
                auth.attach_proof(session_key, nonce, self.worker_id, attach_index)
                if attach_index
                else b""
            ),
        )

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
        key = graphs["train_chunk"] + graphs["init_opt_state"]
        if key not in self._compiled:  # a reconnect to the same run reuses compiled graphs
            layouts = self._layouts(plan)
            try:
                train = self._load(graphs, "train_chunk", layouts, donate_argnums=(0, 1))
                init = self._load(graphs, "init_opt_state", layouts)
            except LayoutError as exc:
                raise protocol.MalformedMessage(str(exc)) from None
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

    async def _receive_loop(self, connection: Connection, rounds: trio.MemorySendChannel) -> None:
        """Hand round starts to the training task; end on the shepherd's goodbye or error.

        The connection refuses kinds out of turn (`contract.RECEIVES`) from their header.
        """
        while True:
            message = await connection.receive()
            body = message.body
            if isinstance(body, protocol.RoundStart):
                await rounds.send(message)
            elif isinstance(body, protocol.FragmentUpdate):  # Streaming DiLoCo
                if self._streaming is None:
                    raise protocol.MalformedMessage(
                        "a fragmentUpdate, but the plan has no fragments"
                    )
                self._streaming.updates.deliver(message)
            elif isinstance(body, protocol.Goodbye):
                raise goodbye_ended(body)
            elif isinstance(body, protocol.Error):
                if body.code == protocol.ErrorCode.BAD_RESULT:
                    self.status.update(message=f"shepherd refused a result: {body.message}")
                    continue
                raise ended_by(body)

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


class _LostAfterWelcome(Exception):
    """An admitted connection was lost: the worker gets a fresh budget to come back."""


def _run_chunk(train_chunk: Callable, params, opt_state, batches: np.ndarray, first_step: int):
    params, opt_state, losses = train_chunk(
        tuple(params), tuple(opt_state), batches, np.int32(first_step)
    )
    return list(params), list(opt_state), np.asarray(losses)  # np.asarray waits for the device
