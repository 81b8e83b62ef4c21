"""A worker over several local devices (a JAX mesh) trains as a one-device worker does.

The shepherd exports its graphs for the worker's device count (`shard_map`
inside, reductions explicit). The mesh runs on forced CPU devices
(`--xla_force_host_platform_device_count=4`; N = 2 takes two of them), which
must be set before JAX starts: those parts run in subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import trio

from pcp_tui import protocol
from pcp_tui.app.api_bodies import worker_json
from pcp_tui.app.cli import build_parser, worker_config_from
from pcp_tui.app.config_file import load_config_file
from pcp_tui.backends import BackendUnavailable, GraphError, JaxBackend
from pcp_tui.config import ConfigError, RunConfig, ShardingConfig
from pcp_tui.contract import auth
from pcp_tui.protocol import _messages as wire
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.shepherd.run.graphs import GraphLibrary, Unservable
from pcp_tui.shepherd.run.state import WorkerView
from pcp_tui.testing import (
    OutputProcess,
    WorkerProcesses,
    connect_peer,
    free_port,
    shepherd_command,
    small_config,
    until,
)
from pcp_tui.testing import worker_env as base_env
from pcp_tui.training.build import build_workload
from pcp_tui.training.export import InnerOptimizer, TrainingGraphs, build_graphs
from pcp_tui.training.sharding import (
    MAX_PATTERN_CHARS,
    MAX_RULES,
    param_layout,
    split_axis,
    state_axes,
)

DEVICES = 4
FORCED = "--xla_force_host_platform_device_count=4"


def mesh_env() -> dict[str, str]:
    """A worker's environment with 4 CPU devices, each on one XLA thread."""
    env = base_env()
    env["XLA_FLAGS"] = f"{FORCED} --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    return env


# ----------------------------------------------------------------------------- the section


def test_sharding_section_reads_from_toml_in_order(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'inner_steps = 5\n[sharding]\nmode = "fsdp"\n'
        'rules = { "wte" = "replicated", "h.*" = "fsdp", "*" = "replicated" }\n'
    )
    values = load_config_file(path)
    assert values["inner_steps"] == 5
    assert RunConfig(**values).sharding == ShardingConfig(
        "fsdp", (("wte", "replicated"), ("h.*", "fsdp"), ("*", "replicated"))
    )
    path.write_text('[sharding]\nrules = { "h.*" = "tensor" }\n')
    with pytest.raises(ConfigError, match=r"'h\.\*' = 'tensor'.*replicated, fsdp"):
        RunConfig(**load_config_file(path)).validate()
    with pytest.raises(ConfigError, match="at most 256"):
        ShardingConfig(rules=(("x", "fsdp"),) * 257).check()
    assert (MAX_RULES, MAX_PATTERN_CHARS) == (wire.MAX_SHARDING_RULES, wire.TENSOR_NAME_CHARS)
    path.write_text('[sharding]\nmodes = "fsdp"\n')
    with pytest.raises(ConfigError, match="unknown option 'modes'.*did you mean 'mode'"):
        load_config_file(path)
    path.write_text('[sharding]\nmode = "fsdpp"\n')  # named as the file names it: no such flag
    with pytest.raises(ConfigError, match=r"^\[sharding\] mode must be one of data, fsdp, got"):
        RunConfig(**load_config_file(path)).validate()


def test_first_matching_rule_decides_then_the_mode():
    rules = [("h.*.mlp.*", "replicated"), ("*.b", "fsdp")]
    assert param_layout("h.0.mlp.c_fc.w", 2, "fsdp", rules) == "replicated"
    assert param_layout("h.0.attn.c_attn.b", 1, "data", rules) == "fsdp"
    assert param_layout("wte", 2, "fsdp", rules) == "fsdp"  # the mode splits matrices
    assert param_layout("ln_f.scale", 1, "fsdp", rules) == "replicated"  # ... not vectors
    assert param_layout("wte", 2, "data", rules) == "replicated"
    assert split_axis((128, 384), 4) == 1  # the largest axis the devices divide
    assert split_axis((6, 3), 4) is None  # none: replicated
    # Adam's state: a count, then first and second moments in parameter order
    params, axes = [(8, 4), (4,)], [0, None]
    assert state_axes([(), (8, 4), (4,), (8, 4), (4,)], params, axes) == [None, 0, None, 0, None]


