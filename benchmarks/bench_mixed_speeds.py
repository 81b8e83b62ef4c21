"""Workers of different speeds: fixed H against --adaptive-steps, in the same invocation.

Runs of the same model, seed and shards on loopback: one honest worker and one
made FACTOR times slower (`faulty_worker slow`: each compiled chunk sleeps the
difference, like a slower machine). The baseline gives both H inner steps a
round, so the fast worker idles while the slow one finishes; with
--adaptive-steps each worker's round is sized to its measured speed
(`pcp_tui/shepherd/rounds/pacing.py`). With `--fragments F` (F >= 2) the same two runs
are repeated with Streaming DiLoCo (`--streaming-fragments F --overlap-steps τ`),
each against its own fixed-H baseline.

Two ways to compare:

- fixed rounds (default): every run trains `--rounds` rounds. Columns: the fast
  worker's utilization (its compute seconds over the round's wall time, round 1
  left out: nobody is measured yet), round seconds, tokens a round, final eval loss.
- fixed wall time (`--run-seconds S`): every run gets the same S seconds, from
  the start of its round 1 (so compiling is not counted) until the benchmark
  stops it; only rounds that ended within the S seconds count. Columns: rounds
  done, tokens trained, eval loss at the last of those rounds (evaluated every
  round), the fast worker's utilization. Every run is started with the same
  `--rounds` (a cap it does not reach), so the learning-rate schedules agree.

    python benchmarks/bench_mixed_speeds.py [--rounds 8] [--inner-steps 40] [--factor 2]
        [--run-seconds 60] [--fragments 2 --overlap 5] [--repeats 3] [--smoke]

Ends with `ratio_fast_utilization_adaptive_vs_fixed=<x>` (plain DiLoCo rows).

One run's eval loss moves by a few percent from round to round on this model
(its learning rate is high and its batches small), and the box's load moves how
many rounds fit in a fixed time: `--repeats N` runs every row N times,
interleaved, and the table shows means and the range of the loss ratio.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pcp_tui.testing import (
    WorkerProcesses,
    faulty_worker_command,
    free_port,
    parse_with_smoke,
    shepherd_command,
    worker_env,
)

ROUND_CAP = 1000  # --rounds of a fixed-time run: never reached, the same for every run


def run(args: argparse.Namespace, workdir: Path, label: str, extra: list[str]) -> list[dict]:
    """One run with a fast and a slow worker; its round events (in a fixed-time run, those in time)."""
    port, metrics, log = free_port(), workdir / f"{label}.jsonl", workdir / f"{label}.log"
    timed = args.run_seconds is not None
    options = [
        *("--workers", "2", "--inner-steps", str(args.inner_steps), "--metrics", str(metrics)),
        *("--rounds", str(ROUND_CAP if timed else args.rounds), "--chunk-steps", "5"),
        *("--batch-size", "8", "--seq-len", "64", "--eval-every", "1" if timed else "1000000"),
        *extra,
    ]
    with open(log, "w") as out, WorkerProcesses() as workers:
        shepherd = subprocess.Popen(
            shepherd_command(port, *options), stdout=out, stderr=subprocess.STDOUT, env=worker_env()
        )
        try:
            _wait_for(lambda: "listening on" in log.read_text(), shepherd, log)
            workers.spawn(port, "--id", "fast")
            workers.start(faulty_worker_command(port, "slow", "--id", "slow", factor=args.factor))
            if timed:
                _wait_for(lambda: _budget_spent(metrics, args.run_seconds), shepherd, log)
                shepherd.send_signal(signal.SIGINT)  # stop after the current round
            if shepherd.wait(timeout=3600) not in (0, 128 + signal.SIGINT):
                raise SystemExit(f"the {label} run failed:\n{log.read_text()}")
        finally:
            if shepherd.poll() is None:
                shepherd.kill()
    rounds = [e for e in _events(metrics) if e["event"] == "round"]
    return _within(rounds, args.run_seconds) if timed else rounds


def _wait_for(condition, shepherd: subprocess.Popen, log: Path) -> None:
    while not condition():
        if shepherd.poll() is not None:
            raise SystemExit(f"the shepherd ended early:\n{log.read_text()}")
        time.sleep(0.2)


def _events(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    lines = metrics.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]  # a half-written last line


def _start(rounds: list[dict]) -> float:
    """When round 1 started (wall clock): its event's time less its round seconds."""
    return rounds[0]["time"] - rounds[0]["round_seconds"]


def _budget_spent(metrics: Path, seconds: float) -> bool:
    rounds = [e for e in _events(metrics) if e["event"] == "round"]
    return bool(rounds) and rounds[-1]["time"] > _start(rounds) + seconds


