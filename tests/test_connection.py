"""The one connection class both sides use, and the worker's reconnect budget, on trio's virtual
clock; one real `pcp-tui worker` process that gives up and says so."""

from __future__ import annotations

import re

import numpy as np
import pytest
import trio
import trio.testing

from pcp_tui import protocol
from pcp_tui.contract.connection import (
    CLOSE_SECONDS,
    HELLO_SECONDS,
    Connection,
    ConnectionLost,
    IdInUse,
    Refused,
    ended_by,
    expect_hello,
)
from pcp_tui.contract.plan import Stage
from pcp_tui.testing import OutputProcess, free_port, worker_command
from pcp_tui.worker.reconnect import FIRST_WAIT, LAST_TRY_SECONDS, Reconnect


def _pair() -> tuple[Connection, protocol.MessageStream, trio.abc.Stream]:
    """A worker-side Connection, and its peer as a MessageStream and as raw bytes."""
    ours, theirs = trio.testing.memory_stream_pair()
    connection = Connection(protocol.MessageStream(ours), "worker", clock=trio.current_time)
    return connection, protocol.MessageStream(theirs), theirs


async def test_heartbeats_go_out_on_the_negotiated_interval(autojump_clock):
    connection, peer, _ = _pair()
    beats: list[float] = []
    async with connection.alive(heartbeat_seconds=2.5, timeout=100.0):
        while len(beats) < 4:
            message = await peer.receive()
            assert message.kind == "heartbeat"
            beats.append(trio.current_time())
    assert beats == [2.5, 5.0, 7.5, 10.0]


async def test_a_broken_link_met_by_a_task_the_body_started_ends_it_as_lost(autojump_clock):
    """A worker's result goes out from a task of the round (its exchange), not the body: a
    shepherd killed as the send began broke the pipe there, the error came out of the
    nursery as an exception group that nothing caught, and the worker exited with a
    traceback instead of reconnecting (the elastic kill-and-resume test waited for it)."""
    connection, _, theirs = _pair()
    await theirs.aclose()  # the peer is gone

    async def send_a_result():
        await connection.send(protocol.Heartbeat(0.0))  # any message: the pipe is broken

    with pytest.raises(ConnectionLost):
        async with connection.alive(heartbeat_seconds=1.0, timeout=100.0) as tasks:
            tasks.start_soon(send_a_result)
            await trio.sleep_forever()


async def test_the_watchdog_ends_a_silent_connection_after_the_timeout_and_not_while_paused(
    autojump_clock,
):
    connection, _, _ = _pair()
    with pytest.raises(ConnectionLost) as lost:
        async with connection.alive(heartbeat_seconds=1.0, timeout=10.0):
            with connection.paused():  # compiling: the peer's silence does not count
                await trio.sleep(30)
            await connection.receive()  # nothing ever comes
    # polls every 1 s; silent 10 s is not over the timeout, 11 s is
    assert trio.current_time() == 30 + 11
    assert lost.value.code == "timeout"
    assert lost.value.reason == "silent for 11 s (heartbeat timeout 10 s)"


async def test_a_message_still_arriving_is_not_silence(autojump_clock):
    """A round start trickles in over 60 s, 100 bytes every 5 s: longer than the 10 s
    timeout, but never 10 s without a byte, so it arrives whole."""

    connection, _, raw = _pair()
    connection.stage = Stage.READY
    weights = np.arange(300, dtype=np.float32)
    recorder, recorded = trio.testing.memory_stream_pair()
    size = await protocol.MessageStream(recorder).send(protocol.RoundStart(round=3), {"w": weights})
    wire = b""
    while len(wire) < size:
        wire += await recorded.receive_some()

    async def trickle():
        for start in range(0, len(wire), 100):
            await trio.sleep(5)
            await raw.send_all(wire[start : start + 100])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trickle)
        async with connection.alive(heartbeat_seconds=1.0, timeout=10.0):
            message = await connection.receive()
    assert trio.current_time() == 5 * -(-len(wire) // 100) > 10
    assert message.body.round == 3
    np.testing.assert_array_equal(message.tensors["w"], weights)


async def test_concurrent_sends_never_interleave(autojump_clock):
    """Eight tasks send 256 KiB messages at once: each arrives whole, none mixed."""

    connection, peer, _ = _pair()
    received: dict[int, np.ndarray] = {}

    async def receive_all():
        for _ in range(8):
            message = await peer.receive()
            received[message.body.round] = message.tensors["w"]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive_all)
        for number in range(8):
            tensors = {"w": np.full(65536, number, np.float32)}
            nursery.start_soon(connection.send, protocol.RoundStart(round=number), tensors)
    assert sorted(received) == list(range(8))
    for number, array in received.items():
        np.testing.assert_array_equal(array, np.full(65536, number, np.float32))