def test_plan_carries_the_sharding_section():
    sharding = ShardingConfig("fsdp", (("h.*", "replicated"),)).to_wire()
    frame = b"".join(bytes(part) for part in protocol.encode(protocol.Plan(sharding=sharding)))
    assert protocol.decode(frame).body.sharding == sharding
    assert protocol.Plan().sharding.mode == protocol.ShardingMode.DATA  # absent: data parallel


def test_devices_that_cannot_run_the_plan_say_which_option_to_change():
    config, workload = _tiny_gpt2(batch_size=6)
    library = GraphLibrary.for_run(config, workload, InnerOptimizer())
    with pytest.raises(Unservable, match="batch size 6 does not split over a worker.s 4 devices"):
        trio.run(library.for_worker, protocol.Platform.CPU, protocol.Runtime.XLA, 4)
    cudnn = GraphLibrary.for_run(*_tiny_gpt2(attention="cudnn"), InnerOptimizer())
    cudnn.main = TrainingGraphs((), b"", b"", b"", ("cuda",), 4)  # the run's, unused here
    with pytest.raises(
        Unservable, match="cudnn.*has 1: join with --devices 1, or run the shepherd"
    ):
        trio.run(cudnn.for_worker, protocol.Platform.CUDA, protocol.Runtime.XLA, 2)
    two = _graphs(workload, 2, "data")  # exported for two devices on this one-device process
    with pytest.raises(GraphError, match=r"exported for 2 device\(s\), this worker runs on 1"):
        JaxBackend("cpu", 1).load("train_chunk", two.train_chunk)
    with pytest.raises(BackendUnavailable, match="--devices 64: this host has"):
        JaxBackend("cpu", 64)


async def test_a_worker_whose_devices_cannot_split_the_batch_is_refused_not_lost():
    """It joined and the shepherd cannot serve it: the event and the log say refused and why
    (a `lost` sent its operator looking at the network), and the worker is told the same.
    It never joined the run: no `joined` line before the refusal (there was one)."""
    config = small_config(workers=1)  # batch size 4
    shepherd = Shepherd(config, build_workload(config, shards=1))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(shepherd.run)
        stream, nonce = await connect_peer(port)
        backend = protocol.BackendInfo(platform=protocol.Platform.CPU, device_count=3)
        hello = protocol.WorkerHello(
            supported_versions=protocol.SUPPORTED_VERSIONS,
            worker_id="three",
            proof=auth.proof("test-token", nonce, "three"),
            backend=backend,
        )
        await stream.send(hello)
        answer = (await stream.receive()).body
        await until(lambda: shepherd.state.workers["three"].state in ("lost", "refused"))
        nursery.cancel_scope.cancel()
    why = "this run's batch size 4 does not split over a worker's 3 devices: restart that worker"
    assert answer.code == protocol.ErrorCode.UNSUPPORTED_BACKEND and why in answer.message
    kinds = [event.kind for event in shepherd.state.events]
    assert "lost" not in kinds and kinds.count("worker_refused") == 1, kinds
    assert "joined" not in kinds and "shard_adopted" not in kinds, kinds
    [refused] = [event for event in shepherd.state.events if event.kind == "worker_refused"]
    assert refused.message.startswith(f"worker 0 refused: {why}"), refused.message
    assert shepherd.state.workers["three"].reason.startswith(why)


