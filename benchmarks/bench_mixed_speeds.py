"""Workers of different speeds: fixed H against --adaptive-steps, in the same invocation.

Two runs of the same model, seed and shards on loopback: one honest worker and
one made FACTOR times slower (`faulty_worker slow`: each compiled chunk sleeps
the difference, like a slower machine). The baseline gives both H inner steps
a round, so the fast worker idles while the slow one finishes; with
--adaptive-steps each worker's round is sized to its measured speed
(`pcp_tui/shepherd/pacing.py`). Columns: the fast worker's utilization (its
compute seconds over the round's wall time, from the round events, round 1 left
out: nobody is measured yet), round seconds, tokens a round, final eval loss,
and each against the baseline.

    python benchmarks/bench_mixed_speeds.py [--rounds 8] [--inner-steps 40] [--factor 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pcp_tui.testing import (
    WorkerProcesses,
    faulty_worker_command,
    free_port,
    shepherd_command,
    worker_env,
)


def run(args: argparse.Namespace, workdir: Path, adaptive: bool) -> dict:
    """One run with a fast and a slow worker; its mean round numbers (round 1 left out)."""
    port, metrics = free_port(), workdir / f"adaptive-{adaptive}.jsonl"
    options = [
        *("--workers", "2", "--rounds", str(args.rounds), "--inner-steps", str(args.inner_steps)),
        *("--chunk-steps", "5", "--batch-size", "8", "--seq-len", "64", "--metrics", str(metrics)),
        *(["--adaptive-steps"] if adaptive else []),
    ]
    shepherd = subprocess.Popen(
        shepherd_command(port, *options),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=worker_env(),
    )
    with WorkerProcesses() as workers:
        try:
            for line in shepherd.stdout:
                if "listening on" in line:
                    break
            workers.spawn(port, "--id", "fast")
            workers.start(faulty_worker_command(port, "slow", "--id", "slow", factor=args.factor))
            output, _ = shepherd.communicate(timeout=3600)
            if shepherd.returncode != 0:
                raise SystemExit(f"the run (adaptive={adaptive}) failed:\n{output}")
        finally:
            if shepherd.poll() is None:
                shepherd.kill()
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    rounds = [e for e in events if e["event"] == "round"]
    later = rounds[1:]
    return {
        "fast_utilization": statistics.mean(r["worker_utilization"]["fast"] for r in later),
        "slow_utilization": statistics.mean(r["worker_utilization"]["slow"] for r in later),
        "round_seconds": statistics.mean(r["round_seconds"] for r in later),
        "tokens": statistics.mean(r["tokens"] for r in later),
        "eval_loss": rounds[-1]["eval_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=40)
    parser.add_argument("--factor", type=float, default=2.0)
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as workdir:
        for adaptive in (False, True):
            print(f"running adaptive={adaptive}...", file=sys.stderr, flush=True)
            rows["adaptive steps" if adaptive else "fixed H"] = run(args, Path(workdir), adaptive)
    base = rows["fixed H"]
    print(
        f"1 worker + 1 worker {args.factor:g}x slower, tiny, H={args.inner_steps}, "
        f"rounds 2..{args.rounds}\n"
    )
    print(
        f"{'run':>15} {'fast util':>9} {'x fixed':>7} {'slow util':>9} {'round s':>8} "
        f"{'tokens/round':>12} {'eval loss':>9} {'x fixed':>8}"
    )
    for label, row in rows.items():
        print(
            f"{label:>15} {row['fast_utilization']:9.1%} "
            f"{row['fast_utilization'] / base['fast_utilization']:7.3f} "
            f"{row['slow_utilization']:9.1%} {row['round_seconds']:8.2f} {row['tokens']:12,.0f} "
            f"{row['eval_loss']:9.4f} {row['eval_loss'] / base['eval_loss']:8.4f}"
        )


if __name__ == "__main__":
    main()
