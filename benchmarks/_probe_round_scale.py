"""PROBE (not kept): scored against the round, every result as it comes. What a token-holding attacker does to a run at the CLI's training settings, per defence.

The CLI's defaults (tiny model, batch 16 x 128 tokens, inner AdamW lr 1e-3 with
50 warm-up steps, outer Nesterov 0.7 / 0.9) with `--inner-steps 10`, 6 rounds,
seed 0: where a round moves the model enough for an attack to show. The run is
simulated in this process with the shepherd's own parts, in the order a round
uses them (`shepherd/rounds/engine.py`, `shepherd/rounds/results.py`): the exported graphs
(each worker's `train_chunk` on its shard's sample streams, its AdamW state kept
across rounds as a worker keeps it), `ResultScreen.check` (with the
inner-optimizer bound), the aggregate, the loss-delta validator, and the outer
step. As in the engine, a round's results that pass the screen are folded in at
once and checked after its outer step (`shepherd/rounds/checks.py`): the next
round's workers train from that step, and a refusal leaves it (`checks.recompute`)
before the next step. A worker's results are scored before they count until one
has counted, and again after a refusal (its check taken to end before the next
round's results come). Worker k is index k on shard k of `--workers` shards, as in
a real run whose workers join in order. Attackers train honestly, then send instead:

- ``sign flip``: −Δ.
- ``scaled``: Δ scaled to just under the inner-optimizer bound (the most the
  screen lets through: ``SCALE_TO_BOUND`` of it).
- ``random``: a Gaussian direction with its honest Δ's norm.
- ``ALIE``: "a little is enough" (Baruch et al. 2019): mean − z·std over the
  round's honest results, per coordinate, z from the worker count (it knows them:
  the strongest colluder).
- ``..., 3 of 5 ids``: one token holder joins as 3 of 5 ids, from one address, and
  sends 1e-12·Δ (``tiny``), −Δ, or ALIE's vector with f = 3 from each. Their rows
  are printed twice: as they weigh by id (``--weight-per id``: each id its tokens)
  and by address (the default in an open run: the holder's ids share one id's
  weight, `RoundEngine._shares`).

Defences: ``mean`` (DiLoCo's token-weighted mean), ``centered-clip`` (the
default before loss-delta validation), ``clip+validate`` (today's default:
centered clip, each result checked by `diloco/validation.py`). Each attacked run
is compared with the same run with the attacker honest ("honest control"); the
3-of-5 Sybil run with the run where those ids are absent (the 2 honest workers
alone, on the same shards). docs/security.md has a run.

    python benchmarks/bench_byzantine.py [--smoke] [--only "sign flip"]

`--smoke` runs the scenarios of 5 ids only: every attack and the Sybil, one compile.
"""

from __future__ import annotations

import argparse
import sys
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from pcp_tui.backends import select_backend
from pcp_tui.config import RunConfig
from pcp_tui.diloco.aggregate import CenteredClip, make_aggregate
from pcp_tui.diloco.outer import OuterOptimizer
from pcp_tui.diloco.screening import BadResult, NormGuard, ResultScreen, global_norm
from pcp_tui.diloco.validation import (
    AssignedBatches,
    Assignment,
    Kept,
    LossDeltaValidator,
    eval_loss,
)
from pcp_tui.shepherd.rounds.checks import Before, recompute
from pcp_tui.shepherd.rounds.engine import (
    copy_tree,
    inner_optimizer,
    result_lr_sum,
    round_lr_sum,
    tokens_per_step,
    update_bound,
)
from pcp_tui.shepherd.rounds.results import weight_shares
from pcp_tui.shepherd.run.graphs import GraphLibrary
from pcp_tui.training import shards
from pcp_tui.training.build import build_workload

Params = dict[str, np.ndarray]
# (the attacker's own honest Δ, the round's honest results, the round's bound, rng) → what it sends
Attack = Callable[[Params, list[Params], float, np.random.Generator], Params]

