"""One worker in full (Enter on its row): identity, device, statistics, and its loss and tok/s history."""

from __future__ import annotations

import collections
from collections.abc import Callable

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from pcp_tui.app.dashboard._format import compact_count, duration, loss_text, short_bytes
from pcp_tui.shepherd.run.state import WorkerView

HISTORY = 240  # progress samples kept per worker (one per refresh tick that brought a new step)


class WorkerHistory:
    """A worker's recent loss and tokens/s, one sample per new (round, step) the dashboard saw."""

    def __init__(self) -> None:
        self.loss: collections.deque[float] = collections.deque(maxlen=HISTORY)
        self.tokens_per_second: collections.deque[float] = collections.deque(maxlen=HISTORY)
        self._last: tuple[int, int] | None = None

    def sample(self, view: WorkerView) -> None:
        position = (view.round, view.step)
        if view.state != "training" or view.loss is None or position == self._last:
            return
        self._last = position
        self.loss.append(view.loss)
        self.tokens_per_second.append(view.tokens_per_second)


def sparkline(values, width: int) -> str:
    """The latest `width` values as ▁..█, scaled between their own minimum and maximum."""
    values = list(values)[-width:]
    if not values:
        return "-"
    low, high = min(values), max(values)
    span = high - low
    if span <= 0:
        return "▄" * len(values)
    return "".join("▁▂▃▄▅▆▇█"[min(int((v - low) / span * 8), 7)] for v in values)


class WorkerDetail(ModalScreen[None]):
    """Everything the shepherd knows of one worker, refreshed with the dashboard; escape closes it."""

    BINDINGS = [Binding("escape,enter,q", "dismiss", "close")]

    def __init__(
        self,
        worker_id: str,
        read: Callable[[str], tuple[WorkerView | None, WorkerHistory | None, float]],
    ):
        super().__init__()
        self._worker_id = worker_id
        self._read = read

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="worker-detail") as scroll:
            scroll.border_title = Text(f"worker {self._worker_id}")  # a worker's text: no markup
            scroll.border_subtitle = "escape closes"
            yield Static(id="worker-detail-body")

    def on_mount(self) -> None:
        self.refresh_detail()
        self.set_interval(0.5, self.refresh_detail)

    def refresh_detail(self) -> None:
        view, history, now = self._read(self._worker_id)
        body = self.query_one("#worker-detail-body", Static)
        if view is None:
            body.update(Text("this worker is no longer listed"))
            return
        body.update(detail_renderable(view, history, now, width=max(self.size.width - 30, 10)))


def detail_renderable(view: WorkerView, history: WorkerHistory | None, now: float, *, width: int):
    """The detail as a grid of (what, value) rows and, under it, the history sparklines."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    memory = "-"
    if view.memory_in_use:
        memory = (
            f"{short_bytes(view.memory_in_use)} in use, peak {short_bytes(view.memory_peak or 0)}"
        )
        if view.memory_limit:
            memory += f" of {short_bytes(view.memory_limit)}"
    gpu = "-" if view.gpu_utilization is None else f"{view.gpu_utilization:.0%}"
    compiled = "-" if view.compile_seconds is None else f"{view.compile_seconds:.1f} s"
    rows = (
        ("index / id", f"{view.index} / {view.worker_id}"),
        ("host", ", ".join(view.hosts) if view.processes > 1 and view.hosts else view.host),
        (
            "backend",
            f"{view.backend or '?'} · runtime {view.runtime or '?'} · {view.devices} device(s)",
        ),
        ("state", view.state + (f" ({view.reason})" if view.reason else "")),
        ("shard", "-" if view.shard is None else str(view.shard)),
        ("round / step", f"{view.round} / {view.step} of {view.total_steps}"),
        ("loss", loss_text(view.loss)),
        ("tokens/s", compact_count(view.tokens_per_second)),
        ("trained", f"{view.steps_trained:,} steps, {compact_count(view.tokens_trained)} tokens"),
        ("compile", compiled),
        ("device memory", memory),
        ("GPU utilization", gpu),
        ("sent / received", f"{short_bytes(view.bytes_out)} / {short_bytes(view.bytes_in)}"),
        ("rounds contributed", str(view.rounds_contributed)),
        ("last heard", f"{duration(now - view.last_heard)} ago"),
    )
    for what, value in rows:
        grid.add_row(what, Text(value))  # values hold a worker's own texts: never markup
    if history is not None:
        grid.add_row("", "")
        grid.add_row("loss history", sparkline(history.loss, width))
        grid.add_row("tok/s history", sparkline(history.tokens_per_second, width))
    return Group(grid)