def _within(rounds: list[dict], seconds: float) -> list[dict]:
    """The rounds that ended within `seconds` of round 1's start."""
    end = _start(rounds) + seconds
    return [r for r in rounds if r["time"] <= end]


def summary(rounds: list[dict]) -> dict:
    """The row of a run: means over rounds 2.. and totals."""
    later = rounds[1:] or rounds
    return {
        "rounds": len(rounds),
        "fast_utilization": statistics.mean(r["worker_utilization"]["fast"] for r in later),
        "slow_utilization": statistics.mean(r["worker_utilization"]["slow"] for r in later),
        "round_seconds": statistics.mean(r["round_seconds"] for r in later),
        "tokens_per_round": statistics.mean(r["tokens"] for r in later),
        "tokens": sum(r["tokens"] for r in rounds),
        "eval_loss": next(r["eval_loss"] for r in reversed(rounds) if r["eval_loss"] is not None),
    }


def runs(args: argparse.Namespace) -> list[tuple[str, list[str], str]]:
    """(label, shepherd options, the label of its baseline) for every run of the invocation."""
    plain = [("fixed H", [], "fixed H"), ("adaptive", ["--adaptive-steps"], "fixed H")]
    if args.fragments < 2:
        return plain
    streaming = ["--streaming-fragments", str(args.fragments), "--overlap-steps", str(args.overlap)]
    return [
        *plain,
        ("streaming fixed H", streaming, "streaming fixed H"),
        ("streaming adaptive", [*streaming, "--adaptive-steps"], "streaming fixed H"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=40)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--run-seconds", type=float, help="fixed wall time per run (seconds)")
    parser.add_argument("--fragments", type=int, default=1, help="also streaming rows (F >= 2)")
    parser.add_argument("--overlap", type=int, default=5, help="τ of the streaming rows")
    parser.add_argument(
        "--repeats", type=int, default=1, help="invocations of every run, interleaved"
    )
    args = parse_with_smoke(parser, rounds=2, inner_steps=5, factor=1.5)
    plan = runs(args)
    rows: dict[str, list[dict]] = {label: [] for label, _, _ in plan}
    with tempfile.TemporaryDirectory() as workdir:
        for repeat in range(args.repeats):  # interleaved: a busier box slows every row alike
            for label, extra, _ in plan:
                print(
                    f"running {label} ({repeat + 1}/{args.repeats})...", file=sys.stderr, flush=True
                )
                slug = f"{label.replace(' ', '-')}-{repeat}"
                rows[label].append(summary(run(args, Path(workdir), slug, extra)))
    report(args, rows, {label: baseline for label, _, baseline in plan})


def report(args: argparse.Namespace, rows: dict[str, list[dict]], baselines: dict) -> None:
    """The table: each column the mean over repeats; eval loss x fixed also its range."""
    budget = f"{args.run_seconds:g} s of wall time" if args.run_seconds else f"{args.rounds} rounds"
    print(
        f"1 worker + 1 worker {args.factor:g}x slower, tiny, H={args.inner_steps}, {budget} a run, "
        f"{args.repeats} run(s) a row (means; utilization and round seconds: rounds 2..)\n"
    )
    print(
        f"{'run':>18} {'rounds':>6} {'fast util':>9} {'slow util':>9} {'round s':>7} "
        f"{'tokens':>9} {'x fixed':>7} {'eval loss':>9} {'x fixed':>7} {'range':>13}"
    )
    for label, repeats in rows.items():
        base = rows[baselines[label]]
        mean = {key: statistics.mean(r[key] for r in repeats) for key in repeats[0]}
        losses = [r["eval_loss"] / b["eval_loss"] for r, b in zip(repeats, base, strict=True)]
        tokens = mean["tokens"] / statistics.mean(b["tokens"] for b in base)
        print(
            f"{label:>18} {mean['rounds']:6.1f} {mean['fast_utilization']:9.1%} "
            f"{mean['slow_utilization']:9.1%} {mean['round_seconds']:7.2f} {mean['tokens']:9,.0f} "
            f"{tokens:7.3f} {mean['eval_loss']:9.4f} {statistics.mean(losses):7.4f} "
            f"{min(losses):6.4f}-{max(losses):6.4f}"
        )
    fast = {
        label: statistics.mean(r["fast_utilization"] for r in rows[label])
        for label in ("fixed H", "adaptive")
    }
    print(f"ratio_fast_utilization_adaptive_vs_fixed={fast['adaptive'] / fast['fixed H']:.3f}")


if __name__ == "__main__":
    main()
