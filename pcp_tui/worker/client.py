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
import random
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import trio

from pcp_tui import __version__, protocol
from pcp_tui.backends import Backend, GraphError, select_backend
from pcp_tui.contract import auth
from pcp_tui.contract import plan as contract
from pcp_tui.contract.checks import expected_shapes, round_start_problem
from pcp_tui.contract.tls import ClientTLS, TLSRefused
from pcp_tui.contract.trace import MessageTrace
from pcp_tui.training import shards
from pcp_tui.worker.streaming import StreamingRounds

PROGRESS_INTERVAL = 0.25  # seconds between progress messages, at most
_LINK_ERRORS = (protocol.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError)
log = logging.getLogger(__name__)  # connection-level diagnostics (--log-level, --log-file)


class Refused(Exception):
    """The shepherd turned this worker away for good: do not retry."""


class IdInUse(Refused):
    """Another live connection holds this worker's id.

    Final for a worker that was never admitted (two workers started with one --id);
    a worker that was admitted before retries, as the live connection is likely its
    own, cut off, until the shepherd notices it is silent.
    """


class RunOver(Exception):
    """The shepherd said goodbye: the run is finished."""


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


class Worker:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str,
        backend: str | Backend = "auto",
        worker_id: str | None = None,
        reconnect: bool = True,
        max_backoff: float = 30.0,
        give_up_after: float = 1800.0,
        tls: ClientTLS | None = None,
        trace: MessageTrace | None = None,
    ):
        self.host, self.port, self.token = host, port, token
        self.trace = trace  # --trace: every message to and from the shepherd
        self.tls = tls  # None: plain TCP
        self.backend = select_backend(backend) if isinstance(backend, str) else backend
        self.worker_id = (
            worker_id or f"{host_platform.node() or 'worker'}-{os.getpid()}-{secrets.token_hex(2)}"
        )
        self.reconnect = reconnect
        self.max_backoff = max_backoff
        self.give_up_after = give_up_after  # seconds without being admitted before exiting
        self._last_contact = time.monotonic()  # of a welcome (or the start); see _backoff
        self._attempts = 0  # failed connects or sessions since then
        self._admitted = False  # the current session got its welcome
        self.status = WorkerStatus(shepherd=f"{host}:{port}")
        self.heartbeat_seconds = 2.0  # the welcome says the run's interval
        self.heartbeat_timeout = 30.0
        self._plan: Training | None = None
        self._opt_state = None
        self._compiled: dict[bytes, tuple[Callable, Callable]] = {}
        self._streaming: StreamingRounds | None = None  # the plan names fragments

    async def run(self) -> None:
        """Train until the shepherd says goodbye. Raises Refused on a final refusal.

        Raises ConnectionLost once --give-up-after seconds pass without the
        shepherd admitting this worker (see `_backoff`).
        """
        self._last_contact = time.monotonic()
        while True:
            try:
                stream = await trio.open_tcp_stream(self.host, self.port)
                if self.tls is not None:
                    stream = await self.tls.connect(stream, self.host)
            except TLSRefused as exc:
                raise Refused(str(exc)) from None
            except socket.gaierror as exc:
                await self._backoff(
                    f"the shepherd's name {self.host!r} did not resolve ({exc.strerror})"
                )
                continue
            except OSError as exc:
                await self._backoff(f"cannot reach {self.host}:{self.port} ({exc.strerror or exc})")
                continue
            self._admitted = False
            try:
                messages = protocol.MessageStream(stream)
                if self.trace is not None:
                    messages.observer = self.trace.observer(f"{self.host}:{self.port}")
                await self._session(messages)
            except RunOver:
                log.info("the shepherd ended the run")
                self.status.update(state="done", message="the shepherd ended the run")
                return
            except IdInUse as exc:
                if self.status.worker_index is None:  # never admitted: a twin, not a reconnect
                    raise
                await self._backoff(str(exc))
            except protocol.VersionMismatch as exc:
                raise Refused(str(exc)) from None
            except (ConnectionLost, *_LINK_ERRORS) as exc:
                log.info("connection to %s:%d lost: %s", self.host, self.port, exc)
                if self._admitted:  # the link was useful until now: a fresh budget and back-off
                    self._last_contact, self._attempts = time.monotonic(), 0
                await self._backoff(f"connection lost ({exc})")
            finally:
                with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
                    await stream.aclose()

    async def _backoff(self, reason: str) -> None:
        """Wait before the next attempt, or raise ConnectionLost once the budget is spent.

        The budget (`give_up_after`) runs from the last welcome, not the last TCP
        connect: a shepherd that accepts and then drops or refuses every
        connection must not keep a worker retrying forever. The wait doubles
        with each failed attempt (about 1, 2, 4 ... s, up to `max_backoff`),
        jittered so that workers cut off together do not return together.
        """
        if not self.reconnect:
            raise ConnectionLost(reason)
        self._attempts += 1
        cut_off = time.monotonic() - self._last_contact
        if cut_off >= self.give_up_after:
            raise ConnectionLost(
                f"{reason}; gave up after {cut_off:.0f} s of retrying without a welcome "
                "(the run may have ended while this worker was cut off; --give-up-after sets the limit)"
            )
        delay = min(self.max_backoff, 0.5 * 2 ** min(self._attempts, 8))
        delay = min(delay * random.uniform(0.5, 1.0), self.give_up_after - cut_off)
        log.info("%s; retrying in %.1f s (attempt %d)", reason, delay, self._attempts)
        self.status.update(state="connecting", message=f"{reason}; retrying in {delay:.1f} s")
        await trio.sleep(delay)

    async def _session(self, stream: protocol.MessageStream) -> None:
        """One connection, from handshake to goodbye; always ends by raising why."""
        await self._handshake(stream)
        plan_message = await _expect(stream, "plan")
        self.status.update(state="compiling", message="compiling the training graph")
        sender = _Sender(stream)
        silent: list[str] = []  # why the watchdog cancelled the session, if it did
        ended: BaseException | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._heartbeats, sender)
            try:
                await self._compile(sender, plan_message)
                rounds_out, rounds_in = trio.open_memory_channel(1)
                nursery.start_soon(self._train_rounds, sender, rounds_in)
                nursery.start_soon(self._watch_silence, stream, nursery.cancel_scope, silent)
                await self._receive_loop(stream, rounds_out)
            except (RunOver, Refused, ConnectionLost, *_LINK_ERRORS) as exc:
                ended = exc  # re-raised below, outside the nursery, so it is not wrapped in a group
            nursery.cancel_scope.cancel()
        if isinstance(ended, protocol.ProtocolError) and ended.code != "unknown":
            with trio.move_on_after(2):  # tell the shepherd what it sent wrong; it may be gone
                await stream.send_error(ended.code, str(ended))
        raise ended or ConnectionLost(silent[0] if silent else "the session ended")

    async def _compile(self, sender: _Sender, plan_message: protocol.Message) -> None:
        started = time.perf_counter()
        self._plan = await trio.to_thread.run_sync(self._load_plan, plan_message)
        seconds = time.perf_counter() - started
        await sender.send(protocol.Ready(seconds, protocol.Platform(self.backend.info.platform)))
        self.status.update(
            state="idle", message=f"compiled in {seconds:.1f} s; waiting for a round"
        )

    async def _handshake(self, stream: protocol.MessageStream) -> None:
        self.status.update(state="connecting", message="handshake")
        hello = await _expect(stream, "hello")
        info = self.backend.info
        backend = protocol.BackendInfo(
            platform=protocol.Platform(info.platform),
            device_kind=info.device_kind[: protocol.ID_CHARS],
            device_count=info.device_count,
            memory_bytes=info.memory_bytes,
            jax_version=info.jax_version,
        )
        await stream.send(
            protocol.WorkerHello(
                supported_versions=protocol.SUPPORTED_VERSIONS,
                worker_id=self.worker_id,
                hostname=host_platform.node()[: protocol.ID_CHARS],
                backend=backend,
                proof=auth.proof(self.token, hello.body.nonce, self.worker_id),
                software=f"pcp-tui {__version__}",
            )
        )
        welcome = await _expect(stream, "welcome")
        self._admitted = True
        self.heartbeat_seconds = welcome.body.heartbeat_seconds
        self.heartbeat_timeout = max(10.0, 10 * self.heartbeat_seconds)
        log.info(
            "admitted by %s:%d (heartbeat every %g s)", self.host, self.port, self.heartbeat_seconds
        )
        self.status.update(worker_index=welcome.body.worker_index, message="admitted")

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
            try:
                train = self.backend.load(
                    "train_chunk", graphs["train_chunk"], donate_argnums=(0, 1)
                )
                init = self.backend.load("init_opt_state", graphs["init_opt_state"])
            except GraphError as exc:
                raise protocol.MalformedMessage(str(exc)) from None
            self._compiled = {key: (train.call, init.call)}
            self._opt_state = None
        train_chunk, init_opt_state = self._compiled[key]
        self._streaming = StreamingRounds(self, plan) if plan.fragments else None
        return Training(plan, shard, train_chunk, init_opt_state)

    async def _receive_loop(
        self, stream: protocol.MessageStream, rounds: trio.MemorySendChannel
    ) -> None:
        while True:
            message = await stream.receive()
            body = message.body
            problem = contract.out_of_turn("worker", message.kind, contract.Stage.READY)
            if problem is not None:
                raise protocol.MalformedMessage(f"{problem} (from the shepherd)")
            if isinstance(body, protocol.RoundStart):
                await rounds.send(message)
            elif isinstance(body, protocol.FragmentUpdate):  # Streaming DiLoCo
                if self._streaming is None:
                    raise protocol.MalformedMessage(
                        "a fragmentUpdate, but the plan has no fragments"
                    )
                self._streaming.updates.deliver(message)
            elif isinstance(body, protocol.Goodbye):
                raise RunOver(body.reason)
            elif isinstance(body, protocol.Error):
                if body.code == protocol.ErrorCode.BAD_RESULT:
                    self.status.update(message=f"shepherd refused a result: {body.message}")
                    continue
                _raise_for(body)

    async def _watch_silence(
        self, stream: protocol.MessageStream, scope: trio.CancelScope, silent: list[str]
    ) -> None:
        """Cancel `scope` once no byte has come from the shepherd for `heartbeat_timeout`.

        Bytes, not messages: parameters for a large model over a slow link take
        minutes to arrive and are not silence.
        """
        since = time.monotonic()  # compiling does not read the socket: count from now
        while True:
            last = max(stream.last_activity, since)
            left = last + self.heartbeat_timeout - time.monotonic()
            if left <= 0:
                silent.append(f"the shepherd was silent for {self.heartbeat_timeout:.0f} s")
                scope.cancel()
                return
            await trio.sleep(left)

    async def _heartbeats(self, sender: _Sender) -> None:
        with contextlib.suppress(*_LINK_ERRORS):
            while True:
                sent = await sender.send(protocol.Heartbeat(time.time()))
                log.debug("sent heartbeat (%d bytes)", sent)
                await trio.sleep(self.heartbeat_seconds)  # the run's interval, from the welcome

    async def _train_rounds(self, sender: _Sender, rounds: trio.MemoryReceiveChannel) -> None:
        with contextlib.suppress(*_LINK_ERRORS):  # the receive loop reports a broken link
            async for message in rounds:
                await self._train_round(sender, message)

    async def refuse(self, sender: _Sender, reason: str) -> None:
        """A broken or tampered shepherd: say why and hang up (the receive loop sees it)."""
        self.status.update(message=f"refused: {reason}")
        await sender.send(protocol.Error(protocol.ErrorCode.MALFORMED, reason))
        await sender._stream.aclose()

    async def _train_round(self, sender: _Sender, message: protocol.Message) -> None:
        if self._streaming is not None:  # Streaming DiLoCo: worker/streaming.py
            await self._streaming.train_round(sender, message)
            return
        training, plan = self._plan, self._plan.plan
        problem = await trio.to_thread.run_sync(self._round_start_problem, message.tensors)
        if problem is not None:
            await self.refuse(sender, f"roundStart refused: {problem}")
            return
        number = message.body.round
        steps = message.body.inner_steps or plan.inner_steps
        started = time.perf_counter()
        params, kept = await trio.to_thread.run_sync(self._upload, message.tensors)
        if self._opt_state is None:
            self._opt_state = await trio.to_thread.run_sync(training.init_opt_state, tuple(params))
        self.status.update(state="training", round=number, step=0, total_steps=steps, message="")
        params, losses = await self._train_chunks(sender, number, steps, params, started)
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
        await sender.send(
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
        params = self.backend.to_device(host)
        return params, self.backend.keep(host, params)

    async def _train_chunks(
        self,
        sender: _Sender,
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
            elapsed = time.perf_counter() - started
            tps = len(losses) * plan.batch_size * plan.tokens_per_row / elapsed
            self.status.update(
                step=done_before + len(losses), loss=losses[-1], tokens_per_second=tps
            )
            now = time.monotonic()
            if not math.isfinite(losses[-1]):
                continue  # a diverged loss is for the round result (the shepherd refuses it)
            if streaming and sender.busy:
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
                )
                await sender.send(progress)
        self._opt_state = opt_state
        return params, losses


class ConnectionLost(Exception):
    """The link to the shepherd broke; the worker reconnects."""


class _Sender:
    """Serialises sends from the heartbeat, progress and result tasks."""

    def __init__(self, stream: protocol.MessageStream):
        self._stream = stream
        self._lock = trio.Lock()

    @property
    def busy(self) -> bool:
        """Whether a send is under way (e.g. a fragment's upload)."""
        return self._lock.locked()

    async def send(self, body: protocol.Body, tensors=None, **options) -> int:
        async with self._lock:
            return await self._stream.send(body, tensors, **options)


def _run_chunk(train_chunk: Callable, params, opt_state, batches: np.ndarray, first_step: int):
    params, opt_state, losses = train_chunk(
        tuple(params), tuple(opt_state), batches, np.int32(first_step)
    )
    return list(params), list(opt_state), np.asarray(losses)  # np.asarray waits for the device


async def _expect(stream: protocol.MessageStream, kind: str) -> protocol.Message:
    message = await stream.receive()
    if message.kind == kind:
        return message
    if isinstance(message.body, protocol.Error):
        _raise_for(message.body)
    raise protocol.MalformedMessage(f"expected {kind} from the shepherd, got {message.kind}")


# The shepherd will say the same again on every reconnect: stop and tell the person why.
_FINAL_ERRORS = frozenset(
    {
        protocol.ErrorCode.AUTH_FAILED,
        protocol.ErrorCode.VERSION_MISMATCH,
        protocol.ErrorCode.UNSUPPORTED_BACKEND,
    }
)


def _raise_for(error: protocol.Error):
    """Refused for an error that reconnecting cannot fix, else ConnectionLost (reconnect)."""
    if error.code == protocol.ErrorCode.ID_IN_USE:
        raise IdInUse(f"the shepherd refused this worker ({error.code.value}): {error.message}")
    if error.code in _FINAL_ERRORS:
        raise Refused(f"the shepherd refused this worker ({error.code.value}): {error.message}")
    raise ConnectionLost(f"the shepherd reported an error ({error.code.value}): {error.message}")
