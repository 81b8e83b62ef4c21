"""Checkpoints a run can resume from, and other tools can read.

Layout of a checkpoint directory::

    DIR/round-000012/params.safetensors   global parameters (float32)
    DIR/round-000012/outer.safetensors    outer optimizer state
    DIR/round-000012/meta.json            round, config, data positions, run id, and
                                          each tensor file's size and CRC-32
    DIR/latest                            name of the newest complete checkpoint
    DIR/token                             the run's join token (mode 0600, DIR 0700), so that
                                          `--resume DIR` lets the waiting workers back in

Each checkpoint is written into a temporary directory, every file fsynced, and
renamed into place; `latest` is replaced atomically afterwards. A crash at any
point leaves the previous `latest` pointing at a complete checkpoint; a crash
between the rename and the first `latest` leaves a complete round directory,
which `locate` falls back to; one while a round is saved again, between moving
the old copy aside and renaming the new one in, leaves the old copy aside,
which `locate` reads. A write that fails for any reason (full disk,
permissions, a safetensors error) is a CheckpointError: the caller reports it
and the run goes on. A full disk first gives up the checkpoints older than the
latest, then the write is tried once more. A file whose size or CRC-32 differs
from what meta.json recorded (a flipped bit still parses as tensors) is unreadable:
the error names the complete checkpoint before it.

A checkpoint is checked as it is loaded (`check_sane`): a NaN parameter, a
non-finite optimizer state, a negative round or an absurd worker index in meta.json,
or a `latest` that points outside the directory would otherwise wedge or poison
the resumed run; such a checkpoint is refused (CheckpointRefused) naming what is wrong.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from pcp_tui.shepherd.run.state import finite_or_null

FORMAT = "pcp-tui-checkpoint/1"

#: The steps of a write, in order, as `save` names them to its `fault_hook` once each is done
#: (a test that kills the writer at each of them checks that every crash leaves a loadable
#: checkpoint). "moved aside" only happens when the round is saved again.
WRITE_STEPS = (
    "params.safetensors",
    "outer.safetensors",
    "meta.json",
    "moved aside",
    "renamed",
    "latest",
)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says what to do."""


class CheckpointRefused(CheckpointError):
    """A checkpoint was read but holds what no run can continue from (NaN, a bad meta.json)."""


# Worker indices a checkpoint may hold: far above any run's churn, far below what stalls a join.
MAX_WORKER_INDEX = 1 << 20
# Rounds a checkpoint may say it holds: a round number travels as a UInt32 in `roundStart`
MAX_ROUND = (1 << 31) - 1
# meta.json and `latest` are small; a bigger one (or /dev/zero behind a link) is not read
MAX_META_BYTES = 16 << 20
_ROUND_NAME = re.compile(r"round-(\d{6,})")


@dataclass
class Checkpoint:
    path: Path
    round: int
    params: dict[str, np.ndarray]
    outer_state: dict[str, np.ndarray]
    meta: dict[str, Any]


def save(
    directory: str | os.PathLike,
    *,
    round: int,
    params: dict[str, np.ndarray],
    outer_state: dict[str, np.ndarray],
    meta: dict[str, Any],
    keep: int = 3,
    fault_hook: Callable[[str], None] | None = None,
) -> Path:
    """Write round `round` atomically and point `latest` at it; keep the newest `keep`.

    `fault_hook(step)` is called after each of `WRITE_STEPS` (fault injection for tests:
    a hook that kills the process there is a crash at that moment of the write).

    CheckpointError for any failure of the write, whatever raised it: a
    checkpoint that cannot be written must never end the run that asked for it.
    A write that finds the disk full removes the checkpoints older than the latest
    and tries once more: else a disk with room for fewer than `keep` would refuse
    every checkpoint after it filled, and a crash would lose every round since.
    """
    root = Path(directory)
    done = fault_hook or (lambda step: None)
    try:
        _save_once(root, round, params, outer_state, meta, done)
    except Exception as exc:  # safetensors' own errors are no OSError; all mean "not written"
        if not (_no_space(exc) and _remove_older_than_latest(root)):
            raise _not_written(root, round, exc) from None
        try:
            _save_once(root, round, params, outer_state, meta, done)
        except Exception as again:  # noqa: BLE001 - reported as the CheckpointError below
            raise _not_written(root, round, again) from None
    _prune(root, keep)
    return root / f"round-{round:06d}"


