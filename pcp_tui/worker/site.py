"""A site: several processes, one a host, that train as one worker over multi-controller JAX.

Each process of a site calls `join_site` with JAX's own names (the
coordinator's address, the number of processes, its id). Process 0 holds the
PCP session; the others follow it: what they must run comes from process 0
over the site's own collectives (`Site.share`: a broadcast over every
process's devices, Gloo on CPU), and the graphs run over the global mesh.

The site is one failure unit, and that is JAX's coordination service's doing:
a process that stops heartbeating for `heartbeat_seconds` (it died, or its
host did) makes the service end every other process (checked on JAX 0.10.2,
CPU, 2 processes: the survivor aborted after the heartbeat timeout, never
hung in the collective it was waiting in).

The coordination service has no authentication and no TLS in JAX's API
(`jax.distributed.initialize` takes none): anyone who reaches its port can
join the site or read what it shares. It must stay on a trusted LAN;
`join_site` says so once.
"""

from __future__ import annotations

import logging
import platform as host_platform
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 10  # a process silent this long is dead: the whole site ends
HOSTNAME_BYTES = 64

TRUSTED_LAN = (
    "the site's coordination service ({address}) has no authentication or encryption "
    "(JAX offers none): keep it on a trusted LAN, never on a port the internet reaches"
)


@dataclass(frozen=True)
class Site:
    """This process's place in its site: `process_id` of `process_count`, and each one's host."""

    process_id: int
    process_count: int
    hostnames: tuple[str, ...]

    @property
    def leads(self) -> bool:
        """Whether this process holds the PCP session (process 0)."""
        return self.process_id == 0

    def share(self, data: bytes | None) -> bytes:
        """Process 0's `data`, on every process (a collective: every process calls it, in the
        same order; the others pass None).

        Two broadcasts over the site's devices: the length, then the bytes.
        """
        from jax.experimental import multihost_utils

        mine_size = np.array([len(data) if self.leads and data is not None else 0], np.int64)
        size = int(np.asarray(multihost_utils.broadcast_one_to_all(mine_size))[0])
        if size == 0:
            return b""
        mine = np.frombuffer(data, np.uint8) if self.leads and data else np.zeros(size, np.uint8)
        return np.asarray(multihost_utils.broadcast_one_to_all(mine)).tobytes()


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
        log.warning(TRUSTED_LAN.format(address=bind_address or coordinator_address))
    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=process_count,
        process_id=process_id,
        heartbeat_timeout_seconds=heartbeat_seconds,
        coordinator_bind_address=bind_address,
    )
    mine = host_platform.node().encode()[:HOSTNAME_BYTES].ljust(HOSTNAME_BYTES, b"\0")
    every = multihost_utils.process_allgather(np.frombuffer(mine, np.uint8))
    hostnames = tuple(
        bytes(row).rstrip(b"\0").decode(errors="replace")
        for row in np.asarray(every).reshape(process_count, HOSTNAME_BYTES)
    )
    return Site(process_id, process_count, hostnames)
