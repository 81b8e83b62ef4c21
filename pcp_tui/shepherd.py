"""The shepherd: admits workers, ships the plan, runs DiLoCo rounds.

It is a plain trio program. Headless mode runs it under `trio.run`; the
dashboard hosts the very same object in Textual's loop via trio guest mode and
only reads `shepherd.state` and calls `request_stop` / `pause` / `resume`.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import time
from collections.abc import Mapping

import numpy as np
import trio

import protocol
from backends import select_backend

from . import checkpoint, data, tls
from .admission import Admission
from .config import RunConfig
from .diloco import OuterOptimizer
from .graph import CUDNN_ATTENTION_CALLS, InnerOptimizer, TrainingGraphs, build_graphs
from .links import WorkerLink, WorkerLost
from .rounds import BadResult, Round, check_pseudo_gradient
from .screening import NormGuard, check_token_count
from .state import RoundRecord, RunState, WorkerView
from .task import Task

_CONNECTION_ERRORS = (protocol.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError)


class RunFailed(RuntimeError):
    """The run cannot go on; the message is the one-line reason."""


class Shepherd:
    def __init__(self, config: RunConfig, task: Task, *, state: RunState | None = None):
        self.config = config.validate()
        self.task = task
        self.token = config.token
        if not self.token:
            raise ValueError("the shepherd needs a join token (RunConfig.token)")
        self.run_id = secrets.token_hex(4)
        self.state = state or RunState(
            run_id=self.run_id, rounds_total=config.rounds, settings=_settings(config)
        )
        self.state.model_name = task.name
        self.state.param_count = task.param_count
        self.params: dict[str, np.ndarray] = dict(task.params)
        self.outer = OuterOptimizer(config.outer_optimizer, config.outer_lr, config.outer_momentum)
        self.graphs: TrainingGraphs | None = None
        self._shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        self._links: dict[str, WorkerLink] = {}
        self._round: Round | None = None
        self._changed = trio.Event()  # set whenever a worker becomes ready or goes away
        self._stop_reason: str | None = None
        self._failure: str | None = None
        self._paused = False
        self._resumed = trio.Event()
        self._eval = None
        self._next_index = 0
        self._known_indices: dict[str, int] = {}  # worker id -> index, from a checkpoint
        self._resumed_from: tuple[str, int] | None = None
        self.start_round = 1
        self.tls = (
            tls.ServerTLS.from_files(config.tls_cert, config.tls_key) if config.tls_cert else None
        )
        self._admission = Admission(
            self.state,
            token=self.token,
            run_id=self.run_id,
            tls=self.tls,
            timeout=config.handshake_timeout,
            max_per_host=config.max_handshakes_per_host,
            max_pending=config.max_handshakes,
        )
        self._norms = NormGuard()
        if config.resume:
            self._resume(config.resume)

    def _resume(self, directory: str) -> None:
        saved = checkpoint.load_latest(directory)
        if saved.meta.get("data_fingerprint") != self.task.corpus.fingerprint:
            raise checkpoint.CheckpointError(
                f"{saved.path} was trained on other data; resume with the same --data and --data-max-bytes"
            )
        shapes = {n: tuple(p.shape) for n, p in saved.params.items()}
        if shapes != self._shapes:
            raise checkpoint.CheckpointError(
                f"{saved.path} holds another model; resume with the same --model"
            )
        self.params = {n: np.asarray(p, np.float32) for n, p in saved.params.items()}
        self.outer.load_state_arrays(self.params, saved.outer_state)
        self.start_round = saved.round + 1
        self._known_indices = {str(k): int(v) for k, v in saved.meta.get("workers", {}).items()}
        self._next_index = max(self._known_indices.values(), default=-1) + 1
        self._resumed_from = (str(saved.path), saved.round)  # announced when the run starts

    # -- commands (safe to call from the dashboard) -------------------------

    def request_stop(self, reason: str = "stopped by the operator") -> None:
        """End the run after the current round; workers are told goodbye."""
        self._stop_reason = reason
        self._resumed.set()
        self._wake()

    def abort(self, reason: str) -> None:
        """End the run as failed (exit code non-zero) after the current round."""
        self._failure = reason
        self.request_stop(reason)

    def pause(self) -> None:
        self._paused = True
        self._resumed = trio.Event()
        self.state.emit("paused", "pausing after the current round")

    def resume(self) -> None:
        self._paused = False
        self._resumed.set()
        self.state.emit("resumed", "training resumed")

    # -- the run ------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> RunState:
        """Listen, train for `config.rounds` rounds, say goodbye. Raises RunFailed."""
        cfg = self.config
        if self._resumed_from:
            path, number = self._resumed_from
            self.state.emit("resumed_from", f"resumed from {path} (round {number})", round=number)
        self.state.emit("exporting", f"exporting training graphs for {', '.join(cfg.platforms)}")
        self.graphs = await trio.to_thread.run_sync(self._export)
        self.state.emit(
            "exported",
            f"graphs exported in {self.graphs.export_seconds:.1f} s",
            seconds=self.graphs.export_seconds,
        )
        try:
            listeners = await trio.open_tcp_listeners(cfg.port, host=cfg.host)
        except OSError as exc:
            raise RunFailed(
                f"cannot listen on {cfg.host}:{cfg.port} ({exc.strerror}); pick another --port"
            ) from None
        port = listeners[0].socket.getsockname()[1]
        shown_host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
        self.state.address = f"{shown_host}:{port}"
        self.state.join_command = " ".join(
            [
                "pcp-tui",
                "worker",
                "--connect",
                self.state.address,
                "--token",
                self.token,
                *(self.tls.worker_flags() if self.tls else []),
            ]
        )
        failure: RunFailed | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.serve_listeners, self._serve_connection, listeners)
                nursery.start_soon(self._admission.refusals.run)
                task_status.started(port)
                self.state.emit(
                    "listening",
                    f"listening on {self.state.address}; join with: {self.state.join_command}",
                )
                try:
                    await self._train()
                except RunFailed as exc:  # raised out of the nursery below, not as a group
                    failure = exc
                finally:
                    with trio.CancelScope(shield=True):
                        await self._goodbye_all(self._stop_reason or str(failure or "run finished"))
                    nursery.cancel_scope.cancel()
        finally:
            self.state.finished_at = time.monotonic()
        if failure is not None:
            self.state.status = "failed"
            self.state.emit("failed", str(failure))
            raise failure
        return self.state

    def _export(self) -> TrainingGraphs:
        cfg = self.config
        inner = InnerOptimizer(
            name=cfg.inner_optimizer,
            lr=cfg.inner_lr,
            warmup_steps=cfg.warmup_steps,
            decay_steps=cfg.rounds * cfg.inner_steps if cfg.inner_optimizer == "adamw" else 0,
            weight_decay=cfg.weight_decay,
            grad_clip=cfg.grad_clip,
        )
        graphs = build_graphs(
            self.task.loss_fn,
            self.params,
            self.task.batch_spec,
            inner=inner,
            chunk_steps=cfg.chunk,
            eval_batches=self.task.eval_batch_count,
            # cuDNN attention exists only on CUDA, and its kernels are custom calls
            platforms=("cuda",) if cfg.attention == "cudnn" else cfg.platforms,
            custom_calls=CUDNN_ATTENTION_CALLS if cfg.attention == "cudnn" else (),
        )
        backend = select_backend("auto")
        self._eval = backend.load("eval_loss", graphs.eval_loss)
        return graphs

    async def _train(self) -> None:
        cfg = self.config
        self.state.status = "waiting"
        await self._wait_for_workers(cfg.workers, f"waiting for {cfg.workers} worker(s)")
        number = self.start_round
        while number <= cfg.rounds and self._stop_reason is None:
            if self._paused:
                self.state.status = "paused"
                await self._resumed.wait()
                continue
            await self._wait_for_workers(1, "no worker is ready; waiting for one to join")
            if self._stop_reason is not None:
                break
            self.state.status = "training"
            record = await self._run_round(number)
            if record is None:
                self.state.emit(
                    "round_repeated", f"round {number} got no result; repeating it", round=number
                )
                continue
            if cfg.checkpoint_dir and number % cfg.checkpoint_every == 0:
                await self._checkpoint(number)
            number += 1
        if (
            cfg.checkpoint_dir
            and self.state.history
            and self.state.history[-1].round % cfg.checkpoint_every
        ):
            await self._checkpoint(self.state.history[-1].round)
        if self._failure:
            raise RunFailed(self._failure)
        self.state.status = "stopped" if self._stop_reason else "done"
        self.state.emit(
            "done",
            f"run {self.state.status} after {len(self.state.history)} rounds",
            rounds=len(self.state.history),
            final_eval_loss=_last_eval(self.state),
            seconds=self.state.elapsed(),
        )

    async def _checkpoint(self, number: int) -> None:
        """Save the run after round `number`; a failed write is reported, the run goes on."""
        meta = {
            "run_id": self.run_id,
            "model": self.task.name,
            "data_fingerprint": self.task.corpus.fingerprint,
            "config": {k: v for k, v in vars(self.config).items() if k != "token"},
            "data_positions": {"seed": self.config.seed, "next_round": number + 1},
            "workers": {worker_id: view.index for worker_id, view in self.state.workers.items()},
            "eval_loss": _last_eval(self.state),
        }
        try:
            path = await trio.to_thread.run_sync(
                lambda: checkpoint.save(
                    self.config.checkpoint_dir,
                    round=number,
                    params=self.params,
                    outer_state=self.outer.state_arrays(),
                    meta=meta,
                )
            )
        except checkpoint.CheckpointError as exc:
            self.state.emit("checkpoint_failed", str(exc), round=number)
            return
        self.state.emit(
            "checkpoint",
            f"checkpoint of round {number} saved to {path}",
            round=number,
            path=str(path),
        )

    async def _wait_for_workers(self, count: int, message: str) -> None:
        announced = False
        while self._stop_reason is None and len(self._ready_links()) < count:
            if not announced:
                self.state.emit("waiting", message)
                announced = True
            self._changed = trio.Event()
            await self._changed.wait()

    def _ready_links(self) -> list[WorkerLink]:
        return [link for link in self._links.values() if link.ready.is_set() and not link.closed]

    def _wake(self) -> None:
        self._changed.set()

    # -- one round ------------------------------------------------------------

    async def _run_round(self, number: int) -> RoundRecord | None:
        cfg = self.config
        links = self._ready_links()
        current = Round(number, [link.worker_id for link in links], self.graphs.param_names)
        current.bytes_at_start = (self.state.bytes_sent, self.state.bytes_received)
        self._round = current
        self.state.round = number
        tensors = {name: self.params[name] for name in self.graphs.param_names}
        body = {"round": number, "innerSteps": cfg.inner_steps}
        async with trio.open_nursery() as nursery:
            for link in links:
                link.view.state, link.view.round, link.view.step = "syncing", number, 0
                nursery.start_soon(self._send_round_start, link, body, tensors, current)
        await self._collect(current)
        self._round = None
        if not current.contributors:
            return None
        pseudo_gradient = current.mean.mean()
        self.params = await trio.to_thread.run_sync(self.outer.step, self.params, pseudo_gradient)
        eval_loss = None
        if number % cfg.eval_every == 0 or number == cfg.rounds:
            eval_loss = await trio.to_thread.run_sync(self.evaluate)
        return self._record(current, eval_loss)

    async def _send_round_start(
        self, link: WorkerLink, body: dict, tensors: dict, current: Round
    ) -> None:
        try:
            await link.send("roundStart", body, tensors)
        except _CONNECTION_ERRORS:
            current.finish(link.worker_id)  # the connection task reports the loss

    async def _collect(self, current: Round) -> None:
        cfg = self.config
        timeout = cfg.round_timeout if cfg.round_timeout > 0 else math.inf
        with trio.move_on_after(timeout):
            await current.done.wait()
        if current.done.is_set():
            return
        late = sorted(current.pending)
        if len(current.contributors) < cfg.min_workers:
            self.state.emit(
                "round_waiting",
                f"round {current.number}: timeout with {len(current.contributors)} result(s); "
                f"waiting for --min-workers {cfg.min_workers}",
            )
            while len(current.contributors) < cfg.min_workers and not current.done.is_set():
                self._changed = trio.Event()
                with trio.move_on_after(1):
                    await current.done.wait()
            late = sorted(current.pending)
        for worker_id in late:
            current.finish(worker_id)
        if late:
            self.state.emit(
                "stragglers",
                f"round {current.number} closed without {', '.join(late)}",
                workers=late,
            )

    def _record(self, current: Round, eval_loss: float | None) -> RoundRecord:
        seconds = time.monotonic() - current.started
        compute, communication, straggler = current.timings(seconds)
        sent0, received0 = current.bytes_at_start
        record = RoundRecord(
            round=current.number,
            train_loss=float(np.mean(current.losses)) if current.losses else float("nan"),
            eval_loss=eval_loss,
            round_seconds=seconds,
            compute_seconds=compute,
            communication_seconds=communication,
            straggler_seconds=straggler,
            tokens=current.tokens,
            tokens_per_second=current.tokens / seconds if seconds > 0 else 0.0,
            bytes_sent=self.state.bytes_sent - sent0,
            bytes_received=self.state.bytes_received - received0,
            bytes_saved=current.bytes_saved,
            workers=len(current.contributors),
            worker_ids=tuple(current.contributors),
        )
        for worker_id in current.contributors:
            self.state.workers[worker_id].rounds_contributed += 1
        self.state.history.append(record)
        self.state.emit("round", f"round {current.number} done", record=record)
        return record

    def evaluate(self, params: Mapping[str, np.ndarray] | None = None) -> float:
        """Mean loss on the held-out batches (exported eval graph, local backend)."""
        params = params if params is not None else self.params
        flat = tuple(params[n] for n in self.graphs.param_names)
        return float(self._eval.call(flat, self.task.eval_tokens))

    # -- connections ----------------------------------------------------------

    async def _serve_connection(self, raw: trio.SocketStream) -> None:
        admitted = await self._admission.admit(raw)  # TLS, token, limits; logs and closes refusals
        if admitted is None:
            return
        stream, hello, peer = admitted.stream, admitted.hello, admitted.peer
        link = self._admit(stream, hello, peer)
        try:
            await self._serve_worker(link)
        except WorkerLost as exc:
            self._mark_gone(link, "lost", str(exc))
        except _CONNECTION_ERRORS as exc:
            self._mark_gone(link, "lost", str(exc) or type(exc).__name__)
        except (KeyError, TypeError, ValueError) as exc:
            # a body that passed the decoder but not our reading of it: drop this peer, keep the run
            self._mark_gone(link, "lost", f"protocol violation ({type(exc).__name__}: {exc})")
        else:
            self._mark_gone(link, "left", link.view.reason or "said goodbye")
        finally:
            with trio.CancelScope(shield=True):
                await link.close("connection closed")

    def _admit(self, stream: protocol.MessageStream, hello, peer: str) -> WorkerLink:
        old = self.state.workers.get(hello.worker_id)
        if old is not None:
            index = old.index
        elif hello.worker_id in self._known_indices:  # same shard as before the restart
            index = self._known_indices[hello.worker_id]
        else:
            index = self._next_index
            self._next_index += 1
        view = WorkerView(
            worker_id=hello.worker_id,
            index=index,
            host=hello.hostname or peer,
            backend=hello.backend,
        )
        self.state.workers[hello.worker_id] = view
        link = WorkerLink(stream, view, self.state, hello.platform)
        previous = self._links.get(hello.worker_id)
        if previous is not None:
            previous.closed = True
        self._links[hello.worker_id] = link
        verb = "rejoined" if old is not None else "joined"
        self.state.emit(
            verb,
            f"worker {index} ({hello.worker_id}, {hello.backend}) {verb} from {peer}",
            worker=hello.worker_id,
        )
        return link

    def _mark_gone(self, link: WorkerLink, state: str, reason: str) -> None:
        if self.state.status in ("done", "stopped", "failed") or self._stop_reason is not None:
            state = "left"  # the run is ending: a closing connection is expected, not a loss
        if self._links.get(link.worker_id) is link:
            del self._links[link.worker_id]
            link.view.state, link.view.reason = state, reason
            if state == "lost" and self._stop_reason is None:
                self.state.emit(
                    "lost", f"worker {link.view.index} lost: {reason}", worker=link.worker_id
                )
        link.closed = True
        if self._round is not None:
            self._round.finish(link.worker_id)
        self._wake()

    async def _serve_worker(self, link: WorkerLink) -> None:
        cfg = self.config
        slot = link.view.index % len(self.task.shards)
        shard = self.task.shards[slot]
        await link.send(
            "welcome",
            {
                "workerIndex": link.view.index,
                "runId": self.run_id,
                "heartbeatSeconds": cfg.heartbeat_seconds,
            },
        )
        link.view.state = "compiling"
        plan, tensors = self._plan(slot, shard, link.platform)
        await link.send("plan", plan, tensors)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._heartbeats, link)
            nursery.start_soon(self._watchdog, link, nursery.cancel_scope)
            try:
                await self._receive_loop(link)
            except _CONNECTION_ERRORS as exc:
                link.lost_reason = link.lost_reason or str(exc) or type(exc).__name__
            nursery.cancel_scope.cancel()
        if link.lost_reason:
            raise WorkerLost(link.lost_reason)

    def _plan(
        self, slot: int, shard: np.ndarray | dict[str, np.ndarray], platform: str
    ) -> tuple[dict, dict[str, np.ndarray]]:
        cfg, graphs = self.config, self.graphs
        if platform not in graphs.platforms:
            raise WorkerLost(
                f"platform {platform} is not among the exported ones ({', '.join(graphs.platforms)})"
            )
        tensors = {
            f"graph/{name}": np.frombuffer(blob, np.uint8)
            for name, blob in graphs.as_dict().items()
            if name != "eval_loss"
        }
        data_fields, data_tensors = data.shard_plan(shard)  # LM windows or rows of a custom dataset
        tensors.update(data_tensors)
        plan = {
            "runId": self.run_id,
            "modelName": self.task.name,
            "paramCount": self.task.param_count,
            "graphs": [
                {"name": name, "platforms": list(graphs.platforms), "tensor": f"graph/{name}"}
                for name in ("train_chunk", "init_opt_state")
            ],
            "paramNames": list(graphs.param_names),
            "innerSteps": cfg.inner_steps,
            "chunkSteps": graphs.chunk_steps,
            "batchSize": cfg.batch_size,
            "seqLen": cfg.seq_len,
            "seed": cfg.seed,
            "workerSlot": slot,
            "compression": cfg.compression,
            **data_fields,
        }
        return plan, tensors

    async def _receive_loop(self, link: WorkerLink) -> None:
        view = link.view
        while True:
            message = await link.receive()
            body = message.body
            if message.kind == "ready":
                view.state = "idle"
                link.ready.set()
                self.state.emit(
                    "compiled",
                    f"worker {view.index} compiled in {body.get('compileSeconds', 0):.1f} s",
                    worker=view.worker_id,
                )
                self._wake()
            elif message.kind == "progress":
                self._on_progress(view, body)
            elif message.kind == "roundResult":
                await self._on_result(link, message)
            elif message.kind == "heartbeat":
                pass
            elif message.kind == "goodbye":
                view.reason = str(body.get("reason", "said goodbye"))
                return
            elif message.kind == "error":
                raise WorkerLost(f"worker error ({body.get('code')}): {body.get('message')}")
            else:
                raise WorkerLost(f"unexpected {message.kind} from a worker")

    def _on_progress(self, view: WorkerView, body: dict) -> None:
        view.state = str(body.get("phase") or "training")
        view.step = int(body.get("step", 0))
        view.total_steps = int(body.get("totalSteps", 0))
        loss = float(body.get("loss", float("nan")))
        if math.isfinite(loss):
            view.loss = loss
            global_step = (int(body.get("round", 1)) - 1) * self.config.inner_steps + view.step
            self.state.step_losses.append((global_step, loss, view.index))
        view.tokens_per_second = float(body.get("tokensPerSecond", 0.0))

    async def _on_result(self, link: WorkerLink, message: protocol.Message) -> None:
        view, current = link.view, self._round
        number = int(message.body.get("round", -1))
        if current is None or not current.accepts(link.worker_id, number):
            self.state.emit(
                "late_result",
                f"dropped a late result for round {number} from worker {view.index}",
                worker=link.worker_id,
                round=number,
            )
            return
        try:
            check_pseudo_gradient(message.tensors, self._shapes)
            check_token_count(
                message.body.get("tokens", 0),
                self.config.inner_steps * self.config.batch_size * self.config.seq_len,
            )
            norm = self._norms.check(message.tensors)
            await current.add(link.worker_id, message)
            self._norms.accept(norm)
        except BadResult as exc:
            current.finish(link.worker_id)
            view.reason = f"result refused: {exc}"
            self.state.emit(
                "bad_result",
                f"refused worker {view.index}'s round {number} result: {exc}",
                worker=link.worker_id,
            )
            with contextlib.suppress(*_CONNECTION_ERRORS):
                await link.send("error", {"code": "badResult", "message": f"result refused: {exc}"})
            return
        view.state = "idle"
        view.step = view.total_steps

    async def _heartbeats(self, link: WorkerLink) -> None:
        try:
            while True:
                await trio.sleep(self.config.heartbeat_seconds)
                await link.send("heartbeat", {"sentAt": time.time()})
        except _CONNECTION_ERRORS:
            return  # the receive loop sees the broken connection and reports it

    async def _watchdog(self, link: WorkerLink, scope: trio.CancelScope) -> None:
        timeout = self.config.heartbeat_timeout
        while True:
            await trio.sleep(min(1.0, timeout / 4))
            silent = time.monotonic() - link.view.last_heard
            if silent > timeout:
                link.lost_reason = f"silent for {silent:.0f} s (heartbeat timeout {timeout:.0f} s)"
                scope.cancel()
                return

    async def _goodbye_all(self, reason: str) -> None:
        async with trio.open_nursery() as nursery:
            for link in list(self._links.values()):
                link.view.state, link.view.reason = "left", reason
                nursery.start_soon(link.close, reason)


def _peer_name(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "unknown peer"


def _last_eval(state: RunState) -> float | None:
    for record in reversed(state.history):
        if record.eval_loss is not None:
            return record.eval_loss
    return None


def _settings(config: RunConfig) -> dict:
    return {
        "algorithm": "DiLoCo",
        "inner_steps": config.inner_steps,
        "inner_optimizer": config.inner_optimizer,
        "inner_lr": config.inner_lr,
        "outer_optimizer": config.outer_optimizer,
        "outer_lr": config.outer_lr,
        "outer_momentum": config.outer_momentum,
        "batch_size": config.batch_size,
        "seq_len": config.seq_len,
        "compression": config.compression,
    }
