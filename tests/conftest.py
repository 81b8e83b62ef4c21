"""Shared fixtures; the harness itself is `pcp_tui.testing` (real processes on 127.0.0.1)."""

from __future__ import annotations

import pytest

from pcp_tui.testing import WorkerProcesses, small_config, worker_command, worker_env

__all__ = ["small_config", "worker_command", "worker_env"]


@pytest.fixture
def spawn_worker():
    """Start real `pcp-tui worker` processes; kill leftovers at the end of the test."""
    with WorkerProcesses() as workers:
        yield workers.spawn
