"""A site: several processes, one a host, that train as one worker over multi-controller JAX.

Each process of a site calls `join_site` with JAX's own names (the
coordinator's address, the number of processes, its id). Process 0 holds the
PCP session; the others follow it: every message of its session that says
what to compute (the welcome, the plan, round starts, fragment updates) goes
to them as it comes, over a TCP connection from each follower to process 0
(`Site.send`, `Site.receive`), and each runs it as process 0 does
(`client.Worker.follow`), so the graphs run over the global mesh with every
process in step. Process 0 listens on a port of its own and says which, with a
fresh secret each follower must present, in the coordination service's
key-value store. Neither that store nor a device collective carries the
messages: the store's gRPC compresses every value, which holds float32
parameters to about 10 MB/s (tens of seconds for GPT-2's round start); and a
follower waits for the next message for as long as the shepherd takes, where a
collective waited in beside training would have to be entered in the same
order as training's own on every process. A one-process worker is a site of one
(`Site.alone`): nothing to send.

The site is one failure unit. A process that stops heartbeating for
`heartbeat_seconds` (it died, or its host did) makes JAX's coordination
service end every other process (checked on JAX 0.10.2, CPU: the survivor
aborts with "The following tasks are unhealthy (stopped sending heartbeats)",
never hangs in the collective it was waiting in); a follower whose process 0
is gone, or a process 0 whose follower is, hears it at once from their connection
(`SiteLost`). A process 0 whose session
ends, for any reason, tells the followers (`Site.end`), and the site exits as
one: a lost shepherd is not retried by a site, whose processes may be mid-round
at different points; restart the site's processes to rejoin.

A site keeps no persistent compile cache (`--compile-cache`): its processes
must run one executable, and JAX's cache would give them two. JAX writes it
from process 0 only (and on CPU keys it by process), so only process 0 loads
a cached executable while the others compile the graph afresh. Checked on JAX
0.10.2, CPU: with an `fsdp` train_chunk exported for cpu, cuda and rocm (each
all-gather a platform `conditional`, every collective on channel 1), process
0's cached executable ran its all-gathers in another order than the followers'
fresh one, and Gloo aborted both at the first chunk ("Received data size doesn't
match expected size"), every time the cache was warm; compiled afresh on every
process, the same graph trains. A site's restart compiles again.

The coordination service has no authentication and no TLS in JAX's API
(`jax.distributed.initialize` takes none): anyone who reaches its port can
join the site or read what it shares (the message port's secret included). It
must stay on a trusted LAN; `join_site` says so once. The messages themselves
go in the clear, as the collectives' own traffic does.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import platform as host_platform
import queue
import socket
import struct
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

HEARTBEAT_SECONDS = 10  # a process silent this long is dead: the whole site ends
JOIN_SECONDS = 120  # how long a process waits for the site's others to start (JAX's: 300)
HOSTNAME_BYTES = 64
CHANNEL = "pcp-tui/messages"  # in the store: process 0's message port and its secret
SECRET_BYTES = 32
POLL_SECONDS = 1.0  # a follower's wait for the next message, renewed until it comes
END_WAIT_SECONDS = 30  # how long the site's processes wait for each other at the end
MESSAGE, END = b"m", b"e"  # what a message to the followers is: a PCP message, or the end
HEADER = struct.Struct("!cQ")  # a message's kind and length

TRUSTED_LAN = (
    "the site's coordination service ({address}) has no authentication or encryption "
    "(JAX offers none): keep it on a trusted LAN, never on a port the internet reaches"
)


@dataclass(frozen=True)
class SiteEnd:
    """Process 0's worker ended: the followers exit with `code`; `reason` says why."""

    code: int
    reason: str


class SiteLost(Exception):
    """Another process of the site is gone (or unreachable): this one ends too."""


