"""Shared helpers: small run configs and real worker processes on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess

import pytest

from pcp_tui.app.launch import local_worker_command
from pcp_tui.config import RunConfig

# Small enough to train in seconds on 2 cores; everything else is the real thing.
SMALL = dict(
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
    return RunConfig(**{**SMALL, **changes})


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def worker_command(port: int, *extra: str, token: str = "test-token") -> list[str]:
    return local_worker_command(port, token=token, extra=extra)


@pytest.fixture
def spawn_worker():
    """Start real `pcp-tui worker` processes; kill leftovers at the end of the test."""
    processes: list[subprocess.Popen] = []

    def spawn(port: int, *extra: str, token: str = "test-token") -> subprocess.Popen:
        process = subprocess.Popen(
            worker_command(port, *extra, token=token),
            env=worker_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        processes.append(process)
        return process

    yield spawn
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        if process.stdout:
            process.stdout.close()