def _save_once(
    root: Path,
    round: int,
    params: dict,
    outer_state: dict,
    meta: dict[str, Any],
    done: Callable[[str], None],
) -> None:
    name = f"round-{round:06d}"
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        _write_round(staging, round, params, outer_state, meta, done)
        _move_into_place(staging, root / name, done)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _replace_text(root / "latest", name)
    _fsync_dir(root)
    done("latest")


def _not_written(root: Path, round: int, exc: Exception) -> CheckpointError:
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
    try:
        kept = f"the previous checkpoint ({(root / 'latest').read_text().strip()}) is kept"
    except OSError:  # every write so far failed: say so, it is the operator's only warning
        kept = "no earlier checkpoint of this run is there to fall back on"
    if _too_large(exc):
        advice = "raise the shell's file-size limit (ulimit -f) or choose another --checkpoint-dir"
    else:
        advice = (
            "free disk space, fix the directory's permissions or choose another --checkpoint-dir"
        )
    return CheckpointError(
        f"checkpoint of round {round} not written to {root}: {reason} "
        f"({type(exc).__name__}); {kept} ({advice})"
    )


def _too_large(exc: Exception) -> bool:
    """Whether a write passed the process's file-size limit (RLIMIT_FSIZE: EFBIG)."""
    if isinstance(exc, OSError):
        return exc.errno == errno.EFBIG
    return "File too large" in str(exc)


def _no_space(exc: Exception) -> bool:
    """Whether a write failed for lack of space (safetensors reports it only in its text)."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(exc)
    return "No space left on device" in text or "Disk quota exceeded" in text


def _remove_older_than_latest(root: Path) -> bool:
    """Delete every complete checkpoint but the one `latest` names; whether any was."""
    try:
        latest = (root / "latest").read_text().strip()
    except OSError:
        return False  # without a known latest, nothing is safe to remove
    older = [p for p in root.glob("round-*") if p.is_dir() and p.name != latest]
    for path in older:
        shutil.rmtree(path, ignore_errors=True)
    return bool(older)


def _write_round(
    staging: Path,
    round: int,
    params: dict[str, np.ndarray],
    outer_state: dict[str, np.ndarray],
    meta: dict[str, Any],
    done: Callable[[str], None],
) -> None:
    """The round's three files, each fsynced (a rename must never expose unflushed data)."""
    save_file(
        {k: np.ascontiguousarray(v) for k, v in params.items()},
        staging / "params.safetensors",
        metadata={"format": FORMAT, "round": str(round)},
    )
    done("params.safetensors")
    save_file(
        {k: np.ascontiguousarray(v) for k, v in outer_state.items()},
        staging / "outer.safetensors",
    )
    done("outer.safetensors")
    files = {}
    for written in TENSOR_FILES:
        _fsync_file(staging / written)
        files[written] = _fingerprint(staging / written)  # read back: what the disk holds
    _write_json(staging / "meta.json", {"format": FORMAT, "round": round, **meta, "files": files})
    _fsync_dir(staging)
    done("meta.json")


TENSOR_FILES = ("params.safetensors", "outer.safetensors")


