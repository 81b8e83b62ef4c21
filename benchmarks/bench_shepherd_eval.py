"""The shepherd's held-out eval against the workers' time: a long eval must not idle them.

Two runs of the same model on the same tokens (a headless shepherd process and
worker processes over loopback), evaluating after every round: one with
`--eval-batches 1` (the baseline) and one with many (`--eval-batches 64`).
Where the shepherd's CPUs are few, the eval of a round can take longer than a
round: it runs on a copy of θ off the rounds' path (`shepherd/run/evaluation.py`),
so the next round starts at once and an eval that would start while the last
still runs is skipped. Before that change, each eval ran between two rounds
while the workers waited.

With two CPUs or more the shepherd runs on one and the workers on the others,
as a coordinator on a machine of its own would (`--no-pin`: all share all).

Columns: `busy` (the workers' compute seconds over the time between two round
ends, the shepherd's work between rounds included; rounds 2..R-1: the last one
ends after the run's final eval, which no worker waits for), each against
the baseline, the round's wall time, the rounds whose eval ran (the last one
always does, awaited), the final eval loss.

    python benchmarks/bench_shepherd_eval.py [--eval-batches 1 64] [--rounds 5] [--smoke]

Ends with `ratio_busy_eval<last>_vs_eval<first>=<x>` (goal: >= 0.95).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

from pcp_tui.testing import parse_with_smoke, run_over_link


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval-batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--no-pin", dest="pin", action="store_false")
    parser.add_argument(
        "--cpu-shepherd",
        action="store_true",
        help="the shepherd on the CPU (JAX_PLATFORMS=cpu) beside GPU workers",
    )
    parser.add_argument(
        "--shepherd-args",
        default="",
        help="more shepherd options for both runs, e.g. a GPU run's "
        "'--data tokens.bin --compute-dtype bfloat16 --attention xla'",
    )
    args = parse_with_smoke(
        parser, eval_batches=[1, 2], rounds=3, inner_steps=2, batch_size=2, seq_len=16
    )
    available = sorted(os.sched_getaffinity(0))
    pin = args.pin and len(available) >= 2
    cpus = ({available[0]}, set(available[1:])) if pin else None
    options = (
        *("--model", args.model, "--rounds", str(args.rounds)),
        *("--inner-steps", str(args.inner_steps), "--chunk-steps", str(args.inner_steps)),
        *("--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)),
        *("--eval-every", "1", "--data-max-bytes", str(4 * 2**20)),
        *shlex.split(args.shepherd_args),
    )
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for batches in args.eval_batches:
            print(f"running --eval-batches {batches}...", file=sys.stderr, flush=True)
            row = run_over_link(
                "loopback",
                Path(workdir),
                (*options, "--eval-batches", str(batches)),
                workers=args.workers,
                label=f"eval{batches}",
                cpus=cpus,
                shepherd_env={"JAX_PLATFORMS": "cpu"} if args.cpu_shepherd else None,
            )
            rows.append({**row, "batches": batches})
    base = rows[0]
    where = (
        f"shepherd on CPU {available[0]}, workers on {len(available) - 1} more"
        if pin
        else f"shepherd and workers share {len(available)} CPUs"
    )
    print(
        f"{args.workers} worker(s), {args.model}, H={args.inner_steps}, "
        f"batch {args.batch_size}x{args.seq_len}, eval every round, {where}, "
        f"busy over rounds 2..{max(args.rounds - 1, 2)}\n"
    )
    print(
        f"{'eval batches':>12} {'busy':>6} {'x base':>7} {'round s':>8} {'evaluated':>10} "
        f"{'eval loss':>9}"
    )
    for row in rows:
        print(
            f"{row['batches']:>12} {row['busy']:6.1%} {row['busy'] / base['busy']:7.3f} "
            f"{row['round_seconds']:8.2f} {row['evaluated']:>4}/{args.rounds:<5} "
            f"{row['final_eval_loss']:9.4f}"
        )
    last = rows[-1]
    print(
        f"ratio_busy_eval{last['batches']}_vs_eval{base['batches']}="
        f"{last['busy'] / base['busy']:.3f}"
    )


if __name__ == "__main__":
    main()
