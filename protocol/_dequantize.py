"""A received quantized payload decoded a cache-sized chunk at a time, over a few threads.

`_tensors.dequantize` decodes a tensor in whole-array steps on one thread:
an int4Block payload is first unpacked into a model-sized int8 array, then
every level is widened and scaled. A shepherd does that for k model-sized
pseudo-gradients a round, a Streaming DiLoCo worker for every fragment
update, and on a fast link it is a good part of a receive. `dequantize_chunked`
computes the same values in chunks of whole blocks (`_chunked.run_chunks`):
per chunk, each level is widened into the output (int4 bytes through a table
of the 256 bytes' two float32 levels, which beats unpacking them) and
multiplied by its block's scale while the chunk is in cache; bfloat16 is
widened chunk by chunk.

The bits are `dequantize`'s: every value is the same float32 level x the same
float32 scale (one multiplication, no reassociation), or the same ml_dtypes
cast, and only where each chunk starts differs. Memory: the output array, as
before (and for a tensor that is not float32, a chunk-sized float32 scratch a
thread where `dequantize` made a whole float32 copy); the model-sized int8 levels of
int4Block are gone. The scales are checked (finite, not negative) before any
value is decoded, as `dequantize` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ._chunked import CHUNK, SMALL, THREADS, run_chunks
from ._tensors import (
    BLOCK_QUANTIZATIONS,
    DTYPES,
    TensorSpec,
    block_scales,
    block_spans,
    dequantize,
    level_bytes,
    unpack_int4,
)

_FLOAT32 = np.dtype("<f4")


def dequantize_chunked(payload: np.ndarray, spec: TensorSpec, threads: int = THREADS) -> np.ndarray:
    """`dequantize(payload, spec)` to the bit, decoded in chunks over up to `threads` threads.

    `payload` is the tensor's uint8 payload, its size already checked against
    `spec`. An unquantized payload is returned as a view, as `dequantize` does;
    below `SMALL` values one thread does the work. MalformedMessage for a
    block scale no sender computes.
    """
    if spec.quantization == "none" or spec.count == 0:
        return dequantize(payload, spec)
    job = _Job.of(payload, spec)
    work = list(block_spans(spec.count, job.block_size, CHUNK))
    span = max(stop - start for *_, start, stop in work)
    run_chunks(
        [(job, *item) for item in work],
        _decode_chunk,
        lambda: _Scratch(span, job),
        threads if spec.count >= SMALL else 1,
    )
    return job.out.reshape(spec.shape)


@dataclass
class _Job:
    """One tensor's decode: its flat output and where each chunk reads from."""

    out: np.ndarray  # the decoded values, flat, in the spec's dtype
    block_size: int  # 1 for bfloat16: a chunk may start anywhere
    wire: np.ndarray | None = None  # bfloat16: the payload as bfloat16 values
    levels: np.ndarray | None = None  # int8Block: the payload's int8 levels
    packed: np.ndarray | None = None  # int4Block: the payload's packed nibbles
    scales: np.ndarray | None = None  # float32, one a block

    @classmethod
    def of(cls, payload: np.ndarray, spec: TensorSpec) -> _Job:
        out = np.empty(spec.count, DTYPES[spec.dtype])
        if spec.quantization not in BLOCK_QUANTIZATIONS:
            return cls(out, 1, wire=payload.view(ml_dtypes.bfloat16))
        job = cls(out, spec.block_size, scales=block_scales(payload, spec))
        if spec.quantization == "int8Block":
            job.levels = payload[: spec.count].view(np.int8)
        else:
            job.packed = payload[: level_bytes(spec)]
        return job


class _Scratch:
    """One thread's chunk-sized float32 buffer, for a tensor whose dtype is not float32."""

    def __init__(self, span: int, job: _Job):
        wide = job.wire is None and job.out.dtype != _FLOAT32
        self.floats = np.empty(span, np.float32) if wide else None


def _decode_chunk(scratch: _Scratch, job: _Job, first: int, last: int, start: int, stop: int):
    """Values start..stop (blocks first..last) into `job.out`, as `dequantize` computes them."""
    out = job.out[start:stop]
    if job.wire is not None:
        with np.errstate(invalid="ignore"):  # ml_dtypes warns of NaN; receivers check values
            out[...] = job.wire[start:stop]  # the cast `astype` makes
        return
    values = out if scratch.floats is None else scratch.floats[: stop - start]
    rows = values.reshape(last - first, -1)
    assert job.scales is not None, "a job without `wire` is block-quantized: it has scales"
    if job.packed is not None:
        _widen_int4(job.packed, start, stop, values)
    else:
        assert job.levels is not None, "int8Block: its levels"
        rows[...] = job.levels[start:stop].reshape(rows.shape)  # int8 -> float32: exact
    # Scales come off the wire: huge ones overflow to inf, left for the receiver's checks.
    with np.errstate(over="ignore", invalid="ignore"):
        rows *= job.scales[first:last, None]
        if values is not out:
            out[...] = values  # the float32 -> dtype cast of `astype`


def _widen_int4(packed: np.ndarray, start: int, stop: int, values: np.ndarray) -> None:
    """Levels start..stop of int4 `packed` as float32 into `values`, through a table of the
    256 bytes' level pairs (exact small integers, the ones `unpack_int4` gives)."""
    if start % 2:  # the chunk starts on a byte's high nibble
        values[0] = _INT4_PAIRS[packed[start // 2], 1]
    if stop % 2:  # and ends on a byte's low nibble
        values[-1] = _INT4_PAIRS[packed[stop // 2], 0]
    even, whole = start + start % 2, stop - stop % 2
    if whole > even:
        middle = values[even - start : whole - start].reshape(-1, 2)
        _INT4_PAIRS.take(packed[even // 2 : whole // 2], axis=0, out=middle, mode="clip")


def _int4_pairs() -> np.ndarray:
    """(256, 2) float32: the low and high level of every byte."""
    levels = np.empty(512, np.int8)
    unpack_int4(np.arange(256, dtype=np.uint8), levels)
    return levels.astype(np.float32).reshape(256, 2)


_INT4_PAIRS = _int4_pairs()
