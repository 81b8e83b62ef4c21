"""The dashboard hosting a shepherd in trio guest mode, driven through Textual's Pilot.

A stand-in shepherd checks the hosting itself (commands reach trio, quit, failure);
the end-to-end test runs the real shepherd and real `pcp-tui worker` processes.
"""

from __future__ import annotations

import collections
import functools
import io
import math
import re

import pytest
import trio

from pcp_tui.app.dashboard import DashboardApp
from pcp_tui.app.dashboard import app as dashboard_app
from pcp_tui.app.dashboard._braille import BrailleCanvas
from pcp_tui.app.dashboard.app import summary
from pcp_tui.app.dashboard.loss_chart import StepMeans
from pcp_tui.app.dashboard.widgets import EventLog, LossChart, RoundTiming, RunHeader, WorkerTable
from pcp_tui.app.worker_view import WorkerStatusView, status_line
from pcp_tui.config import RunConfig
from pcp_tui.shepherd.coordinator import RunFailed
from pcp_tui.shepherd.run.events import Listening, Waiting
from pcp_tui.shepherd.run.state import RunState, RunStatus, WorkerView
from pcp_tui.testing.dashboard import (
    NOW,
    fake_state,
    panel_lines,
    run_async,
    wait_until,
)
from pcp_tui.worker.client import WorkerStatus

from .conftest import small_config, worker_command, worker_env


def screen_text(app: DashboardApp) -> str:
    return app.export_screenshot().replace("&#160;", " ")


class StandInShepherd:
    """Listens like the shepherd and waits for commands, which must arrive in trio context."""

    def __init__(self, failure: str | None = None):
        self.state = RunState(run_id="standin", rounds_total=3, settings={"inner_steps": 2})
        self.config = RunConfig(token="standin")  # no --api-port: the app runs no API beside it
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
        self.state.emit(Listening(f"listening on {self.state.address}"))
        if self.failure:
            raise RunFailed(self.failure)
        await self._stop.wait()
        self.state.status = self._ended_as
        self.state.finished_at = trio.current_time()  # any number: freezes elapsed
        for listener in listeners:
            await listener.aclose()
        return self.state

    _ended_as = RunStatus.STOPPED  # as the real one: stopped, or cancelled for good

    def request_stop(self, reason: str) -> None:
        trio.lowlevel.current_trio_token()  # raises outside trio: commands must be routed in
        self.commands.append(f"stop: {reason}")
        self._stop.set()

    def cancel(self, reason: str) -> None:
        trio.lowlevel.current_trio_token()
        self.commands.append(f"cancel: {reason}")
        self._ended_as = RunStatus.CANCELLED
        self._stop.set()

    def stop_now(self, reason: str) -> None:
        trio.lowlevel.current_trio_token()
        self.commands.append(f"stop now: {reason}")
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
        assert app.check_action("pause", ()) and not app.check_action("resume", ())
        await pilot.press("p")
        assert app.check_action("resume", ()) and not app.check_action("pause", ())
        await pilot.press("p")
        await wait_until(pilot, lambda: len(shepherd.commands) == 2)
        await pilot.press("q")
        assert not app.check_action("pause", ()) and not app.check_action("resume", ())
        await wait_until(pilot, lambda: not app.is_running)
    assert shepherd.commands == ["pause", "resume", "cancel: quit from the dashboard"]
    assert app.return_code == 0 and not app.guest_running
    assert shepherd.state.status == "cancelled"


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


def test_step_means_reads_only_new_entries_and_survives_the_deque_bound():
    losses: collections.deque = collections.deque(maxlen=4)
    means = StepMeans()
    assert not means.update(losses)
    losses.extend([(1, 2.0, 0), (1, 4.0, 1)])
    assert means.update(losses) and means.points() == [(1, 3.0)]
    assert not means.update(losses)  # nothing new: the chart is left alone
    losses.extend([(2, 1.0, 0), (2, float("nan"), 1), (3, 5.0, 0)])  # (1, 2.0, 0) falls out
    assert means.update(losses)
    assert means.points() == [(1, 3.0), (2, 1.0), (3, 5.0)]  # step 1 kept, nan skipped


def _progress(state: RunState, worker: WorkerView, step: int, now: float) -> None:
    """What the shepherd does with one progress message (Shepherd._on_progress and the link)."""
    worker.state, worker.step, worker.total_steps = "training", step, 50
    worker.loss = 3.0 - 0.01 * step + 0.001 * worker.index
    worker.tokens_per_second = 1_000.0 + worker.index
    worker.last_heard, worker.bytes_in = now, worker.bytes_in + 120
    state.step_losses.append((step, worker.loss, worker.index))


