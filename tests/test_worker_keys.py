"""--worker-keys: a worker joins as the one id its key was issued for, until the key is revoked.

A live shepherd on 127.0.0.1 in this process, keyed workers (`Worker`, the real client)
training in it, and peers that speak the real protocol with the token's proof and a
signature that is wrong in one way each.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import subprocess
import threading

import pytest
import trio

from pcp_tui import protocol
from pcp_tui.app.cli import main
from pcp_tui.config import ConfigError, WorkerConfig
from pcp_tui.contract import keys
from pcp_tui.contract.connection import Refused
from pcp_tui.contract.tls import ClientTLS, ServerTLS
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.shepherd.serving.worker_keys import WorkerKeys
from pcp_tui.testing import (
    connect_peer,
    pause_after_round,
    peer_hello,
    run_shepherd,
    self_signed_certificate,
    until,
)
from pcp_tui.training.build import build_workload
from pcp_tui.worker.client import Worker
from pcp_tui.worker.rounds import Faults

from .conftest import small_config

ISSUED = {name: keys.generate() for name in ("alice", "bob")}
STRANGER = keys.generate()


def write_keys(path, names) -> None:
    path.write_text("# issued by the operator\n" + "".join(
        f"{keys.public_line(ISSUED[name], name)}\n" for name in names
    ))  # fmt: skip


def write_private(tmp_path, name: str) -> str:
    path = str(tmp_path / f"{name}.key")
    if not os.path.exists(path):  # written once: pcp-tui never overwrites a key
        keys.write_private_key(ISSUED[name], path)
    return path


def keyed_worker(
    tmp_path, port: int, name: str, faults: Faults | None = None, pin: str | None = None
) -> Worker:
    """A CPU worker `name` joining 127.0.0.1:`port` with a key of its own, once (no reconnect);
    over TLS to a shepherd of certificate fingerprint `pin`, if given."""
    settings = WorkerConfig(
        connect=f"127.0.0.1:{port}",
        token="test-token",
        backend="cpu",
        worker_id=name,
        key=write_private(tmp_path, name),
        reconnect=False,
        tls_fingerprint=pin,
    )
    return Worker(settings, faults=faults, tls=ClientTLS.from_options(pinned=pin))


def signed(worker_id: str, nonce: bytes, key, *, public=None, signed_nonce=None):
    """A hello as `worker_id` with the token's proof for `nonce`, signed by `key` over
    `signed_nonce` (default: this connection's), presenting `public` (default: `key`'s)."""
    return peer_hello(
        worker_id,
        nonce,
        public_key=keys.public_bytes(public or key),
        signature=keys.sign_hello(key, signed_nonce or nonce, worker_id, 0, ""),  # plain TCP
    )


async def answer(port: int, hello_for) -> protocol.Message:
    """Open a connection, send `hello_for(its nonce)`, return the shepherd's answer."""
    stream, nonce = await connect_peer(port)
    await stream.send(hello_for(nonce))
    reply = await stream.receive()
    await stream.aclose()
    return reply


