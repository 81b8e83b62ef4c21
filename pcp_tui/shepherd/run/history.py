"""One finished round as the run's history keeps it: `RoundRecord`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class RoundRecord:
    round: int
    train_loss: float
    eval_loss: float | None
    round_seconds: float
    compute_seconds: float  # slowest contributor's compute time
    communication_seconds: float  # parameter send + result receive, beyond compute
    straggler_seconds: float  # waiting for the slowest after the median had returned
    tokens: int
    tokens_per_second: float
    bytes_sent: int
    bytes_received: int
    workers: int
    worker_ids: tuple[str, ...]
    relays: int = 0  # relays whose workers' results count in it (`pcp-tui relay`)
    relay_folded: int = 0  # results its relays folded: their tensors never reached the shepherd
    bytes_saved: int = 0  # by pseudo-gradient compression, this round
    untrained_shards: tuple[int, ...] = ()  # data shards no contributor of this round trained
    # compute seconds / (contributors x round seconds): the run's share of wall time spent training
    utilization: float = 0.0
    # worker id -> its compute seconds / round seconds, one entry per contributor
    worker_utilization: Mapping[str, float] = field(default_factory=dict, hash=False)
    # what synchronous data parallelism would have exchanged for the same tokens (see rounds.py)
    bytes_data_parallel: int = 0
    # the largest single result on the wire: a worker's peak bytes in flight (streaming: ~1/F)
    largest_result_bytes: int = 0
    # Streaming DiLoCo: results folded into each fragment's outer step this round; () when plain
    fragment_results: tuple[int, ...] = ()

    @property
    def bytes_exchanged(self) -> int:
        """Bytes that crossed the wire this round, both directions."""
        return self.bytes_sent + self.bytes_received

    def data_parallel_ratio(self) -> float | None:
        """How many times fewer bytes than synchronous data parallelism (None if nothing moved)."""
        if self.bytes_exchanged <= 0 or self.bytes_data_parallel <= 0:
            return None
        return self.bytes_data_parallel / self.bytes_exchanged

    def counting(self, tokens: Mapping[str, int], untrained_shards: tuple[int, ...]) -> RoundRecord:
        """This round with only the results of `tokens`' workers (id -> tokens), the others
        refused after it was recorded; `untrained_shards` as those results leave them."""
        each = {w: u for w, u in self.worker_utilization.items() if w in tokens}
        total = sum(tokens.values())
        # data parallelism's bytes are linear in the contributors (`data_parallel_bytes`)
        per_worker = self.bytes_data_parallel // self.workers if self.workers else 0
        return replace(
            self,
            worker_ids=tuple(tokens),
            workers=len(tokens),
            tokens=total,
            tokens_per_second=total / self.round_seconds if self.round_seconds > 0 else 0.0,
            untrained_shards=untrained_shards,
            utilization=sum(each.values()) / len(each) if each else 0.0,
            worker_utilization=each,
            bytes_data_parallel=per_worker * len(tokens),
        )

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["worker_ids"] = list(self.worker_ids)
        data["worker_utilization"] = dict(self.worker_utilization)
        data["untrained_shards"] = list(self.untrained_shards)
        data["fragment_results"] = list(self.fragment_results)
        return {"event": "round", **data}
