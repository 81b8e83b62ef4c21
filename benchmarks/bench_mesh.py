"""One worker over N local devices vs N one-device workers: tokens/s and bytes per round.

Both sides run the worker's own code path on the same exported GPT-2
`train_chunk` and the same per-device batch b:

- one N-device worker: `JaxBackend(platform, N)` with the graph the shepherd
  exports for an N-device worker (batch N*b, --sharding data or fsdp): each
  device runs its b rows inside `shard_map`, gradients reduced explicitly;
- N one-device workers: `JaxBackend(platform, 1)` with the graph for batch b;
  N of them would train N times its tokens/s (one per device, nothing shared).

    python benchmarks/bench_mesh.py --backend cuda --devices 4 --model gpt2 \\
        --compute-dtype bfloat16 --seq-len 1024 --batch-per-device 16 --chunk-steps 20

Prints a table, `ratio_mesh_vs_separate=<x>` (tokens/s of the mesh worker
over N x one one-device worker: the issue's goal is >= 0.9 at N = 2 and 4 on
GPUs) and `ratio_bytes_separate_vs_mesh=<x>` (the bytes a round moves between
shepherd and workers: parameters down, pseudo-gradients up, as encoded on the
wire; N separate workers move N times a mesh worker's).

On CPU (the default, with N forced host devices) the devices share the same
cores, so the speed ratio says nothing about scaling: it checks the path runs.
Run it on a host with several GPUs for the real number.

`--graphs DIR` keeps the exported graphs in DIR and reuses them: export them on
one machine (`--export-only`, e.g. a CPU with another JAX version) and time
them on another, as a shepherd and its workers do. `--smoke`: 2 CPU devices,
tiny sizes, seconds.
"""

from __future__ import annotations

import argparse
import os
import time

