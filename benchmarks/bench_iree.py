"""Tokens/s of one exported train_chunk run by IREE builds against the same step run by XLA.

Every runtime gets the same initial parameters and the same batches and runs them
the way a worker does: chunk after chunk, parameters and optimizer state staying
on the device, the chunk's losses read back each time. XLA runs the artifact
exported for its platform, IREE the StableHLO of the cpu export (as a worker
does). The first chunk (compile, warm-up) is not timed; the timed chunks
alternate between the runs and the median counts; the final losses are printed,
so a fast wrong run shows. The ratio column is tokens/s over the first row's
(XLA with the default export), measured in the same invocation; the last line,
`ratio_iree_vs_xla=<x>`, is the last row's (nan if that build did not run).

Several IREE builds in one invocation (one device session compiles and times
them all against one baseline): `--variant NAME=SPEC`, repeatable. SPEC is
space-separated: words starting with `--` are iree-compile flags, `lookup=onehot`,
`dtype=bfloat16` and `unroll=N` change the export (`--token-lookup`, `--compute-dtype`,
`build_graphs(scan_unroll=N)`);
an export change also adds an XLA row with that export, so its cost on XLA shows.
Each build compiles in a child process under `--compile-budget` seconds: one that
takes longer is reported as skipped and the others still run; after `--time-budget`
seconds no further build is compiled, so a run under a time limit still prints its table. Compiled modules
go to `--cache` (IREE's compile cache), so a second invocation skips compiling.

Besides wall-clock seconds a chunk, the table gives the process's CPU seconds a
chunk (all threads) and the load average before and after.

    python benchmarks/bench_iree.py                        # CPU: IREE llvm-cpu vs XLA-CPU
    python benchmarks/bench_iree.py --smoke                # the same, tiny sizes, one chunk
    python benchmarks/bench_iree.py --xla cuda --iree vulkan \\
        --variant 'ampere=--iree-vulkan-target=ampere' \\
        --variant 'onehot=lookup=onehot --iree-vulkan-target=ampere'
    python benchmarks/bench_iree.py --dump-modules /tmp/m --variant a=... # then:
    bash /tmp/m/a/benchmark.sh --dispatch_statistics        # time per dispatch
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from pcp_tui.backends import IreeBackend, select_backend
from pcp_tui.config import RunConfig
from pcp_tui.testing import parse_with_smoke
from pcp_tui.training.build import build_workload
from pcp_tui.training.export import InnerOptimizer, build_graphs
from pcp_tui.training.shards import sample_batches

EXPORT_KEYS = {"lookup": ("gather", "onehot"), "dtype": ("float32", "bfloat16"), "unroll": ("N",)}


@dataclass(frozen=True)
class Variant:
    """One IREE build: a name for the table, iree-compile flags, and the export it compiles."""

    name: str
    flags: tuple[str, ...]
    lookup: str = "gather"
    dtype: str = "float32"
    unroll: str = "1"

    @property
    def export(self) -> tuple[str, str, str]:
        return (self.lookup, self.dtype, self.unroll)


def parse_variant(text: str) -> Variant:
    """`NAME=SPEC` (see the module's docstring) as a Variant; ValueError says what is wrong."""
    name, sep, spec = text.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--variant {text!r}: write NAME=SPEC, e.g. 'onehot=lookup=onehot --f'")
    flags, export = [], {}
    for word in shlex.split(spec):
        if word.startswith("--"):
            flags.append(word)
            continue
        key, _, value = word.partition("=")
        if value not in EXPORT_KEYS.get(key, ()) and not (key == "unroll" and value.isdigit()):
            choices = ", ".join(f"{k}={'|'.join(v)}" for k, v in EXPORT_KEYS.items())
            raise ValueError(f"--variant {name}: {word!r} is neither a --flag nor {choices}")
        export[key] = value
    return Variant(name.strip(), tuple(flags), **export)


class Run:
    """One runtime's graphs, loaded, with parameters and optimizer state kept on its device."""

    def __init__(self, backend, graphs, workload, batches, compile_seconds=None):
        started = time.perf_counter()
        self.backend, self.batches = backend, batches
        self.train = backend.load("train_chunk", graphs.train_chunk, donate_argnums=(0, 1))
        init = backend.load("init_opt_state", graphs.init_opt_state)
        self.compile_seconds = compile_seconds or time.perf_counter() - started
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


def compile_in_child(args, variant: Variant, graphs, scratch: str, budget: float) -> float | str:
    """Compile `variant` into the cache in a child process: its seconds, or why it was skipped."""
    prefix = os.path.join(scratch, variant.name.replace("/", "_"))
    for entry in ("train_chunk", "init_opt_state"):
        with open(f"{prefix}.{entry}", "wb") as out:
            out.write(getattr(graphs, entry))
    command = [sys.executable, __file__, "--compile-only", prefix, "--iree", args.iree]
    command += ["--cache", args.cache, *(f"--iree-flag={flag}" for flag in variant.flags)]
    started = time.perf_counter()
    child = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},  # the child leaves the GPU to the runs
        start_new_session=True,  # its own process group: iree-compile runs under it
    )
    try:
        _, stderr = child.communicate(timeout=budget)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the child and the iree-compile it started
        child.communicate()
        return f"skipped: compile ran past its budget, {budget:.0f} s"
    if child.returncode != 0:
        lines = stderr.strip().splitlines() or ["?"]
        errors = [line for line in lines if "Error" in line or "error:" in line]
        return "failed: " + (errors or lines)[-1][:300]
    return time.perf_counter() - started


