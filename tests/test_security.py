"""Attacks on a live shepherd process over 127.0.0.1: who gets in, what it survives.

Real processes and sockets. The hostile peers are trio tasks in this test
process speaking raw TCP; the poisoning worker is pcp_tui.testing.faulty_worker.
"""

from __future__ import annotations

import math
import os
import secrets
import struct
import subprocess
from pathlib import Path

import pytest
import trio

from pcp_tui import protocol
from pcp_tui.app.plot import with_evals
from pcp_tui.contract import auth
from pcp_tui.contract.tls import normalize_fingerprint
from pcp_tui.testing import (
    faulty_worker_command,
    read_metrics,
    round_workers,
    self_signed_certificate,
)

from .conftest import worker_env

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- raw peers


def worker_hello(
    nonce: bytes,
    proof_token: str | None,
    *,
    worker_id: str = "raw-peer",
    version: int = protocol.PROTOCOL_VERSION,
) -> bytes:
    proof = auth.proof(proof_token, nonce, worker_id) if proof_token is not None else b""
    body = protocol.WorkerHello(supported_versions=(version,), worker_id=worker_id, proof=proof)
    return b"".join(bytes(b) for b in protocol.encode(body, version=version))


async def handshake_answer(port: int, hello_for) -> tuple[protocol.Message, bytes]:
    """Connect, read the shepherd's hello, send hello_for(nonce); return its answer and what we sent."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        messages = protocol.MessageStream(stream)
        hello = await messages.receive()
        sent = hello_for(hello.body.nonce)
        await stream.send_all(sent)
        return await messages.receive(), sent


async def test_only_a_worker_with_the_token_gets_in(shepherds, spawn_worker, tmp_path):
    shepherd = shepherds(
        "--workers", "1", "--rounds", "2", "--inner-steps", "2", "--metrics", str(tmp_path / "m")
    )

    answers = {}
    answers["wrong"], _ = await handshake_answer(shepherd.port, lambda n: worker_hello(n, "guess"))
    answers["none"], _ = await handshake_answer(shepherd.port, lambda n: worker_hello(n, None))
    # an honest handshake, captured on the wire, then replayed byte for byte on a new connection
    answers["right"], captured = await handshake_answer(
        shepherd.port, lambda n: worker_hello(n, "test-token")
    )
    answers["replay"], _ = await handshake_answer(shepherd.port, lambda n: captured)
    answers["v2"], _ = await handshake_answer(
        shepherd.port,
        lambda n: worker_hello(
            n,
            "test-token",
            worker_id="from-the-future",
            version=max(protocol.SUPPORTED_VERSIONS) + 1,
        ),
    )
    for attempt in ("wrong", "none", "replay"):
        assert answers[attempt].kind == "error" and answers[attempt].body.code == "authFailed", (
            attempt
        )
        assert "--token" in answers[attempt].body.message
    assert answers["right"].kind == "welcome"
    mismatch = answers["v2"].body
    assert mismatch.code == "versionMismatch"
    assert (
        f"speaks protocol version {protocol.PROTOCOL_VERSION}, this worker speaks version "
        f"{protocol.PROTOCOL_VERSION + 1}; upgrade pcp-tui on this shepherd" in mismatch.message
    )

    # a real worker process with the wrong token: refused for good, it exits saying why
    intruder = spawn_worker(shepherd.port, token="wrong")
    assert intruder.wait() != 0
    said = intruder.stdout.read()
    assert "wrong or missing join token" in said and "not retrying" in said, said

    honest = spawn_worker(shepherd.port, token="test-token")
    assert shepherd.finish() == 0, shepherd.output
    assert honest.wait() == 0
    refused = [row for row in read_metrics(tmp_path / "m") if row["event"] == "refused"]
    assert [row.get("code") for row in refused] == [
        "authFailed",
        "authFailed",
        "authFailed",
        "versionMismatch",
        "authFailed",  # the intruder process
    ]
    assert round_workers(tmp_path / "m") == [1, 1]


# --------------------------------------------------------------------------- flood


async def hostile_peer(port: int, kind: str, closed: list[str]) -> None:
    """One unauthenticated connection; records `kind` once the shepherd has hung up on it."""
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        closed.append(kind)  # refused at connect: the run may already be over
        return
    async with stream:
        try:
            if kind == "garbage":
                await stream.send_all(secrets.token_bytes(2048))
            elif kind == "huge":
                await stream.send_all(struct.pack("<II", 0, 2**31 - 1) + b"\0" * 512)
            elif kind == "trickle":
                for _ in range(10_000):
                    await stream.send_all(b"\0")
                    await trio.sleep(0.2)
            while await stream.receive_some(65536):  # "nothing": just wait to be dropped
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        closed.append(kind)


async def flood(port: int, connections: int) -> list[str]:
    closed: list[str] = []
    kinds = ("garbage", "huge", "nothing", "trickle")
    async with trio.open_nursery() as nursery:
        for index in range(connections):
            nursery.start_soon(hostile_peer, port, kinds[index % len(kinds)], closed)
            await trio.sleep(0)
    return closed


def test_a_flood_of_hostile_connections_neither_stops_training_nor_grows_memory(
    shepherds, spawn_worker, tmp_path
):
    shepherd = shepherds(
        "--workers",
        "2",
        "--rounds",
        "3",
        "--inner-steps",
        "5",
        "--handshake-timeout",
        "2",
        "--metrics",
        str(tmp_path / "m"),
    )
    rss_before = shepherd.rss_kib()
    closed = trio.run(flood, shepherd.port, 200)  # while the shepherd waits for its workers
    assert len(closed) == 200
    rss_after = shepherd.rss_kib()
    assert rss_after - rss_before < 64 * 1024, (rss_before, rss_after)

    workers = [spawn_worker(shepherd.port, token="test-token") for _ in range(2)]
    shepherd.wait_for(r"joined from", count=2)
    closed = trio.run(flood, shepherd.port, 200)  # while they compile and train
    assert len(closed) == 200

    assert shepherd.finish() == 0, shepherd.output
    for worker in workers:
        assert worker.wait() == 0
    assert round_workers(tmp_path / "m") == [2, 2, 2]
    rows = read_metrics(tmp_path / "m")
    shown = [row for row in rows if row["event"] == "refused" and "suppressed" not in row]
    summaries = [row for row in rows if row["event"] == "refused" and "suppressed" in row]
    assert 200 <= len(shown) + sum(row["suppressed"] for row in summaries) <= 400
    assert summaries and len(shown) <= 5 * 10  # rate-limited: 5 per address per minute
    assert "more in the last 60 s" in shepherd.output


# --------------------------------------------------------------------------- poisoned results


def test_a_worker_sending_nan_is_refused_and_the_model_stays_finite(
    shepherds, spawn_worker, tmp_path
):
    shepherd = shepherds(
        "--workers", "3", "--rounds", "2", "--inner-steps", "3", "--metrics", str(tmp_path / "m")
    )
    honest = [spawn_worker(shepherd.port, token="test-token") for _ in range(2)]
    evil = subprocess.Popen(
        faulty_worker_command(shepherd.port, "nan", "--quiet", token="test-token"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=worker_env(),
        cwd=REPO,
    )
    try:
        assert shepherd.finish() == 0, shepherd.output
        for worker in honest:
            assert worker.wait() == 0
    finally:
        if evil.poll() is None:
            evil.kill()
        evil.communicate(timeout=30)
    rows = read_metrics(tmp_path / "m")
    assert round_workers(tmp_path / "m") == [2, 2]
    bad = [row for row in rows if row["event"] == "bad_result"]
    assert len(bad) == 2 and all("NaN or Inf" in row["message"] for row in bad)
    assert all(math.isfinite(row["eval_loss"]) for row in with_evals(rows))


# --------------------------------------------------------------------------- TLS


@pytest.mark.skipif(
    not any(os.access(os.path.join(p, "openssl"), os.X_OK) for p in os.get_exec_path()),
    reason="needs the openssl command",
)
async def test_tls_run_and_workers_that_do_not_trust_the_shepherd(
    shepherds, spawn_worker, tmp_path
):
    cert, key = self_signed_certificate(tmp_path)
    other_cert, _ = self_signed_certificate(tmp_path, "other-")
    shepherd = shepherds(
        "--workers",
        "2",
        "--rounds",
        "2",
        "--inner-steps",
        "3",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        "--streams",  # each session over 2 TLS connections: the extra one passes TLS too
        "2",
        "--log-level",
        "info",
        "--metrics",
        str(tmp_path / "m"),
    )
    printed = shepherd.join_command.split("--tls-fingerprint ")[1].split()[0]
    openssl = subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-fingerprint", "-sha256"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert printed == normalize_fingerprint(openssl)

    wrong_pin = spawn_worker(shepherd.port, "--tls-fingerprint", "ab" * 32, token="test-token")
    wrong_ca = spawn_worker(shepherd.port, "--tls-ca", str(other_cert), token="test-token")
    for worker, reason in ((wrong_pin, "not the pinned"), (wrong_ca, "certificate is not trusted")):
        assert worker.wait() != 0
        output = worker.stdout.read()
        assert reason in output and "not retrying" in output, output

    stream = await trio.open_tcp_stream("127.0.0.1", shepherd.port)
    async with stream:
        await stream.send_all(
            worker_hello(b"", "test-token")
        )  # Cap'n Proto where a TLS ClientHello belongs
        while await stream.receive_some(4096):
            pass
    pinned = spawn_worker(shepherd.port, "--tls-fingerprint", printed, token="test-token")
    with_ca = spawn_worker(shepherd.port, "--tls-ca", str(cert), token="test-token")
    assert shepherd.finish() == 0, shepherd.output
    assert pinned.wait() == 0 and with_ca.wait() == 0
    assert round_workers(tmp_path / "m") == [2, 2]
    assert "TLS handshake failed" in shepherd.output
    assert shepherd.output.count("session striped over 2 connections") == 2, shepherd.output


def test_a_new_token_never_reads_as_a_flag_after_token():
    """Pasted as `--token TOKEN`, one in 64 random tokens began with "-" and argparse took it
    for a flag; the join command the shepherd printed then failed."""
    tokens = {auth.new_token() for _ in range(2000)}
    assert len(tokens) == 2000 and all(len(t) == 24 for t in tokens)
    assert not any(t.startswith("-") for t in tokens)
    assert any("-" in t[1:] for t in tokens)  # the alphabet is still URL-safe base64's
