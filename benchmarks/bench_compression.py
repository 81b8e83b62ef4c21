"""Pseudo-gradient compression: bytes saved, loss cost and codec speed, same seed, real runs.

For each encoding (none, bfloat16, int8Block, int4Block) one run with a shepherd
in this process and 2 real worker processes on 127.0.0.1, identical seed, data
and hyper-parameters. Prints bytes the workers sent back, the ratio to float32,
and the final eval loss and its ratio to float32's. Then the codec alone:
encode + decode of a pseudo-gradient-like float32 array (normal values), as
seconds and GB/s of float32, with the ratio to int8Block measured alongside.

    python benchmarks/bench_compression.py [--rounds 8] [--inner-steps 20] [--codec-mb 64] [--smoke]

Ends with `ratio_eval_<last encoding>_vs_<first>=<x>`: the last encoding's final
eval loss over the first's (float32, `none`, by default).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import trio

from pcp_tui import protocol
from pcp_tui.app.launch import local_worker_command
from pcp_tui.config import RunConfig
from pcp_tui.testing import parse_with_smoke


async def one_run(compression: str, args: argparse.Namespace) -> dict:
    from pcp_tui.shepherd.coordinator import Shepherd
    from pcp_tui.training.build import build_workload

    config = RunConfig(
        workers=2,
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        seq_len=64,
        batch_size=8,
        compression=compression,
        host="127.0.0.1",
        port=0,
        token="bench",
        platforms=("cpu",),
        eval_batches=8,
        data_max_bytes=2**20,
        warmup_steps=10,
        inner_lr=2e-3,
    )
    shepherd = Shepherd(config, build_workload(config, shards=2))
    env = dict(
        os.environ, XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    )
    async with trio.open_nursery() as nursery:
        port = await nursery.start(shepherd.run)
        for i in range(2):
            command = local_worker_command(port, token="bench", extra=("--quiet", "--id", f"w{i}"))
            nursery.start_soon(lambda c=command: trio.run_process(c, env=env))
    history = shepherd.state.history
    return {
        "compression": compression,
        "received": sum(r.bytes_received for r in history),
        "eval": history[-1].eval_loss,
        "curve": [r.eval_loss for r in history],
    }


def codec_seconds(array: np.ndarray, quantization: str) -> tuple[float, int]:
    """Seconds to encode and decode `array` as one message; and the message's wire bytes."""
    start = time.perf_counter()
    buffers = protocol.encode(protocol.RoundResult(), {"d": array}, quantization=quantization)
    data = b"".join(bytes(buffer) for buffer in buffers)
    protocol.decode(data, protocol.Limits(max_tensor_bytes=2**34))
    return time.perf_counter() - start, len(data)


ENCODINGS = ("none", "bfloat16", "int8Block", "int4Block")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--codec-mb", type=int, default=64, help="float32 MB for the codec table")
    parser.add_argument("--encodings", nargs="+", default=ENCODINGS, choices=ENCODINGS)
    args = parse_with_smoke(
        parser, rounds=1, inner_steps=2, codec_mb=1, encodings=["none", "int8Block"]
    )
    rows = [trio.run(one_run, c, args) for c in args.encodings]
    base = rows[0]
    print(
        f"\npseudo-gradient compression  tiny GPT-2, 2 workers, {args.rounds} rounds x H={args.inner_steps}, seed 0"
    )
    print(
        f"{'encoding':<12}{'MB received':>13}{'vs ' + base['compression']:>14}{'final eval':>12}"
        f"{'delta':>10}{'eval ratio':>12}"
    )
    for r in rows:
        print(
            f"{r['compression']:<12}{r['received'] / 1e6:>13.2f}{r['received'] / base['received']:>14.3f}"
            f"{r['eval']:>12.4f}{r['eval'] - base['eval']:>+10.4f}{r['eval'] / base['eval']:>12.4f}"
        )
    for r in rows:
        print(r["compression"], " ".join(f"{x:.3f}" for x in r["curve"]))
    print_codec_table(args.codec_mb)
    last = rows[-1]
    print(
        f"ratio_eval_{last['compression']}_vs_{base['compression']}="
        f"{last['eval'] / base['eval']:.4f}"
    )


def print_codec_table(megabytes: int, repeats: int = 7) -> None:
    """Best of `repeats` per encoding, taken round-robin so that load drift hits all alike."""
    array = np.random.default_rng(0).standard_normal(megabytes * 2**20 // 4).astype(np.float32)
    best = dict.fromkeys(ENCODINGS, float("inf"))
    wire = {}
    for _ in range(repeats):
        for name in ENCODINGS:
            seconds, wire[name] = codec_seconds(array, name)
            best[name] = min(best[name], seconds)
    print(
        f"\ncodec alone: encode + decode {megabytes} MB of float32, best of {repeats}, one thread"
    )
    print(f"{'encoding':<12}{'seconds':>10}{'GB/s':>8}{'wire MB':>10}{'time vs int8Block':>19}")
    for name, seconds in best.items():
        print(
            f"{name:<12}{seconds:>10.3f}{array.nbytes / seconds / 1e9:>8.2f}{wire[name] / 1e6:>10.2f}"
            f"{seconds / best['int8Block']:>19.2f}"
        )


if __name__ == "__main__":
    main()
