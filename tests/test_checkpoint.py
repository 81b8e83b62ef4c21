"""Checkpoints are atomic: a crash mid-write never breaks the latest one."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import safetensors
import trio
from safetensors.numpy import load_file

from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.shepherd.run import checkpoint
from pcp_tui.training.build import build_workload

from .conftest import small_config


def _params(value: float, size: int = 1000) -> dict[str, np.ndarray]:
    return {
        "wte": np.full((size,), value, np.float32),
        "h.0.w": np.full((size, 4), value, np.float32),
    }


def test_round_trip_and_latest_and_pruning(tmp_path):
    for r in range(1, 6):
        checkpoint.save(
            tmp_path,
            round=r,
            params=_params(r),
            outer_state={"m": np.ones(3, np.float32) * r},
            meta={"note": "x"},
            keep=2,
        )
    saved = checkpoint.load_latest(tmp_path)
    assert saved.round == 5 and saved.meta["note"] == "x"
    np.testing.assert_array_equal(saved.params["wte"], _params(5)["wte"])
    np.testing.assert_array_equal(saved.outer_state["m"], np.full(3, 5, np.float32))
    assert sorted(p.name for p in tmp_path.glob("round-*")) == ["round-000004", "round-000005"]
    # other tools read the weights with plain safetensors
    assert set(load_file(saved.path / "params.safetensors")) == {"wte", "h.0.w"}
    assert json.loads((saved.path / "meta.json").read_text())["round"] == 5


def test_missing_checkpoint_says_what_to_do(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="start without --resume"):
        checkpoint.load_latest(tmp_path)


def test_full_disk_keeps_previous_checkpoint(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, round=1, params=_params(1), outer_state={}, meta={})

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", disk_full)
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"No space left on device.*the previous checkpoint \(round-000001\) is kept \(free",
    ):
        checkpoint.save(tmp_path, round=2, params=_params(2), outer_state={}, meta={})
    monkeypatch.undo()
    assert checkpoint.load_latest(tmp_path).round == 1
    assert not list(tmp_path.glob(".round-*"))  # no half-written staging directory left behind


@pytest.mark.e2e
def test_a_file_size_limit_is_named_and_a_first_failure_says_nothing_is_saved(tmp_path):
    """A real RLIMIT_FSIZE (1 MiB) under a process writing a 4 MiB checkpoint: EFBIG, which
    safetensors reports in its text. Before: "the previous checkpoint is kept (free disk
    space, ...)" though there was none and no disk was full."""
    writer = textwrap.dedent(f"""
        import resource
        import numpy as np
        from pcp_tui.shepherd.run import checkpoint
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
        try:
            checkpoint.save({str(tmp_path)!r}, round=1, params={{"w": np.zeros(2**20, np.float32)}},
                            outer_state={{}}, meta={{}})
        except checkpoint.CheckpointError as exc:
            print(exc)
    """)
    said = subprocess.run(
        [sys.executable, "-c", writer], capture_output=True, text=True, check=True
    ).stdout
    assert "File too large" in said, said
    assert "no earlier checkpoint of this run is there to fall back on" in said
    assert "(ulimit -f)" in said and "free disk space" not in said


KILLED_AT = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from pcp_tui.shepherd.run import checkpoint
    directory, step, round, value = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    def kill_at(done):
        if done == step:
            os.kill(os.getpid(), signal.SIGKILL)
    params = {"wte": np.full((1000,), value, np.float32), "h.0.w": np.full((1000, 4), value, np.float32)}
    outer = {"wte": np.full((1000,), -value, np.float32)}
    checkpoint.save(directory, round=round, params=params, outer_state=outer, meta={}, fault_hook=kill_at)