async def test_a_refused_worker_leaves_no_mark_on_the_shard_ledger():
    """Red team: a worker the shepherd cannot serve never trained a shard, though the pool
    gives it one before it finds out (`_admit`, then `graphs.for_worker`). Its shard was
    reported orphaned as it was refused, and the ledger kept it as that shard's last
    holder, so the run's first real worker 'took over' a shard nobody had trained."""
    config = small_config(workers=1)  # batch size 4
    shepherd = Shepherd(config, build_workload(config, shards=1))

    async def join(port: int, worker_id: str, devices: int) -> protocol.Message:
        stream, nonce = await connect_peer(port)
        backend = protocol.BackendInfo(platform=protocol.Platform.CPU, device_count=devices)
        hello = protocol.WorkerHello(
            supported_versions=protocol.SUPPORTED_VERSIONS,
            worker_id=worker_id,
            proof=auth.proof("test-token", nonce, worker_id),
            backend=backend,
        )
        await stream.send(hello)
        answer = await stream.receive()
        await stream.aclose()
        return answer

    async with trio.open_nursery() as nursery:
        port = await nursery.start(shepherd.run)
        assert (await join(port, "three", 3)).kind == "error"
        await until(lambda: shepherd.state.workers["three"].state == "refused")
        assert (await join(port, "one", 1)).kind == "welcome"
        nursery.cancel_scope.cancel()
    kinds = [event.kind for event in shepherd.state.events]
    assert "worker_refused" in kinds and "joined" in kinds, kinds
    assert "shard_orphaned" not in kinds and "shard_adopted" not in kinds, kinds
    parser = build_parser()

    def devices(text: str) -> int | None:
        args = parser.parse_args(["worker", "--connect", "h:1", "--devices", text])
        return worker_config_from(args).compute.device_count

    assert devices("all") is None
    assert devices("2") == 2
    with pytest.raises(ConfigError, match="--devices must be all or a positive number"):
        devices("0")


# ----------------------------------------------------------------------------- equivalence


def _tiny_gpt2(**options):
    """The tiny GPT-2 of the test runs."""
    from pcp_tui.testing import small_config
    from pcp_tui.training.build import build_workload

    config = small_config(**options)
    return config, build_workload(config, 1)


def _graphs(workload, devices: int, mode: str):
    """Its graphs (4 AdamW steps per chunk) as the shepherd exports them for `devices` devices."""
    return build_graphs(
        workload.loss_fn,
        workload.params,
        workload.batch_spec,
        inner=InnerOptimizer(),
        chunk_steps=4,
        eval_batches=1,
        platforms=("cpu",),
        devices=devices,
        sharding=ShardingConfig(mode).to_wire(),
    )


def _chunks_on(devices: int, mode: str, config, workload) -> dict:
    """Two train_chunk calls as a worker runs them, on `devices` of a 4-device process."""
    from pcp_tui.training import shards
    from pcp_tui.worker.rounds import run_chunk

    graphs = _graphs(workload, devices, mode)
    backend = JaxBackend("cpu", devices)
    train = backend.load("train_chunk", graphs.train_chunk, donate_argnums=(0, 1))
    init = backend.load("init_opt_state", graphs.init_opt_state)
    host = [workload.params[name] for name in graphs.param_names]
    axes = train.input_axes[: len(host)] if train.input_axes else None
    params = backend.to_device(host, axes) if axes else backend.to_device(host)
    kept, state, losses = backend.keep(host, params), init.call(tuple(params)), []
    for chunk in range(2):
        batches = shards.sample_shard(
            "windows", workload.shards[0], steps=4, batch_size=config.data.batch_size,
            seq_len=config.data.seq_len, seed=0, stream=(0, 1, chunk),
        )  # fmt: skip
        params, state, chunk_losses = run_chunk(train.call, params, state, batches, chunk * 4)
        losses.extend(float(x) for x in chunk_losses)
    split = [
        name
        for name, p in zip(graphs.param_names, params, strict=True)
        if not p.sharding.is_fully_replicated
    ]
    hlo = train.call.as_text()
    return {
        "losses": losses,
        "pseudo_gradient": backend.difference(kept, params),
        "split": split,
        "all_reduce": hlo.count("all-reduce("),
        "all_gather": hlo.count("all-gather("),
        "reduce_scatter": hlo.count("reduce-scatter("),
    }


_RUNS = (
    ("one", 1, "data"),
    ("data2", 2, "data"),
    ("fsdp2", 2, "fsdp"),
    ("data4", 4, "data"),
    ("fsdp4", 4, "fsdp"),
)


def _equivalence() -> None:
    """Subprocess entry: the runs to compare, as one JSON line."""
    model = _tiny_gpt2()
    runs = {name: _chunks_on(n, mode, *model) for name, n, mode in _RUNS}
    reference = runs["one"]["pseudo_gradient"]
    for run in runs.values():  # the tensors stay here: only how far they are from one device's
        run["pseudo_gradient_vs_one"] = _relative_difference(reference, run.pop("pseudo_gradient"))
    print(json.dumps(runs))