def test_keyed_workers_train_and_every_other_hello_is_refused_and_a_revoked_key_leaves(
    tmp_path, caplog
):
    """Each worker's session is striped over 2 connections: the extra one signs too."""
    caplog.set_level(logging.INFO, logger="pcp_tui.shepherd.serving.striping")
    issued = tmp_path / "workers.keys"
    write_keys(issued, ["alice", "bob"])
    config = small_config(workers=2, rounds=3, inner_steps=5, worker_keys=str(issued), streams=2)
    shepherd = Shepherd(config, build_workload(config, shards=2))
    answers: dict[str, protocol.Message] = {}
    seen: dict[str, object] = {}

    def worker(port: int, name: str) -> Worker:
        return keyed_worker(tmp_path, port, name)

    async def bob_until_revoked(port: int) -> None:
        try:
            await worker(port, "bob").run()
        except Refused as exc:
            seen["bob"] = str(exc)

    async def scenario(port: int) -> None:
        alice = ISSUED["alice"]
        answers["no key"] = await answer(port, lambda nonce: peer_hello("alice", nonce))
        answers["unknown key"] = await answer(
            port, lambda nonce: signed("mallory", nonce, STRANGER)
        )
        answers["wrong signature"] = await answer(
            port, lambda nonce: signed("alice", nonce, STRANGER, public=alice)
        )
        other, elsewhere = await connect_peer(port)  # alice's signature for another connection
        answers["replayed"] = await answer(
            port, lambda nonce: signed("alice", nonce, alice, signed_nonce=elsewhere)
        )
        await other.aclose()
        answers["second id"] = await answer(port, lambda nonce: signed("alice-2", nonce, alice))
        pause_after_round(shepherd, 1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker(port, "alice").run)
            nursery.start_soon(bob_until_revoked, port)
            await until(lambda: shepherd.state.status == "paused" and shepherd.state.history)
            write_keys(issued, ["alice"])  # the operator revokes bob's key
            shepherd.resume()
            await until(lambda: "bob" in seen)
            answers["revoked"] = await answer(
                port, lambda nonce: signed("bob", nonce, ISSUED["bob"])
            )

    run_shepherd(shepherd, scenario)
    assert {name: a.kind for name, a in answers.items()} == dict.fromkeys(answers, "error")
    assert {a.body.code for a in answers.values()} == {protocol.ErrorCode.AUTH_FAILED}
    said = {name: a.body.message for name, a in answers.items()}
    assert "start the worker with --key FILE" in said["no key"]
    stranger = keys.fingerprint(keys.public_bytes(STRANGER))
    assert said["unknown key"].startswith(f"key {stranger} is not in this shepherd's --worker-keys")
    assert "signature is not key" in said["wrong signature"]
    assert "signature is not key" in said["replayed"]
    assert "issued to worker id 'alice', not 'alice-2'" in said["second id"]
    assert "--id alice" in said["second id"]
    assert "is not in this shepherd's --worker-keys" in said["revoked"]
    bob = keys.fingerprint(keys.public_bytes(ISSUED["bob"]))
    assert f"its key {bob} was removed from --worker-keys" in str(seen["bob"])
    assert "authFailed" in str(seen["bob"])
    # the run went on: bob trained round 1 only, alice every round
    assert [sorted(r.worker_ids) for r in shepherd.state.history] == [
        ["alice", "bob"],
        ["alice"],
        ["alice"],
    ]
    [reread] = [e.message for e in shepherd.state.events if e.kind == "worker_keys"]
    assert reread == f"--worker-keys {issued} read again: 1 key(s)"
    assert shepherd.state.join_command.endswith("--key <KEY_FILE> --id <ITS_NAME_IN_WORKER_KEYS>")
    striped = [r.getMessage() for r in caplog.records if "striped over" in r.getMessage()]
    assert sorted(striped) == [f"worker {i}: session striped over 2 connections" for i in (0, 1)]
    [gone] = [e for e in shepherd.state.events if e.kind == "lost" and e.worker == "bob"]
    assert "was removed from --worker-keys" in gone.message
    assert not [r for r in caplog.records if "does not check worker keys" in r.getMessage()]


def test_a_worker_with_a_key_is_told_once_that_an_unkeyed_shepherd_does_not_check_it(
    tmp_path, caplog
):
    """The token alone admits it there: its operator should not think the key protects it."""
    caplog.set_level(logging.WARNING, logger="pcp_tui")
    config = small_config(workers=1, rounds=1, inner_steps=5)
    shepherd = Shepherd(config, build_workload(config, shards=1))
    run_shepherd(shepherd, lambda port: keyed_worker(tmp_path, port, "alice").run())
    assert [r.worker_ids for r in shepherd.state.history] == [("alice",)]
    said = [r.getMessage() for r in caplog.records if "worker keys" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(
        " does not check worker keys (no --worker-keys): this worker's --key is unused there; "
        "the join token alone admitted it"
    ), said


def test_a_key_revoked_mid_round_takes_that_rounds_result_with_it(tmp_path):
    """The operator removes bob's line while bob trains round 1: bob's result of that round,
    sent after, was folded in (revocation was looked at only before a round); now it ends
    bob's connection with authFailed, and round 1 is alice's alone."""
    issued = tmp_path / "workers.keys"
    write_keys(issued, ["alice", "bob"])
    config = small_config(workers=2, rounds=1, inner_steps=2, worker_keys=str(issued))
    shepherd = Shepherd(config, build_workload(config, shards=2))
    seen: dict[str, str] = {}

    class RevokedAsItTrains(Faults):
        async def before_round(self, number: int) -> None:
            write_keys(issued, ["alice"])

    def worker(port: int, name: str, faults: Faults | None = None) -> Worker:
        return keyed_worker(tmp_path, port, name, faults)

    async def bob(port: int) -> None:
        try:
            await worker(port, "bob", RevokedAsItTrains()).run()
        except Refused as exc:
            seen["bob"] = str(exc)

    async def scenario(port: int) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker(port, "alice").run)
            nursery.start_soon(bob, port)

    run_shepherd(shepherd, scenario)
    assert [sorted(r.worker_ids) for r in shepherd.state.history] == [["alice"]]
    bob_key = keys.fingerprint(keys.public_bytes(ISSUED["bob"]))
    assert f"its key {bob_key} was removed from --worker-keys" in seen["bob"]
    assert "authFailed" in seen["bob"]


