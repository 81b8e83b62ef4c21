"""A site: several processes, one a host, that train as one worker over multi-controller JAX.

Each process of a site calls `join_site` with JAX's own names (the
coordinator's address, the number of processes, its id). Process 0 holds the
PCP session; the others follow it: every message of its session that says
what to compute (the welcome, the plan, round starts, fragment updates) goes
to them as it comes, over the coordination service's key-value store
(`Site.send`, `Site.receive`), and each runs it as process 0 does
(`client.Worker.follow`), so the graphs run over the global mesh with every
process in step. The store, not a device collective, carries them: a
follower waits for the next message for as long as the shepherd takes, and a
collective waited in beside training would have to be entered in the same
order as training's own on every process. A one-process worker is a site of
one (`Site.alone`): nothing to send.

The site is one failure unit. A process that stops heartbeating for
`heartbeat_seconds` (it died, or its host did) makes JAX's coordination
service end every other process (checked on JAX 0.10.2, CPU: the survivor
aborts with "The following tasks are unhealthy (stopped sending heartbeats)",
never hangs in the collective it was waiting in); a follower whose process 0
is gone hears it at once from the store (`SiteLost`). A process 0 whose session
ends, for any reason, tells the followers (`Site.end`), and the site exits as
one: a lost shepherd is not retried by a site, whose processes may be mid-round
at different points; restart the site's processes to rejoin.

The coordination service has no authentication and no TLS in JAX's API
(`jax.distributed.initialize` takes none): anyone who reaches its port can
join the site or read what it shares. It must stay on a trusted LAN;
`join_site` says so once.
"""

from __future__ import annotations

import contextlib
import platform as host_platform
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

HEARTBEAT_SECONDS = 10  # a process silent this long is dead: the whole site ends
JOIN_SECONDS = 120  # how long a process waits for the site's others to start (JAX's: 300)
HOSTNAME_BYTES = 64
MESSAGES = "pcp-tui/messages"  # process 0's messages to the followers, numbered, in the store
POLL_MS = 1000  # a follower's wait for the next message, renewed until it comes
END_WAIT_SECONDS = 30  # how long the site's processes wait for each other at the end
MESSAGE, END = b"m", b"e"  # what a message to the followers is: a PCP message, or the end

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
    _sent: int = 0  # messages process 0 sent the followers; on a follower: received
    _client: Any = field(default=None, repr=False)  # the coordination service's client

    @classmethod
    def alone(cls) -> Site:
        """A one-process worker's site: itself."""
        return cls(0, 1, (host_platform.node(),))

    @property
    def leads(self) -> bool:
        """Whether this process holds the PCP session (process 0)."""
        return self.process_id == 0

    def send(self, data: bytes) -> None:
        """Process 0: `data` is the followers' next message (blocks while the store takes it)."""
        assert self.leads, "only process 0 sends"
        if self.process_count > 1:
            self._client.key_value_set_bytes(f"{MESSAGES}/{self._sent}", MESSAGE + data)
            self._sent += 1

    def receive(self) -> bytes | SiteEnd:
        """A follower: process 0's next message, or the site's end, waiting as long as it
        takes; SiteLost if process 0 is gone. The last follower to read a message deletes it
        from the store."""
        assert not self.leads, "process 0 sends"
        from jax.errors import JaxRuntimeError

        key = f"{MESSAGES}/{self._sent}"
        while True:
            try:
                data = self._client.blocking_key_value_get_bytes(key, POLL_MS)
                if self._client.key_value_increment(f"{key}/read", 1) == self.process_count - 1:
                    self._client.key_value_delete(key)
                    self._client.key_value_delete(f"{key}/read")
                break
            except JaxRuntimeError as exc:
                if str(exc).startswith("DEADLINE_EXCEEDED"):
                    continue  # nothing yet: the shepherd is slow, or between rounds
                raise SiteLost(self._gone(0, exc)) from None
        self._sent += 1
        if data.startswith(END):
            return SiteEnd(data[len(END)], data[len(END) + 1 :].decode(errors="replace"))
        return data[len(MESSAGE) :]

    def end(self, code: int, reason: str) -> None:
        """Process 0: the worker ended (`code`, the exit code, and why): the followers end
        too. Leaves the site once they have read it (`leave`)."""
        if self.process_count > 1:
            data = END + bytes([min(max(code, 0), 255)]) + reason.encode()
            self._client.key_value_set_bytes(f"{MESSAGES}/{self._sent}", data)
            self._sent += 1
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
) -> Site:
    """Start multi-controller JAX for this process of a site; its `Site`.

    Call it before any other JAX call of the process (JAX's rule). Process 0
    runs the coordination service, bound to `bind_address` (default: every
    interface, on the address's port) and warns once that it must stay on a
    trusted LAN. On CPU the collectives go over Gloo.
    """
    import jax
    from jax.experimental import multihost_utils

    if not 0 <= process_id < process_count:
        raise ValueError(
            f"--process-id {process_id} is not one of the site's {process_count} processes "
            f"(0 to {process_count - 1})"
        )
    if process_id == 0:
        print(
            f"pcp-tui: warning: {TRUSTED_LAN.format(address=bind_address or coordinator_address)}",
            file=sys.stderr,
            flush=True,
        )
    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX waits here for every process, unable to hear a signal, then ends the process with
    # its own fatal log line: say first what it waits for
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

    return Site(process_id, process_count, hostnames, _client=distributed.global_state.client)
