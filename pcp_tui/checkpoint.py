"""Checkpoints a run can resume from, and other tools can read.

Layout of a checkpoint directory::

    DIR/round-000012/params.safetensors   global parameters (float32)
    DIR/round-000012/outer.safetensors    outer optimizer state
    DIR/round-000012/meta.json            round, config, data positions, run id
    DIR/latest                            name of the newest complete checkpoint

Each checkpoint is written into a temporary directory and renamed into place;
`latest` is replaced atomically afterwards. A crash at any point leaves the
previous `latest` pointing at a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

FORMAT = "pcp-tui-checkpoint/1"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says what to do."""


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
) -> Path:
    """Write round `round` atomically and point `latest` at it; keep the newest `keep`."""
    root = Path(directory)
    name = f"round-{round:06d}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            save_file(
                {k: np.ascontiguousarray(v) for k, v in params.items()},
                staging / "params.safetensors",
                metadata={"format": FORMAT, "round": str(round)},
            )
            save_file(
                {k: np.ascontiguousarray(v) for k, v in outer_state.items()},
                staging / "outer.safetensors",
            )
            _write_json(staging / "meta.json", {"format": FORMAT, "round": round, **meta})
            _fsync_dir(staging)
            final = root / name
            if final.exists():
                shutil.rmtree(final)
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _replace_text(root / "latest", name)
        _fsync_dir(root)
    except OSError as exc:
        raise CheckpointError(
            f"checkpoint of round {round} not written to {root}: {exc.strerror or exc}; "
            "the previous checkpoint is kept (free disk space or choose another --checkpoint-dir)"
        ) from None
    _prune(root, keep)
    return root / name


def load_latest(directory: str | os.PathLike) -> Checkpoint:
    """Read the checkpoint `latest` names; raises CheckpointError if there is none."""
    root = Path(directory)
    try:
        name = (root / "latest").read_text().strip()
    except FileNotFoundError:
        raise CheckpointError(
            f"no checkpoint in {root} (no 'latest' file); start without --resume"
        ) from None
    path = root / name
    try:
        meta = json.loads((path / "meta.json").read_text())
        params = load_file(path / "params.safetensors")
        outer = load_file(path / "outer.safetensors")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} is unreadable: {exc}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return Checkpoint(
        path=path, round=int(meta["round"]), params=params, outer_state=outer, meta=meta
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
