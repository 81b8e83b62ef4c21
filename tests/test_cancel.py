"""Stops say what they mean (issue 27 item 6): a cancel is final, a stop is resumable.

Ctrl-\\ (SIGQUIT) at the shepherd's terminal cancels the run: even with a checkpoint
to resume from, the goodbye tells the workers to exit, and they do at once. (The
API's cancel: tests/test_api.py; a second Ctrl-C still says goodbye:
tests/test_cli_errors.py; a resumable stop's bounded wait: tests/test_resume.py.)
"""

from __future__ import annotations

import re
import signal

import pytest

from pcp_tui.shepherd.run import checkpoint
from pcp_tui.testing import OutputProcess, free_port, shepherd_command, worker_command

pytestmark = pytest.mark.e2e  # every test here runs real shepherd and worker processes


def test_ctrl_backslash_cancels_the_run_and_the_workers_exit_at_once(tmp_path):
    port = free_port()
    checkpoints = tmp_path / "ck"
    shepherd = OutputProcess(
        shepherd_command(
            port,
            *("--workers", "1", "--rounds", "500", "--inner-steps", "4"),
            *("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "100"),
        ),
    )
    worker = None
    try:
        shepherd.wait_for("listening on")
        worker = OutputProcess(worker_command(port, "--id", "w0"))
        shepherd.wait_for(r"^round +1/")
        shepherd.process.send_signal(signal.SIGQUIT)
        assert shepherd.finish() == 128 + signal.SIGQUIT, shepherd.output
        assert worker.finish() == 0, worker.output  # the goodbye was final: no waiting
    finally:
        shepherd.kill()
        if worker is not None:
            worker.kill()
    assert "SIGQUIT: cancelling the run for good after the current round" in shepherd.output
    assert "the run can be resumed" not in shepherd.output + worker.output
    assert "reconnecting" not in worker.output
    # the worker's operator learns why it ended: a cancel, not the run's end or a failure
    assert "the shepherd ended the run (cancelled (SIGQUIT))" in worker.output
    assert re.search(r"^run cancelled after \d+ rounds?; final eval loss", shepherd.output, re.M)
    assert checkpoint.load_latest(checkpoints).round >= 1  # the stop still wrote it
