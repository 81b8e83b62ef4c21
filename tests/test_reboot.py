"""Identity after a reboot (issue 27 item 7): a restarted worker with its old --id gets in.

A machine that reboots (or is cut off) leaves its old connection half-open: the
shepherd hears nothing on it but has not yet dropped it. The restarted worker, with
the same --id, used to be refused for good ("idInUse ... (not retrying)"). Now the
shepherd sees the old connection's heartbeats have stopped and answers "busy": the
worker retries and is let in once that connection's silence reaches --heartbeat-timeout.
SIGSTOP stands for the reboot: the stopped process's socket stays open and silent.
"""

from __future__ import annotations

import signal
import time

import pytest

from pcp_tui.testing import OutputProcess, free_port, shepherd_command, worker_command

pytestmark = pytest.mark.e2e  # every test here runs real shepherd and worker processes


def test_a_restarted_worker_with_its_old_id_waits_out_the_old_connection(tmp_path):
    port = free_port()
    shepherd = OutputProcess(
        shepherd_command(
            port,
            *("--workers", "1", "--rounds", "500", "--inner-steps", "4"),
            # the window in which the restarted worker must first knock (it hears "busy" only
            # while the old connection is silent for less than this): a worker starts in 2-8 s
            # here, on a loaded CI machine; the test waits this long (and the worker's next
            # retry, its waits doubling: about twice as long again at worst) for the old
            # connection to be dropped. Beats 0.25 s apart: missed after 0.5 s, see below
            *("--heartbeat-seconds", "0.25", "--heartbeat-timeout", "12"),
        ),
    )
    old = new = None
    try:
        shepherd.wait_for("listening on")
        old = OutputProcess(worker_command(port, "--id", "w0"))
        shepherd.wait_for(r"^round +1/")
        old.process.send_signal(signal.SIGSTOP)  # the machine goes down, its socket stays open
        # its heartbeats must be seen missing (2 beats of 0.25 s) before the new one asks; a
        # worker that starts faster than that would hear "in use" from a live-looking twin
        time.sleep(1.0)
        new = OutputProcess(worker_command(port, "--id", "w0"))
        new.wait_for(
            r"\(busy\): worker id .w0. is still held by an earlier connection from .*, silent for"
        )
        shepherd.wait_for(r"worker 0 \(w0, cpu\) rejoined")
        # a round after the rejoin (the old process is stopped: only the new one can train it)
        shepherd.wait_for(r"^round +\d+/", count=len(shepherd.matches(r"^round +\d+/")) + 1)
        shepherd.process.send_signal(signal.SIGQUIT)  # cancel: the goodbye ends the new worker
        assert shepherd.finish() == 128 + signal.SIGQUIT, shepherd.output
        assert new.finish() == 0, new.output
    finally:
        shepherd.kill()
        for process in (old, new):
            if process is not None:
                process.kill()
    assert "not retrying" not in new.output
    assert "idInUse" not in new.output
