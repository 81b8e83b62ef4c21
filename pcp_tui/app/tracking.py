"""Experiment tracking sinks: the metrics file's rows, sent on to Weights & Biases or TensorBoard.

A sink takes one metrics row, the dict the JSON Lines file gets for a round or
an event, and nothing else; so every sink shows the same scalar names as the
file (`train_loss`, `eval_loss`, `tokens_per_second`, `utilization`, ...;
a nested number such as `worker_utilization` of worker `w0` becomes
`worker_utilization/w0`), stepped by round.

Both packages are optional extras (`pip install 'pcp-tui[wandb]'`,
`'pcp-tui[tensorboard]'`). A sink that cannot start (package missing, no W&B
login) or that fails later (disk full, network) costs one warning on stderr
and is dropped: tracking never ends a run, and the metrics file goes on.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import IO, Any, Protocol

log = logging.getLogger(__name__)

_NOT_SCALARS = {"round", "time"}  # the step and the wall clock, not curves
# rows logged at step = their round: a round's, and its eval's (which ends after the round's row)
_STEPPED = ("round", "evaluated")


class MetricsSink(Protocol):
    """Where metrics rows go besides the JSON Lines file."""

    name: str

    @property
    def where(self) -> str:
        """One line: where the rows go, printed when the sink starts."""
        ...

    def __call__(self, row: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's finite numbers by the file's names; one level of nesting becomes `name/key`."""
    found: dict[str, float] = {}
    for name, value in row.items():
        if name in _NOT_SCALARS:
            continue
        if isinstance(value, Mapping):
            for key, inner in value.items():
                if _is_number(inner):
                    found[f"{name}/{key}"] = float(inner)
        elif _is_number(value):
            found[name] = float(value)
    return found


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class GuardedSink:
    """A sink whose first failure prints one warning and switches it off for the rest of the run."""

    def __init__(self, sink: MetricsSink, warn: Callable[[str], None]):
        self._sink = sink
        self._warn = warn
        self.failed = False

    @property
    def name(self) -> str:
        return self._sink.name

    def __call__(self, row: Mapping[str, Any]) -> None:
        if not self.failed:
            self._guarded("write to", lambda: self._sink(row))

    def close(self) -> None:
        if not self.failed:
            self._guarded("finish", self._sink.close)

    def _guarded(self, doing: str, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception as exc:  # any failure of a tracking backend; the run must go on
            self.failed = True
            self._warn(
                f"could not {doing} {self.name} ({type(exc).__name__}: {exc}); "
                f"no more {self.name} logging this run, the metrics file goes on"
            )


class WandbSink:
    """A W&B run named after the PCP run; every scalar is plotted against `round`.

    A round's eval ends while later rounds train, so its row can come after the next
    round's: logged at W&B's own `step = round`, W&B would drop it (a step lower than
    the last one logged). So each row is its own W&B step, carrying `round`, and
    `define_metric` makes `round` every curve's x axis: a late eval lands at its round.

    Offline (`WANDB_MODE=offline`) it writes the run under `./wandb` (or
    `$WANDB_DIR`) for a later `wandb sync`; online it needs `wandb login` first.
    """

    name = "W&B"

    def __init__(self, project: str, run_id: str, settings: Mapping[str, Any]):
        import wandb

        self._run = wandb.init(
            project=project,
            name=run_id,
            config=dict(settings),
            settings=wandb.Settings(console="off", silent=True),  # the terminal is ours
        )
        self._run.define_metric("round")
        self._run.define_metric("*", step_metric="round")

    @property
    def where(self) -> str:
        """Where the run's rows go: its page, or the offline folder to `wandb sync`."""
        run = self._run
        if run.offline:
            folder = run.settings.sync_dir
            return f"W&B: offline run {run.name} in {folder} (upload it with: wandb sync {folder})"
        return f"W&B: run {run.name} at {run.url}"

    def __call__(self, row: Mapping[str, Any]) -> None:
        if row.get("event") in _STEPPED:
            self._run.log({"round": int(row["round"]), **scalars(row)})
        elif row.get("event") == "done":
            self._run.summary.update(scalars(row))

    def close(self) -> None:
        self._run.finish()


class TensorBoardSink:
    """TensorBoard event files in `directory`, written with TensorBoard's own writer (no TensorFlow)."""

    name = "TensorBoard"

    def __init__(self, directory: str):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._writer = EventFileWriter(directory)
        self._directory = directory

    @property
    def where(self) -> str:
        return f"TensorBoard: event files in {self._directory} (tensorboard --logdir {self._directory})"

    def __call__(self, row: Mapping[str, Any]) -> None:
        if row.get("event") not in _STEPPED:
            return
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalars(row).items()]
        event = self._event(
            wall_time=float(row.get("time", time.time())),
            step=int(row["round"]),
            summary=self._summary(value=values),
        )
        self._writer.add_event(event)
        self._writer.flush()  # one round's worth: a crash loses nothing already trained

    def close(self) -> None:
        self._writer.close()


_INSTALL = {
    "wandb": "pip install 'pcp-tui[wandb]' (or: pip install wandb)",
    "tensorboard": "pip install 'pcp-tui[tensorboard]' (or: pip install tensorboard)",
}


def open_sinks(
    *,
    wandb_project: str | None,
    tensorboard_dir: str | None,
    run_id: str,
    settings: Mapping[str, Any],
    err: IO[str] | None = None,
    out: IO[str] | None = None,
) -> list[GuardedSink]:
    """The sinks the options ask for, each saying where it writes (on `out`); one that cannot
    start is left out after a warning (on `err`)."""

    def warn(line: str) -> None:
        log.info("%s", line)  # for --log-file; the line below is what a person sees, once
        print(f"pcp-tui: warning: {line}", file=err or sys.stderr, flush=True)

    wanted: list[tuple[str, str, Callable[[], MetricsSink]]] = []
    if wandb_project:
        wanted.append(("wandb", "--wandb", lambda: WandbSink(wandb_project, run_id, settings)))
    if tensorboard_dir:
        wanted.append(("tensorboard", "--tensorboard", lambda: TensorBoardSink(tensorboard_dir)))
    sinks = []
    for package, flag, start in wanted:
        try:
            sink = start()
        except ImportError:
            warn(f"{flag} needs the {package} package: {_INSTALL[package]}; running without it")
        except Exception as exc:  # a login missing, a directory not writable: the run goes on
            warn(f"{flag}: could not start ({type(exc).__name__}: {exc}); running without it")
        else:
            print(sink.where, file=out or sys.stdout, flush=True)
            sinks.append(GuardedSink(sink, warn))
    return sinks
