"""Synchronous DiLoCo over emulated wide-area links: how much of each round the workers compute.

The baseline is the same run on loopback, measured in the same invocation. Each
other row puts `pcp-tui emulate-link` (a shaping TCP proxy, one shaped link per
worker connection) between the workers and the shepherd. Utilization is each
round event's `utilization` (--metrics): the contributors' compute seconds over
contributors x the round's wall time, as the shepherd reports it; `vs DP` is how
many times fewer bytes than synchronous data parallelism (`bytes_data_parallel`).
Round 1 is left out (first-call warm-up).

    python benchmarks/bench_wan.py [--rounds 5] [--inner-steps 25] [--model tiny]
        [--links loopback 1Gbit/50ms 100Mbit/50ms]

This is the number streaming DiLoCo (overlapping the exchange with the next
inner steps) exists to raise; today a round is strictly synchronous.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pcp_tui.testing import WorkerProcesses, free_port, shepherd_command, worker_env


def run_link(
    link: str, args: argparse.Namespace, workdir: Path, extra: tuple[str, ...] = (), label: str = ""
) -> dict:
    """One run over `link` ('loopback' or 'BANDWIDTH/RTT'); its mean round numbers.

    `extra`: more shepherd options (benchmarks/bench_streaming.py passes
    --streaming-fragments and friends); `label` names the run's metrics file.
    """
    name = f"{link}{label}".replace("/", "_")
    port, metrics = free_port(), workdir / f"{name}.jsonl"
    shepherd = subprocess.Popen(
        shepherd_command(
            port,
            *("--model", args.model, "--workers", str(args.workers), "--rounds", str(args.rounds)),
            *("--inner-steps", str(args.inner_steps), "--batch-size", "16", "--seq-len", "128"),
            *("--metrics", str(metrics)),
            *extra,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=worker_env(),
    )
    emulator, join_port = None, port
    with WorkerProcesses() as workers:
        try:
            if link != "loopback":
                bandwidth, rtt = link.split("/")
                join_port = free_port()
                emulator = subprocess.Popen(
                    [sys.executable, "-m", "pcp_tui", "emulate-link"]
                    + ["--listen", f"127.0.0.1:{join_port}", "--to", f"127.0.0.1:{port}"]
                    + ["--bandwidth", bandwidth, "--rtt", rtt],
                    stdout=subprocess.DEVNULL,
                )
            for line in shepherd.stdout:
                if "listening on" in line:
                    break
            for index in range(args.workers):
                workers.spawn(join_port, "--id", f"w{index}")
            output, _ = shepherd.communicate(timeout=3600)
            if shepherd.returncode != 0:
                raise SystemExit(f"the {link} run failed:\n{output}")
        finally:
            for process in (shepherd, emulator):
                if process is not None and process.poll() is None:
                    process.kill()
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    rounds = [r for r in events if r["event"] == "round" and r["round"] > 1]
    return {
        "final_eval_loss": [r for r in events if r["event"] == "round"][-1]["eval_loss"],
        "largest_result_bytes": max(r.get("largest_result_bytes", 0) for r in rounds),
        "link": link,
        "round_seconds": statistics.mean(r["round_seconds"] for r in rounds),
        "compute_seconds": statistics.mean(r["compute_seconds"] for r in rounds),
        "utilization": statistics.mean(r["utilization"] for r in rounds),
        "bytes_per_round": statistics.mean(r["bytes_sent"] + r["bytes_received"] for r in rounds),
        "bytes_data_parallel": statistics.mean(r["bytes_data_parallel"] for r in rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--inner-steps", type=int, default=25)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--links", nargs="+", default=["loopback", "1Gbit/50ms", "100Mbit/50ms"])
    args = parser.parse_args()
    links = ["loopback", *[link for link in args.links if link != "loopback"]]
    with tempfile.TemporaryDirectory() as workdir:
        rows = []
        for link in links:
            print(f"running over {link}...", file=sys.stderr, flush=True)
            rows.append(run_link(link, args, Path(workdir)))
    base = rows[0]
    print(f"{args.workers} workers, {args.model}, H={args.inner_steps}, rounds 2..{args.rounds}\n")
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


if __name__ == "__main__":
    main()
