"""The shepherd's front door in isolation: memory streams and a virtual clock."""

from __future__ import annotations

import shutil
import struct
import subprocess

import numpy as np
import pytest
import trio
import trio.testing

from pcp_tui import protocol
from pcp_tui.contract import auth
from pcp_tui.contract.tls import ClientTLS, ServerTLS, TLSRefused
from pcp_tui.shepherd.run.state import RunState
from pcp_tui.shepherd.serving.admission import PRE_AUTH_LIMITS, TLS_ONLY, Admission, RefusalLog

TOKEN = "unit-token"


def new_state() -> RunState:
    return RunState(run_id="r", rounds_total=1, settings={})


def refusals(state: RunState) -> list[str]:
    return [event.message for event in state.events if event.kind == "refused"]


def hello_bytes(
    nonce: bytes,
    *,
    token: str | None = TOKEN,
    worker_id: str = "w1",
    version: int = protocol.PROTOCOL_VERSION,
    tensors=None,
) -> bytes:
    proof = auth.proof(token, nonce, worker_id) if token is not None else b""
    body = protocol.WorkerHello(supported_versions=(version,), worker_id=worker_id, proof=proof)
    return b"".join(bytes(b) for b in protocol.encode(body, tensors, version=version))


async def run_admission(admission: Admission, client):
    """Run one admit() against `client(stream)`; returns (admitted, whatever client returned)."""
    server_side, client_side = trio.testing.memory_stream_pair()
    results = {}

    async def serve():
        results["admitted"] = await admission.admit(server_side)

    async def talk():
        results["client"] = await client(client_side)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        nursery.start_soon(talk)
    return results["admitted"], results.get("client")


async def read_hello(stream) -> protocol.Message:
    return await protocol.MessageStream(stream).receive()


async def until_closed(stream) -> bytes:
    """Everything the shepherd sends until it hangs up."""
    received = b""
    while True:
        try:
            chunk = await stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return received
        if not chunk:
            return received
        received += chunk


async def test_right_token_is_admitted_and_limits_open_up():
    admission = Admission(new_state(), token=TOKEN, run_id="r")

    async def client(stream):
        hello = await read_hello(stream)
        await stream.send_all(hello_bytes(hello.body.nonce))

    admitted, _ = await run_admission(admission, client)
    assert admitted is not None and admitted.hello.worker_id == "w1"
    assert admitted.stream.limits == protocol.Limits()  # pre-auth limits only last the handshake
    assert admission.pending == 0


async def test_replayed_hello_is_refused_and_no_token_too():
    state = new_state()
    admission = Admission(state, token=TOKEN, run_id="r")
    captured = {}

    async def honest(stream):
        hello = await read_hello(stream)
        captured["bytes"] = hello_bytes(hello.body.nonce)
        await stream.send_all(captured["bytes"])

    assert (await run_admission(admission, honest))[0] is not None

    async def replay(stream):
        messages = protocol.MessageStream(stream)
        await messages.receive()  # a fresh nonce the captured proof does not answer
        await stream.send_all(captured["bytes"])
        return await messages.receive()

    admitted, answer = await run_admission(admission, replay)
    assert admitted is None and answer.body.code == "authFailed"

    async def no_token(stream):
        messages = protocol.MessageStream(stream)
        await messages.receive()
        await stream.send_all(hello_bytes(b"", token=None))
        return await messages.receive()

    admitted, answer = await run_admission(admission, no_token)
    assert admitted is None and answer.body.code == "authFailed"
    assert all("wrong or missing join token" in text for text in refusals(state))


@pytest.mark.parametrize(
    "payload",
    [
        struct.pack("<II", 0, 2**31),  # one segment of 16 GiB
        struct.pack("<I", 2**31),  # two billion segments
        b"\x00" * 4
        + struct.pack("<I", 9000)
        + b"\x00" * 72_000,  # 72 KB: fine after auth, not before
    ],
)
async def test_big_frames_are_refused_before_anything_is_allocated(payload):
    state = new_state()
    admission = Admission(state, token=TOKEN, run_id="r")

    async def client(stream):
        await read_hello(stream)
        await stream.send_all(payload)
        return await until_closed(stream)

    admitted, answer = await run_admission(admission, client)
    assert admitted is None
    assert protocol.decode(answer).body.code == "tooLarge"
    assert "dropped" in refusals(state)[0]


async def test_a_hello_with_tensors_is_refused():
    admission = Admission(new_state(), token=TOKEN, run_id="r")

    async def client(stream):
        hello = await read_hello(stream)
        await stream.send_all(hello_bytes(hello.body.nonce, tensors={"x": np.zeros(4, np.float32)}))
        return await until_closed(stream)

    admitted, answer = await run_admission(admission, client)
    assert admitted is None and protocol.decode(answer).body.code == "tooLarge"
    assert PRE_AUTH_LIMITS.max_tensors == 0


@pytest.mark.parametrize("trickle", [False, True])
async def test_silent_and_trickling_peers_are_dropped_at_the_deadline(autojump_clock, trickle):
    state = new_state()
    admission = Admission(state, token=TOKEN, run_id="r", timeout=10)

    async def client(stream):
        await read_hello(stream)
        if trickle:  # a plausible frame header, one byte per second, forever
            for byte in b"\x00\x00\x00\x00\x10\x00\x00\x00" + b"\x00" * 10**6:
                try:
                    await stream.send_all(bytes([byte]))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
                await trio.sleep(1)
        return await until_closed(stream)

    started = trio.current_time()
    admitted, _ = await run_admission(admission, client)
    assert admitted is None
    assert 10 <= trio.current_time() - started < 12
    assert "handshake not finished within 10 s" in refusals(state)[0]


