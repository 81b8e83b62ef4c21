"""Shepherd scale: what a round costs the shepherd with 1, 8, 64, 256 workers.

The workers here are lightweight and protocol-level: N trio tasks in one other
process that do the real handshake (HMAC), receive the real plan and global
parameters, and answer every round at once with a (small, finite) pseudo-
gradient of the plan's shapes. No compute, so the round time *is* the
shepherd's overhead: sending N copies of the parameters, receiving N results,
the streaming token-weighted mean and the outer step.

    python benchmarks/bench_shepherd_scale.py [--workers 1 8 64 256] [--rounds 4] [--model tiny]
    python benchmarks/bench_shepherd_scale.py --param-shapes gpt2 --workers 1 2 --rounds 5
    python benchmarks/bench_shepherd_scale.py --smoke
    python benchmarks/bench_shepherd_scale.py --workers 256 1024 --relays 32
    python benchmarks/bench_shepherd_scale.py --simulated --workers 1000 4000 10000

`--simulated` runs the fakes in the shepherd's own process over in-memory links on trio's
virtual clock (`pcp_tui.testing.simulate`): the real round code with thousands of workers,
each round's seeming training 30 s, and a stand-in model of a few parameters. It prints the
shepherd's CPU seconds per round and per worker (its own: `pcp_tui.testing.CpuByPart`),
whose ratio across N says whether a round's work grows faster than the number of workers;
with `--relays R` each N also runs through R real relays in the same loop, and "root MB" is
what crossed the shepherd's links either way.

With `--relays R`, each N runs twice: flat, and with the fakes spread over R
`pcp-tui relay` processes (fake i joins relay i mod R). The shepherd's bytes per
round are then what crossed its own sockets (flat: its workers', through relays:
its relays' links), printed for both with the last line
`ratio_root_bytes_flat_vs_tree=<x>` (the largest N's).

Prints per N: median round seconds, the shepherd process's CPU seconds per
round (its own work, less sensitive than wall time to a loaded machine), MB
moved, seconds per GB moved (flat means linear in bytes), and the overhead as
a fraction of a reference round, a real 1-worker round of H inner steps
measured on this machine by bench_worker_overhead (pass
--reference-round-seconds; default: H=50 tiny on a 2-core CPU, ~6 s). Ends with
`ratio_round_seconds_<last N>_vs_<first N>=<x>`. `fewest` is the fewest results a round
folded in and `lost` the workers the shepherd dropped: the fakes heartbeat and report
progress like real workers, so a loss is the shepherd's doing (before per-peer bounds left
out its own load, 256 fakes of `--param-shapes small` lost workers as "upload too slow").

`--real-worker` adds one real `pcp-tui worker` process to each run (through relay 0 when the
run has relays), pinned to `--real-device` (CUDA_VISIBLE_DEVICES; run the benchmark itself
with JAX_PLATFORMS=cpu so the shepherd leaves the GPU to it), training the real `--model`
for `--inner-steps` steps a round while the fakes answer at once. Its utilization (its
compute seconds over the wall time from round 1's end to the last's) says whether the tree
costs a GPU its time; the last line is then `ratio_real_utilization_tree_vs_flat=<x>`.

    JAX_PLATFORMS=cpu python benchmarks/bench_shepherd_scale.py --workers 1000 --relays 8 \
        --real-worker --inner-steps 2000 --rounds 5

`--param-shapes gpt2` gives the model the parameter shapes of that preset
(GPT-2 124M: 498 MB of float32) with a stand-in loss: nothing here runs the
model, so only the shapes matter, and the graphs export in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from functools import partial

import numpy as np
import trio

from pcp_tui.config import RunConfig
from pcp_tui.testing import (
    fake_worker,
    free_port,
    parse_with_smoke,
    pseudo_gradient,
    simulate,
    stand_in,
    stand_in_shepherd,
)

FAKE_PROCESSES = 4  # the fakes run in this many processes
REAL_WORKER = "real-worker"  # `--real-worker`'s id


async def _drawn(shapes: tuple, seed: int) -> dict[str, np.ndarray]:
    """A fake's result, drawn in a thread: drawn on the event loop for each of 64 fakes it
    kept every fake of the process from sending a heartbeat for longer than the heartbeat
    timeout, as no real worker does."""
    return await trio.to_thread.run_sync(pseudo_gradient, shapes, seed)


async def fake_workers(ports: list[int], first: int, count: int) -> None:
    """Fakes `first` .. `first + count - 1` (`pcp_tui.testing.fake_worker`); fake i joins
    `ports[i % len(ports)]`. A link the shepherd ends ends its fake (it counts it as lost)."""
    async with trio.open_nursery() as nursery:
        for i in range(first, first + count):
            port = ports[i % len(ports)]
            dial = partial(trio.open_tcp_stream, "127.0.0.1", port)
            nursery.start_soon(partial(fake_worker, dial, i, token="bench", drawn=_drawn))


def with_param_shapes(workload, preset: str):
    """`workload` with the parameter shapes of a GPT-2 preset (`pcp_tui.testing.stand_in`)."""
    import jax

    from pcp_tui.training.models import gpt2

    config = gpt2.PRESETS[preset]
    shapes = jax.eval_shape(lambda: gpt2.init(config, jax.random.PRNGKey(0)))
    return stand_in(workload, {n: s.shape for n, s in shapes.items()}, f"{preset}-shapes")


async def one_size(count: int, args: argparse.Namespace, relays: int = 0) -> dict:
    from pcp_tui.shepherd.coordinator import Shepherd
    from pcp_tui.training.build import build_workload

    real = 1 if args.real_worker else 0
    config = RunConfig(
        model=args.model,
        workers=count + real,
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        chunk_steps=min(args.inner_steps, 50),
        seq_len=64,
        batch_size=8,
        host="127.0.0.1",
        port=0,
        token="bench",
        # the fakes answer with random results: validation would refuse about half, and put
        # the fakes out as no worker does; this measures the shepherd's cost, not their worth
        validate="off",
        platforms=("cpu", "cuda"),  # workers say cpu; the shepherd evaluates on its best device
        eval_every=10**6,
        eval_batches=1,
        data_max_bytes=2**20,
        max_handshakes_per_host=max(count + real, 8),
        max_handshakes=max(count + real, 64),
        relays=relays,
    )
    workload = build_workload(config, shards=count + real)
    if args.param_shapes:
        workload = with_param_shapes(workload, args.param_shapes)
    shepherd = Shepherd(config, workload)
    cpu_at_round: list[float] = []  # this process's CPU seconds when each round ended
    root_bytes: list[int] = []  # bytes through the shepherd's sockets when each round ended
    lost: list[str] = []  # why workers were dropped: a fake behaves, so none should be

    round_ends: list[float] = []  # wall seconds as each round ended

    def note(event) -> None:
        if event.kind == "round":
            round_ends.append(time.perf_counter())
            cpu_at_round.append(time.process_time())
            tree = shepherd.pool.relays
            flat = shepherd.state.bytes_sent + shepherd.state.bytes_received
            root_bytes.append(tree.sent + tree.received if relays else flat)
        elif event.kind == "lost":
            lost.append(event.message)
            print(f"  {event.message}", file=sys.stderr, flush=True)

    shepherd.state.subscribe(note)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(shepherd.run)
        ports = [port]
        if relays:
            ports = [free_port() for _ in range(relays)]
            for r, relay_port in enumerate(ports):
                command = [
                    sys.executable,
                    "-m",
                    "pcp_tui",
                    "relay",
                    "--connect",
                    f"127.0.0.1:{port}",
                ]
                command += ["--token", "bench", "--id", f"relay-{r}", "--host", "127.0.0.1"]
                command += ["--port", str(relay_port), "--give-up-after", "60"]
                nursery.start_soon(partial(trio.run_process, command, stderr=subprocess.DEVNULL))
            while len(shepherd.pool.relays.live) < relays:
                await trio.sleep(0.1)
        # several processes, as real workers have CPUs of their own: one process decoding
        # every fake's round start was the slowest "worker" (silent for the heartbeat timeout)
        processes = min(count, FAKE_PROCESSES)
        for p in range(processes):
            first, last = p * count // processes, (p + 1) * count // processes
            command = [sys.executable, __file__, "--fake", str(first), str(last - first)]
            command += [str(port) for port in ports]
            nursery.start_soon(partial(trio.run_process, command))
        if real:
            command = [sys.executable, "-m", "pcp_tui", "worker", "--token", "bench"]
            command += ["--connect", f"127.0.0.1:{ports[0]}", "--id", REAL_WORKER]
            env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
            env["CUDA_VISIBLE_DEVICES"] = args.real_device
            nursery.start_soon(partial(trio.run_process, command, env=env))
    history = shepherd.state.history[1:]  # round 1 also compiles the outer step
    # the real worker's compute seconds in rounds 2.., over the wall time they took
    computed = sum(r.worker_utilization.get(REAL_WORKER, 0.0) * r.round_seconds for r in history)
    real_utilization = computed / (round_ends[-1] - round_ends[0]) if real else None
    seconds = float(np.median([r.round_seconds for r in history]))
    cpu = float(np.median(np.diff(cpu_at_round)))
    moved = float(np.median([r.bytes_sent + r.bytes_received for r in history]))
    return {
        "workers": count,
        "relays": relays,
        "root_mb_per_round": float(np.median(np.diff(root_bytes))) / 1e6,
        "round_seconds": seconds,
        "shepherd_cpu_seconds": cpu,
        "mb_moved": moved / 1e6,
        "seconds_per_gb": seconds / (moved / 1e9),
        "params": shepherd.workload.param_count,
        "fewest_workers": min(r.workers for r in shepherd.state.history),
        "lost": len(lost),
        "lost_example": lost[0] if lost else "",
        "real_utilization": real_utilization,
        "real_counted": sum(REAL_WORKER in r.worker_ids for r in history) if real else None,
    }


def simulated(counts: list[int], rounds: int, relays: int) -> None:
    """`--simulated`: the real shepherd's CPU seconds and bytes per round with N fakes (and
    through `relays` relays), in virtual time."""
    rows = []
    for count in counts:
        for tree in (0, relays) if relays else (0,):
            shepherd = stand_in_shepherd(count, rounds, relays=tree)
            cpu_at_round: list[float] = []  # the shepherd's CPU seconds as each round ended
            root_bytes: list[int] = []  # through its links: its relays' and direct workers'
            relayed: list[int] = []  # workers carried by relays as each round ended

            def note(cpu, moved, shepherd=shepherd, marks=(cpu_at_round, root_bytes, relayed)):
                marks[0].append(cpu["shepherd"] + cpu["threads"])
                marks[1].append(moved)
                marks[2].append(sum(v.workers for v in shepherd.pool.relays.live.values()))
                done = shepherd.state.history[-1]
                print(  # long runs show progress: a round of 10,000 takes minutes
                    f"    round {done.round}: {done.workers} workers, shepherd CPU "
                    f"{marks[0][-1]:.1f} s so far",
                    file=sys.stderr,
                    flush=True,
                )

            started = time.perf_counter()
            run = simulate(shepherd, count, relays=tree, train_seconds=30.0, on_round=note)
            history = shepherd.state.history
            cpu = float(np.median(np.diff(cpu_at_round)))  # round 1 also compiles the outer step
            rows.append(
                {
                    "workers": count,
                    "relays": tree,
                    "relayed": min(relayed),
                    "cpu_per_round": cpu,
                    "cpu_per_worker_ms": 1e3 * cpu / count,
                    "root_mb_per_round": float(np.median(np.diff(root_bytes))) / 1e6,
                    "round_virtual_s": float(np.median([r.round_seconds for r in history[1:]])),
                    "fewest": min(r.workers for r in history),
                    "lost": len(run.lost),
                    "wall_s": time.perf_counter() - started,
                }
            )
            print(
                f"  {count} simulated workers, {tree} relays, in {rows[-1]['wall_s']:.0f} s",
                file=sys.stderr,
            )
    print("\nshepherd scale, simulated (virtual clock, in-memory links, 30 s rounds)")
    print(
        f"{'workers':>8}{'relays':>7}{'relayed':>8}{'CPU s/round':>13}{'ms/worker':>11}"
        f"{'root MB':>9}"
        f"{'round s':>9}{'fewest':>8}{'lost':>6}{'wall s':>8}"
    )
    for r in rows:
        print(
            f"{r['workers']:>8}{r['relays']:>7}{r['relayed']:>8}{r['cpu_per_round']:>13.3f}"
            f"{r['cpu_per_worker_ms']:>11.3f}{r['root_mb_per_round']:>9.2f}"
            f"{r['round_virtual_s']:>9.2f}{r['fewest']:>8}{r['lost']:>6}{r['wall_s']:>8.0f}"
        )
    flat = [r for r in rows if not r["relays"]]
    first, last = flat[0], flat[-1]
    print(
        f"ratio_cpu_per_worker_{last['workers']}_vs_{first['workers']}="
        f"{last['cpu_per_worker_ms'] / first['cpu_per_worker_ms']:.3f}"
    )
    if relays:
        tree = rows[-1]
        print(
            "ratio_root_bytes_flat_vs_tree="
            f"{last['root_mb_per_round'] / tree['root_mb_per_round']:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--model", default="tiny")
    parser.add_argument(
        "--param-shapes", choices=["tiny", "small", "gpt2"], help="stand-in model of these shapes"
    )
    parser.add_argument("--reference-round-seconds", type=float, default=6.0)
    parser.add_argument(
        "--relays", type=int, default=0, help="also run each N through this many relays"
    )
    parser.add_argument(
        "--simulated", action="store_true", help="fakes in this process, on a virtual clock"
    )
    parser.add_argument(
        "--real-worker", action="store_true", help="one real worker process joins each run"
    )
    parser.add_argument("--real-device", default="0", help="CUDA_VISIBLE_DEVICES of that worker")
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--fake", nargs="+", type=int, help=argparse.SUPPRESS)
    args = parse_with_smoke(parser, workers=[1, 4], rounds=3, relays=2)
    if args.real_worker and args.param_shapes:
        parser.error("--real-worker trains the real --model: leave --param-shapes out")
    if args.simulated:
        simulated(args.workers, args.rounds, args.relays)
        return
    if args.fake:
        first, count, *ports = args.fake
        trio.run(fake_workers, ports, first, count)
        return
    rows = []
    for count in args.workers:
        for relays in (0, args.relays) if args.relays else (0,):
            started = time.perf_counter()
            rows.append(trio.run(one_size, count, args, relays))
            print(
                f"  {count} workers, {relays} relays measured in "
                f"{time.perf_counter() - started:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    model = f"{args.param_shapes}-shapes" if args.param_shapes else args.model
    print(
        f"\nshepherd scale  model={model} ({rows[0]['params']:,} params), protocol-level workers, 127.0.0.1"
    )
    print(
        f"{'workers':>8}{'relays':>7}{'round s':>10}{'CPU s':>8}{'MB moved':>11}"
        f"{'root MB':>9}{'s per GB':>10}"
        f"{'of a ' + str(args.reference_round_seconds) + ' s round':>20}{'fewest':>8}{'lost':>6}"
    )
    for r in rows:
        print(
            f"{r['workers']:>8}{r['relays']:>7}{r['round_seconds']:>10.3f}"
            f"{r['shepherd_cpu_seconds']:>8.3f}{r['mb_moved']:>11.1f}{r['root_mb_per_round']:>9.1f}"
            f"{r['seconds_per_gb']:>10.3f}"
            f"{r['round_seconds'] / args.reference_round_seconds:>20.1%}"
            f"{r['fewest_workers']:>8}{r['lost']:>6}"
        )
        if r["lost"]:
            print(f"    first loss: {r['lost_example']}")
        if r["real_utilization"] is not None:
            print(
                f"    the real worker: utilization {r['real_utilization']:.1%}, counted in "
                f"{r['real_counted']} of {args.rounds - 1} rounds after the first"
            )
    print(json.dumps(rows))
    flat = [r for r in rows if not r["relays"]]
    first, last = flat[0], flat[-1]
    print(
        f"ratio_round_seconds_{last['workers']}_vs_{first['workers']}="
        f"{last['round_seconds'] / first['round_seconds']:.3f}"
    )
    if args.relays:
        tree = rows[-1]
        print(
            f"ratio_root_bytes_flat_vs_tree={last['root_mb_per_round'] / tree['root_mb_per_round']:.3f}"
        )
        if args.real_worker:
            ratio = tree["real_utilization"] / last["real_utilization"]
            print(f"ratio_real_utilization_tree_vs_flat={ratio:.3f}")


if __name__ == "__main__":
    main()
