"""What a run says happened: one event class per kind, each with the fields its readers use.

`RunState.emit(event)` records an event and tells every listener (the log, the dashboard,
the metrics file). Every event has its `message` (for people) and `at` (wall-clock time);
`kind` is the class's, for filters and the log. A reader that needs a field narrows first
(`isinstance(event, RoundDone)`), so a misspelled field fails the type checker, not a run.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from pcp_tui.diloco.screening import Refusal

if TYPE_CHECKING:
    from pcp_tui.shepherd.run.history import RoundRecord


class EventKind(enum.StrEnum):
    """Every kind of event a run emits: one `Event` class each, its `kind`."""

    EXPORTING = "exporting"
    EXPORTED = "exported"
    LISTENING = "listening"
    WAITING = "waiting"
    JOINED = "joined"
    REJOINED = "rejoined"
    RELAY_JOINED = "relay_joined"
    RELAY_LEFT = "relay_left"
    RELAY_FOLD_LOST = "relay_fold_lost"
    REFUSED = "refused"
    WORKER_KEYS = "worker_keys"
    COMPILED = "compiled"
    LOST = "lost"
    WORKER_REFUSED = "worker_refused"
    LEFT = "left"
    INTERNAL = "internal"
    SHARD_ADOPTED = "shard_adopted"
    SHARD_ORPHANED = "shard_orphaned"
    ROUND = "round"
    ROUND_REPEATED = "round_repeated"
    ROUND_WAITING = "round_waiting"
    EVALUATED = "evaluated"  # a round's held-out eval, which arrives after the round's event
    EVAL_SKIPPED = "eval_skipped"
    STRAGGLERS = "stragglers"
    LATE_RESULT = "late_result"
    BAD_RESULT = "bad_result"
    RESULT_CLIPPED = "result_clipped"
    PAUSED = "paused"
    RESUMED = "resumed"
    RESUMED_FROM = "resumed_from"
    STOP_REQUESTED = "stop_requested"
    RESUMABLE = "resumable"
    NOT_RESUMABLE = "not_resumable"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_FAILED = "checkpoint_failed"
    METRICS_FAILED = "metrics_failed"
    DONE = "done"
    FAILED = "failed"


_COMMON = ("message", "at")


@dataclass(frozen=True)
class Event:
    """An event with nothing to say beyond its message."""

    kind: ClassVar[EventKind]
    message: str
    at: float = field(default_factory=time.time, kw_only=True)

    def fields(self) -> dict[str, Any]:
        """What the event says beyond its message and time, by field name (metrics rows)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _COMMON}


# -- the run ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Exporting(Event):
    kind = EventKind.EXPORTING


@dataclass(frozen=True, kw_only=True)
class Exported(Event):
    kind = EventKind.EXPORTED
    seconds: float


@dataclass(frozen=True)
class Listening(Event):
    kind = EventKind.LISTENING


@dataclass(frozen=True)
class Waiting(Event):
    """The run waits for workers (which, and why, in the message)."""

    kind = EventKind.WAITING


@dataclass(frozen=True)
class Paused(Event):
    kind = EventKind.PAUSED


@dataclass(frozen=True)
class Resumed(Event):
    kind = EventKind.RESUMED


@dataclass(frozen=True, kw_only=True)
class ResumedFrom(Event):
    kind = EventKind.RESUMED_FROM
    round: int


@dataclass(frozen=True)
class StopRequested(Event):
    kind = EventKind.STOP_REQUESTED


@dataclass(frozen=True, kw_only=True)
class Resumable(Event):
    kind = EventKind.RESUMABLE
    directory: str


@dataclass(frozen=True)
class NotResumable(Event):
    kind = EventKind.NOT_RESUMABLE


@dataclass(frozen=True, kw_only=True)
class Checkpoint(Event):
    kind = EventKind.CHECKPOINT
    round: int
    path: str


@dataclass(frozen=True, kw_only=True)
class CheckpointFailed(Event):
    kind = EventKind.CHECKPOINT_FAILED
    round: int


@dataclass(frozen=True, kw_only=True)
class MetricsFailed(Event):
    kind = EventKind.METRICS_FAILED
    path: str


@dataclass(frozen=True, kw_only=True)
class Done(Event):
    kind = EventKind.DONE
    rounds: int
    final_eval_loss: float | None
    seconds: float


@dataclass(frozen=True)
class Failed(Event):
    kind = EventKind.FAILED


