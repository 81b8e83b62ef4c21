"""A site (`pcp_tui/worker/site.py`): 2 real processes x 2 forced CPU devices, multi-controller JAX.

What a site stands on, on this JAX: its processes join, share process 0's
bytes, compute over the global mesh of all 4 devices, and one process dying
ends the other (no hang in the collective it waits in).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from pcp_tui.testing import free_port

pytestmark = pytest.mark.e2e

PROCESS = """
import json, os, sys
from pcp_tui.worker.site import join_site
port, process_id, die = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "die"
site = join_site(f"127.0.0.1:{port}", 2, process_id, heartbeat_seconds=5)
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
shared = site.share(b"plan bytes from process 0" if site.leads else None)
if die and process_id == 1:
    os._exit(3)  # a host gone: no goodbye
mesh = Mesh(np.array(jax.devices()), ("devices",))
rows = np.arange(8, dtype=np.float32).reshape(4, 2)  # every process has the whole batch
batch = jax.make_array_from_callback((4, 2), NamedSharding(mesh, PartitionSpec("devices")),
                                     lambda index: rows[index])
total = jax.jit(lambda x: x.sum(axis=0), out_shardings=NamedSharding(mesh, PartitionSpec()))(batch)
site.share(None if process_id else b"x")  # process 1 may be gone: this must not hang
print(json.dumps({"devices": jax.device_count(), "local": jax.local_device_count(),
                  "hosts": site.hostnames, "shared": shared.decode(),
                  "total": np.asarray(total.addressable_data(0)).tolist()}), flush=True)
"""


def _site(mode: str) -> list[tuple[int, str, str]]:
    """Run the site's 2 processes; each one's (exit code, stdout, stderr)."""
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
    )
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


def test_two_processes_are_one_site_over_four_devices():
    outputs = []
    for code, out, err in _site("live"):
        assert code == 0, err[-3000:]
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    for seen in outputs:
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
