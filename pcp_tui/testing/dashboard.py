"""A dashboard without a shepherd, for tests: a hand-made `RunState` of a run in progress seen
at a frozen moment, and the helpers that drive a Textual app from a test.

Imports Textual: not re-exported by `pcp_tui.testing`, whose harness runs without it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math

from textual.geometry import Region

from pcp_tui.app.dashboard import DashboardApp
from pcp_tui.shepherd.rounds.results import data_parallel_bytes, utilization
from pcp_tui.shepherd.run.events import (
    Compiled,
    Event,
    Joined,
    Listening,
    Lost,
    PeerRefused,
    RoundDone,
)
from pcp_tui.shepherd.run.history import RoundRecord
from pcp_tui.shepherd.run.ledger import ShardLedger
from pcp_tui.shepherd.run.state import RunState, RunStatus, WorkerState, WorkerView

STARTED = 1_000.0  # monotonic seconds, frozen
NOW = STARTED + 83.0
WALL = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC, for event times
H = 10


def fake_state(*, status: str = "training") -> RunState:
    state = RunState(
        run_id="3f2a91bc",
        rounds_total=6,
        settings={
            "algorithm": "DiLoCo",
            "inner_steps": H,
            "inner_optimizer": "adamw",
            "inner_lr": 0.001,
            "outer_optimizer": "nesterov",
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
            "compression": "int8Block",
            "workers": 4,
        },
    )
    state.model_name, state.param_count = "tiny", 1_234_567
    state.address = "127.0.0.1:8080"
    state.join_command = "pcp-tui worker --connect 127.0.0.1:8080 --token Zk3xQ9wLm2Tr7bYp8vNc4d"
    state.status, state.round, state.started_at = RunStatus(status), 4, STARTED
    workers = [
        WorkerView(
            "gpu-a-1",
            0,
            "gpu-a",
            "cuda NVIDIA H100",
            WorkerState.TRAINING,
            4,
            6,
            H,
            2.4121,
            51_234.0,
            NOW - 0.2,
            1_800_000,
            1_700_000,
            3,
        ),
        WorkerView(
            "laptop-7",
            1,
            "laptop",
            "cpu",
            WorkerState.SYNCING,
            4,
            H,
            H,
            2.5310,
            2_345.0,
            NOW - 1.4,
            1_750_000,
            1_690_000,
            3,
        ),
        WorkerView(
            "mac-2",
            2,
            "studio.local",
            "metal Apple M2",
            WorkerState.LOST,
            3,
            3,
            H,
            2.9012,
            980.0,
            NOW - 40,
            900_000,
            500_000,
            1,
            "silent for 31 s (heartbeat timeout 30 s)",
        ),
        WorkerView(
            "late-3",
            3,
            "gpu-b",
            "cuda NVIDIA A100",
            WorkerState.COMPILING,
            0,
            0,
            0,
            None,
            0.0,
            NOW - 3.0,
            600_000,
            0,
        ),
    ]
    for worker, (memory, peak, limit, gpu) in zip(
        workers,
        [
            (61 * 10**9, 72 * 10**9, 80 * 10**9, 0.97),
            (31 * 10**8, 34 * 10**8, 16 * 10**9, None),
            (9 * 10**9, 9 * 10**9, 32 * 10**9, None),
        ],
        strict=False,
    ):
        worker.runtime, worker.devices, worker.compile_seconds = "xla", 1, 2.1
        worker.memory_in_use, worker.memory_peak, worker.memory_limit = memory, peak, limit
        worker.gpu_utilization = gpu
        worker.steps_trained, worker.tokens_trained = 36, 36 * 8 * 32
    state.shards = ShardLedger(len(workers))
    for worker in workers:
        worker.shard, _ = state.shards.assign(worker.worker_id)
    state.shards.release("mac-2")  # lost: its shard waits for a new worker
    state.workers = {w.worker_id: w for w in workers}
    for number in range(1, 4):
        for step in range(1, H + 1):
            global_step = (number - 1) * H + step
            for index in range(2):
                loss = 2.2 + 3.3 * math.exp(-global_step / 6) + 0.05 * math.sin(global_step + index)
                state.step_losses.append((global_step, loss, index))
        seconds = 4.0 + number * 0.25
        run_share, shares = utilization({"gpu-a-1": 3.1, "laptop-7": 2.6}, seconds)
        state.history.append(
            RoundRecord(
                round=number,
                train_loss=2.3 + 3.0 * math.exp(-number * H / 6),
                eval_loss=2.4 + 2.8 * math.exp(-number * H / 6),
                round_seconds=seconds,
                compute_seconds=3.1,
                communication_seconds=0.6 + 0.1 * number,
                straggler_seconds=0.3 + 0.15 * number,
                tokens=2 * H * 8 * 32,
                tokens_per_second=1_200.0 - number * 20,
                bytes_sent=1_200_000,
                bytes_received=1_150_000,
                workers=2,
                worker_ids=("gpu-a-1", "laptop-7"),
                utilization=run_share,
                worker_utilization=shares,
                bytes_data_parallel=data_parallel_bytes(state.param_count, H, 2),
            )
        )
    state.bytes_sent, state.bytes_received = 5_050_000, 3_890_000
    events: list[Event] = [
        Listening("listening on 127.0.0.1:8080; join with: " + state.join_command),
        Joined(
            "worker 0 (gpu-a-1, cuda NVIDIA H100) joined from 10.0.0.5:51234",
            worker="gpu-a-1",
            shard=0,
            platform="cuda",
            devices=1,
        ),
        Joined(
            "worker 1 (laptop-7, cpu) joined from 10.0.0.9:40110",
            worker="laptop-7",
            shard=1,
            platform="cpu",
            devices=1,
        ),
        Compiled("worker 0 compiled in 2.1 s", worker="gpu-a-1"),
        PeerRefused("refused 10.0.0.66:50000: wrong join token", peer="10.0.0.66:50000"),
        *[RoundDone(f"round {r.round} done", record=r) for r in state.history],
        Lost("worker 2 lost: silent for 31 s (heartbeat timeout 30 s)", worker="old-2"),
        Joined(
            "worker 3 (late-3, cuda NVIDIA A100) joined from 10.0.0.7:33002",
            worker="late-3",
            shard=2,
            platform="cuda",
            devices=1,
        ),
    ]
    for offset, event in enumerate(events):
        state.events.append(dataclasses.replace(event, at=WALL + 5 * offset))
    return state


def frozen_app(state: RunState) -> DashboardApp:
    """The dashboard of `state`, its clock stopped at `NOW`, no shepherd behind it."""
    return DashboardApp(state=state, shepherd=None, clock=lambda: NOW)


MAX_PAUSES = 600  # generous bound on polling loops; each pause is 0.1 s


def run_async(test):
    """Run an async test on a fresh asyncio loop (Textual's host loop); no pytest plugin needed."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return wrapper


async def wait_until(pilot, condition, *, pauses: int = MAX_PAUSES) -> None:
    for _ in range(pauses):
        if condition():
            return
        await pilot.pause(0.1)
    raise AssertionError(f"condition never became true: {condition.__doc__ or condition}")


def panel_lines(widget) -> list[str]:
    """What a panel shows, line by line, as plain text (border and scrollbars included)."""
    return [strip.text for strip in widget.render_lines(Region(0, 0, *widget.outer_size))]
