"""A terminal closed under a run: output nobody reads ends neither the run nor a worker."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np
import pytest

from pcp_tui.shepherd.run import checkpoint
from pcp_tui.testing import free_port, shepherd_command, worker_command, worker_env

pytestmark = pytest.mark.e2e


def _closed_pipe() -> int:
    """The write end of a pipe whose reader is gone: writing to it raises EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    return write_end


def _wait_for_text(path, text: str, process: subprocess.Popen) -> str:
    while text not in (content := path.read_text() if path.exists() else ""):
        assert process.poll() is None, f"exited {process.returncode}: {content}"
        time.sleep(0.1)
    return content


def test_a_closed_terminal_ends_no_run_and_sighup_saves_it(tmp_path):
    """The shepherd's stdout closed after round 2 (`| head`), its --metrics on a full device
    (/dev/full: ENOSPC), a worker whose stdout is a closed pipe from the start; then SIGHUP
    with stderr gone too (the terminal window closed). Before: the first line printed after
    the pipe closed raised BrokenPipeError inside the round and ended the run, unsaved (a
    failed metrics write did the same), and the worker died at its first status line."""
    port, checkpoints = free_port(), tmp_path / "ckpt"
    command = shepherd_command(
        port,
        *("--workers", "1", "--rounds", "500", "--inner-steps", "2"),
        *("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1000"),
        *("--metrics", "/dev/full"),
    )
    shepherd = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env()
    )
    worker_out, worker_err, log = _closed_pipe(), tmp_path / "w.err", tmp_path / "w.log"
    worker = subprocess.Popen(
        worker_command(port, "--id", "w", "--log-level", "info", "--log-file", str(log)),
        stdout=worker_out,
        stderr=worker_err.open("w"),
        env=worker_env(),
    )
    os.close(worker_out)
    try:
        lines = []
        for line in shepherd.stdout:
            lines.append(line)
            if line.startswith("round    2/"):
                break
        shepherd.stdout.close()  # `| head`: the reader is gone
        assert any(
            line.startswith("metrics not written to /dev/full: No space left on device;")
            and "the run goes on" in line
            for line in lines
        ), lines
        noted = shepherd.stderr.readline()  # at the next line it prints: round 3's
        assert noted.startswith("pcp-tui: cannot print the run's log any more (Broken pipe)")
        shepherd.stderr.close()  # the terminal is gone: SIGHUP finds no stderr either
        shepherd.send_signal(signal.SIGHUP)
        assert shepherd.wait() == 128 + signal.SIGHUP
        saved = checkpoint.load_latest(checkpoints)  # only the stop writes one (every 1000)
        assert 3 <= saved.round < 500
        assert all(np.isfinite(p).all() for p in saved.params.values())
        # the worker trained every round with its output gone, and was asked back
        _wait_for_text(log, "the run can be resumed: reconnecting", worker)
        assert "cannot show the worker's status any more (Broken pipe)" in worker_err.read_text()
    finally:
        for process in (shepherd, worker):
            if process.poll() is None:
                process.kill()
            process.wait()