""")


@pytest.mark.e2e
@pytest.mark.parametrize(
    "step, saved_again, resumes_from",
    [
        *[(step, False, (1, 1.0)) for step in checkpoint.WRITE_STEPS[:3]],
        ("renamed", False, (1, 1.0)),  # `latest` still names round 1, which is whole
        ("latest", False, (2, 2.0)),
        ("moved aside", True, (1, 1.0)),  # the old copy, read from where it was moved
        ("renamed", True, (1, 7.0)),
    ],
)
def test_a_process_killed_at_any_step_of_a_write_leaves_a_loadable_checkpoint(
    tmp_path, step, saved_again, resumes_from
):
    """SIGKILL from inside the write (its fault hook), at each step: what --resume reads is
    complete and of the round it claims. Round 1 is saved; the killed process saves round 2,
    or round 1 again (the old copy is moved aside first)."""
    checkpoint.save(
        tmp_path, round=1, params=_params(1), outer_state={"wte": _params(-1)["wte"]}, meta={}
    )
    round, value = (1, 7.0) if saved_again else (2, 2.0)
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AT, str(tmp_path), step, str(round), str(value)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr  # it reached `step`
    saved = checkpoint.load_latest(tmp_path)
    assert (saved.round, float(saved.params["wte"][0])) == resumes_from
    for name, tensor in saved.params.items():
        assert (tensor == resumes_from[1]).all(), name
    assert (saved.outer_state["wte"] == -resumes_from[1]).all()
    checkpoint.save(tmp_path, round=3, params=_params(3), outer_state={}, meta={}, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "round-000003"]


def test_a_round_directory_loads_too_and_the_message_fits_the_caller(tmp_path):
    checkpoint.save(tmp_path, round=1, params=_params(1), outer_state={}, meta={})
    checkpoint.save(tmp_path, round=2, params=_params(2), outer_state={}, meta={})
    assert checkpoint.load_latest(tmp_path / "round-000001").round == 1
    info = checkpoint.inspect(tmp_path)
    assert info.round == 2 and info.shapes == {"wte": (1000,), "h.0.w": (1000, 4)}
    with pytest.raises(checkpoint.CheckpointError, match=r"/nope: no such directory; use X$"):
        checkpoint.load_latest(tmp_path / "nope", hint="use X")
    (tmp_path / "empty").mkdir()
    with pytest.raises(checkpoint.CheckpointError, match=r"nor a round directory\); use Y$"):
        checkpoint.load_latest(tmp_path / "empty", hint="use Y")


def test_compatibility_names_the_model_before_the_data(tmp_path):
    meta = {"model": "mlp-16x64x4", "data_fingerprint": "rows"}
    checkpoint.save(tmp_path, round=1, params=_params(1), outer_state={}, meta=meta)
    saved, info = checkpoint.load_latest(tmp_path), checkpoint.inspect(tmp_path)
    shapes = {"wte": (1000,), "h.0.w": (1000, 4)}
    for found in (saved, info):
        checkpoint.check_compatible(found, "mlp-16x64x4", shapes, "rows")  # the same run: fine
        with pytest.raises(
            checkpoint.CheckpointError,
            match=r"holds model mlp-16x64x4, this run builds gpt2-tiny .*--model",
        ):
            checkpoint.check_compatible(found, "gpt2-tiny", {"wte": (256, 128)}, "tokens")
        with pytest.raises(checkpoint.CheckpointError, match=r"tensor 'wte' is \[1000\] there"):
            checkpoint.check_compatible(found, "mlp-16x64x4", {**shapes, "wte": (9,)}, "rows")
        with pytest.raises(checkpoint.CheckpointError, match="trained on other data"):
            checkpoint.check_compatible(found, "mlp-16x64x4", shapes, "other rows")


# --------------------------------------------------------------------------- writes that fail


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nothing may be written into: permissions for a user, a read-only mount for root."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    if os.geteuid() != 0:
        directory.chmod(0o555)
        yield directory
        directory.chmod(0o755)
        return
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(directory)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"root cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_an_unreadable_latest_checkpoint_names_the_one_before_it(tmp_path):
    """A truncated file (a bad disk, a copy cut short) must not leave the operator guessing:
    the error names the newest complete checkpoint before it, the --resume to use."""
    for r in (2, 4):
        checkpoint.save(tmp_path, round=r, params=_params(r), outer_state={}, meta={})
    os.truncate(tmp_path / "round-000004" / "params.safetensors", 100)
    for read in (checkpoint.load_latest, checkpoint.inspect):
        with pytest.raises(checkpoint.CheckpointError) as refused:
            read(tmp_path)
        message = str(refused.value)
        assert message.startswith(f"checkpoint {tmp_path / 'round-000004'} is unreadable: ")
        assert message.endswith(
            f"resume from the one before it with --resume {tmp_path / 'round-000002'}"
        )
    assert checkpoint.load_latest(tmp_path / "round-000002").round == 2


def _flip_bit(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def test_a_bit_flipped_or_edited_checkpoint_is_refused_naming_the_one_before_it(tmp_path):
    """A flipped bit in a tensor's bytes (a bad disk, memory, a network copy) still parses:
    before, --resume loaded it and trained on a wrong parameter without a word. Each file's
    size and CRC-32 are in meta.json now; a mismatch is the unreadable-checkpoint error. A
    meta.json that parses but lost a field is that error too (before: a KeyError traceback)."""
    for r in (2, 4):
        checkpoint.save(tmp_path, round=r, params=_params(r), outer_state=_params(-r), meta={})
    latest = tmp_path / "round-000004"
    earlier = f"resume from the one before it with --resume {tmp_path / 'round-000002'}"
    for name in ("params.safetensors", "outer.safetensors"):
        good = (latest / name).read_bytes()
        _flip_bit(latest / name, len(good) - 5)  # inside the last tensor's data
        with pytest.raises(checkpoint.CheckpointError) as refused:
            checkpoint.load_latest(tmp_path)
        message = str(refused.value)
        assert message.startswith(f"checkpoint {latest} is unreadable: {name} ")
        assert "checksum" in message and message.endswith(earlier), message
        (latest / name).write_bytes(good)
    assert checkpoint.load_latest(tmp_path).round == 4  # restored: its own bytes again
    meta = json.loads((latest / "meta.json").read_text())
    del meta["round"]
    (latest / "meta.json").write_text(json.dumps(meta))
    for read in (checkpoint.load_latest, checkpoint.inspect):
        with pytest.raises(checkpoint.CheckpointError, match="is unreadable: .*round") as refused:
            read(tmp_path)
        assert str(refused.value).endswith(earlier)


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A directory on a 5 MiB disk: a real tmpfs for root, else writes past 5 MiB fail as ENOSPC."""
    directory, capacity = tmp_path / "small-disk", 5 * 2**20
    directory.mkdir()
    mounted = (
        os.geteuid() == 0
        and not subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={capacity}", "tmpfs", str(directory)],
            capture_output=True,
            check=False,
        ).returncode
    )
    if not mounted:  # the same full disk, as the filesystem would report it
        honest_save_file = checkpoint.save_file

        def save_file(tensors, path, metadata=None):
            used = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
            if used + sum(t.nbytes for t in tensors.values()) > capacity:
                raise OSError(errno.ENOSPC, "No space left on device")
            return honest_save_file(tensors, path, metadata=metadata)

        monkeypatch.setattr(checkpoint, "save_file", save_file)
    try:
        yield directory
    finally:
        if mounted:
            subprocess.run(["umount", str(directory)], check=True)


