"""`pcp-tui relay`: a site's workers reach the shepherd as channels of one link.

The claims: a run through a relay is the flat run (same shards, same batches, the
same losses bit for bit), with the shepherd's parameters and updates crossing its
link once for all of the relay's workers; one channel's slow reader stalls no
other; a relay that breaks the framing ends its link, not the run; and a shepherd
takes relays only when its operator says so.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import pytest
import trio
import trio.testing

from pcp_tui import protocol
from pcp_tui.config.options import ConfigError
from pcp_tui.config.relay import RelayConfig
from pcp_tui.contract import keys
from pcp_tui.contract.channels import WINDOW, Channels
from pcp_tui.contract.connection import ConnectionLost, Refused, expect_hello
from pcp_tui.contract.tls import ClientTLS, ServerTLS
from pcp_tui.relay import Asked, Fold, Folds, Relay, watch
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.testing import (
    free_port,
    local_worker,
    pause_after_round,
    self_signed_certificate,
    until,
)
from pcp_tui.training.build import build_workload
from pcp_tui.worker.session import BUSY_TRIES

from .conftest import small_config


def _relay(port: int, **options) -> Relay:
    config = RelayConfig(
        connect=f"127.0.0.1:{port}", host="127.0.0.1", port=0, worker_id="site-a", **options
    )
    return Relay(config, token="test-token", say=lambda line: None)


async def _run(relays: int, **changes) -> tuple[Shepherd, Relay | None]:
    """A 2-worker run of 3 rounds whose workers join in order, through a relay if `relays`;
    `changes`: other `RunConfig` fields."""
    config = small_config(workers=2, rounds=3, relays=relays, **changes)
    shepherd = Shepherd(config, build_workload(config, shards=2))
    relay = None
    async with trio.open_nursery() as nursery:  # ends with the run: its goodbye ends them all
        port = await nursery.start(shepherd.run)
        if relays:
            relay = _relay(port)
            port = await nursery.start(relay.run)
            await until(lambda: bool(shepherd.pool.relays.live))
        for name in ("a", "b"):
            nursery.start_soon(local_worker(port, name).run)
            await until(lambda name=name: name in shepherd.state.workers)
    return shepherd, relay


async def test_a_run_through_a_relay_is_the_flat_run_and_sends_each_round_once():
    flat, _ = await _run(relays=0)
    tree, relay = await _run(relays=1)
    assert relay is not None

    losses = [(r.train_loss, r.eval_loss) for r in flat.state.history]
    assert [(r.train_loss, r.eval_loss) for r in tree.state.history] == losses
    assert [r.relays for r in tree.state.history] == [1, 1, 1]
    assert [r.relays for r in flat.state.history] == [0, 0, 0]
    assert {v.worker_id: (v.shard, v.via) for v in tree.state.workers.values()} == {
        "a": (0, "site-a"),
        "b": (1, "site-a"),
    }
    assert tree.state.workers["a"].stats_json()["via"] == "site-a"
    # an open run weighs a relay's workers as one address (`--weight-per address`): said once
    (joined,) = [e.message for e in tree.state.events if e.kind == "relay_joined"]
    assert "share one address's weight" in joined and "--weight-per id" in joined
    # what the shepherd wrote for its workers, against what crossed its one link to the relay
    link = tree.pool.relays.sent
    params = 4 * tree.state.param_count
    assert tree.state.bytes_sent > 2 * 3 * params  # each worker was sent θ each round (and more)
    # the workers' bytes, less one of the two copies of every round's θ and update
    assert tree.state.bytes_sent - link >= 3 * params, (tree.state.bytes_sent, link)


async def test_a_streaming_run_through_a_relay_that_folds_is_the_flat_run():
    """Streaming DiLoCo (2 fragments) with the mean and no validation: the relay folds both
    workers' fragment results every round (4 results a round never reach the shepherd) and
    the run ends as the flat one does, to float32 summation order."""
    run = {"streaming_fragments": 2, "aggregate": "mean", "validate": "off"}
    flat, _ = await _run(relays=0, **run)
    tree, _ = await _run(relays=1, **run)
    assert [r.relay_folded for r in tree.state.history] == [4, 4, 4]
    assert [r.relay_folded for r in flat.state.history] == [0, 0, 0]
    assert [r.fragment_results for r in tree.state.history] == [(2, 2)] * 3
    for name, value in flat.engine.params.items():
        largest = float(np.max(np.abs(value)))
        assert np.max(np.abs(tree.engine.params[name] - value)) <= 1e-6 * largest, name


async def _linked() -> tuple[Channels, Channels, trio.Nursery]:
    """(the relay's end, the shepherd's end) of a real TCP link on 127.0.0.1."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    relay_side = await trio.open_tcp_stream("127.0.0.1", port)
    shepherd_side = await listeners[0].accept()
    await listeners[0].aclose()
    relay = Channels(protocol.MessageStream(relay_side), accepts=False, keeps=False)
    shepherd = Channels(protocol.MessageStream(shepherd_side), accepts=True, keeps=True)
    return relay, shepherd


