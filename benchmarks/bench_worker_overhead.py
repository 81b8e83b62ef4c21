"""Worker overhead: tokens/s inside a real run vs a bare JAX loop of the same graph.

Both sides run the same exported `train_chunk` on the same device, in a
process with the same environment:

- bare loop: a subprocess loads the exported graph and calls it back to back
  on pre-sampled batches (no network, no protocol, no Python around it);
- real run: a shepherd in this process, one `pcp-tui worker` process, H inner
  steps per round; tokens/s = tokens / round seconds as the shepherd sees it
  (parameter send, compute, pseudo-gradient return, outer step, all included).

    python benchmarks/bench_worker_overhead.py [--model tiny] [--inner-steps 200] [--rounds 4]

Prints a table and `ratio_run_vs_bare=<x>` (goal: >= 0.95 on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pcp_tui.config import RunConfig  # noqa: E402


def _config(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        model=args.model, seq_len=args.seq_len, batch_size=args.batch_size, rounds=args.rounds,
        inner_steps=args.inner_steps, chunk_steps=args.chunk_steps, workers=1, host="127.0.0.1", port=0,
        platforms=(args.backend,), token="bench", eval_every=10**6, eval_batches=1,
        compute_dtype=args.compute_dtype, attention=args.attention, data=args.data,
    )


def bare_loop(args: argparse.Namespace) -> None:
    """Subprocess mode: time the exported train_chunk called back to back."""
    from backends import select_backend
    from pcp_tui.data import sample_batches
    from pcp_tui.shepherd import Shepherd
    from pcp_tui.task import build_task

    config = _config(args)
    task = build_task(config, shards=1)
    graphs = Shepherd(config, task)._export()
    backend = select_backend(args.backend)
    train = backend.load("train_chunk", graphs.train_chunk, donate_argnums=(0, 1))
    init = backend.load("init_opt_state", graphs.init_opt_state)
    params = tuple(backend.to_device([task.params[n] for n in graphs.param_names]))
    opt_state = init.call(params)
    chunks = config.inner_steps // graphs.chunk_steps
    batches = [sample_batches(task.shards[0], steps=graphs.chunk_steps, batch_size=config.batch_size,
                              seq_len=config.seq_len, seed=0, stream=(0, 0, c)) for c in range(chunks)]
    params, opt_state, losses = train.call(params, opt_state, batches[0])  # warm-up
    np.asarray(losses)
    rates = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        for batch in batches:
            params, opt_state, losses = train.call(params, opt_state, batch)
        np.asarray(losses)
        rates.append(chunks * graphs.chunk_steps * task.tokens_per_step / (time.perf_counter() - started))
    print(json.dumps({"bare_tokens_per_second": rates}))


async def real_run(args: argparse.Namespace, env: dict[str, str]) -> list[float]:
    from pcp_tui.shepherd import Shepherd
    from pcp_tui.task import build_task

    config = _config(args)
    shepherd = Shepherd(config, build_task(config, shards=1))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(shepherd.run)
        command = [sys.executable, "-m", "pcp_tui", "worker", "--connect", f"127.0.0.1:{port}", "--token", "bench",
                   "--backend", args.backend, "--quiet"]
        nursery.start_soon(lambda: trio.run_process(command, env=env))
    return [r.tokens_per_second for r in shepherd.state.history]


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
    parser.add_argument("--compute-dtype", default="float32")
    parser.add_argument("--attention", default="xla")
    parser.add_argument("--bare-loop", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_loop:
        bare_loop(args)
        return
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    bare = subprocess.run([sys.executable, __file__, "--bare-loop", *sys.argv[1:]], env=env, check=True,
                          capture_output=True, text=True)
    bare_rates = json.loads(bare.stdout.strip().splitlines()[-1])["bare_tokens_per_second"]
    run_rates = trio.run(real_run, args, env)
    # round 1 includes the worker's first call after compile; report the steady state (median of the rest)
    steady = run_rates[1:] or run_rates
    bare_median, run_median = float(np.median(bare_rates)), float(np.median(steady))
    print(f"\nworker overhead  model={args.model} backend={args.backend} H={args.inner_steps} "
          f"batch={args.batch_size}x{args.seq_len}")
    print(f"{'method':<34}{'tokens/s (median)':>20}{'samples':>10}{'ratio':>8}")
    print(f"{'bare JAX loop (exported graph)':<34}{bare_median:>20,.0f}{len(bare_rates):>10}{1.0:>8.3f}")
    print(f"{'real run (1 worker, via shepherd)':<34}{run_median:>20,.0f}{len(steady):>10}"
          f"{run_median / bare_median:>8.3f}")
    print(f"ratio_run_vs_bare={run_median / bare_median:.3f}")


if __name__ == "__main__":
    main()