@pytest.mark.e2e
def test_a_disk_full_of_older_checkpoints_makes_room_for_the_newest(small_disk):
    """Two 2 MiB checkpoints fill the disk; the third would be refused for ever (the run
    would go on with no checkpoint after round 2). The older ones make room instead;
    the latest is never removed before its successor is complete."""
    for r in range(1, 5):
        checkpoint.save(small_disk, round=r, params=_params(r, 100_000), outer_state={}, meta={})
        assert checkpoint.load_latest(small_disk).round == r
    names = sorted(p.name for p in small_disk.iterdir())
    assert names == ["latest", "round-000003", "round-000004"]
    saved = checkpoint.load_latest(small_disk)
    np.testing.assert_array_equal(saved.params["wte"], _params(4, 100_000)["wte"])


@pytest.mark.e2e
def test_a_read_only_directory_is_a_checkpoint_error(read_only_dir):
    with pytest.raises(
        checkpoint.CheckpointError, match=r"not written to .*no earlier checkpoint.*permissions"
    ):
        checkpoint.save(read_only_dir / "run", round=1, params=_params(1), outer_state={}, meta={})


def test_a_writer_error_that_is_no_oserror_is_a_checkpoint_error(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, round=1, params=_params(1), outer_state={}, meta={})

    def broken(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: IoError")

    monkeypatch.setattr(checkpoint, "save_file", broken)
    with pytest.raises(checkpoint.CheckpointError, match=r"IoError \(SafetensorError\)"):
        checkpoint.save(tmp_path, round=2, params=_params(2), outer_state={}, meta={})
    monkeypatch.undo()
    assert checkpoint.load_latest(tmp_path).round == 1
    assert not list(tmp_path.glob(".round-*"))


def test_killed_before_the_first_latest_the_complete_round_still_resumes(tmp_path):
    checkpoint.save(tmp_path, round=3, params=_params(3), outer_state={}, meta={})
    (tmp_path / "latest").unlink()  # the state a kill between rename and `latest` leaves
    assert checkpoint.load_latest(tmp_path).round == 3


def test_saving_a_round_again_replaces_it_whole(tmp_path):
    checkpoint.save(tmp_path, round=1, params=_params(1), outer_state={}, meta={})
    checkpoint.save(tmp_path, round=1, params=_params(7), outer_state={}, meta={})
    assert (checkpoint.load_latest(tmp_path).params["wte"] == 7).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "round-000001"]


@pytest.mark.e2e
async def test_a_failing_write_is_an_event_and_the_run_goes_on(tmp_path, monkeypatch, spawn_worker):
    """A real run checkpoints every round while the next trains; round 2's write raises."""
    config = small_config(
        workers=1, rounds=3, inner_steps=2, chunk_steps=2, checkpoint_every=1,
        checkpoint_dir=str(tmp_path),
    )  # fmt: skip
    shepherd = Shepherd(config, build_workload(config, shards=1))
    honest_save_file = checkpoint.save_file

    def save_file(tensors, path, metadata=None):
        if metadata and metadata.get("round") == "2":
            raise safetensors.SafetensorError("Error while serializing: IoError")
        return honest_save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(checkpoint, "save_file", save_file)

    async with trio.open_nursery() as nursery:
        spawn_worker(await nursery.start(shepherd.run))
    events = [(e.kind, e.fields().get("round")) for e in shepherd.state.events]
    assert ("checkpoint_failed", 2) in events and ("checkpoint", 3) in events
    assert shepherd.state.status == "done" and len(shepherd.state.history) == 3
    assert sorted(p.name for p in tmp_path.glob("round-*")) == ["round-000001", "round-000003"]
    # each checkpoint holds its own round's parameters, though the next round ran meanwhile
    for number in (1, 3):
        saved = checkpoint.load_latest(tmp_path / f"round-{number:06d}")
        assert shepherd.evaluate(saved.params) == shepherd.state.history[number - 1].eval_loss
        # and its meta says that loss, of that round (it said the round before's)
        assert saved.meta["eval_loss"] == shepherd.state.history[number - 1].eval_loss
        assert saved.meta["eval_round"] == number
