"""The link emulator delivers what it claims: every byte, in order, at the rate and delay asked for."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import socket
import subprocess
import sys
import time

import pytest
import trio
import trio.testing

from pcp_tui.app.link_emulator import (
    CHUNK_BYTES,
    LinkEmulator,
    LinkProfile,
    ShapedPipe,
    Wire,
    parse_bandwidth,
    parse_duration,
    parse_window,
)
from pcp_tui.config import ConfigError
from pcp_tui.testing import free_port


def _through_pipe(
    profile: LinkProfile, payload: bytes, seed: int = 0, ack_delay: float = 0.0
) -> tuple[bytes, float]:
    """(bytes received, virtual time of the last byte) for `payload` sent at time 0."""
    received = bytearray()
    last = [0.0]

    async def main():
        sender, pipe_in = trio.testing.memory_stream_pair()
        pipe_out, receiver = trio.testing.memory_stream_pair()

        async def send():
            await sender.send_all(payload)
            await sender.aclose()

        async def receive():
            while chunk := await receiver.receive_some(1 << 20):
                received.extend(chunk)
                last[0] = trio.current_time()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            nursery.start_soon(receive)
            pipe = ShapedPipe(profile, random.Random(seed), ack_delay=ack_delay)
            nursery.start_soon(pipe.run, pipe_in, pipe_out)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return bytes(received), last[0]


def test_bytes_arrive_after_the_serialization_time_plus_the_one_way_delay():
    payload = random.Random(1).randbytes(2_000_000)
    profile = LinkProfile(bytes_per_second=1_000_000, delay=0.025)
    received, finished = _through_pipe(profile, payload)
    assert received == payload
    assert finished == pytest.approx(
        2.0 + 0.025, abs=1e-9
    )  # virtual clock: exact but for float sums


def test_jitter_never_reorders_bytes_and_an_unlimited_link_only_delays():
    payload = random.Random(2).randbytes(500_000)
    jittery = LinkProfile(bytes_per_second=250_000, delay=0.04, jitter=0.03)
    received, finished = _through_pipe(jittery, payload, seed=7)
    assert received == payload
    assert 2.0 + 0.01 <= finished <= 2.0 + 0.07  # serialization plus delay, moved by the jitter
    received, finished = _through_pipe(LinkProfile(delay=0.1), payload)
    assert received == payload and finished == pytest.approx(0.1, abs=1e-9)


@pytest.mark.parametrize("bytes_per_second", [float("inf"), 10e6])
def test_a_window_holds_one_stream_to_a_window_per_round_trip(bytes_per_second):
    """Each window's worth waits for the previous one's acknowledgement: a window's cycle is one
    round trip plus the serialization of the first chunk (whose acknowledgement frees room);
    the last window then crosses in its serialization time plus the one-way delay."""
    window, delay, windows = 256 * 1024, 0.05, 8
    payload = random.Random(4).randbytes(windows * window)
    profile = LinkProfile(bytes_per_second=bytes_per_second, delay=delay, window=window)
    received, finished = _through_pipe(profile, payload, ack_delay=delay)
    assert received == payload
    cycle = 2 * delay + CHUNK_BYTES / bytes_per_second
    expected = (windows - 1) * cycle + window / bytes_per_second + delay
    assert finished == pytest.approx(expected, abs=1e-9)


def test_connections_on_a_shared_wire_take_turns_on_its_bandwidth():
    """Two connections at once on one 1 MB/s wire: together 2 MB cross in 2 s, as on one link;
    each on a wire of its own, both finish after 1 s."""
    payload = random.Random(6).randbytes(1_000_000)
    profile = LinkProfile(bytes_per_second=1_000_000, delay=0.025)

    def finish_times(shared: bool) -> list[float]:
        wire = Wire() if shared else None
        finished = []

        async def one():
            sender, pipe_in = trio.testing.memory_stream_pair()
            pipe_out, receiver = trio.testing.memory_stream_pair()
            pipe = ShapedPipe(profile, wire=wire or Wire())

            async def send():
                await sender.send_all(payload)
                await sender.aclose()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                nursery.start_soon(pipe.run, pipe_in, pipe_out)
                while await receiver.receive_some(1 << 20):
                    pass
            finished.append(trio.current_time())

        async def main():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one)
                nursery.start_soon(one)

        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
        return finished

    assert max(finish_times(shared=True)) == pytest.approx(2.0 + 0.025, abs=1e-9)
    assert finish_times(shared=False) == pytest.approx([1.025, 1.025], abs=1e-9)


def test_window_sizes():
    assert parse_window("1MiB") == 2**20
    assert parse_window("4MB") == 4e6
    assert parse_window("65536") == 65536
    assert parse_window("unbounded") == float("inf")
    with pytest.raises(ConfigError, match="--window 'big'"):
        parse_window("big")
    with pytest.raises(ConfigError, match="--window"):
        parse_window("0")


@pytest.mark.parametrize(
    ("text", "bytes_per_second"),
    [
        ("1Gbit", 125e6),
        ("100mbit", 12.5e6),
        ("10MB", 10e6),
        ("800kbit", 1e5),
        ("unlimited", float("inf")),
    ],
)
def test_bandwidth_units(text, bytes_per_second):
    assert parse_bandwidth(text) == bytes_per_second


@pytest.mark.parametrize("text", ["fast", "1 Gigabit", "-5Mbit", "0Mbit"])
def test_a_rate_that_is_not_one_says_how_to_write_it(text):
    with pytest.raises(ConfigError, match="--bandwidth"):
        parse_bandwidth(text)


def test_durations_default_to_milliseconds():
    assert parse_duration("50ms", "--rtt") == 0.05
    assert parse_duration("2s", "--rtt") == 2.0
    assert parse_duration("20", "--rtt") == 0.02
    with pytest.raises(ConfigError, match="--rtt 'soon'"):
        parse_duration("soon", "--rtt")


async def test_real_sockets_through_the_emulator_and_a_cut_link():
    """An echo server behind the emulator: content intact, never faster than the link allows."""
    payload = random.Random(3).randbytes(300_000)
    profile = LinkProfile(bytes_per_second=1_000_000, delay=0.05)

    async def echo(stream):
        async with stream:
            while chunk := await stream.receive_some(65536):
                await stream.send_all(chunk)

    async with trio.open_nursery() as nursery:
        server = await nursery.start(functools.partial(trio.serve_tcp, echo, 0, host="127.0.0.1"))
        target = ("127.0.0.1", server[0].socket.getsockname()[1])
        proxy = await nursery.start(
            LinkEmulator(target, profile, profile).serve,
            await trio.open_tcp_listeners(0, host="127.0.0.1"),
        )
        port = proxy[0].socket.getsockname()[1]
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        started, echoed = trio.current_time(), bytearray()
        async with trio.open_nursery() as io:
            io.start_soon(stream.send_all, payload)
            while len(echoed) < len(payload):
                echoed.extend(await stream.receive_some(65536))
        elapsed = trio.current_time() - started
        await stream.aclose()

        cut = LinkEmulator(target, LinkProfile(), LinkProfile(), cut_after=0.2)
        cut_listeners = await nursery.start(
            cut.serve, await trio.open_tcp_listeners(0, host="127.0.0.1")
        )
        doomed = await trio.open_tcp_stream("127.0.0.1", cut_listeners[0].socket.getsockname()[1])
        while True:  # the emulator cuts it: the read ends, no hang
            try:
                if not await doomed.receive_some(100):
                    break
            except trio.BrokenResourceError:
                break
        nursery.cancel_scope.cancel()
    (echoed, elapsed) = bytes(echoed), elapsed
    assert echoed == payload
    # a lower bound the emulator guarantees (it sleeps until then): both directions' delay
    # plus one serialization of the payload (the two directions overlap)
    assert elapsed >= len(payload) / 1_000_000 + 2 * 0.05


async def test_bytes_a_peer_sent_before_it_closed_arrive_though_the_other_way_broke():
    """A server says goodbye and closes while its client is still sending: on a link whose
    downstream is slower than its upstream, the client's next bytes meet the closed server
    (a write error) before the goodbye has arrived. A wire delivers what it carries: the
    goodbye still arrives, then the end. (The emulator dropped it with the failed
    direction, so a worker behind it missed its shepherd's goodbye and retried for ever.)"""
    upstream, downstream = LinkProfile(delay=0.01), LinkProfile(delay=0.5)

    async def says_goodbye(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.receive_some(100)  # the client is there
            await stream.send_all(b"goodbye")

    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            functools.partial(trio.serve_tcp, says_goodbye, 0, host="127.0.0.1")
        )
        target = ("127.0.0.1", server[0].socket.getsockname()[1])
        proxy = await nursery.start(
            LinkEmulator(target, upstream, downstream).serve,
            await trio.open_tcp_listeners(0, host="127.0.0.1"),
        )
        client = await trio.open_tcp_stream("127.0.0.1", proxy[0].socket.getsockname()[1])
        received = bytearray()

        async def keep_sending() -> None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                while True:  # heartbeats, as a worker sends them
                    await client.send_all(b"beat")
                    await trio.sleep(0.01)

        async with trio.open_nursery() as io:
            io.start_soon(keep_sending)
            with contextlib.suppress(trio.BrokenResourceError):
                while chunk := await client.receive_some(100):
                    received.extend(chunk)
            io.cancel_scope.cancel()
        await client.aclose()
        nursery.cancel_scope.cancel()
    assert bytes(received) == b"goodbye"


async def _tcp_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    """Both ends of one real TCP connection on 127.0.0.1."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        accepted = []
        nursery.start_soon(lambda: _accept(listeners[0], accepted))
        client = await trio.testing.open_stream_to_socket_listener(listeners[0])
    await listeners[0].aclose()
    return client, accepted[0]


async def _accept(listener, into: list) -> None:
    into.append(await listener.accept())


async def test_a_windowed_stream_over_real_sockets_is_held_to_a_window_per_round_trip():
    """Real TCP on both sides of the pipe: the window is reached, and never outrun."""
    window, delay, windows = 256 * 1024, 0.05, 8
    payload = random.Random(5).randbytes(windows * window)
    pipe = ShapedPipe(LinkProfile(delay=delay, window=window), ack_delay=delay)

    sender, pipe_in = await _tcp_pair()
    pipe_out, receiver = await _tcp_pair()
    received = bytearray()

    async def send():
        await sender.send_all(payload)
        await sender.send_eof()

    async def receive():
        while chunk := await receiver.receive_some(1 << 20):
            received.extend(chunk)

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        nursery.start_soon(receive)
        nursery.start_soon(pipe.run, pipe_in, pipe_out)
    elapsed = trio.current_time() - started
    for stream in (sender, pipe_in, pipe_out, receiver):
        await stream.aclose()
    (received, elapsed) = bytes(received), elapsed
    assert received == payload
    assert pipe.peak_in_flight == window  # the sender kept the window full: it was the limit
    # what the emulator guarantees (it sleeps until then): every window but the last waits a
    # round trip for its acknowledgement, the last crosses one way; rate <= window / RTT
    assert elapsed >= (windows - 1) * 2 * delay + delay


# A worker training through `pcp-tui emulate-link` (the CLI, real processes): tests/test_streams_e2e.py


@pytest.mark.e2e
def test_an_address_in_use_is_reported_and_a_closed_stdout_does_not_stop_the_link():
    """`pcp-tui emulate-link` as a process: a busy port is a one-line error naming it;
    a launcher that stops reading the emulator's output leaves the link working."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        refused = subprocess.run(
            [*_EMULATE, "--listen", f"127.0.0.1:{port}", "--to", "127.0.0.1:9"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert refused.returncode == 1
    assert refused.stdout.startswith(f"pcp-tui: error: cannot listen on 127.0.0.1:{port} ")

    read_end, write_end = os.pipe()
    os.close(read_end)  # stdout is a pipe nobody reads: printing to it raises EPIPE
    with socket.socket() as target:
        target.bind(("127.0.0.1", 0))
        target.listen()
        listen = free_port()
        emulator = subprocess.Popen(
            [*_EMULATE, "--listen", f"127.0.0.1:{listen}", "--to", _address(target)],
            stdout=write_end,
        )
        os.close(write_end)
        try:
            client = _connect_when_listening(listen, emulator)
            with client, target.accept()[0] as server:
                client.sendall(b"still here")
                assert server.recv(64) == b"still here"
        finally:
            emulator.kill()
            emulator.wait()


_EMULATE = [sys.executable, "-m", "pcp_tui", "emulate-link", "--rtt", "0ms"]


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()
    return f"{host}:{port}"


def _connect_when_listening(port: int, process: subprocess.Popen) -> socket.socket:
    """A connection to the emulator once it listens (it has no output to wait on here)."""
    while True:
        assert process.poll() is None, "the emulator stopped"
        try:
            return socket.create_connection(("127.0.0.1", port))
        except ConnectionRefusedError:
            time.sleep(0.05)
