"""The loss chart: mean training loss per inner step and held-out loss per round, in braille."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from pcp_tui.app.dashboard._braille import BrailleCanvas

EVAL_MARK = "●"


class StepMeans:
    """Mean training loss per global step over every worker, kept up to date incrementally.

    `RunState.step_losses` is a bounded deque that every progress message appends
    to; re-reading all of it on each refresh tick costs time that grows with the
    number of workers, and its bound would cut the start of the chart off in long
    runs. This reads only what arrived since the last call (found by identity of
    the last entry seen, which this object keeps alive) and keeps (sum, count) per step.
    """

    def __init__(self) -> None:
        self._sums: dict[int, list[float]] = {}
        self._last_seen: tuple | None = None

    def update(self, step_losses: Sequence[tuple]) -> bool:
        """Take in the entries appended since the last call; True when there were any."""
        new = []
        for entry in reversed(step_losses):
            if entry is self._last_seen:
                break
            new.append(entry)
        if not new:
            return False
        self._last_seen = step_losses[-1]
        for step, loss, *_ in reversed(new):
            if math.isfinite(loss):
                cell = self._sums.setdefault(int(step), [0.0, 0])
                cell[0] += loss
                cell[1] += 1
        return True

    def points(self) -> list[tuple[int, float]]:
        """(global step, mean loss), in step order."""
        return [(step, total / count) for step, (total, count) in sorted(self._sums.items())]


class LossChart(Widget):
    """Training loss per inner step (mean over workers) and eval loss per round (●), in braille.

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
        self._inner_steps = 0
        self.log_scale = True
        self.window = 0

    @property
    def points(self) -> int:
        """Training-loss steps the chart holds (before averaging them per column)."""
        return len(self._train)

    def set_data(
        self,
        train: Iterable[tuple[int, float]],
        evals: Iterable[tuple[int, float]],
        *,
        inner_steps: int = 0,
    ) -> None:
        """`train`: (global step, mean loss) in step order; `evals`: (global step, eval loss).

        With `inner_steps` (H) the x axis is marked and labelled in rounds (round r
        ends at step r x H), else in steps.
        """
        self._inner_steps = max(int(inner_steps), 0)
        self._train = [(int(s), float(v)) for s, v in train if math.isfinite(v)]
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
            latest += f" [$accent]{EVAL_MARK}[/] eval {self._evals[-1][1]:.4f}"
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
        canvas = BrailleCanvas(width - label_width, height - 2)
        if canvas.width < 4 or canvas.height < 2:
            return Text(f"loss {self._train[-1][1]:.4f}" if self._train else "")
        x_lo, x_hi = self._x_range()
        train = _column_means(self._train, x_lo, x_hi, canvas.pixel_width)
        evals = [
            (_x_pixel(s, x_lo, x_hi, canvas.pixel_width), v) for s, v in self._evals if s >= x_lo
        ]
        y_lo, y_hi = _y_range([v for _, v in train] + [v for _, v in evals], self.log_scale)

        def y_pixel(value: float) -> int:
            scaled = _scale(value, self.log_scale)
            return round((y_hi - scaled) / (y_hi - y_lo) * (canvas.pixel_height - 1))

        for series, points in ((0, train), (1, evals)):
            pixels = [(x, y_pixel(v)) for x, v in points]
            for (xa, ya), (xb, yb) in zip(pixels, pixels[1:], strict=False):
                canvas.line(xa, ya, xb, yb, series)
            if len(pixels) == 1:
                canvas.point(*pixels[0], series)
            if series == 1:
                for x, y in pixels:
                    canvas.mark(x, y, EVAL_MARK, series)
        styles = {
            0: self.get_component_rich_style("loss-chart--train"),
            1: self.get_component_rich_style("loss-chart--eval"),
        }
        labels = _y_labels(
            _unscale(y_lo, self.log_scale), _unscale(y_hi, self.log_scale), canvas.height, y_pixel
        )
        lines = []
        for row, cells in enumerate(canvas.rows()):
            line = Text(no_wrap=True)
            line.append(f"{labels[row]:>6}┤" if row in labels else "      │", axis)
            for char, series in cells:
                line.append(char, styles.get(series, Style()))
            lines.append(line)
        marks, names = self._x_axis(x_lo, x_hi, canvas.width)
        lines.append(Text("      └" + marks, axis, no_wrap=True))
        lines.append(Text(names, axis, no_wrap=True))
        return Text("\n").join(lines)

    def _x_axis(self, x_lo: int, x_hi: int, width: int) -> tuple[str, str]:
        """The axis line with a ┴ at round boundaries, and the line of their labels under it.

        Marks and labels go to round numbers spaced 1, 2, 5, 10, 20... rounds apart,
        as many as fit with room to read them; without H, the same for steps.
        """
        unit = self._inner_steps or 1
        first, last = math.ceil(x_lo / unit), x_hi // unit
        stride = max(1, round(_nice_stride(max(last - first, 1), max(width // 7, 1))))
        ticks = [n for n in range(first, last + 1) if n % stride == 0] or [first]
        marks, names = ["─"] * width, [" "] * width
        for number in ticks:
            column = _x_pixel(number * unit, x_lo, x_hi, width * 2) // 2
            text = str(number)
            start = min(max(column - len(text) // 2, 0), width - len(text))
            if 0 <= column < width and all(
                c == " " for c in names[max(start - 1, 0) : start + len(text) + 1]
            ):
                marks[column] = "┴"
                names[start : start + len(text)] = text
        caption = " round " if self._inner_steps else "  step "
        return "".join(marks), caption + "".join(names)

    def _x_range(self) -> tuple[int, int]:
        steps = [s for s, _ in self._train[:1] + self._train[-1:]] + [s for s, _ in self._evals]
        x_lo, x_hi = min(steps), max(steps)
        x_lo = max(x_lo, x_hi - math.ceil((x_hi - x_lo) * self.WINDOWS[self.window]))
        return x_lo, max(x_hi, x_lo + 1)


def _nice_stride(span: float, count: int) -> float:
    """The 1, 2 or 5 x 10^k step that cuts `span` into at most about `count` parts."""
    raw = span / max(count, 1)
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for factor in (1, 2, 5, 10):
        if factor * power >= raw:
            return factor * power
    return 10 * power


def _y_labels(low: float, high: float, rows: int, y_pixel) -> dict[int, str]:
    """Row -> label for round values (…, 2.5, 3, 3.5, …) between `low` and `high`, one row apart at least."""
    step = _nice_stride(high - low, max(rows // 2, 4))
    gap = {-1, 0, 1} if rows >= 6 else {0}  # a short chart labels neighbouring rows too
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    labels: dict[int, str] = {}
    value = math.ceil(low / step) * step
    while value <= high:
        row = y_pixel(value) // 4
        if 0 <= row < rows and not {row + d for d in gap} & labels.keys():
            labels[row] = _fmt_axis(value, decimals)
        value += step
    return labels


def _x_pixel(step: int, x_lo: int, x_hi: int, pixels: int) -> int:
    return round((step - x_lo) / (x_hi - x_lo) * (pixels - 1))


def _column_means(
    points: Sequence[tuple[int, float]], x_lo: int, x_hi: int, pixels: int
) -> list[tuple[int, float]]:
    """Average the steps that land on the same pixel column: one readable line for long runs."""
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


def _fmt_axis(value: float, decimals: int) -> str:
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.{min(decimals, 4)}f}"
