"""Protocol-level fake workers, and a simulated network to run thousands of them on.

A fake does the real handshake (HMAC), takes the real plan, says ready at once, heartbeats
as a real worker does, and answers every roundStart (at once, or after a seeming training
time) with a progress report and a small finite pseudo-gradient of the round's shapes: no
compute, so what a round costs is the shepherd's. `benchmarks/bench_shepherd_scale.py` runs them over TCP in processes of
their own; `SimulatedNetwork` runs them in the shepherd's own trio loop over in-memory
links, so that on `trio.testing.MockClock` a run of 1,000 or more of them, with churn and
reconnect storms, takes seconds: the real round code, in virtual time.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import trio
import trio.testing

from pcp_tui import protocol
from pcp_tui.contract import auth
from pcp_tui.contract.connection import LINK_ERRORS, ConnectionLost
from pcp_tui.worker.reconnect import Reconnect

if TYPE_CHECKING:
    from pcp_tui.shepherd.coordinator import Shepherd
    from pcp_tui.training.workload import Workload

STAND_IN_SHAPES = {"w": (64, 16), "b": (16,)}  # the bytes are not the point of a simulation

PSEUDO_GRADIENTS = 4  # distinct results among the fakes of one process
_drawn: dict[tuple, dict[str, np.ndarray]] = {}


class _Address:
    """What `admission.peer_name` reads off a socket: where the peer dialled from."""

    def __init__(self, host: str, port: int):
        self._address = (host, port)

    def getpeername(self) -> tuple[str, int]:
        return self._address


class SimulatedNetwork(trio.abc.Listener[trio.abc.Stream]):
    """A listener for `Shepherd.run(listeners=[...])` that fakes dial in memory.

    Each link carries bytes at `bytes_per_second` after `latency` seconds per write, on
    trio's clock (a `MockClock` makes them virtual). A link is named for the address its
    fake dials from (`host`), which the shepherd's per-address rules read.
    """

    def __init__(self, *, latency: float = 0.0, bytes_per_second: float = math.inf):
        self.latency, self.bytes_per_second = latency, bytes_per_second
        self._incoming, self._accepting = trio.open_memory_channel[trio.abc.Stream](math.inf)
        self._ports = itertools.count(1024)

    async def accept(self) -> trio.abc.Stream:
        return await self._accepting.receive()

    async def aclose(self) -> None:
        await self._accepting.aclose()

    async def dial(self, host: str) -> trio.abc.Stream:
        """A new link from `host` to the shepherd: the fake's end (BrokenResourceError once
        the shepherd stopped listening)."""
        ours, theirs = trio.testing.memory_stream_pair()
        await self._incoming.send(_Link(theirs, self, _Address(host, next(self._ports))))
        return _Link(ours, self)


class _Link(trio.abc.Stream):
    """One end of a simulated link: writes take latency + bytes / rate on trio's clock."""

    def __init__(
        self, stream: trio.StapledStream, network: SimulatedNetwork, peer: _Address | None = None
    ):
        self._stream, self._network = stream, network
        self.socket = peer  # the shepherd's end: who dialled (`admission.peer_name`)

    async def send_all(self, data) -> None:
        network = self._network
        delay = network.latency + len(data) / network.bytes_per_second
        if delay > 0:
            await trio.sleep(delay)
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self._stream.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    async def aclose(self) -> None:
        await self._stream.aclose()


def pseudo_gradient(shapes: tuple, seed: int) -> dict[str, np.ndarray]:
    """A small random result of `shapes` (name, shape pairs), drawn once per seed."""
    key = (shapes, seed)
    if key not in _drawn:
        rng = np.random.default_rng(seed)
        _drawn[key] = {
            n: rng.standard_normal(shape, dtype=np.float32) * np.float32(1e-4)
            for n, shape in shapes
        }
    return _drawn[key]


