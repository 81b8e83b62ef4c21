"""`--resume DIR` continues the run as its checkpoint saved it; a checkpoint is checked as it loads.

Issue 27 (resume just works) and issue 25 (hostile checkpoints): the options, the
token, the port come back from the checkpoint; an option that would change the run's
meaning is refused in one line; NaN tensors and impossible meta are refused.
"""

from __future__ import annotations

import json
import re
import signal
import stat
import subprocess

import numpy as np
import pytest

from pcp_tui.app.cli import _config_from as config_from
from pcp_tui.app.cli import build_parser, main, parse_args
from pcp_tui.app.headless import MetricsWriter
from pcp_tui.config import RunConfig
from pcp_tui.shepherd.run import checkpoint
from pcp_tui.shepherd.run.events import Done
from pcp_tui.shepherd.run.state import RunState
from pcp_tui.testing import OutputProcess, free_port, shepherd_command, worker_command
from pcp_tui.training.build import build_workload

from .conftest import small_config, worker_env

SAVED = RunConfig(
    port=9123, workers=3, inner_steps=7, inner_lr=3e-3, metrics="old.jsonl", headless=True
)


def _saved_run(directory, *, config=SAVED, params=None, outer=None, round=4, **meta):
    """A checkpoint of round `round` as the shepherd writes one (its meta records `config`)."""
    checkpoint.save(
        directory,
        round=round,
        params=params or {"w": np.ones((2, 3), np.float32)},
        outer_state=outer or {"m": np.zeros((2, 3), np.float32)},
        meta={
            "run_id": "abcd1234",
            "config": {k: v for k, v in config.flat().items() if k != "token"},
            **meta,
        },
    )
    checkpoint.keep_token(directory, "kept-token-123456")


def _resumed(*argv: str) -> RunConfig:
    return config_from(parse_args(build_parser(), ["shepherd", *argv]))


def test_resume_alone_continues_the_run_as_saved(tmp_path, monkeypatch):
    monkeypatch.delenv("PCP_TOKEN", raising=False)
    _saved_run(tmp_path / "ck")
    config = _resumed("--resume", str(tmp_path / "ck"))
    assert (config.network.port, config.network.workers, config.inner.steps) == (9123, 3, 7)
    assert (config.inner.lr, config.operator.metrics, config.operator.headless) == (
        3e-3,
        "old.jsonl",
        True,
    )
    assert config.security.token == "kept-token-123456"
    assert config.checkpoints.dir == config.checkpoints.resume == str(tmp_path / "ck")
    assert stat.S_IMODE((tmp_path / "ck").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "ck" / "token").stat().st_mode) == 0o600


