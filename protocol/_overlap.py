"""One tensor decoding in a thread while the event loop reads the next one's payload.

A receive used to read a tensor's payload, then decode it (in a thread), then
read the next: while it decoded, it read nothing, the kernel's socket buffer
filled, and over a long link the sender stopped in TCP flow control, the link
idle for every decode. `DecodeBehind` lets the payload of tensor i+1 arrive
while tensor i decodes: at most one decode runs behind the reading, so what is
held beyond the old path is one tensor's quantized payload.

Structured like `trio.to_thread.run_sync` (which it is built as): the thread
is started with `trio.lowlevel.start_thread_soon` and always waited for before
the receive returns or raises, cancellation included (`settle`, shielded: a
decode is bounded by one tensor's size). A decode's error (a bad block scale)
is raised by the next `start` or by `finish`, as itself, never wrapped in an
exception group.
"""

from __future__ import annotations

import numpy as np
import outcome
import trio

from ._dequantize import dequantize_chunked
from ._tensors import TensorSpec


class DecodeBehind:
    """Decodes big tensors one at a time in a thread, into `tensors`, behind the reading."""

    def __init__(self, tensors: dict[str, np.ndarray | None], threads: int):
        self.tensors = tensors
        self.threads = threads
        self._name: str | None = None  # the tensor decoding now
        self._done = trio.Event()
        self._result: outcome.Outcome[np.ndarray] | None = None  # the decode's, once delivered

    async def start(self, payload: np.ndarray, spec: TensorSpec) -> None:
        """Decode `payload` in a thread once the decode before it has finished."""
        await self.finish()
        token, done = trio.lowlevel.current_trio_token(), trio.Event()
        self._name, self._done, self._result = spec.name, done, None

        def deliver(result: outcome.Outcome[np.ndarray]) -> None:  # on the decode thread
            self._result = result
            token.run_sync_soon(done.set)

        trio.lowlevel.start_thread_soon(
            lambda: dequantize_chunked(payload, spec, self.threads), deliver
        )

    async def finish(self) -> None:
        """Wait for the decode in flight, if any; its tensor, or its error raised here."""
        if self._name is None:
            return
        await self._done.wait()
        name, self._name = self._name, None
        assert self._result is not None, "the decode thread set `done` after its result"
        self.tensors[name] = self._result.unwrap()

    async def settle(self) -> None:
        """On the way out of a failed or cancelled receive: let the thread end, drop its work."""
        if self._name is not None:
            with trio.CancelScope(shield=True):
                await self._done.wait()
            self._name = None