SCALE_TO_BOUND = 0.95
PROBE_LOG: list = []
GRID = [2.0**j for j in range(-5, 5)]
RATIO = 0.5  # shrink when s*_k / median s* is at most this


def relative(sim, results, start, number, rng):
    cfg = sim.config
    stars = {}
    for k, d in results.items():
        rows = shards.sample_batches(
            sim.workload.shards[k], steps=1, batch_size=16, seq_len=cfg.data.seq_len,
            seed=cfg.model.seed, stream=(k, 0, int(rng.integers(2**62))),
        )
        f = [sim.score({n: start[n] - np.float32(g) * d[n] for n in start}, rows) for g in GRID]
        stars[k] = GRID[int(np.argmin(f))]
    median = float(np.median(list(stars.values())))
    out, log = {}, {}
    for k, d in results.items():
        ratio = stars[k] / median
        scale = 1.0
        while ratio <= RATIO and scale > 2**-6:
            scale, ratio = scale / 2, ratio * 2
        out[k] = {n: v * np.float32(scale) for n, v in d.items()} if scale != 1 else d
        log[k] = (stars[k], scale)
    return out, log
DEFENCES = ("mean", "centered-clip", "clip+validate")


def sign_flip(own: Params, honest: list[Params], bound: float, rng) -> Params:
    return {n: -v for n, v in own.items()}


def scaled(own: Params, honest: list[Params], bound: float, rng) -> Params:
    factor = np.float32(SCALE_TO_BOUND * bound / global_norm(own))
    return {n: v * factor for n, v in own.items()}


def random_direction(own: Params, honest: list[Params], bound: float, rng) -> Params:
    noise = {n: rng.standard_normal(v.shape).astype(np.float32) for n, v in own.items()}
    factor = np.float32(global_norm(own) / global_norm(noise))
    return {n: v * factor for n, v in noise.items()}


def alie(own: Params, honest: list[Params], bound: float, rng, colluders: int = 1) -> Params:
    """Baruch et al. 2019: z_max = Φ⁻¹((n − s) / n), s = ⌊n/2 + 1⌋ − f, with f attackers of n
    (s at least 1: f past half of n leaves the formula's z infinite)."""
    n, f = len(honest) + colluders, colluders
    s = max(math.floor(n / 2 + 1) - f, 1)
    z = NormalDist().inv_cdf((n - s) / n)
    out = {}
    for name in own:
        stacked = np.stack([h[name] for h in honest])
        out[name] = (stacked.mean(0) - z * stacked.std(0)).astype(np.float32)
    return out


def alie_3(own: Params, honest: list[Params], bound: float, rng) -> Params:
    """ALIE by 3 colluding ids (one holder's): each sends the same vector."""
    return alie(own, honest, bound, rng, colluders=3)


def tiny(own: Params, honest: list[Params], bound: float, rng) -> Params:
    return {n: v * np.float32(1e-12) for n, v in own.items()}


@dataclass(frozen=True)
class Scenario:
    label: str
    workers: int  # ids in the run (shards are always `shards`)
    attackers: tuple[int, ...]  # indices that attack
    attack: Attack | None
    shards: int
    # the attackers are one token holder's ids, from one address (the others one each)
    holder: bool = False


SCENARIOS = [
    Scenario("sign flip, 1 of 3", 3, (2,), sign_flip, 3),
    Scenario("sign flip, 1 of 5", 5, (4,), sign_flip, 5),
    Scenario("scaled to the bound, 1 of 3", 3, (2,), scaled, 3),
    Scenario("scaled to the bound, 1 of 5", 5, (4,), scaled, 5),
    Scenario("random direction, 1 of 3", 3, (2,), random_direction, 3),
    Scenario("random direction, 1 of 5", 5, (4,), random_direction, 5),
    Scenario("ALIE, 1 of 3", 3, (2,), alie, 3),
    Scenario("ALIE, 1 of 5", 5, (4,), alie, 5),
    Scenario("tiny 1e-12, 3 of 5 ids", 5, (2, 3, 4), tiny, 5, holder=True),
    Scenario("sign flip, 3 of 5 ids", 5, (2, 3, 4), sign_flip, 5, holder=True),
    Scenario("ALIE, 3 of 5 ids", 5, (2, 3, 4), alie_3, 5, holder=True),
]


