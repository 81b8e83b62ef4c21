"""The one object that holds a run's state: the shepherd writes, views read.

The dashboard and the headless printer never reach into sockets or the
training loop; they read `RunState` and subscribe to its events.
"""

from __future__ import annotations

import collections
import enum
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pcp_tui.shepherd.run.events import Evaluated, Event
from pcp_tui.shepherd.run.history import RoundRecord
from pcp_tui.shepherd.run.ledger import ShardLedger

if TYPE_CHECKING:
    from pcp_tui.config import RunConfig
    from pcp_tui.protocol import WorkerStats


class RunStatus(enum.StrEnum):
    """Where the run is; views and the API show the value."""

    STARTING = "starting"
    WAITING = "waiting"
    TRAINING = "training"
    PAUSED = "paused"
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"  # by the operator, resumable (its checkpoint, `--resume`)
    CANCELLED = "cancelled"  # for good: its workers exit

    @property
    def finished(self) -> bool:
        return self in FINISHED


FINISHED = frozenset({RunStatus.DONE, RunStatus.FAILED, RunStatus.STOPPED, RunStatus.CANCELLED})


class WorkerState(enum.StrEnum):
    """Where a worker is, in the order it normally passes through them (the worker's own
    progress phases, `protocol.Phase`, are among them: idle, training, syncing)."""

    CONNECTING = "connecting"
    COMPILING = "compiling"
    IDLE = "idle"
    TRAINING = "training"
    SYNCING = "syncing"
    LOST = "lost"
    REFUSED = "refused"
    LEFT = "left"


WORKER_STATES = tuple(WorkerState)


@dataclass
class WorkerView:
    worker_id: str
    index: int
    host: str
    backend: str = ""
    state: WorkerState = WorkerState.CONNECTING
    round: int = 0
    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    tokens_per_second: float = 0.0
    last_heard: float = field(default_factory=time.monotonic)
    bytes_in: int = 0
    bytes_out: int = 0
    rounds_contributed: int = 0
    reason: str = ""
    shard: int | None = None  # the data shard it trains (see ShardLedger)
    runtime: str = "xla"  # what runs its graphs: "xla" (JAX) or "iree"
    devices: int = 1  # devices it trains on as one worker (pcp-tui worker --devices), all hosts
    processes: int = 1  # a site: its processes (multi-controller JAX, one a host)
    hosts: tuple[str, ...] = ()  # a site: its processes' hosts, process 0's first
    via: str = ""  # the relay it joined through (`pcp-tui relay`); "": it dialled the shepherd
    network: str = ""  # the address it connected from (IPv6: its /64): --weight-per address
    compile_seconds: float | None = None
    # its own statistics, from its latest progress message (WorkerStats)
    steps_trained: int = 0  # inner steps since the worker process started
    tokens_trained: int = 0
    memory_in_use: int | None = None  # bytes; None: not measured
    memory_peak: int | None = None
    memory_limit: int | None = None
    gpu_utilization: float | None = None  # 0..1 (NVML); None: not measured

    def record_stats(self, stats: WorkerStats) -> None:
        """Take a progress message's statistics; zero memory and -1 utilization mean unknown."""
        self.steps_trained = stats.steps
        self.tokens_trained = stats.tokens
        self.memory_in_use = stats.memory_in_use_bytes or None
        self.memory_peak = stats.memory_peak_bytes or None
        self.memory_limit = stats.memory_limit_bytes or None
        self.gpu_utilization = stats.gpu_utilization if stats.gpu_utilization >= 0 else None

    def stats_json(self) -> dict[str, Any]:
        """Its runtime, devices and statistics, as /v1/workers and the metrics file list them."""
        return {
            "runtime": self.runtime,
            "devices": self.devices,
            "processes": self.processes,
            "hosts": list(self.hosts) or [self.host],
            "shard": self.shard,
            "via": self.via or None,
            "network": self.network or None,  # --weight-per address: its ids share one weight
            "compile_seconds": self.compile_seconds,
            "steps_trained": self.steps_trained,
            "tokens_trained": self.tokens_trained,
            "memory_in_use_bytes": self.memory_in_use,
            "memory_peak_bytes": self.memory_peak,
            "memory_limit_bytes": self.memory_limit,
            "gpu_utilization": self.gpu_utilization,
        }


Listener = Callable[[Event], None]


