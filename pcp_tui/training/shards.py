"""A worker's shard: how it ships in a plan and how batches are drawn from it (numpy only).

Both sides import this module: the shepherd to ship a shard, the worker to sample
its batches with a seed and a stream (slot, round, chunk), so the same run draws
the same batches again after a restart. Nothing here loads a corpus or a model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from pcp_tui import protocol

MAX_DATA_TENSORS = 64


class DataError(ValueError):
    """The data cannot feed this run; the message says what to change."""


class MissingData(DataError):
    """`--data` names a file, folder or archive that does not exist: an option that cannot work."""


def fingerprint(*arrays: np.ndarray) -> str:
    """sha256 hex over each array's dtype, length and bytes: equal only for equal token streams."""
    digest = hashlib.sha256()
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}:{array.size};".encode())
        digest.update(array.data.cast("B"))
    return digest.hexdigest()


def sample_batches(
    tokens: np.ndarray,
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    stream: tuple[int, ...],
) -> np.ndarray:
    """int32[steps, batch_size, seq_len + 1]: random contiguous windows of `tokens`.

    The same (seed, stream) always gives the same batches; different streams
    give independent ones.
    """
    window = seq_len + 1
    if len(tokens) < window + 1:
        raise DataError(
            f"the data shard has {len(tokens)} tokens, too few for windows of {window}; "
            "use fewer workers, a shorter --seq-len or more data"
        )
    rng = np.random.default_rng([seed, *stream])
    starts = rng.integers(0, len(tokens) - window + 1, size=(steps, batch_size))
    return np.asarray(tokens[starts[..., None] + np.arange(window)], np.int32)


def sample_rows(
    arrays: tuple[np.ndarray, ...],
    *,
    steps: int,
    batch_size: int,
    seed: int,
    stream: tuple[int, ...],
) -> tuple[np.ndarray, ...]:
    """One array [steps, batch_size, ...] per input: random rows, the same for the same (seed, stream)."""
    rows = len(arrays[0])
    if rows < 1:
        raise DataError("the data shard has no rows; use fewer workers or more data")
    rng = np.random.default_rng([seed, *stream])
    index = rng.integers(0, rows, size=(steps, batch_size))
    return tuple(np.ascontiguousarray(array[index]) for array in arrays)


@dataclass(frozen=True)
class ShippedShard:
    """How one worker's shard travels: the plan's data fields and the tensors that carry it."""

    batch_kind: protocol.BatchKind
    shard_tensor: str
    data_tensors: tuple[str, ...]
    fingerprint: str
    tensors: dict[str, np.ndarray]


def shard_plan(shard: np.ndarray | dict[str, np.ndarray]) -> ShippedShard:
    """The plan fields and tensors that ship one worker's shard.

    A 1-D token array is batched as LM windows; a dict of row-indexed arrays as
    random rows (a row counts as one token: `contract.plan.tokens_per_row`).
    """
    if isinstance(shard, np.ndarray):
        windows = protocol.BatchKind.WINDOWS
        return ShippedShard(windows, "shard", (), fingerprint(shard), {"shard": shard})
    tensors = {f"data/{key}": array for key, array in shard.items()}
    rows = protocol.BatchKind.ROWS
    return ShippedShard(rows, "", tuple(tensors), fingerprint(*tensors.values()), tensors)


def shard_from_plan(
    plan: protocol.Plan, tensors: dict
) -> tuple[protocol.BatchKind, np.ndarray | tuple[np.ndarray, ...]]:
    """(batch kind, shard) from a plan; DataError when the shard is missing or does not match."""
    kind = plan.batch_kind
    if kind == protocol.BatchKind.WINDOWS:
        names = [plan.shard_tensor]
    else:
        names = list(plan.data_tensors)
        if not 1 <= len(names) <= MAX_DATA_TENSORS:
            raise DataError(
                f"a rows plan needs 1..{MAX_DATA_TENSORS} data tensors, got {len(names)}"
            )
    missing = [name for name in names if name not in tensors]
    if missing:
        raise DataError(f"the plan lacks its data tensors {missing}")
    arrays = tuple(tensors[name] for name in names)
    if fingerprint(*arrays) != plan.shard_fingerprint:
        raise DataError("the data shard does not match its fingerprint")
    if kind == protocol.BatchKind.WINDOWS:
        return kind, arrays[0]
    if any(a.ndim < 1 or len(a) != len(arrays[0]) for a in arrays):
        raise DataError("the rows of the data tensors do not line up")
    return kind, arrays


def sample_shard(
    kind: str,
    shard,
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    stream: tuple[int, ...],
):
    """One chunk of batches for the plan's batch kind (see `shard_plan`)."""
    if kind == protocol.BatchKind.ROWS:
        return sample_rows(shard, steps=steps, batch_size=batch_size, seed=seed, stream=stream)
    return sample_batches(
        shard, steps=steps, batch_size=batch_size, seq_len=seq_len, seed=seed, stream=stream
    )
