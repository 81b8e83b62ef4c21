"""Experiment tracking and plotting on one real run: W&B (offline), TensorBoard, `pcp-tui plot`.

One short headless demo writes its metrics file and feeds every sink whose
package is installed; each test reads back what one sink wrote and compares it
with the metrics file, the source of truth. wandb and tensorboard are optional
extras, installed with the test extra; their tests are skipped where the package is missing.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pcp_tui.app.plot import with_evals
from pcp_tui.app.tracking import GuardedSink, open_sinks, scalars
from pcp_tui.testing import worker_env

REPO = Path(__file__).resolve().parents[1]
HAS = {name: importlib.util.find_spec(name) is not None for name in ("wandb", "tensorboard")}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory) -> Path:
    """A 3-round demo with --metrics and every tracking sink installed here; its folder."""
    folder = tmp_path_factory.mktemp("tracked")
    sinks = []
    if HAS["wandb"]:
        sinks += ["--wandb", "pcp-test"]
    if HAS["tensorboard"]:
        sinks += ["--tensorboard", str(folder / "tb")]
    env = dict(worker_env(), WANDB_MODE="offline", WANDB_DIR=str(folder), WANDB_SILENT="true")
    result = subprocess.run(
        [
            *(sys.executable, "-m", "pcp_tui", "demo", "--headless", "--workers", "1"),
            *("--rounds", "3", "--inner-steps", "5", "--seq-len", "32", "--batch-size", "4"),
            *("--data-max-bytes", "200000", "--eval-batches", "2"),
            *("--metrics", str(folder / "run.jsonl"), *sinks),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning" not in result.stderr, result.stderr
    (folder / "stdout.txt").write_text(result.stdout)
    return folder


@pytest.mark.skipif(not all(HAS.values()), reason="needs wandb and tensorboard (extras)")
@pytest.mark.e2e  # the tracked run is a real demo process
def test_each_sink_says_where_the_run_goes_when_it_starts(tracked_run):
    said = (tracked_run / "stdout.txt").read_text().splitlines()
    [folder] = glob.glob(str(tracked_run / "wandb" / "offline-run-*"))
    assert (
        f"TensorBoard: event files in {tracked_run / 'tb'} (tensorboard --logdir {tracked_run / 'tb'})"
        in said
    )
    [wandb_line] = [line for line in said if line.startswith("W&B: ")]
    assert wandb_line.endswith(f" in {folder} (upload it with: wandb sync {folder})"), wandb_line
    assert said.index(wandb_line) < next(
        i for i, line in enumerate(said) if line.startswith("round")
    )


def _rounds(folder: Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "run.jsonl").read_text().splitlines()]
    rounds = with_evals(rows)  # the eval of rounds 1 and 2 ends after their rows
    assert [r["round"] for r in rounds] == [1, 2, 3]
    return rounds


@pytest.mark.skipif(not HAS["tensorboard"], reason="tensorboard not installed (extra: tensorboard)")
@pytest.mark.e2e  # the tracked run is a real demo process
def test_tensorboard_event_files_hold_the_metrics_files_scalars(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tracked_run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    rounds = _rounds(tracked_run)
    assert set(events.Tags()["scalars"]) == set().union(*(scalars(r) for r in rounds))
    for name in ("train_loss", "eval_loss", "tokens_per_second", "utilization", "bytes_sent"):
        written = [(e.step, e.value) for e in events.Scalars(name)]
        # TensorBoard keeps float32: exactly the metrics file's value, rounded to float32; a
        # round whose eval was skipped (one still ran, `eval_skipped`) has none in either
        kept = [(r["round"], float(np.float32(r[name]))) for r in rounds if r[name] is not None]
        assert written == kept, name
    worker = f"worker_utilization/{rounds[0]['worker_ids'][0]}"
    assert len(events.Scalars(worker)) == 3


def _wandb_records(path: str):
    """Records of a W&B run file: LevelDB-log blocks of 32 KiB, each record a protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    position, pending = 7, b""
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # full/first, or middle/last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


