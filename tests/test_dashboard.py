"""The dashboard hosting a shepherd in trio guest mode, driven through Textual's Pilot.

A stand-in shepherd checks the hosting itself (commands reach trio, quit, failure);
the end-to-end test runs the real shepherd and real `pcp-tui worker` processes.
"""

from __future__ import annotations

import asyncio
import functools
import io
import math

import pytest
import trio

from pcp_tui.dashboard import DashboardApp
from pcp_tui.dashboard._braille import BrailleCanvas
from pcp_tui.dashboard.app import summary
from pcp_tui.dashboard.widgets import LossChart, WorkerTable
from pcp_tui.shepherd import RunFailed
from pcp_tui.state import RunState
from pcp_tui.worker import WorkerStatus
from pcp_tui.worker_view import WorkerStatusView

from .conftest import small_config, worker_command, worker_env

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


def screen_text(app: DashboardApp) -> str:
    return app.export_screenshot().replace("&#160;", " ")


class StandInShepherd:
    """Listens like the shepherd and waits for commands, which must arrive in trio context."""

    def __init__(self, failure: str | None = None):
        self.state = RunState(run_id="standin", rounds_total=3, settings={"inner_steps": 2})
        self.failure = failure
        self.commands: list[str] = []
        self._stop: trio.Event | None = None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> RunState:
        self._stop = trio.Event()
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        self.state.address = f"127.0.0.1:{port}"
        self.state.join_command = f"pcp-tui worker --connect {self.state.address} --token t"
        task_status.started(port)
        self.state.status = "training"
        self.state.emit("listening", f"listening on {self.state.address}")
        if self.failure:
            raise RunFailed(self.failure)
        await self._stop.wait()
        self.state.status = "stopped"
        self.state.finished_at = trio.current_time()  # any number: freezes elapsed
        for listener in listeners:
            await listener.aclose()
        return self.state

    def request_stop(self, reason: str) -> None:
        trio.lowlevel.current_trio_token()  # raises outside trio: commands must be routed in
        self.commands.append(f"stop: {reason}")
        self._stop.set()

    def pause(self) -> None:
        trio.lowlevel.current_trio_token()
        self.commands.append("pause")

    def resume(self) -> None:
        trio.lowlevel.current_trio_token()
        self.commands.append("resume")


@run_async
async def test_quit_stops_the_guest_run_then_exits():
    shepherd = StandInShepherd()
    app = DashboardApp(shepherd.state, shepherd)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: shepherd.state.status == "training")
        await pilot.press("p")
        await pilot.press("p")
        await wait_until(pilot, lambda: len(shepherd.commands) == 2)
        await pilot.press("q")
        await wait_until(pilot, lambda: not app.is_running)
    assert shepherd.commands == ["pause", "resume", "stop: quit from the dashboard"]
    assert app.return_code == 0 and not app.guest_running
    assert shepherd.state.status == "stopped"


@run_async
async def test_failed_run_stays_on_screen_and_exits_1():
    shepherd = StandInShepherd(failure="cannot listen on 127.0.0.1:1 (denied); pick another --port")
    app = DashboardApp(shepherd.state, shepherd)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: not app.guest_running)
        await pilot.pause(0.5)
        assert app.is_running  # the failure stays visible until the person quits
        assert app.failure == "cannot listen on 127.0.0.1:1 (denied); pick another --port"
        assert shepherd.state.status == "failed"
        await pilot.press("q")
        await wait_until(pilot, lambda: not app.is_running)
    assert app.return_code == 1


def test_braille_canvas_draws_a_diagonal():
    canvas = BrailleCanvas(2, 1)
    canvas.line(0, 0, 3, 3, series=0)
    assert [char for char, _ in canvas.rows()[0]] == ["⠑", "⢄"]
    canvas.point(99, 99, series=1)  # outside: ignored


@run_async
async def test_loss_chart_handles_flat_and_nan_losses():
    state = RunState(run_id="flat", rounds_total=1, settings={"inner_steps": 2})
    state.step_losses.extend([(1, 2.0, 0), (2, 2.0, 1), (3, float("nan"), 0)])
    app = DashboardApp(state)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("l", "z", "z", "z")
        chart = app.query_one(LossChart)
        assert chart.log_scale is False and chart.window == 0
        assert "train 2.0000" in str(chart.border_subtitle)
        assert "⠀" not in str(chart.render())  # blank cells are spaces, not empty braille


def test_worker_view_plain_lines_and_live_line():
    status = WorkerStatus(shepherd="127.0.0.1:8080")
    out = io.StringIO()
    with WorkerStatusView(status, out, live=False):
        status.update(state="training", round=2, step=3, total_steps=10, loss=2.5, message="")
        status.update(step=4)  # same state and round: no new line
        status.update(state="done", message="the shepherd ended the run")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "training" in lines[0] and "loss 2.5000" in lines[0]
    assert not status.listeners

    live_out = io.StringIO()
    with WorkerStatusView(status, live_out, live=True):
        status.update(
            state="training", round=3, step=5, total_steps=10, loss=2.25, tokens_per_second=1234.0
        )
    assert "round 3 · step 5/10 · loss 2.2500 · 1,234 tok/s" in " ".join(
        live_out.getvalue().split()
    )


# -- the real thing: shepherd + worker processes on 127.0.0.1 ------------------------


@pytest.mark.e2e
@run_async
async def test_dashboard_hosts_a_real_run_and_quits_cleanly():
    from pcp_tui.shepherd import Shepherd
    from pcp_tui.task import build_task

    config = small_config(rounds=40, inner_steps=5, chunk_steps=1, workers=2, eval_every=1)
    shepherd = Shepherd(config, build_task(config, shards=2))
    processes: list[trio.Process] = []

    async def spawn(nursery: trio.Nursery, port: int) -> list[trio.Process]:
        command = worker_command(port, "--quiet")
        for _ in range(2):
            processes.append(
                await nursery.start(
                    functools.partial(trio.run_process, command, env=worker_env(), check=False)
                )
            )
        return processes

    state = shepherd.state
    app = DashboardApp(state, shepherd, spawn)
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            table = app.query_one(WorkerTable)
            await wait_until(pilot, lambda: table.row_count == 2)
            await wait_until(pilot, lambda: len(state.history) >= 1 and len(state.step_losses) >= 5)
            await pilot.pause(0.5)  # one refresh tick after the round
            assert {str(table.get_cell(key, "backend")) for key in state.workers} == {"cpu"}
            assert app.query_one(LossChart).points >= 5
            screen = screen_text(app)
            assert "compute" in screen and "round 1" in screen and "training" in screen.lower()
            await pilot.press("q")
            await wait_until(pilot, lambda: not app.is_running)
    finally:
        for process in processes:  # only after a failure: leave no worker reconnecting forever
            if process.returncode is None:
                process.kill()
    assert app.return_code == 0
    assert state.status == "stopped" and len(state.history) < 40
    assert [p.returncode for p in processes] == [0, 0]
    assert math.isfinite(state.history[-1].train_loss)
    assert f"{len(state.history)}/40 rounds" in summary(state)
