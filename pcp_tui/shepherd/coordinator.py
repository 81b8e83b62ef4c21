"""The shepherd: one DiLoCo run over the workers its `WorkerPool` serves, start to end.

`Shepherd` owns the run's lifecycle: it listens (`listening.py`), waits for
workers, loops over the rounds (`engine.RoundEngine`: plain and Streaming
DiLoCo alike), checkpoints, and says goodbye. It is a plain trio program.
Headless mode runs it under `trio.run`; the dashboard hosts the very same
object in Textual's loop via trio guest mode and only reads `shepherd.state` and calls `request_stop` / `pause` / `resume`.
Connections (welcome, plan, results, liveness) are `pool.WorkerPool`'s business.
"""

from __future__ import annotations

import functools
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import outcome
import trio

from pcp_tui import protocol
from pcp_tui.backends import LoadedGraph, select_backend
from pcp_tui.config import RunConfig
from pcp_tui.contract import tls
from pcp_tui.diloco.validation import AssignedBatches, LossDeltaValidator, eval_loss
from pcp_tui.shepherd.rounds import checks, divergence
from pcp_tui.shepherd.rounds.engine import (
    RoundEngine,
    copy_tensors,
    inner_optimizer,
    record_round,
    tokens_per_step,
)
from pcp_tui.shepherd.rounds.pacing import StepPacing
from pcp_tui.shepherd.rounds.results import OpenRounds
from pcp_tui.shepherd.run import checkpoint
from pcp_tui.shepherd.run.checkpoint_writer import CheckpointWriter
from pcp_tui.shepherd.run.evaluation import HeldOutEval
from pcp_tui.shepherd.run.events import (
    Done,
    Event,
    Exported,
    Exporting,
    Failed,
    Listening,
    NotResumable,
    Paused,
    ResultRefused,
    Resumable,
    Resumed,
    ResumedFrom,
    RoundRepeated,
    Waiting,
)
from pcp_tui.shepherd.run.graphs import GraphLibrary
from pcp_tui.shepherd.run.history import RoundRecord
from pcp_tui.shepherd.run.ledger import ShardLedger
from pcp_tui.shepherd.run.state import RunState, RunStatus, run_settings
from pcp_tui.shepherd.serving.admission import Admission
from pcp_tui.shepherd.serving.listening import (
    CannotListen,
    advertised,
    join_command,
    open_listeners,
)
from pcp_tui.shepherd.serving.pool import WorkerPool
from pcp_tui.training.export import TrainingGraphs
from pcp_tui.training.workload import Workload


class RunFailed(RuntimeError):
    """The run cannot go on; the message is the one-line reason."""


