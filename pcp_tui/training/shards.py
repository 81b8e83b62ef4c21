"""A worker's shard: how it ships in a plan and how batches are drawn from it (numpy only).

Both sides import this module: the shepherd to ship a shard, the worker to sample
its batches with a seed and a stream (slot, round, chunk), so the same run draws
the same batches again after a restart. Nothing here loads a corpus or a model.
"""

from __future__ import annotations

import hashlib

import numpy as np

MAX_DATA_TENSORS = 64


class DataError(ValueError):
    """The data cannot feed this run; the message says what to change."""


def fingerprint(*arrays: np.ndarray) -> str:
    """sha256 hex over each array's dtype, length and bytes: equal only for equal token streams."""
    digest = hashlib.sha256()
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}:{array.size};".encode())
        digest.update(memoryview(array).cast("B"))
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


def shard_plan(shard: np.ndarray | dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
    """Plan fields and tensors that ship one worker's shard.

    A 1-D token array is batched as LM windows ("windows"); a dict of
    row-indexed arrays as random rows ("rows"), where a row counts as one token.
    """
    if isinstance(shard, np.ndarray):
        return (
            {
                "batchKind": "windows",
                "shardTensor": "shard",
                "shardFingerprint": fingerprint(shard),
            },
            {"shard": shard},
        )
    tensors = {f"data/{key}": array for key, array in shard.items()}
    fields = {
        "batchKind": "rows",
        "dataTensors": list(tensors),
        "shardFingerprint": fingerprint(*tensors.values()),
        "seqLen": 1,
    }
    return fields, tensors


def shard_from_plan(body: dict, tensors: dict) -> tuple[str, np.ndarray | tuple[np.ndarray, ...]]:
    """(batch kind, shard) from a plan; DataError when the shard is missing or does not match."""
    kind = body.get("batchKind") or "windows"
    if kind == "windows":
        names = [body.get("shardTensor", "")]
    elif kind == "rows":
        names = list(body.get("dataTensors") or [])
        if not 1 <= len(names) <= MAX_DATA_TENSORS:
            raise DataError(
                f"a rows plan needs 1..{MAX_DATA_TENSORS} data tensors, got {len(names)}"
            )
    else:
        raise DataError(f"unknown batch kind {kind!r} (windows | rows); upgrade pcp-tui")
    missing = [name for name in names if name not in tensors]
    if missing:
        raise DataError(f"the plan lacks its data tensors {missing}")
    arrays = tuple(tensors[name] for name in names)
    if fingerprint(*arrays) != body.get("shardFingerprint"):
        raise DataError("the data shard does not match its fingerprint")
    if kind == "windows":
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
    if kind == "rows":
        return sample_rows(shard, steps=steps, batch_size=batch_size, seed=seed, stream=stream)
    return sample_batches(
        shard, steps=steps, batch_size=batch_size, seq_len=seq_len, seed=seed, stream=stream
    )
