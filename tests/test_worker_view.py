"""What people read: a worker's log lines and the shepherd's metrics file."""

from __future__ import annotations

import io
import json

from pcp_tui.app.headless import MetricsWriter
from pcp_tui.app.worker_view import WorkerStatusView
from pcp_tui.shepherd.run.events import Listening, PeerRefused
from pcp_tui.shepherd.run.state import RunState
from pcp_tui.worker.client import WorkerStatus


def test_a_message_is_printed_once_not_on_every_later_line():
    status = WorkerStatus(shepherd="127.0.0.1:8080")
    out = io.StringIO()
    with WorkerStatusView(status, out, live=False):
        status.update(state="idle", message="compiled in 4.2 s; waiting for a round")
        status.update(state="training", round=1, step=0, total_steps=10)
        status.update(state="syncing", loss=2.5)
        status.update(state="idle")
        status.update(state="done", message="the shepherd ended the run")
    lines = out.getvalue().splitlines()
    assert len(lines) == 5
    assert lines[0].endswith("compiled in 4.2 s; waiting for a round")
    assert not any("compiled" in line for line in lines[1:]), lines
    assert lines[-1].endswith("round 1 loss 2.5000 the shepherd ended the run")


def test_a_reconnect_line_does_not_repeat_the_last_rounds_numbers():
    reason = "connection lost: the shepherd closed the connection; retrying in 1.0 s"
    for live in (False, True):
        status = WorkerStatus(shepherd="127.0.0.1:8080")
        out = io.StringIO()
        with WorkerStatusView(status, out, live=live):
            status.update(state="training", round=13, step=50, total_steps=50, loss=2.5)
            status.update(tokens_per_second=4_000.0)
            status.update(state="connecting", message=reason)
        shown = " ".join(out.getvalue().split())
        said = shown[shown.index("connecting") :]
        assert reason in said and "round 13" not in said and "50/50" not in said, shown
        assert "2.5000" not in said and "tok/s" not in said


def test_the_live_line_drops_a_message_once_its_round_is_over():
    status = WorkerStatus(shepherd="127.0.0.1:8080")
    out = io.StringIO()
    with WorkerStatusView(status, out, live=True):
        status.update(state="idle", message="compiled in 4.2 s; waiting for a round")
        status.update(state="training", round=1, step=10, total_steps=10, loss=2.5)
        status.update(state="idle")
    shown = " ".join(out.getvalue().split())
    assert shown.count("compiled in 4.2 s") == 1  # the log line of round 0, not the idle line


def test_the_metrics_file_never_holds_the_join_token(tmp_path):
    path = tmp_path / "m.jsonl"
    state = RunState(run_id="r", rounds_total=1, settings={})
    writer = MetricsWriter(str(path), state, token="tok-1234567890")
    state.subscribe(writer)
    state.emit(
        Listening(
            "listening on 10.0.0.5:8080; join with: pcp-tui worker --connect 10.0.0.5:8080 "
            "--token tok-1234567890 --tls-fingerprint ab"
        )
    )
    state.emit(PeerRefused("refused 1.2.3.4: sent tok-1234567890 as its id", peer="1.2.3.4"))
    writer.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert "tok-1234567890" not in path.read_text()
    assert rows[0]["message"].endswith("--token <redacted> --tls-fingerprint ab")
    assert rows[1]["message"] == "refused 1.2.3.4: sent <redacted> as its id"