async def _read(channel, nbytes: int) -> bytes:
    data = bytearray()
    while len(data) < nbytes:
        chunk = await channel.receive_some(1 << 20)
        assert chunk, f"channel ended after {len(data)} of {nbytes} bytes"
        data += chunk
    return bytes(data)


async def test_a_channel_nobody_reads_holds_up_only_itself():
    relay, shepherd = await _linked()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.run)
        nursery.start_soon(shepherd.run)
        stuck, flowing = await relay.open("10.0.0.1:1"), await relay.open("10.0.0.2:2")
        unread = await shepherd.accepted.receive()
        read = await shepherd.accepted.receive()
        assert (unread.peer, read.peer) == ("10.0.0.1:1", "10.0.0.2:2")

        async def stuck_sender():  # blocks once the window is full, until the link ends
            with pytest.raises(trio.BrokenResourceError, match="link"):
                await stuck.send_all(bytes(5 * WINDOW))

        nursery.start_soon(stuck_sender)
        payload = bytes(range(256)) * 40_000  # 10 MB, more than two windows
        nursery.start_soon(flowing.send_all, payload)
        assert await _read(read, len(payload)) == payload
        assert unread._buffered <= WINDOW  # what the stuck channel holds at the shepherd
        await relay.link.aclose()  # the link ends: every channel ends with it
        assert await _read(unread, unread._buffered) is not None
        assert await unread.receive_some() == b""
        nursery.cancel_scope.cancel()


async def test_a_buffer_sent_to_many_channels_crosses_the_link_once():
    relay, shepherd = await _linked()
    update = protocol.encode_once(
        protocol.FragmentUpdate(round=1), {"w": np.arange(2**21, dtype="f4")}
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.run)
        nursery.start_soon(shepherd.run)
        ends = [await relay.open(f"10.0.0.{i}:1") for i in range(4)]
        served = [await shepherd.accepted.receive() for _ in ends]
        streams = [protocol.MessageStream(channel) for channel in served]
        async with trio.open_nursery() as senders:  # at once, as a round's starts go out
            for stream in streams:
                senders.start_soon(stream.send_encoded, update)
        for end in ends:
            message = await protocol.MessageStream(end).receive()
            assert message.body == update.body
            assert (message.tensors["w"] == update.tensors["w"]).all()
        sent = shepherd.link.bytes_sent
        assert sent < 1.05 * update.wire_bytes, (sent, update.wire_bytes)
        assert shepherd.bytes_repeated == 3 * update.tensors["w"].nbytes
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("op", "channel", "why"),
    [
        (protocol.RelayOp.DATA, 7, "unknown channel 7"),
        (protocol.RelayOp.KEEP, 1, "only the shepherd sends keep"),
        (protocol.RelayOp.OPEN, 5, "opened out of order"),
    ],
)
async def test_a_relay_that_breaks_the_framing_ends_its_link_and_its_channels(op, channel, why):
    relay, shepherd = await _linked()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.run)
        await relay.open("10.0.0.1:1")
        data = memoryview(b"x" * 16) if op is not protocol.RelayOp.OPEN else None
        await relay.send_frame(op, channel, 1, data)
        with pytest.raises(protocol.ProtocolError, match=why):
            await shepherd.run()
        served = await shepherd.accepted.receive()
        assert await served.receive_some() == b""  # the link's end is its channels' end
        nursery.cancel_scope.cancel()


