"""The operator API on a live shepherd process: tokens, bodies, Prometheus, hostile clients, cancel.

Real processes and sockets on 127.0.0.1: a `pcp-tui shepherd` with `--api-port`,
real `pcp-tui worker` processes, httpx against hypercorn, raw sockets for the
malformed requests, and prometheus_client's own parser for /metrics.
"""

from __future__ import annotations

import errno
import shutil
import socket
import ssl
import subprocess
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pcp_tui.testing import (
    QUICK_FLAGS,
    ShepherdProcess,
    WorkerProcesses,
    free_port,
    self_signed_certificate,
    shepherd_command,
    worker_env,
)

pytestmark = pytest.mark.e2e

TOKEN = "api-secret-for-tests"


@pytest.fixture
def run_with_api():
    """Start shepherds with the API on a free port and PCP_API_TOKEN set; killed at the end."""
    started: list[ShepherdProcess] = []

    def start(*flags: str) -> tuple[ShepherdProcess, httpx.Client]:
        port = free_port()
        shepherd = ShepherdProcess(
            "--api-port", str(port), *flags, env={**worker_env(), "PCP_API_TOKEN": TOKEN}
        )  # returns once it listens
        started.append(shepherd)
        shepherd.wait_for(
            rf"listening on 127\.0\.0\.1:\d+, operator API on http://127\.0\.0\.1:{port};"
        )
        return shepherd, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=None)

    yield start
    for shepherd in started:
        shepherd.kill()


def _authorized(client: httpx.Client, path: str) -> httpx.Response:
    return client.get(path, headers={"Authorization": f"Bearer {TOKEN}"})


def _until(probe, what: str):
    """Poll `probe()` until it returns something truthy (`what` it waits for, for the reader)."""
    while not (value := probe()):
        time.sleep(0.1)
    return value


# --------------------------------------------------------------------------- tokens and bodies