# -- peers and workers ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PeerRefused(Event):
    """A peer refused or dropped before admission; `suppressed` more like it went unshown."""

    kind = EventKind.REFUSED
    peer: str
    code: str = ""
    suppressed: int = 0


@dataclass(frozen=True)
class WorkerKeysRead(Event):
    """--worker-keys changed and was read again: how many keys it holds, what was left out."""

    kind = EventKind.WORKER_KEYS


@dataclass(frozen=True, kw_only=True)
class WorkerEvent(Event):
    """Something about one worker (its id)."""

    worker: str


@dataclass(frozen=True, kw_only=True)
class Joined(WorkerEvent):
    kind = EventKind.JOINED
    shard: int
    platform: str
    devices: int
    processes: int = 1  # a site: one worker over several hosts' processes


@dataclass(frozen=True, kw_only=True)
class Rejoined(Joined):
    kind = EventKind.REJOINED


@dataclass(frozen=True, kw_only=True)
class RelayJoined(Event):
    """A relay connected (`pcp-tui relay`); its workers join through it, each on its own."""

    kind = EventKind.RELAY_JOINED
    relay: str


@dataclass(frozen=True, kw_only=True)
class RelayLeft(Event):
    kind = EventKind.RELAY_LEFT
    relay: str


@dataclass(frozen=True, kw_only=True)
class RelayFoldLost(Event):
    """A relay's fold of a round's results did not count (it never answered, or its answer
    did not agree with itself or its notices): those results count for nothing."""

    kind = EventKind.RELAY_FOLD_LOST
    relay: str
    round: int
    workers: int  # results the shepherd had notices of that the fold held


@dataclass(frozen=True, kw_only=True)
class Compiled(WorkerEvent):
    kind = EventKind.COMPILED


@dataclass(frozen=True, kw_only=True)
class Lost(WorkerEvent):
    kind = EventKind.LOST
    # its message held a NaN or infinite number it must not (`protocol.NonFinite`): a
    # diverged worker, which `rounds/divergence.py` tells from a broken link by this
    non_finite: bool = False


@dataclass(frozen=True, kw_only=True)
class WorkerRefused(WorkerEvent):
    """A worker that joined and that the shepherd cannot serve (its devices cannot split the
    batch, its platform has no graphs): it is told why and dropped; not a lost link."""

    kind = EventKind.WORKER_REFUSED


@dataclass(frozen=True, kw_only=True)
class Left(WorkerEvent):
    kind = EventKind.LEFT


@dataclass(frozen=True, kw_only=True)
class Internal(WorkerEvent):
    """A worker's task failed inside the shepherd: the worker is dropped, the run goes on."""

    kind = EventKind.INTERNAL


@dataclass(frozen=True, kw_only=True)
class ShardAdopted(WorkerEvent):
    kind = EventKind.SHARD_ADOPTED
    shard: int


@dataclass(frozen=True, kw_only=True)
class ShardOrphaned(WorkerEvent):
    kind = EventKind.SHARD_ORPHANED
    shard: int


# -- rounds -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RoundDone(Event):
    kind = EventKind.ROUND
    record: RoundRecord


@dataclass(frozen=True, kw_only=True)
class RoundRepeated(Event):
    kind = EventKind.ROUND_REPEATED
    round: int


@dataclass(frozen=True)
class RoundWaiting(Event):
    kind = EventKind.ROUND_WAITING


@dataclass(frozen=True, kw_only=True)
class Evaluated(Event):
    """Round `round`'s held-out eval, ended after the round's own event (`run/evaluation.py`)."""

    kind = EventKind.EVALUATED
    round: int
    eval_loss: float


@dataclass(frozen=True, kw_only=True)
class EvalSkipped(Event):
    kind = EventKind.EVAL_SKIPPED
    round: int


@dataclass(frozen=True, kw_only=True)
class Stragglers(Event):
    kind = EventKind.STRAGGLERS
    workers: list[str]


@dataclass(frozen=True, kw_only=True)
class LateResult(WorkerEvent):
    kind = EventKind.LATE_RESULT
    round: int


@dataclass(frozen=True, kw_only=True)
class ResultRefused(WorkerEvent):
    kind = EventKind.BAD_RESULT
    round: int
    refusal: Refusal  # why, for code (`rounds/divergence.py`); the message is for people


@dataclass(frozen=True, kw_only=True)
class ResultClipped(WorkerEvent):
    kind = EventKind.RESULT_CLIPPED
    round: int
    scale: float