async def test_a_shepherd_takes_relays_only_with_relays():
    config = small_config(workers=2, rounds=1)
    shepherd = Shepherd(config, build_workload(config, shards=2))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(shepherd.run)
        with pytest.raises(Refused, match="refused this relay .*start it with --relays N"):
            await _relay(port, give_up_after=5.0).run()
        nursery.cancel_scope.cancel()
    # the operator sees it as any refusal (dashboard, headless, metrics), not a bare log line
    (refused,) = [e for e in shepherd.state.events if e.kind == "refused"]
    assert "start it with --relays N" in refused.message and refused.code == "authFailed"


def test_a_relay_takes_one_shepherd_address():
    """A worker's --connect takes a list to fail over along; a relay would use its first."""
    with pytest.raises(ConfigError, match="a relay joins one shepherd: pass its HOST:PORT only"):
        RelayConfig(connect="127.0.0.1:8080,127.0.0.1:8081").validate()


async def test_a_worker_at_a_relay_not_yet_joined_is_told_why():
    relay = _relay(free_port(), give_up_after=60.0)  # no shepherd listens there
    async with trio.open_nursery() as nursery:
        port = await nursery.start(relay.run)
        where = f"127.0.0.1:{port}"
        stream = protocol.MessageStream(await trio.open_tcp_stream("127.0.0.1", port))
        with pytest.raises(
            ConnectionLost,
            match=f"{where} reported an error \\(unavailable\\): relay "
            "site-a has no link to its shepherd \\(yet\\): retrying",
        ):
            await expect_hello(stream, where)
        nursery.cancel_scope.cancel()


async def test_a_relay_says_the_join_command_that_fails_over_to_the_shepherd():
    """The line an operator copies for the site's workers lists the shepherd after the relay
    (`--connect RELAY,SHEPHERD`), as docs/relays.md says to: a worker that joins with it
    finishes the run direct when the relay dies."""
    config = small_config(workers=2, rounds=1, relays=1)
    shepherd = Shepherd(config, build_workload(config, shards=2))
    said: list[str] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(shepherd.run)
        relay = Relay(
            RelayConfig(connect=f"127.0.0.1:{port}", host="127.0.0.1", port=0, worker_id="site-a"),
            token="test-token",
            say=said.append,
        )
        relay_port = await nursery.start(relay.run)
        await until(lambda: bool(shepherd.pool.relays.live))
        nursery.cancel_scope.cancel()
    assert said[0] == (
        f"relay site-a joined the shepherd at 127.0.0.1:{port}; workers join with: pcp-tui "
        f"worker --connect 127.0.0.1:{relay_port},127.0.0.1:{port} --token <TOKEN>"
    )


async def test_workers_whose_relay_dies_go_on_through_the_next_address():
    """Both workers join through the relay, listing the shepherd after it (`--connect
    RELAY,SHEPHERD`); the relay dies after round 1 and they finish the run direct, from their
    own shards, each result counted once."""
    config = small_config(workers=2, rounds=4, relays=1)
    shepherd = Shepherd(config, build_workload(config, shards=2))
    pause_after_round(shepherd, 1)  # held there until both are back
    async with trio.open_nursery() as nursery:
        port = await nursery.start(shepherd.run)
        relay, relay_scope = _relay(port), trio.CancelScope()

        async def relay_until_killed(task_status=trio.TASK_STATUS_IGNORED):
            with relay_scope:
                await relay.run(task_status=task_status)

        relay_port = await nursery.start(relay_until_killed)
        await until(lambda: bool(shepherd.pool.relays.live))
        for name in ("a", "b"):
            connect = f"127.0.0.1:{relay_port},127.0.0.1:{port}"
            nursery.start_soon(local_worker(port, name, connect=connect).run)
            await until(lambda name=name: name in shepherd.state.workers)
        await until(lambda: shepherd.state.status == "paused" and len(shepherd.state.history))
        relay_scope.cancel()  # its listener and its link close at once, as a killed process's do

        def direct() -> set[str]:
            return {link.worker_id for link in shepherd.pool.ready_links() if not link.view.via}

        await until(lambda: direct() == {"a", "b"})
        shepherd.resume()

    history = shepherd.state.history
    assert [(r.workers, r.relays) for r in history] == [(2, 1)] + [(2, 0)] * 3
    assert {v.worker_id: (v.shard, v.via) for v in shepherd.state.workers.values()} == {
        "a": (0, ""),
        "b": (1, ""),
    }
    full = config.inner.steps * config.data.batch_size * config.data.seq_len
    assert [r.tokens for r in history] == [2 * full] * 4  # each result counted once