from pcp_tui.testing import parse_with_smoke


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "rocm"])
    parser.add_argument("--devices", type=int, default=0, help="N (default: 4 on cpu, all else)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--data", default=None, help="token file (default: embedded corpus)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-per-device", type=int, default=4)
    parser.add_argument("--chunk-steps", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=4, help="timed chunks per side")
    parser.add_argument("--sharding", default="fsdp", choices=["data", "fsdp"])
    parser.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--attention", default="xla", choices=["xla", "cudnn"])
    parser.add_argument(
        "--exchange-dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="what an N-device worker gathers and reduces in (default: the compute dtype, "
        "as the shepherd exports it)",
    )
    parser.add_argument("--graphs", default=None, help="folder to keep and reuse exports in")
    parser.add_argument("--export-only", action="store_true", help="fill --graphs, time nothing")
    return parse_with_smoke(
        parser, devices=2, seq_len=16, batch_per_device=1, chunk_steps=1, chunks=1
    )


def main() -> None:
    args = _arguments()
    flags = os.environ.get("XLA_FLAGS", "")
    if args.backend == "cpu" and "xla_force_host_platform_device_count" not in flags:
        count = f"--xla_force_host_platform_device_count={args.devices or 4}"
        # before JAX starts, and first: placed after the bare `intra_op_parallelism_threads=1`
        # of pcp_tui.testing.worker_env's XLA_FLAGS, XLA did not take it (one cpu device)
        os.environ["XLA_FLAGS"] = f"{count} {flags}".strip()
    import jax

    from pcp_tui.backends import JaxBackend

    devices = args.devices or JaxBackend(args.backend).info.device_count
    model = _Model(args, devices)
    if args.export_only:
        for count in (1, devices):
            model.graphs(count)
        return
    one = model.tokens_per_second(JaxBackend(args.backend, 1), args.batch_per_device)
    mesh = model.tokens_per_second(
        JaxBackend(args.backend, devices), args.batch_per_device * devices
    )
    separate = devices * one
    round_bytes = model.round_bytes()
    print(f"jax {jax.__version__}, {devices} x {jax.devices(args.backend)[0].device_kind}")
    print(
        f"model {args.model}, {model.param_count:,} parameters, seq {args.seq_len}, "
        f"batch {args.batch_per_device} per device, {args.chunk_steps} steps per chunk, "
        f"sharding {args.sharding}, {args.compute_dtype}"
    )
    print(f"{'worker(s)':<34}{'tokens/s':>14}{'bytes per round':>18}")
    print(f"{f'one worker on {devices} devices':<34}{mesh:>14,.0f}{round_bytes:>18,}")
    print(f"{f'{devices} x one 1-device worker':<34}{separate:>14,.0f}{devices * round_bytes:>18,}")
    print(f"{'(one 1-device worker)':<34}{one:>14,.0f}{round_bytes:>18,}")
    print(f"ratio_mesh_vs_separate={mesh / separate:.3f}")
    print(f"ratio_bytes_separate_vs_mesh={devices * round_bytes / round_bytes:.1f}")
    if args.backend == "cpu":
        print("note: forced CPU devices share the same cores; the speed ratio is not scaling")


class _Model:
    """The run's model, exported per global batch size, and its batches."""

    def __init__(self, args: argparse.Namespace, devices: int):
        from pcp_tui.config import RunConfig
        from pcp_tui.training.build import build_workload

        self.args, self.devices = args, devices
        self.config = RunConfig(
            model=args.model,
            data=args.data,
            seq_len=args.seq_len,
            batch_size=args.batch_per_device,
            compute_dtype=args.compute_dtype,
            attention=args.attention,
            sharding_mode=args.sharding,
        )
        self.workload = build_workload(self.config, shards=1)
        self.exchange_dtype = args.exchange_dtype or self.workload.compute_dtype
        self.param_count = self.workload.param_count

    def graphs(self, devices: int):
        """The graphs the shepherd exports for a worker on `devices` devices (global batch)."""
        import json

        import jax
        import jax.numpy as jnp

        from pcp_tui.backends import CUDNN_ATTENTION_CALLS
        from pcp_tui.training.export import InnerOptimizer, TrainingGraphs, build_graphs

        args = self.args
        batch = args.batch_per_device * devices
        name = (
            f"{args.model}-{args.backend}-{args.attention}-{args.compute_dtype}-"
            f"{batch}x{args.seq_len}-k{args.chunk_steps}-{devices}dev-{args.sharding}-"
            f"{self.exchange_dtype}"
        )
        path = os.path.join(args.graphs, name) if args.graphs else None
        if path and os.path.exists(path):
            with open(path, "rb") as file:  # a header line, then the two graphs' bytes
                header = json.loads(file.readline())
                train = file.read(header["train_chunk"])
                graphs = TrainingGraphs(
                    tuple(header["names"]), train, file.read(), b"", (args.backend,), 0
                )
            print(f"graphs for {devices} device(s) read from {path}")
            return graphs
        graphs = build_graphs(
            self.workload.loss_fn,
            self.workload.params,
            jax.ShapeDtypeStruct((batch, args.seq_len + 1), jnp.int32),
            inner=InnerOptimizer(),
            chunk_steps=args.chunk_steps,
            eval_batches=1,
            platforms=(args.backend,),
            custom_calls=CUDNN_ATTENTION_CALLS if args.attention == "cudnn" else (),
            devices=devices,
            sharding=self.config.sharding.to_wire(),
            exchange_dtype=self.exchange_dtype,
        )
        print(f"graphs for {devices} device(s) exported on jax {jax.__version__}")
        if path:
            os.makedirs(args.graphs, exist_ok=True)
            with open(path, "wb") as file:
                header = {"names": graphs.param_names, "train_chunk": len(graphs.train_chunk)}
                file.write(json.dumps(header).encode() + b"\n")
                file.write(graphs.train_chunk + graphs.init_opt_state)
        return graphs

    def tokens_per_second(self, backend, batch: int) -> float:
        """The worker's chunks on `backend` with global batch `batch`, timed after one warm-up."""
        from pcp_tui.training.shards import sample_batches
        from pcp_tui.worker.rounds import run_chunk

        graphs = self.graphs(backend.info.device_count)
        train = backend.load("train_chunk", graphs.train_chunk, donate_argnums=(0, 1))
        init = backend.load("init_opt_state", graphs.init_opt_state)
        host = [self.workload.params[n] for n in graphs.param_names]
        axes = train.input_axes[: len(host)] if train.input_axes else None
        params = backend.to_device(host, axes) if axes else backend.to_device(host)
        state = init.call(tuple(params))
        chunks = [
            sample_batches(
                self.workload.shards[0],
                steps=self.args.chunk_steps,
                batch_size=batch,
                seq_len=self.args.seq_len,
                seed=0,
                stream=(0, 0, c),
            )
            for c in range(2)
        ]
        params, state, _ = run_chunk(train.call, params, state, chunks[0], 0)  # warm-up
        started = time.perf_counter()
        for c in range(self.args.chunks):
            params, state, _ = run_chunk(train.call, params, state, chunks[c % 2], c)
        seconds = time.perf_counter() - started
        steps = self.args.chunks * self.args.chunk_steps
        return steps * batch * self.args.seq_len / seconds

    def round_bytes(self) -> int:
        """Bytes of one round on the wire for one worker: parameters down, pseudo-gradient up."""
        from pcp_tui import protocol

        params = self.workload.params
        down = protocol.encode(protocol.RoundStart(round=1, inner_steps=1), params)
        up = protocol.encode(protocol.RoundResult(round=1, inner_steps=1, losses=(1.0,)), params)
        return sum(len(memoryview(buffer).cast("B")) for buffer in (*down, *up))


if __name__ == "__main__":
    main()
