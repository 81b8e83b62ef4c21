"""Shared fixtures; the harness itself is `pcp_tui.testing` (real processes on 127.0.0.1)."""

from __future__ import annotations

import logging

import pytest

from pcp_tui.testing import WorkerProcesses, small_config, worker_command, worker_env

__all__ = ["small_config", "worker_command", "worker_env"]


@pytest.fixture
def spawn_worker():
    """Start real `pcp-tui worker` processes; kill leftovers at the end of the test."""
    with WorkerProcesses() as workers:
        yield workers.spawn


@pytest.fixture(autouse=True)
def _pcp_tui_logger_restored():
    """A test that runs `pcp_tui.app.cli.main` in this process configures the `pcp_tui`
    logger (its own handler, no propagation); put it back so that later tests' `caplog`
    still sees pcp-tui's records."""
    logger = logging.getLogger("pcp_tui")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved
