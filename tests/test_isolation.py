"""One connection's failure domain is that connection: admitted peers that break the contract.

A real shepherd process trains with a real worker process, while attacking peers
complete the real handshake (the join token's proof) and then send, in real Cap'n
Proto bytes, what an admitted worker must not: a wrong kind for the stage, tensors
where none may ride, a result whose tensors are not the plan's, a body beyond its
bounds, a measurement that is NaN. Each must get an `error` naming what was wrong
and a closed connection; the run must finish all its rounds with exit 0.
(On main before this branch, a second workerHello or an error from an admitted
peer ended the whole run with exit 1.)
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from pcp_tui import protocol
from pcp_tui.contract import auth
from pcp_tui.testing import read_metrics, round_workers

pytestmark = pytest.mark.e2e

TOKEN = "test-token"
INNER_STEPS = 2


def ready() -> protocol.Ready:
    return protocol.Ready(compile_seconds=1.0)


def result(**changes) -> protocol.RoundResult:
    fields = dict(round=1, tokens=8, losses=(1.0,) * INNER_STEPS, inner_steps=INNER_STEPS)
    return protocol.RoundResult(**{**fields, **changes})


def raw_result(frame_changes: dict) -> bytes:
    """A roundResult frame built by hand, with a tensor header that claims 4 GiB."""
    from pcp_tui.protocol._schema import Envelope

    envelope = Envelope.new_message()
    envelope.version = protocol.PROTOCOL_VERSION
    body = envelope.init("roundResult")
    body.round, body.tokens = 1, 8
    [header] = envelope.init("tensors", 1)
    header.name, header.dtype, header.shape = "not.a.param", "float32", [2**30]
    header.payloadBytes = 2**32
    for key, value in frame_changes.items():
        setattr(body, key, value)
    return envelope.to_bytes()  # and no payload: the shepherd must refuse from the header


# name -> (messages sent after the handshake, the error code expected back, words of its message)
ATTACKS = {
    "second workerHello": ([protocol.WorkerHello(worker_id="again")], "malformed", "never accepts"),
    "plan": ([protocol.Plan()], "malformed", "never accepts plan"),
    "roundStart": ([protocol.RoundStart(round=1)], "malformed", "never accepts roundStart"),
    "hello": ([protocol.Hello()], "malformed", "never accepts hello"),
    "result before ready": ([result()], "malformed", "not valid while the connection is planned"),
    "ready twice": ([ready(), ready()], "malformed", "ready is not valid while"),
    "heartbeat with a tensor": (
        [(protocol.Heartbeat(1.0), {"x": np.zeros(4, np.float32)})],
        "tooLarge",
        "may carry no tensors",
    ),
    "result with foreign tensors": ([ready(), raw_result({})], "badResult", "not.a.param"),
    "result with NaN computeSeconds": (
        [ready(), result(compute_seconds=float("nan"))],
        "malformed",
        "roundResult.computeSeconds is nan",
    ),
    "more losses than inner steps": (
        [ready(), result(losses=(1.0,) * (INNER_STEPS + 1))],
        "malformed",
        f"roundResult.losses has {INNER_STEPS + 1} entries; the limit is {INNER_STEPS}",
    ),
    "progress with Inf loss": (
        [ready(), protocol.Progress(round=1, loss=float("inf"), phase=protocol.Phase.TRAINING)],
        "malformed",
        "progress.loss is inf",
    ),
    # a segment table claiming 8 MiB: refused from its length alone
    "oversized frame": ([b"\0\0\0\0" + (2**20).to_bytes(4, "little")], "tooLarge", "frame claims"),
}


async def attack(
    port: int, worker_id: str, messages: list, platform: protocol.Platform = protocol.Platform.CPU
) -> list[protocol.Message]:
    """Join with the real token's proof, send `messages`, and read until the shepherd hangs up."""
    raw = await trio.open_tcp_stream("127.0.0.1", port)
    stream = protocol.MessageStream(raw)
    received: list[protocol.Message] = []
    async with raw:
        hello = (await stream.receive()).body
        proof = auth.proof(TOKEN, hello.nonce, worker_id)
        await stream.send(
            protocol.WorkerHello(
                supported_versions=protocol.SUPPORTED_VERSIONS,
                worker_id=worker_id,
                proof=proof,
                backend=protocol.BackendInfo(platform=platform),
            )
        )
        async with trio.open_nursery() as nursery:  # read while sending: the plan is big
            nursery.start_soon(_send_all, raw, stream, messages)
            try:
                while True:
                    received.append(await stream.receive())
            except protocol.ConnectionClosed:
                pass
    return received