def test_the_api_will_not_start_without_a_token():
    env = {k: v for k, v in worker_env().items() if k != "OPS_TOKEN"}
    result = subprocess.run(
        shepherd_command(0, "--api-port", str(free_port()), "--api-token-env", "OPS_TOKEN"),
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1 and "set the environment variable OPS_TOKEN" in errors[0]


def test_a_busy_api_port_fails_the_run_with_one_line():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run(
            shepherd_command(0, "--api-port", str(port)),
            env={**worker_env(), "PCP_API_TOKEN": TOKEN},
            capture_output=True,
            text=True,
        )
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"cannot serve the operator API on 127.0.0.1:{port}" in result.stderr
    assert "pick another --api-port" in result.stderr


def test_endpoints_need_the_token_and_show_the_run_and_its_workers(run_with_api):
    shepherd, client = run_with_api("--workers", "2", "--rounds", "2", *QUICK_FLAGS)
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json()["ready"] is True
    assert client.head("/healthz").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        answer = client.get("/v1/job", headers=headers)
        assert answer.status_code == 401 and answer.headers["www-authenticate"].startswith("Bearer")
    assert client.get("/metrics").status_code == 401
    assert client.post("/v1/job/cancel").status_code == 401
    job = _authorized(client, "/v1/job").json()
    assert (job["status"], job["rounds_total"], job["rounds_done"]) == ("waiting", 2, 0)
    assert job["utilization"] is None and job["bytes_data_parallel"] is None  # no round yet
    controller = _authorized(client, "/v1/controller").json()
    assert controller["address"] == f"127.0.0.1:{shepherd.port}"
    assert _authorized(client, "/v1/nothing-here").status_code == 404
    wrong_method = client.get("/v1/job/cancel", headers={"Authorization": f"Bearer {TOKEN}"})
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"

    with WorkerProcesses() as workers:
        workers.spawn(shepherd.port, "--id", "w0")
        listed = _until(
            lambda: [
                w
                for w in _authorized(client, "/v1/workers").json()["workers"]
                if w["state"] == "idle" and w["memory_in_use_bytes"]
            ],
            "worker w0 compiled, idle and its statistics in /v1/workers",
        )
        assert [(w["id"], w["index"], w["host"]) for w in listed] == [
            ("w0", 0, socket.gethostname())
        ]
        assert listed[0]["backend"] and listed[0]["bytes_out"] > 0
        assert listed[0]["utilization"] is None  # it has contributed to no round yet
        stats = listed[0]
        assert (stats["runtime"], stats["devices"], stats["shard"]) == ("xla", 1, 0)
        assert (stats["processes"], stats["hosts"]) == (1, [socket.gethostname()])  # not a site
        assert stats["compile_seconds"] > 0 and stats["steps_trained"] == 0
        # a CPU worker's "device" memory is its resident memory: more than its Python alone
        assert 0 < stats["memory_in_use_bytes"] <= stats["memory_peak_bytes"]
        assert stats["memory_limit_bytes"] > stats["memory_peak_bytes"]
        assert stats["gpu_utilization"] is None  # not measured on CPU, never a made-up 0
        _check_prometheus(_authorized(client, "/metrics"))
        workers.spawn(shepherd.port, "--id", "w1")
        assert shepherd.finish() == 0, shepherd.output
    assert "run done after 2 rounds" in shepherd.output


def _check_prometheus(answer: httpx.Response) -> None:
    """/metrics parses with prometheus_client's own parser and holds run and per-worker families."""
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(answer.text)}
    run_families = {"pcp_round", "pcp_rounds_planned", "pcp_rounds_completed", "pcp_tokens"}
    assert run_families | {"pcp_bytes_sent", "pcp_bytes_received"} <= set(families)
    assert families["pcp_bytes_sent"].type == "counter"
    assert families["pcp_rounds_planned"].samples[0].value == 2
    status = {s.labels["status"]: s.value for s in families["pcp_run_status"].samples}
    assert status["waiting"] == 1 and sum(status.values()) == 1
    info = families["pcp_worker_info"].samples
    assert [(s.labels["worker"], s.labels["state"]) for s in info] == [("w0", "idle")]
    for name in ("pcp_worker_step", "pcp_worker_bytes_out", "pcp_worker_seconds_since_heard"):
        assert [s.labels for s in families[name].samples] == [{"worker": "w0"}], name
    assert families["pcp_worker_bytes_out"].samples[0].value > 0
    assert info[0].labels["runtime"] == "xla"
    assert [s.value for s in families["pcp_worker_shard"].samples] == [0]
    assert [s.value for s in families["pcp_worker_processes"].samples] == [1]
    assert families["pcp_worker_memory_bytes"].samples[0].value > 0
    assert families["pcp_worker_steps_trained"].type == "counter"
    assert families["pcp_worker_gpu_utilization"].samples == []  # not measured, not zero
    assert "pcp_utilization" not in families  # no made-up zero before round 1
    assert families["pcp_worker_utilization"].samples == []


# --------------------------------------------------------------------------- hostile clients


