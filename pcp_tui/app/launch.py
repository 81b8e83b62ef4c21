"""Process-level entry points: wire config, workload, shepherd, workers and views."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, NoReturn

import trio

from pcp_tui.app.signals import SignalStop
from pcp_tui.backends import BackendUnavailable
from pcp_tui.config import ConfigError, RunConfig, WorkerConfig
from pcp_tui.config.relay import RelayConfig
from pcp_tui.contract.auth import new_token

if TYPE_CHECKING:  # each side loads its own on demand: a worker imports no shepherd
    from pcp_tui.app.headless import MetricsWriter
    from pcp_tui.shepherd.coordinator import Shepherd
    from pcp_tui.worker.client import Worker
    from pcp_tui.worker.rounds import Faults
    from pcp_tui.worker.site import Site


def _fail(reason: str, code: int = 1) -> int:
    print(f"pcp-tui: error: {reason}", file=sys.stderr, flush=True)
    return code


def prepare(config: RunConfig, shards: int) -> tuple[Shepherd, MetricsWriter | None]:
    """Build the workload and the shepherd, attach headless printer and metrics."""
    from pcp_tui.app.headless import MetricsWriter
    from pcp_tui.app.tracking import open_sinks
    from pcp_tui.shepherd.coordinator import Shepherd
    from pcp_tui.shepherd.run.checkpoint import CheckpointError, keep_token
    from pcp_tui.shepherd.serving.listening import open_files_for
    from pcp_tui.training.build import build_workload

    token = config.security.token or new_token()
    config = config.replace(token=token)
    if config.checkpoints.dir:  # `--resume` reads it back, so waiting workers get in again
        try:
            keep_token(config.checkpoints.dir, token)
        except CheckpointError as exc:
            print(f"pcp-tui: warning: {exc}", file=sys.stderr, flush=True)
    files = open_files_for(config.worker_connections, config.network.streams)
    if files:
        print(f"pcp-tui: warning: {files}", file=sys.stderr, flush=True)
    print(f"loading data and model ({config.model.name})...", flush=True)
    workload = build_workload(config, shards=shards)
    print(
        f"{workload.data_summary}; model {workload.name}: {workload.param_count:,} parameters",
        flush=True,
    )
    shepherd = Shepherd(config, workload)  # a resumed checkpoint is checked against workload here
    sinks = open_sinks(
        wandb_project=config.operator.wandb,
        tensorboard_dir=config.operator.tensorboard,
        run_id=shepherd.state.run_id,
        settings=shepherd.state.settings,
    )
    metrics = (
        MetricsWriter(
            config.operator.metrics, shepherd.state, token=config.security.token, sinks=sinks
        )
        if config.operator.metrics or sinks
        else None
    )
    if metrics:
        shepherd.state.subscribe(metrics)
    return shepherd, metrics


def _start(config: RunConfig) -> tuple[Shepherd, MetricsWriter | None] | int:
    """Preflight and prepare; an exit code (after a one-line reason) if that fails."""
    from pcp_tui.app.preflight import preflight  # the operator API's: hypercorn, not for workers
    from pcp_tui.shepherd.coordinator import RunFailed
    from pcp_tui.shepherd.run.checkpoint import CheckpointError, CheckpointRefused
    from pcp_tui.training.corpus import DataError, MissingData
    from pcp_tui.training.model_file import ModelFileError

    try:
        preflight(config)
        return prepare(config, shards=config.network.workers)
    except (
        ConfigError,
        MissingData,
        CheckpointRefused,
    ) as exc:  # an option that cannot work: exit 2
        return _fail(str(exc), 2)
    except (DataError, CheckpointError, RunFailed, ModelFileError, OSError, ValueError) as exc:
        return _fail(str(exc))


def run_shepherd(config: RunConfig, *, headless: bool) -> int:
    started = _start(config)
    if isinstance(started, int):
        return started
    shepherd, metrics = started
    if not headless:
        launched = _launch_dashboard(shepherd, metrics=metrics)
        if launched is not None:
            return launched
    from pcp_tui.app.api import run_with_api  # hypercorn: only a shepherd serves the API
    from pcp_tui.app.headless import HeadlessPrinter

    shepherd.state.subscribe(HeadlessPrinter(shepherd.state))
    return _run_headless(shepherd, metrics, partial(run_with_api, shepherd))


def _run_headless(
    shepherd: Shepherd, metrics: MetricsWriter | None, body: Callable[[], Awaitable[object]]
) -> int:
    """Run `body` under trio with signal handling; 0, 1 (RunFailed) or 128 + signal.

    A model file's loss first runs when the shepherd exports the graph, inside
    the run: its ModelFileError ends the run like a RunFailed, in one line.
    """
    from pcp_tui.app.headless import clean_stop_plan
    from pcp_tui.shepherd.coordinator import RunFailed
    from pcp_tui.training.model_file import ModelFileError

    checkpoints = bool(shepherd.config.checkpoints.dir)
    stop = SignalStop(
        shepherd.request_stop,
        plan=lambda: clean_stop_plan(shepherd.state, checkpoints),
        now=shepherd.stop_now,
        cancel=shepherd.cancel,
    )
    try:
        failure = _run_with_signals(stop, body, (RunFailed, ModelFileError))
    finally:
        if metrics:
            metrics.close()
    if failure is not None:
        return _fail(str(failure))
    return stop.exit_code or 0


def _run_with_signals(
    stop: SignalStop,
    body: Callable[[], Awaitable[object]],
    expected: type[BaseException] | tuple[type[BaseException], ...],
) -> BaseException | None:
    """trio.run(body) beside `stop`'s signal watcher; the `expected` error it ended with, if any.

    Nurseries wrap errors in groups: a group of only `expected` errors is
    unwrapped, anything else (a bug) propagates with its traceback.
    """

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(stop.watch, nursery.cancel_scope)
            await body()
            nursery.cancel_scope.cancel()

    return run_unwrapped(main, expected)


def run_unwrapped(
    main: Callable[[], Awaitable[object]],
    expected: type[BaseException] | tuple[type[BaseException], ...],
) -> BaseException | None:
    """`trio.run(main)`; the `expected` error it ended with, if any, out of its groups.

    Nurseries wrap errors in groups: a group of only `expected` errors is
    unwrapped to its first, anything else (a bug) propagates with its traceback.
    """
    try:
        trio.run(main)
    except BaseExceptionGroup as group:
        matched, rest = group.split(expected)
        if matched is None or rest is not None:
            raise
        first: BaseException = matched
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        return first
    finally:
        settle_threads()
    return None


# seconds to wait for trio's cached threads to come back from their last job; far more than
# dropping a job's objects takes, and bounded: the process exits either way
SETTLE_SECONDS = 10.0


def settle_threads() -> None:
    """Wait until every thread of trio's thread cache is back from its last job.

    Blocking JAX work runs on trio's cached threads, which are daemon threads. A
    thread hands its job's result back, then drops its own reference to it; when
    that was the last one, the arrays are freed on that thread, in jaxlib's C++,
    which may let go of the GIL. If the interpreter is finalizing by the time it
    wants the GIL back, CPython before 3.14 ends the thread with pthread_exit,
    whose unwinding through a C++ destructor aborts the process (CPython
    gh-87135): a worker that had finished its run exited with SIGABRT (-6).

    One job a thread, all held at a barrier until each has a thread of its own:
    trio gives a new job to an idle thread first, and a thread that is still
    finishing its last job takes the new one only once that is done.
    """
    count = sum(1 for t in threading.enumerate() if t.daemon and t.name.startswith("Trio thread"))
    if not count:
        return
    barrier = threading.Barrier(count, timeout=SETTLE_SECONDS)

    def wait() -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait()

    async def settle() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(trio.to_thread.run_sync, wait)

    trio.run(settle)


def _launch_dashboard(
    shepherd: Shepherd, spawn_workers=None, *, metrics: MetricsWriter | None = None
) -> int | None:
    """Run inside the Textual dashboard; None to fall back to headless (no terminal)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("not a terminal: running headless (pass --headless to say so)", flush=True)
        return None
    try:
        from pcp_tui.app.dashboard import run_dashboard
    except ImportError:
        print("the dashboard is not available in this build; running headless", flush=True)
        return None
    try:
        return run_dashboard(shepherd, spawn_workers=spawn_workers)
    finally:
        if metrics:
            metrics.close()  # a W&B run is marked finished, TensorBoard's last events written


