"""Where the shepherd can be reached: its workers' listening sockets and the join command.

The shepherd listens on `--host:--port`; what it shows people (the address in
the dashboard, the `pcp-tui worker --connect ...` line to copy) must be an
address other machines can use, which "0.0.0.0" is not: `advertised` asks the
routing table for this machine's outward address instead.
"""

from __future__ import annotations

import errno
import resource
import socket

import trio

from pcp_tui.contract.tls import ServerTLS

EVERYWHERE = ("0.0.0.0", "::", "")  # hosts that mean "every interface of this machine"
# descriptors beside the workers' sockets: listeners, the API's, files, JAX's, refused peers
SPARE_FILES = 256


class CannotListen(OSError):
    """The shepherd cannot listen where it was told; the message says what to pick instead."""


async def open_listeners(host: str, port: int) -> tuple[list[trio.SocketListener], int]:
    """(the listeners on `host:port`, the port they got); CannotListen."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        where = f"{host}:{port}"
        if exc.errno == errno.EADDRNOTAVAIL:
            raise CannotListen(
                f"cannot listen on {where}: {host} is not an address of "
                "this machine; use one of its addresses or 0.0.0.0"
            ) from None
        raise CannotListen(
            f"cannot listen on {where} ({exc.strerror}); pick another --port"
        ) from None
    return listeners, listeners[0].socket.getsockname()[1]


def open_files_for(connections: int, streams: int) -> str:
    """Raise this process's open-files soft limit to what `connections` admitted workers of
    `streams` sockets each need (up to the hard limit); "" or a warning saying what to do.

    Linux starts most shells at a soft limit of 1,024: a thousand workers, or 250 with
    --streams 4, would otherwise fail in `accept` ("Too many open files") as they join.
    """
    needed = connections * streams + SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return ""
    raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if raised > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    if raised >= needed:
        return ""
    return (
        f"{connections} worker connection(s) x {streams} stream(s) need about {needed} open "
        f"files and this process may hold {raised} (its hard limit): raise it (`ulimit -Hn "
        f"{needed}` as root, or LimitNOFILE= in a systemd unit) or lower "
        "--max-worker-connections"
    )


def advertised(host: str, port: int) -> str:
    """The address to show for a socket bound to `host:port`, as `--connect` takes it: `host`
    (an IPv6 one in brackets: `::1:8080` is refused), or this machine's own."""
    shown = address_for_others() if host in EVERYWHERE else host
    return f"[{shown}]:{port}" if ":" in shown else f"{shown}:{port}"


def join_command(address: str, token: str, tls: ServerTLS | None, *, keyed: bool = False) -> str:
    """The command line that joins a worker to the shepherd at `address`; `keyed`
    (--worker-keys): with the placeholders of the worker's own key and id."""
    flags = tls.worker_flags() if tls else []
    if keyed:
        flags += ["--key", "<KEY_FILE>", "--id", "<ITS_NAME_IN_WORKER_KEYS>"]
    return " ".join(["pcp-tui", "worker", "--connect", address, "--token", token, *flags])


def address_for_others() -> str:
    """The address other machines most likely reach this one at, for the join command.

    Listening on all interfaces says nothing about which one: ask the routing
    table which source address a packet to a public address would leave from
    (a UDP connect sends nothing). A machine with no route out gets 127.0.0.1,
    which is right for workers on the same machine.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1 (RFC 5737): never answered, never sent
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"
