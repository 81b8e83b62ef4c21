"""IREE runs the exported graphs with XLA's numbers: GPT-2 tiny and the MLP example, on CPU."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest
import trio

from pcp_tui import protocol
from pcp_tui.backends import (
    IREE_TARGETS,
    GraphError,
    IreeBackend,
    UntrustedGraph,
    compile_stablehlo,
    select_backend,
)
from pcp_tui.backends import _iree as iree_backend
from pcp_tui.contract import auth
from pcp_tui.contract.checks import expected_shapes
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.shepherd.run.graphs import GraphLibrary, Unservable
from pcp_tui.training.build import build_workload
from pcp_tui.training.export import InnerOptimizer, TrainingGraphs, build_graphs
from pcp_tui.training.shards import sample_shard

from .conftest import small_config, worker_command, worker_env

pytest.importorskip("iree.compiler", reason="IREE is the optional extra pcp-tui[iree]")

MLP = f"{Path(__file__).parents[1] / 'examples' / 'mlp_model.py'}:build"
CHUNK = 3
LR = 3e-3
_NO_GRAPHS = TrainingGraphs((), b"", b"", b"", ("cpu",), CHUNK)
# Measured worst cases (GPT-2 tiny): losses 2e-7 relative, Adam's moments 3e-7, parameters 1.0e-4
# (one value of 65,536 on the batches of the corpus's new held-out split; 8.5e-5 before).
# Adam divides by sqrt(v): a weight whose gradient is mostly float32 rounding moves by up to the
# learning rate either way, so parameters agree to a fraction of LR, not to float32's epsilon.
LOSS_RTOL, STATE_ATOL, PARAM_ATOL = 1e-6, 1e-6, LR / 20


def _graphs(workload, platforms=("cpu",)):
    return build_graphs(
        workload.loss_fn,
        workload.params,
        workload.batch_spec,
        inner=InnerOptimizer(name="adamw", lr=LR, warmup_steps=2, decay_steps=20),
        chunk_steps=CHUNK,
        eval_batches=len(jax.tree.leaves(workload.eval_tokens)[0]),
        platforms=platforms,
    )


def _run(backend, graphs, workload, batches):
    """One train_chunk from the initial parameters, then eval_loss of its result."""
    init = backend.load("init_opt_state", graphs.init_opt_state)
    train = backend.load("train_chunk", graphs.train_chunk)
    evaluate = backend.load("eval_loss", graphs.eval_loss)
    params = tuple(backend.to_device([workload.params[n] for n in graphs.param_names]))
    opt_state = init.call(params)
    params, opt_state, losses = train.call(params, opt_state, batches, np.int32(5))
    loss = evaluate.call(params, workload.eval_tokens)
    host = backend.to_host
    return host(params), host(opt_state), host([losses])[0], float(host([loss])[0])


@pytest.fixture(scope="module")
def iree_cache(tmp_path_factory):
    """One compile cache for the module: the e2e run's IREE worker finds GPT-2's graphs compiled."""
    return tmp_path_factory.mktemp("compile-cache")


# The e2e run's shape; the numbers test exports the very same graphs (see iree_cache).
RUN = dict(workers=2, rounds=3, inner_steps=6, chunk_steps=CHUNK, inner_lr=LR, warmup_steps=2)


@pytest.mark.e2e  # IREE compiles in a process of its own
@pytest.mark.parametrize("model", ["tiny", MLP])
def test_iree_train_chunk_and_eval_loss_equal_xla(model, iree_cache):
    config = small_config(model=model, batch_size=8 if model == MLP else 4, **RUN)
    workload = build_workload(config, shards=2)
    graphs = _graphs(workload) if model == MLP else Shepherd(config, workload).library.export_main()
    shard = workload.shards[0]
    batches = sample_shard(
        "rows" if model == MLP else "windows",
        tuple(shard.values()) if model == MLP else shard,
        steps=CHUNK,
        batch_size=config.data.batch_size,
        seq_len=config.data.seq_len,
        seed=0,
        stream=(0, 1, 0),
    )
    xla = _run(select_backend("cpu", runtime="xla"), graphs, workload, batches)
    iree = _run(IreeBackend("cpu", cache_dir=iree_cache), graphs, workload, batches)
    for ours, theirs in zip(xla[0], iree[0], strict=True):
        np.testing.assert_allclose(theirs, ours, rtol=0, atol=PARAM_ATOL)
    for ours, theirs in zip(xla[1], iree[1], strict=True):
        np.testing.assert_allclose(theirs, ours, rtol=0, atol=STATE_ATOL)
    np.testing.assert_allclose(iree[2], xla[2], rtol=LOSS_RTOL)
    assert iree[3] == pytest.approx(xla[3], rel=LOSS_RTOL)
    moved = max(
        float(np.max(np.abs(p - workload.params[n])))
        for p, n in zip(xla[0], graphs.param_names, strict=True)
    )
    assert moved > 10 * PARAM_ATOL  # the chunk trained: equal numbers are not equal garbage
    cached = {path.read_bytes() for path in (iree_cache / "iree").glob("*.vmfb")}
    assert cached  # compiled modules went to the cache
    # the module a tool (iree-benchmark-module) gets is the one the worker ran, from the cache
    module = IreeBackend("cpu", cache_dir=iree_cache).compiled_module(
        "train_chunk", graphs.train_chunk
    )
    assert module in cached
    # a worker checks each round's parameters against the shapes its graph expects
    init = IreeBackend("cpu", cache_dir=iree_cache).load("init_opt_state", graphs.init_opt_state)
    shapes = {n: workload.params[n].shape for n in graphs.param_names}
    assert expected_shapes(init.call, graphs.param_names) == shapes


@pytest.mark.e2e
def test_a_graph_iree_cannot_compile_names_the_op(tmp_path):
    """eigh lowers to a LAPACK custom call on CPU: IREE has no lowering, and the error says so.
    A worker never gets that far: the custom call is not one of our exports', so `load`
    refuses the graph before IREE compiles it (backends/_vouch.py)."""
    exported = jax.export.export(
        jax.jit(lambda a: jax.numpy.linalg.eigh(a)[0]), platforms=("cpu",)
    )(jax.ShapeDtypeStruct((4, 4), np.float32))
    with pytest.raises(GraphError) as caught:
        compile_stablehlo(exported.mlir_module(), IREE_TARGETS["cpu"])
    assert str(caught.value) == (
        "op stablehlo.custom_call 'lapack_ssyevd_ffi' has no IREE lowering "
        "(export the graph without it)"
    )
    with pytest.raises(UntrustedGraph, match="holds a custom call to 'lapack_ssyevd_ffi'"):
        IreeBackend("cpu", cache_dir=tmp_path).load("eigh", exported.serialize())


@pytest.mark.e2e
def test_cpu_workers_run_unpinned_and_the_cache_names_the_host_cpu(tmp_path, monkeypatch):
    """Two properties of running on the CPU, checked on one small compiled graph.

    IREE pins a worker thread to each core by default, which left it at 0.2-0.5x
    XLA's speed on a loaded box: the backend's workers may run on every core this
    process may use. A module compiled for `host` is native code for this CPU, so
    the compile cache keys on the CPU: another CPU compiles anew, this one reads it.
    """
    exported = jax.export.export(jax.jit(lambda a, b: jax.numpy.tanh(a @ b)), platforms=("cpu",))(
        *[jax.ShapeDtypeStruct((256, 256), np.float32)] * 2
    )
    a = np.random.default_rng(0).normal(size=(256, 256)).astype(np.float32)
    backend = IreeBackend("cpu", cache_dir=tmp_path)
    graph = backend.load("tanh_matmul", exported.serialize())
    # float32 sums of 256 products in an order of the compiler's (it differs by CPU: two
    # hosts differ in the last bits): Higham's bound n·u·(|a| @ |a|), through tanh's slope
    exact = np.tanh(a.astype(np.float64) @ a.astype(np.float64))
    u = np.finfo(np.float32).eps / 2
    bound = 256 * u * (np.abs(a) @ np.abs(a)).astype(np.float64) * (1 - exact**2) + 4 * u
    assert np.all(np.abs(backend.to_host([graph.call(a, a)])[0] - exact) <= bound)
    if "--task_topology" not in os.environ.get("IREE_PY_RUNTIME_FLAGS", ""):
        workers = _iree_worker_threads()
        assert len(workers) == iree_backend.cpu_cores()
        assert all(os.sched_getaffinity(t) == os.sched_getaffinity(0) for t in workers)

    cached = lambda: sorted((tmp_path / "iree").glob("*.vmfb"))  # noqa: E731
    assert len(cached()) == 1
    backend.load("tanh_matmul", exported.serialize())
    assert len(cached()) == 1  # same CPU: read from the cache
    monkeypatch.setattr(iree_backend, "host_cpu", lambda: "vendor_id : another CPU")
    backend.load("tanh_matmul", exported.serialize())
    assert len(cached()) == 2


@pytest.mark.parametrize(
    ("files", "cpus"),
    [
        ({"cpu.max": "150000 100000\n"}, 2),  # cgroup v2, 1.5 CPUs: 2 workers
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),  # v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_a_cgroup_cpu_quota_caps_the_cpu_workers(tmp_path, files, cpus):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert iree_backend.cgroup_cpu_quota(tmp_path) == cpus


def _iree_worker_threads() -> list[int]:
    """Thread ids of IREE's task workers in this process (Linux names them iree-worker-N)."""
    tasks = Path("/proc/self/task")
    return [
        int(t.name) for t in tasks.iterdir() if (t / "comm").read_text().startswith("iree-worker")
    ]


