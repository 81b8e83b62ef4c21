"""The help screen (`?`): every key and what each panel shows."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP_KEYS = (
    (
        "q",
        "end the run for good: finish the round, tell the workers to exit (again: stop at once)",
    ),
    ("p", "pause after the current round; p again resumes"),
    ("l", "loss chart: log or linear y axis"),
    ("z", "loss chart: all steps, the latest half, the latest quarter"),
    ("c", "copy the join command to the clipboard (OSC 52)"),
    (
        "↑↓ enter",
        "pick a worker in the table; enter opens its detail (memory, statistics, history)",
    ),
    ("/", "filter the event log: only lines holding the text (escape clears it)"),
    ("?", "this help; escape closes it"),
)
HELP_PANELS = (
    (
        "Loss",
        "training loss per inner step (mean over workers, ━) and held-out loss per round (●);"
        " the x axis is marked at round ends",
    ),
    (
        "Round time",
        "last round and mean: compute (slowest worker), communication, waiting for stragglers;"
        " util: compute / wall time; bytes vs data parallel (DP); tok/s, util and time per round",
    ),
    (
        "Workers",
        "every worker seen; lost and refused ones stay listed with the reason;"
        " mem: its device memory in use; heard: since its last message;"
        " sent/recv: bytes the shepherd sent it / got from it; enter: its detail",
    ),
)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "close help")]

    def compose(self) -> ComposeResult:
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        for key, what in (*HELP_KEYS, ("", ""), *HELP_PANELS):
            grid.add_row(key, what)
        with VerticalScroll(id="help") as scroll:
            scroll.border_title = "PCP-TUI keys"
            yield Static(grid)
