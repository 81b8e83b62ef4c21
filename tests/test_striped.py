"""A striped stream is one byte stream over K real TCP connections: exact, and it ends, never hangs.

Every test runs over real sockets on 127.0.0.1. The piece size is small here
(a few kilobytes) so that even modest payloads cross every connection many
times and every boundary case (a send ending inside a piece, a receive
stopping at a piece's end) is met.
"""

from __future__ import annotations

import dataclasses
import random
import socket
import struct
import types

import numpy as np
import pytest
import trio
import trio.testing

from pcp_tui import protocol
from pcp_tui.contract import auth
from pcp_tui.contract.connection import ConnectionLost
from pcp_tui.shepherd.serving import striping
from pcp_tui.shepherd.serving.connection import Hello
from pcp_tui.shepherd.serving.striping import Attachments
from pcp_tui.worker import striping as worker_striping

PIECE = 4096


async def connection_pairs(count: int) -> tuple[list[trio.SocketStream], list[trio.SocketStream]]:
    """`count` TCP connections on 127.0.0.1: (the connecting ends, the accepted ends), in order."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    clients, servers = [], []
    for _ in range(count):
        clients.append(await trio.testing.open_stream_to_socket_listener(listener))
        servers.append(await listener.accept())
    await listener.aclose()
    return clients, servers


async def striped_pair(count: int, piece_bytes: int = PIECE):
    clients, servers = await connection_pairs(count)
    return (
        protocol.StripedStream(clients, piece_bytes=piece_bytes),
        protocol.StripedStream(servers, piece_bytes=piece_bytes),
    )


@pytest.mark.parametrize("count", [1, 3, 4])
async def test_bytes_arrive_exactly_whatever_the_sizes_of_sends_and_receives(count):
    """Sends of 1 byte to many pieces, both directions at once, receives of random sizes."""
    rng = random.Random(count)
    sizes = [1, 7, PIECE - 1, 1, PIECE, 3 * PIECE + 5, 100, 50_000, 1, 2, 1_000_000, 9]
    sends = [rng.randbytes(size) for size in sizes]
    expected = b"".join(sends)

    left, right = await striped_pair(count)
    results = {}

    async def send(stream, tag):
        for data in sends:
            await stream.send_all(data)
        results[tag + " sent"] = True

    async def receive(stream, tag):
        got = bytearray()
        while len(got) < len(expected):
            got += await stream.receive_some(rng.choice([1, 13, PIECE, 1 << 20, None]))
        results[tag] = bytes(got)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send, left, "left")
        nursery.start_soon(send, right, "right")
        nursery.start_soon(receive, right, "at right")
        nursery.start_soon(receive, left, "at left")
    await left.aclose()
    assert await right.receive_some(10) == b""  # the peer's close is an end of stream
    await right.aclose()
    assert results["at right"] == expected and results["at left"] == expected


async def test_the_codec_runs_unchanged_over_a_striped_stream():
    """Big and small PCP messages, back to back, with the default piece size."""
    params = {"w": np.arange(3_000_000, dtype=np.float32), "b": np.ones(3, np.float32)}
    bodies = [protocol.Heartbeat(1.5), protocol.RoundStart(round=2, inner_steps=4)]

    left, right = await striped_pair(4, protocol.PIECE_BYTES)
    sender, receiver = protocol.MessageStream(left), protocol.MessageStream(right)
    received = []

    async def send():
        for body in bodies:
            await sender.send(body, params if isinstance(body, protocol.RoundStart) else None)
            await sender.send(protocol.Goodbye("between"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        for _ in range(2 * len(bodies)):
            received.append(await receiver.receive())
    await sender.aclose()
    await receiver.aclose()
    assert [message.body for message in received[::2]] == bodies
    assert all(message.body == protocol.Goodbye("between") for message in received[1::2])
    for name, array in params.items():
        np.testing.assert_array_equal(received[2].tensors[name], array)


def _reset(stream: trio.SocketStream) -> None:
    """Make the next close send a TCP reset (RST) instead of an orderly FIN."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.mark.parametrize("how", ["closed", "reset"])
