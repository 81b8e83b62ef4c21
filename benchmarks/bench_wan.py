"""Synchronous DiLoCo over emulated wide-area links: how much of each round the workers compute.

The baseline is the same run on loopback, measured in the same invocation. Each
other row puts `pcp-tui emulate-link` (a shaping TCP proxy, one shaped link per
worker connection) between the workers and the shepherd. Utilization is each
round event's `utilization` (--metrics): the contributors' compute seconds over
contributors x the round's wall time, as the shepherd reports it; `vs DP` is how
many times fewer bytes than synchronous data parallelism (`bytes_data_parallel`).
Round 1 is left out (first-call warm-up).

    python benchmarks/bench_wan.py [--rounds 5] [--inner-steps 25] [--model tiny]
        [--links loopback 1Gbit/50ms 100Mbit/50ms] [--smoke]

Ends with `ratio_utilization_<last link, / as _>_vs_loopback=<x>`.

This is the number streaming DiLoCo (overlapping the exchange with the next
inner steps) exists to raise; today a round is strictly synchronous.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from pcp_tui.testing import parse_with_smoke, run_over_link


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--inner-steps", type=int, default=25)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--links", nargs="+", default=["loopback", "1Gbit/50ms", "100Mbit/50ms"])
    args = parse_with_smoke(
        parser,
        rounds=2,
        inner_steps=2,
        workers=1,
        batch_size=4,
        seq_len=32,
        links=["loopback", "100Mbit/5ms"],
    )
    links = ["loopback", *[link for link in args.links if link != "loopback"]]
    with tempfile.TemporaryDirectory() as workdir:
        rows = []
        for link in links:
            print(f"running over {link}...", file=sys.stderr, flush=True)
            options = (
                *("--model", args.model, "--rounds", str(args.rounds)),
                *("--inner-steps", str(args.inner_steps), "--batch-size", str(args.batch_size)),
                *("--seq-len", str(args.seq_len)),
            )
            rows.append(run_over_link(link, Path(workdir), options, workers=args.workers))
    base = rows[0]
    print(
        f"{args.workers} workers, {args.model}, batch {args.batch_size}x{args.seq_len}, "
        f"H={args.inner_steps}, rounds 2..{args.rounds}\n"
    )
    print(
        f"{'link':>14} {'round s':>8} {'compute s':>9} {'util':>6} {'MB/round':>9} "
        f"{'vs DP':>7} {'vs loopback':>11}"
    )
    for row in rows:
        print(
            f"{row['link']:>14} {row['round_seconds']:8.2f} {row['compute_seconds']:9.2f} "
            f"{row['utilization']:6.1%} {row['bytes_per_round'] / 1e6:9.1f} "
            f"{'x' + format(row['bytes_data_parallel'] / row['bytes_per_round'], '.0f'):>7} "
            f"{row['utilization'] / base['utilization']:11.3f}"
        )
    last = rows[-1]
    name = re.sub(r"\W", "_", last["link"])  # 100Mbit/50ms: 100Mbit_50ms
    print(f"ratio_utilization_{name}_vs_loopback={last['utilization'] / base['utilization']:.3f}")


if __name__ == "__main__":
    main()
