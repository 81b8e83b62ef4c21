"""Can the shepherd tell a copied pseudo-gradient from an id's own? (Issue 25's open Sybil gap.)

An open-run token holder joins as several ids and sends each a copy of one trained Δ: each
copy gets an id's weight. Two signals the shepherd controls were proposed; this measures
both at the CLI's training settings (tiny model, batch 16 x 128, `--inner-steps 10`, 5
workers on 5 shards, plain mean, seed 0), with `bench_byzantine`'s in-process simulation:

- own-shard specificity: Δ_k lowers the loss on the rows worker k trained on ("seen")
  more than on unseen rows of the same shard, and a copy of Δ_j (j ≠ k) should not;
- near-duplicates: copies look alike. A copier adds noise n and −n of Δ's norm to two
  copies: their sum is still 2Δ; printed are the cosine of the pair and their gains.

Per round and id: gains (loss before − after, 64 rows) of its own Δ and of its neighbour's.

    python benchmarks/bench_sybil_copies.py [--rounds 6] [--smoke]

The ratio line: a copy's gain on the copier's own rows over the copier's own Δ's, over
every round and id (1.0: the own-shard loss cannot tell them apart).
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_byzantine import Simulation, config_for

from pcp_tui.diloco.aggregate import make_aggregate
from pcp_tui.diloco.outer import OuterOptimizer
from pcp_tui.diloco.screening import global_norm
from pcp_tui.testing import parse_with_smoke
from pcp_tui.training import shards

WORKERS, ROWS = 5, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--inner-steps", type=int, default=10)
    args = parse_with_smoke(parser, rounds=1, inner_steps=2)
    settings = argparse.Namespace(
        inner_steps=args.inner_steps, rounds=args.rounds, seed=0, backend="cpu", smoke=args.smoke
    )
    cfg = config_for(settings, WORKERS)
    sim = Simulation(cfg, WORKERS)

    def rows(index: int, number: int, seen: bool) -> np.ndarray:
        """ROWS rows of worker `index`'s batches of round `number` (`seen`), or of a stream of
        the same shard it never trains on."""
        chunks = [
            shards.sample_batches(
                sim.workload.shards[index],
                steps=sim.chunk_steps,
                batch_size=cfg.data.batch_size,
                seq_len=cfg.data.seq_len,
                seed=cfg.model.seed,
                stream=(index, number if seen else number + 10_000, chunk),
            )
            for chunk in range(cfg.inner.steps // sim.chunk_steps)
        ]
        flat = np.concatenate([c.reshape(-1, c.shape[-1]) for c in chunks])
        return flat[
            np.random.default_rng(number * 100 + index).choice(len(flat), ROWS, len(flat) < ROWS)
        ]

    def gain(params, delta, batch) -> float:
        """Mean loss drop over `batch`, scored as validation scores: --validate-rows at a time."""
        moved = {n: params[n] - delta[n] for n in params}
        size = cfg.outer.validate_rows
        drops = [
            sim.score(params, batch[i : i + size][None])
            - sim.score(moved, batch[i : i + size][None])
            for i in range(0, ROWS, size)
        ]
        return float(np.mean(drops))

    params = {n: np.array(p, np.float32) for n, p in sim.workload.params.items()}
    outer = OuterOptimizer(cfg.outer.optimizer, cfg.outer.lr, cfg.outer.momentum)
    mean = make_aggregate("mean", tuple(sorted(params)))
    opt = {k: list(sim.init_opt_state(tuple(params[n] for n in sim.names))) for k in range(5)}
    rng = np.random.default_rng(0)
    own_gains, copy_gains = [], []
    print("round id  own: seen unseen  copy: seen unseen  copy±n: seen  cos(copy+n, copy−n)")
    for number in range(1, cfg.outer.rounds + 1):
        deltas = {}
        for k in range(WORKERS):
            deltas[k], opt[k] = sim._train(k, number, params, opt[k])
        for k in range(WORKERS):
            seen, unseen = rows(k, number, True), rows(k, number, False)
            copy = deltas[(k + 1) % WORKERS]
            noise = {n: rng.standard_normal(v.shape).astype(np.float32) for n, v in copy.items()}
            scale = np.float32(global_norm(copy) / global_norm(noise))
            plus = {n: copy[n] + scale * noise[n] for n in copy}
            minus = {n: copy[n] - scale * noise[n] for n in copy}
            dot = sum(float(np.vdot(plus[n], minus[n])) for n in copy)
            cos = dot / (global_norm(plus) * global_norm(minus))
            own_gains.append(gain(params, deltas[k], seen))
            copy_gains.append(gain(params, copy, seen))
            print(
                f"{number:>5} {k:>2}  {own_gains[-1]:.4f} "
                f"{gain(params, deltas[k], unseen):.4f}   {copy_gains[-1]:.4f} "
                f"{gain(params, copy, unseen):.4f}   {gain(params, plus, seen):.4f} "
                f"{gain(params, minus, seen):.4f}  {cos:+.3f}",
                flush=True,
            )
        mean.reset()
        for k in range(WORKERS):
            mean.add(deltas[k], 1.0, key=str(k))
        mean.finish()
        outer.apply(params, mean.sums, mean.scale)
    print(f"ratio_copy_gain_vs_own={sum(copy_gains) / sum(own_gains):.3g}")


if __name__ == "__main__":
    main()