class Simulation:
    """The run's graphs, compiled once per shard count; `run` trains one scenario."""

    def __init__(self, config: RunConfig, shard_count: int):
        self.config = config
        self.workload = build_workload(config, shards=shard_count)
        graphs = GraphLibrary.for_run(config, self.workload, inner_optimizer(config)).export_main()
        backend = select_backend(config.model.platforms[0])
        self.names = graphs.param_names
        self.train_chunk = backend.load("train_chunk", graphs.train_chunk).call
        self.init_opt_state = backend.load("init_opt_state", graphs.init_opt_state).call
        self.evaluate = eval_loss(backend.load("eval_loss", graphs.eval_loss).call, self.names)
        self.score = eval_loss(backend.load("score_loss", graphs.score_loss).call, self.names)
        self.chunk_steps = graphs.chunk_steps
        self.shapes = {n: tuple(p.shape) for n, p in self.workload.params.items()}

    def _train(self, index: int, number: int, params: Params, opt_state: list) -> tuple:
        cfg, flat = self.config, [params[n] for n in self.names]
        for chunk in range(cfg.inner.steps // self.chunk_steps):
            batches = shards.sample_batches(
                self.workload.shards[index],
                steps=self.chunk_steps,
                batch_size=cfg.data.batch_size,
                seq_len=cfg.data.seq_len,
                seed=cfg.model.seed,
                stream=(index, number, chunk),
            )
            first_step = (number - 1) * cfg.inner.steps + chunk * self.chunk_steps
            flat, opt_state, _ = self.train_chunk(
                tuple(flat), tuple(opt_state), batches, np.int32(first_step)
            )
        trained = {n: np.asarray(v) for n, v in zip(self.names, flat, strict=True)}
        return {n: params[n] - trained[n] for n in self.names}, list(opt_state)

    def run(
        self, scenario: Scenario, defence: str, honest: bool, workers: int, per: str = "address"
    ) -> Outcome:
        """Final eval loss of `workers` ids (the attackers honest if `honest`) under `defence`,
        with `--weight-per` `per` (a holder's ids share one address; the others one each)."""
        cfg = self.config
        params = {n: np.array(p, np.float32) for n, p in self.workload.params.items()}
        outer = OuterOptimizer(cfg.outer.optimizer, cfg.outer.lr, cfg.outer.momentum)
        kind = "mean" if defence == "mean" else "centered-clip"
        mean = make_aggregate(kind, tuple(sorted(params)))
        # the screen a round's results pass, as the round engine builds it
        screen = ResultScreen(
            dict(self.shapes),
            max_tokens=cfg.inner.steps * tokens_per_step(cfg, self.workload),
            norms=None if kind == "mean" else NormGuard(factor=math.inf),
        )
        validator = None
        if defence == "clip+validate":
            batches = AssignedBatches.for_run(cfg, self.workload, self.chunk_steps)
            validator = LossDeltaValidator(self.score, batches)
        tokens = cfg.inner.steps * cfg.data.batch_size * cfg.data.seq_len
        networks = {
            str(k): "holder" if scenario.holder and k in scenario.attackers else f"own {k}"
            for k in range(workers)
        }
        shares = weight_shares(networks) if per == "address" else {}
        steps = cfg.inner.steps
        opt_states = {
            k: list(self.init_opt_state(tuple(params[n] for n in self.names)))
            for k in range(workers)
        }
        rng = np.random.default_rng(cfg.model.seed)
        refused = {"attacker": 0, "honest": 0}
        evals, validate_seconds = [], 0.0
        correction = None  # the last round's check's, taken in before this round's step
        # workers none of whose results has counted yet, or refused since: scored as they come
        probation: set[int] = set(range(workers))
        for number in range(1, cfg.outer.rounds + 1):
            screen.bound = update_bound(cfg, params)
            screen.norms.begin_round()
            per_step = screen.max_tokens // cfg.inner.steps
            screen.lr_sum = result_lr_sum(cfg, per_step, end=number * cfg.inner.steps)
            if isinstance(mean, CenteredClip):
                mean.step_scale = round_lr_sum(cfg, number)
            start = {n: v.copy() for n, v in params.items()}  # the workers' start: scored on
            results = {}
            for k in range(workers):
                results[k], opt_states[k] = self._train(k, number, params, opt_states[k])
            attacking = () if honest else scenario.attackers
            honest_results = [results[k] for k in range(workers) if k not in attacking]
            for k in attacking:
                results[k] = scenario.attack(results[k], honest_results, screen.bound, rng)
            if defence == "clip+validate":  # PROBE: relative supported scale, as they come
                results, log = relative(self, results, start, number, rng)
                PROBE_LOG.append((honest, number, log))
            if correction is not None:  # the last round's refusals leave its step now
                params.update(correction.params)
                outer.state = correction.outer_state
                mean.load_state_arrays(correction.aggregate)
            # the engine folds as results come, then again after a correction: the same sums
            aggregate_state = {n: np.array(v) for n, v in mean.state_arrays().items()}
            mean.reset()
            kept = []  # checked after the step, as the engine does
            for k in range(workers):
                who = "attacker" if k in attacking else "honest"
                claim = Assignment(k, k, steps)
                try:
                    screen.check(results[k], tokens)
                    if validator is not None and k in probation:  # scored before it counts
                        validator.score(results[k], tokens, claim, number=number, params=start)
                except BadResult:
                    refused[who] += 1
                    continue
                weight = tokens * shares.get(str(k), 1.0)  # as `Round` weighs it
                mean.add(results[k], weight, key=str(k))
                kept.append(Kept(str(k), results[k], weight, claim, k in probation))
            correction = None
            if mean.contributors:
                mean.finish()
                before = Before(
                    {n: params[n].copy() for n in params},
                    copy_tree(outer.state) if outer.state is not None else None,
                    aggregate_state,
                    getattr(mean, "step_scale", 1.0),
                )
                outer.apply(params, mean.sums, mean.scale)
                if validator is not None:
                    started = time.perf_counter()
                    out = set()
                    for result in kept:
                        try:
                            if not result.checked:
                                validator.score(
                                    result.tensors,
                                    tokens,
                                    result.assignment,
                                    number=number,
                                    params=start,
                                )
                            probation.discard(int(result.worker_id))  # it counts
                        except BadResult:
                            refused[
                                "attacker" if int(result.worker_id) in attacking else "honest"
                            ] += 1
                            out.add(result.worker_id)
                            probation.add(int(result.worker_id))
                    validate_seconds += time.perf_counter() - started
                    if out:
                        counted = [r for r in kept if r.worker_id not in out]
                        correction = recompute(
                            before,
                            counted,
                            make_aggregate(kind, tuple(sorted(params))),
                            OuterOptimizer(cfg.outer.optimizer, cfg.outer.lr, cfg.outer.momentum),
                        )
            # the round's eval is of θ as its check leaves it
            evals.append(
                self.evaluate(
                    {**params, **(correction.params if correction else {})},
                    self.workload.eval_tokens,
                )
            )
        return Outcome(evals, refused, validate_seconds)


@dataclass
class Outcome:
    evals: list[float]
    refused: dict[str, int]
    validate_seconds: float

    @property
    def final(self) -> float:
        return self.evals[-1]


def config_for(args: argparse.Namespace, workers: int) -> RunConfig:
    config = RunConfig(
        inner_steps=args.inner_steps,
        rounds=args.rounds,
        seed=args.seed,
        workers=workers,
        platforms=(args.backend,),
        token="bench-byzantine",
    )
    if args.smoke:
        config = config.replace(
            batch_size=2, seq_len=16, eval_batches=2, warmup_steps=2, chunk_steps=2
        )
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="cpu", help="where the graphs run: cpu, cuda")
    parser.add_argument(
        "--only", nargs="+", help="scenarios to run, in this order (a label or its start)"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a seconds-long run at toy sizes (CI's check)"
    )
    parser.add_argument("--defences", nargs="+", choices=DEFENCES, default=list(DEFENCES))
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.inner_steps = 2, 2
    chosen = SCENARIOS  # in --only's order, if given
    if args.smoke:  # every attack once (a holder's ids: tiny's), on one shard count: one compile
        chosen = [s for s in SCENARIOS if s.shards == 5 and not (s.holder and s.attack != tiny)]
    if args.only:
        chosen = [s for o in args.only for s in SCENARIOS if s.label.startswith(o)]
    simulations: dict[int, Simulation] = {}
    controls: dict[tuple[int, int, str], Outcome] = {}  # (shards, workers, defence)
    print(
        "| attack | defence | final eval | honest control | change | refused: attacker / honest |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    worst: dict[str, float] = {}
    for scenario in chosen:
        if scenario.shards not in simulations:
            simulations[scenario.shards] = Simulation(
                config_for(args, scenario.shards), scenario.shards
            )
        sim = simulations[scenario.shards]
        sybil = len(scenario.attackers) > 1
        for defence in args.defences:
            # the control: attackers honest, or (several ids of one holder) absent
            workers = scenario.workers - len(scenario.attackers) if sybil else scenario.workers
            key = (scenario.shards, workers, defence)
            if key not in controls:
                controls[key] = sim.run(scenario, defence, True, workers)
            control = controls[key]
            # one holder's ids: also as they weigh by id (--weight-per id), undefended
            for per in ("id", "address") if scenario.holder else ("address",):
                attacked = sim.run(scenario, defence, False, scenario.workers, per)
                change = attacked.final / control.final - 1
                if per == "address":
                    worst[defence] = max(worst.get(defence, -math.inf), abs(change))
                print(
                    f"| {scenario.label} | {defence}{', weight per id' if per == 'id' else ''} "
                    f"| {attacked.final:.3f} | {control.final:.3f}"
                    f"{' (ids absent)' if sybil else ''} | {change:+.1%} "
                    f"| {attacked.refused['attacker']} / {attacked.refused['honest']} |",
                    flush=True,
                )
    shard_counts = sorted({s.shards for s in chosen})
    for shard_count in shard_counts:
        cost = [
            controls[(shard_count, shard_count, d)].final
            for d in DEFENCES
            if (shard_count, shard_count, d) in controls
        ]
        if len(cost) == len(DEFENCES):
            mean, clip, validated = cost
            print(
                f"nobody attacks, {shard_count} workers: mean {mean:.4f}, centered-clip "
                f"{clip:.4f} ({clip / mean - 1:+.2%}), clip+validate {validated:.4f} "
                f"({validated / mean - 1:+.2%})"
            )
    print(
        "largest |change| vs its control: "
        + ", ".join(f"{d} {worst[d]:.1%}" for d in DEFENCES if d in worst)
    )
    if "mean" in worst and "clip+validate" in worst:  # what the defence leaves of the attacks
        print(
            f"ratio_worst_change_defended_vs_mean={worst['clip+validate'] / max(worst['mean'], 1e-9):.4g}"
        )


if __name__ == "__main__":  # PROBE: python benchmarks/_rel.py "scaled to the bound, 1 of 5"
    for label in sys.argv[1:]:
        scenario = next(s for s in SCENARIOS if s.label.startswith(label))
        settings = argparse.Namespace(inner_steps=10, rounds=6, seed=0, backend="cpu", smoke=False)
        sim = Simulation(config_for(settings, scenario.shards), scenario.shards)
        for honest in (False, True):
            PROBE_LOG.clear()
            o = sim.run(scenario, "clip+validate", honest, scenario.workers)
            print(label, "honest" if honest else "attacked", " ".join(f"{e:.3f}" for e in o.evals))
            for _, number, log in PROBE_LOG:
                print("   round", number, "worker: (best scale, taken at)", log, flush=True)