@dataclass
class Site:
    """This process's place in its site: `process_id` of `process_count`, and each one's host."""

    process_id: int
    process_count: int
    hostnames: tuple[str, ...]
    _client: Any = field(default=None, repr=False)  # the coordination service's client
    # process 0: a connection from each follower, by process id; a follower: its to process 0
    _links: dict[int, socket.socket] = field(default_factory=dict, repr=False)
    # process 0: each follower's messages not yet written, and its writer (`_write`)
    _queues: dict[int, queue.SimpleQueue] = field(default_factory=dict, repr=False)
    _writers: list[threading.Thread] = field(default_factory=list, repr=False)
    _broken: list[str] = field(default_factory=list, repr=False)  # why a follower's write failed

    @classmethod
    def alone(cls) -> Site:
        """A one-process worker's site: itself."""
        return cls(0, 1, (host_platform.node(),))

    @property
    def leads(self) -> bool:
        """Whether this process holds the PCP session (process 0)."""
        return self.process_id == 0

    def send(self, data: bytes) -> None:
        """Process 0: `data` is the followers' next message. Returns at once (each
        follower's writer sends it, in order, as fast as that follower reads: a follower
        busy compiling holds nothing up here); SiteLost once a follower is gone."""
        assert self.leads, "only process 0 sends"
        self._send(MESSAGE, data)

    def _send(self, kind: bytes, data: bytes) -> None:
        if self._broken:
            raise SiteLost(self._broken[0])
        for pending in self._queues.values():
            pending.put((kind, data))

    def _write(self, process: int) -> None:
        """Process 0's writer to follower `process`: its messages in order, until the end."""
        link, pending = self._links[process], self._queues[process]
        while True:
            kind, data = pending.get()
            try:
                link.sendall(HEADER.pack(kind, len(data)))
                link.sendall(data)
            except OSError as exc:
                self._broken.append(self._gone(process, exc))
                return
            if kind == END:
                return

    def receive(self) -> bytes | SiteEnd:
        """A follower: process 0's next message, or the site's end, waiting as long as it
        takes; SiteLost if process 0 is gone."""
        assert not self.leads, "process 0 sends"
        kind, length = HEADER.unpack(self._read(HEADER.size))
        data = self._read(length)
        if kind == END:
            return SiteEnd(data[0], data[1:].decode(errors="replace"))
        return data

    def _read(self, count: int) -> bytes:
        """`count` bytes from process 0, however long they take to come."""
        link, buffer = self._links[0], bytearray(count)
        view, got = memoryview(buffer), 0
        while got < count:
            try:
                read = link.recv_into(view[got:], min(count - got, 1 << 24))
            except TimeoutError:
                continue  # nothing yet: the shepherd is slow, or between rounds
            except OSError as exc:
                raise SiteLost(self._gone(0, exc)) from None
            if not read:
                raise SiteLost(self._gone(0, ConnectionError("it closed the connection")))
            got += read
        return bytes(buffer)

    def end(self, code: int, reason: str) -> None:
        """Process 0: the worker ended (`code`, the exit code, and why): the followers end
        too. Leaves the site once they have read it (`leave`)."""
        for pending in self._queues.values():  # a follower already gone ends as it can
            pending.put((END, bytes([min(max(code, 0), 255)]) + reason.encode()))
        for writer in self._writers:
            writer.join(END_WAIT_SECONDS)
        self.leave()

    def leave(self) -> None:
        """Disconnect from the coordination service once every process of the site is
        leaving too: JAX's own shutdown, whose barrier keeps process 0's service up until
        each follower has disconnected. A follower still connected as the service goes
        would be aborted by its client ("the JAX distributed service detected fatal
        errors"). Only once all have met at the site's own end barrier: a process gone or
        stuck (in a collective with one that is gone) for END_WAIT_SECONDS would fail JAX's
        shutdown barrier, and that aborts this process too (SIGABRT, not its exit code);
        then this one leaves without it (the launcher exits with `os._exit`)."""
        import jax
        from jax.errors import JaxRuntimeError

        if self.process_count > 1:
            try:
                self._client.wait_at_barrier("pcp-tui/end", END_WAIT_SECONDS * 1000)
            except JaxRuntimeError:
                return  # a process gone or stuck: JAX's shutdown barrier would abort this one
            with contextlib.suppress(JaxRuntimeError):
                jax.distributed.shutdown()
            for link in self._links.values():
                link.close()

    def _gone(self, process: int, exc: BaseException) -> str:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return (
            f"the site's process {process} ({self.hostnames[process]}) is gone ({why}): this "
            f"process {self.process_id} ends with it; restart every process of the site"
        )


