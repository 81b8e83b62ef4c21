"""Which run a worker is in: a resumable goodbye brings it back, and its inner optimizer
state is kept only for the run it belongs to (a `--resume`d shepherd keeps the run id)."""

from __future__ import annotations

from functools import partial

import trio
import trio.testing

from pcp_tui import protocol
from pcp_tui.config import WorkerConfig
from pcp_tui.contract.connection import (
    Connection,
    RunOver,
    RunResumable,
    expect,
    goodbye_ended,
)
from pcp_tui.worker.client import Worker


async def _join(worker: Worker, run_id: str) -> None:
    """One real handshake of `worker` with a shepherd of run `run_id`, over memory streams."""
    ours, theirs = trio.testing.memory_stream_pair()
    shepherd = protocol.MessageStream(theirs)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker._handshake, protocol.MessageStream(ours))
        await shepherd.send(protocol.Hello(protocol.SUPPORTED_VERSIONS, b"n" * 32, run_id))
        assert (await shepherd.receive()).kind == "workerHello"
        await shepherd.send(protocol.Welcome(worker_index=0, run_id=run_id))


async def test_a_worker_keeps_its_optimizer_state_only_for_the_same_run():
    worker = Worker(WorkerConfig(connect="127.0.0.1:1", token="t"))
    moments = object()  # stands in for the AdamW state a round leaves behind

    await _join(worker, "run-a")
    worker._inner.opt_state = moments
    await _join(worker, "run-a")  # the same run (resumed, or the link came back)
    assert worker._inner.opt_state is moments and worker.run_id == "run-a"
    await _join(worker, "run-b")  # a shepherd started afresh: another run
    assert worker._inner.opt_state is None and worker.run_id == "run-b"


async def test_a_resumable_goodbye_reads_as_a_lost_connection_a_plain_one_as_the_end():
    for resumable, ending in ((True, RunResumable), (False, RunOver)):
        ours, theirs = trio.testing.memory_stream_pair()
        shepherd = Connection(protocol.MessageStream(theirs), "shepherd")
        worker = protocol.MessageStream(ours)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(shepherd.close, "stopped by SIGTERM", resumable=resumable))
            message = await worker.receive()  # real Cap'n Proto bytes, decoded
        assert message.body == protocol.Goodbye("stopped by SIGTERM", resumable)
        ended = goodbye_ended(message.body)
        assert type(ended) is ending and "stopped by SIGTERM" in str(ended)


async def test_expect_turns_a_resumable_goodbye_into_a_reconnect():
    ours, theirs = trio.testing.memory_stream_pair()
    await protocol.MessageStream(theirs).send(protocol.Goodbye("restarting", resumable=True))
    try:
        await expect(protocol.MessageStream(ours), "plan")
    except RunResumable as exc:
        assert "restarting" in str(exc)
    else:
        raise AssertionError("a resumable goodbye must end the wait for the plan")