async def test_close_tells_the_peer_why_then_says_goodbye(autojump_clock):
    connection, peer, _ = _pair()
    await connection.close("done", error=ConnectionLost("you sent garbage", code="malformed"))
    error, goodbye = await peer.receive(), await peer.receive()
    assert error.body == protocol.Error(protocol.ErrorCode.MALFORMED, "you sent garbage")
    assert goodbye.body == protocol.Goodbye("done")
    with pytest.raises(protocol.ConnectionClosed):
        await peer.receive()
    await connection.close("again")  # a second close is a no-op


async def test_close_is_bounded_when_the_peer_does_not_read(autojump_clock):
    ours, _theirs = trio.testing.lockstep_stream_pair()  # a send waits for a reader
    connection = Connection(protocol.MessageStream(ours), "shepherd", clock=trio.current_time)
    await connection.close("bye")
    assert trio.current_time() == CLOSE_SECONDS
    with pytest.raises(trio.ClosedResourceError):
        await connection.send(protocol.Heartbeat(0.0))


async def test_a_kind_out_of_turn_is_refused_from_its_header(autojump_clock):
    connection, peer, _ = _pair()  # a worker that has no plan yet
    await peer.send(protocol.RoundStart(round=1), {"w": np.zeros(4, np.float32)})
    with pytest.raises(protocol.MalformedMessage, match="roundStart is not valid while"):
        await connection.receive()


def test_error_codes_fall_into_the_three_kinds():
    def error(code):
        return protocol.Error(code, "why")

    assert type(ended_by(error(protocol.ErrorCode.AUTH_FAILED))) is Refused
    assert type(ended_by(error(protocol.ErrorCode.UNSUPPORTED_BACKEND))) is Refused
    assert type(ended_by(error(protocol.ErrorCode.ID_IN_USE))) is IdInUse
    assert type(ended_by(error(protocol.ErrorCode.TIMEOUT))) is ConnectionLost
    assert type(ended_by(error(protocol.ErrorCode.MALFORMED))) is ConnectionLost


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"", r"no hello from shepherd:8080 in 60 s: is --connect the address in the shepherd's"),
        (b"SSH-2.0-OpenSSH_9.6\r\n", r"shepherd:8080 does not speak PCP \(frame claims \d+ "),
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", r"shepherd:8080 does not speak PCP \("),
        (None, r"shepherd:8080 closed the connection before its hello \(.*if it goes on: is"),
    ],
    ids=["silent", "ssh", "http", "closed"],
)
async def test_a_port_that_is_no_shepherd_is_named_not_waited_on(autojump_clock, answer, error):
    """--connect at another service: it says nothing (the worker waited in its handshake
    for all of --give-up-after) or sends bytes that are no PCP frame."""

    ours, theirs = trio.testing.memory_stream_pair()
    if answer is None:
        await theirs.aclose()
    else:
        await theirs.send_all(answer)
    started = trio.current_time()
    with pytest.raises(ConnectionLost, match=error):
        await expect_hello(protocol.MessageStream(ours), "shepherd:8080")
    assert trio.current_time() - started == (HELLO_SECONDS if answer == b"" else 0)


class Unreachable:
    """An attempt that never gets a welcome: when each try began, and the deadline it was given."""

    def __init__(self, takes: str = "nothing"):
        self.takes = takes  # "nothing": refused at once; "deadline": black-holed until its deadline
        self.tries: list[tuple[float, float]] = []

    async def __call__(self, deadline: float) -> str:
        self.tries.append((trio.current_time(), deadline))
        if self.takes == "deadline":
            await trio.sleep_until(deadline)
        raise ConnectionLost("cannot reach 127.0.0.1:9 (connection refused)")


async def test_reconnect_waits_double_within_their_range_and_are_cut_to_the_budget(autojump_clock):
    waits: list[float] = []
    attempt = Unreachable()
    reconnect = Reconnect(give_up_after=60, max_backoff=8, on_wait=lambda _, s: waits.append(s))
    with pytest.raises(ConnectionLost, match=r"; gave up after 60 s of retrying .*--give-up-after"):
        await reconnect.run(attempt)
    starts = [start for start, _ in attempt.tries]
    assert starts[0] == 0 and starts[-1] == 60  # the budget, exactly: the last try is at its end
    slept = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert slept == pytest.approx(waits, abs=1e-9)  # each wait announced was slept
    for number, wait in enumerate(waits[:-1], start=1):  # the last one is cut to what is left
        most = min(8, FIRST_WAIT * 2 ** (number - 1))
        assert most / 2 <= wait <= most, (number, waits)
    assert 0 < waits[-1] <= 8
    assert all(deadline == max(60, start + LAST_TRY_SECONDS) for start, deadline in attempt.tries)


