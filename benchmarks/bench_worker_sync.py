"""Worker sync: what a worker adds to a round around its compute, and how long it stalls.

Runs the worker's real round (`RoundTrainer.train_round`, plain DiLoCo: one
fragment) on a round start of GPT-2 124M shapes (498 MB of float32) with a
stand-in training graph that hands its inputs back (no compute), and a
stand-in sender that encodes the result, drops it (no wire) and answers with
the fragment's update at once (the round's start values: no shepherd). What is
left is the worker's own work on a round: checking the round's parameters,
uploading them, forming the pseudo-gradient and bringing it to the host, then
taking the update in. The worker's status changes split the round into phases:
`upload` (checks, host to device), `train` (the stand-in graph: dispatch only)
and `return` (pseudo-gradient, device to host, encoding; the update checked,
staged and merged). A ticker task on the
same trio loop records the longest stall of the event loop in each phase:
heartbeats and the receive loop wait that long.

    python benchmarks/bench_worker_sync.py [--preset gpt2] [--backend cpu] [--rounds 5]
    python benchmarks/bench_worker_sync.py --smoke              # tiny shapes, one round

A before/after pair with the same harness: run this file with the Python of
another checkout's environment (e.g. a `git worktree` of an older commit with
its own editable install), alternating the two.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

import pcp_tui
from pcp_tui.testing import parse_with_smoke


def stand_in_graphs(names: tuple[str, ...], shapes: dict, backend):
    """A `train_chunk` (parameters, optimizer state, batches, first step) that returns its
    (donated) inputs, and an `init_opt_state` of one scalar."""
    import jax
    import jax.numpy as jnp

    specs = tuple(jax.ShapeDtypeStruct(shapes[n], jnp.float32) for n in names)
    opt_specs = (jax.ShapeDtypeStruct((), jnp.float32),)
    batches = jax.ShapeDtypeStruct((1, 1, 9), jnp.int32)
    first_step = jax.ShapeDtypeStruct((), jnp.int32)
    with jax.default_device(backend.device):
        train = jax.jit(
            lambda p, o, b, s: (p, o, jnp.zeros((1,), jnp.float32)), donate_argnums=(0, 1)
        )
        init = jax.jit(lambda p: (jnp.zeros((), jnp.float32),))
        return (
            train.lower(specs, opt_specs, batches, first_step).compile(),
            init.lower(specs).compile(),
        )


class NullSender:
    """Encodes what the worker sends (as the real sender does) and drops it; answers each
    result with its fragment's update at once, `start`'s values (as if the outer step moved
    nothing)."""

    def __init__(self, rounds, start: dict[str, np.ndarray]):
        self.rounds, self.start = rounds, start
        self.stream = argparse.Namespace(sending=False)  # never busy: progress lines go out

    async def send(self, body, tensors=None, **options) -> int:
        from pcp_tui import protocol

        size = sum(len(memoryview(b)) for b in protocol.encode(body, tensors, **options))
        if isinstance(body, protocol.RoundResult):
            names = self.rounds.fragments[body.fragment]
            update = protocol.FragmentUpdate(round=body.round, fragment=body.fragment)
            self.rounds.updates.deliver(protocol.Message(update, {n: self.start[n] for n in names}))
        return size


PHASE_AFTER = {"training": "train", "syncing": "return", "idle": "done"}  # status -> phase


async def one_round(worker, rounds, message) -> tuple[dict[str, float], list[tuple[float, float]]]:
    """Run one round; when each phase started, and every (time, stall) the ticker saw."""
    import trio

    starts: dict[str, float] = {}
    gaps: list[tuple[float, float]] = []

    def on_status(status) -> None:
        phase = PHASE_AFTER.get(status.state)
        if phase is not None and phase not in starts:
            starts[phase] = time.perf_counter()

    async def ticker():
        while True:
            before = time.perf_counter()
            await trio.sleep(0.002)
            after = time.perf_counter()
            gaps.append((after, after - before - 0.002))

    worker.status.listeners = [on_status]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0.01)
        starts["upload"] = time.perf_counter()
        await rounds.train_round(NullSender(rounds, message.tensors), message)
        starts.setdefault("done", time.perf_counter())
        await trio.sleep(0.01)  # the ticker records a stall that lasted to the round's end
        nursery.cancel_scope.cancel()
    return starts, gaps


async def measure(args: argparse.Namespace) -> dict:
    import jax

    from pcp_tui import protocol
    from pcp_tui.config import WorkerConfig
    from pcp_tui.training.models import gpt2
    from pcp_tui.worker.client import Worker
    from pcp_tui.worker.rounds import InnerState, RoundTrainer, Training

    config = gpt2.PRESETS[args.preset]
    shapes = {
        n: tuple(s.shape)
        for n, s in jax.eval_shape(lambda: gpt2.init(config, jax.random.PRNGKey(0))).items()
    }
    names = tuple(sorted(shapes))
    # never connects: the rounds are fed to it directly
    worker = Worker(WorkerConfig(connect="127.0.0.1:1", token="bench", backend=args.backend))
    train, init = stand_in_graphs(names, shapes, worker.backend)
    plan = protocol.Plan(
        param_names=names,
        inner_steps=1,
        chunk_steps=1,
        batch_size=1,
        seq_len=8,
        tokens_per_row=8,
        fragments=(protocol.Fragment(names),),  # plain DiLoCo: one fragment, every tensor
    )
    rounds = RoundTrainer(
        Training(plan, np.arange(1024, dtype=np.int32), train, init),
        worker.backend,
        worker.counters,
        InnerState(),
        status=worker.status.update,
        worker_index=lambda: 0,
    )
    rng = np.random.default_rng(0)
    params = {n: rng.standard_normal(shapes[n], dtype=np.float32) * 0.02 for n in names}
    phases = ("upload", "train", "return")
    seconds = {phase: [] for phase in ("round", *phases)}
    stalls = {phase: [] for phase in ("round", *phases)}
    for number in range(1, args.rounds + 2):  # round 1 compiles and initialises: not counted
        tensors = {n: p.copy() for n, p in params.items()}  # what decoding a roundStart gives
        message = protocol.Message(protocol.RoundStart(round=number, inner_steps=1), tensors)
        starts, gaps = await one_round(worker, rounds, message)
        if number == 1:
            continue
        seconds["round"].append(starts["done"] - starts["upload"])
        stalls["round"].append(
            max((g for t, g in gaps if t - g / 2 >= starts["upload"]), default=0)
        )
        for phase, end in zip(phases, ("train", "return", "done"), strict=True):
            begin, finish = starts[phase], starts[end]
            seconds[phase].append(finish - begin)
            # a stall belongs to the phase its middle falls in
            stalls[phase].append(
                max((g for t, g in gaps if begin <= t - g / 2 < finish), default=0)
            )
    return {
        "preset": args.preset,
        "backend": worker.backend.info.describe(),
        "params": int(sum(np.prod(s) for s in shapes.values())),
        "src": os.path.dirname(os.path.dirname(pcp_tui.__file__)),
        **{f"{k}_seconds": statistics.median(v) for k, v in seconds.items()},
        **{f"{k}_longest_stall": statistics.median(v) for k, v in stalls.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2", choices=["tiny", "small", "gpt2"])
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    args = parse_with_smoke(parser, preset="tiny", rounds=1)
    import trio

    row = trio.run(measure, args)
    print(
        f"worker sync  {row['preset']} ({row['params']:,} params) on {row['backend']}, {row['src']}"
    )
    print(
        f"  round without compute {row['round_seconds']:.3f} s, "
        f"longest event-loop stall {row['round_longest_stall']:.3f} s (medians)"
    )
    for phase in ("upload", "train", "return"):
        print(
            f"  {phase:>7} {row[phase + '_seconds']:.3f} s, "
            f"longest event-loop stall {row[phase + '_longest_stall']:.3f} s"
        )
    print(json.dumps(row))


if __name__ == "__main__":
    main()