def run_demo(config: RunConfig, *, headless: bool, backend: str = "cpu") -> int:
    """A shepherd and `config.network.workers` local worker processes on this machine."""
    started = _start(config)
    if isinstance(started, int):
        return started
    shepherd, metrics = started

    async def spawn(nursery: trio.Nursery, port: int) -> list[trio.Process]:
        return [
            await nursery.start(_worker_process, shepherd, port, backend, i)
            for i in range(config.network.workers)
        ]

    if not headless:
        launched = _launch_dashboard(shepherd, spawn_workers=spawn, metrics=metrics)
        if launched is not None:
            return launched
    from pcp_tui.app.headless import HeadlessPrinter
    from pcp_tui.app.local_run import run_with_local_workers  # the operator API's: hypercorn

    shepherd.state.subscribe(HeadlessPrinter(shepherd.state))
    return _run_headless(shepherd, metrics, partial(run_with_local_workers, shepherd, spawn))


# Seconds the local workers get, once the run is over, to leave by themselves.
def local_worker_command(
    port: int, *, token: str | None = None, backend: str = "cpu", extra: Sequence[str] = ()
) -> list[str]:
    """argv of a `pcp-tui worker` for a shepherd on 127.0.0.1:`port`, run by this Python.

    Without `token` the worker reads PCP_TOKEN from its environment (kept out of `ps`).
    """
    command = [sys.executable, "-m", "pcp_tui", "worker", "--connect", f"127.0.0.1:{port}"]
    if token is not None:
        command += ["--token", token]
    return [*command, "--backend", backend, *extra]