@pytest.mark.e2e
async def test_an_xla_worker_and_an_iree_worker_train_one_run(iree_cache, spawn_worker):
    """Real processes: both workers' results are averaged each round and the loss falls.

    In the same run a peer that says it runs Vulkan through XLA is refused with
    unsupportedBackend naming what would work.
    """
    config = small_config(**RUN)
    shepherd = Shepherd(config, build_workload(config, shards=2))
    workers = {}
    refusal = []

    async with trio.open_nursery() as nursery:
        port = await nursery.start(shepherd.run)
        cache = ("--compile-cache", str(iree_cache))
        workers["xla"] = spawn_worker(port, "--runtime", "xla", "--id", "xla", "--quiet")
        workers["iree"] = spawn_worker(port, "--runtime", "iree", "--id", "iree", *cache)
        refusal.append(await _join_as(port, protocol.Platform.VULKAN, protocol.Runtime.XLA))
    for name, process in workers.items():
        assert process.wait(timeout=60) == 0, f"{name}: {process.stdout.read()}"
    history = shepherd.state.history
    assert [r.workers for r in history] == [2, 2, 2]
    assert history[-1].eval_loss < history[0].eval_loss
    views = shepherd.state.workers
    assert views["xla"].rounds_contributed == views["iree"].rounds_contributed == 3
    assert (views["xla"].backend, views["iree"].backend) == ("cpu", "cpu (iree llvm-cpu)")
    assert refusal == [
        protocol.Error(
            protocol.ErrorCode.UNSUPPORTED_BACKEND,
            "JAX has no Vulkan platform; join with --runtime iree --backend vulkan",
        )
    ]


