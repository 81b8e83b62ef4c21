"""How close does `protocol.MessageStream` get to a raw socket when moving model parameters?

Moves ~300 MB of float32 tensors shaped like GPT-2-124M (token embedding,
position embedding, then whole transformer blocks) over real TCP on
127.0.0.1 to a separate receiver process, and times, per transfer, everything
from "start encoding" on the sender to "decoded, acknowledged" back from the
receiver:

- ``raw socket``: `socket.sendall` of each tensor's bytes / `recv_into` one
  preallocated buffer: the floor any codec has to pay.
- ``MessageStream none``: encode + send + receive + decode, unquantized.
- ``MessageStream bfloat16`` / ``int8Block`` / ``int4Block``: the same with
  quantization (MB and GB/s count the float32 bytes represented, so they show
  the effective parameter throughput; the wire carries 1/2, ~1/4, ~1/8 of it).

    python benchmarks/bench_tensor_transfer.py [--mb 300] [--repeats 3] [--smoke]

Prints a table and a final ``ratio_vs_raw_socket=<x>`` line (unquantized
MessageStream time over raw socket time as a speed ratio: 1.0 is parity).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import subprocess
import sys
import time

import numpy as np
import trio

from pcp_tui import protocol
from pcp_tui.testing import parse_with_smoke

METHODS = {
    1: ("raw socket", None),
    2: ("MessageStream none", "none"),
    3: ("MessageStream bfloat16", "bfloat16"),
    4: ("MessageStream int8Block", "int8Block"),
    5: ("MessageStream int4Block", "int4Block"),
}
QUIT = 0
COMMAND = struct.Struct("<QQ")  # method, payload bytes


def gpt2_shapes(n_layer: int = 12, d: int = 768, vocab: int = 50257, context: int = 1024):
    """(name, shape) of GPT-2-124M's parameters, in checkpoint order."""
    yield "wte", (vocab, d)
    yield "wpe", (context, d)
    for layer in range(n_layer):
        prefix = f"h.{layer}."
        yield prefix + "ln_1.g", (d,)
        yield prefix + "ln_1.b", (d,)
        yield prefix + "attn.c_attn.w", (d, 3 * d)
        yield prefix + "attn.c_attn.b", (3 * d,)
        yield prefix + "attn.c_proj.w", (d, d)
        yield prefix + "attn.c_proj.b", (d,)
        yield prefix + "ln_2.g", (d,)
        yield prefix + "ln_2.b", (d,)
        yield prefix + "mlp.c_fc.w", (d, 4 * d)
        yield prefix + "mlp.c_fc.b", (4 * d,)
        yield prefix + "mlp.c_proj.w", (4 * d, d)
        yield prefix + "mlp.c_proj.b", (d,)
    yield "ln_f.g", (d,)
    yield "ln_f.b", (d,)


def make_params(megabytes: float) -> dict[str, np.ndarray]:
    """GPT-2-shaped float32 tensors, in order, until about `megabytes` MB (whole tensors only)."""
    rng = np.random.default_rng(0)
    params, total, target = {}, 0, megabytes * 1e6
    for name, shape in gpt2_shapes(n_layer=48):
        size = int(np.prod(shape)) * 4
        if total + size > target * 1.02:  # (the 154 MB token embedding too, below 151 MB)
            continue
        params[name] = rng.standard_normal(shape, dtype=np.float32) * 0.02
        total += size
        if total >= target * 0.98:
            break
    if not params:
        raise SystemExit(f"--mb {megabytes}: no GPT-2 tensor is that small; give 0.01 or more")
    return params


# --------------------------------------------------------------------------- receiver process


