"""Why does the first round after `--resume` with fresh worker processes lose ground?

Runs the same small run (real shepherd in this process, real `pcp-tui worker`
processes on 127.0.0.1) three ways for each aggregate:

- uninterrupted, ROUNDS rounds;
- stopped after round STOP (checkpoint every round), its workers killed, then
  resumed from that checkpoint with fresh worker processes (fresh AdamW moments);
- the same resume with the centered clip's history dropped (the center and
  distances carried by the checkpoint removed), to see what the clip does.

Prints one table: eval loss per round, and the clip scale of each result in the
first resumed round; the baseline is the uninterrupted run of the same aggregate.

    python benchmarks/bench_resume_clip.py [--rounds 8] [--stop 3] [--inner-steps 30] [--inner-lr 2e-3]
        [--workers 3] [--smoke]

Ends with `ratio_first_resumed_vs_uninterrupted=<x>` of the last resumed run.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import trio

from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.shepherd.run import checkpoint
from pcp_tui.testing import WorkerProcesses, parse_with_smoke, small_config, until
from pcp_tui.training.build import build_workload


def run(config, *, stop_after: int | None = None, forget_clip: bool = False) -> Shepherd:
    """One run on fresh worker processes; `stop_after`: stop (checkpointed) after that round."""
    workload = build_workload(config, shards=config.network.workers)
    shepherd = Shepherd(config, workload)
    shepherd.ask_workers_back = False  # fresh processes for a resume: the point of this probe
    for aggregate in shepherd.engine.aggregates if forget_clip else ():  # one per fragment
        aggregate.load_state_arrays({})  # a probe, not the product: private state below
        if hasattr(aggregate, "center"):
            aggregate.center = None
            aggregate._medians.clear()

    async def main():
        with WorkerProcesses() as workers:
            async with trio.open_nursery() as nursery:
                port = await nursery.start(shepherd.run)
                for index in range(config.network.workers):
                    workers.spawn(port, "--id", f"w{index}")
                if stop_after is not None:
                    await until(lambda: len(shepherd.state.history) >= stop_after, polls=6000)
                    shepherd.request_stop("probe: stop for a resume")
                await until(lambda: shepherd.state.status in ("done", "stopped"), polls=12000)

    trio.run(main)
    return shepherd


def clip_scales(shepherd: Shepherd) -> dict[int, list[float]]:
    """Round -> the scale of each result the centered clip scaled down in it."""
    scales: dict[int, list[float]] = {}
    for event in shepherd.state.events:
        if event.kind == "result_clipped":
            scales.setdefault(event.round, []).append(round(event.scale, 3))
    return scales


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--stop", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=30)
    parser.add_argument("--inner-lr", type=float, default=2e-3)
    parser.add_argument("--aggregates", nargs="+", default=["centered-clip", "mean"])
    parser.add_argument("--workers", type=int, default=3)
    args = parse_with_smoke(
        parser, rounds=3, stop=1, inner_steps=5, workers=2, aggregates=["centered-clip"]
    )
    rows = []
    for aggregate in args.aggregates:
        with tempfile.TemporaryDirectory() as directory:
            common = dict(
                workers=args.workers,
                rounds=args.rounds,
                inner_steps=args.inner_steps,
                inner_lr=args.inner_lr,
                warmup_steps=10,
                chunk_steps=5,
                eval_batches=4,
                aggregate=aggregate,
                checkpoint_dir=directory,
                checkpoint_every=1,
            )
            whole = run(small_config(**common))
            base = [r.eval_loss for r in whole.state.history]
            rows.append((aggregate, "uninterrupted", base, clip_scales(whole)))
            with tempfile.TemporaryDirectory() as second:
                run(small_config(**{**common, "checkpoint_dir": second}), stop_after=args.stop)
                saved = checkpoint.load_latest(second).round
                for forget in (False, True):
                    copy = shutil.copytree(second, f"{directory}/resume-{forget}")  # same start
                    resumed = run(
                        small_config(**{**common, "checkpoint_dir": copy, "resume": copy}),
                        forget_clip=forget,
                    )
                    losses = [None] * saved + [r.eval_loss for r in resumed.state.history]
                    label = f"resumed at {saved}" + (", clip history dropped" if forget else "")
                    rows.append((aggregate, label, losses, clip_scales(resumed)))
                    if aggregate == "mean":
                        break
    print(
        f"{'aggregate':14} {'run':36} eval loss per round{'':48} 1st resumed / "
        "uninterrupted   results clipped: round -> scales"
    )
    baselines = {
        aggregate: losses for aggregate, label, losses, _ in rows if label == "uninterrupted"
    }
    for aggregate, label, losses, scales in rows:
        shown = " ".join("  -   " if x is None else f"{x:.4f}" for x in losses)
        first = next(i for i, x in enumerate(losses) if x is not None)
        ratio = losses[first] / baselines[aggregate][first] if first else 1.0
        print(f"{aggregate:14} {label:36} {shown:68} {ratio:.4f}{'':19} {scales}")
    print(f"ratio_first_resumed_vs_uninterrupted={ratio:.4f}")


if __name__ == "__main__":
    main()