@pytest.mark.e2e  # openssl makes the relay's certificate
async def test_a_keyed_worker_joins_through_a_tls_relay(tmp_path):
    """Under --worker-keys a worker signs the certificate it sees, the relay's: the relay
    (keyed itself) names it in its hello and the shepherd checks the signature over it."""
    issued, private = tmp_path / "workers.keys", {}
    for name in ("alice", "site-a"):  # the relay joins with a key of its own, too
        key, private[name] = keys.generate(), str(tmp_path / f"{name}.key")
        keys.write_private_key(key, private[name])
        with issued.open("a") as lines:
            lines.write(keys.public_line(key, name) + "\n")
    cert, cert_key = self_signed_certificate(tmp_path)
    server_tls = ServerTLS.from_files(str(cert), str(cert_key))
    config = small_config(workers=1, rounds=1, relays=1, worker_keys=str(issued))
    shepherd = Shepherd(config, build_workload(config, shards=1))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(shepherd.run)
        relay = _relay(port, key=private["site-a"])
        relay.server_tls = server_tls
        relay_port = await nursery.start(relay.run)
        await until(lambda: bool(shepherd.pool.relays.live))
        worker = local_worker(
            relay_port,
            "alice",
            key=private["alice"],
            tls_fingerprint=server_tls.fingerprint,
            reconnect=False,
        )
        worker.tls = ClientTLS.from_options(pinned=server_tls.fingerprint)
        nursery.start_soon(worker.run)
    [record] = shepherd.state.history
    assert (record.worker_ids, record.relays) == (("alice",), 1)
    assert shepherd.state.workers["alice"].via == "site-a"


async def test_a_send_cancelled_mid_frame_leaves_the_link_whole():
    """A worker's send cut off (its deadline, a closing fragment) while the link's socket is
    full must not cut a frame in half: the link carries every other channel on."""
    relay, shepherd = await _linked()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(shepherd.run)
        await relay.open("10.0.0.1:1")  # the slow worker's
        other = await relay.open("10.0.0.2:2")
        to_slow, to_other = await shepherd.accepted.receive(), await shepherd.accepted.receive()
        # the relay's reader is not running yet: the shepherd's writes fill the link's socket
        async with trio.open_nursery() as senders:
            senders.start_soon(to_slow.send_all, bytes(64 * 2**20))
            await trio.testing.wait_all_tasks_blocked()
            senders.cancel_scope.cancel()  # the slow worker's send is cut off, mid-frame
            nursery.start_soon(relay.run)  # raises ProtocolError if the link is garbled
        await to_other.send_all(b"still whole")
        assert await _read(other, len(b"still whole")) == b"still whole"
        nursery.cancel_scope.cancel()


def _kept_budget(monkeypatch, nbytes: int) -> None:
    from pcp_tui.contract import channels

    monkeypatch.setattr(channels, "KEEP_BYTES", nbytes)


async def test_kept_buffers_stay_within_what_the_relay_holds(monkeypatch):
    """The shepherd forgets old buffers before it keeps a new one, so the relay never holds
    more than KEEP_BYTES; a buffer bigger than that goes as plain data, never kept."""
    _kept_budget(monkeypatch, 3 * 2**20)
    relay, shepherd = await _linked()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.run)
        nursery.start_soon(shepherd.run)
        end = await relay.open("10.0.0.1:1")
        served = await shepherd.accepted.receive()
        rng = np.random.default_rng(0)
        sent = [rng.bytes(size) for size in (5 * 2**19, 5 * 2**19, 7 * 2**20, 5 * 2**19)]
        for data in sent:
            nursery.start_soon(served.send_all, data)
            assert await _read(end, len(data)) == data
            assert relay._kept_in_bytes <= 3 * 2**20
        nursery.cancel_scope.cancel()


