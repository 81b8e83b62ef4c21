"""A site (`pcp_tui/worker/site.py`): 2 real processes x 2 forced CPU devices, multi-controller JAX.

What a site stands on, on this JAX: its processes join, get process 0's
messages (`Site.send`, `Site.receive`), compute over the global mesh of all 4
devices (the worker's own backend and exported train_chunk, data and fsdp), and
one process dying ends the other (no hang in the collective it waits in). Then
the CLI's site: `pcp-tui worker --num-processes 2` trains a run as one worker of
4 devices would, and ends as one when a process dies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from pcp_tui.testing import (
    OutputProcess,
    free_port,
    shepherd_command,
    worker_command,
    worker_env,
)

pytestmark = pytest.mark.e2e

PROCESS = """
import json, os, socket, sys, time
from pcp_tui.worker import site as sites
port, process_id, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if mode == "late":  # the site's processes wait 3 s for each other at the end, not 30
    sites.END_WAIT_SECONDS = 3
if mode == "stranger":  # process 1 first knocks on process 0's message port without the secret
    honest = sites._reach_process_0
    def knock_then_join(site, host):
        message_port = int(site._client.blocking_key_value_get(sites.CHANNEL, 60_000).split()[0])
        with socket.create_connection((host, message_port)) as stranger:
            stranger.sendall(bytes(sites.SECRET_BYTES) + (1).to_bytes(2, "big"))
            assert stranger.recv(1) == b"", "process 0 must hang up on a wrong secret"
        honest(site, host)
    sites._reach_process_0 = knock_then_join
site = sites.join_site(f"127.0.0.1:{port}", 2, process_id, heartbeat_seconds=5)
if mode == "late":  # process 1 does not come to the end in time (stuck in a collective)
    if site.leads:
        site.end(7, "the shepherd refused this worker")
        os._exit(7)  # as the launcher exits (`_run_site_process`)
    time.sleep(20)
    os._exit(0)
if mode == "end":  # process 0 ends the site and exits at once; process 1 is slow to exit
    if site.leads:
        site.end(0, "the run is over")
        os._exit(0)
    end = site.receive()
    site.leave()
    time.sleep(3)  # process 0 and its coordination service are gone by now
    print(json.dumps({"end": [end.code, end.reason]}), flush=True)
    os._exit(0)
import jax, numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
if site.leads:
    site.send(b"plan bytes from process 0")
shared = b"plan bytes from process 0" if site.leads else site.receive()
if mode == "die" and process_id == 1:
    os._exit(3)  # a host gone: no goodbye
mesh = Mesh(np.array(jax.devices()), ("devices",))
rows = np.arange(8, dtype=np.float32).reshape(4, 2)  # every process has the whole batch
batch = jax.make_array_from_callback((4, 2), NamedSharding(mesh, PartitionSpec("devices")),
                                     lambda index: rows[index])
total = jax.jit(lambda x: x.sum(axis=0), out_shardings=NamedSharding(mesh, PartitionSpec()))(batch)
multihost_utils.broadcast_one_to_all(np.ones(1))  # process 1 may be gone: this must not hang
print(json.dumps({"cache": jax.config.jax_enable_compilation_cache,
                  "devices": jax.device_count(), "local": jax.local_device_count(),
                  "hosts": site.hostnames, "shared": shared.decode(),
                  "total": np.asarray(total.addressable_data(0)).tolist()}), flush=True)
