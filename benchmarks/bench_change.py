"""A fragment update's change round trip on the shepherd: op by op (before) vs `encode_change` (now).

With --compression, Streaming DiLoCo sends each fragment's new global value
as its change since the last one, quantized, and the shepherd keeps
old + decode(encode(change)), the sum every worker forms. Before, the shepherd
(`RoundEngine._step`) took the change into a new array, encoded it,
joined and decoded the bytes and added them: one thread, several model-sized
temporaries; then every worker's link quantized the change again as it sent
it. Now `protocol.encode_change` does it once, in cache-sized chunks over
threads, forming the new value from the encoder's own levels, and every link
sends those bytes.

For each size (float32 values of a fragment, on GPT-2-like (rows, 768)
matrices) and quantization, in one process on the same arrays:

- before: the round trip (change, encode, join, decode, add), and the same
  plus k encodes of the change (one per worker link, --workers);
- now: `encode_change` on 1 thread and on --threads threads;

and it stops if the wire bytes or the new values differ by a bit. The baseline
of the ratios is "before" measured in the same run. Medians of --repeat.

    python benchmarks/bench_change.py [--sizes 31 124] [--workers 4] [--threads 8] [--repeat 3]
        [--smoke]

Ends with `ratio_now_vs_before=<x>`: the last row's speed-up of `encode_change`
over the round trip before.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from pcp_tui import protocol
from pcp_tui.protocol import _change
from pcp_tui.testing import gpt2_like_shapes, parse_with_smoke

BODY = protocol.FragmentUpdate(round=1, fragment=0, change=True)


def before(params: dict, old: dict, quantization: str) -> tuple[bytes, dict]:
    """`RoundEngine._step` as it was: the change, encoded, joined, decoded, added to old."""
    change = {n: params[n] - old[n] for n in params}
    wire = b"".join(protocol.encode(BODY, change, quantization=quantization))
    decoded = protocol.decode(wire).tensors
    for n in params:
        np.add(old[n], decoded[n], out=params[n])
    return wire, change


def per_link(change: dict, quantization: str) -> None:
    """What each worker's link did as it sent the update: quantize the change again."""
    protocol.encode(BODY, change, quantization=quantization)


def now(params: dict, old: dict, quantization: str, threads: int) -> protocol.Encoded:
    """`RoundEngine._step` now: the buffers every link sends, and old + decoded in params."""
    return protocol.encode_change(BODY, params, old, quantization=quantization, threads=threads)


def timed(fn, *args):
    start = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - start, value


def one_case(old: dict, new: dict, quantization: str, workers: int, threads: int) -> dict:
    """Seconds of each way once, from the same (old, new); SystemExit if a bit differs."""
    times = {}
    reference = {n: v.copy() for n, v in new.items()}
    times["before"], (wire, change) = timed(before, reference, old, quantization)
    times["links"] = sum(timed(per_link, change, quantization)[0] for _ in range(workers))
    del change
    for label, count in (("now 1", 1), ("now", threads)):
        params = {n: v.copy() for n, v in new.items()}
        times[label], got = timed(now, params, old, quantization, count)
        same = b"".join(got.buffers) == wire and all(
            params[n].tobytes() == reference[n].tobytes() for n in params
        )
        if not same:
            raise SystemExit(f"encode_change ({label}) changed a byte or a bit: not valid")
        del params, got
    return times


def report(size: float, quantization: str, workers: int, t: dict) -> None:
    total = t["before"] + t["links"]
    cells = [f"{size:g}", quantization, f"{t['before']:.3f}", f"{t['now 1']:.3f}"]
    cells += [f"{t['now']:.3f}", f"**{t['before'] / t['now']:.1f}x**"]
    cells += [f"{total:.3f}", f"**{total / t['now']:.1f}x**"]
    print("| " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[31, 124])
    parser.add_argument("--compression", nargs="+", default=["int8Block", "int4Block", "bfloat16"])
    parser.add_argument("--workers", type=int, default=4, help="links the update goes to")
    parser.add_argument("--threads", type=int, default=_change.THREADS)
    parser.add_argument("--repeat", type=int, default=3)
    args = parse_with_smoke(parser, sizes=[0.1], repeat=1)
    rng = np.random.default_rng(0)
    load = os.getloadavg()
    print(
        f"{os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
        f"--threads {args.threads}, --workers {args.workers}; seconds, medians of {args.repeat}"
    )
    head = ["M values", "quantization", "round trip before", "now, 1 thread"]
    head += [f"now, {args.threads} threads", "speed-up"]
    head += [f"before + {args.workers} link encodes", "speed-up"]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for size in args.sizes:
        shapes = gpt2_like_shapes(size)
        old = {
            n: rng.standard_normal(s, dtype=np.float32) * np.float32(0.02)
            for n, s in shapes.items()
        }
        new = {
            n: old[n] + rng.standard_normal(s, dtype=np.float32) * np.float32(1e-3)
            for n, s in shapes.items()
        }
        for quantization in args.compression:
            runs = [
                one_case(old, new, quantization, args.workers, args.threads)
                for _ in range(args.repeat)
            ]
            median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            report(size, quantization, args.workers, median)
        del old, new
    print(f"ratio_now_vs_before={median['before'] / median['now']:.2f}")


if __name__ == "__main__":
    main()
