"""Harness for tests and benchmarks that run the real thing: free ports, worker processes, small runs.

What the test suite, the benchmarks and a user's own integration tests would
otherwise each write again (as trio ships `trio.testing`). Everything here
starts real processes and real sockets on 127.0.0.1; nothing is mocked.

    with WorkerProcesses() as workers:
        workers.spawn(port, "--id", "w0")
        ...                              # leftovers are killed on exit
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from types import TracebackType

from pcp_tui.app.launch import local_worker_command
from pcp_tui.config import RunConfig

__all__ = [
    "SMALL_RUN",
    "WorkerProcesses",
    "free_port",
    "shepherd_command",
    "small_config",
    "worker_command",
    "worker_env",
]

#: Options of a run small enough to train in seconds on 2 cores; everything else is the real thing.
SMALL_RUN = dict(
    model="tiny",
    seq_len=32,
    batch_size=4,
    data_max_bytes=256 * 1024,
    eval_batches=2,
    host="127.0.0.1",
    port=0,
    heartbeat_seconds=0.5,
    platforms=("cpu",),
    token="test-token",
)


def small_config(**changes) -> RunConfig:
    """A `RunConfig` of `SMALL_RUN` with `changes` applied."""
    return RunConfig(**{**SMALL_RUN, **changes})


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process that cannot take port 0)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def worker_env() -> dict[str, str]:
    """This process's environment for a worker: one XLA thread each, unbuffered output.

    Several workers share the cores of one test machine; without the thread
    limit each would start a thread per core and they would fight.
    """
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def worker_command(port: int, *extra: str, token: str = "test-token") -> list[str]:
    """argv of a `pcp-tui worker` joining 127.0.0.1:`port` on the CPU backend."""
    return local_worker_command(port, token=token, extra=extra)


def shepherd_command(port: int, *extra: str, token: str = "test-token") -> list[str]:
    """argv of a headless `pcp-tui shepherd` of `SMALL_RUN`'s shape on 127.0.0.1:`port`.

    `extra` options come last, so they override the small defaults.
    """
    small = SMALL_RUN
    return [
        sys.executable,
        "-m",
        "pcp_tui",
        "shepherd",
        "--headless",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--token",
        token,
        "--model",
        str(small["model"]),
        "--seq-len",
        str(small["seq_len"]),
        "--batch-size",
        str(small["batch_size"]),
        "--data-max-bytes",
        str(small["data_max_bytes"]),
        "--eval-batches",
        str(small["eval_batches"]),
        "--heartbeat-seconds",
        str(small["heartbeat_seconds"]),
        *extra,
    ]


class WorkerProcesses:
    """Real `pcp-tui worker` processes that are killed, if still running, when the block ends."""

    def __init__(self, env: dict[str, str] | None = None):
        self.env = env or worker_env()
        self.processes: list[subprocess.Popen] = []

    def spawn(self, port: int, *extra: str, token: str = "test-token") -> subprocess.Popen:
        """Start one worker for 127.0.0.1:`port`; its stdout and stderr are one text pipe."""
        return self.start(worker_command(port, *extra, token=token))

    def start(self, command: Sequence[str]) -> subprocess.Popen:
        """Start any command (a test worker wrapping the real one, say) under the same cleanup."""
        process = subprocess.Popen(
            list(command),
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.processes.append(process)
        return process

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)
            if process.stdout:
                process.stdout.close()

    def __enter__(self) -> WorkerProcesses:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