async def test_one_connection_lost_mid_message_ends_both_sides(how):
    """The receiver loses one of its four connections while a 40 MB message is on its way:
    the sender's send fails, the receiver's receive fails (ConnectionClosed), nothing hangs,
    and every later call on either striped stream fails at once."""
    payload = {"x": np.zeros(10_000_000, np.float32)}

    clients, servers = await connection_pairs(4)
    sender = protocol.MessageStream(protocol.StripedStream(clients, piece_bytes=PIECE))
    striped = protocol.StripedStream(servers, piece_bytes=PIECE)
    receiver = protocol.MessageStream(striped)
    errors = {}

    async def send():
        try:
            await sender.send(protocol.RoundResult(round=1), payload)
        except trio.BrokenResourceError as exc:
            errors["send"] = exc

    async def receive():
        try:
            await receiver.receive()
        except protocol.ConnectionClosed as exc:
            errors["receive"] = exc

    async def cut():
        while striped._received < 8 * PIECE:  # some bytes through, most still to come
            await trio.sleep(0.001)
        if how == "reset":
            _reset(servers[2])
        await servers[2].aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        nursery.start_soon(receive)
        nursery.start_soon(cut)
    with pytest.raises(trio.BrokenResourceError):
        await sender.stream.send_all(b"more")
    with pytest.raises(trio.BrokenResourceError):
        await striped.receive_some()
    await sender.aclose()
    await receiver.aclose()
    assert "striped connections failed" in str(errors["send"])
    assert "receive" in errors  # a ConnectionClosed: "striped connections failed" or, had the
    # sender noticed first and closed all four, "peer closed the connection mid-frame"


async def test_a_cancelled_send_breaks_the_stream_rather_than_send_bytes_out_of_step():
    left, right = await striped_pair(2)
    with trio.move_on_after(0.5):  # the peer never reads: the send fills every buffer, waits
        await left.send_all(bytes(64 * 2**20))
    with pytest.raises(trio.BrokenResourceError, match="cancelled part-way"):
        await left.send_all(b"x")
    await left.aclose()
    await right.aclose()


async def test_misuse_is_refused_with_the_usual_trio_errors():
    left, right = await striped_pair(2)
    with pytest.raises(ValueError, match="at least one"):
        protocol.StripedStream([])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(right.receive_some)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await right.receive_some()
        await left.send_all(b"1")
    await left.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await left.send_all(b"x")
    await right.aclose()


# --------------------------------------------------------------------------- attaching


def _attach_hello(index: int, key: bytes, *, worker_id: str = "w0", nonce: bytes = b"n" * 32):
    proof = auth.attach_proof(key, nonce, worker_id, index)
    return Hello(worker_id, "", "cpu", protocol.Platform.CPU, nonce=nonce, attach_index=index,
                 attach_proof=proof)  # fmt: skip


def test_only_the_welcomed_session_can_attach_its_extra_connections():
    """The join token (which every worker has) is not enough: an extra connection must prove the
    session key of the welcome, over its own nonce, for an index not yet taken, in time."""
    key, other_key = auth.new_session_key(), auth.new_session_key()
    pending = Attachments("w0", key, wanted=3)
    stream = object()  # held, never used, by this unit
    assert "wrong session proof" in pending.offer(_attach_hello(1, other_key), stream)
    replayed = dataclasses.replace(_attach_hello(1, key), nonce=b"m" * 32)  # another connection's
    assert "wrong session proof" in pending.offer(replayed, stream)
    assert "not 'w1'" in pending.offer(_attach_hello(1, key, worker_id="w1"), stream)
    assert "not within 1..3" in pending.offer(_attach_hello(4, key), stream)
    assert "not within 1..3" in pending.offer(_attach_hello(0, key), stream)
    assert pending.offer(_attach_hello(1, key), stream) is None
    assert "already attached" in pending.offer(_attach_hello(1, key), stream)
    assert pending.offer(_attach_hello(2, key), stream) is None
    assert not pending.complete.is_set()
    assert pending.offer(_attach_hello(3, key), stream) is None
    assert pending.complete.is_set() and sorted(pending.streams) == [1, 2, 3]
    pending.open = False
    assert "too late" in pending.offer(_attach_hello(2, key), stream)


