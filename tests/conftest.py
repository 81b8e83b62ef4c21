"""Shared fixtures; the harness itself is `pcp_tui.testing` (real processes on 127.0.0.1)."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from functools import partial

import pytest

from pcp_tui.testing import (
    ONE_XLA_THREAD,
    ShepherdProcess,
    WorkerProcesses,
    small_config,
    worker_command,
    worker_env,
)

__all__ = ["small_config", "worker_command", "worker_env"]


def pytest_configure(config: pytest.Config) -> None:
    """One fresh compile cache for this test run, shared by all of its processes.

    A worker keeps compiled graphs in `--compile-cache` ($PCP_COMPILE_CACHE, by default
    the user's own cache); the shepherds and this process keep theirs in JAX's
    ($JAX_COMPILATION_CACHE_DIR, read when JAX is imported). Both point at one new
    directory: a graph compiled once in the run loads from disk in the next process,
    and a run starts cold, whatever earlier runs compiled. xdist's workers are started
    after this and inherit the controller's directory with its environment.

    Every graph is kept, however fast it compiled: the suite's graphs are small (most
    compile in 0.1-0.5 s, under JAX's and the worker's thresholds) and the same ones
    compile in process after process. This process and its xdist workers run XLA on one
    thread as the worker processes do (`worker_env`): XLA_FLAGS are part of a graph's
    cache key, so the test processes and the workers share entries, and no process
    starts a thread per core on a machine its neighbours share.
    """
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    os.environ.setdefault("XLA_FLAGS", ONE_XLA_THREAD)
    if hasattr(config, "workerinput"):
        return
    directory = tempfile.mkdtemp(prefix="pcp-tui-test-compile-cache-")
    # ignore_errors: a process that outlived its test may still be writing there
    config.add_cleanup(partial(shutil.rmtree, directory, ignore_errors=True))
    os.environ["PCP_COMPILE_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"] = directory


@pytest.fixture
def spawn_worker():
    """Start real `pcp-tui worker` processes; kill leftovers at the end of the test."""
    with WorkerProcesses() as workers:
        yield workers.spawn


@pytest.fixture
def shepherds():
    """Start headless `pcp-tui shepherd` processes (`ShepherdProcess`); kill leftovers at the end."""
    started: list[ShepherdProcess] = []

    def start(*flags: str, **options) -> ShepherdProcess:
        started.append(ShepherdProcess(*flags, **options))
        return started[-1]

    yield start
    for shepherd in started:
        shepherd.kill()


@pytest.fixture(autouse=True)
def _pcp_tui_logger_restored():
    """A test that runs `pcp_tui.app.cli.main` in this process configures the `pcp_tui`
    logger (its own handler, no propagation); put it back so that later tests' `caplog`
    still sees pcp-tui's records."""
    logger = logging.getLogger("pcp_tui")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


#: what this test (setup and call) started: audit events of a new process, see `_audit`
_processes_started: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event == "subprocess.Popen":
        _processes_started.append(" ".join(map(str, args[1]))[:120])
    elif event in ("os.posix_spawn", "os.fork", "os.forkpty"):
        _processes_started.append(event)


sys.addaudithook(_audit)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _processes_started.clear()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """`-m "not e2e"` is the fast set: a test that starts a process must be marked e2e."""
    result = yield
    if _processes_started and item.get_closest_marker("e2e") is None:
        pytest.fail(
            f"{item.nodeid} starts a process ({_processes_started[0]}) but is not marked e2e: "
            "add @pytest.mark.e2e, or keep it in this process"
        )
    return result
