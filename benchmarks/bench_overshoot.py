"""Can a loss check see Δ "scaled to the bound"? (Issue 25's open row of `bench_byzantine`.)

The attacker trains honestly and sends c·Δ, c = 0.95 x the inner-optimizer bound / |Δ|: it
points downhill and passes loss-delta validation. Proposed: score also on rows the worker did
not train on, and take a result at the scale those rows support (an overshoot test: does
Δ/2 do better than Δ?). This measures the line L(θ − s·Δ) of every honest result of a
centered-clip run at the CLI's training settings (`bench_byzantine`'s simulation: tiny
model, batch 16 x 128, `--inner-steps 10`, 5 workers on 5 shards, seed 0) on three sets of
16 rows: the rows the worker trained on (drawn as the validator draws them), rows of its
shard from a stream it never trains on ("unseen"), and the next worker's trained rows
(another shard, which the worker never receives). Per round and worker, the loss at
s = 0, 1/2, 1, 2 and at c·(1/8, 1/4, 1/2, 1): the attacker's result and its halvings.

    python benchmarks/bench_overshoot.py [--rounds 6] [--phases] [--smoke]

The summary: per row set, the smallest honest margin L(θ − Δ/2) − L(θ − Δ) (negative: an
honest result an overshoot test would shrink) and the rounds where c·Δ/2 beats c·Δ (an
overshoot test would shrink the attacker). `--phases` also runs `bench_byzantine`'s "scaled
to the bound, 1 of 5" under centered clip with the attack in rounds 1-2 only and in rounds
3 on only: where its harm comes from.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
from bench_byzantine import SCALE_TO_BOUND, SCENARIOS, Simulation, config_for, scaled

from pcp_tui.diloco.aggregate import make_aggregate
from pcp_tui.diloco.outer import OuterOptimizer
from pcp_tui.diloco.screening import global_norm
from pcp_tui.diloco.validation import AssignedBatches, Assignment
from pcp_tui.shepherd.rounds.engine import round_lr_sum, update_bound
from pcp_tui.testing import parse_with_smoke
from pcp_tui.training import shards

WORKERS = 5
HONEST = (0.0, 0.5, 1.0, 2.0)
ATTACKER = (0.125, 0.25, 0.5, 1.0)  # of c


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--phases", action="store_true", help="also the phased attack runs")
    args = parse_with_smoke(parser, rounds=2, inner_steps=2)
    settings = argparse.Namespace(
        inner_steps=args.inner_steps, rounds=args.rounds, seed=0, backend="cpu", smoke=args.smoke
    )
    cfg = config_for(settings, WORKERS)
    sim = Simulation(cfg, WORKERS)
    rng = np.random.default_rng(0)
    trained = AssignedBatches.for_run(cfg, sim.workload, sim.chunk_steps, rng=rng)

    def unseen(index: int) -> np.ndarray:
        return shards.sample_batches(
            sim.workload.shards[index],
            steps=1,
            batch_size=trained.rows,
            seq_len=cfg.data.seq_len,
            seed=cfg.model.seed,
            stream=(index, 0, int(rng.integers(2**62))),  # no round is numbered 0
        )

    params = {n: np.array(p, np.float32) for n, p in sim.workload.params.items()}
    outer = OuterOptimizer(cfg.outer.optimizer, cfg.outer.lr, cfg.outer.momentum)
    clip = make_aggregate("centered-clip", tuple(sorted(params)))
    opt = {k: list(sim.init_opt_state(tuple(params[n] for n in sim.names))) for k in range(5)}
    margins: dict[str, list[float]] = {"own": [], "unseen": [], "other": []}
    overshoots: dict[str, list[int]] = {"own": [], "unseen": [], "other": []}
    tokens = cfg.inner.steps * cfg.data.batch_size * cfg.data.seq_len
    print("round worker c rows | L at s = 0, 1/2, 1, 2 | at c x (1/8, 1/4, 1/2, 1)")
    for number in range(1, cfg.outer.rounds + 1):
        bound = update_bound(cfg, params)
        clip.step_scale = round_lr_sum(cfg, number)  # type: ignore[attr-defined]
        clip.reset()
        results = {}
        for k in range(WORKERS):
            results[k], opt[k] = sim._train(k, number, params, opt[k])
        for k, delta in results.items():
            c = SCALE_TO_BOUND * bound / global_norm(delta)
            sets = {
                "own": trained(Assignment(k, k, cfg.inner.steps), number),
                "unseen": unseen(k),
                "other": trained(Assignment((k + 1) % 5, (k + 1) % 5, cfg.inner.steps), number),
            }
            for name, rows in sets.items():

                def at(s: float, rows=rows, delta=delta) -> float:
                    return sim.score(
                        {n: params[n] - np.float32(s) * delta[n] for n in params}, rows
                    )

                honest = [at(s) for s in HONEST]
                attacker = [at(c * s) for s in ATTACKER]
                margins[name].append(honest[1] - honest[2])
                if attacker[2] < attacker[3]:
                    overshoots[name].append(number)
                print(
                    f"{number} {k} {c:5.2f} {name:6s} | "
                    + " ".join(f"{x:.4f}" for x in honest)
                    + " | "
                    + " ".join(f"{x:.4f}" for x in attacker),
                    flush=True,
                )
        for k, delta in results.items():
            clip.add(delta, tokens, key=str(k))
        clip.finish()
        outer.apply(params, clip.sums, clip.scale)
    for name in margins:
        low = min(margins[name])
        negative = sum(m < 0 for m in margins[name])
        print(
            f"{name}: smallest honest margin L(θ − Δ/2) − L(θ − Δ) {low:+.4f} ({negative} of "
            f"{len(margins[name])} negative); c·Δ/2 beats c·Δ for {len(overshoots[name])} of "
            f"{len(margins[name])} (rounds {sorted(set(overshoots[name]))})"
        )
    # how often an overshoot test on unseen rows would shrink the attacker (1: every result)
    print(
        f"ratio_attacker_overshoots_unseen={len(overshoots['unseen']) / len(margins['unseen']):.4g}"
    )
    if args.phases:
        scenario = next(s for s in SCENARIOS if s.label == "scaled to the bound, 1 of 5")
        control = sim.run(scenario, "centered-clip", True, WORKERS)
        print(f"attacker honest: {control.final:.3f}")
        early = set(range(1, min(3, cfg.outer.rounds + 1)))
        for label, rounds in (("1-2", early), ("3 on", set(range(3, cfg.outer.rounds + 1)))):
            calls = iter(range(1, cfg.outer.rounds + 1))  # one attacker: one call a round

            def phased(own, honest, bound, rng, rounds=rounds, calls=calls):
                return scaled(own, honest, bound, rng) if next(calls) in rounds else own

            attacked = sim.run(
                dataclasses.replace(scenario, attack=phased), "centered-clip", False, 5
            )
            print(
                f"scaled in rounds {label} only: {attacked.final:.3f} "
                f"({attacked.final / control.final - 1:+.1%}); evals "
                + " ".join(f"{e:.3f}" for e in attacked.evals)
            )


if __name__ == "__main__":
    main()
