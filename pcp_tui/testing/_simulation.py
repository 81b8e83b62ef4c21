"""Protocol-level fake workers, and a simulated network to run thousands of them on.

A fake does the real handshake (HMAC), takes the real plan, says ready at once, heartbeats
as a real worker does, and answers every roundStart (at once, or after a seeming training
time) with a progress report and a small finite pseudo-gradient of the round's shapes: no
compute, so what a round costs is the shepherd's. `benchmarks/bench_shepherd_scale.py`
runs them over TCP in processes of their own; `SimulatedNetwork` runs them in the shepherd's own trio loop over in-memory
links, so that on `trio.testing.MockClock` a run of 1,000 or more of them, with churn and
reconnect storms, takes seconds: the real round code, in virtual time.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np
import trio
import trio.testing

from pcp_tui import protocol
from pcp_tui.config.relay import RelayConfig
from pcp_tui.contract import auth
from pcp_tui.contract.connection import (
    HELLO_SECONDS,
    LINK_ERRORS,
    ConnectionLost,
    silence_timeout,
)
from pcp_tui.worker.reconnect import Reconnect
from pcp_tui.worker.session import BUSY_TRIES

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

    def __init__(
        self,
        *,
        latency: float = 0.0,
        bytes_per_second: float = math.inf,
        frozen: trio.Event | None = None,
    ):
        self.latency, self.bytes_per_second = latency, bytes_per_second
        self.frozen = frozen  # once set, its links carry nothing more and stay open (`_Link`)
        self.moved = 0  # bytes written on its links, both ways: what crossed the listener's NIC
        self._incoming, self._accepting = trio.open_memory_channel[trio.abc.Stream](math.inf)
        self._ports = itertools.count(1024)

    async def accept(self) -> trio.abc.Stream:
        return await self._accepting.receive()

    async def aclose(self) -> None:
        await self._accepting.aclose()

    async def dial(self, host: str) -> _Link:
        """A new link from `host` to the shepherd: the fake's end (BrokenResourceError once
        the shepherd stopped listening)."""
        ours, theirs = trio.testing.memory_stream_pair()
        await self._incoming.send(
            _Link(theirs, self, _Address(host, next(self._ports)), self.frozen)
        )
        return _Link(ours, self, frozen=self.frozen)


class _Link(trio.abc.Stream):
    """One end of a simulated link: writes take latency + bytes / rate on trio's clock.

    `frozen`: once set, this end neither sends nor takes a byte more and stays open, as
    the socket of a process that hangs (SIGSTOP, a deadlock) does."""

    def __init__(
        self,
        stream: trio.StapledStream,
        network: SimulatedNetwork,
        peer: _Address | None = None,
        frozen: trio.Event | None = None,
    ):
        self._stream, self._network = stream, network
        self.socket = peer  # the shepherd's end: who dialled (`admission.peer_name`)
        self.frozen = frozen

    async def _hang_if_frozen(self) -> None:
        if self.frozen is not None and self.frozen.is_set():
            await trio.sleep_forever()

    async def send_all(self, data) -> None:
        await self._hang_if_frozen()
        network = self._network
        network.moved += len(data)
        delay = network.latency + len(data) / network.bytes_per_second
        if delay > 0:
            await trio.sleep(delay)
        await self._hang_if_frozen()
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        await self._hang_if_frozen()
        data = await self._stream.receive_some(max_bytes)
        await self._hang_if_frozen()
        return data

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
    hello = None
    with trio.move_on_after(HELLO_SECONDS):  # a hung relay takes the dial and says nothing
        hello = await stream.receive()
    if hello is None:
        return f"no hello in {HELLO_SECONDS:g} s"
    if hello.kind == "error":  # a relay without its link yet, a full shepherd: busy
        refusal = hello.body_as(protocol.Error)
        return f"{refusal.code.value}: {refusal.message}"
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
    silence = silence_timeout(welcome.heartbeat_seconds)  # as a real worker's watchdog
    async with trio.open_nursery() as nursery:  # heartbeats, as a real worker sends them
        nursery.start_soon(_heartbeats, stream, welcome.heartbeat_seconds)
        ended = await _answer_rounds(stream, plan, tokens, index, drawn, train_seconds, silence)
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
    silence: float,
) -> str:
    """Answer every roundStart after `train_seconds`: a progress report of the whole round,
    then the result; "silent" once the shepherd sends nothing (not even a heartbeat) for
    `silence` seconds while no training goes on."""
    result = None
    while True:
        with trio.move_on_after(silence) as waited:
            message = await stream.receive()
        if waited.cancelled_caught:
            return f"silent for {silence:g} s"
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


def stand_in_shepherd(workers: int, rounds: int, **changes) -> Shepherd:
    """A shepherd of `SMALL_RUN`'s settings for `workers` fakes, its model's parameters the
    few of `STAND_IN_SHAPES` (the graphs export in seconds), with validation and the held-out
    eval off (the fakes' results are random); `changes`: other `RunConfig` fields (relays=)."""
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
        **changes,
    )
    return Shepherd(config, stand_in(build_workload(config, shards=workers), STAND_IN_SHAPES))


