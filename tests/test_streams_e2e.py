"""`--streams 4` end to end: real shepherds, workers and link emulators, one window-limited link each.

Two runs side by side, identical but for --streams: the same model, seed, data
and worker id, each through its own `pcp-tui emulate-link` with a small window
(so one stream is slow, as on a long fat pipe). The striped run trains on the
very same tokens, so its losses must equal the single-stream run's exactly.
The single-stream run is also the test that a worker trains through the
emulator's command line at all.
"""

from __future__ import annotations

import json
import sys

import pytest

from pcp_tui.app.plot import with_evals
from pcp_tui.testing import OutputProcess, WorkerProcesses, free_port, shepherd_command

RUN = ("--workers", "1", "--rounds", "2", "--inner-steps", "4", "--chunk-steps", "4")


def _link(listen: int, target: int) -> OutputProcess:
    return OutputProcess(
        [sys.executable, "-m", "pcp_tui", "emulate-link", "--listen", f"127.0.0.1:{listen}"]
        + ["--to", f"127.0.0.1:{target}", "--bandwidth", "200Mbit", "--rtt", "20ms"]
        + ["--window", "64KiB", "--shared"]
    )


@pytest.mark.e2e
def test_a_striped_run_trains_on_the_same_tokens_as_a_single_stream_run(tmp_path):
    runs, processes = {}, []
    try:
        for streams in (1, 4):
            port, link_port = free_port(), free_port()
            metrics = tmp_path / f"streams{streams}.jsonl"
            shepherd = OutputProcess(
                shepherd_command(port, *RUN, "--streams", str(streams), "--metrics", str(metrics)),
            )
            link = _link(link_port, port)
            processes += [shepherd, link]
            link.wait_for("emulating a 200Mbit link with 20ms RTT and a 64KiB window")
            shepherd.wait_for("listening on")
            runs[streams] = (shepherd, link_port, metrics)
        with WorkerProcesses() as workers:
            spawned = {
                streams: workers.spawn(link_port, "--id", "w0", "--log-level", "info")
                for streams, (_, link_port, _) in runs.items()
            }
            for shepherd, _, _ in runs.values():
                assert shepherd.finish() == 0, shepherd.output
                assert "run done after 2 rounds" in shepherd.output
            outputs = {streams: workers.output(worker) for streams, worker in spawned.items()}
            assert [worker.returncode for worker in spawned.values()] == [0, 0], outputs
    finally:
        for process in processes:
            process.kill()
    assert "session striped over 4 connections" in outputs[4], outputs[4]
    assert "striped" not in outputs[1]
    rounds = {
        streams: with_evals(map(json.loads, metrics.read_text().splitlines()))
        for streams, (_, _, metrics) in runs.items()
    }
    assert [row["train_loss"] for row in rounds[4]] == [row["train_loss"] for row in rounds[1]]
    assert [row["eval_loss"] for row in rounds[4]] == [row["eval_loss"] for row in rounds[1]]
    assert len(rounds[4]) == 2