def compile_only(prefix: str, platform: str, cache: str, flags: list[str]) -> None:
    """The child's side of compile_in_child: compile both graphs into the cache."""
    backend = IreeBackend(platform, cache_dir=cache, flags=flags)
    for entry in ("train_chunk", "init_opt_state"):
        with open(f"{prefix}.{entry}", "rb") as graph:
            backend.compiled_module(entry, graph.read())


def export(args, workloads, export_key, platform):
    """The graphs of `export_key` (lookup, dtype, unroll) for `platform`."""
    workload = workloads(export_key)
    return build_graphs(
        workload.loss_fn,
        workload.params,
        workload.batch_spec,
        inner=InnerOptimizer(lr=1e-3),
        chunk_steps=args.chunk,
        eval_batches=1,
        platforms=(platform,),
        scan_unroll=int(export_key[2]),
    )


def dump_module(backend, graphs, workload, batches, folder: str, platform: str) -> None:
    """Write the IREE build's module, its inputs and the iree-benchmark-module command to run.

    The command times the module alone and breaks a call down by dispatch
    (`--dispatch_statistics`): where the device's time goes, kernel by kernel.
    """
    import jax

    folder = os.path.abspath(folder)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "train_chunk.vmfb"), "wb") as out:
        out.write(backend.compiled_module("train_chunk", graphs.train_chunk))
    params = [np.asarray(workload.params[n], np.float32) for n in graphs.param_names]
    init = backend.load("init_opt_state", graphs.init_opt_state)
    opt_state = backend.to_host(init.call(tuple(backend.to_device(params))))
    leaves = [*params, *opt_state, np.asarray(batches, np.int32), np.int32(0)]
    kept = jax.export.deserialize(bytearray(graphs.train_chunk)).module_kept_var_idx
    inputs = []
    for index in kept:
        path = os.path.join(folder, f"input{index}.npy")
        np.save(path, np.asarray(leaves[index]))
        inputs.append(f"--input=@{path}")
    device = {"vulkan": "vulkan", "cpu": "local-task"}.get(platform, platform)
    command = ["iree-benchmark-module", f"--device={device}", "--function=main"]
    command += [f"--module={os.path.join(folder, 'train_chunk.vmfb')}", *inputs]
    with open(os.path.join(folder, "benchmark.sh"), "w") as out:
        out.write(shlex.join(command) + ' "$@"\n')
    print(f"module and inputs in {folder}: bash {folder}/benchmark.sh --dispatch_statistics")


def print_table(runs: dict[str, Run | str], tokens: int) -> None:
    """The table of every run, then the last timed run's ratio line."""
    print(
        f"{'runtime':<58} {'compile s':>9} {'s/chunk':>9} {'cpu s':>7} {'tokens/s':>10} "
        f"{'ratio':>6} loss"
    )
    baseline = None
    for label, run in runs.items():
        if isinstance(run, str):
            print(f"{label:<58} {run}")
            continue
        seconds = float(np.median(run.seconds))
        rate = tokens / seconds
        baseline = baseline or rate
        print(
            f"{label:<58} {run.compile_seconds:>9.1f} {seconds:>9.4f} "
            f"{float(np.median(run.cpu_seconds)):>7.3f} {rate:>10,.0f} "
            f"{rate / baseline:>6.3f} {run.loss:.6f}"
        )
    last = list(runs.values())[-1]  # an IREE build: nan when it was skipped or failed
    print(f"ratio_iree_vs_xla={rate / baseline if isinstance(last, Run) else math.nan:.3f}")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="GPT-2 preset (default: tiny)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=5, help="inner steps per call (default: 5)")
    parser.add_argument("--chunks", type=int, default=5, help="timed calls (default: 5)")
    parser.add_argument("--xla", default="cpu", help="XLA backend, the baseline (default: cpu)")
    parser.add_argument("--iree", default="cpu", help="IREE backend (default: cpu)")
    parser.add_argument(
        "--iree-flag",
        action="append",
        default=[],
        help="iree-compile flag of the one build when no --variant is given (repeatable)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        type=parse_variant,
        metavar="NAME=SPEC",
        help="an IREE build to time (repeatable): NAME=flags and export options, e.g. "
        "'onehot=lookup=onehot --iree-vulkan-target=ampere'",
    )
    parser.add_argument(
        "--compile-budget",
        type=float,
        default=300.0,
        help="seconds one build may take to compile before it is skipped (default: 300)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=math.inf,
        help="seconds from the start after which no further build is compiled: those left are "
        "reported as skipped and the rest timed, so a run inside a time limit prints its table",
    )
    parser.add_argument("--cache", default=None, help="IREE compile cache (default: a temp dir)")
    parser.add_argument(
        "--dump-modules",
        default=None,
        metavar="DIR",
        help="write each build's module and inputs to DIR/NAME for iree-benchmark-module",
    )
    parser.add_argument("--compile-only", default=None, help=argparse.SUPPRESS)
    return parse_with_smoke(parser, batch_size=2, seq_len=16, chunk=1, chunks=1)


