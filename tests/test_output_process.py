"""`OutputProcess.wait_for` answers as soon as the line can no longer come.

A process that closes its stdout and stderr but lives on (a daemon detaching,
a server handing its output to a log file) wrote its last line. Before, the
waiter only looked again when a line came or the process ended, so it waited
its whole hang guard (120 s by default) for a line that could not come.
"""

from __future__ import annotations

import sys

import pytest

from pcp_tui.testing import OutputProcess, WorkerProcesses

# prints one line, closes its output, then lives on until killed
CLOSES_ITS_OUTPUT = (
    "import os, time; print('started', flush=True); os.close(1); os.close(2); time.sleep(600)"
)


@pytest.mark.e2e
def test_a_process_that_closes_its_output_ends_the_wait_though_it_lives_on():
    process = OutputProcess([sys.executable, "-c", CLOSES_ITS_OUTPUT])
    try:
        assert process.wait_for("started").group() == "started"
        with pytest.raises(AssertionError, match="the process closed its output") as failure:
            process.wait_for("never printed")
        assert process.process.poll() is None  # it still runs: the closed output ended the wait
        assert "started" in str(failure.value)  # the output so far, to read in the report
    finally:
        process.kill()


@pytest.mark.e2e
def test_a_process_that_ends_ends_the_wait_with_its_last_lines_read():
    process = OutputProcess([sys.executable, "-c", "print('last words'); raise SystemExit(3)"])
    with pytest.raises(AssertionError, match="the process closed its output") as failure:
        process.wait_for("never printed")
    assert "last words" in str(failure.value)
    assert process.finish() == 3


@pytest.mark.e2e
def test_a_worker_that_never_exits_fails_with_where_it_hangs():
    """`WorkerProcesses.output` of a process that lives on past its timeout aborts it, and
    the failure holds its output and its fault handler's stacks (`worker_env` turns it on)."""
    hangs = "import time; print('done', flush=True)\ndef stuck():\n    time.sleep(600)\nstuck()"
    with WorkerProcesses() as workers:
        process = workers.start([sys.executable, "-c", hangs])
        with pytest.raises(AssertionError, match="had not exited 2 s on") as failure:
            workers.output(process, timeout=2)
    assert "done" in str(failure.value) and "in stuck" in str(failure.value), failure.value
