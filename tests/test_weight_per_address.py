"""In an open run, the ids that connect from one address share one id's weight.

`--weight-per address` (the default without `--worker-keys`): a token holder who joins
as k ids from one address gets what the fewest ids of any address get. Real shepherd and
real workers (`Worker`, in this process) over TCP on 127.0.0.1, each dialling from its own
loopback address (`--source-address`), real JAX; the weights are read from the round's
own fold (centered clip's partial: one entry per result folded in).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import trio

from pcp_tui.config.relay import RelayConfig
from pcp_tui.contract.connection import Refused
from pcp_tui.diloco import aggregate
from pcp_tui.diloco.aggregate import CoordinateWise
from pcp_tui.relay import Relay
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.shepherd.rounds.results import weight_shares
from pcp_tui.testing import local_worker, until
from pcp_tui.testing.faulty_worker import FAULTS
from pcp_tui.training.build import build_workload
from pcp_tui.worker.reconnect import dial

from .conftest import small_config

SOURCES = {"alone": "127.0.0.2", "twin-1": "127.0.0.3", "twin-2": "127.0.0.3"}


def _run(weight_per: str) -> Shepherd:
    config = small_config(rounds=2, inner_steps=4, chunk_steps=2, workers=3, weight_per=weight_per)
    shepherd = Shepherd(config, build_workload(config, shards=3))

    async def main():
        async with trio.open_nursery() as nursery:
            port = await nursery.start(shepherd.run)
            for worker_id, source in SOURCES.items():  # joined in this order: shards 0, 1, 2
                worker = local_worker(port, worker_id, source_address=source)
                nursery.start_soon(worker.run)
                await until(lambda w=worker_id: w in shepherd.state.workers)

    trio.run(main)
    return shepherd


@pytest.mark.parametrize("weight_per", ["address", "id"])
def test_ids_from_one_address_weigh_as_one(weight_per):
    shepherd = _run(weight_per)
    assert {w: v.network for w, v in shepherd.state.workers.items()} == SOURCES
    assert [len(r.worker_ids) for r in shepherd.state.history] == [3, 3]
    tokens = 4 * 4 * 32  # a result: inner steps x batch x sequence
    folded = shepherd.engine.aggregates[0].partial.results  # the last round's results
    weights = {w: entry.weight for w, entry in folded.items()}
    if weight_per == "address":  # the twins' address weighs what the other one does
        assert weights == {"alone": tokens, "twin-1": tokens / 2, "twin-2": tokens / 2}
    else:
        assert weights == dict.fromkeys(SOURCES, tokens)
    # the ledger counts every id's tokens whatever its weight
    assert shepherd.state.history[-1].tokens == 3 * tokens


def test_every_network_weighs_what_its_fewest_ids_weigh():
    rng = random.Random(0)
    for _ in range(200):
        networks = {f"w{i}": f"10.0.0.{rng.randrange(4)}" for i in range(rng.randrange(1, 12))}
        shares = weight_shares(networks)
        counts = {n: list(networks.values()).count(n) for n in set(networks.values())}
        fewest = min(counts.values())
        for network in counts:
            total = sum(shares.get(w, 1.0) for w, n in networks.items() if n == network)
            assert total == pytest.approx(fewest, rel=1e-15)
        # a share is listed only below 1: none at all where every network sends as many ids
        assert all(share < 1 for share in shares.values())
        assert (shares == {}) == (len(set(counts.values())) == 1)


async def test_a_relay_cannot_name_its_workers_addresses(monkeypatch):
    """A relay is any token holder's to run (`--relays N` takes the token): the address it
    reports for a worker is its word, not a socket's. A holder's relay that reported one of
    its ids as an honest worker's address (halving that worker's weight) and another as an
    address of its own making (a full weight) gained 1.5 ids' weight over one honest id's
    0.5; its workers are weighed by the relay's own address, the one its link comes from."""
    import pcp_tui.relay

    forged = {"127.0.0.5": "127.0.0.2:40000", "127.0.0.6": "10.9.9.9:40000"}  # what it says
    real = pcp_tui.relay.peer_name
    monkeypatch.setattr(
        pcp_tui.relay, "peer_name", lambda raw: forged.get(real(raw).split(":")[0], real(raw))
    )
    config = small_config(rounds=2, inner_steps=4, chunk_steps=2, workers=3, relays=1)
    shepherd = Shepherd(config, build_workload(config, shards=3))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(shepherd.run)
        relay_config = RelayConfig(
            connect=f"127.0.0.1:{port}",
            host="127.0.0.1",
            port=0,
            worker_id="holder-relay",
            source_address="127.0.0.3",
        )
        relay = Relay(relay_config, token="test-token", say=lambda line: None)
        relay_port = await nursery.start(relay.run)
        await until(lambda: bool(shepherd.pool.relays.live))
        joins = [("honest", port, "127.0.0.2"), ("x1", relay_port, "127.0.0.5")]
        joins.append(("x2", relay_port, "127.0.0.6"))
        for worker_id, to, source in joins:
            nursery.start_soon(local_worker(to, worker_id, source_address=source).run)
            await until(lambda w=worker_id: w in shepherd.state.workers)
    views = shepherd.state.workers
    assert {w: v.network for w, v in views.items()} == {
        "honest": "127.0.0.2",
        "x1": "127.0.0.3",
        "x2": "127.0.0.3",
    }
    tokens = 4 * 4 * 32
    folded = shepherd.engine.aggregates[0].partial.results
    assert {w: e.weight for w, e in folded.items()} == {
        "honest": tokens,
        "x1": tokens / 2,
        "x2": tokens / 2,
    }