async def _send_all(raw: trio.SocketStream, stream: protocol.MessageStream, messages) -> None:
    for message in messages:
        try:
            if isinstance(message, bytes):
                await raw.send_all(message)
            elif isinstance(message, tuple):
                await stream.send(*message)
            else:
                await stream.send(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # refused already: the reader sees the error and the close


def test_an_admitted_peer_breaking_the_contract_loses_its_connection_not_the_run(
    shepherds, spawn_worker, tmp_path
):
    shepherd = shepherds(
        "--workers",
        "1",
        "--rounds",
        "3",
        "--inner-steps",
        str(INNER_STEPS),
        "--metrics",
        str(tmp_path / "m"),
        token=TOKEN,
    )

    async def all_attacks() -> dict[str, list[protocol.Message]]:
        answers = {}
        for index, (name, (messages, _, _)) in enumerate(ATTACKS.items()):
            answers[name] = await attack(shepherd.port, f"attacker-{index}", messages)
        vulkan = protocol.Platform.VULKAN  # through XLA (the hello's default runtime)
        answers["vulkan"] = await attack(shepherd.port, "vulkan-worker", [], platform=vulkan)
        return answers

    answers = trio.run(all_attacks)  # while the shepherd waits for a worker
    for name, (_, code, words) in ATTACKS.items():
        kinds = [message.kind for message in answers[name]]
        assert kinds[:2] == ["welcome", "plan"], (name, kinds)
        errors = [message.body for message in answers[name] if message.kind == "error"]
        assert len(errors) == 1, (name, kinds)
        assert errors[0].code == code and words in errors[0].message, (name, errors[0])
    # JAX has no Vulkan platform: refused, naming what would serve it
    [unsupported] = [message.body for message in answers["vulkan"] if message.kind == "error"]
    assert unsupported.code == "unsupportedBackend" and "--runtime iree" in unsupported.message

    honest = spawn_worker(shepherd.port, token=TOKEN)
    assert shepherd.finish() == 0, shepherd.output
    assert honest.wait() == 0
    assert round_workers(tmp_path / "m") == [1, 1, 1]
    events = [row["event"] for row in read_metrics(tmp_path / "m")]
    assert events.count("lost") == len(ATTACKS)  # the Vulkan worker was refused, not lost
    assert events.count("worker_refused") == 1


async def test_a_worker_that_reports_an_error_is_dropped_with_its_reason(
    shepherds, spawn_worker, tmp_path
):
    """An honest worker's `error` (it refused a round's parameters, say) is what it is:
    that worker is out, with its reason shown; the shepherd does not crash."""
    shepherd = shepherds(
        "--workers",
        "1",
        "--rounds",
        "2",
        "--inner-steps",
        "2",
        "--heartbeat-timeout",
        "5",
        "--metrics",
        str(tmp_path / "m"),
    )
    refusal = protocol.Error(protocol.ErrorCode.MALFORMED, "roundStart refused: w holds NaN")

    refused = await attack(shepherd.port, "refuser", [ready(), refusal])
    silent = await attack(shepherd.port, "silent", [])  # admitted, then says nothing
    (answers, silent) = refused, silent
    assert [message.kind for message in answers][:2] == ["welcome", "plan"]
    assert "error" not in [message.kind for message in answers]  # it did nothing wrong
    [timeout] = [message.body for message in silent if message.kind == "error"]
    assert timeout.code == "timeout" and "heartbeat timeout 5 s" in timeout.message
    honest = spawn_worker(shepherd.port, token=TOKEN)
    assert shepherd.finish() == 0, shepherd.output
    assert honest.wait() == 0
    assert round_workers(tmp_path / "m") == [1, 1]
    [lost, _silent] = [row for row in read_metrics(tmp_path / "m") if row["event"] == "lost"]
    assert lost["message"].endswith(
        "lost: the worker reported malformed: roundStart refused: w holds NaN"
    )


async def test_a_worker_whose_platform_was_not_exported_stops_instead_of_reconnecting(spawn_worker):
    """unsupportedBackend (like authFailed and versionMismatch) is final: the worker prints
    the shepherd's reason and exits non-zero, and never connects a second time."""

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    worker = spawn_worker(port)
    connections = 0
    async with listeners[0]:
        while worker.poll() is None:
            with trio.move_on_after(0.5):  # poll the process between accepts
                raw = await listeners[0].accept()
                connections += 1
                async with raw:
                    await refuse_platform(protocol.MessageStream(raw))
    (connections, code, output) = connections, worker.wait(), worker.stdout.read()
    assert code != 0 and connections == 1, output
    assert "unsupportedBackend" in output and "export it with --platforms" in output


async def refuse_platform(stream: protocol.MessageStream) -> None:
    await stream.send(protocol.Hello(supported_versions=protocol.SUPPORTED_VERSIONS, nonce=b"n"))
    assert (await stream.receive()).kind == "workerHello"
    await stream.send_error("unsupportedBackend", "cpu is not exported: export it with --platforms")