def _raw_exchange(port: int, request: bytes) -> bytes:
    """Send `request` on a fresh connection and return what came back before the server closed.

    Sending may fail half way (the server answers and closes while a huge
    request is still going out, and its answer may then be lost to the reset):
    that is the server's right. Not returning at all is the failure.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=None) as raw:
        try:
            raw.sendall(request)
            raw.shutdown(socket.SHUT_WR)  # the request ends here, complete or not
        except OSError as error:  # the server closed first: a pipe, a reset, or nothing to shut
            if error.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                raise
        chunks = []
        try:
            while chunk := raw.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    return b"".join(chunks)


def test_malformed_requests_end_their_connection_not_the_run(run_with_api):
    shepherd, client = run_with_api("--workers", "1", "--rounds", "2", *QUICK_FLAGS)
    port = client.base_url.port
    garbage = _raw_exchange(port, b"\x00\xff\x13\x37 not http at all\r\n\r\n" * 4)
    assert garbage.startswith(b"HTTP/1.1 400 ")
    huge = b"GET /v1/job HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (4 * 2**20) + b"\r\n\r\n"
    answer = _raw_exchange(port, huge)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:200]  # headers too large
    half = _raw_exchange(port, b"GET /v1/job HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n")
    assert half.startswith(b"HTTP/1.1 400 ")  # the request ended mid-headers
    assert client.get("/healthz").status_code == 200
    assert _authorized(client, "/v1/job").status_code == 200

    with WorkerProcesses() as workers:
        workers.spawn(shepherd.port, "--id", "w0")
        assert shepherd.finish() == 0, shepherd.output
    assert "run done after 2 rounds" in shepherd.output


# --------------------------------------------------------------------------- cancel


def test_cancel_ends_the_run_for_good_after_the_current_round(run_with_api, tmp_path):
    """With checkpoints on, a cancel is still final: the goodbye is not resumable, so the
    worker exits at once instead of waiting --give-up-after for a --resume (issue 27)."""
    shepherd, client = run_with_api(
        *("--workers", "1", "--rounds", "500", "--checkpoint-dir", str(tmp_path / "ck")),
        *QUICK_FLAGS,
    )
    with WorkerProcesses() as workers:
        worker = workers.spawn(shepherd.port, "--id", "w0")
        _until(lambda: _authorized(client, "/v1/job").json()["rounds_done"] >= 1, "round 1 done")
        answer = client.post("/v1/job/cancel", headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 202 and answer.json()["status"] == "stopping"
        assert shepherd.finish() == 0, shepherd.output
        assert worker.wait() == 0  # told goodbye for good, not cut off
        assert "the run can be resumed" not in worker.stdout.read()
    assert "operator API: cancel from 127.0.0.1; ending the run for good" in shepherd.output
    assert "the run can be resumed" not in shepherd.output
    stopped = shepherd.wait_for(r"run cancelled after (\d+) rounds")
    assert 1 <= int(stopped.group(1)) < 500


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_with_a_tls_certificate_the_api_speaks_only_https(tmp_path):
    cert, key = self_signed_certificate(tmp_path)
    port = free_port()
    shepherd = ShepherdProcess(
        *("--api-port", str(port), "--tls-cert", str(cert), "--tls-key", str(key)),
        env={**worker_env(), "PCP_API_TOKEN": TOKEN},
    )
    try:
        shepherd.wait_for(rf"operator API on https://127\.0\.0\.1:{port};")
        trusted = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=trusted) as client:
            assert client.get("/healthz").status_code == 200
            assert _authorized(client, "/v1/job").json()["status"] == "waiting"
            with pytest.raises(httpx.TransportError):
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=None)
            cancel = client.post("/v1/job/cancel", headers={"Authorization": f"Bearer {TOKEN}"})
            assert cancel.status_code == 202
        assert shepherd.finish() == 0, shepherd.output
    finally:
        shepherd.kill()


# --------------------------------------------------------------------------- inside the dashboard


def test_the_api_serves_from_the_dashboards_guest_run_and_its_cancel_stops_it(monkeypatch):
    """Under the dashboard the shepherd runs as a trio guest on Textual's asyncio loop; the API
    (hypercorn on trio) serves from there too, and its cancel is the dashboard's q."""
    from pcp_tui.app.dashboard import DashboardApp
    from pcp_tui.shepherd.coordinator import Shepherd
    from pcp_tui.testing import small_config
    from pcp_tui.testing.dashboard import run_async, wait_until
    from pcp_tui.training.build import build_workload

    monkeypatch.setenv("PCP_API_TOKEN", TOKEN)
    port = free_port()
    config = small_config(rounds=3, workers=1, api_port=port)
    shepherd = Shepherd(config, build_workload(config, shards=1))
    headers = {"Authorization": f"Bearer {TOKEN}"}

    @run_async
    async def scenario() -> None:
        app = DashboardApp(shepherd.state, shepherd)
        async with (
            app.run_test(size=(100, 30)) as pilot,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers) as client,
        ):
            await wait_until(pilot, lambda: shepherd.state.status == "waiting")
            assert (await client.get("/v1/job")).json()["status"] == "waiting"
            assert (await client.post("/v1/job/cancel")).status_code == 202
            await wait_until(pilot, lambda: shepherd.state.status == "cancelled")
            await pilot.press("q")
            await wait_until(pilot, lambda: not app.is_running)

    scenario()
    assert shepherd.state.status == "cancelled" and not shepherd.state.history
