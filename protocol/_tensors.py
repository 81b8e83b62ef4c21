"""Tensors on the wire: dtype mapping, payload sizes, header checks and quantization.

A tensor travels as a `TensorHeader` inside the Cap'n Proto message plus a raw
payload that follows the message on the stream. Unquantized payloads are the
array's bytes (little-endian, C order), so sending them needs no copy at all.
Quantized payloads trade precision for bytes:

- ``bfloat16``: float32/float64 rounded to bfloat16 (nearest even), 2 bytes per value.
- ``int8Block``: per block of `block_size` values, ``scale = max|x| / 127`` (float32)
  and ``round(x / scale)`` as int8; the payload is all int8 values, then all scales.
  The error of each value is at most ``scale / 2``, i.e. 1/254 of its block's max.
- ``int4Block``: the same with ``scale = max|x| / 7`` and values in -7..7 packed two
  to a byte (value ``2i`` in the low nibble of byte ``i``, ``2i + 1`` in the high one,
  two's complement; an odd count leaves the last high nibble 0), then the float32
  scales. The error of each value is at most ``scale / 2``, 1/14 of its block's max;
  about 0.52 bytes a value at 256-value blocks, an eighth of float32 (Streaming
  DiLoCo, arXiv 2501.18512, sends pseudo-gradients in 4 bits at no loss in quality).

Everything here is vectorised numpy: no Python loop runs per element or per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ._errors import FrameTooLarge, MalformedMessage
from ._schema import DTYPE_VALUES, QUANTIZATION_VALUES

QUANTIZATIONS: tuple[str, ...] = ("none", "bfloat16", "int8Block", "int4Block")
#: Quantizations that scale blocks of `block_size` values (the header carries blockSize).
BLOCK_QUANTIZATIONS = frozenset({"int8Block", "int4Block"})
#: Largest level of each block quantization: a block's max|x| is sent as this many steps.
LEVELS = {"int8Block": 127, "int4Block": 7}
MAX_NAME_CHARS = 256
MAX_NDIM = 32

#: Wire dtype name -> numpy dtype of the decoded array (explicitly little-endian).
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float64": np.dtype("<f8"),
    "int8": np.dtype("i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("u1"),
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
    "uint64": np.dtype("<u8"),
    "bool": np.dtype("?"),
}
FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})
_DTYPE_NAMES = {value: name for name, value in DTYPE_VALUES.items()}
_QUANTIZATION_NAMES = {value: name for name, value in QUANTIZATION_VALUES.items()}
# Elements per vectorised step of int8Block: large enough that numpy dominates,
# small enough that the float32 temporaries stay in cache-sized chunks.
_CHUNK_ELEMENTS = 1 << 20

assert set(DTYPES) == set(DTYPE_VALUES), "pcp.capnp DType and DTYPES disagree"
assert set(QUANTIZATIONS) == set(QUANTIZATION_VALUES), (
    "pcp.capnp Quantization and QUANTIZATIONS disagree"
)


@dataclass(frozen=True)
class TensorSpec:
    """One checked tensor header: everything needed to read and decode its payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    quantization: str
    payload_bytes: int
    block_size: int

    @property
    def count(self) -> int:
        return math.prod(self.shape)

    def to_wire(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "quantization": self.quantization,
            "payloadBytes": self.payload_bytes,
            "blockSize": self.block_size,
        }


def dtype_name(dtype: np.dtype) -> str:
    """The wire name of a numpy dtype; ValueError for dtypes the protocol cannot carry."""
    dtype = np.dtype(dtype)
    if dtype == DTYPES["bfloat16"]:
        return "bfloat16"
    for name, wire in DTYPES.items():
        if dtype.kind == wire.kind and dtype.itemsize == wire.itemsize and dtype.kind != "V":
            return name
    raise ValueError(f"dtype {dtype} cannot be sent; supported: {', '.join(DTYPES)}")


