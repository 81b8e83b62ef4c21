"""The shard ledger's rules, one at a time (the end-to-end case is in test_elastic.py)."""

from __future__ import annotations

import tracemalloc

from hypothesis import given
from hypothesis import strategies as st

from pcp_tui.shepherd.run.ledger import ShardLedger


def test_a_lost_workers_shard_goes_to_the_next_joiner_and_a_returning_worker_gets_its_own():
    ledger = ShardLedger(2)
    assert ledger.assign("a") == (0, False)
    assert ledger.assign("b") == (1, False)
    ledger.trained(1, 100)  # b's
    assert ledger.release("b") == 1 and ledger.orphaned() == [1]
    assert ledger.assign("c") == (1, True)  # adopted: b held it, nobody does now
    assert ledger.release("a") == 0
    assert ledger.assign("b") == (0, True)  # its own shard is taken: it adopts a's
    assert ledger.release("c") == 1
    assert ledger.assign("c") == (1, False)  # back to its own, still free
    assert ledger.assign("c") == (1, False)  # a reconnect keeps the shard it holds


def test_getting_its_own_shard_back_is_no_adoption_whoever_held_it_in_between():
    ledger = ShardLedger(2)
    ledger.assign("a"), ledger.assign("b")
    ledger.release("b")
    assert ledger.assign("c") == (1, True)  # c adopts b's shard
    ledger.release("c")
    assert ledger.assign("b") == (1, False)  # b is back on its own shard: no "took over"


def test_more_workers_than_shards_share_the_least_crowded_and_release_orphans_only_the_last():
    ledger = ShardLedger(2)
    assert [ledger.assign(w)[0] for w in ("a", "b", "c", "d", "e")] == [0, 1, 0, 1, 0]
    assert ledger.release("a") is None  # c and e still train shard 0
    assert ledger.release("b") is None
    assert ledger.release("d") == 1


def test_progress_and_last_holders_survive_a_checkpoint():
    ledger = ShardLedger(3)
    for worker in ("a", "b", "c"):
        ledger.assign(worker)
    ledger.trained(1, 64)  # b's
    ledger.trained(1, 64)  # b's
    restored = ShardLedger(3)
    restored.restore(ledger.as_meta())
    assert [(s.rounds, s.tokens) for s in restored.shards] == [(0, 0), (2, 128), (0, 0)]
    assert restored.orphaned() == [0, 1, 2]  # nobody is connected after a restart
    assert restored.assign("c") == (2, False)  # its shard from before the restart
    fewer = ShardLedger(2)
    fewer.restore(ledger.as_meta())  # c's shard 2 no longer exists: c gets a free one
    assert fewer.assign("c") == (0, True)  # a's, adopted


def test_a_worker_refused_before_it_trained_gives_its_shard_back_as_if_never_held():
    ledger = ShardLedger(2)
    assert ledger.assign("r") == (0, False)
    assert ledger.withdraw("r") is None  # it never trained shard 0: nothing is orphaned
    assert ledger.assign("a") == (0, False)  # the first real worker takes nothing over
    assert ledger.assign("b") == (1, False)
    assert ledger.release("b") == 1
    assert ledger.assign("b") == (1, False)
    ledger.release("b")
    assert ledger.assign("c") == (1, True)  # c adopts b's shard
    assert ledger.assign("b") == (0, False)  # b, back on shard 0 beside a, is refused:
    assert ledger.withdraw("b") is None
    ledger.release("c")
    assert ledger.assign("b") == (1, False)  # its own shard again, not an adoption
    assert ledger.assign("b") == (1, False)  # a replaced connection, refused: it held it
    assert ledger.withdraw("b") == 1


class _Oracle:
    """The ledger's rules read off whole lists each time (as it was written before it kept
    indexes): what `ShardLedger` must decide, join by join."""

    def __init__(self, shards: int):
        self.owners: list[list[str]] = [[] for _ in range(shards)]
        self.last: dict[str, int] = {}
        self.before: dict[str, tuple[int | None, bool]] = {}

    def shard_of(self, worker: str) -> int | None:
        return next((i for i, owners in enumerate(self.owners) if worker in owners), None)

    def assign(self, worker: str) -> tuple[int, bool]:
        held, previous = self.shard_of(worker), self.last.get(worker)
        self.before[worker] = (previous, held is not None)
        if held is not None:
            return held, False
        free = [i for i, owners in enumerate(self.owners) if not owners]
        if previous is not None and not self.owners[previous]:
            chosen = previous
        elif free:
            chosen = free[0]
        else:
            chosen = min(range(len(self.owners)), key=lambda i: (len(self.owners[i]), i))
        adopted = (
            chosen != previous
            and not self.owners[chosen]
            and any(i == chosen and w != worker for w, i in self.last.items())
        )
        self.owners[chosen].append(worker)
        self.last[worker] = chosen
        return chosen, adopted

    def release(self, worker: str) -> int | None:
        shard = self.shard_of(worker)
        if shard is None:
            return None
        self.owners[shard].remove(worker)
        return None if self.owners[shard] else shard

    def withdraw(self, worker: str) -> int | None:
        shard = self.shard_of(worker)
        previous, held = self.before.pop(worker, (self.last.get(worker), True))
        if shard is None:
            return None
        self.owners[shard].remove(worker)
        if previous is None:
            del self.last[worker]
        else:
            self.last[worker] = previous
        return shard if held and not self.owners[shard] else None


@given(
    shards=st.integers(1, 6),
    steps=st.lists(
        st.tuples(st.sampled_from(["assign", "release", "withdraw", "restart"]), st.integers(0, 9)),
        max_size=60,
    ),
)
def test_the_ledger_decides_every_join_and_leave_as_the_rules_read_off_whole_lists(shards, steps):
    """Joins, leaves and refusals in any order, workers coming back, more workers than shards,
    restarts from a checkpoint (of a run with 1 to 6 shards) between them: each shard given,
    adoption, orphan and checkpointed last holder is the oracle's."""
    ledger, oracle = ShardLedger(shards), _Oracle(shards)
    for op, worker in steps:
        name = f"w{worker}"
        if op == "restart":  # the shepherd restarts from its checkpoint, maybe resized
            shards = worker % 6 + 1
            meta = ledger.as_meta()
            ledger, oracle = ShardLedger(shards), _Oracle(shards)
            ledger.restore(meta)
            oracle.last = {w: i for w, i in meta["last_shard"].items() if i < shards}
            continue
        assert getattr(ledger, op)(name) == getattr(oracle, op)(name), (op, name)
        assert ledger.orphaned() == [i for i, o in enumerate(oracle.owners) if not o]
        assert ledger.as_meta()["last_shard"] == oracle.last


def test_a_worker_that_reconnects_for_ever_holds_no_more_of_the_ledger():
    """Red team on the free shards' heap: a worker that got its own shard back while a lower
    shard was free left a second copy of its shard in the heap each time (nothing popped
    it), so each reconnect held 8 bytes more, for the run's life: 10,000 reconnects, 80 kB."""
    ledger = ShardLedger(4)
    ledger.assign("a"), ledger.assign("b")
    ledger.release("a")  # shard 0 is free from now on

    def reconnect(times: int) -> None:
        for _ in range(times):
            ledger.release("b")
            assert ledger.assign("b") == (1, False)

    reconnect(100)  # what a first few allocate (an interned string, a grown list) aside
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        reconnect(10_000)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 1_000, grown
