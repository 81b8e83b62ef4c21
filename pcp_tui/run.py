"""Process-level entry points: wire config, task, shepherd, workers and views."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import trio

from backends import BackendUnavailable

from .auth import new_token
from .checkpoint import CheckpointError
from .config import RunConfig
from .data import DataError
from .headless import HeadlessPrinter, MetricsWriter
from .shepherd import RunFailed, Shepherd


def _fail(reason: str) -> int:
    print(f"pcp-tui: error: {reason}", file=sys.stderr, flush=True)
    return 1


def prepare(config: RunConfig, shards: int) -> tuple[Shepherd, MetricsWriter | None]:
    """Build the task and the shepherd, attach headless printer and metrics."""
    from .task import build_task

    if not config.token:
        config = config.replace(token=new_token())
    print(f"loading data and model ({config.model})...", flush=True)
    task = build_task(config, shards=shards)
    print(
        f"{task.data_summary}; model {task.name}: {task.param_count:,} parameters",
        flush=True,
    )
    shepherd = Shepherd(config, task)
    metrics = MetricsWriter(config.metrics, shepherd.state) if config.metrics else None
    if metrics:
        shepherd.state.subscribe(metrics)
    return shepherd, metrics


def run_shepherd(config: RunConfig, *, headless: bool) -> int:
    try:
        shepherd, metrics = prepare(config, shards=config.workers)
    except (DataError, CheckpointError, OSError, ValueError) as exc:
        return _fail(str(exc))
    if not headless:
        launched = _launch_dashboard(shepherd)
        if launched is not None:
            return launched
    shepherd.state.subscribe(HeadlessPrinter(shepherd.state))
    try:
        trio.run(shepherd.run)
    except RunFailed as exc:
        return _fail(str(exc))
    finally:
        if metrics:
            metrics.close()
    return 0


def _launch_dashboard(shepherd: Shepherd, spawn_workers=None) -> int | None:
    """Run inside the Textual dashboard; None to fall back to headless (no terminal)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("not a terminal: running headless (pass --headless to say so)", flush=True)
        return None
    try:
        from .dashboard import run_dashboard
    except ImportError:
        print("the dashboard is not available in this build; running headless", flush=True)
        return None
    return run_dashboard(shepherd, spawn_workers=spawn_workers)


def run_demo(config: RunConfig, *, headless: bool, backend: str = "cpu") -> int:
    """A shepherd and `config.workers` local worker processes on this machine."""
    try:
        shepherd, metrics = prepare(config, shards=config.workers)
    except (DataError, CheckpointError, OSError, ValueError) as exc:
        return _fail(str(exc))

    async def spawn(nursery: trio.Nursery, port: int) -> list[trio.Process]:
        return [
            await nursery.start(_worker_process, shepherd, port, backend, i)
            for i in range(config.workers)
        ]

    if not headless:
        launched = _launch_dashboard(shepherd, spawn_workers=spawn)
        if launched is not None:
            return launched
    shepherd.state.subscribe(HeadlessPrinter(shepherd.state))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(shepherd.run)
            await spawn(nursery, port)

    try:
        trio.run(main)
    except RunFailed as exc:
        return _fail(str(exc))
    finally:
        if metrics:
            metrics.close()
    return 0


async def _worker_process(
    shepherd: Shepherd, port: int, backend: str, index: int, *, task_status
) -> None:
    """One local worker process; if it dies before the run ends, the run fails."""
    command = [
        sys.executable,
        "-m",
        "pcp_tui",
        "worker",
        "--connect",
        f"127.0.0.1:{port}",
        "--backend",
        backend,
        "--id",
        f"local-{index}",
        "--quiet",
        *(shepherd.tls.worker_flags() if shepherd.tls else []),
    ]
    env = dict(os.environ, PCP_TOKEN=shepherd.token, **_cpu_threads_env(shepherd.config.workers))
    async with trio.open_nursery() as nursery:
        process = await nursery.start(
            lambda **kw: trio.run_process(command, env=env, check=False, **kw)
        )
        task_status.started(process)
    if process.returncode != 0 and shepherd.state.status not in ("done", "stopped", "failed"):
        shepherd.abort(f"local worker {index} exited with code {process.returncode}")


def _cpu_threads_env(workers: int) -> dict[str, str]:
    """Give each local CPU worker its share of the cores instead of all of them."""
    share = max(1, (os.cpu_count() or 1) // max(workers, 1))
    return (
        {
            "XLA_FLAGS": f"--xla_cpu_multi_thread_eigen={'true' if share > 1 else 'false'} "
            f"intra_op_parallelism_threads={share}"
        }
        if "XLA_FLAGS" not in os.environ
        else {}
    )


def run_worker(args: argparse.Namespace) -> int:
    from .tls import ClientTLS
    from .worker import ConnectionLost, Refused, Worker
    from .worker_view import WorkerStatusView

    token = args.token or os.environ.get("PCP_TOKEN")
    if not token:
        return _fail(
            "no join token: pass --token (the shepherd prints it in its join command) or set PCP_TOKEN"
        )
    host, _, port_text = args.connect.rpartition(":")
    if not host or not port_text.isdigit():
        return _fail(f"--connect wants HOST:PORT, got {args.connect!r}")
    if args.compile_cache:
        from backends import enable_compilation_cache

        try:
            enable_compilation_cache(args.compile_cache)
        except OSError as exc:
            print(
                f"pcp-tui: warning: no compile cache at {args.compile_cache} ({exc.strerror})",
                file=sys.stderr,
            )
    try:
        tls = ClientTLS.from_options(args.tls_ca, args.tls_fingerprint)
        worker = Worker(
            host,
            int(port_text),
            token=token,
            backend=args.backend,
            worker_id=args.worker_id,
            reconnect=not args.no_reconnect,
            tls=tls,
        )
    except (BackendUnavailable, ValueError) as exc:
        return _fail(str(exc))
    view = contextlib.nullcontext() if args.quiet else WorkerStatusView(worker.status)
    try:
        with view:
            trio.run(worker.run)
    except Refused as exc:
        return _fail(f"{exc} (not retrying)")
    except ConnectionLost as exc:
        return _fail(str(exc))
    return 0
