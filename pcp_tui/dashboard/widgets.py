"""The dashboard's panels. Each takes plain data from the app's refresh tick; none touches the shepherd."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence

from rich.console import Group
from rich.style import Style
from rich.table import Table
from rich.text import Text
from textual.widget import Widget
from textual.widgets import DataTable, RichLog, Static

from ..headless import human_bytes
from ..state import Event, RoundRecord, RunState, WorkerView
from ._braille import BrailleCanvas


def duration(seconds: float | None) -> str:
    """12:03 or 1:02:03; '-' when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    minutes, secs = divmod(int(max(seconds, 0)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def compact_count(value: float) -> str:
    """1234567 -> '1.23M': parameter counts and tokens/s in narrow columns."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.0f}"


def loss_text(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.4f}"


class RunHeader(Static):
    """Run id, model, algorithm, progress through the rounds, and the join command."""

    COMPONENT_CLASSES = {
        "run-header--title",
        "run-header--dim",
        "run-header--join",
        "run-header--bar",
        "run-header--bar-empty",
        "run-header--starting",
        "run-header--waiting",
        "run-header--training",
        "run-header--paused",
        "run-header--done",
        "run-header--failed",
        "run-header--stopped",
    }

    def show(self, state: RunState, *, now: float, status: str, note: str = "") -> None:
        style = self.get_component_rich_style
        dim = style("run-header--dim")
        s = state.settings
        status_style = style(f"run-header--{status if status in _STATUSES else 'paused'}")
        title = Text(no_wrap=True, overflow="ellipsis")
        title.append(f" {status.upper()} ", status_style)
        title.append(f" run {state.run_id} ", style("run-header--title"))
        model = state.model_name or "model"
        title.append(
            f" {model} {compact_count(state.param_count)} params", style("run-header--title")
        )
        title.append(
            f" · {s.get('algorithm', 'DiLoCo')} H={s.get('inner_steps', '?')}"
            f" · inner {s.get('inner_optimizer', '?')} lr {s.get('inner_lr', '?')}"
            f" · outer {s.get('outer_optimizer', '?')} lr {s.get('outer_lr', '?')}"
            f" · {s.get('compression', 'none')}",
            dim,
        )
        elapsed = (state.finished_at or now) - state.started_at
        done_rounds, total = len(state.history), max(state.rounds_total, 1)
        progress = Text(no_wrap=True, overflow="ellipsis")
        progress.append(f"round {state.round}/{state.rounds_total} ")
        filled = round(12 * done_rounds / total)
        progress.append("━" * filled, style("run-header--bar"))
        progress.append("━" * (12 - filled), style("run-header--bar-empty"))
        if note:
            progress.append(
                f" {note} ", style(f"run-header--{status if status in _STATUSES else 'paused'}")
            )
        eta = None if state.finished_at is not None else state.eta_seconds()
        progress.append(f" elapsed {duration(elapsed)}  ETA {duration(eta)}")
        progress.append(
            f"  workers {len(state.active_workers())}/{len(state.workers)}"
            f"  ↑{human_bytes(state.bytes_sent)} ↓{human_bytes(state.bytes_received)}",
            dim,
        )
        join = Text(overflow="fold")
        join.append("join ", dim)
        join.append(state.join_command or "(not listening yet)", style("run-header--join"))
        self.update(Group(title, progress, join))


_STATUSES = ("starting", "waiting", "training", "paused", "done", "failed", "stopped")


class LossChart(Widget):
    """Training loss per inner step (mean over workers) and eval loss per round, as braille lines.

    `l` toggles a log y axis; `z` zooms to the latest half / quarter of the steps,
    so the slow late part of training is not flattened by the first steep drop.
    """

    COMPONENT_CLASSES = {
        "loss-chart--train",
        "loss-chart--eval",
        "loss-chart--axis",
        "loss-chart--empty",
    }
    WINDOWS = (1.0, 0.5, 0.25)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._train: list[tuple[int, float]] = []
        self._evals: list[tuple[int, float]] = []
        self.log_scale = True
        self.window = 0

    @property
    def points(self) -> int:
        """Training-loss points the chart holds (before averaging them per column)."""
        return len(self._train)

    def set_data(self, train: Iterable[tuple], evals: Iterable[tuple[int, float]]) -> None:
        """`train`: (global step, loss, ...) from any worker; `evals`: (global step, eval loss)."""
        self._train = [(int(p[0]), float(p[1])) for p in train if math.isfinite(p[1])]
        self._evals = [(int(s), float(v)) for s, v in evals if math.isfinite(v)]
        self._update_subtitle()
        self.refresh()

    def toggle_log(self) -> None:
        self.log_scale = not self.log_scale
        self._update_subtitle()
        self.refresh()

    def cycle_window(self) -> None:
        self.window = (self.window + 1) % len(self.WINDOWS)
        self._update_subtitle()
        self.refresh()

    def _update_subtitle(self) -> None:
        latest = (
            f"[$primary-lighten-2]━[/] train {self._train[-1][1]:.4f}" if self._train else "train -"
        )
        if self._evals:
            latest += f" [$accent]━[/] eval {self._evals[-1][1]:.4f}"
        scope = "" if self.window == 0 else f" · {self.WINDOWS[self.window]:.0%}"
        self.border_subtitle = f"{latest} · {'log' if self.log_scale else 'lin'}{scope}"

    def render(self) -> Text:
        width, height = self.size.width, self.size.height
        axis = self.get_component_rich_style("loss-chart--axis")
        if not self._train and not self._evals:
            return Text(
                "waiting for the first inner steps…",
                self.get_component_rich_style("loss-chart--empty"),
            )
        label_width = 7
        canvas = BrailleCanvas(width - label_width, height - 1)
        if canvas.width < 4 or canvas.height < 2:
            return Text(f"loss {self._train[-1][1]:.4f}" if self._train else "")
        x_lo, x_hi = self._x_range()
        train = _column_means(self._train, x_lo, x_hi, canvas.pixel_width)
        evals = [
            (_x_pixel(s, x_lo, x_hi, canvas.pixel_width), v) for s, v in self._evals if s >= x_lo
        ]
        values = [v for _, v in train] + [v for _, v in evals]
        y_lo, y_hi = _y_range(values, self.log_scale)

        def y_pixel(value: float) -> int:
            scaled = _scale(value, self.log_scale)
            return round((y_hi - scaled) / (y_hi - y_lo) * (canvas.pixel_height - 1))

        for series, points in ((0, train), (1, evals)):
            pixels = [(x, y_pixel(v)) for x, v in points]
            for (xa, ya), (xb, yb) in zip(pixels, pixels[1:], strict=False):
                canvas.line(xa, ya, xb, yb, series)
            if len(pixels) == 1 or series == 1:
                for x, y in pixels:
                    canvas.point(x, y, series)
        styles = {
            0: self.get_component_rich_style("loss-chart--train"),
            1: self.get_component_rich_style("loss-chart--eval"),
        }
        lines = []
        labels = _axis_rows(canvas.height)
        for row, cells in enumerate(canvas.rows()):
            line = Text(no_wrap=True)
            if row in labels:
                centre = (row * 4 + 1.5) / (canvas.pixel_height - 1)
                line.append(
                    f"{_fmt_axis(_unscale(y_hi - centre * (y_hi - y_lo), self.log_scale)):>6}┤",
                    axis,
                )
            else:
                line.append("      │", axis)
            for char, series in cells:
                line.append(char, styles.get(series, Style()))
            lines.append(line)
        lines.append(
            Text(" " * label_width + _x_labels(x_lo, x_hi, canvas.width), axis, no_wrap=True)
        )
        return Text("\n").join(lines)

    def _x_range(self) -> tuple[int, int]:
        steps = [s for s, _ in self._train] + [s for s, _ in self._evals]
        x_lo, x_hi = min(steps), max(steps)
        x_lo = max(x_lo, x_hi - math.ceil((x_hi - x_lo) * self.WINDOWS[self.window]))
        return x_lo, max(x_hi, x_lo + 1)


def _axis_rows(height: int) -> set[int]:
    """Rows that get a y label: about one in three, always the top and the bottom."""
    count = max(2, min(height // 3, 8))
    return {round(i * (height - 1) / (count - 1)) for i in range(count)}


def _x_labels(x_lo: int, x_hi: int, width: int) -> str:
    """Step numbers under the plot, about every 16 columns, the last one flush right."""
    line = [" "] * width
    ticks = max(2, width // 16)
    for i in range(ticks):
        text = str(round(x_lo + i * (x_hi - x_lo) / (ticks - 1)))
        start = min(round(i * (width - 1) / (ticks - 1)), width - len(text))
        if all(c == " " for c in line[max(start - 1, 0) : start + len(text)]):
            line[start : start + len(text)] = text
    return "".join(line)


def _x_pixel(step: int, x_lo: int, x_hi: int, pixels: int) -> int:
    return round((step - x_lo) / (x_hi - x_lo) * (pixels - 1))


def _column_means(
    points: Sequence[tuple[int, float]], x_lo: int, x_hi: int, pixels: int
) -> list[tuple[int, float]]:
    """Average every worker's losses that land on the same pixel column: one readable line for 64 workers."""
    sums: dict[int, list[float]] = {}
    for step, loss in points:
        if step >= x_lo:
            cell = sums.setdefault(_x_pixel(step, x_lo, x_hi, pixels), [0.0, 0])
            cell[0] += loss
            cell[1] += 1
    return [(x, total / count) for x, (total, count) in sorted(sums.items())]


def _scale(value: float, log: bool) -> float:
    return math.log10(max(value, 1e-6)) if log else value


def _unscale(value: float, log: bool) -> float:
    return 10**value if log else value


def _y_range(values: Sequence[float], log: bool) -> tuple[float, float]:
    scaled = [_scale(v, log) for v in values]
    lo, hi = min(scaled), max(scaled)
    pad = (hi - lo) * 0.05 or (0.01 if log else max(abs(hi) * 0.05, 0.01))
    return lo - pad, hi + pad


def _fmt_axis(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"


class RoundTiming(Static):
    """Last and mean round time, split into compute / communication / waiting for stragglers."""

    COMPONENT_CLASSES = {
        "round-timing--compute",
        "round-timing--comm",
        "round-timing--wait",
        "round-timing--dim",
    }

    def show(self, history: Sequence[RoundRecord]) -> None:
        style = self.get_component_rich_style
        if not history:
            self.update(Text("no round finished yet", style("round-timing--dim")))
            return
        last = history[-1]
        n = len(history)

        def mean(field: str) -> float:
            return sum(getattr(r, field) for r in history) / n

        grid = Table.grid(padding=(0, 1), expand=True)
        grid.add_column("what", no_wrap=True)
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
        grid.add_row("round", f"{last.round_seconds:.2f}s", f"{mean('round_seconds'):.2f}s")
        grid.add_row(
            "tokens/s",
            compact_count(last.tokens_per_second),
            compact_count(mean("tokens_per_second")),
        )
        grid.add_row(
            "bytes",
            human_bytes(last.bytes_sent + last.bytes_received),
            human_bytes(mean("bytes_sent") + mean("bytes_received")),
        )
        if last.bytes_saved:
            grid.add_row("saved", human_bytes(last.bytes_saved), human_bytes(mean("bytes_saved")))
        spark = _sparkline([r.round_seconds for r in history[-(self.size.width or 30) :]])
        self.update(
            Group(
                grid,
                Text(""),
                Text("round time per round", style("round-timing--dim")),
                Text(spark, style("round-timing--compute")),
            )
        )


def _sparkline(values: Sequence[float]) -> str:
    """▁▃▇: one character per value, scaled from zero to the largest."""
    top = max(values, default=0.0)
    if top <= 0:
        return ""
    return "".join("▁▂▃▄▅▆▇█"[min(int(v / top * 8), 7)] for v in values)


_COLUMNS = (
    ("#", "index"),
    ("worker", "id"),
    ("backend", "backend"),
    ("state", "state"),
    ("step", "step"),
    ("loss", "loss"),
    ("tok/s", "tps"),
    ("heard", "heard"),
    ("reason", "reason"),
    ("host", "host"),
    ("in/out", "bytes"),
)


class WorkerTable(DataTable):
    """One row per worker the run has seen, lost and refused ones included, with why."""

    COMPONENT_CLASSES = DataTable.COMPONENT_CLASSES | {
        f"worker-table--{state}"
        for state in (
            "connecting",
            "compiling",
            "idle",
            "training",
            "syncing",
            "lost",
            "refused",
            "left",
        )
    }

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self._cells: dict[str, tuple] = {}

    def on_mount(self) -> None:
        for label, key in _COLUMNS:
            self.add_column(label, key=key)

    def show(
        self, workers: Iterable[WorkerView], refused: Sequence[tuple[str, str]], *, now: float
    ) -> None:
        """`refused`: (peer, reason) of connections turned away at the handshake."""
        rows = {w.worker_id: self._row(w, now) for w in sorted(workers, key=lambda w: w.index)}
        for peer, reason in refused:
            rows[f"refused:{peer}"] = (
                "-",
                "-",
                "-",
                self._state("refused"),
                "",
                "",
                "",
                "",
                reason,
                peer,
                "",
            )
        for key, cells in rows.items():
            old = self._cells.get(key)
            if old is None:
                self.add_row(*cells, key=key)
            else:
                for (_, column), new, previous in zip(_COLUMNS, cells, old, strict=True):
                    if new != previous:
                        self.update_cell(key, column, new, update_width=True)
            self._cells[key] = cells
        self.border_subtitle = (
            f"{sum(1 for c in rows.values() if c[3].plain in _ACTIVE)} active / {len(rows)}"
        )

    def _row(self, w: WorkerView, now: float) -> tuple:
        step = f"{w.step}/{w.total_steps}" if w.total_steps else "-"
        heard = "-" if w.state in ("lost", "left") else f"{max(now - w.last_heard, 0):.0f}s"
        return (
            str(w.index),
            w.worker_id,
            w.backend or "?",
            self._state(w.state),
            step,
            loss_text(w.loss),
            compact_count(w.tokens_per_second) if w.tokens_per_second else "-",
            heard,
            w.reason,
            w.host,
            f"{human_bytes(w.bytes_in)}/{human_bytes(w.bytes_out)}",
        )

    def _state(self, state: str) -> Text:
        if f"worker-table--{state}" in self.COMPONENT_CLASSES:
            return Text(
                state, self.get_component_rich_style(f"worker-table--{state}", partial=True)
            )
        return Text(state)


_ACTIVE = {"connecting", "compiling", "idle", "training", "syncing"}


class EventLog(RichLog):
    """What happened, newest at the bottom; appended incrementally by the app."""

    COMPONENT_CLASSES = {"event-log--time", "event-log--bad", "event-log--good", "event-log--round"}
    _BAD = {
        "lost",
        "refused",
        "failed",
        "bad_result",
        "stragglers",
        "round_repeated",
        "late_result",
    }
    _GOOD = {"joined", "rejoined", "compiled", "done", "listening", "resumed"}

    def __init__(self, **kwargs) -> None:
        super().__init__(wrap=False, markup=False, max_lines=2_000, **kwargs)

    def add_events(self, events: Iterable[Event]) -> None:
        style = self.get_component_rich_style
        for event in events:
            line = Text(no_wrap=True)
            line.append(
                time.strftime("%H:%M:%S ", time.localtime(event.at)), style("event-log--time")
            )
            if event.kind in self._BAD:
                kind_style = style("event-log--bad")
            elif event.kind in self._GOOD:
                kind_style = style("event-log--good")
            else:
                kind_style = style("event-log--round") if event.kind == "round" else Style()
            line.append(_describe(event), kind_style)
            self.write(line)


def _describe(event: Event) -> str:
    record = event.data.get("record")
    if event.kind == "round" and isinstance(record, RoundRecord):
        eval_text = f" eval {record.eval_loss:.4f}" if record.eval_loss is not None else ""
        return (
            f"{event.message}: train {record.train_loss:.4f}{eval_text} in {record.round_seconds:.2f} s"
            f" ({record.workers} worker{'s' if record.workers != 1 else ''})"
        )
    return event.message