async def test_handshakes_beyond_the_caps_are_closed_at_once(autojump_clock):
    state = new_state()
    admission = Admission(
        state, token=TOKEN, run_id="r", timeout=10, max_per_host=3, max_pending=100
    )
    hung_up = []

    async def silent_peer():
        server_side, client_side = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(admission.admit, server_side)
            started = trio.current_time()
            await until_closed(client_side)
            hung_up.append(trio.current_time() - started)

    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(silent_peer)
    # memory streams all share one "address": 3 wait out the deadline, 7 are closed at once
    assert sorted(hung_up)[:7] == [0] * 7 and min(sorted(hung_up)[7:]) >= 10
    assert len(refusals(state)) == 5  # 5 shown per address per minute, the other 5 counted
    admission.refusals.flush()
    assert (
        "… and 5 more in the last 60 s (last: handshake not finished within 10 s)"
        in refusals(state)[-1]
    )
    assert admission.pending == 0


def test_refusal_log_is_rate_limited_per_address_and_summarised():
    now = [0.0]
    state = new_state()
    log = RefusalLog(state, per_host=5, total=50, window=60, clock=lambda: now[0])
    for i in range(125):
        log.refused("1.2.3.4", f"1.2.3.4:{i}", "wrong or missing join token")
    log.refused("5.6.7.8", "5.6.7.8:1", "said nothing")
    assert len(refusals(state)) == 6
    now[0] = 61.0
    log.refused(
        "1.2.3.4", "1.2.3.4:999", "wrong or missing join token"
    )  # a new window: shown again
    texts = refusals(state)
    assert (
        "refused 1.2.3.4: … and 120 more in the last 60 s (last: wrong or missing join token)"
        in texts
    )
    assert texts[-1] == "refused 1.2.3.4:999: wrong or missing join token"
    assert [e.fields().get("suppressed") for e in state.events if e.fields().get("suppressed")] == [
        120
    ]


def test_refusal_log_memory_is_bounded_across_many_addresses():
    state = new_state()
    log = RefusalLog(state, per_host=1, total=10, max_hosts=16)
    for i in range(5000):
        log.refused(f"10.0.{i // 256}.{i % 256}", f"10.0.{i // 256}.{i % 256}:1", "garbage")
    assert len(log._suppressed) <= 17
    log.flush()
    assert sum(e.fields().get("suppressed", 0) for e in state.events) == 5000 - 10


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for localhost and its key (PEM files)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
        + ["-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=t"]
        + ["-addext", "subjectAltName=DNS:localhost"],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


@pytest.fixture(scope="module")
def server_tls(certificate) -> ServerTLS:
    return ServerTLS.from_files(*certificate)


@pytest.mark.e2e  # its certificate fixture runs openssl
@pytest.mark.parametrize("speaks_first", [False, True], ids=["silent", "plain-bytes"])
async def test_a_peer_without_tls_is_told_in_plain_pcp_to_use_tls(
    autojump_clock, server_tls, speaks_first
):
    """A worker without --tls-* waits for the shepherd's hello; it must not wait for nothing."""

    state = new_state()
    admission = Admission(state, token=TOKEN, run_id="r", tls=server_tls, timeout=10)

    async def plain_worker(stream):
        if speaks_first:
            await stream.send_all(hello_bytes(b""))
        return await protocol.MessageStream(stream).receive()

    admitted, answer = await run_admission(admission, plain_worker)
    assert admitted is None
    assert (answer.kind, answer.body.code) == ("error", "authFailed")  # final for a worker
    assert answer.body.message == TLS_ONLY
    assert "TLS handshake failed" in refusals(state)[0] and admission.pending == 0


@pytest.mark.e2e
async def test_a_tls_worker_is_admitted_after_its_first_bytes_were_looked_at(server_tls):
    admission = Admission(new_state(), token=TOKEN, run_id="r", tls=server_tls)
    client_tls = ClientTLS.from_options(pinned=server_tls.fingerprint)

    async def tls_worker(stream):
        secure = await client_tls.connect(stream, "localhost")
        hello = await read_hello(secure)
        await secure.send_all(hello_bytes(hello.body.nonce))

    admitted, _ = await run_admission(admission, tls_worker)
    assert admitted is not None and admitted.hello.worker_id == "w1"


@pytest.mark.e2e
@pytest.mark.parametrize("pin_matches", [True, False])
async def test_with_tls_ca_and_tls_fingerprint_the_certificate_must_pass_both(
    certificate, server_tls, pin_matches
):
    admission = Admission(new_state(), token=TOKEN, run_id="r", tls=server_tls)
    pin = server_tls.fingerprint if pin_matches else "ab" * 32
    client_tls = ClientTLS.from_options(ca_path=certificate[0], pinned=pin)

    async def tls_worker(stream):
        try:
            secure = await client_tls.connect(stream, "localhost")
        except TLSRefused as exc:
            return str(exc)
        hello = await read_hello(secure)
        await secure.send_all(hello_bytes(hello.body.nonce))

    admitted, refused = await run_admission(admission, tls_worker)
    assert (admitted is not None) == pin_matches
    assert pin_matches or "not the pinned" in refused