async def test_a_keep_cut_off_part_way_is_forgotten_at_the_relay(monkeypatch):
    """A keep cancelled between its pieces leaves nothing at the relay the shepherd does not
    count: else the relay's count creeps up to KEEP_BYTES and it ends the link."""
    _kept_budget(monkeypatch, 40 * 2**20)
    relay, shepherd = await _linked()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(shepherd.run)
        await relay.open("10.0.0.1:1")
        served = await shepherd.accepted.receive()
        async with trio.open_nursery() as senders:  # the link's socket fills, then a cut
            senders.start_soon(served.send_all, bytes(32 * 2**20))  # kept, in 32 pieces
            await trio.testing.wait_all_tasks_blocked()
            senders.cancel_scope.cancel()
            nursery.start_soon(relay.run)
        data = bytes(range(256)) * 8192  # 2 MiB, kept
        nursery.start_soon(served.send_all, data)
        await trio.testing.wait_all_tasks_blocked()
        assert relay._kept_in_bytes == shepherd._kept_out_bytes == len(data)
        nursery.cancel_scope.cancel()


async def test_big_buffers_for_a_worker_that_does_not_read_wait_for_its_credit():
    """Kept and repeated buffers are charged to their channel's credit as data is. They were
    not: the shepherd's sends of big buffers to a worker that never read went through at
    once (its send deadline never applied) and the relay buffered them without bound."""
    relay, shepherd = await _linked()
    buffers = [np.random.default_rng(i).bytes(2**20) for i in range(16)]
    sent = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.run)
        nursery.start_soon(shepherd.run)
        end = await relay.open("10.0.0.1:1")
        served = await shepherd.accepted.receive()

        async def sender():
            for data in buffers:
                await served.send_all(data)
                sent.append(data)

        nursery.start_soon(sender)
        await trio.testing.wait_all_tasks_blocked()
        assert len(sent) < len(buffers)
        assert end._buffered <= WINDOW + 2**20  # a window and the repeat sent into its last byte
        assert await _read(end, 16 * 2**20) == b"".join(buffers)  # the rest, as it is read
        nursery.cancel_scope.cancel()


async def test_a_relay_whose_old_link_hangs_half_open_gets_back_in():
    """A relay back (restarted, or past a partition) while its old link still hangs open at
    the shepherd, silent: told to retry, as a worker is, not refused for good (its name
    was "in use" by that dead link, so the relay exited and its site was gone)."""
    config = small_config(workers=1, rounds=1, relays=1, heartbeat_timeout=3.0)
    shepherd = Shepherd(config, build_workload(config, shards=1))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(shepherd.run)
        stale = await trio.open_tcp_stream("127.0.0.1", port)  # welcomed, then never heard
        await _relay(port)._join(protocol.MessageStream(stale), "the shepherd")
        await until(lambda: "site-a" in shepherd.pool.relays.live)
        old = shepherd.pool.relays.live["site-a"].channels.link
        await until(lambda: old.clock() - old.last_activity > 2 * config.network.heartbeat_seconds)
        relay = _relay(port, give_up_after=60.0)
        relay_port = await nursery.start(relay.run)
        nursery.start_soon(local_worker(relay_port, "a").run)
        await until(lambda: len(shepherd.state.history) == 1)
        await stale.aclose()
    assert shepherd.state.workers["a"].via == "site-a"


async def test_a_channel_address_that_is_not_printable_ends_the_link():
    """The address a relay names for its worker reaches the shepherd's log, events and
    dashboard: an escape sequence there (clear the screen, forge a log line) is refused."""
    relay, shepherd = await _linked()
    await relay.send_frame(protocol.RelayOp.OPEN, 1, 0, text="10.0.0.1:1\x1b[2J\nrefused nobody")
    await relay.link.aclose()
    with pytest.raises(protocol.ProtocolError, match="printable"):
        await shepherd.run()
    assert not shepherd.channels


