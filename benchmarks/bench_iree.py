"""Tokens/s of one exported train_chunk run by IREE against the same step run by XLA.

Both runtimes get the same artifact bytes (GPT-2 exported with `jax.export` for
the XLA platform and for cpu, the StableHLO IREE compiles), the same initial
parameters and the same batches, and run them the way a worker does: chunk after
chunk, parameters and optimizer state staying on the device, the chunk's losses
read back each time. The first chunk (compile, warm-up) is not timed; the timed
chunks alternate between the runtimes and the median counts; the final losses of
both runs are printed (equal steps, equal data), so a fast wrong run shows.

Besides wall-clock seconds a chunk, the table gives the process's CPU seconds a
chunk (all threads): the work each runtime does, which load from other programs
changes little, while wall-clock time also shows how a runtime's threads fare
when they must share the cores. The load average is printed before and after.

    python benchmarks/bench_iree.py                        # CPU: IREE llvm-cpu vs XLA-CPU
    python benchmarks/bench_iree.py --xla cuda --iree vulkan --iree-flag=--iree-vulkan-target=ampere
    IREE_PY_RUNTIME_FLAGS=--task_topology_mode=physical_cores python benchmarks/bench_iree.py
        # IREE's own CPU threading (workers pinned to cores), which the backend replaces
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pcp_tui.backends import IreeBackend, select_backend  # noqa: E402
from pcp_tui.config import RunConfig  # noqa: E402
from pcp_tui.training.build import build_workload  # noqa: E402
from pcp_tui.training.export import InnerOptimizer, build_graphs  # noqa: E402
from pcp_tui.training.shards import sample_batches  # noqa: E402


class Run:
    """One runtime's graphs, loaded, with parameters and optimizer state kept on its device."""

    def __init__(self, backend, graphs, workload, batches):
        started = time.perf_counter()
        self.backend, self.batches = backend, batches
        self.train = backend.load("train_chunk", graphs.train_chunk, donate_argnums=(0, 1))
        init = backend.load("init_opt_state", graphs.init_opt_state)
        self.compile_seconds = time.perf_counter() - started
        self.params = tuple(backend.to_device([workload.params[n] for n in graphs.param_names]))
        self.opt_state = init.call(self.params)
        self.step, self.loss, self.seconds, self.cpu_seconds = 0, float("nan"), [], []
        self.chunk()  # warm-up: not timed
        self.seconds, self.cpu_seconds = [], []

    def chunk(self) -> None:
        """Time one call, its losses read back (waiting for the device, as a worker does)."""
        started, cpu = time.perf_counter(), time.process_time()
        self.params, self.opt_state, losses = self.train.call(
            self.params, self.opt_state, self.batches, np.int32(self.step)
        )
        self.loss = float(np.asarray(self.backend.to_host([losses])[0])[-1])
        self.step += 1
        self.seconds.append(time.perf_counter() - started)
        self.cpu_seconds.append(time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="GPT-2 preset (default: tiny)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=5, help="inner steps per call (default: 5)")
    parser.add_argument("--chunks", type=int, default=5, help="timed calls (default: 5)")
    parser.add_argument("--xla", default="cpu", help="XLA backend, the baseline (default: cpu)")
    parser.add_argument("--iree", default="cpu", help="IREE backend (default: cpu)")
    parser.add_argument(
        "--iree-flag", action="append", default=[], help="extra iree-compile flag (repeatable)"
    )
    args = parser.parse_args()
    config = RunConfig(
        model=args.model,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        data_max_bytes=2_000_000,
        eval_batches=1,
        platforms=("cpu",),
    )
    workload = build_workload(config, shards=1)
    platforms = tuple(dict.fromkeys(("cpu", args.xla)))  # cpu: the lowering IREE compiles
    graphs = {
        p: build_graphs(
            workload.loss_fn,
            workload.params,
            workload.batch_spec,
            inner=InnerOptimizer(lr=1e-3),
            chunk_steps=args.chunk,
            eval_batches=1,
            platforms=(p,),
        )
        for p in platforms
    }
    batches = sample_batches(
        workload.shards[0],
        steps=args.chunk,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=0,
        stream=(0,),
    )
    tokens = args.chunk * args.batch_size * args.seq_len
    runs = {
        f"XLA {args.xla}": (select_backend(args.xla, 1, runtime="xla"), graphs[args.xla]),
        f"IREE {args.iree} {' '.join(args.iree_flag)}".strip(): (
            IreeBackend(args.iree, flags=args.iree_flag),
            graphs["cpu"],
        ),
    }
    print(f"GPT-2 {args.model}, batch {args.batch_size}x{args.seq_len}, {args.chunk} steps a call")
    loaded = {
        label: Run(backend, graph, workload, batches) for label, (backend, graph) in runs.items()
    }
    load_before = os.getloadavg()[0]
    for _ in range(args.chunks):  # alternate, so that load from other work hits both alike
        for run in loaded.values():
            run.chunk()
    print(f"load average {load_before:.1f} before the timed chunks, {os.getloadavg()[0]:.1f} after")
    print(
        f"{'runtime':<44} {'compile s':>9} {'s/chunk':>9} {'cpu s':>7} {'tokens/s':>10} "
        f"{'ratio':>6} loss"
    )
    baseline = None
    for label, run in loaded.items():
        seconds = float(np.median(run.seconds))
        rate = tokens / seconds
        baseline = baseline or rate
        print(
            f"{label:<44} {run.compile_seconds:>9.1f} {seconds:>9.4f} "
            f"{float(np.median(run.cpu_seconds)):>7.3f} {rate:>10,.0f} "
            f"{rate / baseline:>6.2f} {run.loss:.6f}"
        )


if __name__ == "__main__":
    main()