def join_site(
    coordinator_address: str,
    process_count: int,
    process_id: int,
    *,
    platform: str = "cpu",
    heartbeat_seconds: int = HEARTBEAT_SECONDS,
    bind_address: str | None = None,
    quiet: bool = False,
) -> Site:
    """Start multi-controller JAX for this process of a site; its `Site`.

    Call it before any other JAX call of the process (JAX's rule). Process 0
    runs the coordination service, bound to `bind_address` (default: every
    interface, on the address's port) and warns once that it must stay on a
    trusted LAN (not when `quiet`: --quiet). On CPU the collectives go over Gloo.
    """
    import jax
    from jax.experimental import multihost_utils

    if not 0 <= process_id < process_count:
        raise ValueError(
            f"--process-id {process_id} is not one of the site's {process_count} processes "
            f"(0 to {process_count - 1})"
        )
    if process_id == 0 and not quiet:
        print(
            f"pcp-tui: warning: {TRUSTED_LAN.format(address=bind_address or coordinator_address)}",
            file=sys.stderr,
            flush=True,
        )
    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # every process compiles every graph afresh: all run one executable (the module docstring)
    jax.config.update("jax_enable_compilation_cache", False)
    # JAX waits here for every process, unable to hear a signal, then ends the process with
    # its own fatal log line: say first what it waits for (not under --quiet: errors only)
    if not quiet:
        print(
            f"pcp-tui: waiting up to {JOIN_SECONDS} s for the site's {process_count} processes "
            f"at {coordinator_address} (process 0 serves it; start every process of the site)",
            file=sys.stderr,
            flush=True,
        )
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=process_count,
        process_id=process_id,
        initialization_timeout=JOIN_SECONDS,
        heartbeat_timeout_seconds=heartbeat_seconds,
        shutdown_timeout_seconds=END_WAIT_SECONDS,
        coordinator_bind_address=bind_address,
    )
    mine = host_platform.node().encode()[:HOSTNAME_BYTES].ljust(HOSTNAME_BYTES, b"\0")
    every = multihost_utils.process_allgather(np.frombuffer(mine, np.uint8))
    hostnames = tuple(
        bytes(row).rstrip(b"\0").decode(errors="replace")
        for row in np.asarray(every).reshape(process_count, HOSTNAME_BYTES)
    )
    from jax._src import distributed  # its client: the only handle on the store JAX gives

    site = Site(process_id, process_count, hostnames, _client=distributed.global_state.client)
    host = coordinator_address.rsplit(":", 1)[0].strip("[]")
    if site.leads:
        _serve_followers(site, bind_address)
    else:
        _reach_process_0(site, host)
    return site


def _serve_followers(site: Site, bind_address: str | None) -> None:
    """Process 0: listen on a fresh port, say it and a fresh secret in the store, and take
    one connection from each follower that presents the secret and its process id."""
    secret = os.urandom(SECRET_BYTES)
    bind = bind_address.rsplit(":", 1)[0].strip("[]") if bind_address else ""
    if not bind and socket.has_dualstack_ipv6():
        listener = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    else:
        listener = socket.create_server((bind, 0))
    with listener:
        port = listener.getsockname()[1]
        site._client.key_value_set(CHANNEL, f"{port} {secret.hex()}")
        listener.settimeout(JOIN_SECONDS)
        while len(site._links) < site.process_count - 1:
            try:
                link, _ = listener.accept()
            except TimeoutError:
                raise SiteLost(
                    f"the site's other processes did not connect to process 0's message port "
                    f"{port} within {JOIN_SECONDS} s: let them reach it (a firewall?)"
                ) from None
            link.settimeout(JOIN_SECONDS)
            try:
                said = _read_exactly(link, SECRET_BYTES + 2)
            except OSError:
                link.close()
                continue
            process = int.from_bytes(said[SECRET_BYTES:], "big")
            if not hmac.compare_digest(said[:SECRET_BYTES], secret) or not (
                0 < process < site.process_count and process not in site._links
            ):
                link.close()  # not one of the site's processes
                continue
            link.settimeout(None)
            link.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            site._links[process] = link
    for process in sorted(site._links):
        site._queues[process] = queue.SimpleQueue()
        writer = threading.Thread(
            target=site._write, args=(process,), name=f"pcp-tui site writer {process}", daemon=True
        )
        writer.start()
        site._writers.append(writer)


def _reach_process_0(site: Site, host: str) -> None:
    """A follower: connect to process 0's message port (from the store) with the secret."""
    from jax.errors import JaxRuntimeError

    try:
        port, secret = site._client.blocking_key_value_get(CHANNEL, JOIN_SECONDS * 1000).split()
        link = socket.create_connection((host, int(port)), timeout=JOIN_SECONDS)
        link.sendall(bytes.fromhex(secret) + site.process_id.to_bytes(2, "big"))
    except (JaxRuntimeError, OSError) as exc:
        raise SiteLost(site._gone(0, exc)) from None
    link.settimeout(POLL_SECONDS)
    site._links[0] = link


def _read_exactly(link: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = link.recv(count - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data
