"""A shepherd run in this process while a scenario (spawning workers, killing them) drives it."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from pcp_tui import protocol

if TYPE_CHECKING:
    from pcp_tui.worker.client import Worker


def run_shepherd(shepherd: Any, scenario: Callable[[int], Any]) -> None:
    """Run `shepherd` under `trio.run`; once it listens, call `scenario(port)` (awaited if async).

    Returns when the run ends: the scenario only starts workers or steers them.
    """

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(shepherd.run)
            started = scenario(port)
            if inspect.isawaitable(started):
                await started

    trio.run(main)


def local_worker(
    port: int, worker_id: str | None = None, *, faults: Any = None, **options: Any
) -> Worker:
    """A real `Worker` joining 127.0.0.1:`port` on the CPU backend, to run in this process.

    The worker process's code from the socket on (handshake, plan, compile, train,
    results; `faults` as in `pcp_tui.testing.faulty_worker.FAULTS[name].make(...)`), without
    its start-up: for a test whose workers are only peers (`await worker.run()` in the
    test's trio loop). `options`: more `WorkerConfig` options by their flat names.
    """
    from pcp_tui.config import WorkerConfig
    from pcp_tui.worker.client import Worker

    settings: dict[str, Any] = {"connect": f"127.0.0.1:{port}", "token": "test-token"}
    settings.update(backend="cpu", **({} if worker_id is None else {"worker_id": worker_id}))
    config = WorkerConfig(**{**settings, **options})  # `options` may say where (`connect`)
    return Worker(config, faults=faults)


def local_workers(count: int) -> Callable[[int], Any]:
    """A `run_shepherd` scenario: `count` `local_worker`s run until the shepherd ends them."""

    async def scenario(port: int) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(local_worker(port).run)

    return scenario


async def until(predicate: Callable[[], bool], *, polls: int = 6000) -> None:
    """Wait for `predicate()` (polled every 50 ms, at most `polls` times: a bound, not a timing).

    Raises AssertionError when it never becomes true.
    """
    for _ in range(polls):
        if predicate():
            return
        await trio.sleep(0.05)
    raise AssertionError("condition never became true")


def pause_after_round(shepherd: Any, number: int) -> None:
    """Hold `shepherd`'s run at the boundary after round `number`: call before that round ends.

    Waiting until the history holds `number` rounds and then pausing races the run: short
    rounds can all end within one poll, and the pause lands rounds later, or after the run.
    This pauses from inside the round's own "round" event, which the run loop emits before it
    looks at its pause flag again, so the run holds exactly there. It is held once
    `shepherd.state.status == "paused"` and the history holds `number` rounds (the status
    stays "paused" after `shepherd.resume()` until the next round starts).
    """

    def listener(event: Any) -> None:
        if event.kind == "round" and event.record.round == number:
            shepherd.pause()

    shepherd.state.subscribe(listener)


def worker_batches(workload: Any, config: Any, slot: int, number: int, steps: int) -> list:
    """The `steps` batches worker `slot` trains on in round `number`, sampled in chunks of one
    step as a worker with `--chunk-steps 1` samples them: a reference run's inputs."""
    from pcp_tui.training.shards import sample_batches

    return [
        sample_batches(
            workload.shards[slot],
            steps=1,
            batch_size=config.data.batch_size,
            seq_len=config.data.seq_len,
            seed=config.model.seed,
            stream=(slot, number, step),
        )[0]
        for step in range(steps)
    ]


def memory_link(worker_id: str, index: int = 0, shard: int | None = None) -> Any:
    """A real shepherd-side `WorkerLink` of `worker_id` over an in-memory stream (its peer
    end dropped), welcomed now: for round and slot logic without a socket. In trio."""
    import trio.testing

    from pcp_tui.shepherd.run.state import RunState, WorkerView
    from pcp_tui.shepherd.serving.connection import WorkerLink

    near, _far = trio.testing.memory_stream_pair()
    view = WorkerView(worker_id=worker_id, index=index, host="here", shard=shard)
    state = RunState(run_id="r", rounds_total=1, settings={})
    return WorkerLink(protocol.MessageStream(near), view, state, protocol.Platform.CPU)


async def heartbeat_until_hung_up(stream: Any, every: float = 0.2) -> None:
    """A hostile peer's tail: heartbeats forever (alive to the watchdog), reading nothing more.

    Returns when the shepherd hangs up. `stream` is a `protocol.MessageStream`.
    """
    try:
        while True:
            await stream.send(protocol.Heartbeat(time.time()))
            await trio.sleep(every)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return
