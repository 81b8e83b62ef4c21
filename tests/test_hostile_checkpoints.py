"""`--resume` from a checkpoint someone else made: what it reads back is checked before the run.

Each case was reproduced against `Shepherd(config, workload)` with `--resume` before the
fix: meta.json entries of the wrong shape ended the shepherd with a traceback
(AttributeError, KeyError, TypeError), a round of 2^40 was taken (a `roundStart` carries a
UInt32), and a `latest` linked to /dev/zero filled memory (MemoryError) where a FIFO named
meta.json hung the start for ever. Now each is a CheckpointRefused naming what is wrong
(exit 2 from the CLI).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pcp_tui.shepherd.run import checkpoint


def _saved(directory, **meta):
    checkpoint.save(
        directory,
        round=4,
        params={"w": np.ones((2, 3), np.float32)},
        outer_state={"m": np.zeros((2, 3), np.float32)},
        meta={"run_id": "abcd1234", **meta},
    )
    return directory / "round-000004"


def _edit_meta(round_dir, **entries):
    path = round_dir / "meta.json"
    meta = json.loads(path.read_text())
    meta.update(entries)
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("entries", "said"),
    [
        ({"files": [1]}, "meta.json's files must map"),
        ({"files": {"params.safetensors": 3}}, "meta.json's files must map"),
        ({"shard_ledger": {"shards": [{}]}}, "shard_ledger.shards must be"),
        ({"shard_ledger": {"shards": 5}}, "shard_ledger.shards must be"),
        ({"shard_ledger": {"shards": [{"rounds": "x", "tokens": 1}]}}, "shard_ledger.shards"),
        ({"shard_ledger": {"shards": [{"rounds": -1, "tokens": 1}]}}, "shard_ledger.shards"),
        ({"shard_ledger": {"last_shard": [1]}}, "shard_ledger.last_shard must map"),
        ({"shard_ledger": {"last_shard": {"w0": -3}}}, "shard_ledger.last_shard must map"),
        ({"shard_ledger": []}, "shard_ledger.shards must be"),
        ({"eval_loss": "abc"}, "eval_loss must be a number or null"),
        ({"workers": [1]}, "workers must map worker ids to indices 0.."),
    ],
)
def test_a_meta_entry_of_the_wrong_shape_is_refused_naming_it(tmp_path, entries, said):
    _edit_meta(_saved(tmp_path / "ck"), **entries)
    with pytest.raises(checkpoint.CheckpointRefused, match=said):
        checkpoint.load_latest(tmp_path / "ck")
    with pytest.raises(checkpoint.CheckpointRefused, match=said):
        checkpoint.inspect(tmp_path / "ck")  # what `--resume` reads the run's options with


def test_a_round_beyond_what_a_round_start_carries_is_refused(tmp_path):
    round_dir = _saved(tmp_path / "ck")
    _edit_meta(round_dir, round=2**40)
    elsewhere = round_dir.rename(tmp_path / "x")  # a directory whose name says no round
    with pytest.raises(checkpoint.CheckpointRefused, match="says round 1099511627776, not 0.."):
        checkpoint.load_latest(elsewhere)


def test_an_honest_checkpoints_meta_passes(tmp_path):
    _saved(
        tmp_path / "ck",
        workers={"w0": 0, "w1": 7},
        shard_ledger={"shards": [{"rounds": 3, "tokens": 900}], "last_shard": {"w0": 0}},
        eval_loss=float("nan"),  # written as null
    )
    assert checkpoint.load_latest(tmp_path / "ck").round == 4


def test_latest_linked_to_dev_zero_is_refused_unread(tmp_path):
    _saved(tmp_path / "ck")
    (tmp_path / "ck" / "latest").unlink()
    os.symlink("/dev/zero", tmp_path / "ck" / "latest")
    with pytest.raises(checkpoint.CheckpointRefused, match="leads to '/dev/zero', outside it"):
        checkpoint.load_latest(tmp_path / "ck")


def test_a_fifo_for_meta_json_is_refused_unread(tmp_path):
    round_dir = _saved(tmp_path / "ck")
    (round_dir / "meta.json").unlink()
    os.mkfifo(round_dir / "meta.json")
    with pytest.raises(checkpoint.CheckpointRefused, match="not a regular file"):
        checkpoint.load_latest(tmp_path / "ck")


def test_a_round_directory_linked_to_another_run_is_refused(tmp_path):
    round_dir = _saved(tmp_path / "ck")
    other = _saved(tmp_path / "other")
    for name in os.listdir(round_dir):
        (round_dir / name).unlink()
    round_dir.rmdir()
    os.symlink(other, round_dir)
    with pytest.raises(checkpoint.CheckpointRefused, match="outside it"):
        checkpoint.load_latest(tmp_path / "ck")


def test_a_token_file_linked_to_dev_zero_is_refused_unread(tmp_path):
    _saved(tmp_path / "ck")
    os.symlink("/dev/zero", tmp_path / "ck" / "token")
    with pytest.raises(checkpoint.CheckpointRefused, match="leads to '/dev/zero'"):
        checkpoint.saved_token(tmp_path / "ck")


def test_a_checkpoint_directory_reached_through_a_link_still_loads(tmp_path):
    _saved(tmp_path / "real")
    os.symlink(tmp_path / "real", tmp_path / "ck")  # the operator's own link to the directory
    assert checkpoint.load_latest(tmp_path / "ck").round == 4
