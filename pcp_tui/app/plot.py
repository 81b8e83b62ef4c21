"""`pcp-tui plot`: draw one or more runs' metrics files, to compare runs without writing code.

Three panels against rounds or against tokens trained: loss (train solid,
held-out eval dashed with dots, one colour per run), throughput (tokens/s)
and utilization (the share of each round spent computing). The input is
what `--metrics FILE` writes: the `{"event": "round", ...}` rows. A file that
holds several runs (the metrics file is appended to) is split where the
round number starts again, each part labelled `name #2`, `name #3`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class PlotError(Exception):
    """A metrics file that cannot be plotted; the message says which and why."""


@dataclass
class Series:
    """One run's rounds, as plotted."""

    label: str
    rounds: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # cumulative, at the end of each round
    train_loss: list[float | None] = field(default_factory=list)
    eval_loss: list[float | None] = field(default_factory=list)
    tokens_per_second: list[float | None] = field(default_factory=list)
    utilization: list[float | None] = field(default_factory=list)


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "plot",
        allow_abbrev=False,
        help="draw loss, throughput and utilization of one or more --metrics files into a PNG",
    )
    parser.add_argument("files", nargs="+", metavar="RUN.jsonl", help="metrics files (--metrics)")
    parser.add_argument(
        "-o", "--output", default="runs.png", help="image to write (default: runs.png)"
    )
    parser.add_argument(
        "--x",
        choices=("rounds", "tokens"),
        default="rounds",
        help="horizontal axis: rounds, or tokens trained (compares runs of different sizes)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        series = _unique_labels([part for path in args.files for part in read_runs(Path(path))])
        draw(series, Path(args.output), x=args.x)
    except PlotError as exc:
        print(f"pcp-tui: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} ({len(series)} run{'s' if len(series) != 1 else ''})")
    return 0


def _unique_labels(series: list[Series]) -> list[Series]:
    """Runs from files of the same name (run1/m.jsonl, run2/m.jsonl) get `(2)`, `(3)` added."""
    seen: dict[str, int] = {}
    for run in series:
        seen[run.label] = seen.get(run.label, 0) + 1
        if seen[run.label] > 1:
            run.label = f"{run.label} ({seen[run.label]})"
    return series


def with_evals(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The round rows of a metrics file, each with the eval loss of its `evaluated` row.

    A round's eval runs off the rounds' path (`shepherd/run/evaluation.py`): its row
    says `"eval_loss": null` and an `evaluated` row follows when the eval ends.
    """
    rounds: list[dict[str, Any]] = []
    for row in rows:
        if row.get("event") == "round":
            rounds.append(dict(row))
        elif row.get("event") == "evaluated":
            for earlier in reversed(rounds):
                if earlier.get("round") == row.get("round"):
                    earlier["eval_loss"] = row.get("eval_loss")
                    break
    return rounds


def read_runs(path: Path) -> list[Series]:
    """The runs in one metrics file; lines that are not JSON (a cut-off last line) are skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise PlotError(f"cannot read {path}: {exc.strerror or exc}") from None
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    parts: list[Series] = []
    for row in with_evals(rows):
        number = row.get("round")
        if not isinstance(number, int):
            continue
        if not parts or (parts[-1].rounds and number <= parts[-1].rounds[-1]):
            suffix = f" #{len(parts) + 1}" if parts else ""
            parts.append(Series(label=f"{path.stem}{suffix}"))
        _append(parts[-1], number, row)
    if not parts:
        raise PlotError(
            f"{path} has no round rows: is it a file written by --metrics (JSON Lines)?"
        )
    return parts


def _append(series: Series, number: int, row: dict) -> None:
    series.rounds.append(number)
    before = series.tokens[-1] if series.tokens else 0
    series.tokens.append(before + int(_number(row.get("tokens")) or 0))
    series.train_loss.append(_number(row.get("train_loss")))
    series.eval_loss.append(_number(row.get("eval_loss")))
    series.tokens_per_second.append(_number(row.get("tokens_per_second")))
    series.utilization.append(_number(row.get("utilization")))


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def draw(series: list[Series], output: Path, *, x: str = "rounds") -> None:
    """Write the three panels for every run in `series` to `output` (PNG, or what its suffix says)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise PlotError(
            "plot needs matplotlib: pip install 'pcp-tui[plot]' (or: pip install matplotlib)"
        ) from None
    figure, (loss, speed, share) = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for index, run in enumerate(series):
        colour = f"C{index % 10}"
        xs = run.rounds if x == "rounds" else run.tokens
        loss.plot(*_present(xs, run.train_loss), color=colour, label=f"{run.label} train")
        loss.plot(
            *_present(xs, run.eval_loss),
            color=colour,
            linestyle="--",
            marker="o",
            markersize=3,
            label=f"{run.label} eval",
        )
        speed.plot(*_present(xs, run.tokens_per_second), color=colour, label=run.label)
        share.plot(*_present(xs, run.utilization), color=colour, label=run.label)
    loss.set_ylabel("loss")
    loss.set_title("loss (train: solid, held-out eval: dashed)")
    loss.legend(fontsize="small")
    speed.set_ylabel("tokens / s")
    share.set_ylabel("utilization (compute / wall)")
    share.set_ylim(0, 1.05)
    share.set_xlabel("round" if x == "rounds" else "tokens trained")
    share.xaxis.set_major_locator(MaxNLocator(integer=True))  # no round 2.5
    for axes in (loss, speed, share):
        axes.grid(alpha=0.3)
    figure.tight_layout()
    try:
        figure.savefig(output, dpi=100)
    except OSError as exc:
        raise PlotError(f"cannot write {output}: {exc.strerror or exc}") from None
    finally:
        plt.close(figure)


def _present(xs: list, ys: list[float | None]) -> tuple[list, list[float]]:
    """The points where y is known (a round with no evaluation has no eval loss)."""
    kept = [(a, b) for a, b in zip(xs, ys, strict=True) if b is not None]
    return [a for a, _ in kept], [b for _, b in kept]
