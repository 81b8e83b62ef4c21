"""Which worker trains which data shard, and how much each shard has been trained.

A run splits its data into shards; every shard should keep being trained however
workers come and go. The ledger hands a joining worker the shard it held before
(a reconnect, or a restart from a checkpoint) if that shard is still free, else a
shard nobody trains (a lost worker's: it is *adopted*), else, once every shard
has a worker, the shard with the fewest. When a shard's last worker goes, it is
*orphaned* until the next joiner takes it. Progress (rounds and tokens trained)
is kept per shard, so a report can say which part of the data fell behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Shard:
    """One shard's owners now, its last owners, and what has been trained on it."""

    index: int
    owners: list[str] = field(default_factory=list)
    rounds: int = 0
    tokens: int = 0


class ShardLedger:
    """Shard ownership and progress for one run; the shepherd's single record of both."""

    def __init__(self, shard_count: int):
        self.shards = [Shard(index) for index in range(shard_count)]
        self._last: dict[str, int] = {}  # worker id -> the shard it held last
        # worker id -> (its last shard, whether it held it) before its latest `assign`
        self._before: dict[str, tuple[int | None, bool]] = {}

    def assign(self, worker_id: str) -> tuple[int, bool]:
        """The shard `worker_id` trains from now on, and whether it adopts an orphan.

        A worker that already holds a shard keeps it (a connection replaced by a
        reconnect). It adopts a shard that another worker held last and nobody holds now;
        getting back the shard it held itself last is no adoption, whoever held it before.
        """
        held = self.shard_of(worker_id)
        previous = self._last.get(worker_id)
        self._before[worker_id] = (previous, held is not None)
        if held is not None:
            return held, False
        free = [s for s in self.shards if not s.owners]
        if previous is not None and not self.shards[previous].owners:
            chosen = self.shards[previous]
        elif free:
            chosen = free[0]
        else:
            chosen = min(self.shards, key=lambda s: (len(s.owners), s.index))
        adopted = (
            chosen.index != previous
            and not chosen.owners
            and any(
                index == chosen.index and worker != worker_id
                for worker, index in self._last.items()
            )
        )
        chosen.owners.append(worker_id)
        self._last[worker_id] = chosen.index
        return chosen.index, adopted

    def release(self, worker_id: str) -> int | None:
        """`worker_id` stopped training; the shard it leaves without a worker, if any."""
        shard = self.shard_of(worker_id)
        if shard is None:
            return None
        owners = self.shards[shard].owners
        owners.remove(worker_id)
        return None if owners else shard

    def withdraw(self, worker_id: str) -> int | None:
        """`worker_id` was refused before it trained (`worker_refused`): it gives back the shard
        its latest `assign` gave it as if it had never held it, and the shard it held last
        before stays its last (a newcomer given that shard takes nothing over). The shard it
        leaves without a worker, if it held it before that `assign` (a replaced connection)."""
        shard = self.shard_of(worker_id)
        previous, held = self._before.pop(worker_id, (self._last.get(worker_id), True))
        if shard is None:
            return None
        owners = self.shards[shard].owners
        owners.remove(worker_id)
        if previous is None:
            del self._last[worker_id]
        else:
            self._last[worker_id] = previous
        return shard if held and not owners else None

    def trained(self, shard: int | None, tokens: int) -> None:
        """Count one round's result, trained on `shard` (None: none), towards that shard."""
        if shard is not None:
            self.shards[shard].rounds += 1
            self.shards[shard].tokens += tokens

    def shard_of(self, worker_id: str) -> int | None:
        for shard in self.shards:
            if worker_id in shard.owners:
                return shard.index
        return None

    def orphaned(self) -> list[int]:
        """Shards no live worker trains."""
        return [s.index for s in self.shards if not s.owners]

    def as_meta(self) -> dict[str, Any]:
        """For the checkpoint: each shard's progress and who held each shard last."""
        return {
            "shards": [{"rounds": s.rounds, "tokens": s.tokens} for s in self.shards],
            "last_shard": dict(self._last),
        }

    def restore(self, meta: dict[str, Any]) -> None:
        """Take progress and last holders from a checkpoint; nobody owns a shard yet.

        A checkpoint made with another number of shards keeps only what fits.
        """
        for shard, saved in zip(self.shards, meta.get("shards", []), strict=False):
            shard.rounds, shard.tokens = int(saved["rounds"]), int(saved["tokens"])
        self._last = {
            str(worker): int(index)
            for worker, index in meta.get("last_shard", {}).items()
            if 0 <= int(index) < len(self.shards)
        }