async def test_a_relay_that_reads_nothing_cannot_hold_up_the_shepherds_goodbye(autojump_clock):
    """The run's end says goodbye to every relay; one whose link takes nothing more (a hostile
    relay, a wedged machine) is cut off after GOODBYE_SECONDS, as a worker is, instead of
    keeping the shepherd from exiting."""
    relay, shepherd = await _linked()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(shepherd.run)
        await relay.open("10.0.0.1:1")
        served = await shepherd.accepted.receive()

        async def stuck_sender():  # the relay reads nothing: a big buffer fills the link
            with pytest.raises(trio.BrokenResourceError, match="goodbye"):
                await served.send_all(bytes(64 * 2**20))

        nursery.start_soon(stuck_sender)
        await trio.testing.wait_all_tasks_blocked()
        await shepherd.say_goodbye("run finished")
        assert shepherd.ended is not None
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("code", "order"),
    [
        (protocol.ErrorCode.BUSY, ["relay"] * BUSY_TRIES + ["shepherd"]),
        (protocol.ErrorCode.UNAVAILABLE, ["relay", "shepherd", "relay"]),
    ],
)
async def test_a_worker_told_busy_tries_its_relay_again_and_one_told_unavailable_moves_on(
    code, order
):
    """`--connect RELAY,SHEPHERD`: a relay that answers `busy` (the shepherd behind it cannot
    take the worker yet) is dialled again, not the shepherd directly, which is as busy, up to
    `BUSY_TRIES` times in a row (one that says busy for ever holds nobody); one that answers
    `unavailable` (no link, full) sends the worker to the next address, and round again.
    Both addresses answer over real sockets on 127.0.0.1 to a real `Worker`."""
    dialled: list[str] = []

    async def answer(name: str, error: protocol.ErrorCode, stream: trio.SocketStream) -> None:
        dialled.append(name)
        await protocol.MessageStream(stream).send_error(error, "not now")
        await stream.aclose()

    relay = await trio.open_tcp_listeners(0, host="127.0.0.1")
    shepherd = await trio.open_tcp_listeners(0, host="127.0.0.1")
    ports = [listeners[0].socket.getsockname()[1] for listeners in (relay, shepherd)]
    worker = local_worker(0, connect=",".join(f"127.0.0.1:{port}" for port in ports))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, partial(answer, "relay", code), relay)
        nursery.start_soon(trio.serve_listeners, partial(answer, "shepherd", code), shepherd)
        nursery.start_soon(worker.run)
        await until(lambda: len(dialled) >= len(order))
        nursery.cancel_scope.cancel()
    assert dialled[: len(order)] == order


async def test_a_relay_passes_a_workers_messages_on_as_they_came_and_refuses_a_forged_notice():
    """A relay reads each worker message's header to find results it folds; anything else
    (here a hello, and a result with no fold open for it) goes on byte for byte. A result that
    claims to be a relay's notice (folded, no tensors) is a worker lying about its weight: the
    relay ends that worker's connection and passes none of it on."""
    worker, relay_end = trio.testing.memory_stream_pair()
    shepherd_end, relay_out = trio.testing.memory_stream_pair()
    hello = protocol.WorkerHello(worker_id="w-0", hostname="h", software="t")
    result = protocol.RoundResult(round=3, tokens=8, losses=(1.0,), inner_steps=1)
    tensors = {"w": np.arange(4, dtype=np.float32)}
    sent = b"".join(
        bytes(b) for m in (protocol.encode(hello), protocol.encode(result, tensors)) for b in m
    )
    forged = dataclasses.replace(result, folded=True, weight=1e9)
    await worker.send_all(sent)
    for buffer in protocol.encode(forged):
        await worker.send_all(buffer)
    with pytest.raises(protocol.MalformedMessage, match="never a relay's notice"):
        await Folds().carry_up(protocol.StreamReader(relay_end), relay_out, Asked())
    received = b""
    while len(received) < len(sent):
        received += await shepherd_end.receive_some()
    assert received == sent


