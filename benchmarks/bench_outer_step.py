"""One fragment's shepherd work, phase by phase: what sits between the last result and the update.

For each size (float32 values of a fragment) and k (results), on realistic
tensors (a few GPT-2-like matrices), with int8Block or float32 results:

- per result (the last one is on the critical path): decode the wire bytes,
  screen (names, shapes, finiteness and the norm), fold into centered clip
  (its distance to the center, the clipped scaled add);
- per fragment: centered clip's close (center's share, the new center), the
  outer Nesterov step, and with int8 the update's change encoded once and the
  new global formed from it (what `RoundEngine._step` does: `encode_change`).

The outer step and the close run twice, in the same process on the same
arrays: as before this change (optax's update op by op; the close with
model-sized temporaries) and as now (fused in place, `--threads` threads),
and both results are compared bit for bit. The baseline of every ratio is
the least work a step could be: a bare numpy mean of the k results and
`p -= lr * g` (in place), timed in the same run, against the shepherd's own
way from the same k results to new parameters (k folds, the close, the step). Last, the fused step runs in
`trio.to_thread.run_sync` beside a 1 ms trio ticker: the longest gap between
its wake-ups is how long the event loop (heartbeats, other links) stalls while
the step computes. Medians of `--repeat`.

    python benchmarks/bench_outer_step.py [--sizes 31 124] [--results 2 4 8] [--repeat 3] [--smoke]

Ends with `ratio_close_outer_now_vs_before=<x>`: the last row's close + outer speed-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import trio

from pcp_tui import protocol
from pcp_tui.diloco import fused
from pcp_tui.diloco.aggregate import CenteredClip
from pcp_tui.diloco.outer import OuterOptimizer
from pcp_tui.diloco.screening import check_pseudo_gradient
from pcp_tui.testing import gpt2_like_shapes, parse_with_smoke


def timed(fn, *args):
    start = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - start, value


def wire_bytes(tensors, quantization: str) -> bytes:
    body = protocol.FragmentUpdate(round=1, fragment=0, change=True)
    return b"".join(bytes(b) for b in protocol.encode(body, tensors, quantization=quantization))


def old_close(clip: CenteredClip) -> None:
    """Centered clip's close as it was: `sums += center * w` and `center = sums * scale`."""
    sums = clip.sums
    for name in sums:
        sums[name] += clip.center[name] * np.float32(clip.partial.center_weight)
        np.multiply(sums[name], clip.scale, out=clip.center[name])