def _fingerprint(path: Path) -> dict[str, int]:
    """Size and CRC-32 of a file, read in 16 MiB pieces (about a second for GPT-2's 1 GB)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while piece := f.read(16 << 20):
            crc, size = zlib.crc32(piece, crc), size + len(piece)
    return {"bytes": size, "crc32": crc}


def _verify(path: Path, meta: dict[str, Any]) -> None:
    """ValueError unless each tensor file is what meta.json recorded (older checkpoints: no record)."""
    for name, recorded in (meta.get("files") or {}).items():
        if name not in TENSOR_FILES:
            continue
        found = _fingerprint(path / name)
        if found != recorded:
            raise ValueError(
                f"{name} does not match its checksum in meta.json ({found['bytes']} bytes, "
                f"CRC-32 {found['crc32']:08x}; written: {recorded}): a damaged disk or copy"
            )


def _move_into_place(staging: Path, final: Path, done: Callable[[str], None]) -> None:
    """Rename `staging` to `final`; an existing `final` is moved aside first, never half-deleted."""
    aside = None
    if final.exists():
        aside = final.with_name(f".{final.name}-replaced")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        done("moved aside")
    os.rename(staging, final)
    done("renamed")
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


RESUME_HINT = "pass the --checkpoint-dir of an earlier run, or start without --resume"


@dataclass
class CheckpointInfo:
    """What a checkpoint holds, read without loading its tensors."""

    path: Path
    round: int
    shapes: dict[str, tuple[int, ...]]
    meta: dict[str, Any]


def locate(directory: str | os.PathLike, *, hint: str = RESUME_HINT) -> Path:
    """The round directory to read: the one `latest` names, or `directory` itself if it is one.

    CheckpointError (ending with `hint`, which says what the caller can do) when there is none.
    """
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"no checkpoint at {root}: no such directory; {hint}")
    _check_files(root, [root / "latest"], hint)
    path = _find(root, hint)
    _check_files(root, [path / name for name in ("meta.json", *TENSOR_FILES)], hint)
    return path


def _check_files(root: Path, files: list[Path], hint: str) -> None:
    """CheckpointRefused unless each of `files` that exists is a regular file inside `root`.

    A link to a FIFO or /dev/zero would hang the read or fill memory; one to another
    directory would resume something the operator did not point at.
    """
    base = root.resolve()
    for file in files:
        if not file.exists() and not file.is_symlink():
            continue  # missing files are `_unreadable`'s to report
        real = file.resolve()
        if not real.is_relative_to(base) or not real.is_file():
            where = "outside it" if not real.is_relative_to(base) else "not a regular file"
            raise CheckpointRefused(
                f"{file} leads to {str(real)[:120]!r}, {where}: a checkpoint's files are "
                f"regular files inside {root}; {hint}"
            )
        if file.name in ("latest", "meta.json") and real.stat().st_size > MAX_META_BYTES:
            raise CheckpointRefused(
                f"{file} holds {real.stat().st_size} bytes, more than a checkpoint's "
                f"{MAX_META_BYTES}: a damaged or edited checkpoint; {hint}"
            )


def _find(root: Path, hint: str) -> Path:
    """The round directory `latest` names in `root`, or `root` itself, or the newest complete."""
    try:
        name = (root / "latest").read_text().strip()
    except FileNotFoundError:
        if (root / "meta.json").is_file():  # a round-NNNNNN directory of a run
            return root
        complete = sorted(p for p in root.glob("round-*") if (p / "meta.json").is_file())
        if complete:  # killed after the first rename, before `latest` was written
            return complete[-1]
        raise CheckpointError(
            f"no checkpoint in {root} (neither a 'latest' file nor a round directory); {hint}"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {root / 'latest'}: {exc.strerror or exc}") from None
    if not _ROUND_NAME.fullmatch(name):  # a `latest` of "../x" would read outside `root`
        raise CheckpointRefused(
            f"{root / 'latest'} names {name[:80]!r}, not a round-NNNNNN directory of {root}; {hint}"
        )
    aside = root / f".{name}-replaced"  # killed while saving `name` again (`_move_into_place`)
    if not (root / name / "meta.json").is_file() and (aside / "meta.json").is_file():
        return aside  # the complete checkpoint `latest` named, not yet replaced
    return root / name


def inspect(directory: str | os.PathLike, *, hint: str = RESUME_HINT) -> CheckpointInfo:
    """Round, meta and tensor shapes of the checkpoint `locate` finds (headers only: cheap)."""
    path = locate(directory, hint=hint)
    try:
        meta = _read_meta(path)
        _check_meta(path, meta)
        with safe_open(path / "params.safetensors", "numpy") as tensors:
            shapes = {n: tuple(tensors.get_slice(n).get_shape()) for n in tensors.keys()}  # noqa: SIM118
    except _UNREADABLE as exc:
        raise _unreadable(path, exc, hint) from None
    return CheckpointInfo(path=path, round=meta["round"], shapes=shapes, meta=meta)


def load_latest(directory: str | os.PathLike, *, hint: str = RESUME_HINT) -> Checkpoint:
    """Read the checkpoint `latest` names (or `directory` itself, if it is a round directory).

    Raises CheckpointError if there is none; the message ends with `hint`.
    """
    path = locate(directory, hint=hint)
    try:
        meta = _read_meta(path)
        _check_meta(path, meta)
        _verify(path, meta)
        params = load_file(path / "params.safetensors")
        outer = load_file(path / "outer.safetensors")
    except _UNREADABLE as exc:
        raise _unreadable(path, exc, hint) from None
    saved = Checkpoint(path=path, round=meta["round"], params=params, outer_state=outer, meta=meta)
    check_sane(saved)
    return saved


def check_sane(saved: Checkpoint) -> None:
    """CheckpointRefused unless `saved` is something a run can continue from.

    Every parameter and optimizer-state value finite (one NaN parameter makes every
    worker refuse every round; a NaN momentum makes every later step NaN), the
    round the one its directory's name says (meta.json's entries: `_check_meta`, as it
    is read). The message names the file and what is wrong in it.
    """
    where = f"checkpoint {saved.path}"
    for file, tensors in (("params", saved.params), ("outer", saved.outer_state)):
        for name, value in tensors.items():
            bad = np.size(value) - int(np.count_nonzero(np.isfinite(value)))
            if bad:
                raise CheckpointRefused(
                    f"{where}: tensor {name!r} of {file}.safetensors holds {bad} non-finite "
                    "value(s) (NaN or inf): a run cannot continue from it; resume from an "
                    "earlier round-NNNNNN directory, or start a new run"
                )
    numbered = _ROUND_NAME.fullmatch(saved.path.name.lstrip(".").removesuffix("-replaced"))
    if numbered and int(numbered.group(1)) != saved.round:
        raise CheckpointRefused(
            f"{where}: meta.json says round {saved.round}, its directory is {saved.path.name}; "
            "a damaged or edited checkpoint: resume from another round-NNNNNN directory"
        )


def _is_count(value: Any, bound: int | float = float("inf")) -> bool:
    """An int (not a bool) in 0..bound-1."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < bound