def test_an_option_given_again_overrides_where_safe_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PCP_TOKEN", raising=False)
    _saved_run(tmp_path / "ck")
    config = _resumed(
        *("--resume", str(tmp_path / "ck"), "--port", "9200", "--workers", "5"),
        *("--metrics", "new.jsonl", "--rounds", "40", "--inner-steps", "7", "--token", "other"),
    )
    assert (config.network.port, config.network.workers, config.outer.rounds) == (9200, 5, 40)
    assert (config.operator.metrics, config.security.token) == ("new.jsonl", "other")
    assert config.inner.steps == 7  # given again with the saved value: no change, no refusal
    saved = SAVED.flat()
    assert capsys.readouterr().out == (
        f"resuming {tmp_path / 'ck'} with --rounds 40 (was {saved['rounds']}), --port 9200 "
        f"(was {saved['port']}), --workers 5 (was {saved['workers']}), --metrics new.jsonl "
        f"(was {saved['metrics']})\n"
    )  # in the options' order; the token is never shown, --inner-steps 7 changed nothing


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--inner-steps", "20"),
        ("--inner-lr", "0.01"),
        ("--seed", "3"),
        ("--aggregate", "mean"),
        ("--seq-len", "64"),
        ("--streaming-fragments", "7"),
        ("--model", "small"),
        ("--outer-lr", "1.0"),
    ],
)
def test_an_option_that_changes_the_run_is_refused_in_one_line(tmp_path, capsys, flag, value):
    _saved_run(tmp_path / "ck")
    assert main(["shepherd", "--resume", str(tmp_path / "ck"), flag, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{flag} {value} would change the run saved in" in err, err
    assert f"resume without {flag}" in err


def test_a_saved_option_of_the_wrong_type_is_refused(tmp_path, capsys):
    _saved_run(tmp_path / "ck")
    meta_path = tmp_path / "ck" / "round-000004" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["workers"] = "many"
    meta_path.write_text(json.dumps(meta))
    assert main(["shepherd", "--resume", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.workers" in err and "must be an integer" in err, err


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ({"params": {"w": np.array([[1, np.nan, 1], [1, 1, 1]], np.float32)}}, "'w' of params"),
        ({"outer": {"m": np.full((2, 3), np.inf, np.float32)}}, "'m' of outer"),
        ({"workers": {"w0": 10**12}}, "indices 0..1048575"),
        ({"workers": {"w0": -1}}, "indices 0.."),
    ],
)
def test_a_hostile_checkpoint_is_refused(tmp_path, damage, said):
    _saved_run(tmp_path / "ck", **damage)
    with pytest.raises(checkpoint.CheckpointRefused, match=re.escape(said)):
        checkpoint.load_latest(tmp_path / "ck")


def test_a_negative_or_inconsistent_round_is_refused(tmp_path):
    _saved_run(tmp_path / "ck")
    meta_path = tmp_path / "ck" / "round-000004" / "meta.json"
    for number in (-5, 9):
        meta = json.loads(meta_path.read_text())
        meta["round"] = number
        meta_path.write_text(json.dumps(meta))
        with pytest.raises(checkpoint.CheckpointRefused, match=f"says round {number}"):
            checkpoint.load_latest(tmp_path / "ck")


def test_latest_pointing_outside_the_directory_is_refused(tmp_path):
    _saved_run(tmp_path / "ck")
    _saved_run(tmp_path / "elsewhere")
    (tmp_path / "ck" / "latest").write_text("../elsewhere/round-000004\n")
    with pytest.raises(checkpoint.CheckpointRefused, match="not a round-NNNNNN directory"):
        checkpoint.inspect(tmp_path / "ck")


@pytest.mark.e2e
def test_a_nan_checkpoint_ends_the_shepherd_with_exit_2_in_one_line(tmp_path):
    """Issue 25: one NaN parameter used to repeat round 1 for ever (751 repeats in 300 s)."""
    config = small_config()
    workload = build_workload(config, shards=1)
    params = {n: np.array(p, np.float32) for n, p in workload.params.items()}
    name = sorted(params)[0]
    params[name].flat[0] = np.nan
    checkpoint.save(
        tmp_path / "ck",
        round=2,
        params=params,
        outer_state={},
        meta={
            "model": workload.name,
            "data_fingerprint": workload.corpus.fingerprint,
            "config": {k: v for k, v in config.flat().items() if k != "token"},
        },
    )
    result = subprocess.run(
        shepherd_command(0, "--resume", str(tmp_path / "ck")),
        capture_output=True,
        text=True,
        timeout=600,
        env=worker_env(),
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"tensor {name!r} of params.safetensors holds 1 non-finite value" in result.stderr


def test_a_nan_eval_loss_is_written_as_null(tmp_path):
    """Issue 25: the --metrics writer crashed the shepherd on a NaN eval loss."""
    state = RunState(run_id="r", rounds_total=3, settings={})
    writer = MetricsWriter(str(tmp_path / "m.jsonl"), state)
    state.subscribe(writer)
    state.emit(Done("run done", rounds=3, final_eval_loss=float("nan"), seconds=float("inf")))
    writer.close()
    row = json.loads((tmp_path / "m.jsonl").read_text())
    assert row["final_eval_loss"] is None and row["seconds"] is None


def _without_token(command: list[str]) -> list[str]:
    at = command.index("--token")
    return command[:at] + command[at + 2 :]


@pytest.mark.e2e
def test_resume_alone_brings_the_waiting_workers_back(tmp_path):
    """Issue 27 item 1: the default (random) token used to change on --resume, and every
    waiting worker got a final authFailed. Here the first run has no --token, stops on
    SIGINT, and `pcp-tui shepherd --resume DIR` alone (port, metrics, headless, workers,
    token from the checkpoint) gets the same worker process back to the end."""
    port = free_port()
    checkpoints, metrics = tmp_path / "ck", tmp_path / "run.jsonl"
    command = _without_token(
        shepherd_command(
            port,
            *("--workers", "1", "--rounds", "6", "--inner-steps", "4"),
            *("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "100"),
            *("--metrics", str(metrics)),
        )
    )
    env = {k: v for k, v in worker_env().items() if k != "PCP_TOKEN"}
    first = OutputProcess(command, env=env)
    worker = None
    try:
        token = first.wait_for(r"join with: .*--token (\S+)").group(1)
        worker = OutputProcess(
            worker_command(port, "--id", "w0", "--log-level", "info", token=token), env=env
        )
        first.wait_for(r"^round +1/")
        first.process.send_signal(signal.SIGINT)
        assert first.finish() == 128 + signal.SIGINT, first.output
        assert "pcp-tui shepherd --resume" in first.output
        worker.wait_for("waiting for the shepherd to be resumed, giving up in")
        stopped = checkpoint.load_latest(checkpoints)
        second = subprocess.run(
            [command[0], "-m", "pcp_tui", "shepherd", "--resume", str(checkpoints)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert second.returncode == 0, second.stdout + second.stderr
        assert "not a terminal" not in second.stdout  # --headless came back from the checkpoint
        assert worker.finish() == 0, worker.output
        assert "authFailed" not in worker.output
    finally:
        first.kill()
        if worker is not None:
            worker.kill()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    resumed = [r for r in rows if r["event"] == "resumed_from"]
    assert len(resumed) == 1 and resumed[0]["round"] == stopped.round
    rounds = [r["round"] for r in rows if r["event"] == "round"]
    assert rounds == list(range(1, 7))  # one metrics file, every round once
    done = [r for r in rows if r["event"] == "done"][-1]
    assert done["rounds"] == 6  # the run's rounds, not only those since the resume
    assert checkpoint.load_latest(checkpoints).round == 6
