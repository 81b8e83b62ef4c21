"""The outer step's arithmetic in place: one pass over memory, a cache-sized chunk at a time.

optax's SGD with Nesterov momentum, run op by op as `reference.outer_step`
runs it, makes six model-sized temporaries per step (the gradient, the decayed
trace, the new trace, its decayed copy, the update, the scaled update) and
reads and writes each once: most of a 31M-value fragment's outer step is page
faults and memory traffic, not arithmetic. Here every op of the same chain
runs on a 1 MiB chunk that stays in cache, into reused scratch buffers, and the
chunks of a step are spread over a few threads (numpy releases the GIL in its
loops; each chunk is independent, so the split changes no bit).

Bit-equality with optax takes one more care: XLA's CPU runtime flushes
subnormal inputs and results to zero, numpy does not. A chunk whose nonzero
|g| and |trace| are all at least `small_bound(lr, momentum)` cannot meet a
subnormal anywhere in the chain, so numpy's bits are XLA's there: a product
by m or lr scales a bound by m or lr, and a sum of two nonzero floats is 0 or
at least 2^-24 of the smaller (the exact sum is a multiple of the smaller
operand's ulp), so the chain's smallest nonzero value is at least
L · min(lr, 1) · min(m, 1)² · 2^-48, and L is chosen to keep that ≥ 2^-126.
(0.7 and 0.9: L = 2^-77, about 6.6e-24.) A chunk with a smaller value (a
trace decaying over hundreds of rounds without gradient) is computed with
every op's inputs and result flushed to a zero of their sign, as XLA does. The
check is three integer passes over each of the two inputs, in cache. The
last `θ += update` was numpy's in the optax path too.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

CHUNK = 1 << 18  # elements per step of the in-place loops: 1 MiB of float32 stays in cache
THREADS = min(8, os.cpu_count() or 1)  # memory bandwidth, not cores, bounds the step beyond ~8
_MAGNITUDE = np.uint32(0x7FFFFFFF)
_ONE = np.uint32(1)
_TINY = np.finfo(np.float32).tiny


@dataclass
class _Scratch:
    """One thread's chunk-sized buffers."""

    size: int
    floats: list[np.ndarray] = field(default_factory=list)
    bits: np.ndarray = field(init=False)

    def __post_init__(self):
        self.floats = [np.empty(self.size, np.float32) for _ in range(4)]
        self.bits = np.empty(self.size, np.uint32)

    def small(self, values: np.ndarray, bound: np.uint32) -> bool:
        """Whether some nonzero value of `values` is below the float32 whose bits are `bound`.

        |x|'s bits minus one, as unsigned: zero wraps to the largest value.
        """
        bits = np.bitwise_and(values.view(np.uint32), _MAGNITUDE, out=self.bits[: values.size])
        np.subtract(bits, _ONE, out=bits)
        return values.size > 0 and bits.min() < bound - _ONE


def small_bound(lr: float, momentum: float) -> np.uint32:
    """The bits of L, a power of two: nonzero |g| and |trace| at least L keep the step normal.

    See the module docstring; lr = 0 gives inf (every chunk takes the flushing path).
    """
    factor = min(abs(float(np.float32(lr))), 1.0)
    m = min(abs(float(np.float32(momentum))), 1.0)
    factor *= m * m if m > 0 else 1.0
    if factor == 0:
        return np.uint32(0x7F800000)
    exponent = math.ceil(math.log2(2.0**-78 / factor))
    return np.uint32(min(exponent + 127, 255) << 23)


def _flushed(values: np.ndarray) -> np.ndarray:
    """`values` with subnormals set to a zero of their sign, in place (as XLA's CPU runtime does)."""
    np.multiply(values, 0, out=values, where=np.abs(values) < _TINY)
    return values


