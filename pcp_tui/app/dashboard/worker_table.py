"""The workers panel: one row per worker, its numbers, and why it was lost or refused."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rich.cells import cell_len
from rich.text import Text
from textual.widgets import DataTable

from pcp_tui.app.dashboard._format import clip, compact_bytes, compact_count, loss_text
from pcp_tui.shepherd.run.state import WORKER_STATES, WorkerView

# (key, label, right-aligned). Cells carry their own one-space separator (cell padding 0):
# twelve columns fit 80 terminal columns, and a reason line can run on under them as one text.
_COLUMNS = (
    ("index", "#", True),
    ("id", "worker", False),
    ("backend", "backend", False),
    ("state", "state", False),
    ("shard", "shard", True),
    ("step", "step", True),
    ("loss", "loss", True),
    ("tps", "tok/s", True),
    ("memory", "mem", True),
    ("heard", "heard", True),
    ("bytes", "sent/recv", True),
    ("host", "host", False),
)
_STATE_WIDTH = 10  # "connecting": a fixed width keeps the columns right of it still
_ACTIVE = {"connecting", "compiling", "idle", "training", "syncing"}
_VENDORS = ("NVIDIA ", "AMD ", "Apple ")  # the platform (cuda, rocm, metal) says it already


class WorkerTable(DataTable):
    """One row per worker the run has seen, lost and refused ones included, with why.

    A worker with a reason (lost, refused, left mid-run, result refused) gets a
    second line, `↳ reason`, under its numbers. Every cell is padded to its
    column's width, so a tick only swaps the cells that changed and the table
    never re-measures; rows are rebuilt only when a worker appears, a reason
    line comes or goes, or a column's width changes (rare: the labels and the
    fixed-width numbers set most widths). Nothing jitters while numbers change.
    """

    COMPONENT_CLASSES = DataTable.COMPONENT_CLASSES | {
        f"worker-table--{state}" for state in (*WORKER_STATES, "reason")
    }

    def __init__(self, **kwargs) -> None:
        # A row cursor: Enter on a worker opens its detail view (see WorkerDetail).
        super().__init__(cursor_type="row", zebra_stripes=True, cell_padding=0, **kwargs)
        self._shown: dict[str, list[str]] = {}  # row key -> each cell's text as shown
        self._shown_with: tuple | None = None
        self._layout: tuple = ()

    def on_mount(self) -> None:
        self._add_columns()

    def _add_columns(self) -> None:
        for key, label, right in _COLUMNS:
            self.add_column(Text(f" {label}", justify="right" if right else "left"), key=key)

    def show(
        self,
        workers: Iterable[WorkerView],
        refused: Sequence[tuple[str, str]],
        *,
        now: float,
        run_over: bool = False,
    ) -> None:
        """`refused`: (peer, reason) of connections turned away at the handshake.

        Once the run is over every worker has left for the same reason: no reason lines then.
        """
        workers = list(workers)
        self._shown_with = (workers, refused, now, run_over)
        rows: dict[str, tuple[str, ...]] = {}
        reasons: dict[str, str] = {}
        for w in sorted(workers, key=lambda w: w.index):
            rows[w.worker_id] = _worker_cells(w, now)
            if w.reason and not (run_over and w.state == "left"):
                reasons[w.worker_id] = w.reason
        for peer, reason in refused:
            key = f"refused:{peer}"
            rows[key] = ("", peer, "", "refused", *[""] * (len(_COLUMNS) - 4))
            reasons[key] = reason
        room = self.scrollable_content_region.width
        rows = _clip_names(rows, room)
        widths = [
            max([len(label) + 1] + [_width(i, cells[i]) for cells in rows.values()])
            for i, (_, label, _) in enumerate(_COLUMNS)
        ]
        room = room or sum(widths)
        shown = {
            key: _row_text(cells, reasons.get(key, ""), widths, room) for key, cells in rows.items()
        }
        layout = (tuple((key, 2 if key in reasons else 1) for key in rows), tuple(widths), room)
        if layout != self._layout:
            self._rebuild(shown, layout)
        else:
            for key, texts in shown.items():
                self._update_row(key, texts)
        states = [cells[3] for cells in rows.values()]
        lost = states.count("lost")
        self.border_subtitle = f"{sum(s in _ACTIVE for s in states)} active / {len(rows)}" + (
            f" · {lost} lost" if lost else ""
        )

    def on_resize(self) -> None:
        if self._shown_with is not None:  # reason lines and clipped names follow the width
            workers, refused, now, run_over = self._shown_with
            self.show(workers, refused, now=now, run_over=run_over)

    def _rebuild(self, shown: dict[str, list[str]], layout: tuple) -> None:
        scroll_y = self.scroll_y
        self.clear(columns=True)  # columns too: a kept column never gets narrower
        self._add_columns()
        for key, height in layout[0]:
            self.add_row(
                *(self._cell(i, text) for i, text in enumerate(shown[key])), key=key, height=height
            )
        self._shown, self._layout = shown, layout
        self.call_after_refresh(self.scroll_to, y=scroll_y, animate=False)

    def _update_row(self, key: str, texts: list[str]) -> None:
        """Swap the cells that changed; their width is the column's, so nothing is re-measured."""
        shown = self._shown[key]
        for i, ((column, _, _), text) in enumerate(zip(_COLUMNS, texts, strict=True)):
            if text != shown[i]:
                self.update_cell(key, column, self._cell(i, text))
                shown[i] = text

    def _cell(self, column: int, text: str) -> Text:
        """A cell as shown: its state in the state's colour, its piece of a reason dimmed."""
        value, _, reason = text.partition("\n")
        cell = Text(value)
        if _COLUMNS[column][0] == "state" and value.strip():
            state_style = f"worker-table--{value.strip()}"
            if state_style in self.COMPONENT_CLASSES:
                style = self.get_component_rich_style(state_style, partial=True)
                cell.stylize(style, 1, len(value.rstrip()))
        if "\n" in text:
            cell.append("\n")
            cell.append(reason, self.get_component_rich_style("worker-table--reason", partial=True))
        return cell