async def test_a_relay_drops_a_silent_worker_but_not_one_the_shepherd_holds_up(autojump_clock):
    """A relay ends the connection of a worker it has heard nothing from for the heartbeat
    timeout (its heartbeats end at the relay), but not while the shepherd takes nothing of
    that worker's channel: the relay then reads nothing of the worker either (a shepherd
    folding its result, or waiting for a slot for it), and the silence is the shepherd's."""
    relay_end, shepherd_end = trio.testing.memory_stream_pair()
    relay = Channels(protocol.MessageStream(relay_end), accepts=False, keeps=False)
    shepherd = Channels(protocol.MessageStream(shepherd_end), accepts=True, keeps=True)
    worker, _ = trio.testing.memory_stream_pair()
    reader = protocol.StreamReader(worker, trio.current_time)
    planned = trio.Event()
    planned.set()
    timeout = 20.0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.run)
        nursery.start_soon(shepherd.run)
        channel = await relay.open("10.0.0.1:1")
        at_shepherd = await shepherd.accepted.receive()  # not read yet: no credit comes back
        nursery.start_soon(channel.send_all, bytes(WINDOW + 1))
        await trio.testing.wait_all_tasks_blocked()
        assert channel.held_up
        read_at = 5 * timeout  # until then the shepherd takes nothing of the channel

        async def shepherd_reads_later():
            await trio.sleep_until(read_at)
            await _read(at_shepherd, WINDOW + 1)

        nursery.start_soon(shepherd_reads_later)
        await watch(reader, channel, planned, timeout)  # the worker sent nothing at all
        assert not channel.held_up
        assert read_at + timeout < trio.current_time() <= read_at + timeout + 1.0  # polls at 1 s
        nursery.cancel_scope.cancel()


async def test_a_relay_folds_a_workers_results_only_once_the_shepherd_has_planned_it():
    """The relay takes a worker's id from its hello, but only the shepherd's plan says the
    shepherd took that hello (its proof, its id not in use): a result sent before it goes on
    whole, for the shepherd to refuse. Folded under the hello's id, anyone who reaches the
    relay could fold a result as another worker, whose own result then goes on whole and
    leaves the relay's fold holding a result its shepherd never got a notice of: refused,
    with every honest result in it. So is a result of a round the shepherd did not start on
    this connection (a worker that came back through this relay mid-round): it goes on whole,
    and the shepherd drops it. A second hello on a connection ends it."""
    order = protocol.Fold(
        round=3, names=("w",), dims=(4,), ranks=(1,), max_tokens=8, per_step=8,
        lr_steps=(1,), lr_sums=(1.0,),
    )  # fmt: skip
    hello = protocol.WorkerHello(worker_id="bob", hostname="h", software="t")
    result = protocol.RoundResult(round=3, tokens=8, losses=(1.0,), inner_steps=1)
    tensors = {"w": np.arange(4, dtype=np.float32)}
    sent = b"".join(
        bytes(b) for m in (protocol.encode(hello), protocol.encode(result, tensors)) for b in m
    )
    folds = Folds()
    fold = folds.open[(3, 0)] = Fold(order, None)
    folds.open[(4, 0)] = Fold(dataclasses.replace(order, round=4), None)
    worker, relay_end = trio.testing.memory_stream_pair()
    shepherd_end, relay_out = trio.testing.memory_stream_pair()
    await worker.send_all(sent)
    await worker.aclose()
    await folds.carry_up(protocol.StreamReader(relay_end), relay_out, Asked())
    received = b""
    while len(received) < len(sent):
        received += await shepherd_end.receive_some()
    assert received == sent and not fold.partial.results

    planned = Asked()  # the plan and round 3's start went down (2 steps: both claims fit)
    planned.note(protocol.Plan(inner_steps=1, batch_size=2, tokens_per_row=4))
    planned.note(protocol.RoundStart(round=3, inner_steps=2))
    worker, relay_end = trio.testing.memory_stream_pair()
    unasked = dataclasses.replace(result, round=4)  # no roundStart went down for it
    messages = (hello, None), (result, tensors), (unasked, tensors)
    for buffer in (b for body, sent_with in messages for b in protocol.encode(body, sent_with)):
        await worker.send_all(buffer)
    for buffer in protocol.encode(dataclasses.replace(hello, worker_id="carol")):
        await worker.send_all(buffer)
    with pytest.raises(protocol.MalformedMessage, match="hello"):
        await folds.carry_up(protocol.StreamReader(relay_end), relay_out, planned)
    assert list(fold.partial.results) == ["bob"]
    assert not folds.open[(4, 0)].partial.results  # it went on whole