@pytest.mark.skipif(not HAS["wandb"], reason="wandb not installed (extra: wandb)")
@pytest.mark.e2e  # the tracked run is a real demo process
def test_an_offline_wandb_run_holds_the_metrics_files_scalars(tracked_run):
    [path] = glob.glob(str(tracked_run / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = []
    for record in _wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            history.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
            )
        elif record.WhichOneof("record_type") == "run":
            assert record.run.project == "pcp-test"
    # one W&B step a row (a round's, then its eval's, which may come after the next round's),
    # each carrying its round: every curve's x axis (define_metric), so no row is dropped
    rows = [json.loads(line) for line in (tracked_run / "run.jsonl").read_text().splitlines()]
    stepped = [row for row in rows if row.get("event") in ("round", "evaluated")]
    assert [h["_step"] for h in history] == list(range(len(stepped)))
    assert [h["round"] for h in history] == [row["round"] for row in stepped]
    by_round: dict[int, dict] = {}
    for logged in history:
        mine = {k: v for k, v in logged.items() if not k.startswith("_") and k != "round"}
        by_round.setdefault(logged["round"], {}).update(mine)
    # the same names and values as the file
    assert by_round == {row["round"]: scalars(row) for row in _rounds(tracked_run)}


def test_a_failing_sink_warns_once_and_is_dropped():
    warnings: list[str] = []

    class DiskFull:
        name = "TensorBoard"
        calls = 0

        def __call__(self, row):
            DiskFull.calls += 1
            raise OSError(28, "No space left on device")

        def close(self):
            raise AssertionError("a failed sink is not closed again")

    sink = GuardedSink(DiskFull(), warnings.append)
    for step in (1, 2, 3):
        sink({"event": "round", "round": step, "train_loss": 1.0})
    sink.close()
    assert DiskFull.calls == 1 and len(warnings) == 1
    assert "No space left on device" in warnings[0] and "metrics file goes on" in warnings[0]


def test_a_missing_package_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    assert open_sinks(wandb_project="p", tensorboard_dir=None, run_id="r", settings={}) == []
    err = capsys.readouterr().err
    assert err.startswith("pcp-tui: warning: --wandb needs the wandb package: pip install")
    assert err.count("\n") == 1


def test_scalars_are_the_files_numbers_by_its_names():
    row = {
        "event": "round",
        "round": 4,
        "time": 1.0,
        "train_loss": 3.5,
        "eval_loss": None,
        "workers": 2,
        "worker_ids": ["a", "b"],
        "worker_utilization": {"a": 0.5, "b": 0.25},
        "untrained_shards": [],
        "flag": True,
    }
    assert scalars(row) == {
        "train_loss": 3.5,
        "workers": 2.0,
        "worker_utilization/a": 0.5,
        "worker_utilization/b": 0.25,
    }


# --------------------------------------------------------------------------- pcp-tui plot


@pytest.mark.e2e
def test_plot_draws_runs_from_real_metrics_files(tracked_run, tmp_path):
    matplotlib_image = pytest.importorskip("matplotlib.image", reason="extra: plot")
    metrics = tracked_run / "run.jsonl"
    appended = tmp_path / "twice.jsonl"  # a file the next run appended to, its last line cut off
    text = metrics.read_text()
    appended.write_text(text + text + '{"event": "round", "round": 1, "train_lo')
    output = tmp_path / "runs.png"
    result = subprocess.run(
        [sys.executable, "-m", "pcp_tui", "plot", str(metrics), str(appended), "-o", str(output)]
        + ["--x", "tokens"],
        capture_output=True,
        text=True,
        env=worker_env(),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote {output} (3 runs)"
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib_image.imread(output).shape == (1000, 900, 4)


@pytest.mark.e2e  # the tracked run is a real demo process
def test_plot_reads_each_run_of_a_file_with_cumulative_tokens(tracked_run, tmp_path):
    from pcp_tui.app.plot import read_runs

    rounds = _rounds(tracked_run)
    appended = tmp_path / "twice.jsonl"
    appended.write_text((tracked_run / "run.jsonl").read_text() * 2)
    first, second = read_runs(appended)
    assert (first.label, second.label) == ("twice", "twice #2")
    assert first.rounds == second.rounds == [1, 2, 3]
    assert first.tokens == list(np.cumsum([r["tokens"] for r in rounds]))
    assert first.train_loss == [r["train_loss"] for r in rounds]


def test_plot_says_what_is_wrong_in_one_line(tmp_path, monkeypatch):
    from pcp_tui.app import plot

    not_metrics = tmp_path / "notes.jsonl"
    not_metrics.write_text('{"event": "listening"}\n')
    with pytest.raises(
        plot.PlotError, match="has no round rows: is it a file written by --metrics"
    ):
        plot.read_runs(not_metrics)
    with pytest.raises(plot.PlotError, match="cannot read"):
        plot.read_runs(tmp_path / "missing.jsonl")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(plot.PlotError, match=r"pip install 'pcp-tui\[plot\]'"):
        plot.draw([], tmp_path / "x.png")
