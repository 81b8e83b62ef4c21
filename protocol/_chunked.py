"""Model-sized numpy work a cache-sized chunk at a time, spread over a few threads.

Encoding a fragment's change (`_change`) and decoding a received quantized
payload (`_dequantize`) both touch every value of a model-sized array a few
times. Done op by op on the whole array, each op streams it through memory
and leaves a model-sized temporary; done on chunks of `CHUNK` values, every op
of a chunk runs while the chunk is in cache, into one small scratch buffer per
thread. Chunks are independent, so spreading them over threads changes no
bit, and numpy releases the GIL inside its loops, so the threads really run
at once.

`run_chunks` owns its threads: they are started and joined inside the call
(a `ThreadPoolExecutor` block), so none outlives it. Called from trio through
`trio.to_thread.run_sync`, the event loop's thread waits on one worker
thread, which waits on the pool; cancelling the trio task waits for the call
to end, which is bounded by the array's size.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

#: Values per chunk: a chunk's float32 scratch (1 MiB) stays in cache.
CHUNK = 1 << 18
#: Threads for a large array; memory bandwidth, not cores, bounds the work beyond a few.
THREADS = min(8, os.cpu_count() or 1)
#: Below this many values a thread pool costs more than the arithmetic it splits saves.
SMALL = 4 * CHUNK


def run_chunks(
    work: Sequence[tuple],
    kernel: Callable[..., None],
    scratch: Callable[[], object],
    threads: int,
) -> None:
    """`kernel(own scratch, *item)` for every item of `work`, over up to `threads` threads.

    Each thread makes its scratch once (`scratch()`) and pulls the next item as
    it finishes one. Returns once every item is done; if a kernel raises, the
    other threads stop at their next item and the first error is raised once
    all have stopped (items after it may be done or not: treat the output as
    lost). `threads` is capped by the number of items; 1 runs on the calling
    thread.
    """
    threads = max(1, min(threads, len(work)))
    lock, pending, failed = threading.Lock(), iter(work), threading.Event()

    def drain() -> None:
        own = scratch()
        while not failed.is_set():
            with lock:
                item = next(pending, None)
            if item is None:
                return
            try:
                kernel(own, *item)
            except BaseException:
                failed.set()  # the other threads stop at their next item
                raise

    if threads == 1:
        drain()
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="pcp-chunks") as pool:
        done = [pool.submit(drain) for _ in range(threads)]
    for future in done:
        future.result()
