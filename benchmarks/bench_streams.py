"""Several TCP streams against one over an emulated long fat pipe, in the same invocation.

One TCP stream moves at most its window per round trip. `pcp-tui emulate-link
--window` holds each proxied connection to that, as a receive window does;
this benchmark sends one big PCP message (a pseudo-gradient's worth of float32)
through the emulator over K = 1, 2, 4, 8 connections striped by
`protocol.StripedStream`, timing from the first byte sent to the message
decoded on the far side, and prints a table with the ratio against K = 1 and
the bound the link allows: min(bandwidth, K x window / RTT).

    python benchmarks/bench_streams.py [--mb 128] [--bandwidth 1Gbit] [--rtt 50ms]
                                       [--window 1MiB] [--streams 1,2,4,8] [--repeats 1]

The emulator runs in its own process (`pcp-tui emulate-link --shared`: the K
connections share one wire of `--bandwidth`, as they would one machine's link),
so the shaping does not share an interpreter with the sender and receiver.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pcp_tui import protocol  # noqa: E402
from pcp_tui.app.link_emulator import parse_bandwidth, parse_duration, parse_window  # noqa: E402
from pcp_tui.testing import free_port  # noqa: E402


async def accept_ordered(listener: trio.SocketListener, count: int) -> list[trio.abc.Stream]:
    """`count` connections, ordered by the index byte each sends first (the emulator may
    open them towards us in any order)."""
    streams: list = [None] * count
    for _ in range(count):
        stream = await listener.accept()
        index = (await stream.receive_some(1))[0]
        streams[index] = stream
    return streams


async def transfer(link_port: int, listener, count: int, params: dict) -> float:
    """Seconds from the first byte sent to the message decoded, over `count` striped streams."""
    clients = []
    for index in range(count):
        client = await trio.open_tcp_stream("127.0.0.1", link_port)
        await client.send_all(bytes([index]))
        clients.append(client)
    servers = await accept_ordered(listener, count)
    sender = protocol.MessageStream(protocol.StripedStream(clients) if count > 1 else clients[0])
    receiver = protocol.MessageStream(protocol.StripedStream(servers) if count > 1 else servers[0])
    received = []
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender.send, protocol.RoundResult(round=1), params)
        received.append(await receiver.receive())
    elapsed = time.perf_counter() - started
    assert np.array_equal(received[0].tensors["pseudo_gradient"], params["pseudo_gradient"])
    await sender.aclose()
    await receiver.aclose()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=128, help="message size in MB")
    parser.add_argument("--bandwidth", default="1Gbit")
    parser.add_argument("--rtt", default="50ms")
    parser.add_argument("--window", default="1MiB")
    parser.add_argument("--streams", default="1,2,4,8", help="values of K, the first the baseline")
    parser.add_argument("--repeats", type=int, default=1, help="the best of this many per K")
    args = parser.parse_args()
    counts = [int(value) for value in args.streams.split(",")]
    rate = parse_bandwidth(args.bandwidth)
    rtt = parse_duration(args.rtt, "--rtt")
    window = parse_window(args.window)
    params = {"pseudo_gradient": np.ones(int(args.mb * 1e6 / 4), np.float32)}
    nbytes = params["pseudo_gradient"].nbytes

    target, link_port = free_port(), free_port()
    link = subprocess.Popen(
        [sys.executable, "-m", "pcp_tui", "emulate-link", "--listen", f"127.0.0.1:{link_port}"]
        + ["--to", f"127.0.0.1:{target}", "--bandwidth", args.bandwidth, "--rtt", args.rtt]
        + ["--window", args.window, "--shared"],
        stdout=subprocess.PIPE,
        text=True,
    )

    async def run() -> dict[int, float]:
        listener = (await trio.open_tcp_listeners(target, host="127.0.0.1"))[0]
        best = {}
        for count in counts:
            best[count] = min(
                [await transfer(link_port, listener, count, params) for _ in range(args.repeats)]
            )
        return best

    try:
        link.stdout.readline()  # "emulating ...": it listens
        best = trio.run(run)
    finally:
        link.kill()
        link.wait()

    print(
        f"\none {nbytes / 1e6:.0f} MB message through emulate-link "
        f"({args.bandwidth}, RTT {args.rtt}, window {args.window} per connection)\n"
    )
    print(
        f"{'streams':>7} {'seconds':>8} {'MB/s':>8} {'Mbit/s':>8} {'bound Mbit/s':>13} {'vs K=1':>7}"
    )
    for count, seconds in best.items():
        bound = min(rate, count * window / rtt) * 8 / 1e6
        speed = nbytes / seconds
        ratio = best[counts[0]] / seconds
        print(
            f"{count:>7} {seconds:>8.2f} {speed / 1e6:>8.1f} {speed * 8 / 1e6:>8.0f} "
            f"{bound:>13.0f} {ratio:>6.2f}x"
        )
    print(f"ratio_k{counts[-1]}_vs_k{counts[0]}={best[counts[0]] / best[counts[-1]]:.2f}")


if __name__ == "__main__":
    main()