def test_a_keys_file_is_strict_at_start_and_leaves_out_only_bad_lines_later(tmp_path):
    issued = tmp_path / "workers.keys"
    alice, bob = (keys.public_line(ISSUED[n], n) for n in ("alice", "bob"))
    for text, problem in [
        (f"{alice}\nssh-rsa AAAA carol\n", "line 2: wants ssh-ed25519 keys"),
        (f"{alice}\n{alice.replace('alice', 'carol')}\n", "line 2: the key of line 1 again"),
        (f"{alice}\n{bob.replace('bob', 'alice')}\n", "line 2: 'alice' was issued a key on line 1"),
        (alice.removesuffix(" alice"), "line 1: wants 'ssh-ed25519 KEY NAME'"),
        ("# nobody yet\n", "holds no key"),
    ]:
        issued.write_text(text)
        with pytest.raises(ConfigError, match=problem):
            WorkerKeys(str(issued))
    issued.write_text(f"{alice}\n{bob}\n")
    said: list[str] = []
    held = WorkerKeys(str(issued), on_reread=said.append)
    alice_key, bob_key = (keys.public_bytes(ISSUED[n]) for n in ("alice", "bob"))
    assert held.names() == {alice_key: "alice", bob_key: "bob"} and not said  # not read again
    issued.write_text(f"{alice}\n{bob.replace('AAAA', 'BBBB')}\n")
    assert held.names() == {alice_key: "alice"}
    assert said[-1].endswith(
        "1 key(s); left out: " + f"{issued} line 2: the key is not an ssh-ed25519 public key"
    )
    assert (
        held.revoked(bob_key, "bob")
        == f"its key {keys.fingerprint(bob_key)} was removed from --worker-keys {issued}"
    )
    assert held.revoked(alice_key, "alice") is None
    os.remove(issued)
    assert held.names() == {}  # fails closed: nobody holds a key until the file is back
    assert "cannot be read" in said[-1]


