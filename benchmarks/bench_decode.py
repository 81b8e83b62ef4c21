"""Receiving a quantized model-sized message: one-pass decode (before) vs chunked over threads (now).

A shepherd decodes k quantized pseudo-gradients a round; a Streaming DiLoCo
worker decodes every fragment update and adds it to the fragment's last
global value. Before, each tensor was decoded by `_tensors.dequantize` in
whole-array steps on one thread (int4 first unpacked into a model-sized int8
array), and the worker's `last + change` made a new model-sized array. Now
`_dequantize.dequantize_chunked` decodes a cache-sized chunk at a time over
--threads threads, and the worker writes `last + change` over the decoded
change in chunks over threads (`worker.rounds.add_changes`).

For each size (float32 values on GPT-2-like (rows, 768) matrices) and
quantization, in one process on the same payloads:

- decode: every tensor's payload to float32, before and now (1 thread, --threads);
- decode + add: the worker's new global value from the payloads, before and now;
- receive (int8Block only, --receive): one whole roundResult through a real
  `protocol.MessageStream` on a loopback socket pair, from the first byte sent to
  the float32 tensors in hand, with the receive path's payload loop as it was
  (`read_message_before`: read, then decode with `dequantize`, then read on) and
  as it is (chunked decode over threads, behind the reading of the next payload).

It stops if a decoded bit differs. Ratios are against "before" measured in the
same run. Each figure is the best of --repeat runs (noise only adds time),
after --warmup runs left out; each run starts with another way, and freed
memory is kept for reuse (see `warm_pages`: page faults are left out).
Timings on a shared 2-core box are noisy.

    python benchmarks/bench_decode.py [--sizes 31 124] [--threads 8] [--repeat 3] [--warmup 1]
        [--smoke]

Ends with `ratio_decode_now_vs_before=<x>`: the last row's decode speed-up.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import time

import numpy as np
import trio

from pcp_tui import protocol
from pcp_tui.protocol import _chunked, _codec, _stream
from pcp_tui.protocol._dequantize import dequantize_chunked
from pcp_tui.protocol._tensors import dequantize
from pcp_tui.testing import gpt2_like_shapes, parse_with_smoke
from pcp_tui.worker.rounds import add_changes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def warm_pages() -> str:
    """Have glibc keep freed memory and serve arrays up to 32 MiB from it (mallopt).

    Every way then decodes into pages the warm-up already faulted in: on a VM a
    fresh page can cost 10x its arithmetic, at random, which would drown what is
    measured. So these numbers leave out the page faults of the output array, the
    same for both ways (the old worker's extra `last + change` array included).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return "allocator as it is (not glibc)"
    if libc.mallopt(M_TRIM_THRESHOLD, 2**62) != 1 or libc.mallopt(M_MMAP_THRESHOLD, 2**25) != 1:
        return "allocator as it is (mallopt refused)"
    return "warm pages"


def timed(fn, *args):
    start = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - start, value


def decode_before(payloads: dict) -> dict:
    return {n: dequantize(payload, spec) for n, (spec, payload) in payloads.items()}


def decode_now(payloads: dict, threads: int) -> dict:
    return {
        n: dequantize_chunked(payload, spec, threads) for n, (spec, payload) in payloads.items()
    }


def add_before(payloads: dict, last: dict) -> dict:
    """The worker as it was: decode, then `last + change` into a new array."""
    decoded = decode_before(payloads)
    return {n: last[n] + decoded[n] for n in last}


def add_now(payloads: dict, last: dict, threads: int) -> dict:
    decoded = decode_now(payloads, threads)
    return add_changes(last, decoded)


def digests(tensors: dict) -> dict[str, bytes]:
    """A hash of each tensor's bytes: results are compared without keeping one alive."""
    return {n: hashlib.blake2b(memoryview(a).cast("B")).digest() for n, a in tensors.items()}


async def receive_once(encoded: protocol.Encoded, threads: int) -> tuple[float, dict]:
    """Seconds from the first byte sent to the decoded tensors, over a loopback socket pair."""
    left, right = trio.socket.socketpair()
    sender = protocol.MessageStream(trio.SocketStream(left))
    receiver = protocol.MessageStream(trio.SocketStream(right))
    receiver.decode_threads = threads
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender.send_encoded, encoded)
        message = await receiver.receive()
    seconds = time.perf_counter() - start
    await sender.aclose()
    await receiver.aclose()
    return seconds, message.tensors


async def read_message_before(reader, limits, *, offload, threads, before_payload, check_header):
    """`_codec.read_message` as it was: each payload read, then decoded by `dequantize` (in a
    thread when big) before the next is read. The frame part is today's, unchanged."""
    frame = await _codec._read_frame(reader, limits)
    body, version, specs = _codec._parse_frame(frame, limits)
    tensors = {}
    for spec in specs:
        payload = np.empty(spec.payload_bytes, np.uint8)
        await reader.read_into(memoryview(payload))
        if spec.count * 4 > _codec.OFFLOAD_BYTES:
            tensors[spec.name] = await trio.to_thread.run_sync(dequantize, payload, spec)
        else:
            tensors[spec.name] = dequantize(payload, spec)
    wire_bytes = len(frame) + sum(spec.payload_bytes for spec in specs)
    return protocol.Message(body, tensors, version, wire_bytes)


def receive_before(encoded: protocol.Encoded, threads: int) -> tuple[float, dict]:
    """The receive as it was (`read_message_before` in `MessageStream.receive`)."""
    current = _stream.read_message
    _stream.read_message = read_message_before
    try:
        return trio.run(receive_once, encoded, threads)
    finally:
        _stream.read_message = current


def receive_now(encoded: protocol.Encoded, threads: int) -> tuple[float, dict]:
    return trio.run(receive_once, encoded, threads)


def one_case(encoded: protocol.Encoded, last: dict, threads: int, receive: bool, turn: int) -> dict:
    """Seconds of each way once, from the same payloads; SystemExit if a bit differs.

    Each way's result is hashed and dropped before the next runs, so every way
    allocates from the same state (holding one 124M-value result while the next
    is made costs that one fresh pages the others do not pay).
    """
    payloads = {
        spec.name: (spec, np.frombuffer(buffer, np.uint8))
        for spec, buffer in zip(encoded.specs, encoded.buffers[1:], strict=True)
    }
    ways = [
        ("before", "decoded", decode_before, (payloads,)),
        ("now 1", "decoded", decode_now, (payloads, 1)),
        ("now", "decoded", decode_now, (payloads, threads)),
        ("add before", "added", add_before, (payloads, last)),
        ("add now", "added", add_now, (payloads, last, threads)),
    ]
    if receive:
        ways += [
            ("receive before", "decoded", receive_before, (encoded, threads)),
            ("receive now", "decoded", receive_now, (encoded, threads)),
        ]
    times, seen = {}, {}
    turn %= len(ways)  # each repeat starts with another way: none always runs first
    for label, kind, way, args in ways[turn:] + ways[:turn]:
        if label.startswith("receive"):
            times[label], result = way(*args)
        else:
            times[label], result = timed(way, *args)
        if seen.setdefault(kind, digests(result)) != digests(result):
            raise SystemExit(f"{label} changed a bit: not valid")
        del result
    return times


def cells(size: float, quantization: str, t: dict) -> list[str]:
    row = [f"{size:g}", quantization, f"{t['before']:.3f}", f"{t['now 1']:.3f}"]
    row += [f"{t['now']:.3f}", f"**{t['before'] / t['now']:.1f}x**"]
    row += [f"{t['add before']:.3f}", f"{t['add now']:.3f}"]
    row += [f"**{t['add before'] / t['add now']:.1f}x**"]
    if "receive now" in t:
        row += [f"{t['receive before']:.3f}", f"{t['receive now']:.3f}"]
        row += [f"**{t['receive before'] / t['receive now']:.2f}x**"]
    else:
        row += ["", "", ""]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[31, 124])
    parser.add_argument("--compression", nargs="+", default=["int8Block", "int4Block", "bfloat16"])
    parser.add_argument("--threads", type=int, default=_chunked.THREADS)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--warmup", type=int, default=1, help="runs left out: memory a VM touches first is slow"
    )
    parser.add_argument(
        "--receive", nargs="*", default=["int8Block"], help="quantizations to receive over TCP"
    )
    args = parse_with_smoke(parser, sizes=[0.1], repeat=1, warmup=0)
    allocator = warm_pages()
    rng = np.random.default_rng(0)
    load = os.getloadavg()
    print(
        f"{os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
        f"--threads {args.threads}; {allocator}; seconds, best of {args.repeat} "
        f"after {args.warmup} left out"
    )
    head = ["M values", "quantization", "decode before", "now, 1 thread"]
    head += [f"now, {args.threads} threads", "speed-up", "decode + add before", "now"]
    head += ["speed-up", "TCP receive before", "now", "speed-up"]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head), flush=True)
    for size in args.sizes:
        shapes = gpt2_like_shapes(size)
        last = {
            n: rng.standard_normal(s, dtype=np.float32) * np.float32(0.02)
            for n, s in shapes.items()
        }
        params = {
            n: rng.standard_normal(s, dtype=np.float32) * np.float32(1e-3)
            for n, s in shapes.items()
        }
        for quantization in args.compression:
            receive = quantization in args.receive
            body = protocol.RoundResult(round=1)
            encoded = protocol.encode_once(body, params, quantization=quantization)
            runs = [
                one_case(encoded, last, args.threads, receive, turn)
                for turn in range(args.warmup + args.repeat)
            ][args.warmup :]
            del encoded
            best = {k: min(r[k] for r in runs) for k in runs[0]}
            print("| " + " | ".join(cells(size, quantization, best)) + " |", flush=True)
        del last, params
    print(f"ratio_decode_now_vs_before={best['before'] / best['now']:.2f}")


if __name__ == "__main__":
    main()
