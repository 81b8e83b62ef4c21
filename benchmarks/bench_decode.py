"""Receiving a quantized model-sized message: one-pass decode (before) vs chunked over threads (now).

A shepherd decodes k quantized pseudo-gradients a round; a Streaming DiLoCo
worker decodes every fragment update and adds it to the fragment's last
global value. Before, each tensor was decoded by `_tensors.dequantize` in
whole-array steps on one thread (int4 first unpacked into a model-sized int8
array), and the worker's `last + change` made a new model-sized array. Now
`_dequantize.dequantize_chunked` decodes a cache-sized chunk at a time over
--threads threads, and the worker writes `last + change` over the decoded
change in chunks over threads (`worker.streaming.add_changes`).

For each size (float32 values on GPT-2-like (rows, 768) matrices) and
quantization, in one process on the same payloads:

- decode: every tensor's payload to float32, before and now (1 thread, --threads);
- decode + add: the worker's new global value from the payloads, before and now;
- receive (int8Block only, --receive): one whole roundResult through a real
  `protocol.MessageStream` on a loopback socket pair, from the first byte sent to
  the float32 tensors in hand, with the receive path's decode as it was (patched
  back to `dequantize` for "before") and as it is.

It stops if a decoded bit differs. Ratios are against "before" measured in the
same run; medians of --repeat. Every array of 1 MiB or more is mapped fresh
(glibc's mallopt), so each way pays its own page faults, which are a good
part of decoding 124M values. Timings on a shared 2-core box are noisy.

    python benchmarks/bench_decode.py [--sizes 31 124] [--threads 8] [--repeat 3] [--warmup 1]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import numpy as np
import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_outer_step import shapes_of  # noqa: E402  (the same GPT-2-like tensors)

from pcp_tui import protocol  # noqa: E402
from pcp_tui.protocol import _chunked, _codec  # noqa: E402
from pcp_tui.protocol._dequantize import dequantize_chunked  # noqa: E402
from pcp_tui.protocol._tensors import dequantize, prepare  # noqa: E402
from pcp_tui.worker.streaming import add_changes  # noqa: E402

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def fresh_pages() -> str:
    """Have glibc map every array of 1 MiB or more fresh from the OS, as a long-lived receiver's
    new arrays are: no way then decodes into pages an earlier one faulted in and freed."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return "allocator as it is (not glibc)"
    if libc.mallopt(M_MMAP_THRESHOLD, 2**20) != 1:
        return "allocator as it is (mallopt refused)"
    return "arrays >= 1 MiB freshly mapped"


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


def same(got: dict, want: dict, label: str) -> None:
    if any(got[n].tobytes() != want[n].tobytes() for n in want):
        raise SystemExit(f"{label} changed a bit: not valid")


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


def receive_case(encoded: protocol.Encoded, threads: int, want: dict) -> dict:
    """Receive seconds before (the receive path's decode patched back) and now."""
    times = {}
    current = _codec.dequantize_chunked
    _codec.dequantize_chunked = lambda payload, spec, threads: dequantize(payload, spec)
    try:
        times["receive before"], got = trio.run(receive_once, encoded, threads)
    finally:
        _codec.dequantize_chunked = current
    same(got, want, "the old receive")
    del got
    times["receive now"], got = trio.run(receive_once, encoded, threads)
    same(got, want, "the chunked receive")
    return times


def one_case(params: dict, last: dict, quantization: str, threads: int, receive: bool) -> dict:
    """Seconds of each way once, from the same payloads; SystemExit if a bit differs."""
    payloads = {}
    for name, array in params.items():
        spec, payload = prepare(name, array, quantization, 256)
        payloads[name] = (spec, np.frombuffer(payload, np.uint8))
    times = {}
    times["before"], want = timed(decode_before, payloads)
    for label, count in (("now 1", 1), ("now", threads)):
        times[label], got = timed(decode_now, payloads, count)
        same(got, want, f"the chunked decode ({label})")
        del got
    times["add before"], summed = timed(add_before, payloads, last)
    times["add now"], got = timed(add_now, payloads, last, threads)
    same(got, summed, "the in-place add")
    del got, summed
    if receive:
        body = protocol.RoundResult(round=1)
        encoded = protocol.encode_once(body, params, quantization=quantization)
        times |= receive_case(encoded, threads, want)
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
    args = parser.parse_args()
    allocator = fresh_pages()
    rng = np.random.default_rng(0)
    load = os.getloadavg()
    print(
        f"{os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
        f"--threads {args.threads}; {allocator}; seconds, medians of {args.repeat} "
        f"after {args.warmup} left out"
    )
    head = ["M values", "quantization", "decode before", "now, 1 thread"]
    head += [f"now, {args.threads} threads", "speed-up", "decode + add before", "now"]
    head += ["speed-up", "TCP receive before", "now", "speed-up"]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head), flush=True)
    for size in args.sizes:
        shapes = shapes_of(size)
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
            runs = [
                one_case(params, last, quantization, args.threads, receive)
                for _ in range(args.warmup + args.repeat)
            ][args.warmup :]
            median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print("| " + " | ".join(cells(size, quantization, median)) + " |", flush=True)
        del last, params


if __name__ == "__main__":
    main()
