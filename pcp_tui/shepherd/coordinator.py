"""The shepherd: one DiLoCo run over the workers its `WorkerPool` serves, start to end.

`Shepherd` owns the run's lifecycle: it listens (`listening.py`), waits for
workers, loops over the rounds (each one plain, `plain_round.py`, or streaming,
`fragments.py`), checkpoints, and says goodbye. It is a plain trio program.
Headless mode runs it under `trio.run`; the dashboard hosts the very same
object in Textual's loop via trio guest mode and only reads `shepherd.state` and calls `request_stop` / `pause` / `resume`.
Connections (welcome, plan, results, liveness) are `pool.WorkerPool`'s business.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping

import numpy as np
import outcome
import trio

from pcp_tui import protocol
from pcp_tui.backends import select_backend
from pcp_tui.config import RunConfig
from pcp_tui.contract import tls
from pcp_tui.diloco.aggregate import make_aggregate
from pcp_tui.diloco.outer import OuterOptimizer
from pcp_tui.diloco.validation import AssignedBatches, LossDeltaValidator, eval_loss
from pcp_tui.shepherd import checkpoint
from pcp_tui.shepherd.admission import Admission
from pcp_tui.shepherd.api import OperatorAPI
from pcp_tui.shepherd.checkpoint_writer import CheckpointWriter
from pcp_tui.shepherd.fragments import FragmentSync
from pcp_tui.shepherd.graphs import GraphLibrary
from pcp_tui.shepherd.ledger import ShardLedger
from pcp_tui.shepherd.listening import (
    EVERYWHERE,
    CannotListen,
    address_for_others,
    advertised,
    join_command,
    open_listeners,
)
from pcp_tui.shepherd.pacing import StepPacing
from pcp_tui.shepherd.plain_round import (
    PlainRound,
    inner_optimizer,
    record_round,
    result_screen,
)
from pcp_tui.shepherd.pool import WorkerPool
from pcp_tui.shepherd.state import RoundRecord, RunState, run_settings
from pcp_tui.training.export import TrainingGraphs
from pcp_tui.training.workload import Workload


class RunFailed(RuntimeError):
    """The run cannot go on; the message is the one-line reason."""


class Shepherd:
    def __init__(self, config: RunConfig, workload: Workload, *, state: RunState | None = None):
        self.config = config.validate()
        self.workload = workload
        self.token = config.security.token
        if not self.token:
            raise ValueError("the shepherd needs a join token (RunConfig.token)")
        resume = config.checkpoints.resume
        saved = checkpoint.load_latest(resume) if resume else None
        # a resumed run is the same run: workers keep their inner optimizer state for it
        self.run_id = _saved_run_id(saved) or secrets.token_hex(4)
        self.state = state or RunState(
            run_id=self.run_id, rounds_total=config.outer.rounds, settings=run_settings(config)
        )
        self.state.shards = ShardLedger(len(workload.shards))
        self.state.model_name = workload.name
        self.state.param_count = workload.param_count
        # our own float32 copies: the outer step updates them in place, workload.params stays as built
        self.params: dict[str, np.ndarray] = {
            n: np.array(p, np.float32) for n, p in workload.params.items()
        }
        self.outer = OuterOptimizer(config.outer.optimizer, config.outer.lr, config.outer.momentum)
        self.graphs: TrainingGraphs | None = None
        self._shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        # every round's aggregate and screen (fragments.py builds its own per fragment)
        self._mean = make_aggregate(config.outer.aggregate, tuple(sorted(self.params)))
        self._screen = result_screen(config, workload, self._shapes)
        self._stop_reason: str | None = None
        # a stop before the run's end asks workers to come back for a --resume; False where
        # the workers are this process's own (the demo's), which end with it
        self.ask_workers_back = True
        self._failure: str | None = None
        self._checkpoints = CheckpointWriter(config.checkpoints.dir, self.state)
        self._paused = False
        self._resumed = trio.Event()
        self._eval = None
        self._resumed_from: tuple[str, int] | None = None
        self.start_round = 1
        self.tls = (
            tls.ServerTLS.from_files(config.security.tls_cert, config.security.tls_key)
            if config.security.tls_cert
            else None
        )
        self._admission = Admission.for_run(config, self.state, run_id=self.run_id, tls=self.tls)
        self.pool = WorkerPool(
            self.config,
            workload,
            self.state,
            self._admission,
            run_id=self.run_id,
            stopping=lambda: self._stop_reason is not None,
        )
        self.library = GraphLibrary.for_run(self.config, workload, inner_optimizer(config))
        self.fragment_sync: FragmentSync | None = None  # Streaming DiLoCo (--streaming-fragments)
        inner = config.inner
        self.pacing = StepPacing.for_config(inner) if inner.adaptive_steps else None
        self.pool.pacing = self.pacing
        if inner.streaming:
            self.fragment_sync = FragmentSync(config, self._shapes, self._screen.max_tokens)
            self.outer = self.fragment_sync.outer  # per-fragment optax states, one checkpoint
            self.pool.fragments = self.fragment_sync.fragments
        # whose aggregation state (centered clip's history) the checkpoint keeps
        self._aggregation = self.fragment_sync or self._mean
        self.plain_round = (
            None  # the fragments' rounds are fragment_sync's
            if inner.streaming
            else PlainRound(
                config,
                self.state,
                self.pool,
                mean=self._mean,
                screen=self._screen,
                outer=self.outer,
                pacing=self.pacing,
            )
        )
        if saved is not None:
            self._resume(saved)
        self.api = OperatorAPI.from_config(config, self.state, self.request_stop)  # None: off

    def _resume(self, saved: checkpoint.Checkpoint) -> None:
        checkpoint.check_compatible(
            saved, self.workload.name, self._shapes, self.workload.corpus.fingerprint
        )
        self.params = {n: np.array(p, np.float32) for n, p in saved.params.items()}
        self.outer.load_state_arrays(self.params, saved.outer_state)
        self._aggregation.load_state_arrays(saved.outer_state)
        self.start_round = self.state.first_round = saved.round + 1
        self.pool.remember({str(k): int(v) for k, v in saved.meta.get("workers", {}).items()})
        self.state.shards.restore(saved.meta.get("shard_ledger", {}))
        self._resumed_from = (str(saved.path), saved.round)  # announced when the run starts

    # -- commands (safe to call from the dashboard) -------------------------

    def request_stop(self, reason: str = "stopped by the operator") -> None:
        """End the run after the current round; workers are told goodbye (and to come
        back for a `--resume` when the run is not over and has a checkpoint: `_resumable`)."""
        self._stop_reason = reason
        self._resumed.set()
        self.pool.wake()

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
        """Listen, train for `config.outer.rounds` rounds, say goodbye. Raises RunFailed.

        With `--api-port`, the operator API serves from before the graphs are
        exported (so /healthz and /readyz answer during a long export) until the
        run ends; its port is taken first, so a busy one fails the run at once.
        """
        if self.api is None:
            return await self._run(task_status=task_status)
        try:
            self.state.api_address = self.api.bind(
                advertise=address_for_others() if self.api.host in EVERYWHERE else None
            )
        except OSError as exc:
            raise RunFailed(
                f"cannot serve the operator API on {self.api.host}:{self.api.port} "
                f"({exc.strerror or exc}); pick another --api-port or --api-host"
            ) from None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.api.serve)
            result = await outcome.acapture(self._run, task_status=task_status)
            self.api.close()
        return result.unwrap()  # RunFailed leaves bare, not wrapped in the nursery's group

    async def _run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> RunState:
        cfg = self.config
        if self._resumed_from:
            path, number = self._resumed_from
            self.state.emit("resumed_from", f"resumed from {path} (round {number})", round=number)
        platforms = ", ".join(self.library.main_platforms)
        self.state.emit("exporting", f"exporting training graphs for {platforms}")
        self.graphs = await trio.to_thread.run_sync(self._export)
        self.pool.graphs = self.library
        self.state.emit(
            "exported",
            f"graphs exported in {self.graphs.export_seconds:.1f} s",
            seconds=self.graphs.export_seconds,
        )
        try:
            listeners, port = await open_listeners(cfg.network)
        except CannotListen as exc:
            raise RunFailed(str(exc)) from None
        self.state.address = f"{advertised(cfg.network.host)}:{port}"
        self.state.join_command = join_command(self.state.address, self.token, self.tls)
        failure: RunFailed | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.serve_listeners, self.pool.serve, listeners)
                nursery.start_soon(self._admission.refusals.run)
                task_status.started(port)
                self.state.emit(
                    "listening",
                    f"listening on {self.state.address}"
                    + (f", operator API on {self.api.url}" if self.api else "")
                    + f"; join with: {self.state.join_command}",
                )
                try:
                    await self._train(nursery)
                except RunFailed as exc:  # raised out of the nursery below, not as a group
                    failure = exc
                finally:
                    with trio.CancelScope(shield=True):
                        await self._goodbye(failure)
                    nursery.cancel_scope.cancel()
        finally:
            self.state.finished_at = time.monotonic()
        if failure is not None:
            self.state.status = "failed"
            self.state.emit("failed", str(failure))
            raise failure
        return self.state

    async def _goodbye(self, failure: RunFailed | None) -> None:
        """Tell the workers goodbye, and to come back when `--resume` can continue the run."""
        resumable = self._resumable(failure)
        if resumable:
            directory = self.config.checkpoints.dir or self.config.checkpoints.resume
            self.state.emit(
                "resumable",
                f"the run can be resumed: pcp-tui shepherd --resume {directory} "
                "(with this run's options); its workers keep reconnecting until it is, "
                "for their --give-up-after",
                directory=directory,
            )
        reason = self._stop_reason or str(failure or "run finished")
        await self.pool.goodbye_all(reason, resumable=resumable)

    def _resumable(self, failure: RunFailed | None) -> bool:
        """Whether the run stops before its end, not failed, with a checkpoint to resume from."""
        history = self.state.history
        finished = bool(history) and history[-1].round >= self.config.outer.rounds
        saved = self._checkpoints.saved is not None or self._resumed_from is not None
        failed = failure is not None or self._failure is not None
        stopped = self._stop_reason is not None and self.ask_workers_back
        # last: it says why not when the checkpoint it saved is gone (the directory removed)
        return stopped and saved and not failed and not finished and self._checkpoint_on_disk()

    def _checkpoint_on_disk(self) -> bool:
        """Whether a checkpoint can still be read where `--resume` would look; if not, why not."""
        directory = self.config.checkpoints.dir or self.config.checkpoints.resume
        try:
            checkpoint.inspect(directory, hint="its workers are told the run ended")
        except checkpoint.CheckpointError as exc:
            self.state.emit("not_resumable", f"the run cannot be resumed: {exc}")
            return False
        return True

    def _export(self) -> TrainingGraphs:
        """The run's first export (the shepherd evaluates with it); others are made as workers need."""
        graphs = self.library.export_main()
        self._eval = select_backend("auto").load("eval_loss", graphs.eval_loss)
        cfg = self.config
        # plain rounds of a robust aggregate: `--aggregate mean` stays DiLoCo's arithmetic
        if (
            cfg.outer.validate == "loss-delta"
            and cfg.outer.aggregate != "mean"
            and self.plain_round is not None
        ):
            batches = AssignedBatches(
                self.workload.shards,
                count=self.workload.eval_batch_count,
                chunk_steps=graphs.chunk_steps,
                batch_size=cfg.data.batch_size,
                seq_len=cfg.data.seq_len,
                seed=cfg.model.seed,
            )
            loss = eval_loss(self._eval.call, graphs.param_names)
            self._screen.validator = LossDeltaValidator(loss, batches)
        return graphs

    async def _train(self, nursery: trio.Nursery) -> None:
        cfg = self.config
        self.state.status = "waiting"
        await self._wait_for_workers(
            cfg.network.workers, f"waiting for {cfg.network.workers} worker(s)"
        )
        number = self.start_round
        while number <= cfg.outer.rounds and self._stop_reason is None:
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
            if cfg.checkpoints.dir and number % cfg.checkpoints.every == 0:
                await self._checkpoint(number, nursery)
            number += 1
        if (
            cfg.checkpoints.dir
            and self.state.history
            and self.state.history[-1].round % cfg.checkpoints.every
        ):
            await self._checkpoint(self.state.history[-1].round, nursery)
        await self._checkpoints.idle()
        if self._failure:
            raise RunFailed(self._failure)
        self.state.status = "stopped" if self._stop_reason else "done"
        self.state.emit(
            "done",
            f"run {self.state.status} {self.state.rounds_summary()}",
            rounds=len(self.state.history),
            final_eval_loss=self.state.last_eval_loss(),
            seconds=self.state.elapsed(),
        )

    async def _checkpoint(self, number: int, nursery: trio.Nursery) -> None:
        """Save the run after round `number` off the round's path (see CheckpointWriter)."""
        meta = {
            "run_id": self.run_id,
            "model": self.workload.name,
            "data_fingerprint": self.workload.corpus.fingerprint,
            "config": {k: v for k, v in self.config.flat().items() if k != "token"},
            "data_positions": {"seed": self.config.model.seed, "next_round": number + 1},
            "workers": {worker_id: view.index for worker_id, view in self.state.workers.items()},
            "shard_ledger": self.state.shards.as_meta(),
            "eval_loss": self.state.last_eval_loss(),
        }
        await self._checkpoints.save(number, meta, self._snapshot, nursery)

    def _snapshot(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        state = {**self.outer.state_arrays(), **self._aggregation.state_arrays()}
        return (
            {n: p.copy() for n, p in self.params.items()},
            {n: np.array(v, copy=True) for n, v in state.items()},
        )

    async def _wait_for_workers(self, count: int, message: str) -> None:
        announced = False
        while self._stop_reason is None and len(self.pool.ready_links()) < count:
            if not announced:
                late = self.pool.sitting_out_line()  # connected, but owing an old round's result
                self.state.emit("waiting", f"{message}; {late}" if late else message)
                announced = True
            await self.pool.changed()

    # -- one round ------------------------------------------------------------

    async def _run_round(self, number: int) -> RoundRecord | None:
        """Round `number`, plain (`plain_round.py`) or streaming (`fragments.py`), recorded."""
        if self.fragment_sync is not None:  # Streaming DiLoCo (--streaming-fragments)
            current = await self.fragment_sync.run_round(self, number)
        else:
            current = await self.plain_round.run(number, self.params, self.graphs.param_names)
        if current is None:
            return None
        return record_round(self.state, self.config, current, await self._round_eval(number))

    async def _round_eval(self, number: int) -> float | None:
        """The eval loss after round `number`, on the rounds --eval-every asks for (and the last)."""
        cfg = self.config
        if number % cfg.evaluation.every == 0 or number == cfg.outer.rounds:
            return await trio.to_thread.run_sync(self.evaluate)
        return None

    def evaluate(self, params: Mapping[str, np.ndarray] | None = None) -> float:
        """Mean loss on the held-out batches (exported eval graph, local backend)."""
        params = params if params is not None else self.params
        flat = tuple(params[n] for n in self.graphs.param_names)
        return float(self._eval.call(flat, self.workload.eval_tokens))


def _saved_run_id(saved: checkpoint.Checkpoint | None) -> str | None:
    """The run id a checkpoint was saved by (None: no checkpoint, or one that predates it)."""
    run_id = saved.meta.get("run_id") if saved is not None else None
    if not isinstance(run_id, str) or not 0 < len(run_id) <= protocol.ID_CHARS:
        return None
    return run_id
