"""`pcp_tui.train`: a shepherd and local worker processes from Python, as `pcp-tui demo` runs them."""

from __future__ import annotations

import sys
from functools import partial

import trio

from pcp_tui.app.headless import HeadlessPrinter
from pcp_tui.app.launch import _worker_process, run_unwrapped
from pcp_tui.app.local_run import run_with_local_workers
from pcp_tui.app.preflight import preflight
from pcp_tui.config import RunConfig
from pcp_tui.contract.auth import new_token
from pcp_tui.shepherd.coordinator import RunFailed, Shepherd
from pcp_tui.shepherd.run.state import RunState


def train(
    config: RunConfig | None = None,
    *,
    backend: str = "cpu",
    progress: bool = False,
    **options,
) -> RunState:
    """Train `config` (or the defaults with `options` applied) with `config.network.workers` local workers.

    The workers are real `pcp-tui worker` processes on this machine, joined over
    127.0.0.1; the shepherd runs in this process under `trio.run`, so this call
    blocks until the run ends and returns its final state (history, workers,
    events). `progress` prints the headless lines. Raises `ConfigError` for an
    option that cannot work and `RunFailed` when the run cannot go on (a local
    worker died, say); data and model errors pass through as they are.

        state = pcp_tui.train(rounds=3, inner_steps=20)
        print(state.history[-1].eval_loss)
    """
    from pcp_tui.training.build import build_workload

    config = (config or RunConfig(host="127.0.0.1", port=0)).replace(**options)
    if not config.security.token:
        config = config.replace(token=new_token())
    preflight(config)
    shepherd = Shepherd(config, build_workload(config, shards=config.network.workers))
    if progress:
        shepherd.state.subscribe(HeadlessPrinter(shepherd.state, sys.stdout))

    async def spawn(nursery: trio.Nursery, port: int) -> None:
        for index in range(config.network.workers):
            await nursery.start(_worker_process, shepherd, port, backend, index)

    failed = run_unwrapped(partial(run_with_local_workers, shepherd, spawn), RunFailed)
    if failed is not None:
        raise failed
    return shepherd.state