class Shepherd:
    def __init__(self, config: RunConfig, workload: Workload, *, state: RunState | None = None):
        self.config = config.validate()
        self.workload = workload
        if not config.security.token:
            raise ValueError("the shepherd needs a join token (RunConfig.token)")
        self.token: str = config.security.token
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
        self._stop_reason: str | None = None
        self._cancelled = False  # `cancel`: the run ends for good, workers exit
        self._training = trio.CancelScope()  # `stop_now` abandons the round in it
        # a stop before the run's end asks workers to come back for a --resume; False where
        # the workers are this process's own (the demo's), which end with it
        self.ask_workers_back = True
        self._failure: str | None = None
        self._diverged = False  # the last round's outer step made the model non-finite
        self._checkpointed: int | None = None  # the round of the newest checkpoint
        self._checkpoints = CheckpointWriter(config.checkpoints.dir, self.state)
        self._paused = False
        self._resumed = trio.Event()
        self._eval: LoadedGraph | None = None  # the eval graph, once exported (`_export`)
        self._device = threading.Lock()  # held by each model pass (`_one_at_a_time`)
        self._resumed_from: tuple[str, int] | None = None
        self._port = config.network.port
        self.start_round = 1
        self.tls = (
            tls.ServerTLS.from_files(config.security.tls_cert, config.security.tls_key)
            if config.security.tls_cert and config.security.tls_key
            else None
        )
        self._admission = Admission.for_run(config, self.state, run_id=self.run_id, tls=self.tls)
        self.library = GraphLibrary.for_run(self.config, workload, inner_optimizer(config))
        self.graphs: TrainingGraphs | None = None  # the first export, once made (`_export`)
        inner = config.inner
        open_rounds = OpenRounds()
        self.engine = RoundEngine(
            self.config,
            self.state,
            # our own float32 copies: the outer steps update them in place
            {n: np.array(p, np.float32) for n, p in workload.params.items()},
            open_rounds=open_rounds,
            per_step=tokens_per_step(config, workload),
            pacing=StepPacing.for_config(inner) if inner.adaptive_steps else None,
        )
        self.pool = WorkerPool(
            self.config,
            workload,
            self.state,
            self._admission,
            graphs=self.library,
            open_rounds=open_rounds,
            fragments=self.engine.fragments,
            pacing=self.engine.pacing,
            run_id=self.run_id,
            stopping=lambda: self._stop_reason is not None,
        )
        self.evals = HeldOutEval(
            self.evaluate,
            copy_tensors,
            self.state,
            every=config.evaluation.every,
            last_round=config.outer.rounds,
            diverged=self._eval_diverged,
        )
        if saved is not None:
            self._resume(saved)

    @property
    def params(self) -> dict[str, np.ndarray]:
        """The global parameters θ (the round engine's, updated in place by its outer steps)."""
        return self.engine.params

    def _resume(self, saved: checkpoint.Checkpoint) -> None:
        shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        checkpoint.check_compatible(
            saved, self.workload.name, shapes, self.workload.corpus.fingerprint
        )
        self.engine.load(saved.params, saved.outer_state)
        self.start_round = self.state.first_round = saved.round + 1
        self._checkpointed = saved.round
        self.pool.remember({str(k): int(v) for k, v in saved.meta.get("workers", {}).items()})
        self.state.shards.restore(saved.meta.get("shard_ledger", {}))
        self.state.resumed_eval = (saved.meta.get("eval_round"), saved.meta.get("eval_loss"))
        self._resumed_from = (str(saved.path), saved.round)  # announced when the run starts

    # -- commands (safe to call from the dashboard) -------------------------

    def request_stop(self, reason: str = "stopped by the operator") -> None:
        """End the run after the current round; workers are told goodbye (and to come
        back for a `--resume` when the run is not over and has a checkpoint: `_resumable`)."""
        self._stop_reason = reason
        self._resumed.set()
        self.pool.wake()

    def cancel(self, reason: str = "cancelled by the operator") -> None:
        """End the run for good after the current round: the goodbye tells the workers to
        exit, not to wait for a `--resume` (the API's cancel, the dashboard's q, Ctrl-\\)."""
        self._cancelled = True
        self.request_stop(reason)

    def stop_now(self, reason: str) -> None:
        """Stop without finishing the current round (a second Ctrl-C); the workers are still
        told goodbye, resumable if a checkpoint is there to resume from."""
        self.request_stop(reason)
        self._training.cancel()

    def abort(self, reason: str) -> None:
        """End the run as failed (exit code non-zero) after the current round."""
        self._failure = reason
        self.request_stop(reason)

    def pause(self) -> None:
        self._paused = True
        self._resumed = trio.Event()
        self.state.emit(Paused("pausing after the current round"))

    def resume(self) -> None:
        self._paused = False
        self._resumed.set()
        self.state.emit(Resumed("training resumed"))

    # -- the run ------------------------------------------------------------

    async def run(
        self,
        *,
        listeners: list[trio.abc.Listener[trio.abc.Stream]] | None = None,
        task_status=trio.TASK_STATUS_IGNORED,
    ) -> RunState:
        """Listen, train for `config.outer.rounds` rounds, say goodbye. Raises RunFailed.

        The services around a run (the operator API: `app.api.run_with_api`) are the
        host's; this is the run itself. `listeners`: where workers connect, instead of
        TCP on --host:--port (a simulated network: `pcp_tui.testing.SimulatedNetwork`).
        """
        cfg = self.config
        if self._resumed_from:
            path, number = self._resumed_from
            self.state.emit(ResumedFrom(f"resumed from {path} (round {number})", round=number))
        platforms = ", ".join(self.library.main_platforms)
        self.state.emit(Exporting(f"exporting training graphs for {platforms}..."))
        self.graphs, seconds = await with_notes(
            lambda: trio.to_thread.run_sync(self._export),
            lambda seconds: self.state.emit(
                Exporting(f"still exporting training graphs ({seconds:.0f} s so far)")
            ),
        )
        self.state.emit(Exported(f"graphs exported in {seconds:.1f} s", seconds=seconds))
        port = cfg.network.port
        if listeners is None:
            try:
                sockets, port = await open_listeners(cfg.network.host, cfg.network.port)
            except CannotListen as exc:
                raise RunFailed(str(exc)) from None
            listeners = list(sockets)
        self._port = port  # a --port 0 run resumes on the port its workers know
        self.state.address = advertised(cfg.network.host, port)
        self.state.join_command = join_command(
            self.state.address,
            self.token,
            self.tls,
            keyed=self.config.security.worker_keys is not None,
        )
        failure: RunFailed | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.serve_listeners, self.pool.serve, listeners)
                nursery.start_soon(self._admission.refusals.run)
                nursery.start_soon(self.pool.load.run)
                task_status.started(port)
                self.state.emit(
                    Listening(
                        f"listening on {self.state.address}"
                        + (f", operator API on {self.state.api_url}" if self.state.api_url else "")
                        + f"; join with: {self.state.join_command}",
                    )
                )
                try:
                    with self._training:
                        await self._train(nursery)
                    if self._training.cancelled_caught:  # `stop_now`: the round abandoned
                        self._finished()
                except RunFailed as exc:  # raised out of the nursery below, not as a group
                    failure = exc
                finally:
                    with trio.CancelScope(shield=True):
                        await self._goodbye(failure)
                    nursery.cancel_scope.cancel()
        finally:
            self.state.finished_at = time.monotonic()
        if failure is not None:
            self.state.status = RunStatus.FAILED
            self.state.emit(Failed(str(failure)))
            raise failure
        return self.state

    async def _goodbye(self, failure: RunFailed | None) -> None:
        """Tell the workers goodbye, and to come back when `--resume` can continue the run."""
        resumable = self._resumable(failure)
        if resumable:
            directory = self.config.checkpoints.dir or self.config.checkpoints.resume or ""
            self.state.emit(
                Resumable(
                    f"the run can be resumed: pcp-tui shepherd --resume {directory} (its options "
                    "and token are saved there); its workers keep reconnecting until it is, "
                    "for their --give-up-after",
                    directory=directory,
                )
            )
        reason = self._stop_reason or str(failure or "run finished")
        await self.pool.goodbye_all(reason, resumable=resumable)

    def _resumable(self, failure: RunFailed | None) -> bool:
        """Whether the run stops before its end, not failed, with a checkpoint to resume from."""
        history = self.state.history
        finished = bool(history) and history[-1].round >= self.config.outer.rounds
        saved = self._checkpoints.saved is not None or self._resumed_from is not None
        failed = failure is not None or self._failure is not None
        stopped = self._stop_reason is not None and self.ask_workers_back and not self._cancelled
        # last: it says why not when the checkpoint it saved is gone (the directory removed)
        return stopped and saved and not failed and not finished and self._checkpoint_on_disk()

    def _checkpoint_on_disk(self) -> bool:
        """Whether a checkpoint can still be read where `--resume` would look; if not, why not."""
        directory = self.config.checkpoints.dir or self.config.checkpoints.resume
        if not directory:
            return False
        try:
            checkpoint.inspect(directory, hint="its workers are told the run ended")
        except checkpoint.CheckpointError as exc:
            self.state.emit(NotResumable(f"the run cannot be resumed: {exc}"))
            return False
        return True

    def _export(self) -> TrainingGraphs:
        """The run's first export (the shepherd evaluates with it, on one device of its host,
        as eval_loss is exported for one); others are made as workers need."""
        graphs = self.library.export_main()
        backend = select_backend("auto", 1)
        self._eval = backend.load("eval_loss", graphs.eval_loss, own=True)
        gpu = backend.info.platform != "cpu"
        if gpu:
            _first_call(self._eval, len(graphs.param_names))
        cfg = self.config
        if cfg.outer.validating:  # each result, each fragment's, scored on its own rows
            batches = AssignedBatches.for_run(cfg, self.workload, graphs.chunk_steps)
            scorer = backend.load("score_loss", graphs.score_loss, own=True)
            if gpu:
                _first_call(scorer, len(graphs.param_names))
            loss = eval_loss(self._one_at_a_time(scorer.call), graphs.param_names)
            for screen in self.engine.screens:
                screen.validator = LossDeltaValidator(loss, batches)
        return graphs

    async def _train(self, nursery: trio.Nursery) -> None:
        cfg = self.config
        self.state.status = RunStatus.WAITING
        await self._wait_for_workers(
            cfg.network.workers, f"waiting for {cfg.network.workers} worker(s)"
        )
        number = self.start_round
        failing: list[str] = []  # internal errors of the rounds in a row that got no result
        nan_tries = 0  # tries in a row of this round whose every result was non-finite
        while number <= cfg.outer.rounds and self._stop_reason is None:
            if self._paused:
                self.state.status = RunStatus.PAUSED
                await self._resumed.wait()
                continue
            await self._wait_for_workers(1, "no worker is ready; waiting for one to join")
            if self._stop_reason is not None:
                break
            if await self.pool.drop_revoked():  # --worker-keys lost a line: not in this round
                continue
            self.state.status = RunStatus.TRAINING
            mark = self.state.events[-1] if self.state.events else None
            record = await self._run_round(number, nursery)
            events = divergence.events_since(self.state.events, mark)
            internal = divergence.internal_failure(events, record)
            failing = [*failing, internal] if internal is not None else []
            if len(failing) >= divergence.INTERNAL_ROUNDS:  # each repeat meets it again
                self.abort(
                    divergence.internal_advice(
                        len(failing), number, failing[0], self._checkpointed, cfg.checkpoints.dir
                    )
                )
                break
            why = divergence.diverged(events, number, cfg.inner.steps, record)
            if why is not None and record is None:  # one try could be one peer's lie: a
                nan_tries += 1  # diverged model fails again from the same parameters
                why = why if nan_tries >= divergence.NAN_TRIES else None
            elif record is not None:
                nan_tries = 0
            saving = cfg.checkpoints.dir and number % cfg.checkpoints.every == 0
            if why is None and record is not None and saving:
                await self.engine.settle()  # a checkpoint holds checked rounds only
            why = why or self._settled()
            if why is not None:  # repeating the round would diverge again: stop, say why
                self._diverged = record is not None  # its parameters are not worth a checkpoint
                kept = self._checkpointed if self._diverged else number - 1 or None
                self.abort(divergence.advice(why, kept, cfg.inner.lr, cfg.checkpoints.dir))
                break
            if record is None:
                self.state.emit(
                    RoundRepeated(
                        f"round {number} got no result; repeating it",
                        round=number,
                    )
                )
                await self.pool.compiling_ready()  # newcomers that just took slots, too
                continue
            if saving:
                await self._checkpoint(number, nursery)
            number += 1
        await self.engine.settle()  # the last rounds' checks: their refusals are taken out
        if (why := self._settled()) is not None and not self._failure:
            self._diverged = True
            self.abort(
                divergence.advice(why, self._checkpointed, cfg.inner.lr, cfg.checkpoints.dir)
            )
        await self.evals.idle()  # the last checkpoint and the `done` event have its loss
        if (
            cfg.checkpoints.dir
            and not self._diverged
            and self.state.history
            and self.state.history[-1].round % cfg.checkpoints.every
        ):
            await self._checkpoint(self.state.history[-1].round, nursery)
        await self._checkpoints.idle()
        if self._failure:
            raise RunFailed(self._failure)
        self._finished()

    def _finished(self) -> None:
        """The run is done, or stopped (then its round may be unfinished: `stop_now`)."""
        self.state.status = (
            RunStatus.CANCELLED
            if self._cancelled  # not to be resumed
            else RunStatus.STOPPED
            if self._stop_reason
            else RunStatus.DONE
        )
        self.state.emit(
            Done(
                f"run {self.state.status} {self.state.rounds_summary()}",
                rounds=self.state.rounds_done(),  # counting those before a --resume
                final_eval_loss=self.state.last_eval_loss(),
                seconds=self.state.elapsed(),
            )
        )

    async def _checkpoint(self, number: int, nursery: trio.Nursery) -> None:
        """Save the run after round `number` off the round's path (see CheckpointWriter)."""
        meta = {
            "run_id": self.run_id,
            "model": self.workload.name,
            "data_fingerprint": self.workload.corpus.fingerprint,
            # every option but the token (`checkpoint.keep_token`): `--resume` restores them
            "config": {
                **{k: v for k, v in self.config.flat().items() if k != "token"},
                "port": self._port,
            },
            "data_positions": {"seed": self.config.model.seed, "next_round": number + 1},
            "workers": {worker_id: view.index for worker_id, view in self.state.workers.items()},
            "shard_ledger": self.state.shards.as_meta(),
        }
        self._checkpointed = number
        # its eval_loss: this round's, once its eval (`HeldOutEval`) ends, off the round's path
        await self._checkpoints.save(number, meta, self._snapshot, nursery, self.evals.idle)

    def _snapshot(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """θ and the outer state, copied over the outer step's threads (on the next round's
        path: a 124M model's θ and momentum are 1 GB)."""
        return copy_tensors(self.params), copy_tensors(self.engine.state_arrays())

    async def _wait_for_workers(self, count: int, message: str) -> None:
        announced = False
        while self._stop_reason is None and not self.pool.has_ready(count):
            if not announced:
                late = self.pool.sitting_out_line()  # connected, but owing an old round's result
                self.state.emit(Waiting(f"{message}; {late}" if late else message))
                announced = True
            await self.pool.changed()

    # -- one round ------------------------------------------------------------

    async def _run_round(self, number: int, nursery: trio.Nursery) -> RoundRecord | None:
        """Round `number` (`engine.RoundEngine`; its checks run in `nursery`), recorded; its
        eval started in `nursery` (`HeldOutEval`: of θ as the round's checks leave it), or,
        for the run's last round, awaited once its checks have ended."""
        current = await self.engine.run(
            number, self.pool.ready_links(), nursery, relays=self.pool.relays
        )
        if current is None:
            return None
        if number == self.config.outer.rounds:
            await self.engine.settle()
            loss = await self.evals.final(number, self.params)
            return record_round(self.state, self.config, current, loss)
        record = record_round(self.state, self.config, current, None)
        if self.evals.due(number):
            settled = functools.partial(checks.corrected, current.checks)
            await self.evals.start(number, self.params, nursery, settled)
        return record

    def _settled(self) -> str | None:
        """Take the rounds the engine has settled (`RoundEngine.verdicts`): their results
        count (`WorkerPool.settled`). Returns why the run diverged if a round's every result
        was refused late as diverging (its checks: `divergence.diverged`), else None."""
        why = None
        for verdict in self.engine.verdicts():
            self.pool.settled(verdict)
            if why is None and verdict.uncounted and not verdict.counted:
                refusals: list[Event] = [
                    e
                    for e in self.state.events
                    if isinstance(e, ResultRefused) and e.round == verdict.number
                ]
                why = divergence.diverged(refusals, verdict.number, self.config.inner.steps, None)
        return why

    def _eval_diverged(self, number: int, loss: float) -> None:
        """Round `number`'s eval, ended after the round, found the outer step diverged."""
        self._diverged = True
        kept = self._checkpointed
        kept = kept if kept is not None and kept < number else None
        why = f"round {number}'s outer step made the eval loss {loss}"
        self.abort(divergence.advice(why, kept, self.config.inner.lr, self.config.checkpoints.dir))

    def evaluate(self, params: Mapping[str, np.ndarray] | None = None) -> float:
        """Mean loss on the held-out batches (exported eval graph, local backend)."""
        params = params if params is not None else self.params
        assert self.graphs is not None and self._eval is not None, "evaluated once exported"
        flat = tuple(params[n] for n in self.graphs.param_names)
        return float(self._one_at_a_time(self._eval.call)(flat, self.workload.eval_tokens))

    def _one_at_a_time(self, call: Callable[..., Any]) -> Callable[..., float]:
        """`call`, run and read under the shepherd's one device lock.

        The eval and the loss-delta checks run in threads beside each other, and XLA
        captures CUDA graphs on a GPU (command buffers), which fails if another thread
        queues work on the device meanwhile (see `_first_call`). The device does one
        at a time anyway.
        """

        def run(*args: Any) -> float:
            with self._device:
                return float(call(*args))

        return run


def _first_call(graph: LoadedGraph, count: int) -> None:
    """Run `graph` (of `count` parameters) once on zeros, before the run's threads share the device.

    A cuDNN graph is deserialized on its executable's first run inside a CUDA
    stream capture, which fails if another thread queues device work meanwhile: a
    GPU shepherd's first eval died with "capturing stream has unjoined work" while
    the outer step and a streaming round's checks ran beside it (4 x H100, GPT-2,
    --attention cudnn). Its inputs are the graph's (parameters, batch) or
    (parameters, batches), as `eval_loss` and `score_loss` take them; a batch of
    several tensors (row datasets) is a tuple.
    """
    zeros = [np.zeros(a.shape, a.dtype) for a in graph.in_avals]
    params, batch = zeros[:count], zeros[count:]
    float(graph.call(tuple(params), batch[0] if len(batch) == 1 else tuple(batch)))


def _saved_run_id(saved: checkpoint.Checkpoint | None) -> str | None:
    """The run id a checkpoint was saved by (None: no checkpoint, or one that predates it)."""
    run_id = saved.meta.get("run_id") if saved is not None else None
    if not isinstance(run_id, str) or not 0 < len(run_id) <= protocol.ID_CHARS:
        return None
    return run_id


EXPORT_NOTE_SECONDS = 15.0
_T = TypeVar("_T")


async def with_notes(
    work: Callable[[], Awaitable[_T]],
    note: Callable[[float], object],
    every: float = EXPORT_NOTE_SECONDS,
) -> tuple[_T, float]:
    """`await work()`, calling `note(seconds so far)` every `every` seconds until it returns.

    Returns what `work` returned and the seconds it took, counted on the notes' clock: the
    last "so far" never exceeds the total (the evaluator's compile counts in both).

    A big model's export takes minutes with nothing else to show: a headless log
    or a dashboard that says it is still at it is not mistaken for a hung one.
    What `work` raises leaves bare, not wrapped in the nursery's group.
    """

    started = trio.current_time()

    async def notes() -> None:
        while True:
            await trio.sleep(every)
            note(trio.current_time() - started)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(notes)
        result = await outcome.acapture(work)
        nursery.cancel_scope.cancel()
    return result.unwrap(), trio.current_time() - started