def receiver_main() -> None:
    """Accept one connection per transfer, receive it the way the method says, acknowledge."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    while True:
        connection, _ = listener.accept()
        with connection:
            method, nbytes = COMMAND.unpack(_recv_exact(connection, COMMAND.size))
            if method == QUIT:
                return
            if METHODS[method][1] is None:
                _receive_raw(connection, nbytes)
            else:
                trio.run(_receive_message, connection)


def _recv_exact(connection: socket.socket, nbytes: int) -> bytes:
    data = bytearray()
    while len(data) < nbytes:
        chunk = connection.recv(nbytes - len(data))
        if not chunk:
            raise ConnectionError("sender went away")
        data += chunk
    return bytes(data)


def _receive_raw(connection: socket.socket, nbytes: int) -> None:
    buffer = memoryview(np.empty(nbytes, np.uint8))
    filled = 0
    while filled < nbytes:
        got = connection.recv_into(buffer[filled:])
        if not got:
            raise ConnectionError("sender went away")
        filled += got
    connection.sendall(b"k")


async def _receive_message(connection: socket.socket) -> None:
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(connection.dup()))
    message = await protocol.MessageStream(stream).receive()
    assert message.kind == "roundStart" and message.tensors
    await stream.send_all(b"k")
    await stream.aclose()


# --------------------------------------------------------------------------- sender (this process)


def transfer(port: int, method: int, params: dict[str, np.ndarray]) -> tuple[float, int]:
    """Seconds and wire bytes of one transfer, from the first byte prepared to the receiver's acknowledgement."""
    nbytes = sum(array.nbytes for array in params.values())
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.sendall(COMMAND.pack(method, nbytes))
        quantization = METHODS[method][1]
        if quantization is None:
            start = time.perf_counter()
            for array in params.values():
                connection.sendall(memoryview(array.reshape(-1).view(np.uint8)))
            _recv_exact(connection, 1)
            return time.perf_counter() - start, nbytes
        return trio.run(_send_message, connection, params, quantization)


async def _send_message(connection: socket.socket, params, quantization: str) -> tuple[float, int]:
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(connection.dup()))
    start = time.perf_counter()
    sent = await protocol.MessageStream(stream).send(
        protocol.RoundStart(round=1), params, quantization=quantization
    )
    if await stream.receive_some(1) != b"k":
        raise ConnectionError("receiver did not acknowledge")
    elapsed = time.perf_counter() - start
    await stream.aclose()
    return elapsed, sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--mb", type=float, default=300.0, help="float32 megabytes to move per transfer"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="transfers per method (median reported)"
    )
    parser.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    args = parse_with_smoke(parser, mb=4.0, repeats=1)
    if args.receiver:
        receiver_main()
        return
    params = make_params(args.mb)
    megabytes = sum(array.nbytes for array in params.values()) / 1e6
    print(
        f"{len(params)} GPT-2-shaped float32 tensors, {megabytes:.1f} MB, over TCP 127.0.0.1 "
        f"to a separate receiver process, {args.repeats} repeats",
        flush=True,
    )
    receiver = subprocess.Popen(
        [sys.executable, __file__, "--receiver"], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(receiver.stdout.readline())
        times: dict[int, list[float]] = {method: [] for method in METHODS}
        wire: dict[int, int] = {}
        for repeat in range(args.repeats + 1):  # round-robin, so load drift hits every method alike
            for method in METHODS:
                seconds, wire[method] = transfer(port, method, params)
                if repeat:  # the first round warms up: page faults, first-call costs
                    times[method].append(seconds)
        with socket.create_connection(("127.0.0.1", port)) as connection:
            connection.sendall(COMMAND.pack(QUIT, 0))
        receiver.wait(timeout=30)
    finally:
        if receiver.poll() is None:
            receiver.kill()
    print_table(times, wire, sum(array.nbytes for array in params.values()) / 1e6)


def print_table(times: dict[int, list[float]], wire: dict[int, int], megabytes: float) -> None:
    raw = statistics.median(times[1])
    print(
        f"\n{'method':<26}{'MB':>8}{'wire MB':>9}{'median s':>10}{'best s':>8}{'GB/s':>7}{'vs raw':>8}"
    )
    for method, samples in times.items():
        name = METHODS[method][0]
        seconds = statistics.median(samples)
        print(
            f"{name:<26}{megabytes:>8.1f}{wire[method] / 1e6:>9.1f}{seconds:>10.3f}{min(samples):>8.3f}"
            f"{megabytes / 1e3 / seconds:>7.2f}{raw / seconds:>8.2f}"
        )
    print("(GB/s counts float32 bytes represented; 'vs raw' = raw socket time / method time)")
    print(f"ratio_vs_raw_socket={raw / statistics.median(times[2]):.3f}")


if __name__ == "__main__":
    main()
