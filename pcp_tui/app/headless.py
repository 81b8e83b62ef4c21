"""Headless views of a run: one line per round on the terminal, JSON Lines metrics."""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
from collections.abc import Sequence
from typing import IO, Any

from pcp_tui.app.closed_output import abandon, say
from pcp_tui.app.tracking import GuardedSink
from pcp_tui.shepherd.run.events import Done, Event, MetricsFailed, RoundDone
from pcp_tui.shepherd.run.state import RunState, finite_or_null

_TOKEN_FLAG = re.compile(r"(--token[ =])\S+")

# Events worth a line of their own in headless mode (rounds get the table row).
_SHOWN = {
    "exporting",
    "exported",
    "listening",
    "waiting",
    "joined",
    "rejoined",
    "relay_joined",
    "relay_left",
    "relay_fold_lost",
    "compiled",
    "lost",
    "worker_refused",
    "left",
    "shard_orphaned",
    "shard_adopted",
    "refused",
    "worker_keys",
    "round_repeated",
    "late_result",
    "bad_result",
    "result_clipped",
    "stragglers",
    "round_waiting",
    "evaluated",
    "eval_skipped",
    "paused",
    "resumed",
    "failed",
    "checkpoint",
    "checkpoint_failed",
    "metrics_failed",
    "resumed_from",
    "stop_requested",
    "resumable",
    "not_resumable",
}


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(count) < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} GB"


def format_round(record: Any, rounds_total: int) -> str:
    """One round as the headless log prints it: losses, time, throughput, utilization, bytes.

    `util` is the share of the round's wall time the contributors spent computing
    (`RoundRecord.utilization`); `xN fewer bytes than DP` compares the bytes that
    crossed the wire with what synchronous data parallelism would have sent.
    """
    eval_text = fixed(record.eval_loss, 6) if record.eval_loss is not None else "   -  "
    ratio = record.data_parallel_ratio()
    return (
        f"round {record.round:>4}/{rounds_total:<4} train {fixed(record.train_loss, 7)}  eval {eval_text}  "
        f"{record.round_seconds:6.2f} s  {record.tokens_per_second:9,.0f} tok/s  "
        f"util {record.utilization:4.0%}  "
        f"sent {human_bytes(record.bytes_sent):>9}  recv {human_bytes(record.bytes_received):>9}  "
        f"workers {record.workers}"
        + (f"  saved {human_bytes(record.bytes_saved)}" if record.bytes_saved else "")
        + (f"  {times_fewer(ratio)} bytes than DP" if ratio is not None else "")
    )


def fixed(value: float, width: int) -> str:
    """`value` in exactly `width` columns: 4 decimals where they fit, fewer, then 1e+30, nan, inf.

    A diverged loss (1e30) printed with :.4f is 36 characters wide and pushes
    every column after it out of line.
    """
    if math.isfinite(value):
        for decimals in (4, 3, 2, 1):
            text = f"{value:.{decimals}f}"
            if len(text) <= width:
                return text.rjust(width)
    for decimals in (1, 0):
        text = f"{value:.{decimals}e}" if math.isfinite(value) else f"{value}"
        if len(text) <= width:
            return text.rjust(width)
    return text


def times_fewer(ratio: float) -> str:
    """`x48 fewer`, or `x1.5 more` when a round moved more bytes than data parallelism would.

    `ratio` is data-parallel bytes / bytes exchanged (`RoundRecord.data_parallel_ratio`).
    """
    if ratio >= 1:
        return f"x{ratio:,.0f} fewer" if ratio >= 10 else f"x{ratio:.1f} fewer"
    return f"x{1 / ratio:.1f} more"


