"""A worker that trusts no shepherd blindly: what a hostile or broken one ships it.

A real `pcp-tui worker` process joins a shepherd written by hand in this test over
127.0.0.1: it speaks the real protocol (hello, welcome, then a plan of real bytes: the
tiny GPT-2's `jax.export` graphs and its shard, as `worker_plan` builds them) and ships
what an attacker would:

1. an honest export whose module bytes were swapped for a module holding jaxlib's
   Python-callback custom call (it passes jax's deserialization and compiles; run, it
   crashed the worker at an address the module chose): refused before it compiles, with
   unsupportedBackend naming the target, and the worker exits without reconnecting;
2. a plan carrying a 3 GB tensor it does not name (refused from its header: the payload
   is never sent), and a plan whose batch size is 2^30 against a graph built for 4
   (refused before anything is allocated for it); each welcome-then-failure counts
   against --give-up-after, so the worker gives up instead of reconnecting twice a second
   for ever; without TLS it says once that it trusts the network.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np
import pytest
import trio
from jax import export
from jax.extend.mlir import serialize_portable_artifact
from jax.extend.mlir.dialects import stablehlo

from pcp_tui import protocol
from pcp_tui.backends import IreeBackend, JaxBackend, UntrustedGraph
from pcp_tui.shepherd.serving.worker_plan import worker_plan
from pcp_tui.training.build import build_workload
from pcp_tui.training.export import InnerOptimizer, build_graphs

from .conftest import small_config

HANG_GUARD = 120  # seconds; only so that a broken worker fails the test instead of hanging it
CALLBACK = "xla_ffi_python_cpu_callback"  # jaxlib's host-callback target on CPU
PEER_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, protocol.ProtocolError)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@pytest.fixture(scope="module")
def honest_plan() -> tuple[protocol.Plan, dict[str, np.ndarray]]:
    """The plan a shepherd of the tiny GPT-2 (batch 4) sends a CPU worker, and its tensors."""
    config = small_config(workers=1, inner_steps=2, chunk_steps=2)
    workload = build_workload(config, shards=1)
    graphs = build_graphs(
        workload.loss_fn,
        workload.params,
        workload.batch_spec,
        inner=InnerOptimizer(),
        chunk_steps=config.inner.chunk,
        eval_batches=1,
        platforms=("cpu",),
    )
    fragments = (tuple(graphs.param_names),)  # plain DiLoCo: one fragment, every parameter
    return worker_plan(config, workload, graphs, run_id="run", slot=0, fragments=fragments)


def with_host_callback(serialized: bytes) -> bytes:
    """An honest export with its module swapped for one that also calls a host callback.

    `jax.export` refuses to serialize host callbacks, so the attacker lowers the same
    computation plus a `pure_callback` with `jax.jit` and writes that module's bytes
    into the honest artifact (every argument kept, as its `module_kept_var_idx` says).
    """
    honest = export.deserialize(bytearray(serialized))
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in honest.in_avals]
    args, kwargs = jax.tree.unflatten(honest.in_tree, specs)

    def hostile(*args, **kwargs):
        leaves, tree = jax.tree.flatten(honest.call(*args, **kwargs))
        first = jax.ShapeDtypeStruct(leaves[0].shape, leaves[0].dtype)
        leaves[0] = jax.pure_callback(np.negative, first, leaves[0])
        return jax.tree.unflatten(tree, leaves)

    module = jax.jit(hostile, keep_unused=True).lower(*args, **kwargs).compiler_ir("stablehlo")
    swapped = dataclasses.replace(
        honest,
        mlir_module_serialized=serialize_portable_artifact(module, stablehlo.get_minimum_version()),
        module_kept_var_idx=tuple(range(len(specs))),
    )
    return swapped.serialize()


def swapped_plan(plan, tensors, graph: str, blob: bytes):
    tensor = next(g.tensor for g in plan.graphs if g.name == graph)
    return plan, {**tensors, tensor: np.frombuffer(blob, np.uint8)}


def test_a_graph_that_calls_out_is_refused_before_it_compiles(honest_plan):
    """The swapped bytes deserialize and compile in jax (the attack is real); both backends
    refuse them naming the target, before XLA or IREE compiles anything."""
    plan, tensors = honest_plan
    train_chunk = tensors[next(g.tensor for g in plan.graphs if g.name == "train_chunk")]
    hostile = with_host_callback(train_chunk.tobytes())
    exported = export.deserialize(bytearray(hostile))
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported.in_avals]
    args, kwargs = jax.tree.unflatten(exported.in_tree, specs)
    assert CALLBACK in exported.mlir_module()
    jax.jit(exported.call).lower(*args, **kwargs).compile()  # what the worker would have run

    compiles: list[str] = []

    def listen(event: str, seconds: float, **_) -> None:
        compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        JaxBackend("cpu").load("init_opt_state", tensors["graph/init_opt_state"].tobytes())
        assert COMPILE_EVENT in compiles  # the listener hears an honest compile
        compiles.clear()
        for backend in (JaxBackend("cpu"), IreeBackend("cpu")):
            with pytest.raises(UntrustedGraph, match=f"a custom call to '{CALLBACK}'"):
                backend.load("train_chunk", hostile)
        assert compiles == []
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


async def fake_shepherd(port_to, plan_for, answers: list, worker) -> int:
    """Serve connections until `worker` (a process) exits: hello, welcome, then
    `plan_for(n)` (n: the connection's number) as buffers to write; record what comes back.
    Returns how many connections were made."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    process = worker(listener.socket.getsockname()[1])
    connections = 0
    with trio.move_on_after(HANG_GUARD):
        async with listener:
            while process.poll() is None:
                raw = None
                with trio.move_on_after(0.5):  # look at the process between accepts
                    raw = await listener.accept()
                if raw is None:
                    continue
                connections += 1
                async with raw:
                    await _serve(protocol.MessageStream(raw), plan_for(connections), answers)
    return connections


async def _serve(stream: protocol.MessageStream, buffers, answers: list) -> None:
    await stream.send(protocol.Hello(supported_versions=protocol.SUPPORTED_VERSIONS, nonce=b"n"))
    assert (await stream.receive()).kind == "workerHello"
    await stream.send(protocol.Welcome(0, "run", heartbeat_seconds=0.5))
    for buffer in buffers:
        await stream.stream.send_all(buffer)
    with trio.move_on_after(HANG_GUARD):
        try:
            while True:
                message = await stream.receive()
                if message.kind != "heartbeat":
                    answers.append(message.body)
        except PEER_ERRORS:
            pass


@pytest.mark.e2e
def test_a_worker_sent_a_graph_that_calls_out_refuses_it_and_exits(honest_plan, spawn_worker):
    plan, tensors = honest_plan
    train_chunk = tensors[next(g.tensor for g in plan.graphs if g.name == "train_chunk")]
    hostile = swapped_plan(plan, tensors, "train_chunk", with_host_callback(train_chunk.tobytes()))
    answers: list = []
    processes = []

    def worker(port: int):
        processes.append(spawn_worker(port))
        return processes[-1]

    connections = trio.run(
        fake_shepherd, None, lambda n: protocol.encode(*hostile), answers, worker
    )
    code, output = processes[0].wait(timeout=HANG_GUARD), processes[0].stdout.read()
    assert code == 1 and connections == 1, output
    [error] = [a for a in answers if a.KIND == "error"]
    assert error.code == protocol.ErrorCode.UNSUPPORTED_BACKEND
    assert f"a custom call to '{CALLBACK}'" in error.message, error.message
    assert "ready" not in [a.KIND for a in answers]
    assert f"'{CALLBACK}'" in output and "(not retrying)" in output


@pytest.mark.e2e
def test_plans_that_do_not_fit_their_graphs_are_refused_and_count_against_give_up_after(
    honest_plan, spawn_worker, tmp_path
):
    """Odd connections get a plan with an unnamed 3 GB tensor, of which only the header is
    sent; even ones a plan of batch size 2^30. Each is refused with a malformed error saying
    why, the worker never says ready, and within --give-up-after 6 it makes at most the
    connections its waits (0.5, 1, 2, 4 s at least) leave room for, then exits 1."""
    plan, tensors = honest_plan
    big = np.memmap(tmp_path / "sparse", np.uint8, mode="w+", shape=(3 * 2**30,))  # no memory
    unnamed = protocol.encode(plan, {**tensors, "extra": big})[:1]  # the frame, no payload
    huge_batch = protocol.encode(dataclasses.replace(plan, batch_size=2**30), tensors)
    answers: list = []
    processes = []

    def worker(port: int):
        processes.append(spawn_worker(port, "--give-up-after", "6"))
        return processes[-1]

    connections = trio.run(
        fake_shepherd, None, lambda n: unnamed if n % 2 else huge_batch, answers, worker
    )
    code, output = processes[0].wait(timeout=HANG_GUARD), processes[0].stdout.read()
    assert code == 1 and "gave up after" in output, output
    assert 2 <= connections <= 5, (connections, output)
    errors = [a.message for a in answers if a.KIND == "error"]
    assert "ready" not in [a.KIND for a in answers]
    assert "plan refused: the plan carries tensors it does not name: ['extra']" in errors[0]
    assert (
        "would be shaped [(2, 1073741824, 33)]; its train_chunk graph takes [(2, 4, 33)]"
        in (errors[1])
    )
    assert output.count("no TLS: this worker trusts the network") == 1, output


SCREEN_ESCAPES = "\x1b]0;owned\x07\x1b[2J\npcp-tui: admitted by a forged line"


async def test_a_shepherds_texts_reach_the_worker_operator_escaped():
    """Red team: a hostile shepherd's error (or goodbye) text is printed by the worker (its
    final line, its status): raw, an escape sequence retitles or clears the operator's
    terminal and a newline forges a line. The worker shows it escaped, as the shepherd
    shows a worker's texts (`connection.shown`)."""
    from pcp_tui.config import WorkerConfig
    from pcp_tui.contract.connection import Refused
    from pcp_tui.worker.client import Worker

    async def answer_with(last: protocol.Body) -> str:
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        port = listener.socket.getsockname()[1]
        settings = WorkerConfig(
            connect=f"127.0.0.1:{port}", token="t", backend="cpu", reconnect=False
        )

        async def serve_one() -> None:
            async with listener, await listener.accept() as raw:
                stream = protocol.MessageStream(raw)
                hello = protocol.Hello(supported_versions=protocol.SUPPORTED_VERSIONS, nonce=b"n")
                await stream.send(hello)
                assert (await stream.receive()).kind == "workerHello"
                await stream.send(last)
                with contextlib.suppress(*PEER_ERRORS):
                    await stream.receive()

        worker = Worker(settings)
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve_one)
                try:
                    await worker.run()
                except Refused as exc:  # its last line (`launch._fail`)
                    return str(exc)
        return worker.status.message  # a goodbye: the run is over, its status says why

    refused = await answer_with(protocol.Error(protocol.ErrorCode.AUTH_FAILED, SCREEN_ESCAPES))
    over = await answer_with(protocol.Goodbye(SCREEN_ESCAPES))
    assert "refused this worker" in refused and "ended the run" in over, (refused, over)
    for text in (refused, over):
        assert "\x1b" not in text and "\n" not in text and "\x07" not in text, repr(text)
        assert "\\x1b]0;owned\\x07\\x1b[2J\\npcp-tui: admitted by a forged line" in text
