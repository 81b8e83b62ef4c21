"""Workers die, join late, straggle; the shepherd restarts. Real processes, real signals
(a straggler's stall needs neither: its workers run in the test's trio loop)."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import time

import numpy as np
import pytest
import trio

from pcp_tui.app.headless import HeadlessPrinter
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.shepherd.run import checkpoint
from pcp_tui.testing import (
    OutputProcess,
    faulty_worker_command,
    free_port,
    local_worker,
    pause_after_round,
    run_shepherd,
    shepherd_command,
    until,
)
from pcp_tui.testing.faulty_worker import FAULTS
from pcp_tui.training.build import build_workload

from .conftest import small_config, worker_env


def _kinds(shepherd: Shepherd, kind: str) -> list:
    return [e for e in shepherd.state.events if e.kind == kind]


@pytest.mark.e2e
def test_kill_one_of_three_workers_mid_round(spawn_worker):
    # rounds of 20 steps: the victim holds round 2 by its fault (stalled), not by its length
    config = small_config(workers=3, rounds=4, inner_steps=20, chunk_steps=10)
    shepherd = Shepherd(config, build_workload(config, shards=3))
    killed_at: list[float] = []

    async def scenario(port):
        spawn_worker(port)
        spawn_worker(port)
        # it holds round 2 (heartbeating) until killed: waiting for "training, step > 0"
        # raced the victim's own finish of round 2 on a loaded machine
        command = faulty_worker_command(port, "stall", "--id", "victim", round=2, seconds=600)
        victim = subprocess.Popen(
            command, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        try:
            workers = shepherd.state.workers
            await until(lambda: "victim" in workers and workers["victim"].round == 2)
        finally:
            victim.send_signal(signal.SIGKILL)
            killed_at.append(time.time())
            await trio.to_thread.run_sync(victim.wait)

    run_shepherd(shepherd, scenario)
    history = shepherd.state.history
    assert [r.round for r in history] == [1, 2, 3, 4]  # none lost, none counted twice
    assert [r.workers for r in history] == [3, 2, 2, 2]
    assert "victim" not in history[1].worker_ids
    lost = _kinds(shepherd, "lost")
    assert len(lost) == 1 and lost[0].worker == "victim"
    print(f"kill -9 noticed after {lost[0].at - killed_at[0]:.3f} s")
    assert all(np.isfinite(p).all() for p in shepherd.params.values())


@pytest.mark.e2e
def test_late_worker_joins_at_the_next_round_boundary_and_one_that_leaves_is_told(spawn_worker):
    """A late joiner trains from the next round; a worker stopped by its operator (SIGTERM:
    it says goodbye, it is not lost) gets a headless line, and so does its orphaned shard."""
    config = small_config(workers=1, rounds=6, inner_steps=10)
    shepherd = Shepherd(config, build_workload(config, shards=2))
    headless = io.StringIO()
    shepherd.state.subscribe(HeadlessPrinter(shepherd.state, headless))

    async def scenario(port):
        # (waiting for N rounds in the history and then pausing raced the run: short rounds
        # could all end within one poll; the pause now lands exactly after round N)
        pause_after_round(shepherd, 2)  # held until the newcomer has compiled
        pause_after_round(shepherd, 4)  # round 6 is still to come when "early" leaves
        early = spawn_worker(port, "--id", "early")
        await until(lambda: shepherd.state.status == "paused" and len(shepherd.state.history) == 2)
        spawn_worker(port, "--id", "late")
        workers = shepherd.state.workers
        await until(lambda: "late" in workers and workers["late"].state == "idle")
        shepherd.resume()
        await until(lambda: shepherd.state.status == "paused" and len(shepherd.state.history) == 4)
        early.send_signal(signal.SIGTERM)
        await until(lambda: bool(_kinds(shepherd, "left")))
        shepherd.resume()

    run_shepherd(shepherd, scenario)
    history = shepherd.state.history
    assert [r.round for r in history] == [1, 2, 3, 4, 5, 6]
    assert [r.worker_ids for r in history[:2]] == [("early",)] * 2
    assert [set(r.worker_ids) for r in history[2:4]] == [{"early", "late"}] * 2
    assert [r.worker_ids for r in history[4:]] == [("late",)] * 2  # early left after round 4
    assert shepherd.state.workers["late"].rounds_contributed >= 2
    assert [e.worker for e in _kinds(shepherd, "left")] == ["early"]
    assert not _kinds(shepherd, "lost")
    lines = headless.getvalue().splitlines()
    early = shepherd.state.workers["early"]
    assert f"worker {early.index} left: the worker stopped" in lines, lines
    orphaned = f"shard {early.shard} has no worker since worker {early.index} left"
    [at] = [i for i, line in enumerate(lines) if line.startswith(orphaned)]
    assert lines.index(f"worker {early.index} left: the worker stopped") < at  # why, then what


def test_straggler_past_round_timeout_is_dropped_not_mixed_in():
    """Round 2 closes at its timeout without the stalled worker; it sits round 3 out (it is
    still on round 2), its late result is dropped, and it trains again from the next round."""
    config = small_config(workers=2, rounds=6, inner_steps=10, round_timeout=2.0, min_workers=1)
    shepherd = Shepherd(config, build_workload(config, shards=2))

    async def scenario(port):
        pause_after_round(shepherd, 3)  # held until the late result is in
        stall = FAULTS["stall"].make(round=2, seconds=5)  # heartbeats go on meanwhile
        async with trio.open_nursery() as nursery:  # real workers in this process
            nursery.start_soon(local_worker(port, "steady").run)
            nursery.start_soon(local_worker(port, "slow", faults=stall).run)
            await until(
                lambda: shepherd.state.status == "paused" and len(shepherd.state.history) == 3
            )
            await until(lambda: bool(_kinds(shepherd, "late_result")))
            shepherd.resume()

    run_shepherd(shepherd, scenario)
    history = shepherd.state.history
    assert [r.round for r in history] == [1, 2, 3, 4, 5, 6]
    assert history[0].workers == 2
    assert history[1].worker_ids == ("steady",)  # the stalled round closed without the straggler
    assert history[2].worker_ids == ("steady",)  # which sat round 3 out, still on round 2
    late = _kinds(shepherd, "late_result")
    assert late and late[0].worker == "slow" and late[0].round == 2
    assert shepherd.state.workers["slow"].state != "lost"  # slow is not dead
    assert [r.workers for r in history[3:]] == [2, 2, 2]  # and it caught up


def _shepherd_command(port: int, checkpoints, metrics, *extra: str) -> list[str]:
    return shepherd_command(
        port,
        "--workers",
        "2",
        "--rounds",
        "5",
        "--inner-steps",
        "10",
        "--checkpoint-dir",
        str(checkpoints),
        "--checkpoint-every",
        "1",
        "--metrics",
        str(metrics),
        *extra,
    )


def _final_eval(metrics) -> float:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in rows if r["event"] == "round"][-1]["eval_loss"]


@pytest.mark.e2e
def test_shepherd_killed_and_resumed_equals_an_uninterrupted_run(tmp_path, spawn_worker):
    """SIGKILL after round 2's checkpoint, --resume, and the run ends where an uninterrupted one does.

    Inner SGD keeps no optimizer state on the workers, so everything a round depends
    on is the global parameters, the outer momentum (checkpointed), the data
    positions (seed, shard, round) and the schedule (global step): the two runs'
    final parameters are then the same floats. (With AdamW the workers' moments,
    which live on the workers and are not checkpointed, make them differ slightly.)
    """
    port = free_port()
    sgd = ("--inner-optimizer", "sgd", "--inner-lr", "0.3")
    checkpoints, metrics = tmp_path / "ckpt", tmp_path / "run.jsonl"
    # more rounds than it can finish before the kill, however late the kill (a run that had
    # ended sent its workers home, and the resumed one waited for them for ever); inner SGD's
    # learning rate is constant, so the number of rounds changes nothing a round computes
    first = subprocess.Popen(
        _shepherd_command(port, checkpoints, metrics, *sgd, "--rounds", "1000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=worker_env(),
    )
    workers = []
    try:
        for line in first.stdout:
            if "listening on" in line and not workers:
                workers = [spawn_worker(port, "--id", f"w{i}") for i in range(2)]
            if re.search(r"checkpoint of round 2 saved", line):
                break
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = subprocess.run(
            _shepherd_command(
                port, checkpoints, metrics, *sgd, "--resume", str(checkpoints), "--rounds", "5"
            ),
            capture_output=True,
            text=True,
            timeout=600,
            env=worker_env(),
        )
        assert second.returncode == 0, second.stdout + second.stderr
        assert "resumed from" in second.stdout
        for worker in workers:
            assert worker.wait(timeout=60) == 0  # they reconnected on their own and finished
    finally:
        if first.poll() is None:
            first.kill()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    resumed = [r for r in rows if r["event"] == "resumed_from"]
    assert len(resumed) == 1 and resumed[0]["round"] >= 2
    after = [r["round"] for r in rows[rows.index(resumed[0]) :] if r["event"] == "round"]
    assert after == list(range(resumed[0]["round"] + 1, 6))  # continues where it left off
    assert all(r["workers"] == 2 for r in rows if r["event"] == "round")
    before, after = rows[: rows.index(resumed[0])], rows[rows.index(resumed[0]) :]
    shards = [
        {r["worker"]: r["shard"] for r in part if r["event"] == "joined"}
        for part in (before, after)
    ]
    assert shards[0] == shards[1] and sorted(shards[0].values()) == [
        0,
        1,
    ]  # the ledger was restored

    reference_dir, reference_metrics = tmp_path / "ref-ckpt", tmp_path / "reference.jsonl"
    reference = subprocess.Popen(
        _shepherd_command(port, reference_dir, reference_metrics, *sgd),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        env=worker_env(),
    )
    time.sleep(0.5)  # not an assertion: give the listener a moment before workers dial
    reference_workers = [spawn_worker(port, "--id", f"w{i}") for i in range(2)]
    assert reference.wait(timeout=600) == 0
    for worker in reference_workers:
        worker.wait(timeout=60)
    resumed_end, reference_end = (checkpoint.load_latest(d) for d in (checkpoints, reference_dir))
    assert resumed_end.round == reference_end.round == 5
    for name, array in reference_end.params.items():
        np.testing.assert_array_equal(resumed_end.params[name], array, err_msg=name)
    assert _final_eval(metrics) == _final_eval(reference_metrics)


@pytest.mark.e2e
def test_sigterm_then_resume_brings_the_same_workers_back(tmp_path, spawn_worker):
    """SIGTERM: the round finishes, the checkpoint is written, the goodbye says "come back";
    the same two worker processes wait, rejoin the --resume'd shepherd on the same port,
    keep their AdamW state (the same run id) and finish the run from the checkpoint."""
    port = free_port()
    checkpoints, metrics = tmp_path / "ckpt", tmp_path / "run.jsonl"
    command = shepherd_command(
        port,
        # SIGTERM once round 1 is printed stops it after round 1 or 2: the rest is slack for
        # a loaded machine, and the run the workers come back to finish
        *("--workers", "2", "--rounds", "10", "--inner-steps", "4"),
        *("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "100"),
        *("--metrics", str(metrics)),
    )
    first = OutputProcess(command)
    try:
        first.wait_for("listening on")
        logs = [tmp_path / f"w{i}.log" for i in range(2)]
        workers = [
            spawn_worker(port, "--id", f"w{i}", "--log-level", "info", "--log-file", str(log))
            for i, log in enumerate(logs)
        ]
        first.wait_for(r"^round +1/")
        first.process.send_signal(signal.SIGTERM)
        assert first.finish() == 128 + signal.SIGTERM, first.output
    finally:
        first.kill()
    # one line says why it stops, and no traceback (test_cli_errors checks SIGINT's the same)
    said = [line for line in first.lines if line.startswith("pcp-tui:")]
    assert len(said) == 1 and said[0].startswith(
        "pcp-tui: SIGTERM: stopping after the current round"
    ), said
    assert "Traceback" not in first.output
    assert "the run can be resumed: pcp-tui shepherd --resume" in first.output
    stopped = checkpoint.load_latest(checkpoints)  # the stop wrote it: --checkpoint-every 100
    assert 1 <= stopped.round < 10
    assert all(worker.poll() is None for worker in workers)  # told to come back, not to leave
    second = subprocess.run(
        [*command, "--resume", str(checkpoints)],
        capture_output=True,
        text=True,
        timeout=600,
        env=worker_env(),
    )
    assert second.returncode == 0, second.stdout + second.stderr
    for worker in workers:
        assert worker.wait(timeout=60) == 0, worker.stdout.read()
    finished = checkpoint.load_latest(checkpoints)
    assert finished.round == 10 and finished.meta["run_id"] == stopped.meta["run_id"]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    resumed = [r for r in rows if r["event"] == "resumed_from"]
    assert len(resumed) == 1 and resumed[0]["round"] == stopped.round
    after = [r["round"] for r in rows[rows.index(resumed[0]) :] if r["event"] == "round"]
    assert after == list(range(stopped.round + 1, 11))  # continues from the checkpoint
    assert all(r["workers"] == 2 for r in rows if r["event"] == "round")
    run_id = stopped.meta["run_id"]
    for log in logs:
        text = log.read_text()
        assert "the run can be resumed: reconnecting" in text, text
        assert f"back in run {run_id}: keeping the inner optimizer state" in text, text
        assert "fresh inner optimizer state" not in text, text


async def test_a_cut_off_worker_gives_up_after_its_limit_instead_of_retrying_forever():
    """A run that ended while a worker was cut off never says goodbye to it: after
    --give-up-after seconds of failed reconnects the worker stops and says why."""
    from pcp_tui.config import WorkerConfig
    from pcp_tui.worker.client import ConnectionLost, Worker

    config = WorkerConfig(
        connect=f"127.0.0.1:{free_port()}", token="t", backend="cpu", give_up_after=0.2
    )
    worker = Worker(config, max_backoff=0.02)
    with pytest.raises(ConnectionLost, match=r"gave up after \d+ s of retrying"):
        await worker.run()
    assert worker.status.state == "connecting"


@pytest.mark.e2e
def test_a_lost_workers_shard_goes_to_the_next_worker_to_join(spawn_worker):
    """Kill B: its shard is orphaned, rounds report it untrained, and newcomer C trains it."""
    config = small_config(workers=2, rounds=5, inner_steps=10)
    shepherd = Shepherd(config, build_workload(config, shards=2))
    workers, ledger = shepherd.state.workers, shepherd.state.shards

    async def scenario(port):
        pause_after_round(shepherd, 1)  # b dies at a round boundary
        pause_after_round(shepherd, 2)  # then a round with its shard orphaned, and c joins
        spawn_worker(port, "--id", "a")
        b = spawn_worker(port, "--id", "b")
        await until(lambda: shepherd.state.status == "paused" and len(shepherd.state.history) == 1)
        b.send_signal(signal.SIGKILL)
        await until(lambda: bool(_kinds(shepherd, "shard_orphaned")))
        shepherd.resume()
        await until(lambda: shepherd.state.status == "paused" and len(shepherd.state.history) == 2)
        spawn_worker(port, "--id", "c")
        await until(lambda: "c" in workers and workers["c"].state == "idle")
        owners.extend(list(s.owners) for s in ledger.shards)  # copies: the run goes on
        shepherd.resume()

    owners = []
    run_shepherd(shepherd, scenario)
    b_shard = 1 - workers["a"].shard
    assert workers["b"].shard == b_shard and workers["c"].shard == b_shard
    assert owners[b_shard] == ["c"] and owners[1 - b_shard] == ["a"]
    assert [e.shard for e in _kinds(shepherd, "shard_orphaned")] == [b_shard]
    said = [(e.kind, e.fields().get("worker")) for e in shepherd.state.events]
    assert said.index(("lost", "b")) < said.index(("shard_orphaned", "b"))  # why, then what
    adopted = _kinds(shepherd, "shard_adopted")
    assert [(e.worker, e.shard) for e in adopted] == [("c", b_shard)]
    history = shepherd.state.history
    with_c = [r for r in history if "c" in r.worker_ids]
    assert [sorted(r.worker_ids) for r in history] == [["a", "b"], ["a"], *[["a", "c"]] * 3]
    assert with_c and all(r.untrained_shards == () for r in with_c)
    assert [r.untrained_shards for r in history[:2]] == [(), (b_shard,)]
    trained_by_c = workers["c"].rounds_contributed
    assert ledger.shards[b_shard].rounds == workers["b"].rounds_contributed + trained_by_c
    assert ledger.shards[1 - b_shard].rounds == len(history)  # a trained its shard every round
