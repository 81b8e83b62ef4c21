"""What several benchmarks share: GPT-2-like tensor shapes, the link emulator, a run over a link.

The machinery behind `pcp_tui.testing`, which re-exports what is public here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from pcp_tui.app.plot import with_evals
from pcp_tui.testing._processes import WorkerProcesses, free_port, shepherd_command, worker_env


def parse_with_smoke(parser: argparse.ArgumentParser, **smoke: object) -> argparse.Namespace:
    """`parser.parse_args()` with a `--smoke` flag: `smoke`'s values become the defaults.

    The smoke size is the smallest that runs the benchmark's code path and prints
    its table and ratio line, in seconds on a CPU (tests/test_benchmarks.py runs
    every benchmark so); options given on the command line still win over it.
    """
    shown = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in smoke.items())
    parser.add_argument(
        "--smoke", action="store_true", help=f"a few seconds' run on a CPU: {shown or 'as is'}"
    )
    args = parser.parse_args()
    unknown = [name for name in smoke if not hasattr(args, name)]
    if unknown:
        raise ValueError(f"smoke sizes for options the parser lacks: {', '.join(unknown)}")
    if args.smoke:
        parser.set_defaults(**smoke)
        args = parser.parse_args()
    return args


def gpt2_like_shapes(millions: float) -> dict[str, tuple[int, ...]]:
    """About `millions` M float32 values as GPT-2-like (rows, 768) matrices of ~8M values each."""
    total = int(millions * 1e6) // 768
    shapes: dict[str, tuple[int, ...]] = {}
    index = 0
    while total > 0:
        rows = min(total, 10_240)
        shapes[f"h{index}.w"] = (rows, 768)
        total, index = total - rows, index + 1
    return shapes


def link_emulator_command(listen: int, target: int, bandwidth: str, rtt: str, *extra: str):
    """argv of `pcp-tui emulate-link` from 127.0.0.1:`listen` to 127.0.0.1:`target`.

    `extra`: more emulate-link options (`--window 1MiB`, `--shared`). The process
    prints one line once it listens.
    """
    return [
        *(sys.executable, "-m", "pcp_tui", "emulate-link", "--listen", f"127.0.0.1:{listen}"),
        *("--to", f"127.0.0.1:{target}", "--bandwidth", bandwidth, "--rtt", rtt, *extra),
    ]


def run_over_link(
    link: str,
    workdir: Path,
    options: tuple[str, ...],
    *,
    workers: int,
    label: str = "",
    cpus: tuple[set[int], set[int]] | None = None,
    shepherd_env: dict[str, str] | None = None,
) -> dict:
    """A headless shepherd process and `workers` worker processes over `link`: mean round numbers.

    `link` is 'loopback' or 'BANDWIDTH/RTT' (an `emulate-link` process between
    the workers and the shepherd, one shaped link per connection). `options` are
    the shepherd's (`--rounds`, `--inner-steps`, ...; `--metrics` is added); the
    means are over the rounds after the first (first-call warm-up). `label` names
    the run's metrics file in `workdir`. `cpus`: the shepherd's and the workers'
    CPUs, as if each ran on a machine of its own; `shepherd_env`: more of its environment
    (`JAX_PLATFORMS=cpu`: a CPU shepherd beside GPU workers). `busy` is the workers' share of
    the time between round ends (the shepherd's work between rounds included:
    `utilization` counts only the round's own seconds), the last round left out.
    """
    name = f"{link}{label}".replace("/", "_")
    port, metrics = free_port(), workdir / f"{name}.jsonl"
    shepherd = subprocess.Popen(
        shepherd_command(port, "--workers", str(workers), *options, "--metrics", str(metrics)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**worker_env(), **(shepherd_env or {})},
    )
    if cpus is not None:  # before it starts a thread: its threads inherit the set
        os.sched_setaffinity(shepherd.pid, cpus[0])
    emulator, join_port = None, port
    with WorkerProcesses() as processes:
        try:
            if link != "loopback":
                bandwidth, rtt = link.split("/")
                join_port = free_port()
                emulator = subprocess.Popen(
                    link_emulator_command(join_port, port, bandwidth, rtt),
                    stdout=subprocess.DEVNULL,
                )
            assert shepherd.stdout is not None  # started with stdout=PIPE
            for line in shepherd.stdout:
                if "listening on" in line:
                    break
            for index in range(workers):
                worker = processes.spawn(join_port, "--id", f"w{index}")
                if cpus is not None:
                    os.sched_setaffinity(worker.pid, cpus[1])
            output, _ = shepherd.communicate(timeout=3600)
            if shepherd.returncode != 0:
                raise SystemExit(f"the {link} run failed:\n{output}")
        finally:
            for process in (shepherd, emulator):
                if process is not None and process.poll() is None:
                    process.kill()
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    every = with_evals(events)
    ends = {r["round"]: r["time"] for r in every}
    rounds = [r for r in every if r["round"] > 1]
    if not rounds:
        raise SystemExit(f"the {link} run had no round after the first: give it --rounds 2 or more")
    return {
        "final_eval_loss": every[-1]["eval_loss"],
        "evaluated": sum(r["eval_loss"] is not None for r in every),
        "largest_result_bytes": max(r.get("largest_result_bytes", 0) for r in rounds),
        "link": link,
        "round_seconds": statistics.mean(r["round_seconds"] for r in rounds),
        "compute_seconds": statistics.mean(r["compute_seconds"] for r in rounds),
        "utilization": statistics.mean(r["utilization"] for r in rounds),
        # the last round ends after the run's final eval, which no worker waits for: left out
        "busy": statistics.mean(
            r["compute_seconds"] / (ends[r["round"]] - ends[r["round"] - 1])
            for r in rounds[:-1] or rounds
        ),
        "bytes_per_round": statistics.mean(r["bytes_sent"] + r["bytes_received"] for r in rounds),
        "bytes_data_parallel": statistics.mean(r["bytes_data_parallel"] for r in rounds),
    }
