"""Free ports, the argv of real shepherd and worker processes, and their cleanup.

The machinery behind `pcp_tui.testing`, which re-exports what is public here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from pcp_tui.config import RunConfig

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


#: Flags of a shepherd whose rounds are short: 10 inner steps in chunks of 5, 5 warm-up steps.
QUICK_FLAGS = ("--inner-steps", "10", "--chunk-steps", "5", "--warmup-steps", "5")


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The rows of a `--metrics` file (JSON lines)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def round_workers(path: str | os.PathLike) -> list[int]:
    """How many workers each round of a `--metrics` file counted, round by round."""
    return [row["workers"] for row in read_metrics(path) if row["event"] == "round"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process that cannot take port 0)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


#: XLA_FLAGS for one XLA thread on the CPU (a worker beside others on a shared machine)
ONE_XLA_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def worker_env() -> dict[str, str]:
    """This process's environment for a worker: one XLA thread each, unbuffered output, and
    Python's fault handler (a process that crashes or aborts prints every thread's stack).

    Several workers share the cores of one test machine; without the thread
    limit each would start a thread per core and they would fight.
    """
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", ONE_XLA_THREAD)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def worker_command(port: int, *extra: str, token: str = "test-token") -> list[str]:
    """argv of a `pcp-tui worker` joining 127.0.0.1:`port` on the CPU backend."""
    # imported here: the launcher pulls in the shepherd and JAX, which a benchmark of the
    # codec alone (`import pcp_tui.testing` for its helpers) should not wait for
    from pcp_tui.app.launch import local_worker_command

    return local_worker_command(port, token=token, extra=extra)


def faulty_worker_command(
    port: int, fault: str, *extra: str, token: str = "test-token", **parameters: float
) -> list[str]:
    """argv of `worker_command(port, *extra)` run as `pcp_tui.testing.faulty_worker` `fault`.

    `parameters` are the fault's (`faulty_worker_command(port, "stall", round=2,
    seconds=5)`); an unknown fault or parameter raises `ValueError` here rather
    than as a usage error in the worker's output.
    """
    # imported here: `python -m pcp_tui.testing.faulty_worker` imports this package first,
    # and runpy warns when the module it is about to run is already in sys.modules
    from pcp_tui.testing.faulty_worker import FAULTS

    if fault not in FAULTS:
        raise ValueError(f"no fault {fault!r}; choose one of {', '.join(FAULTS)}")
    unknown = set(parameters) - set(FAULTS[fault].parameters)
    if unknown:
        raise ValueError(f"fault {fault!r} takes no {', '.join(sorted(unknown))}")
    options = [str(part) for name, value in parameters.items() for part in (f"--{name}", value)]
    arguments = worker_command(port, *extra, token=token)[4:]  # after `python -m pcp_tui worker`
    return [
        sys.executable,
        "-m",
        "pcp_tui.testing.faulty_worker",
        fault,
        *options,
        "--",
        *arguments,
    ]


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

    def output(self, process: subprocess.Popen, timeout: float = 240.0) -> str:
        """Everything `process` printed, once it exits. One still running after `timeout`
        seconds is aborted (its fault handler prints every thread's stack, `worker_env`) and
        an AssertionError carries that output: a hung worker fails with where it hangs."""
        try:
            return process.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)
            printed = process.communicate(timeout=30)[0]
            raise AssertionError(
                f"the worker had not exited {timeout:g} s on; its output and stacks:\n{printed}"
            ) from None

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


class OutputProcess:
    """A process whose merged stdout and stderr are collected line by line, as they come.

    A test waits for a line (`wait_for`) instead of sleeping. It has no timeout of its own:
    a process that never prints the line hangs the test until pytest's `faulthandler_timeout`
    shows where.
    """

    def __init__(self, command: Sequence[str], *, env: dict[str, str] | None = None):
        self.process = subprocess.Popen(
            list(command),
            env=env if env is not None else worker_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.output_closed = False  # the process closed its output: no line will come any more
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None, "started with stdout=PIPE"
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.output_closed = True
            self._changed.notify_all()

    def matches(self, pattern: str) -> list[re.Match]:
        """Every output line so far that matches `pattern`."""
        return [m for m in (re.search(pattern, line) for line in self.lines) if m]

    def wait_for(self, pattern: str, count: int = 1) -> re.Match:
        """The `count`-th line matching `pattern`, waiting for it; AssertionError if the process
        ends or closes its output first (no line can come then, even if it lives on)."""
        with self._changed:
            self._changed.wait_for(
                lambda: (
                    len(self.matches(pattern)) >= count
                    or self.output_closed
                    or self.process.poll() is not None
                ),
            )
            found = self.matches(pattern)
        if len(found) < count and self.process.poll() is not None:
            self._reader.join(timeout=10)  # it ended: its last lines may still be in the pipe
            found = self.matches(pattern)
        if len(found) < count:
            code = self.process.poll()
            why = (
                "closed its output" + (f", exit code {code}" if code is not None else "")
                if self.output_closed
                else f"ended with exit code {code}"
            )
            raise AssertionError(f"{pattern!r}: the process {why}; its output:\n{self.output}")
        return found[count - 1]

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def finish(self) -> int:
        """Wait for the process to end and all its output; its exit code."""
        code = self.process.wait()
        self._reader.join(timeout=10)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


class ShepherdProcess(OutputProcess):
    """A headless `pcp-tui shepherd` process (`shepherd_command` on a port of the OS's choosing),
    its merged output collected line by line; returns once it listens.

    `port` and `join_command` are read from its "listening on" line.
    """

    def __init__(self, *flags: str, token: str = "test-token", env: dict[str, str] | None = None):
        super().__init__(shepherd_command(0, *flags, token=token), env=env)
        found = self.wait_for(r"listening on 127\.0\.0\.1:(\d+)[^;]*; join with: (.*)")
        self.port, self.join_command = int(found.group(1)), found.group(2)

    def rss_kib(self) -> int:
        """Its resident memory now (Linux /proc)."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        found = re.search(r"VmRSS:\s+(\d+) kB", status)
        assert found is not None, "/proc/PID/status has no VmRSS line"
        return int(found.group(1))


def self_signed_certificate(directory: Path, name: str = "") -> tuple[Path, Path]:
    """A certificate and key for 127.0.0.1 made by `openssl` (the README's one-line recipe)."""
    cert, key = directory / f"{name}cert.pem", directory / f"{name}key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "365",
            "-subj",
            "/CN=pcp-shepherd",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started (Linux /proc; every thread's children, since trio
    forks from worker threads): how a test finds a demo's local workers."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(FileNotFoundError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found