def one_case(shapes, k: int, quantization: str, threads: int, rng) -> dict[str, float]:
    """Every phase once for one fragment of `shapes` with k results; seconds by phase."""
    names = tuple(sorted(shapes))
    params = {n: rng.standard_normal(s, dtype=np.float32) * 0.02 for n, s in shapes.items()}
    results = [
        {n: rng.standard_normal(s, dtype=np.float32) * 1e-3 for n, s in shapes.items()}
        for _ in range(2)
    ]  # two distinct results, cycled: k copies would not fit the box at 124M x 8
    wires = [wire_bytes(r, quantization) for r in results]
    times: dict[str, float] = {}
    clips = []
    for _ in range(2):  # the same state twice: one closes the old way, one the new
        clip = CenteredClip(names)
        clip.load_state_arrays(
            {f"aggregate.center[{n!r}]": np.zeros(s, np.float32) for n, s in shapes.items()}
            | {"aggregate.round_distances": np.full(1, 0.02)}
            | {"aggregate.round_norms": np.full(1, 1e9)}  # a history: results fold as they come
        )
        clip.threads = threads
        clip.reset()
        clips.append(clip)
    for i in range(k):
        seconds, message = timed(protocol.decode, wires[i % 2])
        times["decode"] = seconds
        tensors = message.tensors
        times["screen"] = timed(check_pseudo_gradient, tensors, shapes)[0]
        times["fold"] = timed(clips[0].add, tensors, 1000.0)[0]
        clips[1].add(tensors, 1000.0)
        del message, tensors
    times["close before"] = timed(old_close, clips[0])[0]
    times["close now"] = timed(clips[1].finish)[0]
    before, now = OuterOptimizer(), OuterOptimizer()
    p_before, p_now = params, {n: v.copy() for n, v in params.items()}
    for _ in range(2):  # the second step has momentum to apply; it is the one timed
        times["outer before"] = timed(before.apply_optax, p_before, clips[0].sums, clips[0].scale)[
            0
        ]
        times["outer now"] = timed(now.apply, p_now, clips[1].sums, clips[1].scale, threads)[0]
    same = all(np.array_equal(p_before[n], p_now[n]) for n in names) and all(
        np.array_equal(clips[0].center[n], clips[1].center[n]) for n in names
    )
    if not same:
        raise SystemExit("the fused outer step or close changed a bit: not a valid measurement")
    times["step in thread"], times["longest stall"] = event_loop_stall(
        now, p_now, clips[1], threads
    )
    if quantization != "none":
        times["change"] = timed(change_round_trip, p_now, params, quantization)[0]
    baseline = list(results) * (k // 2) + results[: k % 2]
    times["baseline"] = timed(bare_step, p_before, baseline)[0]
    return times


def change_round_trip(params, old, quantization: str) -> None:
    """What `RoundEngine._step` does: the change encoded once and old + decoded in params
    (`protocol.encode_change`; benchmarks/bench_change.py times it against the op-by-op way)."""
    body = protocol.FragmentUpdate(round=1, fragment=0, change=True)
    protocol.encode_change(body, params, old, quantization=quantization)


def bare_step(params, results) -> None:
    """The least a step could be: the plain mean of the results and p -= lr * g, in place."""
    for name, param in params.items():
        mean = np.copy(results[0][name])
        for result in results[1:]:
            np.add(mean, result[name], out=mean)
        mean *= np.float32(1 / len(results))
        mean *= np.float32(0.7)
        param -= mean


def event_loop_stall(
    outer: OuterOptimizer, params, clip: CenteredClip, threads: int
) -> tuple[float, float]:
    """The outer step in `trio.to_thread.run_sync`, as the shepherd runs it, beside a 1 ms ticker.

    Returns (the step's seconds, the longest gap between the ticker's wake-ups):
    how long heartbeats and other links would wait while the step computes.
    """
    gaps = [0.0]

    async def tick(done: trio.Event) -> None:
        last = time.perf_counter()
        while not done.is_set():
            await trio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async def main() -> float:
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick, done)
            await trio.sleep(0.01)
            start = time.perf_counter()
            await trio.to_thread.run_sync(outer.apply, params, clip.sums, clip.scale, threads)
            seconds = time.perf_counter() - start
            done.set()
        return seconds

    return trio.run(main), max(gaps)


PHASES = ("decode", "screen", "fold", "close before", "close now", "outer before", "outer now")


def header() -> None:
    head = ["M values", "k", "results", *PHASES, "change", "baseline"]
    head += ["k folds + close + outer, before", "now", "before / baseline", "now / baseline"]
    head += ["close + outer speed-up", "loop stall"]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))


def report(rows) -> None:
    for (size, k, quantization), t in rows:
        old = k * t["fold"] + t["close before"] + t["outer before"]
        new = k * t["fold"] + t["close now"] + t["outer now"]
        speed_up = (t["close before"] + t["outer before"]) / (t["close now"] + t["outer now"])
        cells = [f"{size:g}", str(k), quantization] + [f"{t[p]:.3f}" for p in PHASES]
        cells += [f"{t['change']:.3f}" if "change" in t else "-", f"{t['baseline']:.3f}"]
        cells += [f"{old:.3f}", f"{new:.3f}", f"{old / t['baseline']:.2f}"]
        cells += [f"{new / t['baseline']:.2f}", f"{speed_up:.2f}x"]
        cells += [f"{t['longest stall'] * 1000:.0f} ms of {t['step in thread']:.3f} s"]
        print("| " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[31, 124])
    parser.add_argument("--results", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--compression", nargs="+", default=["int8Block", "none"])
    parser.add_argument("--threads", type=int, default=fused.THREADS)
    parser.add_argument("--repeat", type=int, default=3)
    args = parse_with_smoke(parser, sizes=[0.1], results=[2], repeat=1)
    rng = np.random.default_rng(0)
    print(f"{os.cpu_count()} cores, --threads {args.threads}; seconds, medians of {args.repeat}")
    rows = []
    header()
    for size in args.sizes:
        for quantization in args.compression:
            for k in args.results:
                runs = [
                    one_case(gpt2_like_shapes(size), k, quantization, args.threads, rng)
                    for _ in range(args.repeat)
                ]
                median = {p: statistics.median(r[p] for r in runs) for p in runs[0]}
                rows.append(((size, k, quantization), median))
                report(rows[-1:])
    t = rows[-1][1]
    speed_up = (t["close before"] + t["outer before"]) / (t["close now"] + t["outer now"])
    print(f"ratio_close_outer_now_vs_before={speed_up:.2f}")


if __name__ == "__main__":
    main()
