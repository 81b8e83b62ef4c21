"""A change encoded once, and the value its receivers form, made from the encoder's own levels.

Streaming DiLoCo's compressed update (the shepherd's `FragmentSync._change`)
sends a fragment's change `new - old` quantized, and the shepherd then keeps
`old + decode(encode(new - old))`: the float32 sum every worker forms from the
bytes, so that both sides hold the same bits. Done op by op, that is a
model-sized change, its payload, the wire joined into one buffer, a parse and
a decoded copy, on one thread. `encode_change` takes each cache-sized chunk of
whole blocks through every step while it is in cache (the change into scratch;
its levels and scales into the payload; level x scale added to `old`, written
over `new`), with the chunks spread over a few threads (numpy releases the GIL
in its loops). The payloads are `encode`'s to the byte, and the new values
`decode`'s to the bit:

- block quantizations: `dequantize` turns each int8 level into float32 (exact)
  and multiplies it by its block's float32 scale; so does this, from the int8
  levels it has just written. Not from the float levels before the cast: those
  hold -0.0 where x / scale rounds to it, the wire's 0 decodes as +0.0, and
  -0.0 + -0.0 is -0.0 where -0.0 + 0.0 is +0.0.
- bfloat16: the same ml_dtypes casts, float32 -> bfloat16 -> float32.
- none: the change itself is the payload and what is added.

A tensor that is not a C-contiguous float32 array (and an empty one) takes the
op-by-op way, which is the reference: same bytes, same bits, slower.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from ._chunked import CHUNK, SMALL, THREADS, run_chunks
from ._codec import Encoded, assemble, check_body, check_name
from ._fields import Body
from ._tensors import (
    BLOCK_QUANTIZATIONS,
    LEVELS,
    TensorSpec,
    block_count,
    block_spans,
    dequantize,
    pack_int4,
    payload_size,
    prepare,
    quantize_rows,
)

_FLOAT32 = np.dtype("<f4")


def encode_change(
    body: Body,
    targets: Mapping[str, np.ndarray],
    bases: Mapping[str, np.ndarray],
    *,
    quantization: str,
    block_size: int = 256,
    threads: int = THREADS,
) -> Encoded:
    """`body` with the change `targets - bases` as its tensors, encoded once; each target then
    holds `bases + decode(that message)` (written in place, the very float32 sum a receiver
    forms), bit for bit what encoding, decoding and adding op by op give.

    ValueError, as `encode`, for a body, quantization, name or tensor that cannot be
    sent, including a non-finite change under a block quantization; a target may then
    be part-way updated (the chunks done before the bad one), so treat it as lost.
    ValueError too for a base missing or shaped unlike its target.
    """
    check_body(body, quantization)
    parts, specs, payloads = [], [], []
    for name, target in targets.items():
        check_name(name)
        base = bases.get(name)
        if base is None or np.shape(base) != np.shape(target):
            raise ValueError(f"tensor {name!r}: no base of its shape {np.shape(target)}")
        if _fast(target, base):
            part = _Part.of(target, base, quantization, block_size)
            parts.append(part)
            spec = TensorSpec(
                name,
                "float32",
                tuple(target.shape),
                quantization,
                part.payload.nbytes,
                block_size if quantization in BLOCK_QUANTIZATIONS else 0,
            )
            payload = memoryview(part.payload)
        else:
            spec, payload = _op_by_op(name, target, base, quantization, block_size)
        specs.append(spec)
        payloads.append(payload)
    _run(parts, threads)
    for part in parts:
        part.finish()
    return assemble(body, specs, payloads, dict(targets))


def _fast(target, base) -> bool:
    """Whether the chunked way applies: C-contiguous float32 arrays, the target writable."""
    return (
        isinstance(target, np.ndarray)
        and isinstance(base, np.ndarray)
        and target.dtype == _FLOAT32
        and base.dtype == _FLOAT32
        and target.size > 0
        and target.flags.c_contiguous
        and target.flags.writeable
        and base.flags.c_contiguous
    )


def _op_by_op(name: str, target, base, quantization: str, block_size: int):
    """The reference: change, encode, decode its payload, add; (spec, payload) as `prepare`'s."""
    change = np.asarray(target) - np.asarray(base)
    spec, payload = prepare(name, change, quantization, block_size)
    decoded = dequantize(np.frombuffer(payload, np.uint8), spec)
    np.add(base, decoded, out=target)
    return spec, payload