DEFAULT_EXPORT = ("gather", "float32", "1")


class Workloads:
    """GPT-2 workloads (parameters, data) per export (lookup, dtype), built once each."""

    def __init__(self, args: argparse.Namespace):
        self._args, self._built = args, {}

    def __call__(self, export_key: tuple[str, str, str]):
        args, (lookup, dtype, _) = self._args, export_key
        if (lookup, dtype) not in self._built:
            config = RunConfig(
                model=args.model, batch_size=args.batch_size, seq_len=args.seq_len,
                data_max_bytes=2_000_000, eval_batches=1, platforms=("cpu",),
                token_lookup=lookup, compute_dtype=dtype,
            )  # fmt: skip
            self._built[lookup, dtype] = build_workload(config, shards=1)
        return self._built[lookup, dtype]


def load_iree(args, variant: Variant, workloads, batches, scratch: str, left: float) -> Run | str:
    """Compile `variant` (in a child, under its budget), load it and warm it up; or why not."""
    graphs = export(args, workloads, variant.export, "cpu")
    compiled = (
        compile_in_child(args, variant, graphs, scratch, min(args.compile_budget, left))
        if left > 0
        else f"skipped: --time-budget {args.time_budget:.0f} s spent"
    )
    print(f"{variant.name}: {compiled if isinstance(compiled, str) else f'{compiled:.1f} s'}")
    if isinstance(compiled, str):
        return compiled
    backend = IreeBackend(args.iree, cache_dir=args.cache, flags=variant.flags)
    run = Run(backend, graphs, workloads(variant.export), batches, compiled)
    if args.dump_modules:
        folder = os.path.join(args.dump_modules, variant.name or "iree")
        dump_module(backend, graphs, workloads(variant.export), batches, folder, args.iree)
    return run


def measure(args, scratch: str, started: float) -> None:
    """Load every run (XLA per export, then each IREE build), time them alternately, print."""
    variants = args.variant or [Variant("", tuple(args.iree_flag))]
    args.cache = args.cache or os.path.join(scratch, "cache")
    workloads = Workloads(args)
    batches = sample_batches(
        workloads(DEFAULT_EXPORT).shards[0], steps=args.chunk, batch_size=args.batch_size,
        seq_len=args.seq_len, seed=0, stream=(0,),
    )  # fmt: skip
    print(
        f"GPT-2 {args.model}, batch {args.batch_size}x{args.seq_len}, {args.chunk} steps a call, "
        f"XLA {args.xla} against IREE {args.iree}"
    )
    runs: dict[str, Run | str] = {}
    for key in dict.fromkeys([DEFAULT_EXPORT, *(v.export for v in variants)]):
        label = f"XLA {args.xla}" + ("" if key == DEFAULT_EXPORT else f" {'/'.join(key)}")
        graphs = export(args, workloads, key, args.xla)
        runs[label] = Run(
            select_backend(args.xla, 1, runtime="xla"), graphs, workloads(key), batches
        )
    for variant in variants:
        label = f"IREE {args.iree} {variant.name or ' '.join(variant.flags)}"
        if variant.export != DEFAULT_EXPORT:
            label += f" [{'/'.join(variant.export)}]"
        left = args.time_budget - (time.perf_counter() - started)
        runs[label] = load_iree(args, variant, workloads, batches, scratch, left)
    timed = [run for run in runs.values() if isinstance(run, Run)]
    load_before = os.getloadavg()[0]
    for _ in range(args.chunks):  # alternate, so that load from other work hits all alike
        for run in timed:
            run.chunk()
    print(f"load average {load_before:.1f} before the timed chunks, {os.getloadavg()[0]:.1f} after")
    print_table(runs, args.chunk * args.batch_size * args.seq_len)


def main() -> None:
    started = time.perf_counter()
    args = arguments()
    if args.compile_only:
        return compile_only(args.compile_only, args.iree, args.cache, args.iree_flag)
    with tempfile.TemporaryDirectory(prefix="bench-iree-") as scratch:
        measure(args, scratch, started)


if __name__ == "__main__":
    main()