async def fake_worker(
    dial: Callable[[], Awaitable[trio.abc.Stream]],
    index: int,
    *,
    token: str,
    drawn: Callable[[tuple, int], Awaitable[dict[str, np.ndarray]]] | None = None,
    train_seconds: float = 0.0,
) -> str:
    """One fake's connection, from `dial()` to its end: "goodbye" (the run ended it) or
    why the link ended (the shepherd dropped it, or refused it: `busy` and the like).

    `train_seconds`: how long each round's training seems to take (trio's clock) before
    its result goes; `drawn(shapes, seed)`: its result, instead of `pseudo_gradient`."""
    try:
        raw = await dial()
    except (OSError, trio.BrokenResourceError) as exc:  # nobody listens (any more)
        return f"connection refused ({exc!r})"
    ended = ""
    try:
        ended = await _session(raw, index, token, drawn, train_seconds)
    except* LINK_ERRORS as group:
        ended = str(group.exceptions[0])
    finally:  # cancelled too (a fake that drops its link): the shepherd sees it end
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(raw)
    return ended


async def _session(raw: trio.abc.Stream, index: int, token: str, drawn, train_seconds) -> str:
    stream = protocol.MessageStream(raw)
    hello = await stream.receive()
    worker_id = f"fake-{index}"
    await stream.send(
        protocol.WorkerHello(
            supported_versions=protocol.SUPPORTED_VERSIONS,
            worker_id=worker_id,
            hostname="fake",
            backend=protocol.BackendInfo(device_kind="cpu", device_count=1),
            proof=auth.proof(token, hello.body_as(protocol.Hello).nonce, worker_id),
            software="fake",
        )
    )
    first = await stream.receive()
    if first.kind == "error":
        refusal = first.body_as(protocol.Error)
        return f"{refusal.code.value}: {refusal.message}"
    welcome = first.body_as(protocol.Welcome)
    planned = await stream.receive()
    if planned.kind == "goodbye":  # the run ended as it joined
        return "goodbye"
    plan = planned.body_as(protocol.Plan)
    tokens = plan.inner_steps * plan.batch_size * plan.tokens_per_row
    await stream.send(protocol.Ready(compile_seconds=0.0))
    async with trio.open_nursery() as nursery:  # heartbeats, as a real worker sends them
        nursery.start_soon(_heartbeats, stream, welcome.heartbeat_seconds)
        ended = await _answer_rounds(stream, plan, tokens, index, drawn, train_seconds)
        nursery.cancel_scope.cancel()
    return ended


async def _heartbeats(stream: protocol.MessageStream, seconds: float) -> None:
    while True:
        await trio.sleep(seconds)
        await stream.send(protocol.Heartbeat(time.time()))


async def _answer_rounds(
    stream: protocol.MessageStream,
    plan: protocol.Plan,
    tokens: int,
    index: int,
    drawn,
    train_seconds: float,
) -> str:
    """Answer every roundStart after `train_seconds`: a progress report of the whole round,
    then the result."""
    result = None
    while True:
        message = await stream.receive()
        if message.kind == "goodbye":
            return "goodbye"
        if message.kind != "roundStart":
            continue
        start = message.body_as(protocol.RoundStart)
        number, steps = start.round, start.inner_steps or plan.inner_steps
        if result is None:
            shapes = tuple((n, t.shape) for n, t in message.tensors.items())
            seed = index % PSEUDO_GRADIENTS
            result = await drawn(shapes, seed) if drawn else pseudo_gradient(shapes, seed)
        await trio.sleep(train_seconds)
        progress = protocol.Progress(
            round=number, step=steps, total_steps=steps, loss=1.0, phase=protocol.Phase.TRAINING
        )
        await stream.send(progress)
        body = protocol.RoundResult(
            round=number, tokens=tokens, losses=(1.0,) * plan.inner_steps, inner_steps=steps
        )
        await stream.send(body, result)