def _check_meta(path: Path, meta: dict[str, Any]) -> None:
    """CheckpointRefused naming the first entry of meta.json a run cannot take back.

    The round, worker indices, the shard ledger, the eval loss and the file records
    are read back into the run: each must have the shape the shepherd writes.
    """
    round_number = meta["round"]
    if not _is_count(round_number, MAX_ROUND + 1):
        raise CheckpointRefused(
            f"checkpoint {path}: meta.json says round {round_number}, not 0..{MAX_ROUND}; "
            "a damaged or edited checkpoint: resume from another round-NNNNNN directory"
        )
    ledger = meta.get("shard_ledger", {})
    checks = (
        (
            "workers",
            f"map worker ids to indices 0..{MAX_WORKER_INDEX - 1}",
            lambda v: (
                isinstance(v, dict) and all(_is_count(i, MAX_WORKER_INDEX) for i in v.values())
            ),
            meta.get("workers", {}),
        ),
        (
            "shard_ledger.shards",
            'be a list of {"rounds": n, "tokens": n} with n >= 0',
            lambda v: (
                isinstance(v, list)
                and all(
                    isinstance(s, dict)
                    and _is_count(s.get("rounds"))
                    and _is_count(s.get("tokens"))
                    for s in v
                )
            ),
            ledger.get("shards", []) if isinstance(ledger, dict) else None,
        ),
        (
            "shard_ledger.last_shard",
            "map worker ids to shard indices >= 0",
            lambda v: isinstance(v, dict) and all(_is_count(i) for i in v.values()),
            ledger.get("last_shard", {}) if isinstance(ledger, dict) else None,
        ),
        (
            "eval_loss",
            "be a number or null",
            lambda v: v is None or (isinstance(v, int | float) and not isinstance(v, bool)),
            meta.get("eval_loss"),
        ),
        (
            "eval_round",  # the round whose parameters eval_loss is of
            f"be a round 0..{round_number} or null",
            lambda v: v is None or _is_count(v, round_number + 1),
            meta.get("eval_round"),
        ),
        (
            "files",
            'map file names to {"bytes": n, "crc32": n}',
            lambda v: (
                isinstance(v, dict)
                and all(isinstance(r, dict) and set(r) == {"bytes", "crc32"} for r in v.values())
            ),
            meta.get("files") or {},
        ),
    )
    for key, must, holds, value in checks:
        if not holds(value):
            raise CheckpointRefused(
                f"checkpoint {path}: meta.json's {key} must {must} (found {str(value)[:80]}): "
                "a damaged or edited checkpoint; remove that entry or resume from another round"
            )