class RunState:
    """Everything a view may show about a run."""

    def __init__(self, *, run_id: str, rounds_total: int, settings: dict[str, Any]):
        self.run_id = run_id
        self.rounds_total = rounds_total
        self.settings = settings  # model, algorithm and its hyper-parameters, for display
        self.model_name = ""
        self.param_count = 0
        self.address = ""
        self.join_command = ""
        self.api_address = ""  # "host:port" of the operator API, when it is on
        self.api_url = ""  # and where clients reach it (http or https)
        self.status = RunStatus.STARTING
        self.round = 0
        self.first_round = 1  # the first this shepherd runs: after --resume, the checkpoint's + 1
        # the checkpoint's (round, eval loss) (None: not said), until this run evaluates
        self.resumed_eval: tuple[int | None, float | None] = (None, None)
        self.started_at = time.monotonic()
        self.finished_at: float | None = None
        self.workers: dict[str, WorkerView] = {}
        # worker id -> results of its refused (a rejoin keeps them: `sitting_out.settled`)
        self.refusals: collections.Counter[str] = collections.Counter()
        self.shards = ShardLedger(0)  # replaced by the shepherd with one for its data
        self.history: list[RoundRecord] = []
        # (global step, loss, worker index), one per progress message
        self.step_losses: collections.deque[tuple[int, float, int]] = collections.deque(
            maxlen=20_000
        )
        self.events: collections.deque[Event] = collections.deque(maxlen=2_000)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def emit(self, event: Event) -> Event:
        """Record `event` and tell every listener."""
        self.events.append(event)
        for listener in self._listeners:
            listener(event)
        return event

    def elapsed(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return end - self.started_at

    def rounds_done(self) -> int:
        """The last round finished, counting those before a --resume (history holds only ours)."""
        return self.history[-1].round if self.history else self.first_round - 1

    def rounds_summary(self) -> str:
        """How far the run got: 'after 12 rounds', or after a --resume
        'after round 12 of 20 (2 rounds since resuming after round 10)'."""
        ran = f"{len(self.history)} round{'' if len(self.history) == 1 else 's'}"
        if self.first_round == 1:
            return f"after {ran}"
        return (
            f"after round {self.rounds_done()} of {self.rounds_total} ({ran} "
            f"since resuming after round {self.first_round - 1})"
        )

    def eta_seconds(self) -> float | None:
        if not self.history:
            return None
        mean = sum(r.round_seconds for r in self.history) / len(self.history)
        return mean * max(self.rounds_total - self.rounds_done(), 0)

    def evaluated(self, number: int, loss: float) -> None:
        """Attach round `number`'s eval loss to its history entry (the eval runs off the
        rounds' path and ends after the round's own event); emit `evaluated`."""
        for index in range(len(self.history) - 1, -1, -1):
            if self.history[index].round == number:
                self.history[index] = replace(self.history[index], eval_loss=loss)
                break
        self.emit(Evaluated(f"round {number}: eval loss {loss:.4f}", round=number, eval_loss=loss))

    def count(
        self,
        number: int,
        tokens: Mapping[str, int],
        fragment_results: tuple[int, ...] | None,
        *,
        shards: Mapping[str, int | None],
    ) -> None:
        """Round `number` is settled: the results of the workers in `tokens` (id -> tokens
        trained) count towards their rounds and the progress of the shards they trained
        (`shards`: id -> shard, as the round ran). `fragment_results` (() for a plain round),
        if not None: its checks refused results after the round's own event
        (`shepherd/rounds/checks.py`), and its history entry counts only these."""
        for worker_id, its_tokens in tokens.items():
            self.workers[worker_id].rounds_contributed += 1
            self.shards.trained(shards[worker_id], its_tokens)
        if fragment_results is None:
            return
        trained = {shards[worker_id] for worker_id in tokens}
        untrained = tuple(s.index for s in self.shards.shards if s.index not in trained)
        for index in range(len(self.history) - 1, -1, -1):
            if self.history[index].round == number:
                entry = self.history[index].counting(tokens, untrained)
                self.history[index] = replace(entry, fragment_results=fragment_results)
                break

    def last_eval_loss(self) -> float | None:
        """The eval loss of the last round that was evaluated, by this shepherd or, after a
        --resume, by the run it continues (None: none was yet)."""
        return self.eval_at(None)[1]

    def eval_at(self, number: int | None) -> tuple[int | None, float | None]:
        """(round, eval loss) of the last round up to `number` (None: any) that was evaluated,
        as `last_eval_loss`; the round is None where a checkpoint resumed from did not say."""
        for entry in reversed(self.history):
            if entry.eval_loss is not None and (number is None or entry.round <= number):
                return entry.round, entry.eval_loss
        return self.resumed_eval

    def active_workers(self) -> list[WorkerView]:
        return [w for w in self.workers.values() if w.state not in ("lost", "refused", "left")]


def run_settings(config: RunConfig) -> dict[str, Any]:
    """The run's algorithm and hyper-parameters as views show them (`RunState.settings`)."""
    return {
        "algorithm": "DiLoCo",
        "workers": config.network.workers,
        "inner_steps": config.inner.steps,
        "inner_optimizer": config.inner.optimizer,
        "inner_lr": config.inner.lr,
        "outer_optimizer": config.outer.optimizer,
        "outer_lr": config.outer.lr,
        "outer_momentum": config.outer.momentum,
        "batch_size": config.data.batch_size,
        "seq_len": config.data.seq_len,
        "compression": config.outer.compression,
        "sharding": config.sharding.mode,  # inside multi-device workers: data | fsdp
        **(
            {
                "streaming_fragments": config.inner.streaming_fragments,
                "overlap_steps": config.inner.overlap_steps,
                "mix_alpha": config.inner.mix_alpha,
                "overlap_merge": config.inner.overlap_merge,
            }
            if config.inner.streaming
            else {}
        ),
    }


def finite_or_null(data: Any) -> Any:
    """`data` with every NaN or infinity as None: JSON has neither (a diverged loss, say), so
    every JSON pcp-tui writes (metrics file, API, checkpoint meta) shows one as null."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: finite_or_null(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [finite_or_null(value) for value in data]
    return data