@pytest.fixture(scope="module")
def mesh_runs() -> dict:
    code = f"import runpy; runpy.run_path({__file__!r})['_equivalence']()"  # this file's function
    done = subprocess.run(
        [sys.executable, "-c", code], env=mesh_env(), capture_output=True, text=True, timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _relative_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """|a - b| / |a| over all pseudo-gradient tensors together (L2)."""
    return float(
        np.sqrt(sum(((x - y) ** 2).sum() for x, y in zip(a, b, strict=True)))
        / np.sqrt(sum((x**2).sum() for x in a))
    )


@pytest.mark.e2e  # mesh_runs runs the N-device workers in a process
@pytest.mark.parametrize("run", ["data2", "fsdp2", "data4", "fsdp4"])
def test_an_n_device_worker_trains_as_a_one_device_worker(mesh_runs, run):
    """Same global batch, same AdamW steps: equal up to the order of float32 sums.

    Not bit-equal: each device averages the gradient of its B/N rows and an
    all-reduce (or reduce-scatter) averages the N means, where one device sums
    all B rows in one order; float32 addition is not associative. Measured:
    losses within 9e-8 relative (float32's epsilon is 1.2e-7), pseudo-gradients
    within 2e-5 relative L2 after 8 AdamW steps (Adam's division by sqrt(v)
    magnifies rounding on near-zero gradients; 0 would mean no mesh was used).
    """
    one, mesh = mesh_runs["one"], mesh_runs[run]
    np.testing.assert_allclose(mesh["losses"], one["losses"], rtol=1e-6, atol=0)
    assert 0 < mesh["pseudo_gradient_vs_one"] < 5e-5
    assert mesh["all_reduce"] >= 1  # the loss (and replicated gradients) averaged explicitly
    assert one["all_reduce"] == one["all_gather"] == one["pseudo_gradient_vs_one"] == 0
    if run.startswith("fsdp"):  # the matrices live split: gathered for use, gradients scattered
        assert set(mesh["split"]) == {
            n for n in mesh["split"] if n.endswith(".w") or n in ("wte", "wpe")
        }
        assert {"wte", "wpe", "h.0.mlp.c_fc.w"} <= set(mesh["split"])
        assert mesh["all_gather"] == mesh["reduce_scatter"] == len(mesh["split"])
    else:
        assert mesh["split"] == [] and mesh["all_gather"] == mesh["reduce_scatter"] == 0


# ----------------------------------------------------------------------------- end to end


@pytest.mark.e2e
def test_a_mesh_worker_and_a_one_device_worker_train_one_run(tmp_path):
    """One shepherd (FSDP [sharding]), a 4-device worker and a 1-device worker: both contribute.
    The shepherd runs on a 4-device host too, as on a GPU node: it evaluates on one device."""
    port, metrics, config = free_port(), tmp_path / "run.jsonl", tmp_path / "run.toml"
    config.write_text('platforms = ["cpu"]\n[sharding]\nmode = "fsdp"\n')
    shepherd = OutputProcess(
        shepherd_command(
            port, "--workers", "2", "--rounds", "2", "--inner-steps", "4", "--chunk-steps", "4",
            "--inner-lr", "3e-3", "--warmup-steps", "2", "--config", str(config),
            "--metrics", str(metrics),
        ),
        env=mesh_env(),
    )  # fmt: skip
    try:
        with WorkerProcesses(env=mesh_env()) as workers:
            workers.spawn(port, "--devices", "all", "--id", "mesh")
            workers.spawn(port, "--devices", "1", "--id", "single")
            assert shepherd.finish() == 0, shepherd.output
    finally:
        shepherd.kill()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    joined = {row["worker"]: row for row in rows if row["event"] == "joined"}
    assert {w: row["devices"] for w, row in joined.items()} == {"mesh": 4, "single": 1}
    assert "cpu x4" in joined["mesh"]["message"]  # the backend as the dashboard's table shows it
    view = WorkerView("mesh", 0, "host", backend="cpu x4", devices=joined["mesh"]["devices"])
    assert worker_json(view, now=0.0)["devices"] == 4  # /v1/workers
    rounds = [row for row in rows if row["event"] == "round"]
    assert [r["workers"] for r in rounds] == [2, 2]
    assert sorted(rounds[-1]["worker_ids"]) == ["mesh", "single"]
    assert rounds[-1]["train_loss"] < rounds[0]["train_loss"]
