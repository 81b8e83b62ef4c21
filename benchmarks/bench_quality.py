"""Training quality: DiLoCo against synchronous data parallelism on the same tokens.

Every run goes through the real system: a shepherd in this process, real
`pcp-tui worker` processes on 127.0.0.1, the real protocol. All runs see the
same number of tokens (workers x inner steps per worker x batch x seq_len):

- ``sync DP (k=4, H=1)``: a round per inner step, outer SGD at lr 1. Each worker
  keeps its own AdamW state, so this is "data parallelism where every worker
  takes an AdamW step on its own batch and the steps are averaged": it sends
  exactly what gradient all-reduce would (parameters down, one update up,
  every step) and is the synchronous baseline the DiLoCo paper compares with.
- ``large batch (k=1, 4B)``: one worker, batch 4B, the same number of steps:
  mathematically what gradient-averaging DP with one shared AdamW computes.
- ``DiLoCo (k=4, H)``: H inner AdamW steps per round, outer Nesterov (0.7, 0.9).
- ``single worker (k=1)``: one worker, batch B, 4x the steps.

    python benchmarks/bench_quality.py [--steps 400] [--h 10 50 200] [--out docs]

Writes `quality.json`, `quality_table.md` and `quality.png` (eval loss vs
tokens; needs matplotlib: `pip install -e '.[bench]'`) into --out; docs/quality.md
discusses one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pcp_tui.app.launch import local_worker_command  # noqa: E402
from pcp_tui.config import RunConfig  # noqa: E402
from pcp_tui.shepherd.coordinator import Shepherd  # noqa: E402
from pcp_tui.training.build import build_workload  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    label: str
    workers: int
    inner_steps: int
    rounds: int
    tokens: int
    final_eval_loss: float
    bytes_communicated: int
    train_seconds: float
    curve: list[tuple[int, float]]  # (tokens so far, eval loss)


def run(label: str, config: RunConfig) -> Result:
    """One run through shepherd + worker processes; returns what the table and plot need."""
    workload = build_workload(config, shards=config.network.workers)
    shepherd = Shepherd(config, workload)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
        XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
    )
    workers: list[subprocess.Popen] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(shepherd.run)
            for i in range(config.network.workers):
                command = local_worker_command(
                    port, token=config.security.token, extra=("--id", f"bench-{i}", "--quiet")
                )
                workers.append(subprocess.Popen(command, env=env))

    started = time.perf_counter()
    try:
        trio.run(main)
    finally:
        for worker in workers:
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
    history = shepherd.state.history
    initial = shepherd.evaluate(workload.params)
    curve, tokens = [(0, initial)], 0
    for record in history:
        tokens += record.tokens
        if record.eval_loss is not None:
            curve.append((tokens, record.eval_loss))
    result = Result(
        label=label,
        workers=config.network.workers,
        inner_steps=config.inner.steps,
        rounds=len(history),
        tokens=tokens,
        final_eval_loss=curve[-1][1],
        bytes_communicated=sum(r.bytes_sent + r.bytes_received for r in history),
        train_seconds=sum(r.round_seconds for r in history),
        curve=curve,
    )
    print(
        f"{label:28s} eval {result.final_eval_loss:.4f}  {result.bytes_communicated / 1e6:9.1f} MB  "
        f"{result.train_seconds:7.1f} s  (all in {time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    return result


def plans(args: argparse.Namespace) -> list[tuple[str, RunConfig]]:
    base = RunConfig(
        model="tiny",
        seq_len=64,
        batch_size=8,
        data_max_bytes=args.data_max_bytes,
        eval_batches=16,
        chunk_steps=10,
        inner_lr=args.inner_lr,
        warmup_steps=args.warmup,
        host="127.0.0.1",
        port=0,
        token="bench",
        platforms=("cpu",),
        heartbeat_seconds=1.0,
        heartbeat_timeout=120.0,
        seed=args.seed,
    )
    steps, k = args.steps, 4
    every = max(1, steps // 20)
    runs = [
        (
            "sync DP (k=4, H=1)",
            base.replace(
                workers=k,
                inner_steps=1,
                chunk_steps=1,
                rounds=steps,
                outer_optimizer="sgd",
                outer_lr=1.0,
                eval_every=every,
            ),
        ),
        (
            "large batch (k=1, 4B)",
            base.replace(
                workers=1,
                batch_size=k * base.batch_size,
                inner_steps=every,
                rounds=steps // every,
                outer_optimizer="sgd",
                outer_lr=1.0,
            ),
        ),
    ]
    for h in args.h:
        runs.append(
            (
                f"DiLoCo (k=4, H={h})",
                base.replace(
                    workers=k,
                    inner_steps=h,
                    rounds=steps // h,
                    outer_lr=args.outer_lr,
                    outer_momentum=args.outer_momentum,
                    eval_every=max(1, (steps // h) // 20),
                ),
            )
        )
    runs.append(
        (
            "single worker (k=1)",
            base.replace(
                workers=1,
                inner_steps=k * every,
                rounds=steps // every,
                outer_optimizer="sgd",
                outer_lr=1.0,
            ),
        )
    )
    return [
        (label, config)
        for label, config in runs
        if not args.only or any(o in label for o in args.only)
    ]


def table(results: list[Result]) -> str:
    sync = next((r for r in results if r.label.startswith("sync")), None)
    lines = [
        "| run | rounds | tokens | final eval loss | vs sync | bytes communicated | fewer bytes than sync | train wall time |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        versus = f"{100 * (r.final_eval_loss / sync.final_eval_loss - 1):+.1f}%" if sync else "-"
        fewer = f"{sync.bytes_communicated / r.bytes_communicated:.0f}x" if sync else "-"
        lines.append(
            f"| {r.label} | {r.rounds} | {r.tokens:,} | {r.final_eval_loss:.4f} | {versus} | "
            f"{r.bytes_communicated / 1e6:,.1f} MB | {fewer} | {r.train_seconds:.0f} s |"
        )
    return "\n".join(lines)


def plot(results: list[Result], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", flush=True)
        return False
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for r in results:
        tokens, losses = zip(*r.curve, strict=True)
        axes.plot([t / 1e6 for t in tokens], losses, marker=".", label=r.label)
    axes.set(
        xlabel="tokens (millions)",
        ylabel="held-out loss",
        title="DiLoCo vs synchronous DP, same tokens",
    )
    # the first points (loss ~5.5) would flatten the curves where the runs differ
    axes.set_ylim(top=min(4.0, 1.5 * max(r.final_eval_loss for r in results)))
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=400, help="inner steps per worker of the k=4 runs"
    )
    parser.add_argument("--h", type=int, nargs="+", default=[10, 50, 200])
    parser.add_argument("--inner-lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--only", nargs="*", help="run only the labels containing one of these strings"
    )
    parser.add_argument(
        "--data-max-bytes", type=int, default=2_000_000, help="bytes of the embedded corpus"
    )
    parser.add_argument("--label-suffix", default="", help="appended to every run's label")
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        help="combine quality.json files of earlier runs (e.g. run in parallel) into --out",
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        results = [Result(**r) for path in args.merge for r in json.loads(path.read_text())]
        order = ("sync", "DiLoCo", "large", "single")  # the order a single run prints them in
        results.sort(
            key=lambda r: (next(i for i, o in enumerate(order + ("",)) if o in r.label), r.label)
        )
    else:
        results = [run(label + args.label_suffix, config) for label, config in plans(args)]
    (args.out / "quality.json").write_text(json.dumps([vars(r) for r in results], indent=1))
    text = table(results)
    (args.out / "quality_table.md").write_text(text + "\n")
    print(text)
    plot(results, args.out / "quality.png")


if __name__ == "__main__":
    main()
