"""What a token-holding attacker does to a run, per aggregate: final eval loss against honest-only.

Real `pcp-tui worker` processes on 127.0.0.1, the tiny model, one seed. Four
honest workers start first (indices and data shards 0..3 in every run); then
the attacker, a real worker that trains honestly and tampers with the
pseudo-gradient it returns (`pcp_tui.testing.faulty_worker`):

- ``sign flip``: −Δ.
- ``scaled x100``: 100·Δ.
- ``norm ratchet``: 3^r·Δ in its r-th round (walks a bound learned from history).
- ``tiny, 3 ids``: 1e-6·Δ from three worker ids (drags a median of norms down).
- ``first round 1e6``: 1e6·Δ in its first round, honest after.

Every row's ratio is its final eval loss over that of the honest-only run with
`--aggregate mean` (today's DiLoCo); the honest-only row of another aggregate
shows what robustness costs when nobody attacks. docs/security.md has a run.

    python benchmarks/bench_byzantine.py [--rounds 6] [--aggregates centered-clip mean] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import trio

from pcp_tui.config import RunConfig
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.testing import (
    faulty_worker_command,
    parse_with_smoke,
    small_config,
    worker_command,
)
from pcp_tui.training.build import build_workload

REPO = Path(__file__).resolve().parents[1]
HONEST = 4
TOKEN = "bench-byzantine"
ENV = dict(
    os.environ,
    PYTHONUNBUFFERED="1",
    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
)
ATTACKS = {  # row label: (pcp_tui.testing.faulty_worker fault and parameters, how many ids send it)
    "none (honest only)": (None, 0),
    "sign flip": (("scale", {"factor": -1.0}), 1),
    "scaled x100": (("scale", {"factor": 100.0}), 1),
    "norm ratchet": (("ratchet", {"factor": 3.0}), 1),
    "tiny, 3 ids": (("scale", {"factor": 1e-6}), 3),
    "first round 1e6": (("scale", {"factor": 1e6, "results": 1}), 1),
}


@dataclass
class Row:
    attack: str
    aggregate: str
    final_eval_loss: float
    refused: int
    clipped_attacker: int
    clipped_honest: int


def config(args: argparse.Namespace, aggregate: str, attackers: int) -> RunConfig:
    """bench_faults' small run (`pcp_tui.testing.small_config`), this benchmark's flock and aggregate."""
    return small_config(
        eval_batches=4,
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        chunk_steps=5,
        warmup_steps=10,
        inner_lr=2e-3,
        workers=HONEST + attackers,
        aggregate=aggregate,
        token=TOKEN,
        heartbeat_timeout=60.0,
        seed=args.seed,
        platforms=("cpu",),
    )


def attacker_or_honest_command(
    port: int, worker_id: str, attack: tuple[str, dict[str, float]] | None
) -> list[str]:
    """argv of one worker: honest, or the faulty worker running `attack` (a fault, its parameters)."""
    if attack is None:
        return worker_command(port, "--id", worker_id, "--quiet", token=TOKEN)
    fault, parameters = attack
    return faulty_worker_command(
        port, fault, "--id", worker_id, "--quiet", token=TOKEN, **parameters
    )


async def _joined(shepherd: Shepherd, worker_id: str) -> None:
    while worker_id not in shepherd.state.workers:
        await trio.sleep(0.05)


def run(args: argparse.Namespace, label: str, aggregate: str, logs: Path) -> Row:
    attack, count = ATTACKS[label]
    cfg = config(args, aggregate, count)
    shepherd = Shepherd(cfg, build_workload(cfg, shards=HONEST))
    processes: list[subprocess.Popen] = []
    names = [f"honest{i}" for i in range(HONEST)] + [f"attacker{i}" for i in range(count)]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(shepherd.run)
            for name in names:  # one by one, so honest workers always get shards 0..3
                log = open(logs / f"{aggregate}-{label}-{name}.log".replace(" ", "_"), "w")  # noqa: SIM115
                command = attacker_or_honest_command(
                    port, name, attack if name.startswith("a") else None
                )
                processes.append(
                    subprocess.Popen(command, cwd=REPO, env=ENV, stdout=log, stderr=log)
                )
                await _joined(shepherd, name)

    try:
        trio.run(main)
    finally:
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    events = shepherd.state.events
    clipped = [e.data["worker"] for e in events if e.kind == "result_clipped"]
    return Row(
        attack=label,
        aggregate=aggregate,
        final_eval_loss=shepherd.state.history[-1].eval_loss,
        refused=sum(1 for e in events if e.kind == "bad_result"),
        clipped_attacker=sum(1 for w in clipped if w.startswith("attacker")),
        clipped_honest=sum(1 for w in clipped if w.startswith("honest")),
    )


def table(rows: list[Row], reference: float) -> str:
    lines = [
        "| attack | aggregate | final eval loss | ratio vs honest-only (mean) "
        "| refused | clipped: attacker / honest |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.attack} | {r.aggregate} | {r.final_eval_loss:.4g} "
            f"| {r.final_eval_loss / reference:.3f} | {r.refused} "
            f"| {r.clipped_attacker} / {r.clipped_honest} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--aggregates", nargs="+", default=["centered-clip", "mean"])
    parser.add_argument("--only", nargs="+", choices=sorted(ATTACKS), help="attacks to run")
    args = parse_with_smoke(
        parser, rounds=2, inner_steps=5, aggregates=["centered-clip"], only=[list(ATTACKS)[1]]
    )
    labels = [label for label in ATTACKS if not args.only or label in args.only]
    logs = Path(tempfile.mkdtemp(prefix="bench-byzantine-"))
    reference = run(args, "none (honest only)", "mean", logs)
    rows = [reference]
    for aggregate in args.aggregates:
        for label in labels:
            if (label, aggregate) != ("none (honest only)", "mean"):
                rows.append(run(args, label, aggregate, logs))
                print(table(rows[-1:], reference.final_eval_loss).splitlines()[-1], flush=True)
    print(table(rows, reference.final_eval_loss))
    print(f"worker logs: {logs}")


if __name__ == "__main__":
    main()