async def test_a_black_holed_address_cannot_stretch_the_budget(autojump_clock):
    attempt = Unreachable(takes="deadline")
    with pytest.raises(ConnectionLost, match="gave up after 10 s"):
        await Reconnect(give_up_after=10, max_backoff=4).run(attempt)
    assert attempt.tries == [(0, 10)] and trio.current_time() == 10


async def test_giving_up_on_a_first_join_points_at_the_address_not_at_an_ended_run(
    autojump_clock,
):
    """A worker that never got in (a wrong --connect port, no shepherd yet) was told the run
    may have ended while it was cut off; it was never in one. A rejoin still says so."""
    with pytest.raises(ConnectionLost) as first:
        await Reconnect(give_up_after=5).run(Unreachable())
    assert "is --connect the address its join command printed?" in str(first.value)
    assert "cut off" not in str(first.value)
    with pytest.raises(ConnectionLost, match="the run may have ended while this worker was cut"):
        await Reconnect(give_up_after=5).run(Unreachable(), rejoin=True)


async def test_without_retries_the_first_loss_is_final_and_other_errors_pass_at_once(
    autojump_clock,
):
    attempt = Unreachable()
    with pytest.raises(
        ConnectionLost, match=r"^cannot reach 127\.0\.0\.1:9 \(connection refused\)$"
    ):
        await Reconnect(give_up_after=60, retry=False).run(attempt)
    assert len(attempt.tries) == 1 and trio.current_time() == 0

    async def refused(deadline: float) -> None:
        raise Refused("authFailed")

    with pytest.raises(Refused):
        await Reconnect(give_up_after=60).run(refused)
    assert trio.current_time() == 0


async def test_a_welcome_ends_the_retries_and_a_lost_connection_pauses_first(autojump_clock):
    tries: list[float] = []

    async def third_time_lucky(deadline: float) -> str:
        tries.append(trio.current_time())
        if len(tries) < 3:
            raise ConnectionLost("cannot reach 127.0.0.1:9 (connection refused)")
        return "welcome"

    assert await Reconnect(give_up_after=60).run(third_time_lucky, rejoin=True) == "welcome"
    assert len(tries) == 3
    assert FIRST_WAIT / 2 <= tries[0] <= FIRST_WAIT  # not hammering a shepherd that dropped it


@pytest.mark.e2e
def test_give_up_after_is_the_total_time_spent_trying():
    """Nobody listens: the worker process retries, logs each attempt and why, then exits 1
    naming the option (the waits and the budget: the virtual-clock tests above)."""
    port = free_port()
    command = worker_command(port, "--give-up-after", "3", "--log-level", "info", "--quiet")
    worker = OutputProcess(command)
    assert worker.finish() == 1, worker.output
    retries = worker.matches(r"INFO pcp_tui\.worker\.reconnect: (.*); retrying in ([\d.]+) s")
    assert len(retries) >= 2, worker.output
    assert all(m[1].startswith(f"cannot reach 127.0.0.1:{port} (") for m in retries), worker.output
    waits = [float(m[2]) for m in retries]
    assert sum(waits) <= 3.0 + 0.05 * len(waits), waits  # each wait is cut to fit the budget
    last = worker.output.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"pcp-tui: error: cannot reach 127\.0\.0\.1:{port} \(connection refused: no shepherd "
        r"listens on that port \(yet\)\); gave up "
        r"after \d+ s of retrying without getting in \(.*--give-up-after sets the limit\)",
        last,
    ), last


@pytest.mark.parametrize(
    ("hostnames", "described"),
    [(("a", "b\x1b"), "cpu x4 on 2 hosts"), (("a", "a"), "cpu x4 in 2 processes")],
)
async def test_a_sites_hello_says_its_devices_processes_and_hosts(hostnames, described):
    """A worker of 2 processes x 2 devices (multi-controller JAX) is one worker of 4 devices;
    its hosts are counted by name (two processes tried on one host are not 2 hosts)."""
    from pcp_tui.contract import auth
    from pcp_tui.shepherd.serving.connection import handshake

    ours, theirs = trio.testing.memory_stream_pair()
    shepherd, worker = protocol.MessageStream(ours), protocol.MessageStream(theirs)
    backend = protocol.BackendInfo(device_count=4, process_count=2, hostnames=hostnames)
    async with trio.open_nursery() as nursery:

        async def answer() -> None:
            hello = (await worker.receive()).body
            proof = auth.proof("t", hello.nonce, "site")
            body = protocol.WorkerHello(
                supported_versions=protocol.SUPPORTED_VERSIONS,
                worker_id="site",
                hostname="a",
                backend=backend,
                proof=proof,
            )
            await worker.send(body)

        nursery.start_soon(answer)
        hello = await handshake(shepherd, token="t", run_id="r")
    assert (hello.backend, hello.devices, hello.processes) == (described, 4, 2)
    assert hello.hosts == tuple(h.replace("\x1b", "\\x1b") for h in hostnames)  # no escape
