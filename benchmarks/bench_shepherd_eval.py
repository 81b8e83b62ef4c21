"""The shepherd's own work against the workers' time: its eval and its validation must not idle them.

Runs of the same model on the same tokens (a headless shepherd process and
worker processes over loopback), evaluating after every round: one with
`--eval-batches 1` (the baseline) and one with many (`--eval-batches 64`).
Where the shepherd's CPUs are few, the eval of a round can take longer than a
round: it runs on a copy of θ off the rounds' path (`shepherd/run/evaluation.py`),
so the next round starts at once and an eval that would start while the last
still runs is skipped. Before that change, each eval ran between two rounds
while the workers waited.

`--validate loss-delta off` runs each --eval-batches with loss-delta validation
(which scores each result on --eval-batches of its batches) and without: the
results of a round are checked while the next one trains
(`shepherd/rounds/checks.py`), so the workers should be about as busy either
way. `--before DIR` adds a `loss-delta` run whose shepherd runs the code in DIR
(a copy of `pcp_tui` from before, `protocol/` and `backends/` moved into it, put
first on its PYTHONPATH): validation on the rounds' path, as it was.

With two CPUs or more the shepherd runs on one and the workers on the others,
as a coordinator on a machine of its own would (`--no-pin`: all share all).

Columns: `busy` (the workers' compute seconds over the time between two round
ends, the shepherd's work between rounds included; rounds 2..R-1: the last one
ends after the run's final eval, which no worker waits for), each against
the baseline, the round's wall time, the rounds whose eval ran (the last one
always does, awaited), the final eval loss.

    python benchmarks/bench_shepherd_eval.py [--eval-batches 1 64] [--rounds 5] [--smoke]
    python benchmarks/bench_shepherd_eval.py --eval-batches 16 --validate loss-delta off \
        [--before /tmp/before]

Ends with `ratio_busy_eval<last>_vs_eval<first>=<x>` (goal: >= 0.95), or with
several --validate, `ratio_busy_<mode>_vs_off=<x>` for each other mode (goal: >= 0.95).
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
    parser.add_argument(
        "--validate", nargs="+", default=["loss-delta"], choices=("loss-delta", "off")
    )
    parser.add_argument("--before", help="a copy of pcp_tui from before, for one more run")
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
        parser,
        eval_batches=[2],
        validate=["loss-delta", "off"],
        rounds=3,
        inner_steps=2,
        batch_size=2,
        seq_len=16,
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
    runs = [(batches, mode, None) for batches in args.eval_batches for mode in args.validate]
    if args.before:
        runs.append((args.eval_batches[-1], "loss-delta", args.before))
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        os.chdir(workdir)  # `python -m` puts the working directory first: not this checkout
        for batches, mode, code in runs:
            label = f"eval{batches}-{mode}" + ("-before" if code else "")
            print(f"running {label}...", file=sys.stderr, flush=True)
            env = {"JAX_PLATFORMS": "cpu"} if args.cpu_shepherd else {}
            if code:
                env["PYTHONPATH"] = code
            row = run_over_link(
                "loopback",
                Path(workdir),
                (*options, "--eval-batches", str(batches), "--validate", mode),
                workers=args.workers,
                label=label,
                cpus=cpus,
                shepherd_env=env or None,
            )
            rows.append({**row, "batches": batches, "mode": mode + (" (before)" if code else "")})
    base = rows[0]
    where = (
        f"shepherd on CPU {available[0]}, workers on {len(available) - 1} more"
        if pin
        else f"shepherd and workers share {len(available)} CPUs"
    )
    print(
        f"{args.workers} worker(s), {args.model}, H={args.inner_steps}, "
        f"batch {args.batch_size}x{args.seq_len}, eval every round, {where}, "
        f"busy and utilization over rounds 2..{max(args.rounds - 1, 2)}\n"
    )
    print(
        f"{'eval batches':>12} {'validate':<22} {'busy':>6} {'x base':>7} {'util':>6} "
        f"{'round s':>8} {'evaluated':>10} {'eval loss':>9}"
    )
    for row in rows:
        print(
            f"{row['batches']:>12} {row['mode']:<22} {row['busy']:6.1%} "
            f"{row['busy'] / base['busy']:7.3f} {row['utilization']:6.1%} "
            f"{row['round_seconds']:8.2f} {row['evaluated']:>4}/{args.rounds:<5} "
            f"{row['final_eval_loss']:9.4f}"
        )
    if len(args.validate) > 1:
        last = args.eval_batches[-1]
        off = next(r for r in rows if r["batches"] == last and r["mode"] == "off")
        for row in rows:
            if row["batches"] == last and row["mode"] != "off":
                name = row["mode"].replace(" (before)", "_before").replace("-", "_")
                print(f"ratio_busy_{name}_vs_off={row['busy'] / off['busy']:.3f}")
        return
    last = rows[-1]
    print(
        f"ratio_busy_eval{last['batches']}_vs_eval{base['batches']}="
        f"{last['busy'] / base['busy']:.3f}"
    )


if __name__ == "__main__":
    main()