class _Link:
    """The part of a `WorkerLink` that `striping.welcome` uses (this unit's stand-in)."""

    def __init__(self, stream: protocol.MessageStream):
        self.stream, self.worker_id, self.attachments = stream, "w0", None
        self.view = types.SimpleNamespace(index=0)

    async def send(self, body, tensors=None) -> int:
        return await self.stream.send(body, tensors)


WELCOME = protocol.Welcome(worker_index=0, run_id="r", heartbeat_seconds=0.5)


@pytest.mark.parametrize("attached", [3, 2])
async def test_the_second_welcome_settles_striped_or_one_connection(autojump_clock, attached):
    """Both sides of `striping.welcome` over in-memory streams, on a virtual clock: all three
    extra connections attach and a message crosses the striped session; or one is missing,
    the shepherd waits its window, says 1 and closes the two it got."""
    params = {"w": np.arange(200_000, dtype=np.float32)}

    shepherd_end, worker_end = trio.testing.memory_stream_pair()
    link = _Link(protocol.MessageStream(shepherd_end))
    worker = protocol.MessageStream(worker_end)
    result = {}

    async def shepherd():
        result["used"] = await striping.welcome(link, WELCOME, 4, wait=5.0)
        if result["used"] == 4:
            await link.send(protocol.RoundStart(round=1, inner_steps=4), params)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(shepherd)
        offer = (await worker.receive()).body
        assert offer.streams == 4 and len(offer.session_key) == 32
        pairs = [trio.testing.memory_stream_pair() for _ in range(attached)]
        for index, (theirs, _) in enumerate(pairs, start=1):
            hello = _attach_hello(index, offer.session_key)
            assert link.attachments.offer(hello, protocol.MessageStream(theirs)) is None
        settled = (await worker.receive()).body
        assert settled.streams == (4 if attached == 3 else 1)
        if settled.streams == 4:
            worker.stripe([protocol.MessageStream(ours) for _, ours in pairs])
            result["message"] = await worker.receive()
        else:  # the shepherd closed the ones it got: their far ends read the end of stream
            assert [await ours.receive_some(10) for _, ours in pairs] == [b""] * attached
    assert link.attachments is None
    result["time"] = trio.current_time()
    if attached == 3:
        assert result["used"] == 4 and result["time"] == 0.0
        np.testing.assert_array_equal(result["message"].tensors["w"], params["w"])
    else:
        assert result["used"] == 1 and result["time"] == 5.0


class _UnreachableWorker:
    """The part of a `Worker` that `worker.striping.attach` uses: its extra connections fail."""

    async def _open(self, deadline: float):
        raise ConnectionLost("cannot reach 127.0.0.1:9 (Connection refused)")


def test_a_worker_that_cannot_open_its_extra_connections_goes_on_with_one(caplog):
    async def main():
        shepherd_end, worker_end = trio.testing.memory_stream_pair()
        shepherd, main_stream = (
            protocol.MessageStream(shepherd_end),
            protocol.MessageStream(worker_end),
        )
        offer = dataclasses.replace(WELCOME, streams=3, session_key=auth.new_session_key())
        await shepherd.send(dataclasses.replace(WELCOME, streams=1))  # its window passed
        used = await worker_striping.attach(_UnreachableWorker(), main_stream, offer)
        await shepherd.send(protocol.Heartbeat(2.0))  # the session goes on, on one connection
        return used, (await main_stream.receive()).body

    with caplog.at_level("WARNING"):
        used, after = trio.run(main)
    assert used == 1 and after == protocol.Heartbeat(2.0)
    assert "continuing on one connection: connection 2: cannot reach" in caplog.text