async def _worker_process(
    shepherd: Shepherd, port: int, backend: str, index: int, *, task_status
) -> None:
    """One local worker process; if it dies before the run ends, the run fails.

    It gets a session of its own: a Ctrl-C at the terminal reaches only the
    demo, which stops its shepherd, which tells the worker goodbye.

    It never outlives the demo, even one killed by SIGKILL: it inherits the read
    end of a pipe whose only write end the demo holds, and stops when that end
    closes (the kernel closes it however the demo dies). Not PR_SET_PDEATHSIG:
    that fires when the *thread* that forked exits, and trio forks from a
    cached worker thread that exits after a few idle seconds.
    """
    shepherd.ask_workers_back = False  # a --resume starts new local workers; these end with it
    posix = os.name == "posix"
    parent_end, demo_end = os.pipe() if posix else (None, None)
    command = local_worker_command(
        port,
        backend=backend,
        extra=(
            "--id",
            f"local-{index}",
            "--quiet",
            "--devices",  # the demo's workers share this host: one device each
            "1",
            *(("--parent-fd", str(parent_end)) if posix else ()),
            *(shepherd.tls.worker_flags() if shepherd.tls else ()),
        ),
    )
    assert shepherd.token is not None, "the launchers set a token before making the shepherd"
    env = dict(
        os.environ, PCP_TOKEN=shepherd.token, **_cpu_threads_env(shepherd.config.network.workers)
    )
    inherited = (parent_end,) if parent_end is not None else ()
    try:
        async with trio.open_nursery() as nursery:
            process = await nursery.start(
                lambda **kw: trio.run_process(
                    command,
                    env=env,
                    check=False,
                    start_new_session=posix,
                    pass_fds=inherited,
                    **kw,
                )
            )
            if parent_end is not None:
                os.close(parent_end)
                parent_end = None
            task_status.started(process)
    finally:
        for fd in (parent_end, demo_end):
            if fd is not None:
                os.close(fd)
    if process.returncode != 0 and not shepherd.state.status.finished:
        shepherd.abort(
            f"local worker {index} exited with code {process.returncode} (its reason is above)"
        )


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


# Said once by a worker started without TLS (a demo's own local workers are not told).
PLAIN_TCP_WARNING = (
    "pcp-tui: warning: no TLS: this worker trusts the network (it trains for whoever answers "
    "at {address} or sits on the path); to train only for your shepherd, start it with "
    "--tls-cert and --tls-key and join with the --tls-fingerprint its join command then prints"
)


