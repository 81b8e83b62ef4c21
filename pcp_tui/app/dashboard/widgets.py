"""The dashboard's panels. Each takes plain data from the app's refresh tick; none touches the shepherd."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Sequence

from rich.console import Group
from rich.style import Style
from rich.table import Table
from rich.text import Text
from textual import events
from textual.widgets import RichLog, Static

from pcp_tui.app.dashboard._format import compact_count, duration, short_bytes
from pcp_tui.app.dashboard.loss_chart import LossChart
from pcp_tui.app.dashboard.worker_table import WorkerTable
from pcp_tui.app.headless import human_bytes
from pcp_tui.config.run import ShardingConfig
from pcp_tui.shepherd.run.events import Event, RoundDone
from pcp_tui.shepherd.run.history import RoundRecord
from pcp_tui.shepherd.run.state import RunState, RunStatus

__all__ = ["EventLog", "LossChart", "RoundTiming", "RunHeader", "WorkerTable"]


def _fit(candidates: Sequence[Text], width: int) -> Text:
    """The first candidate that fits `width` cells, else the last (which ends in an ellipsis)."""
    for candidate in candidates:
        if candidate.cell_len <= width:
            return candidate
    return candidates[-1]


_STATUSES = tuple(RunStatus)


class RunHeader(Static):
    """Status and note, run id, model, algorithm; progress through the rounds; the join command.

    Each line is fitted to the terminal's width: the long form when it fits, a
    shorter one otherwise, so an 80-column terminal loses words, not values.
    """

    COMPONENT_CLASSES = {
        "run-header--title",
        "run-header--dim",
        "run-header--note",
        "run-header--join",
        "run-header--bar",
        "run-header--bar-empty",
        *(f"run-header--{status}" for status in (*_STATUSES, "stopping")),
    }
    _shown: tuple | None = None

    def show(self, state: RunState, *, now: float, status: str, note: str = "") -> None:
        self._shown = (state, now, status, note)
        width = self.content_size.width or 80
        self.update(
            Group(
                self._title(state, status, note, width),
                self._progress(state, now, width),
                self._join(state.join_command, width),
            )
        )

    def on_resize(self, event: events.Resize) -> None:
        if self._shown is not None:  # fit the lines to the new width
            state, now, status, note = self._shown
            self.show(state, now=now, status=status, note=note)

    def _title(self, state: RunState, status: str, note: str, width: int) -> Text:
        style = self.get_component_rich_style
        badge_style = f"run-header--{status}"
        if badge_style not in self.COMPONENT_CLASSES:
            badge_style = "run-header--paused"
        candidates = []
        for title, details in _run_description(state):
            line = Text(no_wrap=True, overflow="ellipsis")
            line.append(f" {status.upper()} ", style(badge_style))
            if note:
                line.append(f" {note} ", style("run-header--note"))
            line.append(f" {title}", style("run-header--title"))
            line.append(details, style("run-header--dim"))
            candidates.append(line)
        return _fit(candidates, width)

    def _progress(self, state: RunState, now: float, width: int) -> Text:
        style = self.get_component_rich_style
        elapsed = (state.finished_at or now) - state.started_at
        eta = None if state.finished_at is not None else state.eta_seconds()
        head = f"round {state.round}/{state.rounds_total} "
        times = f" elapsed {duration(elapsed)}  ETA {duration(eta)}"
        wanted = state.settings.get("workers") or len(state.workers)
        traffic = (
            f"  workers {len(state.active_workers())}/{wanted}"  # connected / wanted
            f"  ↑{human_bytes(state.bytes_sent)} ↓{human_bytes(state.bytes_received)}"
        )
        bar = max(6, min(24, width - len(head) - len(times) - len(traffic)))
        filled = round(bar * len(state.history) / max(state.rounds_total, 1))
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(head)
        line.append("━" * min(filled, bar), style("run-header--bar"))
        line.append("━" * max(bar - filled, 0), style("run-header--bar-empty"))
        line.append(times)
        line.append(traffic, style("run-header--dim"))
        return line

    def _join(self, command: str, width: int) -> Text:
        style = self.get_component_rich_style
        line = Text(overflow="fold")
        line.append("join ", style("run-header--dim"))
        line.append(command or "(not listening yet)", style("run-header--join"))
        if command and line.cell_len + 12 <= width:
            line.append("  c copies", style("run-header--dim"))
        return line


DEFAULT_SHARDING = ShardingConfig().mode  # the header names another mode only


def _run_description(state: RunState) -> list[tuple[str, str]]:
    """(title, details) from the longest to the shortest wording."""
    s = state.settings
    model = state.model_name or "model"
    params = compact_count(state.param_count)
    algorithm, inner_steps = s.get("algorithm", "DiLoCo"), s.get("inner_steps", "?")
    inner, inner_lr = s.get("inner_optimizer", "?"), s.get("inner_lr", "?")
    outer, outer_lr = s.get("outer_optimizer", "?"), s.get("outer_lr", "?")
    momentum = (
        f" momentum {s['outer_momentum']}" if outer == "nesterov" and "outer_momentum" in s else ""
    )
    compression = s.get("compression") or "none"
    compressed = "" if compression == "none" else f" · {compression}"
    if s.get("sharding", DEFAULT_SHARDING) != DEFAULT_SHARDING:  # inside multi-device workers
        compressed += f" · {s['sharding']}"
    run = f"run {state.run_id}"
    return [
        (
            f"{run} · {model} {params} params",
            f" · {algorithm} H={inner_steps} · inner {inner} lr {inner_lr}"
            f" · outer {outer} lr {outer_lr}{momentum}{compressed}",
        ),
        (
            f"{run} · {model} {params}",
            f" · {algorithm} H={inner_steps} · {inner} {inner_lr} · {outer} {outer_lr}{compressed}",
        ),
        (f"{run} · {model} {params}", f" · {algorithm} H={inner_steps}{compressed}"),
        (f"{run} · {model}", f" · H={inner_steps}"),
    ]


class RoundTiming(Static):
    """Last and mean round time, split into compute / communication / waiting for stragglers.

    Then `util` (the contributors' compute / their wall time), throughput, bytes,
    and how many times fewer bytes than synchronous data parallelism (DP).

    Under them, one sparkline per round for throughput, utilization and round
    time: how the run has been going, not only its last round.

    Rows are in order of importance: a short panel (80x24) cuts the bottom ones.
    """

    COMPONENT_CLASSES = {
        "round-timing--compute",
        "round-timing--comm",
        "round-timing--wait",
        "round-timing--dim",
    }

    _history: Sequence[RoundRecord] = ()

    def on_resize(self, event: events.Resize) -> None:
        self.show(self._history)  # the sparkline holds as many rounds as there are cells

    def show(self, history: Sequence[RoundRecord]) -> None:
        self._history = history
        style = self.get_component_rich_style
        if not history:
            self.update(Text("no round finished yet", style("round-timing--dim")))
            return
        last = history[-1]
        n = len(history)

        def mean(field: str) -> float:
            return sum(getattr(r, field) for r in history) / n

        grid = Table.grid(padding=(0, 1), expand=True)
        grid.add_column("what", no_wrap=True, min_width=14)
        grid.add_column("last", justify="right", no_wrap=True)
        grid.add_column("mean", justify="right", no_wrap=True)
        grid.add_row(
            Text(f"round {last.round}", style("round-timing--dim")),
            Text("last", style("round-timing--dim")),
            Text(f"mean/{n}", style("round-timing--dim")),
        )
        total = max(last.round_seconds, 1e-9)
        for label, field, part in (
            ("compute", "compute_seconds", "compute"),
            ("comm", "communication_seconds", "comm"),
            ("waiting", "straggler_seconds", "wait"),
        ):
            value = getattr(last, field)
            bar = "█" * max(round(6 * value / total), 1 if value > 0 else 0)
            grid.add_row(
                Text.assemble((f"{bar:<6} ", style(f"round-timing--{part}")), label),
                f"{value:.2f}s",
                f"{mean(field):.2f}s",
            )
        _add_totals(grid, history)
        room = max((self.content_size.width or 30) - 7, 1)
        recent = history[-room:]
        trends = [
            Text.assemble(
                (f"{label:<7}", style("round-timing--dim")),
                (_sparkline([getattr(r, field) for r in recent]), style(f"round-timing--{part}")),
            )
            for label, field, part in (
                ("tok/s", "tokens_per_second", "compute"),
                ("util", "utilization", "compute"),
                ("time", "round_seconds", "comm"),
            )
        ]
        self.update(Group(grid, *trends))


def _add_totals(grid: Table, history: Sequence[RoundRecord]) -> None:
    """Rows under the timing bars, last round and mean: round time, utilization, tokens, bytes."""
    last, n = history[-1], len(history)

    def mean(field: str) -> float:
        return sum(getattr(r, field) for r in history) / n

    grid.add_row("round", f"{last.round_seconds:.2f}s", f"{mean('round_seconds'):.2f}s")
    grid.add_row("util", f"{last.utilization:.0%}", f"{mean('utilization'):.0%}")
    grid.add_row(
        "tokens/s", compact_count(last.tokens_per_second), compact_count(mean("tokens_per_second"))
    )
    grid.add_row(
        "bytes",
        short_bytes(last.bytes_exchanged),
        short_bytes(mean("bytes_sent") + mean("bytes_received")),
    )
    ratios = [r for r in (record.data_parallel_ratio() for record in history) if r is not None]
    if last.data_parallel_ratio() is not None:  # then `ratios` ends with the last round's
        grid.add_row("fewer than DP", _times(ratios[-1]), _times(sum(ratios) / len(ratios)))
    if last.bytes_saved:
        grid.add_row("saved", short_bytes(last.bytes_saved), short_bytes(mean("bytes_saved")))


def _times(ratio: float) -> str:
    """x84: data-parallel bytes / bytes exchanged (below x1, DiLoCo moved more)."""
    return f"x{ratio:,.0f}" if ratio >= 10 else f"x{ratio:.1f}"


def _sparkline(values: Sequence[float]) -> str:
    """▁▃▇: one character per value, scaled from zero to the largest."""
    top = max(values, default=0.0)
    if top <= 0:
        return ""
    return "".join("▁▂▃▄▅▆▇█"[min(int(v / top * 8), 7)] for v in values)


class EventLog(RichLog):
    """What happened, newest at the bottom; appended incrementally by the app.

    `set_filter` narrows it to the lines holding a text (the `/` key), redrawn
    from the events it keeps; new events that match keep arriving.

    Long messages wrap under their own text (not under the time), so a lost
    worker's reason is readable at 80 columns.
    """

    COMPONENT_CLASSES = {"event-log--time", "event-log--bad", "event-log--good", "event-log--round"}
    _BAD = {
        "lost",
        "refused",
        "worker_refused",
        "failed",
        "bad_result",
        "stragglers",
        "round_repeated",
        "late_result",
        "checkpoint_failed",
        "metrics_failed",
        "not_resumable",
        "shard_orphaned",
        "eval_skipped",
    }
    _GOOD = {
        "joined",
        "rejoined",
        "compiled",
        "done",
        "listening",
        "resumed",
        "checkpoint",
        "shard_adopted",
    }

    def __init__(self, **kwargs) -> None:
        super().__init__(wrap=True, markup=False, max_lines=2_000, min_width=20, **kwargs)
        self._events: collections.deque[Event] = collections.deque(maxlen=2_000)
        self.filter_text = ""

    def set_filter(self, text: str) -> None:
        """Show only the events whose line holds `text` (any case); "" shows them all again."""
        self.filter_text = text.strip().lower()
        self.border_subtitle = f"filter: {text.strip()}" if self.filter_text else ""
        self.clear()
        self._write(self._events)

    def on_resize(self, event: events.Resize) -> None:
        # Lines written before the first layout are rendered now (by RichLog); show the newest.
        self.call_after_refresh(self.scroll_end, animate=False)

    def add_events(self, events: Iterable[Event]) -> None:
        events = list(events)
        self._events.extend(events)
        self._write(events)

    def _write(self, events: Iterable[Event]) -> None:
        style = self.get_component_rich_style
        for event in events:
            text = _describe(event)
            if self.filter_text and self.filter_text not in f"{event.kind} {text}".lower():
                continue
            if event.kind in self._BAD:
                kind_style = style("event-log--bad")
            elif event.kind in self._GOOD:
                kind_style = style("event-log--good")
            else:
                kind_style = style("event-log--round") if event.kind == "round" else Style()
            line = Table.grid(padding=(0, 1), expand=True)
            line.add_column(no_wrap=True)
            line.add_column(ratio=1, overflow="fold")
            line.add_row(
                Text(time.strftime("%H:%M:%S", time.localtime(event.at)), style("event-log--time")),
                Text(text, kind_style),
            )
            self.write(line, expand=True)


def _describe(event: Event) -> str:
    if isinstance(event, RoundDone):
        record = event.record
        eval_text = f" eval {record.eval_loss:.4f}" if record.eval_loss is not None else ""
        return (
            f"{event.message}: train {record.train_loss:.4f}{eval_text} in {record.round_seconds:.2f} s"
            f" ({record.workers} worker{'s' if record.workers != 1 else ''})"
        )
    return event.message