class HeadlessPrinter:
    """Prints what happens to a run, for terminals, CI logs and servers."""

    def __init__(self, state: RunState, out: IO[str] = sys.stdout):
        self._state = state
        self._out = out

    def __call__(self, event: Event) -> None:
        if isinstance(event, RoundDone):
            line = format_round(event.record, self._state.rounds_total)
        elif isinstance(event, Done):
            line = f"{event.message}; final eval loss {_fmt(event.final_eval_loss)}"
        elif event.kind in _SHOWN:
            line = event.message
        else:
            return
        try:
            print(line, file=self._out, flush=True)
        except OSError as exc:  # a closed pipe (`| head`), a hung-up terminal: EPIPE, EIO
            abandon(self._out)
            say(
                f"pcp-tui: cannot print the run's log any more ({exc.strerror or exc}); "
                "the run goes on without it (--metrics FILE keeps a record of every round)"
            )


class MetricsWriter:
    """JSON Lines: one object per round and event, flushed as it happens; and the tracking sinks.

    A NaN or infinite value (a diverged loss) is written as null, as the API shows it.

    `path` None writes no file, only feeds `sinks` (see `pcp_tui.app.tracking`).

    Metrics files get shared, so the join token never goes in: the "listening"
    line says `--token <redacted>` (the terminal shows the operator the real one).
    """

    def __init__(
        self,
        path: str | None,
        state: RunState,
        *,
        token: str | None = None,
        sinks: Sequence[GuardedSink] = (),
    ):
        self._state = state
        self._token = token if token and len(token) >= 8 else None  # "a" must not redact every a
        self._sinks = list(sinks)  # W&B, TensorBoard: each gets every row the file gets
        self._file: IO[str] | None = None
        self._path = path
        if path is None:
            return
        try:
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the run
        except OSError as exc:
            raise OSError(f"cannot write metrics to {path}: {exc.strerror}") from None

    def __call__(self, event: Event) -> None:
        if isinstance(event, RoundDone):
            row = event.record.as_json()
        else:
            row = {"event": event.kind, "message": event.message, **_plain(event.fields())}
        if event.kind == "done":
            row.update(
                run_id=self._state.run_id,
                model=self._state.model_name,
                param_count=self._state.param_count,
                bytes_sent=self._state.bytes_sent,
                bytes_received=self._state.bytes_received,
                worker_stats={w.worker_id: w.stats_json() for w in self._state.workers.values()},
            )
        row["time"] = round(event.at, 3)
        row = {k: self._redacted(v) if isinstance(v, str) else v for k, v in row.items()}
        if self._file is not None:
            try:
                self._file.write(
                    json.dumps(finite_or_null(row), allow_nan=False, default=_default) + "\n"
                )
                self._file.flush()
            except OSError as exc:  # a full disk, a file-size limit, a removed mount
                self._file_failed(self._file, exc)
        for sink in self._sinks:
            sink(row)

    def _file_failed(self, failed: IO[str], exc: OSError) -> None:
        """Stop writing the file (a row cut short would follow), and say so as an event."""
        self._file = None
        with contextlib.suppress(OSError):  # its flush fails as the write did
            failed.close()
        self._state.emit(
            MetricsFailed(
                f"metrics not written to {self._path}: {exc.strerror or exc}; no more rows go "
                "there this run and the run goes on (free disk space, or give the next run "
                "another --metrics)",
                path=str(self._path),
            )
        )

    def close(self) -> None:
        """Close the file and finish every sink (a W&B run is marked finished here); idempotent."""
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError as exc:  # its last flush: the run is over, the rows before are there
                say(f"pcp-tui: metrics file {self._path}: {exc.strerror or exc} on closing it")
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close()

    def _redacted(self, text: str) -> str:
        text = _TOKEN_FLAG.sub(r"\1<redacted>", text)
        return text.replace(self._token, "<redacted>") if self._token else text


def clean_stop_plan(state: RunState, checkpoints: bool) -> str:
    """What a clean stop of the run will do now, for the line that announces it.

    While the shepherd waits for workers there is no round to finish, and there is no
    checkpoint to write without --checkpoint-dir or before a round is done.
    """
    training = state.status == "training"
    steps = ["stopping after the current round" if training else "stopping"]
    if checkpoints and (training or state.history):
        steps.append("writing the checkpoint")
    return ", ".join(steps) + " and telling workers goodbye"


def _plain(data: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v for k, v in data.items() if isinstance(v, str | int | float | bool | list | type(None))
    }


def _default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