def run_relay(config: RelayConfig) -> int:
    """Carry workers to the shepherd at `config.connection.connect` until the run ends."""
    from pcp_tui.contract.connection import ConnectionLost, Refused
    from pcp_tui.contract.tls import ClientTLS, ServerTLS
    from pcp_tui.relay import Relay
    from pcp_tui.shepherd.serving.listening import CannotListen

    connection, listen = config.connection, config.listen
    token = connection.token or os.environ.get("PCP_TOKEN")
    if not token:
        return _fail("no join token: pass --token (the shepherd's) or set PCP_TOKEN")
    try:
        client_tls = ClientTLS.from_options(connection.tls_ca, connection.tls_fingerprint)
        server_tls = (
            ServerTLS.from_files(listen.tls_cert, listen.tls_key)
            if listen.tls_cert and listen.tls_key
            else None
        )
        relay = Relay(config, token=token, server_tls=server_tls, client_tls=client_tls)
    except (ValueError, OSError) as exc:
        return _fail(str(exc), 2)
    stop = SignalStop()  # the first SIGINT/SIGTERM ends the relay; the shepherd sees it leave
    ended = _run_with_signals(stop, relay.run, (CannotListen, Refused, ConnectionLost))
    if isinstance(ended, CannotListen):
        return _fail(str(ended), 2)
    if isinstance(ended, Refused):
        return _fail(f"{ended} (not retrying)")
    if ended is not None:
        return _fail(str(ended))
    return stop.exit_code or 0


def run_worker(config: WorkerConfig, *, faults: Faults | None = None) -> int:
    """Join the shepherd at `config.connection.connect` and train until it says goodbye.

    With --num-processes N > 1 this process is one of a site's (`worker/site.py`):
    process 0 joins the shepherd, the others follow it, and the site ends as one.
    `faults`: where a test makes the worker misbehave (`worker.rounds.Faults`).
    """
    from pcp_tui.app.worker_view import WorkerStatusView
    from pcp_tui.contract.tls import ClientTLS
    from pcp_tui.contract.trace import MessageTrace
    from pcp_tui.worker.client import ConnectionLost, Refused, Worker

    connection, output, site_config = config.connection, config.output, config.site
    token = connection.token or os.environ.get("PCP_TOKEN")
    if not token:
        return _fail(
            "no join token: pass --token (the shepherd prints it in its join command) or set PCP_TOKEN"
        )
    try:
        host, port = connection.address
    except ConfigError as exc:
        return _fail(str(exc), 2)
    if site_config.num_processes > 1 and config.compute.devices != "all":
        return _fail("a site trains on every device of its processes: leave out --devices", 2)
    site = _join_site(config)  # before anything else of JAX (its rule)
    if site.leads and not output.quiet:  # --quiet: errors only (they come from _fail)
        _warn_if_unresolved(host, port, retrying=connection.reconnect)
        if not (connection.tls_ca or connection.tls_fingerprint or output.parent_fd is not None):
            print(PLAIN_TCP_WARNING.format(address=connection.connect), file=sys.stderr, flush=True)
    if site.process_count == 1:  # a site compiles afresh on every process (worker/site.py)
        _enable_compile_cache(config.compute.compile_cache, quiet=output.quiet)
    try:
        tls = ClientTLS.from_options(connection.tls_ca, connection.tls_fingerprint)
        trace = MessageTrace(output.trace) if output.trace else None
        worker = Worker(config.replace(token=token), tls=tls, trace=trace, faults=faults, site=site)
    except OSError as exc:
        return _fail(f"cannot write --trace {output.trace} ({exc.strerror or exc})", 2)
    except ConfigError as exc:  # --key: not a key this worker can sign with
        return _fail(str(exc), 2)
    except (BackendUnavailable, ValueError) as exc:
        return _fail(str(exc))
    if site.process_count > 1:
        return _run_site_process(worker, quiet=output.quiet)
    view = contextlib.nullcontext() if output.quiet else WorkerStatusView(worker.status)
    stop = SignalStop()  # the first SIGINT/SIGTERM ends the worker; the shepherd sees it leave
    fd = output.parent_fd
    body = worker.run if fd is None else _until_closed(fd, worker.run)
    with view:
        ended = _run_with_signals(stop, body, (Refused, ConnectionLost, ParentGone))
    if isinstance(ended, Refused):
        return _fail(f"{ended} (not retrying)")
    if ended is not None:
        return _fail(str(ended))
    return stop.exit_code or 0