@run_async
async def test_64_chatty_workers_redraw_panels_per_refresh_tick_not_per_message(monkeypatch):
    """The adapter, not the message rate, decides when panels redraw.

    The refresh timer is set out of reach so the test makes every tick itself:
    3,200 progress messages arrive with the event loop running between batches,
    and the panels redraw only after a tick, a bounded number of times per tick.
    Redraws are counted (render_lines calls), never timed.
    """
    monkeypatch.setattr(dashboard_app, "REFRESH_SECONDS", 3_600.0)
    state = RunState(run_id="many", rounds_total=4, settings={"inner_steps": 50})
    state.status, state.round = "training", 1
    workers = [WorkerView(f"w{i:02d}", i, f"host-{i}", "cpu", "idle") for i in range(64)]
    state.workers = {w.worker_id: w for w in workers}
    clock = [NOW]
    app = DashboardApp(state, clock=lambda: clock[0])
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        panels = [app.query_one(kind) for kind in (RunHeader, LossChart, RoundTiming, WorkerTable)]
        redraws = collections.Counter()
        for panel in panels:
            render_lines = panel.render_lines

            def counted(crop, panel=panel, render_lines=render_lines):
                redraws[type(panel).__name__] += 1
                return render_lines(crop)

            monkeypatch.setattr(panel, "render_lines", counted)
        for _ in range(20):  # the first paint after mount, in as many passes as it takes
            redraws.clear()  # (a loaded machine spread it over several pauses)
            await pilot.pause()
            if not redraws:
                break
        assert not redraws, f"the panels still redraw with nothing new: {redraws}"

        ticks, settled = 0, collections.Counter()
        for step in range(1, 51):
            for worker in workers:
                _progress(state, worker, step, clock[0])
            await pilot.pause()
            assert redraws == settled, f"a panel redrew between ticks, at step {step}"
            if step % 10 == 0:  # one tick per 640 messages
                clock[0] += 0.4
                app.refresh_from_state()
                ticks += 1
                await pilot.pause()
                await pilot.pause()
                settled = redraws.copy()

        assert len(state.step_losses) == 64 * 50
        for name in ("RunHeader", "LossChart", "WorkerTable"):
            assert 1 <= redraws[name] <= 3 * ticks, (name, redraws)
        table = app.query_one(WorkerTable)
        assert table.row_count == 64  # updated in place, not rebuilt
        assert str(table.get_cell("w63", "step")).strip() == "50/50"
        assert app.query_one(LossChart).points == 50  # one mean per step, not 3,200 points


@run_async
async def test_lost_and_refused_workers_keep_their_reason_on_screen():
    app = DashboardApp(fake_state(), clock=lambda: NOW)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        table = app.query_one(WorkerTable)
        lines = panel_lines(table)
        assert all(len(line) == 80 for line in lines)
        lost = next(i for i, line in enumerate(lines) if " mac-2 " in line)
        assert " lost " in lines[lost] and "2.9012" in lines[lost]
        assert "↳ silent for 31 s (heartbeat timeout 30 s)" in lines[lost + 1]  # whole, at 80
        gpu = next(line for line in lines if " gpu-a-1 " in line)
        for text in ("cuda H1", "training", "6/10", "2.4121", "51.2k", "61G", "0s", "1.7M/1.8M"):
            assert text in gpu  # every number in view at 80 columns (names give way first)
        assert "3 active / 5 · 1 lost" in lines[-1]
    app = DashboardApp(fake_state(), clock=lambda: NOW)
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.pause()
        lines = panel_lines(app.query_one(WorkerTable))
        refused = next(i for i, line in enumerate(lines) if " refused " in line)
        assert "10.0.0.66" in lines[refused] and "↳ wrong join token" in lines[refused + 1]


@run_async
async def test_a_refresh_tick_due_as_the_app_closes_draws_nothing(monkeypatch):
    """Before: a tick that came due while the app shut down ran against a screen whose
    widgets were gone (NoMatches: 'RunHeader'); on a loaded machine the suite's dashboard
    tests failed so now and then. A tick every millisecond makes one due at the close."""
    monkeypatch.setattr(dashboard_app, "REFRESH_SECONDS", 0.001)
    app = DashboardApp(fake_state(), clock=lambda: NOW)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert "3 active / 5" in panel_lines(app.query_one(WorkerTable))[-1]


@run_async
async def test_header_fits_80_columns_and_says_what_the_run_waits_for():
    state = fake_state(status="waiting")
    state.history.clear()
    state.events.clear()
    state.emit(Waiting("waiting for 2 worker(s)"))
    for worker in state.workers.values():
        worker.state = "connecting"
    app = DashboardApp(state, clock=lambda: NOW)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        title, progress, join = panel_lines(app.query_one(RunHeader))
        assert title.startswith("  WAITING  waiting for 2 worker(s)  run 3f2a91bc")
        assert "ETA -" in progress and "workers 4/4" in progress and "…" not in progress
        assert join.strip() == f"join {state.join_command}"  # whole, on one line
        state.workers["late-3"].state = "compiling"
        app.refresh_from_state()
        await pilot.pause()
        assert "WAITING  1 worker compiling  run" in panel_lines(app.query_one(RunHeader))[0]


