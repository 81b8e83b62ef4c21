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

import collections
import heapq
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
        self._holds: dict[str, int] = {}  # worker id -> the shard it holds now (`shard_of`)
        # shards that may have no owner (a heap, each shard in it once: `_in_free`; ones taken
        # since are skipped) and how many workers held each last: a join looks at neither
        # list whole (N joins were N² steps)
        self._free = list(range(shard_count))
        self._in_free = set(self._free)
        self._last_holders: collections.Counter[int] = collections.Counter()

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
        free = self._first_free()
        if previous is not None and not self.shards[previous].owners:
            chosen = self.shards[previous]
        elif free is not None:
            chosen = free
        else:
            chosen = min(self.shards, key=lambda s: (len(s.owners), s.index))
        # another worker held it last (this one's last is `previous`, not it)
        adopted = (
            chosen.index != previous
            and not chosen.owners
            and bool(self._last_holders[chosen.index])
        )
        chosen.owners.append(worker_id)
        self._holds[worker_id] = chosen.index
        self._held_last(worker_id, chosen.index)
        return chosen.index, adopted

    def release(self, worker_id: str) -> int | None:
        """`worker_id` stopped training; the shard it leaves without a worker, if any."""
        shard = self.shard_of(worker_id)
        if shard is None:
            return None
        owners = self.shards[shard].owners
        owners.remove(worker_id)
        del self._holds[worker_id]
        if not owners:
            self._freed(shard)
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
        del self._holds[worker_id]
        if not owners:
            self._freed(shard)
        self._held_last(worker_id, previous)
        return shard if held and not owners else None

    def trained(self, shard: int | None, tokens: int) -> None:
        """Count one round's result, trained on `shard` (None: none), towards that shard."""
        if shard is not None:
            self.shards[shard].rounds += 1
            self.shards[shard].tokens += tokens

    def shard_of(self, worker_id: str) -> int | None:
        return self._holds.get(worker_id)

    def _first_free(self) -> Shard | None:
        """The lowest shard nobody holds, or None."""
        while self._free and self.shards[self._free[0]].owners:
            self._in_free.discard(heapq.heappop(self._free))
        return self.shards[self._free[0]] if self._free else None

    def _freed(self, shard: int) -> None:
        """`shard` has no owner now: in the heap, unless it is there already (a worker that
        got its own shard back while a lower one was free left it there: each reconnect
        held one more copy)."""
        if shard not in self._in_free:
            self._in_free.add(shard)
            heapq.heappush(self._free, shard)

    def _held_last(self, worker_id: str, shard: int | None) -> None:
        """`worker_id` held `shard` last (None: nothing)."""
        old = self._last.get(worker_id)
        if old is not None:
            self._last_holders[old] -= 1
        if shard is None:
            self._last.pop(worker_id, None)
        else:
            self._last[worker_id] = shard
            self._last_holders[shard] += 1

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
        self._last_holders = collections.Counter(self._last.values())