async def _join_as(port: int, platform: protocol.Platform, runtime: protocol.Runtime):
    """A peer's handshake reporting `platform` and `runtime`; what the shepherd answers it."""
    stream = protocol.MessageStream(await trio.open_tcp_stream("127.0.0.1", port))
    hello = (await stream.receive()).body
    backend = protocol.BackendInfo(platform=platform, device_kind="GPU", runtime=runtime)
    await stream.send(
        protocol.WorkerHello(
            supported_versions=protocol.SUPPORTED_VERSIONS,
            worker_id="vulkan-through-xla",
            backend=backend,
            proof=auth.proof("test-token", hello.nonce, "vulkan-through-xla"),
        )
    )
    answer = (await stream.receive()).body
    await stream.aclose()
    return answer


@pytest.mark.parametrize(
    ("options", "without_iree", "says"),
    [
        (
            ("--backend", "vulkan", "--runtime", "xla"),
            False,
            "has no vulkan platform; run vulkan with --runtime iree",
        ),
        (
            ("--backend", "cpu", "--runtime", "iree"),
            True,
            "--runtime iree needs IREE's compiler and runtime: pip install 'pcp-tui[iree]'",
        ),
    ],
)
@pytest.mark.e2e
def test_a_worker_that_cannot_run_exits_saying_what_to_do(options, without_iree, says, tmp_path):
    env = worker_env()
    if without_iree:  # an `iree` package without the compiler and runtime shadows the real one
        (tmp_path / "iree").mkdir()
        (tmp_path / "iree" / "__init__.py").write_text("")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        worker_command(1, *options), capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 1
    assert says in result.stderr