@dataclass
class _Part:
    """One tensor's chunked encoding: flat views of target and base, and where its payload goes."""

    target: np.ndarray
    base: np.ndarray
    quantization: str
    block_size: int  # 1 for the elementwise quantizations: a chunk may start anywhere
    payload: np.ndarray  # uint8, as `prepare` would return it
    levels: np.ndarray | None = None  # int8 per value (block quantizations)
    scales: np.ndarray | None = None  # float32 per block
    wire: np.ndarray | None = None  # the payload as bfloat16 / float32 values
    # int4Block: (start, stop) of chunks left to `finish`
    unpacked: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, target: np.ndarray, base: np.ndarray, quantization: str, block_size: int):
        count = target.size
        if quantization in BLOCK_QUANTIZATIONS:
            block_count(count, block_size)  # ValueError for a block size out of range
        payload = np.empty(payload_size("float32", count, quantization, block_size), np.uint8)
        part = cls(target.reshape(-1), base.reshape(-1), quantization, 1, payload)
        if quantization == "int8Block":
            part.levels = payload[:count].view(np.int8)
        elif quantization == "int4Block":
            part.levels = np.empty(count + count % 2, np.int8)
            part.levels[count:] = 0  # an odd count's last high nibble
        elif quantization == "bfloat16":
            part.wire = payload.view(ml_dtypes.bfloat16)
        else:
            part.wire = payload.view(_FLOAT32)
        if part.levels is not None:
            part.block_size = block_size
            part.scales = np.empty(block_count(count, block_size), np.float32)
        return part

    def chunks(self):
        """(part, first block, last block, start, stop) of every chunk of whole blocks."""
        for span in block_spans(self.target.size, self.block_size, CHUNK):
            yield (self, *span)

    def pack(self, start: int, stop: int, *, done: bool) -> None:
        """Pack int4 levels start..stop, widened to whole pairs; with `done` False, a chunk
        that shares a pair with its neighbour is left for `finish` (its levels may be unset)."""
        if not done and (start % 2 or (stop % 2 and stop < self.target.size)):
            self.unpacked.append((start, stop))  # list.append is atomic under the GIL
            return
        start, stop = start - start % 2, stop + stop % 2
        assert self.levels is not None, "int4Block parts have levels"
        pack_int4(self.levels[start:stop], self.payload[start // 2 : stop // 2])

    def finish(self) -> None:
        """Pack the int4 pairs chunks shared and append the scales, once every chunk is done."""
        if self.levels is None or self.scales is None:  # set together, for block quantizations
            return
        for start, stop in self.unpacked:
            self.pack(start, stop, done=True)
        used = self.payload.size - 4 * self.scales.size
        self.payload[used:] = self.scales.view(np.uint8)


class _Scratch:
    """One thread's float32 scratch: the chunk's change, and its levels then decoded values."""

    def __init__(self, size: int):
        self.change = np.empty(size, np.float32)
        self.work = np.empty(size, np.float32)


def _chunk(scratch: _Scratch, part: _Part, first: int, last: int, start: int, stop: int):
    """One chunk from change to new value; see the module docstring for why the bits agree."""
    rows = last - first
    new = part.target[start:stop].reshape(rows, -1)
    old = part.base[start:stop].reshape(rows, -1)
    change = scratch.change[: stop - start].reshape(rows, -1)
    work = scratch.work[: stop - start].reshape(rows, -1)
    if part.levels is None or part.scales is None:  # bfloat16 or none: the payload holds
        assert part.wire is not None  # each value's change, as `wire`
        wire = part.wire[start:stop].reshape(rows, -1)
        np.subtract(new, old, out=change if part.quantization == "bfloat16" else wire)
        if part.quantization == "bfloat16":
            wire[...] = change
            work[...] = wire
            wire = work
        np.add(old, wire, out=new)
        return
    np.subtract(new, old, out=change)
    scale = quantize_rows(change, work, LEVELS[part.quantization], part.quantization)
    part.scales[first:last] = scale
    levels = part.levels[start:stop].reshape(rows, -1)
    levels[...] = work
    with np.errstate(over="ignore", invalid="ignore"):  # as `dequantize`
        np.multiply(levels, scale[:, None], out=work)
    np.add(old, work, out=new)
    if part.quantization == "int4Block":
        part.pack(start, stop, done=False)


def _run(parts: list[_Part], threads: int) -> None:
    """Every chunk of every part, over up to `threads` threads (`run_chunks`)."""
    work = [item for part in parts for item in part.chunks()]
    if sum(part.target.size for part in parts) < SMALL:
        threads = 1
    size = max((stop - start for *_, start, stop in work), default=0)
    run_chunks(work, _chunk, lambda: _Scratch(size), threads)
