"""Worker overhead: tokens/s inside a real run vs a bare JAX loop of the same graph.

Both sides run the same exported `train_chunk` on the same device, in a
process with the same environment:

- bare loop: a subprocess loads the exported graph and calls it back to back
  on pre-sampled batches (no network, no protocol, no Python around it); it
  times rounds of the same H steps before and after the real run
  (`--bare-rounds`);
- real run: a shepherd in this process, one `pcp-tui worker` process, H inner
  steps per round, rounds back to back; tokens/s = a round's tokens / the time
  from the previous round's end to its end (parameter send, compute,
  pseudo-gradient return, outer step and the gap between rounds, all
  included). The worker logs, per streaming round, what its training loop
  waited for.

    python benchmarks/bench_worker_overhead.py [--model tiny] [--inner-steps 200] [--rounds 4]
        [--link 1Gbit/50ms] [--compression int8Block] [--streaming-fragments 4 --overlap-steps 25]
        [--smoke]

With `--link BANDWIDTH/RTT` the worker reaches the shepherd through a
`pcp-tui emulate-link` process (its own process, as a real WAN costs the
shepherd nothing): the whole-round ratio is then the issue's "through a slow
link" number, and the bare loop is still measured in the same run.

Prints a table, `ratio_worker_vs_bare=<x>` (the worker's training phase inside
the run; goal >= 0.95 on CPU, >= 0.97 on a GPU) and `ratio_round_vs_bare=<x>`
(whole rounds, parameter sync and outer step included: depends on H).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import time

import numpy as np
import trio

from pcp_tui.app.launch import local_worker_command
from pcp_tui.config import RunConfig
from pcp_tui.testing import free_port, link_emulator_command, parse_with_smoke


def _config(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        model=args.model,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        chunk_steps=args.chunk_steps,
        workers=1,
        host="127.0.0.1",
        port=0,
        platforms=(args.backend,),
        token="bench",
        eval_every=10**6,
        eval_batches=1,
        compute_dtype=args.compute_dtype,
        attention=args.attention,
        data=args.data,
        aggregate=args.aggregate,
        compression=args.compression,
        streaming_fragments=args.streaming_fragments,
        overlap_steps=args.overlap_steps,
        mix_alpha=args.mix_alpha,
    )


def bare_loop(args: argparse.Namespace) -> None:
    """Subprocess mode: compile, say ready, then time one round per 'go' line on stdin."""
    from pcp_tui.backends import select_backend
    from pcp_tui.shepherd.coordinator import Shepherd
    from pcp_tui.training.build import build_workload
    from pcp_tui.training.shards import sample_batches

    config = _config(args)
    workload = build_workload(config, shards=1)
    graphs = Shepherd(config, workload)._export()
    backend = select_backend(args.backend)
    train = backend.load("train_chunk", graphs.train_chunk, donate_argnums=(0, 1))
    init = backend.load("init_opt_state", graphs.init_opt_state)
    params = tuple(backend.to_device([workload.params[n] for n in graphs.param_names]))
    opt_state = init.call(params)
    chunks = config.inner.steps // graphs.chunk_steps
    batches = [
        sample_batches(
            workload.shards[0],
            steps=graphs.chunk_steps,
            batch_size=config.data.batch_size,
            seq_len=config.data.seq_len,
            seed=0,
            stream=(0, 0, c),
        )
        for c in range(chunks)
    ]
    params, opt_state, losses = train.call(params, opt_state, batches[0], np.int32(0))  # warm-up
    np.asarray(losses)
    print("ready", flush=True)
    for _ in sys.stdin:
        started = time.perf_counter()
        for chunk, batch in enumerate(batches):
            first_step = np.int32(chunk * graphs.chunk_steps)
            params, opt_state, losses = train.call(params, opt_state, batch, first_step)
        np.asarray(losses)
        rate = (
            chunks * graphs.chunk_steps * workload.tokens_per_step / (time.perf_counter() - started)
        )
        print(json.dumps({"tokens_per_second": rate}), flush=True)


async def emulated_link(
    link: str, port: int, scope: trio.CancelScope, *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """A `pcp-tui emulate-link` process in front of 127.0.0.1:`port` until `scope` is cancelled.

    Reports the port to connect to once the emulator listens.
    """
    bandwidth, rtt = link.split("/")
    listen = free_port()
    command = link_emulator_command(listen, port, bandwidth, rtt)
    emulator = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
    with scope:
        try:
            await emulator.stdout.receive_some(4096)  # its "emulating a ... link" line: listening
            print(f"worker connects through a {bandwidth} link with {rtt} RTT", flush=True)
            task_status.started(listen)
            await trio.sleep_forever()
        finally:
            emulator.kill()


async def measured_run(
    args: argparse.Namespace, env: dict[str, str]
) -> tuple[list[float], list[float], list[float]]:
    """Bare rounds before and after a real run whose rounds go back to back.

    The run is not paused between rounds: a streaming worker is still training
    its last τ steps when the shepherd's round ends, so a pause would let a bare
    round share the device with it and would cut the steady state the worker
    lives in. A round's wall time is the time from the previous round's end to
    its own (round 1, which compiles, is only a start mark), which is the
    period a worker sees in a long run: parameter send, compute, the
    pseudo-gradient's return, the outer step and the gap between rounds.
    """
    from pcp_tui.shepherd.coordinator import Shepherd
    from pcp_tui.training.build import build_workload

    bare = subprocess.Popen(
        [sys.executable, __file__, "--bare-loop", *sys.argv[1:]],
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )

    def bare_round() -> float:
        bare.stdin.write("go\n")
        bare.stdin.flush()
        return json.loads(bare.stdout.readline())["tokens_per_second"]

    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    logging.getLogger("pcp_tui.shepherd.rounds.engine").setLevel(
        logging.DEBUG
    )  # per-fragment times
    config = _config(args)
    shepherd = Shepherd(config, build_workload(config, shards=1))  # while the bare loop compiles
    if bare.stdout.readline().strip() != "ready":
        raise SystemExit("the bare loop did not start")
    before = (args.bare_rounds + 1) // 2
    bare_rates = [bare_round() for _ in range(before)]
    ends: list[float] = []
    shepherd.state.subscribe(lambda e: ends.append(time.monotonic()) if e.kind == "round" else None)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(shepherd.run)
        link = trio.CancelScope()  # the emulator, if any, lives as long as the worker
        if args.link != "loopback":
            port = await nursery.start(emulated_link, args.link, port, link)
        command = local_worker_command(
            port, token="bench", backend=args.backend, extra=("--quiet", "--log-level", "info")
        )

        async def worker() -> None:
            await trio.run_process(command, env=env)
            link.cancel()

        nursery.start_soon(worker)
    bare_rates += [bare_round() for _ in range(args.bare_rounds - before)]
    bare.stdin.close()
    bare.wait()
    history = shepherd.state.history
    periods = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    for r, period in zip(history, [math.nan, *periods], strict=False):
        print(
            f"  round {r.round}: {period:.2f} s since the last round ended (worker compute "
            f"{r.compute_seconds:.2f} s; the shepherd's round {r.round_seconds:.2f} s)",
            flush=True,
        )
    return (
        bare_rates,
        [r.tokens / period for r, period in zip(history[1:], periods, strict=False)],
        [r.tokens / r.compute_seconds for r in history[1:]],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--data", default=None)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--inner-steps", type=int, default=200)
    parser.add_argument("--chunk-steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--bare-rounds",
        type=int,
        default=2,
        help="bare-loop rounds, half before the run, half after",
    )
    parser.add_argument("--compute-dtype", default="float32")
    parser.add_argument("--attention", default="xla")
    parser.add_argument(
        "--aggregate", default="centered-clip", help="how results combine (the run's default)"
    )
    parser.add_argument("--compression", default="none", help="results on the wire")
    parser.add_argument("--streaming-fragments", type=int, default=1)
    parser.add_argument("--overlap-steps", type=int, default=1)
    parser.add_argument("--mix-alpha", type=float, default=0.0)
    parser.add_argument(
        "--link",
        default="loopback",
        help="'loopback' or BANDWIDTH/RTT through pcp-tui emulate-link, e.g. 1Gbit/50ms",
    )
    parser.add_argument(
        "--peak-flops",
        dest="flops_per_token_peak",
        type=float,
        default=0.0,
        help="device peak FLOP/s for an MFU line (H100 dense bf16: 989e12)",
    )
    parser.add_argument("--bare-loop", action="store_true", help=argparse.SUPPRESS)
    args = parse_with_smoke(
        parser, seq_len=16, batch_size=2, inner_steps=4, chunk_steps=2, rounds=2
    )
    if args.bare_loop:
        bare_loop(args)
        return
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    bare_rates, steady, compute_rates = trio.run(measured_run, args, env)
    if not steady:
        raise SystemExit("--rounds must be 2 or more: round 1 only marks the start")
    compute_median = float(np.median(compute_rates))
    bare_median, run_median = float(np.median(bare_rates)), float(np.median(steady))
    print(
        f"\nworker overhead  model={args.model} backend={args.backend} H={args.inner_steps} "
        f"batch={args.batch_size}x{args.seq_len} link={args.link} compression={args.compression} "
        f"fragments={args.streaming_fragments} overlap={args.overlap_steps}"
    )
    print(f"{'method':<34}{'tokens/s (median)':>20}{'samples':>10}{'ratio':>8}")
    print(
        f"{'bare JAX loop (exported graph)':<34}{bare_median:>20,.0f}{len(bare_rates):>10}{1.0:>8.3f}"
    )
    print(
        f"{'worker training phase (real run)':<34}{compute_median:>20,.0f}{len(steady):>10}"
        f"{compute_median / bare_median:>8.3f}"
    )
    print(
        f"{'whole round (send+train+return+outer)':<34}{run_median:>20,.0f}{len(steady):>10}"
        f"{run_median / bare_median:>8.3f}"
    )
    if args.flops_per_token_peak:
        from pcp_tui.training.build import build_workload

        workload = build_workload(_config(args), shards=1)
        for label, rate in (
            ("bare", bare_median),
            ("worker", compute_median),
            ("round", run_median),
        ):
            print(
                f"MFU {label}: {rate * workload.flops_per_token / args.flops_per_token_peak:.1%} "
                f"({workload.flops_per_token / 1e9:.3f} GFLOP/token, peak {args.flops_per_token_peak / 1e12:.0f} TFLOP/s)"
            )
    print(f"ratio_worker_vs_bare={compute_median / bare_median:.3f}")
    print(f"ratio_round_vs_bare={run_median / bare_median:.3f}")


if __name__ == "__main__":
    main()