@pytest.mark.e2e
def test_the_gpt2_step_compiles_for_metal(tmp_path):
    """No Mac here: compiling for metal-spirv is what shows a regression in CI.

    The layer norm's gradient once made IREE reject the step ("Failed to get an identity
    value for the reduction operation"); see gpt2._layer_norm.
    """
    config = small_config(chunk_steps=1)
    workload = build_workload(config, shards=1)
    graphs = build_graphs(
        workload.loss_fn,
        workload.params,
        workload.batch_spec,
        inner=InnerOptimizer(),
        chunk_steps=1,
        eval_batches=1,
        platforms=("cpu",),
    )
    text = jax.export.deserialize(bytearray(graphs.train_chunk)).mlir_module()
    module = compile_stablehlo(text, IREE_TARGETS["metal"])
    assert len(module) > 1000


def test_iree_workers_get_the_cpu_export_and_cudnn_runs_refuse_them():
    """Which export serves whom (no export runs: platforms_for only decides)."""
    P, R = protocol.Platform, protocol.Runtime
    library = GraphLibrary(lambda platforms, devices, rows: None, ("cpu", "cuda", "rocm"))
    library.main = dataclasses.replace(_NO_GRAPHS, platforms=library.main_platforms)
    assert library.platforms_for(P.CUDA, R.XLA) == ("cpu", "cuda", "rocm")
    assert library.platforms_for(P.METAL, R.XLA) == ("metal",)  # exported when one joins
    for platform in (P.VULKAN, P.METAL, P.CPU, P.CUDA):  # one portable export, no platform index
        assert library.platforms_for(platform, R.IREE) == ("cpu",)
    cudnn = GraphLibrary(
        lambda platforms, devices: None, ("cuda",), cuda_only="this run uses cuDNN"
    )
    with pytest.raises(Unservable, match="this run uses cuDNN, which IREE workers cannot run"):
        cudnn.platforms_for(P.VULKAN, R.IREE)
    with pytest.raises(Unservable, match="this run uses cuDNN; join with --backend cuda"):
        cudnn.platforms_for(P.ROCM, R.XLA)


EIGH_MODEL = """
import jax.numpy as jnp
import numpy as np
import pcp_tui


def init(key):
    return {"w": jnp.eye(4)}


def loss(params, batch):
    # eigvalsh lowers to a LAPACK custom call on the CPU, which no export of ours holds
    return jnp.mean(jnp.linalg.eigvalsh(params["w"] @ params["w"].T)) + jnp.mean(batch["x"] @ params["w"])


def build(config):
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    return pcp_tui.ModelSpec("eigh", init, loss, pcp_tui.Dataset(train={"x": x}, val={"x": x[:16]}))
"""


@pytest.mark.e2e
async def test_a_worker_whose_iree_cannot_compile_the_graphs_tells_the_shepherd_and_leaves(
    tmp_path, spawn_worker
):
    model = tmp_path / "eigh_model.py"
    model.write_text(EIGH_MODEL)
    config = small_config(model=f"{model}:build", batch_size=8, workers=1, rounds=1)
    shepherd = Shepherd(config, build_workload(config, shards=1))
    exits = []

    async with trio.open_nursery() as nursery:
        port = await nursery.start(shepherd.run)
        worker = spawn_worker(port, "--runtime", "iree", "--id", "eigh", "--quiet")
        exits.append(await trio.to_thread.run_sync(worker.wait, 60))  # reconnect is on
        exits.append(worker.stdout.read())
        shepherd.request_stop("the test is over")
        nursery.cancel_scope.cancel()
    returncode, output = exits
    op = "holds a custom call to 'lapack_ssyevd_ffi', which pcp-tui's exports for cpu never"
    assert returncode == 1 and op in output and "(not retrying)" in output
    reason = shepherd.state.workers["eigh"].reason
    assert reason.startswith("the worker reported unsupportedBackend: graph 'train_chunk'")
    assert op in reason


def test_arrays_read_back_through_staging_where_the_driver_refuses_numpy_memory():
    """Mesa's Vulkan drivers (llvmpipe here; RADV, ANV) refuse the numpy array IREE's
    `to_host` imports as its copy target (it is not page-aligned): the backend then reads
    through a staging buffer of IREE's own. The same path, on this machine's CPU device."""
    backend = IreeBackend("cpu")
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    (array,) = backend.to_device([values])

    class Refused:  # what IREE's DeviceArray does on such a driver
        _buffer_view, _device = array._buffer_view, array._device

        def to_host(self):
            raise ValueError(
                "could not import host allocation: INVALID_ARGUMENT; host allocation import "
                "pointer does not satisfy Vulkan minImportedHostPointerAlignment 4096"
            )

    np.testing.assert_array_equal(backend.to_host([Refused()])[0], values)