"""


def _site_env(devices: int) -> dict[str, str]:
    """A worker process's environment with `devices` forced CPU devices, one XLA thread each."""
    env = worker_env()
    env["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={devices} "
        "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    )
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _site(mode: str) -> list[tuple[int, str, str]]:
    """Run the site's 2 processes; each one's (exit code, stdout, stderr)."""
    env = _site_env(2)
    port = free_port()
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", PROCESS, str(port), str(i), mode],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    ended = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=300)  # a hang guard, not a measurement
            ended.append((process.returncode, out, err))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    return ended


@pytest.mark.parametrize("mode", ["live", "stranger"])
def test_two_processes_are_one_site_over_four_devices(mode):
    """`stranger`: a connection to process 0's message port without the site's secret is
    hung up on, and the site forms all the same. Joined, a process keeps no persistent
    compile cache, though the test run's $JAX_COMPILATION_CACHE_DIR names one: only process 0
    would load cached executables, and a cached fsdp train_chunk against the followers' fresh
    ones made Gloo abort the site at its first chunk (the module docstring of site.py)."""
    outputs, warned = [], []
    for code, out, err in _site(mode):
        assert code == 0, err[-3000:]
        outputs.append(json.loads(out.strip().splitlines()[-1]))
        warned.append("trusted LAN" in err)
    assert warned == [True, False]  # process 0 serves the coordination service and says so
    for seen in outputs:
        assert seen["cache"] is False
        assert (seen["devices"], seen["local"]) == (4, 2)
        assert seen["shared"] == "plan bytes from process 0"
        assert seen["total"] == [12.0, 16.0]  # 0+2+4+6, 1+3+5+7: every device's rows
        assert seen["hosts"] == outputs[0]["hosts"] and len(seen["hosts"]) == 2


def test_one_process_dying_ends_the_other():
    """Process 1 exits without a word; process 0, waiting for it in a collective, is ended
    by the coordination service after the 5 s heartbeat timeout (an abort), not left hanging."""
    (survivor, out, err), (dead, _, _) = _site("die")
    assert dead == 3
    assert survivor == -signal.SIGABRT and '"total"' not in out  # never past the collective
    assert "heartbeat" in err or "unhealthy" in err or "Terminating process" in err, err[-3000:]


def test_a_follower_outlives_process_0_at_the_end():
    """Process 0 ends the site and exits at once, taking the coordination service with it;
    process 1 exits 3 s later. Having left the site first (JAX's shutdown, whose barrier
    process 0 waits at), it is not aborted by its client for the service's loss."""
    (leader, _, _), (follower, out, err) = _site("end")
    assert (leader, follower) == (0, 0), err[-3000:]
    assert json.loads(out.strip().splitlines()[-1]) == {"end": [0, "the run is over"]}


def test_process_0_exits_with_its_code_when_a_follower_does_not_come_to_the_end():
    """Process 0 ends the site with exit code 7; process 1, stuck (in a collective with a
    process that is gone, say), is not there within the end's wait. Process 0 leaves
    without JAX's shutdown, whose barrier would fail and abort it (SIGABRT, not 7)."""
    (leader, _, err), _ = _site("late")
    assert leader == 7, err[-3000:]


CHUNKS = """
import json, runpy, sys
port, process_id, processes, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if processes > 1:
    from pcp_tui.worker.site import join_site
    join_site(f"127.0.0.1:{port}", processes, process_id, heartbeat_seconds=10)
mesh = runpy.run_path(sys.argv[5])  # tests/test_mesh.py: a worker's chunks on N devices
config, workload = mesh["_tiny_gpt2"]()
run = mesh["_chunks_on"](4, mode, config, workload)
print(json.dumps({"losses": run["losses"], "pseudo_gradient": [p.ravel()[:64].tolist()
                  for p in run["pseudo_gradient"]]}), flush=True)
"""


def _chunks(processes: int, mode: str) -> list[dict]:
    """Two train_chunk calls of the worker's backend over 4 devices: one process with 4, or
    a site of 2 processes with 2 each; what each process saw. The one process of 4 devices
    compiles what tests/test_mesh.py's 4-device runs compile, with their XLA flags: one
    compile in the test run's cache serves both."""
    env = _site_env(4 // processes)
    port, mesh = free_port(), os.path.join(os.path.dirname(__file__), "test_mesh.py")
    started = [
        subprocess.Popen(
            [sys.executable, "-c", CHUNKS, str(port), str(i), str(processes), mode, mesh],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    seen = []
    try:
        for process in started:
            out, err = process.communicate(timeout=600)  # a hang guard
            assert process.returncode == 0, err[-3000:]
            seen.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
    return seen


@pytest.mark.parametrize("mode", ["data", "fsdp"])
def test_a_site_of_2_processes_trains_as_one_process_of_4_devices(mode):
    """Not bit-equal, as tight as float32 allows: the site's all-reduce (Gloo, across the
    processes) adds the devices' gradients in another order than one process's. Measured:
    losses within 1 float32 ulp on one host and 2 on an AVX-512 AMD EPYC (the reduction
    order differs by CPU); pseudo-gradients (the first
    64 values of each tensor) within 1.04e-6 (data) and 8.6e-7 (fsdp) relative L2: θ0 - θ
    keeps the last bits of θ (~2e-9 at 0.02) against values of ~5e-3."""
    [one] = _chunks(1, mode)
    first, second = _chunks(2, mode)
    assert first == second  # the processes of a site hold the same values
    for alone, in_site in zip(one["losses"], first["losses"], strict=True):
        assert abs(alone - in_site) <= 4 * np.spacing(np.float32(alone))
    alone, in_site = (np.concatenate(run["pseudo_gradient"]) for run in (one, first))
    apart = np.linalg.norm(in_site - alone) / np.linalg.norm(alone)
    assert apart <= 2e-6, apart


# ----------------------------------------------------------------------------- the CLI's site


def _site_processes(port: int, *extra: str) -> list[OutputProcess]:
    """`pcp-tui worker` as the 2 processes of one site of 2 forced CPU devices each."""
    coordinator = f"127.0.0.1:{free_port()}"
    return [
        OutputProcess(
            worker_command(
                port,
                "--coordinator-address",
                coordinator,
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--quiet",
                *extra,
            ),
            env=_site_env(2),
        )  # fmt: skip
        for i in range(2)
    ]


def _rows(metrics) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_a_site_of_2_processes_is_one_worker_that_trains_as_4_devices_of_one(tmp_path):
    """The same run, 2 rounds of 4 steps, once with one worker of 4 devices and once with a
    site of 2 processes x 2 devices (at the same time, on their own shepherds): the site is one
    worker of 4 devices on 2 processes, and its per-round losses are the single worker's to
    float32's last bits: the site's all-reduce adds the devices' gradients across processes
    (Gloo) in another order than one process does, so a step's loss may differ by an ulp (as
    `test_a_site_of_2_processes_trains_as_one_process_of_4_devices` measures), and round 2
    starts from an outer step over such pseudo-gradients."""
    runs = {}
    for name in ("one", "site"):
        port, metrics = free_port(), tmp_path / f"{name}.jsonl"
        shepherd = OutputProcess(
            shepherd_command(
                port, "--workers", "1", "--rounds", "2", "--inner-steps", "4", "--chunk-steps",
                "4", "--warmup-steps", "2", "--metrics", str(metrics),
            )
        )  # fmt: skip
        if name == "one":
            workers = [OutputProcess(worker_command(port, "--quiet"), env=_site_env(4))]
        else:
            workers = _site_processes(port)
        runs[name] = (shepherd, workers, metrics)
    try:
        for shepherd, workers, _ in runs.values():
            for worker in workers:  # first: the shepherd would wait for a failed one for ever
                assert worker.finish() == 0, worker.output
            assert shepherd.finish() == 0, shepherd.output
    finally:
        for shepherd, workers, _ in runs.values():
            for process in (shepherd, *workers):
                process.kill()
    leader, follower = runs["site"][1]
    for quiet in (leader, follower):  # --quiet: errors only
        assert "pcp-tui:" not in quiet.output, quiet.output
    losses = {}
    for name, (_, _, metrics) in runs.items():
        rows = _rows(metrics)
        [joined] = [row for row in rows if row["event"] == "joined"]
        assert joined["devices"] == 4 and joined["processes"] == (2 if name == "site" else 1)
        assert ("cpu x4 in 2 processes" in joined["message"]) == (name == "site")  # one host
        losses[name] = [row["train_loss"] for row in rows if row["event"] == "round"]
    assert len(losses["site"]) == 2
    np.testing.assert_allclose(losses["site"], losses["one"], rtol=2.4e-7, atol=0)


@pytest.mark.parametrize("dies", [1, 0])
def test_a_site_ends_as_one_when_a_process_dies(tmp_path, dies):
    """A process of the site killed mid-run: the other ends with a line that says the site
    lost it, and the shepherd sees its one worker go (the run waits for workers, as for any).

    The survivor hears it one of a few ways, by where it is: in a collective with the dead
    one (most of a round), Gloo fails it at once; a follower waiting for process 0's next
    message, or process 0 sending the next one, finds their connection closed; anywhere
    else, JAX's coordination service ends it once the dead one misses its heartbeats (10 s),
    or its agent once it cannot reach process 0's service."""
    port, metrics = free_port(), tmp_path / "run.jsonl"
    shepherd = OutputProcess(
        shepherd_command(
            port, "--workers", "1", "--rounds", "1000", "--inner-steps", "4", "--chunk-steps",
            "4", "--metrics", str(metrics),
        )
    )  # fmt: skip
    site = _site_processes(port)
    survivor, dead = site[1 - dies], site[dies]
    try:
        # a site that ends before its first round fails here with its output (the shepherd,
        # which waits for workers as for any, would print no round line and the test hang)
        first = shepherd.wait_for(r"round\s+1/|worker 0 (left|lost)")
        before_stacks = (p.output.split("Fatal Python error")[0][-3000:] for p in site)
        assert first[0].startswith("round"), "\n".join(before_stacks)
        dead.process.kill()
        assert survivor.finish() not in (0, None)
        assert any(
            line in survivor.output
            for line in (
                "another process of the site is gone",  # a collective failed
                f"the site's process {dies} (",  # their message connection closed
                "stopped sending heartbeats",  # JAX's coordination service
                "the leader task was preempted/died",  # JAX's agent, without process 0
            )
        ), survivor.output
        shepherd.wait_for(r"worker 0 (left|lost)")
    finally:
        for process in (shepherd, *site):
            process.kill()
    events = [row["event"] for row in _rows(metrics)]
    assert events.count("joined") == 1 and {"left", "lost"} & set(events)