@pytest.mark.parametrize(
    ("source", "says"),
    [
        # an IPv6 source for an IPv4 shepherd was retried until --give-up-after, each try
        # "cannot reach 127.0.0.1:PORT (all attempts to connect to 127.0.0.1:PORT failed)"
        ("::1", "--source-address ::1 is IPv6 and the shepherd's address 127.0.0.1 is IPv4"),
        ("localhost", "--source-address 'localhost' is not an IP address: name one that"),
        ("203.0.113.7", "--source-address 203.0.113.7 is not an address of this machine"),
    ],
)
async def test_a_source_address_that_cannot_work_is_refused_at_once_with_what_to_do(source, says):
    """A real listener on 127.0.0.1: a --source-address it cannot be reached from is final
    (Refused, not a retried ConnectionLost), in one line that says what to name instead."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    with pytest.raises(Refused) as refused:
        await dial("127.0.0.1", port, None, trio.current_time() + 30, source)
    assert str(refused.value).startswith(says)
    assert "or leave it out" in str(refused.value)
    await listeners[0].aclose()


async def test_a_coordinate_wise_median_weighs_an_address_as_one(monkeypatch):
    """--aggregate median ignores token counts, and ignored the address rule with them: a
    holder's 3 of 5 ids from one address, flipping their results, were 3 of the 5 values
    each coordinate's median took (the run by address was the run by id to the bit). Now
    each of its ids weighs 1/3: the median is that of the 5 results with each honest one
    counted 3 times and each of the holder's once (9 values, no tie). Real workers, real
    TCP; the results the aggregate is handed are recorded on their way in."""
    seen: list[dict[str, np.ndarray]] = []
    add = CoordinateWise.add

    def recorded(self, pseudo_gradient, weight, key="", **share):
        seen.append({n: np.array(v) for n, v in pseudo_gradient.items()} | {"": key})
        return add(self, pseudo_gradient, weight, key, **share)

    monkeypatch.setattr(CoordinateWise, "add", recorded)
    sources = {"a": "127.0.0.2", "h1": "127.0.0.3", "h2": "127.0.0.3", "h3": "127.0.0.3"}
    sources["b"] = "127.0.0.4"
    config = small_config(
        rounds=1, inner_steps=4, chunk_steps=2, workers=5, aggregate="median", validate="off"
    )
    shepherd = Shepherd(config, build_workload(config, shards=5))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(shepherd.run)
        for worker_id, source in sources.items():
            flip = FAULTS["scale"].make(factor=-1.0, results=0) if worker_id[0] == "h" else None
            worker = local_worker(port, worker_id, source_address=source, faults=flip)
            nursery.start_soon(worker.run)
            await until(lambda w=worker_id: w in shepherd.state.workers)
    assert sorted(r[""] for r in seen) == sorted(sources)
    median = shepherd.engine.aggregates[0].sums
    for name, value in median.items():
        rows = [r[name] for r in seen for _ in range(1 if r[""][0] == "h" else 3)]
        np.testing.assert_array_equal(value, np.median(np.stack(rows), axis=0))


def test_a_weighted_trimmed_mean_drops_its_share_of_the_weight_at_each_end():
    """Four values weighing 1, 1, 1/2, 1/2 (total 3), 0.2 of it cut at each end (0.6): the
    lowest keeps 0.4 of its 1, the next all of its 1, the third 0.4 of its 1/2, the
    highest (the holder's outlier) none: the weight kept runs from 0.6 to 2.4."""
    stacked = np.array([[10.0], [2.0], [3.0], [1.0]], np.float32)
    weights = np.array([0.5, 1.0, 0.5, 1.0])
    expected = (1.0 * 0.4 + 2.0 * 1.0 + 3.0 * 0.4) / 1.8
    got = aggregate._weighted(stacked, weights, 0.2, "trimmed-mean")
    assert got[0] == np.float32(expected)
    # equal weights: np.median, and the plain trimmed mean's int(0.2 x 5) = 1 cut each end
    five = np.array([[4.0], [1.0], [9.0], [2.0], [7.0]], np.float32)
    assert aggregate._weighted(five, np.ones(5), 0.2, "median")[0] == 4.0
    assert aggregate._weighted(five[:4], np.ones(4), 0.0, "median")[0] == 3.0
    assert aggregate._weighted(five, np.ones(5), 0.2, "trimmed-mean")[0] == np.float32(13 / 3)


@pytest.mark.parametrize("kind", ["median", "trimmed-mean"])
def test_a_weighted_statistic_taken_in_chunks_is_the_one_taken_whole(monkeypatch, kind):
    """Coordinates are taken `WEIGHTED_CHUNK` at a time (bounded scratch memory): a chunk of
    3 over a 7 x 2 tensor is the whole tensor's answer, bit for bit."""
    stacked = np.random.default_rng(0).standard_normal((5, 7, 2)).astype(np.float32)
    weights = np.array([1.0, 1 / 3, 1 / 3, 1 / 3, 1.0])
    whole = aggregate._weighted(stacked, weights, 0.2, kind)
    monkeypatch.setattr(aggregate, "WEIGHTED_CHUNK", 3)
    np.testing.assert_array_equal(aggregate._weighted(stacked, weights, 0.2, kind), whole)
    assert whole.shape == (7, 2) and whole.dtype == np.float32
