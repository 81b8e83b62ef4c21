"""The dashboard's views for a person who leaves it open: worker detail, event filter, small terminals."""

from __future__ import annotations

from textual.content import Content

from pcp_tui.app.dashboard.widgets import EventLog, LossChart, RoundTiming, RunHeader, WorkerTable
from pcp_tui.app.dashboard.worker_detail import WorkerDetail, WorkerHistory, sparkline
from pcp_tui.testing.dashboard import fake_state, frozen_app, panel_lines, run_async, wait_until


@run_async
async def test_enter_on_a_worker_opens_its_detail_with_statistics_and_history():
    state = fake_state()
    app = frozen_app(state)
    async with app.run_test(size=(120, 40)) as pilot:
        gpu = state.workers["gpu-a-1"]
        for step, loss in ((7, 2.40), (8, 2.35), (9, 2.30)):  # three ticks of progress
            gpu.step, gpu.loss, gpu.tokens_per_second = step, loss, 50_000.0 + step
            app.refresh_from_state()
        assert list(app.worker_history["gpu-a-1"].loss) == [2.4121, 2.40, 2.35, 2.30]
        await pilot.press("enter")  # no Tab first: the table has focus; the cursor is on worker 0
        await pilot.pause()
        assert isinstance(app.screen, WorkerDetail)
        text = "\n".join(panel_lines(app.screen.query_one("#worker-detail-body")))
        for shown in ("0 / gpu-a-1", "runtime xla", "61 GB in use, peak 72 GB of 80 GB"):
            assert shown in text, shown
        assert "97%" in text and "36 steps" in text
        assert sparkline([2.4121, 2.40, 2.35, 2.30], 10) in text
        await pilot.press("escape")
        assert not isinstance(app.screen, WorkerDetail)


def test_history_samples_only_new_training_steps():
    history = WorkerHistory()
    view = fake_state().workers["gpu-a-1"]
    history.sample(view)
    history.sample(view)  # the same step again: not a new sample
    view.state = "syncing"
    view.step += 1
    history.sample(view)  # not training: nothing
    assert list(history.loss) == [view.loss]
    assert sparkline([1, 2, 3, 4], 3) == "▁▅█" and sparkline([], 5) == "-"


@run_async
async def test_slash_filters_the_event_log_and_escape_clears_it():
    app = frozen_app(fake_state())
    async with app.run_test(size=(100, 40)) as pilot:
        log = app.query_one(EventLog)
        everything = len(log.lines)
        await pilot.press("slash", *"lost")
        await pilot.pause()
        shown = "\n".join(panel_lines(log))
        assert "worker 2 lost" in shown and "joined" not in shown
        assert log.border_subtitle == "filter: lost"
        await pilot.press("enter", "escape")
        await pilot.pause()
        assert len(log.lines) == everything and log.filter_text == ""
        await pilot.press("down", "enter")  # the keys go back to the worker table
        await pilot.pause()
        assert _detail_of(app) == "1 / laptop-7"


def _detail_of(app) -> str:
    """The "index / id" line of the open worker detail."""
    assert isinstance(app.screen, WorkerDetail)
    text = "\n".join(panel_lines(app.screen.query_one("#worker-detail-body")))
    line = next(line for line in text.splitlines() if line.startswith("index / id"))
    return line.removeprefix("index / id").strip(" │")


@run_async
async def test_arrow_keys_and_enter_pick_a_worker_as_pressed_from_the_start():
    """Nothing is focused by hand: what a person gets when the dashboard opens."""
    state = fake_state()
    app = frozen_app(state)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("down", "down", "up", "enter")
        await pilot.pause()
        assert _detail_of(app) == "1 / laptop-7"
        await pilot.press("escape", "down", "enter")  # focus comes back to the table, cursor kept
        await pilot.pause()
        assert _detail_of(app) == "2 / mac-2"


@run_async
async def test_small_terminals_drop_panels_instead_of_squeezing_the_chart():
    app = frozen_app(fake_state())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert app.query_one(RoundTiming).display and app.query_one(EventLog).display
        assert app.query_one(LossChart).size.width >= 40
        assert "workers 3/4" in "\n".join(panel_lines(app.query_one(RunHeader)))  # connected/wanted
        await pilot.resize_terminal(60, 15)
        await wait_until(pilot, lambda: not app.query_one(RoundTiming).display)  # next tick
        assert not app.query_one(EventLog).display
        assert app.query_one(LossChart).outer_size.width == 60  # the whole width, not 17 columns
        chart = "\n".join(panel_lines(app.query_one(LossChart)))
        assert "round" in chart and "┴" in chart  # round marks on a labelled axis
        await pilot.resize_terminal(60, 12)
        await wait_until(pilot, lambda: not app.query_one(WorkerTable).display)


@run_async
async def test_a_workers_texts_are_shown_as_written_not_read_as_markup():
    """Ids, host names and reasons come from workers: "[/x]" in one must be shown, not parsed
    (a markup error while rendering the detail ended the dashboard, and the run inside it)."""
    state = fake_state()
    hostile = "evil[/x] [bold]host"
    view = state.workers.pop("gpu-a-1")
    view.worker_id, view.host, view.reason = hostile, hostile, "said [/] bye"
    state.workers = {hostile: view, **state.workers}
    app = frozen_app(state)
    async with app.run_test(size=(120, 40)) as pilot:
        app.refresh_from_state()
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, WorkerDetail)
        text = "\n".join(panel_lines(app.screen.query_one("#worker-detail-body")))
        lines = {line.split("  ")[0]: line for line in text.splitlines()}
        assert f"0 / {hostile}" in lines["index / id"] and hostile in lines["host"]
        assert "said [/] bye" in text
        title = app.screen.query_one("#worker-detail").border_title  # kept as escaped markup
        assert Content.from_markup(title).plain == f"worker {hostile}"
        await pilot.press("escape")


@run_async
async def test_c_says_what_it_did_with_the_join_command_inside_tmux_and_out(monkeypatch):
    """Nothing tells an app whether OSC 52 reached a clipboard; tmux drops it unless told."""
    state = fake_state()
    for tmux, said in (
        ("/tmp/tmux-0/default,1,0", "sent to tmux, which passes it to your clipboard only with"),
        (None, "sent to the terminal's clipboard (OSC 52; some terminals ignore it)"),
    ):
        if tmux:
            monkeypatch.setenv("TMUX", tmux)
        else:
            monkeypatch.delenv("TMUX", raising=False)
        app = frozen_app(state)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("c")
            await pilot.pause()
            (note,) = [n.message for n in app._notifications]
            assert said in note and "copied" not in note
            assert note.endswith(f"it is: {state.join_command}")
            assert app.clipboard == state.join_command