def _join_site(config: WorkerConfig) -> Site:
    """This process's site: itself, or (--num-processes > 1) the one it joins now."""
    from pcp_tui.worker.site import Site, join_site

    site = config.site
    if site.num_processes == 1:
        return Site.alone()
    backend = config.compute.backend
    return join_site(
        site.coordinator_address,
        site.num_processes,
        site.process_id,
        platform="cpu" if backend == "auto" else backend,
        quiet=config.output.quiet,
    )


def _run_site_process(worker: Worker, *, quiet: bool) -> NoReturn:
    """One process of a site of several: process 0 holds the session and, when it ends for
    any reason, tells the others; they follow it until then. Exits with `os._exit`: JAX's
    own shutdown, which waits for every process (one may be stuck in a collective with a
    process that is gone), runs only once every process came to the end (`Site.leave`)."""
    from jax.errors import JaxRuntimeError

    from pcp_tui.app.worker_view import WorkerStatusView
    from pcp_tui.worker.client import ConnectionLost, Refused
    from pcp_tui.worker.site import SiteEnd, SiteLost

    site = worker.site
    view = contextlib.nullcontext() if quiet else WorkerStatusView(worker.status)
    stop = SignalStop()
    code, reason = 0, "the run is over"
    if site.leads:
        with view:
            ended = _run_with_signals(
                stop, worker.run, (Refused, ConnectionLost, JaxRuntimeError, SiteLost)
            )
        if isinstance(ended, JaxRuntimeError):  # a collective with a process that is gone
            code, reason = 1, _site_broken(site.process_id, ended)
        elif isinstance(ended, SiteLost):  # a follower is gone
            code, reason = 1, str(ended)
        elif ended is not None:
            code, reason = 1, f"{ended}{' (not retrying)' if isinstance(ended, Refused) else ''}"
        elif stop.exit_code:
            code, reason = stop.exit_code, "stopped by a signal"
        if code:
            _fail(f"{reason}; the site's other processes end with it")
        site.end(code, reason)
    else:
        result: list[SiteEnd] = []

        async def follow() -> None:
            result.append(await worker.follow())

        with view:
            ended = _run_with_signals(stop, follow, (SiteLost, JaxRuntimeError, Refused))
        if isinstance(ended, JaxRuntimeError):
            code, reason = 1, _site_broken(site.process_id, ended)
        elif ended is not None:
            code, reason = 1, str(ended)
        elif result:
            code, reason = result[0].code, f"process 0's worker ended: {result[0].reason}"
        else:
            code, reason = stop.exit_code or 1, "stopped by a signal"
        if code:
            _fail(reason)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _site_broken(process_id: int, error: BaseException) -> str:
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return (
        f"a collective of the site failed in process {process_id} ({first}): another process "
        "of the site is gone; restart every process of the site"
    )


def _enable_compile_cache(directory: str, *, quiet: bool) -> None:
    """Keep compiled graphs in `directory` ('' : none); a warning if it cannot be used."""
    if not directory:
        return
    from pcp_tui.backends import enable_compilation_cache

    try:
        enable_compilation_cache(directory)
    except OSError as exc:
        if not quiet:
            print(
                f"pcp-tui: warning: no compile cache at {directory} ({exc.strerror})",
                file=sys.stderr,
            )


class ParentGone(Exception):
    """The demo that started this local worker has exited; the worker stops too."""


def _until_closed(fd: int, body: Callable[[], Awaitable[object]]) -> Callable[[], Awaitable[None]]:
    """`body`, cancelled (raising ParentGone) once the pipe `fd` reaches end-of-file.

    The demo never writes to the pipe: end-of-file means its last write end is
    closed, which the kernel does when the demo exits, however it exits.
    """

    async def watched() -> None:
        gone = False
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal gone
                await trio.lowlevel.wait_readable(fd)  # only end-of-file makes it readable
                gone = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            await body()
            nursery.cancel_scope.cancel()
        if gone:
            raise ParentGone("the demo that started this worker has exited; stopping")

    return watched


def _warn_if_unresolved(host: str, port: int, *, retrying: bool) -> None:
    """Say plainly when the name does not resolve; the worker still retries (DNS can recover)."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        then = "retrying in case that is temporary" if retrying else "not retrying"
        print(
            f"pcp-tui: warning: the shepherd's name {host!r} did not resolve ({exc.strerror}): "
            f"check --connect; {then}",
            file=sys.stderr,
            flush=True,
        )
