"""Closing the terminal under the dashboard: the run stops cleanly, as `q` would stop it.

The demo runs with the dashboard in a real pseudo-terminal that is its
controlling terminal; the test then closes the terminal's master side, which
is what closing a terminal window does: the kernel sends SIGHUP and every
later read or write on the terminal fails.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from pcp_tui.shepherd.run import checkpoint
from pcp_tui.testing import child_pids, worker_env

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


class Terminal:
    """A pseudo-terminal of `columns` x `rows` whose output a thread drains (a full one blocks)."""

    def __init__(self, columns: int = 120, rows: int = 40):
        self.master, self.slave = os.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.output = bytearray()
        self._open = True
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        while self._open:
            ready, _, _ = select.select([self.master], [], [], 0.05)
            if ready:
                try:
                    self.output += os.read(self.master, 65536)
                except OSError:  # the child closed its side
                    return

    def start(self, *args: str, env: dict[str, str]) -> subprocess.Popen:
        """`python -m pcp_tui ARGS` in a session of its own, this terminal as its controlling one."""

        def take_terminal() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        process = subprocess.Popen(
            [sys.executable, "-m", "pcp_tui", *args],
            stdin=self.slave,
            stdout=self.slave,
            stderr=self.slave,
            env=env,
            cwd=REPO,
            preexec_fn=take_terminal,  # noqa: PLW1509 - setsid + TIOCSCTTY must run in the child
        )
        os.close(self.slave)
        return process

    def close(self) -> None:
        """Close the window: the kernel hangs up the child's side and sends it SIGHUP."""
        if self._open:
            self._open = False
            self._reader.join()
            os.close(self.master)


def _wait_for_round(process: subprocess.Popen, metrics: Path, terminal: Terminal) -> None:
    while not (metrics.exists() and '"event": "round"' in metrics.read_text()):
        assert process.poll() is None, terminal.output.decode(errors="replace")[-3000:]
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def test_closing_the_terminal_stops_the_dashboard_demo_with_its_final_checkpoint(tmp_path):
    checkpoints, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    terminal = Terminal()
    env = dict(worker_env(), TERM="xterm-256color", COLUMNS="120", LINES="40")
    demo = terminal.start(
        *("demo", "--workers", "1", "--rounds", "1000", "--inner-steps", "5"),
        *("--seq-len", "32", "--batch-size", "4", "--data-max-bytes", "200000"),
        *("--eval-batches", "2", "--heartbeat-seconds", "0.5"),
        *("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1000"),
        *("--metrics", str(metrics)),
        env=env,
    )
    try:
        _wait_for_round(demo, metrics, terminal)
        workers = child_pids(demo.pid)
        assert len(workers) == 1
        terminal.close()
        assert demo.wait() == 128 + signal.SIGHUP
    finally:
        terminal.close()
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rounds = [r["round"] for r in rows if r["event"] == "round"]
    assert not [r for r in rows if r["event"] in ("failed", "lost")], rows
    stopped = [r for r in rows if r["event"] == "stop_requested"]
    assert len(stopped) == 1 and "SIGHUP" in stopped[0]["message"], rows
    assert checkpoint.load_latest(checkpoints).round == max(rounds)  # no trained round lost
    assert not [pid for pid in workers if _alive(pid)]  # they were told goodbye and left