def payload_size(dtype: str, count: int, quantization: str, block_size: int) -> int:
    """Bytes of the payload for `count` values of `dtype` under `quantization`."""
    if quantization == "bfloat16":
        return 2 * count
    if quantization == "int8Block":
        return count + 4 * -(-count // block_size)
    if quantization == "int4Block":
        return (count + 1) // 2 + 4 * -(-count // block_size)
    return count * DTYPES[dtype].itemsize


def effective_quantization(dtype: str, quantization: str) -> str:
    """The quantization actually applied: only floating tensors are quantized, and
    bfloat16 only where it saves bytes (float32/float64)."""
    if dtype not in FLOATING:
        return "none"
    if quantization == "bfloat16" and dtype in ("float16", "bfloat16"):
        return "none"
    return quantization


def prepare(name: str, array: np.ndarray, quantization: str, block_size: int):
    """Header and payload buffer for one tensor.

    The unquantized payload is a zero-copy memoryview of the (C-contiguous,
    little-endian) array; quantized payloads are fresh uint8 arrays.
    """
    array = np.asarray(array)
    wire = dtype_name(array.dtype)
    array = np.asarray(
        array, dtype=DTYPES[wire], order="C"
    )  # keeps 0-d (ascontiguousarray would not)
    applied = effective_quantization(wire, quantization)
    if applied == "bfloat16":
        payload = array.astype(ml_dtypes.bfloat16).reshape(-1).view(np.uint8)
    elif applied == "int8Block":
        payload = quantize_int8_block(array, block_size)
    elif applied == "int4Block":
        payload = quantize_int4_block(array, block_size)
    else:
        payload = array.reshape(-1).view(np.uint8)
    spec = TensorSpec(
        name,
        wire,
        tuple(array.shape),
        applied,
        payload.nbytes,
        block_size if applied in BLOCK_QUANTIZATIONS else 0,
    )
    return spec, payload.data


def quantize_int8_block(array: np.ndarray, block_size: int) -> np.ndarray:
    """int8Block payload (int8 values, then float32 scales) for a floating array.

    Works through cache-sized chunks of whole blocks with one scratch buffer, so
    300 MB of float32 cost a few passes over memory and no big temporaries.
    ValueError for non-finite values (int8 cannot carry NaN or inf) and for a
    block size outside 1..2**31-1.
    """
    flat = array.reshape(-1)
    count, blocks = flat.size, block_count(flat.size, block_size)
    payload = np.empty(count + 4 * blocks, np.uint8)
    scales = _quantize_blocks(flat, block_size, "int8Block", payload[:count].view(np.int8))
    payload[count:] = scales.view(np.uint8)
    return payload


def quantize_int4_block(array: np.ndarray, block_size: int) -> np.ndarray:
    """int4Block payload (values in -7..7 packed two a byte, then float32 scales).

    The levels are first written one a byte into a scratch array a quarter of
    the float32 input's size, then packed in one vectorised pass. ValueError
    for non-finite values and for a block size outside 1..2**31-1.
    """
    flat = array.reshape(-1)
    count, blocks = flat.size, block_count(flat.size, block_size)
    packed = (count + 1) // 2
    levels = np.empty(2 * packed, np.int8)
    levels[count:] = 0  # an odd count's last high nibble
    scales = _quantize_blocks(flat, block_size, "int4Block", levels[:count])
    payload = np.empty(packed + 4 * blocks, np.uint8)
    pack_int4(levels, payload[:packed])
    payload[packed:] = scales.view(np.uint8)
    return payload


def pack_int4(levels: np.ndarray, out: np.ndarray) -> None:
    """Pack an even count of int8 `levels` (-7..7) two to a uint8 of `out`, low nibble first."""
    # Each (low, high) pair of levels read as one little-endian uint16: low | high << 8.
    # Contiguous uint16 arithmetic packs twice as fast as strided uint8 halves.
    pairs = levels.view("<u2")
    nibbles = pairs >> 4
    nibbles &= 0xF0
    nibbles |= pairs & 0x0F
    out[...] = nibbles


def block_count(count: int, block_size: int) -> int:
    if not 1 <= block_size < 2**31:
        raise ValueError(f"block_size must be in 1..2**31-1, got {block_size}")
    return -(-count // block_size)


def _quantize_blocks(
    flat: np.ndarray, block_size: int, quantization: str, levels: np.ndarray
) -> np.ndarray:
    """Write each value's level (rounded x / scale) into int8 `levels`; returns the float32 scales."""
    count, top = flat.size, LEVELS[quantization]
    scales = np.empty(block_count(count, block_size), np.float32)
    scratch = np.empty(min(count, max(block_size, _CHUNK_ELEMENTS)), np.float32)
    for first, last, start, stop in block_spans(count, block_size):
        rows = flat[start:stop].reshape(last - first, -1)
        work = scratch[: stop - start].reshape(rows.shape)
        scales[first:last] = quantize_rows(rows, work, top, quantization)
        levels[start:stop] = work.reshape(-1)
    return scales


def quantize_rows(rows: np.ndarray, work: np.ndarray, top: int, quantization: str) -> np.ndarray:
    """Scale each row (block) into `work` as rounded values in -top..top; returns the scales."""
    rows = rows.astype(np.float32, copy=False)
    peak = np.maximum(rows.max(axis=1), -rows.min(axis=1))
    if not np.isfinite(peak).all():
        raise ValueError(f"{quantization} cannot quantize non-finite values (NaN or inf)")
    scale = peak / np.float32(top)
    with np.errstate(over="ignore", divide="ignore"):
        # Near float32's max, top * scale may round to inf on decode: one step lower cannot.
        overflows = ~np.isfinite(scale * np.float32(top))
        scale[overflows] = np.nextafter(scale[overflows], np.float32(0))
        inverse = np.divide(1, scale, out=np.zeros_like(scale), where=scale > 0)
    tiny = np.isinf(inverse)  # a subnormal scale's inverse overflows: divide those (rare) blocks
    inverse[tiny] = 0
    np.multiply(rows, inverse[:, None], out=work)
    if tiny.any():
        work[tiny] = rows[tiny] / scale[tiny, None]
    np.rint(work, out=work)
    np.clip(work, -top, top, out=work)
    return scale


def block_spans(count: int, block_size: int, chunk: int = _CHUNK_ELEMENTS):
    """(first_block, last_block, start, stop): chunks of whole blocks of about `chunk`
    values, then the short last block."""
    full = count // block_size
    step = max(1, chunk // block_size)
    for first in range(0, full, step):
        last = min(first + step, full)
        yield first, last, first * block_size, last * block_size
    if full * block_size < count:
        yield full, full + 1, full * block_size, count


def dequantize(payload: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """The decoded array for a checked `spec` and its uint8 `payload` (size already verified)."""
    dtype = DTYPES[spec.dtype]
    if spec.quantization == "bfloat16":
        flat = payload.view(ml_dtypes.bfloat16).astype(dtype)
    elif spec.quantization in BLOCK_QUANTIZATIONS:
        levels, scales = _split_block_payload(payload, spec)
        flat = _scale_blocks(levels, scales, spec.block_size).astype(dtype, copy=False)
    else:
        flat = payload.view(dtype)
    return flat.reshape(spec.shape)


def _split_block_payload(payload: np.ndarray, spec: TensorSpec) -> tuple[np.ndarray, np.ndarray]:
    """The int8 level of every value and the float32 scale of every block.

    MalformedMessage for a scale no sender computes (NaN, inf or negative). An
    int4Block nibble of -8, which no sender writes, decodes as -8 scales, and an
    odd count's padding nibble is ignored: neither can make a value non-finite.
    """
    count, used = spec.count, level_bytes(spec)
    scales = block_scales(payload, spec)
    if spec.quantization == "int8Block":
        return payload[:count].view(np.int8), scales
    levels = np.empty(2 * used, np.int8)
    unpack_int4(payload[:used], levels)
    return levels[:count], scales


def unpack_int4(packed: np.ndarray, out: np.ndarray) -> None:
    """The nibbles of uint8 `packed` as int8 levels into `out` (two a byte, low nibble first)."""
    pairs = out.reshape(-1, 2)
    # Two's complement nibbles: shift each to the top of an int8, then arithmetic-shift back.
    np.right_shift(np.left_shift(packed, 4).view(np.int8), 4, out=pairs[:, 0])
    np.right_shift(packed.view(np.int8), 4, out=pairs[:, 1])


def level_bytes(spec: TensorSpec) -> int:
    """Bytes of a block-quantized payload's levels: what comes before its scales."""
    return spec.count if spec.quantization == "int8Block" else (spec.count + 1) // 2


def block_scales(payload: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """The float32 scale of every block (a copy: the payload need not be aligned for float32).

    MalformedMessage for a scale no sender computes (NaN, inf or negative).
    """
    scales = np.frombuffer(payload[level_bytes(spec) :].tobytes(), "<f4")
    if not (np.isfinite(scales) & (scales >= 0)).all():
        raise MalformedMessage(
            f"tensor {spec.name!r} ({spec.quantization}) has a NaN, infinite or negative block "
            f"scale; a sender's scales are max|x| / {LEVELS[spec.quantization]}"
        )
    return scales


def _scale_blocks(levels: np.ndarray, scales: np.ndarray, block_size: int) -> np.ndarray:
    """float32 levels x their block's scale, chunk by chunk."""
    count = levels.size
    out = np.empty(count, np.float32)
    # Scales come off the wire: huge ones overflow to Inf, which is decoded as such and
    # left for the receiver's finiteness check to refuse, not warned about here.
    with np.errstate(over="ignore", invalid="ignore"):
        for first, last, start, stop in block_spans(count, block_size):
            chunk = out[start:stop].reshape(last - first, -1)
            chunk[...] = levels[start:stop].reshape(chunk.shape)
            chunk *= scales[first:last, None]
    return out


def check_header(raw: dict, limits) -> TensorSpec:
    """Validate one header read off the wire (enums still as raw ints) against the contract and `limits`.

    FrameTooLarge for sizes beyond the limits, MalformedMessage for everything
    else that is wrong; nothing is allocated here.
    """
    name = raw["name"]
    if not name or len(name) > MAX_NAME_CHARS:
        raise MalformedMessage(
            f"tensor name must be 1..{MAX_NAME_CHARS} characters, got {len(name)}"
        )
    dtype = _DTYPE_NAMES.get(raw["dtype"])
    if dtype is None:
        raise MalformedMessage(f"tensor {name!r} has unknown dtype value {raw['dtype']}")
    quantization = _QUANTIZATION_NAMES.get(raw["quantization"])
    if quantization is None:
        raise MalformedMessage(
            f"tensor {name!r} has unknown quantization value {raw['quantization']}"
        )
    shape = tuple(raw["shape"])
    count = _checked_count(name, shape)
    block_size = raw["blockSize"]
    if quantization != "none" and dtype not in FLOATING:
        raise MalformedMessage(f"tensor {name!r} is {dtype} but quantized as {quantization}")
    if quantization in BLOCK_QUANTIZATIONS and block_size == 0:
        raise MalformedMessage(f"tensor {name!r} is {quantization} with blockSize 0")
    payload_bytes = raw["payloadBytes"]
    if payload_bytes > limits.max_tensor_bytes:
        raise FrameTooLarge(
            f"tensor {name!r} payload is {payload_bytes} bytes; the limit is {limits.max_tensor_bytes}"
        )
    expected = payload_size(dtype, count, quantization, block_size or 1)
    if payload_bytes != expected:
        raise MalformedMessage(
            f"tensor {name!r} ({dtype}{list(shape)}, {quantization}) needs {expected} payload bytes, "
            f"header says {payload_bytes}"
        )
    return TensorSpec(name, dtype, shape, quantization, payload_bytes, block_size)


def _checked_count(name: str, shape: tuple[int, ...]) -> int:
    if len(shape) > MAX_NDIM:
        raise MalformedMessage(f"tensor {name!r} has {len(shape)} dimensions; at most {MAX_NDIM}")
    if any(dim >= 2**63 for dim in shape):
        raise MalformedMessage(f"tensor {name!r} has a dimension beyond int64: {list(shape)}")
    count = math.prod(shape)
    if count >= 2**63:
        raise MalformedMessage(f"tensor {name!r} shape {list(shape)} overflows int64 elements")
    return count
