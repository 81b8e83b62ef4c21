"""The shepherd raises its open-files limit to what its admitted workers' sockets need, and
shows an address a worker's --connect takes."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from pcp_tui.config.worker import parse_connect
from pcp_tui.shepherd.serving.listening import SPARE_FILES, advertised, open_files_for


def test_the_soft_limit_is_raised_to_what_the_connections_need():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 100 * 2 + SPARE_FILES
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"this machine's hard open-files limit ({hard}) is under {needed}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    try:
        assert open_files_for(100, 2) == ""
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (needed, hard)
        assert open_files_for(10, 1) == ""  # never lowered
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (needed, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.e2e  # lowers its hard limit for good: a process of its own
def test_a_hard_limit_under_the_need_is_raised_to_and_named_with_what_to_do():
    script = (
        "import resource\n"
        "from pcp_tui.shepherd.serving.listening import open_files_for\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 300))\n"
        "print(open_files_for(250, 4))\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    warning, limits = done.stdout.splitlines()
    assert warning == (
        "250 worker connection(s) x 4 stream(s) need about 1256 open files and this process "
        "may hold 300 (its hard limit): raise it (`ulimit -Hn 1256` as root, or LimitNOFILE= "
        "in a systemd unit) or lower --max-worker-connections"
    )
    assert limits == "(300, 300)"


@pytest.mark.parametrize(
    ("host", "shown"), [("::1", "[::1]:8080"), ("127.0.0.1", "127.0.0.1:8080")]
)
def test_the_address_a_join_command_shows_is_one_a_worker_takes(host, shown):
    """`--host ::1` printed `--connect ::1:8080`, which a worker refuses."""
    assert advertised(host, 8080) == shown
    assert parse_connect(shown) == (host, 8080)