_UNREADABLE = (OSError, ValueError, safetensors.SafetensorError)


def _unreadable(path: Path, exc: Exception, hint: str) -> CheckpointError:
    """The error for a checkpoint that cannot be read, naming the newest complete one before it."""
    earlier = sorted(
        p for p in path.parent.glob("round-*") if p.name < path.name and (p / "meta.json").is_file()
    )
    advice = f"resume from the one before it with --resume {earlier[-1]}" if earlier else hint
    return CheckpointError(f"checkpoint {path} is unreadable: {exc}; {advice}")


def check_compatible(
    saved: Checkpoint | CheckpointInfo,
    model_name: str,
    shapes: dict[str, tuple[int, ...]],
    fingerprint: str,
) -> None:
    """CheckpointError unless this run (model, tensor shapes, data) can continue `saved`.

    The model is checked before the data: another --model usually means other
    data too, and "other data" would send the user after the wrong option.
    """
    saved_shapes = (
        saved.shapes
        if isinstance(saved, CheckpointInfo)
        else {n: tuple(p.shape) for n, p in saved.params.items()}
    )
    saved_model = saved.meta.get("model")
    if (saved_model is not None and saved_model != model_name) or saved_shapes != shapes:
        differs = _first_difference(saved_shapes, shapes)
        raise CheckpointError(
            f"{saved.path} holds model {saved_model or '?'}, this run builds {model_name}"
            f"{f' ({differs})' if differs else ''}; resume with the --model (and model options) "
            "of the run that wrote it"
        )
    if saved.meta.get("data_fingerprint") != fingerprint:
        raise CheckpointError(
            f"{saved.path} was trained on other data; resume with the same --data and --data-max-bytes"
        )


def _first_difference(saved: dict[str, tuple], ours: dict[str, tuple]) -> str:
    for name in sorted(set(saved) | set(ours)):
        if name not in ours:
            return f"it has tensor {name!r}, this model does not"
        if name not in saved:
            return f"this model has tensor {name!r}, it does not"
        if saved[name] != ours[name]:
            return f"tensor {name!r} is {list(saved[name])} there, {list(ours[name])} here"
    return ""


def _read_meta(path: Path) -> dict[str, Any]:
    """meta.json, its round an int; ValueError for one that parses but is not a checkpoint's."""
    meta = json.loads((path / "meta.json").read_text())
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{path} has format {found!r}, expected {FORMAT!r}")
    if not isinstance(meta.get("round"), int) or isinstance(meta.get("round"), bool):
        raise ValueError(f"meta.json has no round number (found {meta.get('round')!r})")
    return meta


TOKEN_FILE = "token"


def keep_token(directory: str | os.PathLike, token: str) -> None:
    """Write the run's join token to `directory`/token, readable by its owner only.

    The directory is made (or set) 0700 and the file 0600: `--resume` reads the token
    back, so the workers waiting for the run are let in again. CheckpointError if
    the directory cannot hold it (the run goes on; a resume then needs --token).
    """
    root = Path(directory)
    try:
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        tmp = root / f".{TOKEN_FILE}.tmp"
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / TOKEN_FILE)
    except OSError as exc:
        raise CheckpointError(
            f"cannot keep the join token in {root} ({exc.strerror or exc}); a --resume of this "
            "run will need the same --token"
        ) from None


def saved_token(directory: str | os.PathLike) -> str | None:
    """The token `keep_token` wrote for the run in `directory` (or its parent, for a round
    directory); None if there is none."""
    root = Path(directory)
    for candidate in (root / TOKEN_FILE, root.parent / TOKEN_FILE):
        if candidate.exists():  # not a FIFO or /dev/zero behind a link: it would never end
            _check_files(candidate.parent, [candidate], "start without --resume, with --token")
        try:
            token = candidate.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise CheckpointError(
                f"cannot read the run's token {candidate}: {exc.strerror}"
            ) from None
        return token or None
    return None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(finite_or_null(data), f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: Path, keep: int) -> None:
    rounds = sorted(p for p in root.glob("round-*") if p.is_dir())
    for old in rounds[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".round-*"):  # staging dirs of interrupted writes
        shutil.rmtree(stale, ignore_errors=True)