def _row_text(cells: tuple[str, ...], reason: str, widths: list[int], room: int) -> list[str]:
    """Each cell padded to its column; with a reason, a second line holding its piece of `↳ reason`.

    Cells carry their own separator and no padding of the table's, so the pieces
    read as one line under the row.
    """
    texts = [
        f" {value}".rjust(width) if right else f" {value}".ljust(width)
        for (_, _, right), value, width in zip(_COLUMNS, cells, widths, strict=True)
    ]
    if not reason:
        return texts
    pieces = [*widths[:-1], max(room - sum(widths[:-1]), widths[-1])]
    line = clip(" ↳ " + reason, sum(pieces[1:]))
    offset = 0
    for i, width in enumerate(pieces):
        piece = "" if i == 0 else line[offset : offset + width]
        offset += 0 if i == 0 else width
        texts[i] += "\n" + (piece if i == len(pieces) - 1 else piece.ljust(width))
    return texts


def _width(column: int, value: str) -> int:
    """Cells a value takes in the table, its separator included."""
    return 1 + (_STATE_WIDTH if _COLUMNS[column][0] == "state" else cell_len(value))


_NAMES = (1, 2)  # worker id and backend: the columns that give way on a narrow terminal


def _clip_names(rows: dict[str, tuple[str, ...]], room: int) -> dict[str, tuple[str, ...]]:
    """Cut worker ids and backends so that the numbers after them stay in view.

    The room the other columns leave is shared out: a name column that needs
    less than its share gives the rest to the other. Never under 8 cells.
    """

    def need(i: int) -> int:
        return max([len(_COLUMNS[i][1]) + 1] + [_width(i, cells[i]) for cells in rows.values()])

    left = room - sum(need(i) for i in range(len(_COLUMNS) - 1) if i not in _NAMES)
    limits = {}
    for count, i in enumerate(sorted(_NAMES, key=need)):
        limits[i] = max(8, min(need(i), left // (len(_NAMES) - count)))
        left -= limits[i]
    if not room:
        return rows
    return {
        key: tuple(clip(v, limits[i] - 1) if i in _NAMES else v for i, v in enumerate(cells))
        for key, cells in rows.items()
    }


def _worker_cells(w: WorkerView, now: float) -> tuple[str, ...]:
    gone = w.state in ("lost", "refused", "left")
    total = w.total_steps
    step = f"{w.step:>{len(str(total))}}/{total}" if total else "-"
    backend = w.backend or "?"
    for vendor in _VENDORS:
        backend = backend.replace(f" {vendor}", " ", 1)
    return (
        str(w.index),
        w.worker_id,
        backend,
        w.state,
        "-" if w.shard is None else str(w.shard),
        step,
        loss_text(w.loss),
        "-" if gone or not w.tokens_per_second else compact_count(w.tokens_per_second),
        "-" if gone or not w.memory_in_use else compact_bytes(w.memory_in_use),
        "-" if gone else _ago(now - w.last_heard),
        f"{compact_bytes(w.bytes_out)}/{compact_bytes(w.bytes_in)}",
        clip(_where(w), 28),
    )


def _where(w: WorkerView) -> str:
    """Its host (a site's: +its other processes), and the relay it came through."""
    host = w.host if w.processes <= 1 else f"{w.host} +{w.processes - 1}"
    return f"{host} via {w.via}" if w.via else host


def _ago(seconds: float) -> str:
    """3s, 12m, 2h: how long since a worker was last heard from, in three cells."""
    seconds = max(seconds, 0)
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m"
    return f"{seconds // 3600:.0f}h"