def test_a_keys_file_is_read_whole_or_not_at_all_and_its_byte_order_mark_is_no_text(tmp_path):
    """A file cut where it was read issued the cut line's key to its name's prefix: here
    alice's key, issued to 'alice-2', went to 'alice' once the 16 MiB read cut it there. A
    file too big to be keys is read as none. A Windows editor's byte order mark and CRLF
    lines left line 1 out; they are not text of the file's."""
    issued = tmp_path / "workers.keys"
    alice, bob = (keys.public_line(ISSUED[n], n) for n in ("alice", "bob"))
    alice_key, bob_key = (keys.public_bytes(ISSUED[n]) for n in ("alice", "bob"))
    issued.write_bytes(b"\xef\xbb\xbf" + f"{alice}\r\n{bob}\r\n".encode())
    assert WorkerKeys(str(issued)).names() == {alice_key: "alice", bob_key: "bob"}

    cut = 16 * 1024 * 1024  # where the read stopped
    padding = cut - len(alice)  # comment lines, then alice's line cut after its name
    pad = "#" * 1023 + "\n"
    big = pad * (padding // len(pad) - 1)
    big += "#" * (padding - len(big) - 1) + "\n" + alice.replace(" alice", " alice-2") + "\n"
    issued.write_text(big)
    with pytest.raises(ConfigError, match="over 1048576 characters; is it the right file"):
        WorkerKeys(str(issued))
    issued.write_text(f"{bob}\n")
    said: list[str] = []
    held = WorkerKeys(str(issued), on_reread=said.append)
    issued.write_text(big)
    assert held.names() == {} and "over 1048576 characters" in said[-1]


def test_a_character_beyond_ascii_or_a_byte_beyond_utf8_spoils_its_line_only(tmp_path):
    """A key pasted as shown cut ("AAAAC3Nz…") raised ValueError out of the parser: a
    traceback at start, and mid-run out of the handshake or the check before a round,
    ending the run. A byte that is not UTF-8 (a Latin-1 name) made the whole file unreadable:
    every connected worker was revoked. Each is now one line left out, named."""
    issued = tmp_path / "workers.keys"
    alice, bob = (keys.public_line(ISSUED[n], n) for n in ("alice", "bob"))
    pasted = f"{keys.public_line(STRANGER, 'carol')[:24]}… carol"
    issued.write_text(f"{alice}\n{pasted}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="line 2: the key is not base64"):
        WorkerKeys(str(issued))
    issued.write_text(f"{alice}\n{bob}\n")
    said: list[str] = []
    held = WorkerKeys(str(issued), on_reread=said.append)
    both = held.names()
    latin1 = keys.public_line(STRANGER, "caf\xe9").encode("latin-1")
    issued.write_bytes(f"{alice}\n{pasted}\n".encode() + latin1 + f"\n{bob}\n".encode())
    assert held.names() == both
    assert said[-1].endswith(
        f"2 key(s); left out: {issued} line 2: the key is not base64; {issued} line 3: a key's "
        "name is its worker id: printable characters, no spaces"
    )


def test_a_pipe_is_not_a_keys_file(tmp_path):
    """`--worker-keys <(...)` or a FIFO was read: opening and reading it again mid-run would
    wait on a writer with the event loop stopped (and, once its writer is done, read no key,
    revoking every worker). It is refused at start, naming what to pass instead."""
    fifo = tmp_path / "workers.keys"
    os.mkfifo(fifo)
    line = f"{keys.public_line(ISSUED['alice'], 'alice')}\n".encode()

    def writer() -> None:  # what <(...) does: write the keys once, then close
        with open(fifo, "wb") as pipe:
            pipe.write(line)

    feeding = threading.Thread(target=writer, daemon=True)
    feeding.start()
    try:
        with pytest.raises(ConfigError, match="not a regular file"):
            WorkerKeys(str(fifo))
    finally:  # a reader, held open until the writer is done, lets its open return
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        feeding.join(timeout=60)
        os.close(reader)


def test_keygen_writes_a_private_key_only_its_owner_reads_and_prints_its_line(tmp_path, capsys):
    out = tmp_path / "w.key"
    assert main(["keygen", "--out", str(out), "--name", "alice"]) == 0
    line = capsys.readouterr().out.strip()
    key = keys.load_private_key(str(out))
    assert line == keys.public_line(key, "alice")
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert keys.parse_worker_keys(line, "f").names == {keys.public_bytes(key): "alice"}
    assert main(["keygen", "--out", str(out), "--name", "alice"]) == 2  # never overwritten
    assert "never overwrites a key" in capsys.readouterr().err
    assert keys.load_private_key(str(out)).private_bytes_raw() == key.private_bytes_raw()


def test_a_key_or_keys_file_that_cannot_work_exits_2_naming_it(tmp_path, capsys):
    junk = tmp_path / "junk"
    junk.write_text("junk\n")
    worker = ["worker", "--connect", "127.0.0.1:9", "--token", "t", "--compile-cache", ""]
    assert main([*worker, "--key", str(junk), "--quiet"]) == 2
    assert f"--key {junk} is not an OpenSSH private key" in capsys.readouterr().err
    # before data and model load
    assert main(["shepherd", "--headless", "--port", "0", "--worker-keys", str(junk)]) == 2
    said = capsys.readouterr()
    assert f"--worker-keys {junk} line 1: wants ssh-ed25519 keys" in said.err
    assert "loading data" not in said.out + said.err


@pytest.mark.e2e
def test_a_worker_process_joins_with_the_key_keygen_made(tmp_path, capsys, spawn_worker):
    """The commands of docs/security.md: keygen's line in --worker-keys, `pcp-tui worker
    --key FILE --id NAME` trains every round."""
    key = tmp_path / "gpu-1.key"
    assert main(["keygen", "--out", str(key), "--name", "gpu-1"]) == 0
    issued = tmp_path / "workers.keys"
    issued.write_text(capsys.readouterr().out)
    config = small_config(workers=1, rounds=2, inner_steps=5, worker_keys=str(issued))
    shepherd = Shepherd(config, build_workload(config, shards=1))
    worker = {}

    def scenario(port: int) -> None:
        worker["process"] = spawn_worker(port, "--key", str(key), "--id", "gpu-1")

    run_shepherd(shepherd, scenario)
    assert [r.worker_ids for r in shepherd.state.history] == [("gpu-1",), ("gpu-1",)]
    assert worker["process"].wait(timeout=60) == 0


async def _relay(listen: trio.SocketListener, tls: ServerTLS, port: int, pin: str) -> None:
    """A hostile host the worker was made to trust (it shows its own certificate, `tls`): it
    relays each connection's bytes, both ways, to the shepherd on `port` over TLS."""

    async def pipe(source: trio.abc.Stream, sink: trio.abc.Stream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while data := await source.receive_some():
                await sink.send_all(data)

    async def serve(raw: trio.SocketStream) -> None:
        worker = await tls.accept(raw)
        shepherd = await ClientTLS.from_options(pinned=pin).connect(
            await trio.open_tcp_stream("127.0.0.1", port), "127.0.0.1"
        )
        async with trio.open_nursery() as both:
            both.start_soon(pipe, worker, shepherd)
            both.start_soon(pipe, shepherd, worker)

    await trio.serve_listeners(serve, [listen])


@pytest.mark.e2e  # openssl makes the certificates
def test_a_keyed_hello_relayed_by_a_host_the_worker_trusts_is_refused(tmp_path):
    """The signature covers the certificate the worker was shown: relayed to the real
    shepherd by a host with another certificate (one the worker trusts: a wrong --connect
    and pin, a CA that signed both), the hello is refused; straight to it over TLS, the same
    worker trains."""
    cert, key = self_signed_certificate(tmp_path)
    other_cert, other_key = self_signed_certificate(tmp_path, "relay-")
    shepherd_tls, relay_tls = (
        ServerTLS.from_files(str(cert), str(key)),
        ServerTLS.from_files(str(other_cert), str(other_key)),
    )
    issued = tmp_path / "workers.keys"
    write_keys(issued, ["alice"])
    config = small_config(
        workers=1, rounds=1, inner_steps=2, worker_keys=str(issued),
        tls_cert=str(cert), tls_key=str(key),
    )  # fmt: skip
    shepherd = Shepherd(config, build_workload(config, shards=1))
    refused: list[str] = []

    async def scenario(port: int) -> None:
        async with trio.open_nursery() as nursery:
            [listen] = await trio.open_tcp_listeners(0, host="127.0.0.1")
            nursery.start_soon(_relay, listen, relay_tls, port, shepherd_tls.fingerprint)
            relayed = keyed_worker(
                tmp_path, listen.socket.getsockname()[1], "alice", pin=relay_tls.fingerprint
            )
            with pytest.raises(Refused) as exc:
                await relayed.run()
            refused.append(str(exc.value))
            nursery.cancel_scope.cancel()
        await keyed_worker(tmp_path, port, "alice", pin=shepherd_tls.fingerprint).run()

    run_shepherd(shepherd, scenario)
    [said] = refused
    assert "authFailed" in said and "relayed it here" in said, said
    assert [r.worker_ids for r in shepherd.state.history] == [("alice",)]


def _ca_signed_chain(directory) -> tuple[str, str, str]:
    """(chain file: the shepherd's certificate then the CA's, its key, the CA's certificate),
    made by `openssl`: a shepherd whose --tls-cert holds a chain, trusted with --tls-ca."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *curve, "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=ca")
    openssl("req", *curve, "-keyout", "leaf.key", "-out", "leaf.csr", "-subj", "/CN=pcp")
    (directory / "san").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl(
        "x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "leaf.pem", "-days", "2", "-extfile", "san",
    )  # fmt: skip
    chain = directory / "chain.pem"
    chain.write_bytes((directory / "leaf.pem").read_bytes() + (directory / "ca.pem").read_bytes())
    return str(chain), str(directory / "leaf.key"), str(directory / "ca.pem")


@pytest.mark.e2e  # openssl makes the certificates
def test_a_keyed_worker_trusting_a_ca_stripes_over_tls_to_a_shepherd_of_a_chain(tmp_path, caplog):
    """Both sides fingerprint the shepherd's own certificate, the chain's first: a worker that
    trusts the CA (--tls-ca, no pin) signs the leaf the handshake showed it, on its first
    connection and on its striped extra one, and the shepherd checks the leaf of its
    --tls-cert file, not the CA after it."""
    caplog.set_level(logging.INFO, logger="pcp_tui.worker.striping")
    chain, key, ca = _ca_signed_chain(tmp_path)
    issued = tmp_path / "workers.keys"
    write_keys(issued, ["alice"])
    config = small_config(
        workers=1, rounds=1, inner_steps=2, worker_keys=str(issued), streams=2,
        tls_cert=chain, tls_key=key,
    )  # fmt: skip
    shepherd = Shepherd(config, build_workload(config, shards=1))

    async def scenario(port: int) -> None:
        settings = WorkerConfig(
            connect=f"127.0.0.1:{port}", token="test-token", backend="cpu", worker_id="alice",
            key=write_private(tmp_path, "alice"), reconnect=False, tls_ca=ca,
        )  # fmt: skip
        await Worker(settings, tls=ClientTLS.from_options(ca_path=ca)).run()

    run_shepherd(shepherd, scenario)
    assert [r.worker_ids for r in shepherd.state.history] == [("alice",)]
    striped = [r.getMessage() for r in caplog.records if "striped over" in r.getMessage()]
    assert striped == ["session striped over 2 connections"]