def stand_in(workload: Workload, shapes: Mapping[str, tuple[int, ...]], name: str = "") -> Workload:
    """`workload` with parameters of `shapes` (drawn at 0.02 scale, seed 0) and a loss that
    only touches them: what a run of protocol-level fakes needs, whose graphs nobody runs."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    params = {
        n: rng.standard_normal(s, dtype=np.float32) * np.float32(0.02) for n, s in shapes.items()
    }

    def loss_fn(p, tokens):
        return sum(jnp.mean(v) for v in p.values()) + jnp.mean(tokens.astype(jnp.float32))

    return dataclasses.replace(workload, name=name or workload.name, params=params, loss_fn=loss_fn)


def stand_in_shepherd(workers: int, rounds: int) -> Shepherd:
    """A shepherd of `SMALL_RUN`'s settings for `workers` fakes, its model's parameters the
    few of `STAND_IN_SHAPES` (the graphs export in seconds), with validation and the
    held-out eval off: the fakes' results are random."""
    from pcp_tui.shepherd.coordinator import Shepherd
    from pcp_tui.testing._processes import small_config
    from pcp_tui.training.build import build_workload

    config = small_config(
        workers=workers,
        rounds=rounds,
        inner_steps=4,
        chunk_steps=4,
        warmup_steps=1,
        validate="off",
        eval_every=10**6,
        eval_batches=1,
        data_max_bytes=2**20,
        heartbeat_seconds=2.0,
    )
    return Shepherd(config, stand_in(build_workload(config, shards=workers), STAND_IN_SHAPES))


@dataclasses.dataclass
class Simulated:
    """What a simulated run left: each fake's link ends in order ("goodbye" last, if the run
    said it to that fake), and the shepherd's `lost` events."""

    ends: dict[int, list[str]]
    lost: list[str]


def simulate(
    shepherd: Shepherd,
    workers: int,
    *,
    train_seconds: float = 0.0,
    storm_after: int | None = None,
    latency: float = 0.005,
    clock: trio.abc.Clock | None = None,
) -> Simulated:
    """Run `shepherd` with `workers` fakes on `SimulatedNetwork`, on trio's virtual clock.

    Fake i dials from its own address (10.x.y.z) at once, and after whatever ends its link
    dials again as a real worker does (`Reconnect`: waits from 0.5-1 s, doubling to 15-30
    s); `train_seconds` is each round's seeming training. `storm_after`: once that many
    rounds are done, every third fake drops its link at once (a site's switch rebooting)
    and rejoins as a worker that lost its connection does. Returns when the run ends.
    """
    network = SimulatedNetwork(latency=latency)
    ends: dict[int, list[str]] = collections.defaultdict(list)
    lost: list[str] = []
    storm = trio.Event()
    shepherd.state.subscribe(lambda e: lost.append(e.message) if e.kind == "lost" else None)
    token = shepherd.token

    async def fake(index: int, storm: trio.Event | None) -> None:
        policy = Reconnect(give_up_after=3600.0)
        dial = functools.partial(network.dial, _address(index))

        async def attempt(deadline: float) -> None:
            ended = await fake_worker(dial, index, token=token, train_seconds=train_seconds)
            ends[index].append(ended)
            if ended != "goodbye":
                raise ConnectionLost(ended)

        if storm is not None:
            async with trio.open_nursery() as nursery:

                async def drop() -> None:
                    await storm.wait()
                    ends[index].append("dropped")
                    nursery.cancel_scope.cancel()

                nursery.start_soon(drop)
                await policy.run(attempt)
                nursery.cancel_scope.cancel()
        if not ends[index] or ends[index][-1] != "goodbye":
            await policy.run(attempt, rejoin=bool(ends[index]))

    async def main() -> None:
        async with trio.open_nursery() as nursery:

            async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
                await shepherd.run(listeners=[network], task_status=task_status)
                nursery.cancel_scope.cancel()  # the fakes still backing off, too

            await nursery.start(run)
            for i in range(workers):
                stormy = storm_after is not None and i % 3 == 0
                nursery.start_soon(fake, i, storm if stormy else None)
            if storm_after is not None:
                while len(shepherd.state.history) < storm_after:
                    await trio.sleep(0.5)
                storm.set()

    trio.run(main, clock=clock or trio.testing.MockClock(autojump_threshold=0))
    return Simulated(dict(ends), lost)


def _address(index: int) -> str:
    return f"10.{index >> 16 & 255}.{index >> 8 & 255}.{index & 255}"
