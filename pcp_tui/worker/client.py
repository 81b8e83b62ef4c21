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
import shlex
import time
from collections.abc import Callable
from typing import cast

import trio

from pcp_tui import protocol
from pcp_tui.backends import Backend, GraphError, UntrustedGraph, select_backend, signature
from pcp_tui.config import WorkerConfig
from pcp_tui.contract import plan as contract
from pcp_tui.contract.checks import graphs_problem
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
from pcp_tui.worker.rounds import Faults, InnerState, RoundRefused, RoundTrainer, Training
from pcp_tui.worker.session import CannotRun, Session, WorkerStatus
from pcp_tui.worker.site import Site, SiteEnd
from pcp_tui.worker.stats import WorkerCounters

# the names callers import from here; the connection's live in worker/session.py
__all__ = [
    "CannotRun",
    "ConnectionLost",
    "Faults",
    "IdInUse",
    "Refused",
    "Training",
    "Worker",
    "WorkerStatus",
]

log = logging.getLogger(__name__)  # --log-level, --log-file (worker/session.py logs here too)


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
        faults: Faults | None = None,
        site: Site | None = None,
    ):
        """A worker with `config`'s settings; `config.connection.token` must be set.

        `backend` overrides `config.compute.backend` with one already built;
        `tls` and `trace` are built from the config by the caller (`launch.run_worker`),
        which turns their errors into exit codes. `faults`: where tests make it misbehave
        (`worker.rounds.Faults`; the honest worker's by default). `site`: the processes
        this worker is one of (`join_site`, before anything else of JAX), else itself.
        """
        compute = config.compute
        backend = backend or select_backend(
            compute.backend,
            compute.device_count,
            runtime=compute.runtime,
            cache_dir=compute.compile_cache or None,
            iree_flags=tuple(shlex.split(compute.iree_flags)),
        )
        super().__init__(config, backend, tls=tls, trace=trace, max_backoff=max_backoff, site=site)
        self.counters = WorkerCounters(self.backend)  # steps, tokens, memory: sent with progress
        self.run_id: str | None = None  # the run the per-run state below belongs to
        self._inner = InnerState()  # the inner optimizer's, kept across reconnects to one run
        self._compiled: dict[bytes, tuple[Callable, Callable, tuple | None]] = {}
        self._rounds: RoundTrainer | None = None  # the current plan's, once compiled
        self._faults = faults

    async def follow(self) -> SiteEnd:
        """A site's process other than 0: run what process 0 is handed, as it runs it, until
        it ends (`SiteEnd`: the exit code and why); SiteLost if process 0 is gone.

        The same hooks as process 0's session (`_enter_run`, `_compile`, `_train_rounds`,
        `_deliver_fragment_update`), with the messages from process 0 and the replies
        going nowhere: process 0 sends the site's. Process 0 may have stopped mid-round
        (a goodbye cancels its round) short of a collective this process is in: once the
        end is here, that collective's failure as process 0 leaves is no error.
        """
        from jax.errors import JaxRuntimeError

        outbox = cast(Connection, _Outbox())
        rounds_out, rounds_in = trio.open_memory_channel(1)
        end: SiteEnd | None = None
        try:
            async with trio.open_nursery() as nursery:
                training = False
                while end is None:
                    data = await trio.to_thread.run_sync(self.site.receive, abandon_on_cancel=True)
                    if isinstance(data, SiteEnd):
                        end = data
                        self.status.update(state="done", message=f"process 0: {end.reason}")
                        await trio.to_thread.run_sync(self.site.leave)  # process 0 may go
                        nursery.cancel_scope.cancel()
                        break
                    message = protocol.decode(data)
                    body = message.body
                    if isinstance(body, protocol.Welcome):
                        self._enter_run(body.run_id)
                        self.status.update(worker_index=body.worker_index, state="connecting")
                    elif isinstance(body, protocol.Plan):
                        self.status.update(state="compiling", message="compiling the graphs")
                        await self._compile(outbox, message)
                        if not training:
                            nursery.start_soon(self._train_rounds, outbox, rounds_in)
                            training = True
                    elif isinstance(body, protocol.RoundStart):
                        await rounds_out.send(message)
                    elif isinstance(body, protocol.FragmentUpdate):
                        self._deliver_fragment_update(message)
        except* JaxRuntimeError:
            if end is None:
                raise
        assert end is not None, "the loop ends at the site's end"
        return end

    def _enter_run(self, run_id: str) -> None:
        """Keep the per-run state (the inner optimizer's) only for the run it belongs to.

        A shepherd resumed from its checkpoint keeps its run id; one started afresh
        has a new one, and AdamW moments from another run would steer this one.
        """
        if run_id == self.run_id:
            if self._inner.opt_state is not None:
                log.info("back in run %s: keeping the inner optimizer state", run_id)
            return
        if self.run_id is not None:
            log.info(
                "joined run %s (was run %s): starting with a fresh inner optimizer state",
                run_id,
                self.run_id,
            )
        self.run_id, self._inner.opt_state = run_id, None

    async def _compile(self, connection: Connection, plan_message: protocol.Message) -> None:
        started = time.perf_counter()
        training = await trio.to_thread.run_sync(self._load_plan, plan_message)
        self._rounds = RoundTrainer(
            training,
            self.backend,
            self.counters,
            self._inner,
            status=self.status.update,
            worker_index=lambda: self.status.worker_index,
            faults=self._faults,
        )
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
        if self._rounds is None:
            raise protocol.MalformedMessage("a fragmentUpdate before any plan")
        self._rounds.updates.deliver(message)

    def _load_plan(self, message: protocol.Message) -> Training:
        plan, tensors = message.body_as(protocol.Plan), message.tensors
        problem = contract.plan_problem(plan, tensors)
        if problem is not None:
            raise protocol.MalformedMessage(problem)
        if plan.overlap_steps and self.site.process_count > 1:
            # a fragment's exchange (its reads and uploads are collectives over the site) would
            # run beside training's collectives, in an order that may differ between processes
            raise CannotRun(
                f"a site of several processes cannot train with --overlap-steps "
                f"{plan.overlap_steps}: this run needs one-process workers"
            )
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
            try:
                train = self.backend.load(
                    "train_chunk", graphs["train_chunk"], donate_argnums=(0, 1)
                )
                init = self.backend.load("init_opt_state", graphs["init_opt_state"])
            except UntrustedGraph as exc:  # final: the worker says why and exits
                raise CannotRun(str(exc)) from None
            except GraphError as exc:
                info = self.backend.info
                raise CannotRun(
                    f"{exc}; this worker runs {info.describe()} ({info.runtime}): "
                    "try another --runtime or --backend"
                ) from None
            axes = train.input_axes[: len(plan.param_names)] if train.input_axes else None
            self._compiled = {key: (train.call, init.call, axes)}
            self._inner.opt_state = None
        train_chunk, init_opt_state, axes = self._compiled[key]
        return Training(plan, shard, train_chunk, init_opt_state, axes)

    async def _train_rounds(
        self, connection: Connection, rounds: trio.MemoryReceiveChannel
    ) -> None:
        with contextlib.suppress(*LINK_ERRORS):  # the receive loop reports a broken link
            async for message in rounds:
                assert self._rounds is not None, "rounds start once the plan is compiled"
                try:
                    await self._rounds.train_round(connection, message)
                except RoundRefused as exc:
                    await self.refuse(connection, str(exc))
                    return

    async def refuse(self, connection: Connection, reason: str) -> None:
        """A broken or tampered shepherd: say why and hang up (the receive loop sees it)."""
        self.status.update(message=f"refused: {reason}")
        await connection.send(protocol.Error(protocol.ErrorCode.MALFORMED, reason))
        await connection.stream.aclose()


class _Outbox:
    """A follower's connection: what its rounds would send goes nowhere (process 0 sends the
    site's one copy); it is never busy sending, and hanging it up is process 0's to do."""

    sending = False

    @property
    def stream(self) -> _Outbox:
        return self

    async def send(self, *message: object, **options: object) -> int:
        return 0

    async def aclose(self) -> None:
        return None