class CpuByPart(trio.abc.Instrument):
    """CPU seconds of each part of one trio run (the shepherd, the relays, the fakes), where
    they all share one thread: the loop thread's CPU time, split in proportion to each
    part's task steps (timed on `perf_counter`, a tenth of `thread_time`'s system call on
    this project's 2-core box, where a million task steps are a few seconds). A task's part
    is the one whose `mark`ed task it descends from ("other": trio's own). CPU spent off the
    loop's thread (a fold or the outer step in `trio.to_thread`, XLA's own threads) is
    "threads": in a simulation only the shepherd computes there."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = collections.defaultdict(float)
        self._part: dict[object, str] = {}  # task -> its part, while it runs
        self._started = 0.0
        self._process = self._thread = 0.0  # at the run's start

    def mark(self, part: str) -> None:
        """The calling task, and every task it starts from now on, is `part`."""
        self._part[trio.lowlevel.current_task()] = part

    def seconds(self) -> dict[str, float]:
        """Each part's CPU seconds so far (asked on the loop's thread)."""
        loop = time.thread_time() - self._thread
        stepped = sum(self._seconds.values()) or 1.0
        parts = {part: loop * seconds / stepped for part, seconds in self._seconds.items()}
        return {**parts, "threads": time.process_time() - self._process - loop}

    def _of(self, task: trio.lowlevel.Task) -> str:
        part = self._part.get(task)
        if part is None:
            nursery = task.parent_nursery
            part = self._of(nursery.parent_task) if nursery is not None else "other"
            self._part[task] = part
        return part

    def before_run(self) -> None:
        self._process, self._thread = time.process_time(), time.thread_time()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._started = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self._seconds[self._of(task)] += time.perf_counter() - self._started

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        self._part.pop(task, None)


@contextlib.contextmanager
def _time_stands_still_in_threads() -> Iterator[None]:
    """Virtual time does not pass while a `trio.to_thread.run_sync` call computes.

    `MockClock`'s autojump takes a task waiting for a thread as blocked and jumps to the next
    deadline at once, again and again until the thread returns: a second of real folding or
    compiling became hours of virtual heartbeats, timeouts and progress reports. While a
    thread runs, a system task waits in `wait_all_tasks_blocked`, which holds the autojump
    (trio's documented rule); it ends as the thread returns.
    """
    real = trio.to_thread.run_sync

    async def run_sync(*args, **kwargs):
        computing = trio.CancelScope()

        async def hold() -> None:
            with computing:
                await trio.testing.wait_all_tasks_blocked(math.inf)

        trio.lowlevel.spawn_system_task(hold)
        try:
            return await real(*args, **kwargs)
        finally:
            computing.cancel()

    trio.to_thread.run_sync = run_sync  # type: ignore[assignment]
    try:
        yield
    finally:
        trio.to_thread.run_sync = real


@dataclasses.dataclass
class Simulated:
    """What a simulated run left: each fake's link ends in order ("goodbye" last, if the run
    said it to that fake), the shepherd's `lost` events, and the CPU seconds of each part
    (`CpuByPart`: "shepherd", "relays", "fakes")."""

    ends: dict[int, list[str]]
    lost: list[str]
    cpu: dict[str, float]


def simulate(
    shepherd: Shepherd,
    workers: int,
    *,
    relays: int = 0,
    train_seconds: float = 0.0,
    storm_after: int | None = None,
    relay_down_after: int | None = None,
    relay_fault: str = "kill",
    latency: float = 0.005,
    clock: trio.abc.Clock | None = None,
    on_round: Callable[[Mapping[str, float], int], None] | None = None,
) -> Simulated:
    """Run `shepherd` with `workers` fakes on `SimulatedNetwork`, on trio's virtual clock.

    Fake i dials from its own address (10.x.y.z) at once, and after whatever ends its link
    dials again as a real worker does (`Reconnect`: waits from 0.5-1 s, doubling to 15-30
    s); `train_seconds` is each round's seeming training. `storm_after`: once that many
    rounds are done, every third fake drops its link at once (a site's switch rebooting)
    and rejoins as a worker that lost its connection does.

    `relays`: that many real `Relay`s (the shepherd's --relays at least as many) each dial
    the shepherd from 172.16.0.r, and fake i joins relay i mod R, as a worker started with
    `--connect RELAY,SHEPHERD` does: after a failed or lost link it tries the next address.
    `relay_down_after`: once that many rounds are done, relay 0 fails mid-round as
    `relay_fault` says: "kill" (its process ends: every link closes, nobody listens) or
    "stall" (it hangs: its links stay open and carry nothing, and new dials are taken and
    never answered); its fakes fail over to the shepherd. `on_round(cpu, moved)`: called as each round ends, with
    each part's CPU seconds and the bytes through the shepherd's links (its relays' and its
    direct workers') so far.
    Returns when the run ends; raises the shepherd's `RunFailed` if it fails.
    """
    from pcp_tui.relay import Relay

    network = SimulatedNetwork(latency=latency)
    ends: dict[int, list[str]] = collections.defaultdict(list)
    lost: list[str] = []
    storm, relay_down = trio.Event(), trio.Event()
    cpu = CpuByPart()

    def note(event) -> None:
        if event.kind == "lost":
            lost.append(event.message)
        elif event.kind == "round":
            done = len(shepherd.state.history)
            if done == storm_after:
                storm.set()
            if done == relay_down_after:
                relay_down.set()
            if on_round is not None:
                on_round(cpu.seconds(), network.moved)

    shepherd.state.subscribe(note)
    token = shepherd.token
    if relay_fault not in ("kill", "stall"):
        raise ValueError(f"relay_fault is 'kill' or 'stall', not {relay_fault!r}")
    stalled = relay_down if relay_fault == "stall" else None  # relay 0's links freeze
    sites = [
        SimulatedNetwork(latency=latency, frozen=stalled if r == 0 else None) for r in range(relays)
    ]

    async def fake(index: int, storm: trio.Event | None) -> None:
        cpu.mark("fakes")
        policy = Reconnect(give_up_after=3600.0)
        host = _address(index)
        addresses = [network] if not sites else [sites[index % len(sites)], network]
        at = busy = 0

        async def dial() -> trio.abc.Stream:
            return await addresses[at % len(addresses)].dial(host)

        async def attempt(deadline: float) -> None:
            nonlocal at, busy
            ended = await fake_worker(dial, index, token=token, train_seconds=train_seconds)
            ends[index].append(ended)
            if ended != "goodbye":  # as a worker: the same address if busy, a few times
                busy = busy + 1 if ended.startswith("busy") else BUSY_TRIES
                if busy >= BUSY_TRIES:
                    at, busy = at + 1, 0
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

    async def relay(index: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
        cpu.mark("relays")
        site = Relay(
            RelayConfig(connect="shepherd:8080", worker_id=f"relay-{index}", give_up_after=3600.0),
            token=token,
            say=lambda line: None,
        )

        async def dial(deadline: float) -> trio.abc.Stream:
            try:
                link = await network.dial(f"172.16.{index >> 8 & 255}.{index & 255}")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise ConnectionLost("the shepherd is not listening") from None
            link.frozen = sites[index].frozen  # its uplink hangs with it
            return link

        async with trio.open_nursery() as nursery:

            async def kill() -> None:  # as a process killed: every link ends, nobody listens
                await relay_down.wait()
                await sites[index].aclose()
                nursery.cancel_scope.cancel()

            async def serve(task_status=trio.TASK_STATUS_IGNORED) -> None:
                await site.run(listeners=[sites[index]], dial=dial, task_status=task_status)
                nursery.cancel_scope.cancel()

            if index == 0 and relay_down_after is not None and stalled is None:
                nursery.start_soon(kill)
            await nursery.start(serve)
            task_status.started()

    from pcp_tui.shepherd.coordinator import RunFailed

    failed: list[RunFailed] = []  # the run's own failure, raised as it is (not in a group)

    async def main() -> None:
        async with trio.open_nursery() as nursery:

            async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
                cpu.mark("shepherd")
                try:
                    await shepherd.run(listeners=[network], task_status=task_status)
                except RunFailed as exc:
                    failed.append(exc)
                nursery.cancel_scope.cancel()  # the fakes still backing off, and the relays

            await nursery.start(run)
            for r in range(relays):
                await nursery.start(relay, r)
            while len(shepherd.pool.relays.live) < relays:  # the fakes join through them
                await trio.sleep(0.1)
            for i in range(workers):
                stormy = storm_after is not None and i % 3 == 0
                nursery.start_soon(fake, i, storm if stormy else None)

    with _time_stands_still_in_threads():
        trio.run(
            main,
            clock=clock or trio.testing.MockClock(autojump_threshold=0),
            instruments=[cpu],
        )
    if failed:
        raise failed[0]
    return Simulated(dict(ends), lost, cpu.seconds())


def _address(index: int) -> str:
    return f"10.{index >> 16 & 255}.{index >> 8 & 255}.{index & 255}"