@run_async
async def test_event_log_wraps_long_messages_and_shows_the_newest():
    app = DashboardApp(fake_state(), clock=lambda: NOW)
    async with app.run_test(size=(60, 30)) as pilot:
        await pilot.pause()
        log = app.query_one(EventLog)
        assert log.scroll_y == log.max_scroll_y > 0
        listening = [
            line.text for line in log.lines if "join with" in line.text or "Zk3x" in line.text
        ]
        assert len(listening) >= 2  # wrapped onto a second line, not cut at the border
        assert all(line.cell_length <= log.scrollable_content_region.width for line in log.lines)


def test_round_timing_and_summary_text():
    state = fake_state(status="done")
    state.finished_at = NOW
    state.workers["mac-2"].state = "lost"
    text = summary(state)
    assert text.splitlines()[0].startswith("run 3f2a91bc done: 3/6 rounds in 1:23, train loss 2.")
    assert "4 workers (1 lost); sent 5.0 MB, received 3.9 MB" in text
    assert all(len(line) <= 80 for line in text.splitlines())


def test_worker_status_line_keeps_the_numbers_at_80_columns():
    status = WorkerStatus(shepherd="203.0.113.45:8080")
    status.update(
        state="training", round=12, step=40, total_steps=50, loss=2.25, tokens_per_second=12_345.0
    )
    status.worker_index = 17
    wide, narrow = status_line(status).plain, status_line(status, 80).plain
    assert "→ 203.0.113.45:8080" in wide and len(wide) > 80
    assert narrow.endswith("loss 2.2500 · 12,345 tok/s") and len(narrow) <= 80


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
    from pcp_tui.shepherd.coordinator import Shepherd
    from pcp_tui.training.build import build_workload

    config = small_config(rounds=40, inner_steps=5, chunk_steps=1, workers=2, eval_every=1)
    shepherd = Shepherd(config, build_workload(config, shards=2))
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
            # the next refresh tick draws them: waited for, since a loaded machine ticks late
            await wait_until(pilot, lambda: app.query_one(LossChart).points >= 5)
            assert {str(table.get_cell(key, "backend")).strip() for key in state.workers} == {"cpu"}
            screen = screen_text(app)
            # the round panel names the last round done: which one depends on the machine's speed
            assert "compute" in screen and re.search(r"round \d+", screen)
            assert "training" in screen.lower()
            await pilot.press("q")
            await wait_until(pilot, lambda: not app.is_running)
    finally:
        for process in processes:  # only after a failure: leave no worker reconnecting forever
            if process.returncode is None:
                process.kill()
    assert app.return_code == 0
    assert state.status == "cancelled" and len(state.history) < 40
    assert [p.returncode for p in processes] == [0, 0]
    assert math.isfinite(state.history[-1].train_loss)
    assert f"{len(state.history)}/40 rounds" in summary(state)


@pytest.mark.e2e
@run_async
async def test_q_before_the_local_workers_joined_ends_them_with_the_run():
    """The demo's dashboard: a worker still starting hears no goodbye, and would retry for its
    --give-up-after (30 minutes) with the app waiting on it; the app ends it instead."""
    from pcp_tui.shepherd.coordinator import Shepherd
    from pcp_tui.training.build import build_workload

    config = small_config(rounds=40, inner_steps=5, workers=1)
    shepherd = Shepherd(config, build_workload(config, shards=1))
    processes: list[trio.Process] = []

    async def spawn(nursery: trio.Nursery, port: int) -> list[trio.Process]:
        command = worker_command(port, "--quiet")
        run = functools.partial(trio.run_process, command, env=worker_env(), check=False)
        processes.append(await nursery.start(run))
        return processes

    app = DashboardApp(shepherd.state, shepherd, spawn)
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_until(pilot, lambda: bool(processes))
            await pilot.press("q")
            await wait_until(pilot, lambda: not app.is_running)
    finally:
        for process in processes:
            if process.returncode is None:
                process.kill()
    assert shepherd.state.status == "cancelled" and not shepherd.state.history
    assert all(process.returncode is not None for process in processes)


@pytest.mark.e2e
@run_async
async def test_an_app_that_ends_without_q_does_not_leave_its_guest_run_behind():
    """Whatever ends the app (an error, a test failing mid-way), the shepherd's guest run is
    cancelled and unwound on the app's loop, so the thread can start trio again."""
    from pcp_tui.shepherd.coordinator import Shepherd
    from pcp_tui.training.build import build_workload

    config = small_config(rounds=3, inner_steps=2, chunk_steps=1, workers=2)
    shepherd = Shepherd(config, build_workload(config, shards=2))
    app = DashboardApp(shepherd.state, shepherd)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: shepherd.state.status == "waiting")
        app.exit(return_code=3)  # not the q path: nobody asked the shepherd to stop
    assert not app.guest_running
    assert trio.run(trio.sleep, 0) is None  # trio's run state was released
