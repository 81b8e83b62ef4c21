"""Streaming DiLoCo against plain DiLoCo over one emulated slow link, in the same invocation.

Every run trains the same model on the same tokens (same seed, same compiled
chunk length, so the same batches) through `pcp-tui emulate-link`; only the
synchronisation differs. Rows:

- plain: DiLoCo, float32 results (the baseline every ratio is against);
- plain+int8: DiLoCo with int8 pseudo-gradients;
- streaming+int8: F fragments, τ overlap steps, int8 pseudo-gradients.

Columns: utilization (the shepherd's round events: compute seconds over the
round's wall time, round 1 left out), the largest single result on the wire
(a worker's peak upload in flight; the download, a fragment's float32 global
value, falls by the same factor), the final eval loss, and each against plain.

Scale: GPT-2 124M on an H100 computes H = 300 steps (16 x 1024 tokens) in about
10 s, and its 500 MB of float32 take about 4 s each way over 1 Gbit/s: the
exchange is ~0.8 of the compute. The tiny model here (1.8 MB of float32,
batch 4 x 64 on the CPU box) computes H = 40 steps in a few seconds; the default
link, 8 Mbit/s and 50 ms, makes its exchange about that share of a round.

    python benchmarks/bench_streaming.py [--rounds 6] [--inner-steps 40] [--fragments 4]
        [--overlap 5] [--link 8Mbit/50ms] [--batch-size 4] [--seq-len 64] [--smoke]

`--smoke` leaves out the plain+int8 run: the streaming run goes through its code.

Ends with `ratio_utilization_streaming_vs_plain=<x>`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

from pcp_tui.testing import parse_with_smoke, run_over_link


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--inner-steps", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--overlap", type=int, default=5)
    parser.add_argument("--alpha", type=float, default=0.0)
    parser.add_argument("--link", default="8Mbit/50ms")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument(
        "--shepherd-args",
        default="",
        help="more shepherd options for every run, e.g. a GPU run's "
        "'--model gpt2 --data tokens.bin --compute-dtype bfloat16'",
    )
    args = parse_with_smoke(
        parser,
        rounds=2,
        inner_steps=4,
        workers=1,
        fragments=2,
        overlap=1,
        link="100Mbit/5ms",
        seq_len=32,
    )
    chunk = (  # the same chunks, so the same batches, in every run; --shepherd-args override
        *("--model", args.model, "--rounds", str(args.rounds)),
        *("--inner-steps", str(args.inner_steps)),
        *("--chunk-steps", str(args.overlap or args.inner_steps // args.fragments)),
        *("--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)),
        *shlex.split(args.shepherd_args),
    )
    streaming = (
        *("--streaming-fragments", str(args.fragments), "--overlap-steps", str(args.overlap)),
        *("--mix-alpha", str(args.alpha)),
    )
    runs = {
        "plain": chunk,
        "plain+int8": (*chunk, "--compression", "int8Block"),
        f"streaming F={args.fragments}+int8": (*chunk, "--compression", "int8Block", *streaming),
    }
    if args.smoke:  # the streaming run goes through the same code, int8 included
        del runs["plain+int8"]
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for label, extra in runs.items():
            print(f"running {label} over {args.link}...", file=sys.stderr, flush=True)
            row = run_over_link(
                args.link, Path(workdir), extra, workers=args.workers, label=label.replace(" ", "_")
            )
            rows.append({**row, "label": label})
    base = rows[0]
    print(
        f"{args.workers} workers, {args.model}, H={args.inner_steps}, τ={args.overlap}, "
        f"α={args.alpha}, over {args.link}, rounds 2..{args.rounds}\n"
    )
    print(
        f"{'run':>22} {'util':>6} {'x plain':>7} {'round s':>8} {'peak KB':>8} {'x plain':>7} "
        f"{'eval loss':>9} {'x plain':>8}"
    )
    for row in rows:
        print(
            f"{row['label']:>22} {row['utilization']:6.1%} "
            f"{row['utilization'] / base['utilization']:7.3f} {row['round_seconds']:8.2f} "
            f"{row['largest_result_bytes'] / 1e3:8.1f} "
            f"{row['largest_result_bytes'] / base['largest_result_bytes']:7.3f} "
            f"{row['final_eval_loss']:9.4f} {row['final_eval_loss'] / base['final_eval_loss']:8.4f}"
        )
    print(
        f"ratio_utilization_streaming_vs_plain={rows[-1]['utilization'] / base['utilization']:.3f}"
    )


if __name__ == "__main__":
    main()
