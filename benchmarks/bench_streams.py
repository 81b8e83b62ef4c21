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
                                       [--smoke]

With `--round`, it times whole DiLoCo rounds instead: a real shepherd and one
CPU worker (GPT-2 on bytes, 86M parameters: ~344 MB of parameters out and of
pseudo-gradient back each round) through the same emulated link, with
`--streams` K for each K, and prints the rounds' wall time after the first.

    python benchmarks/bench_streams.py --round [--streams 1,4] [--rounds 3]

The emulator runs in its own process (`pcp-tui emulate-link --shared`: the K
connections share one wire of `--bandwidth`, as they would one machine's link),
so the shaping does not share an interpreter with the sender and receiver.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import trio

from pcp_tui import protocol
from pcp_tui.app.link_emulator import parse_bandwidth, parse_duration, parse_window
from pcp_tui.testing import (
    OutputProcess,
    WorkerProcesses,
    free_port,
    link_emulator_command,
    parse_with_smoke,
    shepherd_command,
)

ROUND_RUN = ("--model", "gpt2", "--batch-size", "1", "--seq-len", "64", "--inner-steps", "4")
ROUND_RUN += ("--chunk-steps", "4", "--workers", "1", "--data-max-bytes", "1000000")


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


def link_command(listen: int, target: int, args) -> list[str]:
    """`pcp-tui emulate-link` with all connections on one shared wire of `args.bandwidth`."""
    return link_emulator_command(
        listen, target, args.bandwidth, args.rtt, "--window", args.window, "--shared"
    )


def round_seconds(count: int, args) -> list[dict]:
    """The round events after the first of a real run with `--streams count`."""
    port, link_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as folder:
        metrics = Path(folder) / "run.jsonl"
        shepherd = OutputProcess(
            shepherd_command(port, *ROUND_RUN, "--rounds", str(args.rounds))
            + ["--streams", str(count), "--metrics", str(metrics)],
        )
        link = OutputProcess(link_command(link_port, port, args))
        try:
            link.wait_for("emulating")
            shepherd.wait_for("listening on")
            with WorkerProcesses() as workers:
                workers.spawn(link_port, "--id", "w0")
                assert shepherd.finish() == 0, shepherd.output
            rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        finally:
            shepherd.kill()
            link.kill()
    return [row for row in rows if row["event"] == "round"][1:]


def rounds_table(counts: list[int], args) -> None:
    rounds = {count: round_seconds(count, args) for count in counts}

    def median(count: int, key: str) -> float:
        return statistics.median(row[key] for row in rounds[count])

    print(
        f"\nDiLoCo rounds ({' '.join(ROUND_RUN)}) through emulate-link "
        f"({args.bandwidth}, RTT {args.rtt}, window {args.window} per connection), "
        "medians of the rounds after the first\n"
    )
    print(f"{'streams':>7} {'round s':>8} {'compute s':>10} {'exchange s':>11} {'vs K=1':>7}")
    base = median(counts[0], "round_seconds")
    for count in counts:
        seconds = median(count, "round_seconds")
        print(
            f"{count:>7} {seconds:>8.2f} {median(count, 'compute_seconds'):>10.2f} "
            f"{median(count, 'communication_seconds'):>11.2f} {base / seconds:>6.2f}x"
        )
    last = median(counts[-1], "round_seconds")
    print(f"ratio_round_k{counts[-1]}_vs_k{counts[0]}={base / last:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=128, help="message size in MB")
    parser.add_argument("--bandwidth", default="1Gbit")
    parser.add_argument("--rtt", default="50ms")
    parser.add_argument("--window", default="1MiB")
    parser.add_argument("--streams", default="1,2,4,8", help="values of K, the first the baseline")
    parser.add_argument("--repeats", type=int, default=1, help="the best of this many per K")
    parser.add_argument("--round", action="store_true", help="time whole DiLoCo rounds instead")
    parser.add_argument("--rounds", type=int, default=3, help="with --round: rounds per run")
    args = parse_with_smoke(parser, mb=2.0, rtt="5ms", window="256KiB", streams="1,2")
    counts = [int(value) for value in args.streams.split(",")]
    if args.round:
        rounds_table(counts, args)
        return
    rate = parse_bandwidth(args.bandwidth)
    rtt = parse_duration(args.rtt, "--rtt")
    window = parse_window(args.window)
    params = {"pseudo_gradient": np.ones(int(args.mb * 1e6 / 4), np.float32)}
    nbytes = params["pseudo_gradient"].nbytes

    target, link_port = free_port(), free_port()
    link = subprocess.Popen(
        link_command(link_port, target, args), stdout=subprocess.PIPE, text=True
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