def nesterov_chunk(scratch, param, trace, gradient_sum, scale, momentum, neg_lr, small) -> None:
    """optax's `trace(momentum, nesterov=True)` then `scale(-lr)`, and θ += update, on one chunk.

    The new trace is g + m·t, the update −lr·(g + m·new trace), each op
    rounded to float32 as optax's are.
    """
    n = param.size
    g, a, u = (f[:n] for f in scratch.floats[:3])
    np.multiply(gradient_sum, scale, out=g)
    if scratch.small(g, small) or scratch.small(trace, small):
        _flushed(g)  # as XLA computes it: every op's inputs and result flushed
        np.add(g, _flushed(np.multiply(trace, momentum, out=a)), out=trace)
        _flushed(trace)
        np.add(g, _flushed(np.multiply(trace, momentum, out=a)), out=u)
        _flushed(np.multiply(_flushed(u), neg_lr, out=u))
    else:
        np.multiply(trace, momentum, out=a)
        np.add(g, a, out=trace)
        np.multiply(trace, momentum, out=a)
        np.add(g, a, out=u)
        np.multiply(u, neg_lr, out=u)
    np.add(param, u, out=param)


def sgd_chunk(scratch, param, gradient_sum, scale, neg_lr, small) -> None:
    """optax's `scale(-lr)` of the gradient, and θ += update, on one chunk."""
    n = param.size
    g, u = scratch.floats[0][:n], scratch.floats[1][:n]
    np.multiply(gradient_sum, scale, out=g)
    if scratch.small(g, small):
        _flushed(g)
        _flushed(np.multiply(g, neg_lr, out=u))
    else:
        np.multiply(g, neg_lr, out=u)
    np.add(param, u, out=param)


def fold_chunk(scratch, total, array, weight, first) -> None:
    """`total += array · weight` on one chunk (`total = array · weight` for the `first` result)."""
    if first:
        np.multiply(array, weight, out=total)
        return
    product = scratch.floats[0][: total.size]
    np.multiply(array, weight, out=product)
    np.add(total, product, out=total)


def center_chunk(scratch, gradient_sum, center, center_weight, scale) -> None:
    """Centered clip's close on one chunk: Σ += center · weight, then center = Σ · scale."""
    n = gradient_sum.size
    product = scratch.floats[0][:n]
    if center_weight is not None:
        np.multiply(center, center_weight, out=product)
        np.add(gradient_sum, product, out=gradient_sum)
    np.multiply(gradient_sum, scale, out=center)


def over_chunks(
    kernel: Callable[..., None],
    tensors: Sequence[Sequence[np.ndarray]],
    constants: tuple,
    threads: int = THREADS,
) -> None:
    """Run `kernel(scratch, *chunk of each array, *constants)` over every chunk of every row.

    Each row of `tensors` holds arrays of one size (a parameter and its
    trace and gradient sum, say); they are cut into the same CHUNK-sized
    flat slices. With `threads` > 1 the chunks go to that many threads,
    which pull the next chunk as they finish one; the call returns once all
    are done (or raises the first error, once every thread has stopped).
    """
    if any(not np.asarray(array).flags.c_contiguous for row in tensors for array in row):
        raise ValueError("the outer step works in place on C-contiguous arrays only")
    flats = [[np.ravel(array) for array in row] for row in tensors]
    for row in flats:
        if len({flat.size for flat in row}) > 1:
            sizes = [flat.size for flat in row]
            raise ValueError(f"arrays of one row must have one size, got {sizes}: shapes differ")
    work = [
        (row, slice(start, min(start + CHUNK, row[0].size)))
        for row in flats
        for start in range(0, row[0].size, CHUNK)
    ]
    if sum(row[0].size for row in flats) < 4 * CHUNK:
        threads = 1  # a thread pool costs more than a few MB of arithmetic saves
    threads = max(1, min(threads, len(work)))
    lock = threading.Lock()
    pending = iter(work)

    def drain() -> None:
        scratch = _Scratch(min(CHUNK, max((row[0].size for row, _ in work), default=0)))
        while True:
            with lock:
                item = next(pending, None)
            if item is None:
                return
            row, part = item
            kernel(scratch, *(flat[part] for flat in row), *constants)

    if threads == 1:
        drain()
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="outer-step") as pool:
        done = [pool.submit(drain) for _ in range(threads)]
    for future in done:
        future.result()
