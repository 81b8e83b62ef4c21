"""RelayConfig: every option of `pcp-tui relay`, declared like WorkerConfig's.

A relay joins the shepherd as a worker does (the `connection` section is the
worker's: --connect, --token, --id, --key, TLS to the shepherd, --give-up-after,
with the relay's own words for --connect, --id and --give-up-after)
and serves workers as the shepherd does (`listen`: where, with which TLS
certificate, how many at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pcp_tui.config.options import ConfigError, Sections, option
from pcp_tui.config.worker import ConnectionConfig, LogConfig


@dataclass(frozen=True)
class RelayConnectionConfig(ConnectionConfig):
    """connection: which shepherd to join, how to prove it, and how long to keep trying"""

    connect: str = option(
        "",
        required=True,
        metavar="HOST:PORT",
        help="the shepherd's address, as its join command prints it (one: a relay joins no relay)",
    )
    worker_id: str | None = option(
        None,
        flag="id",
        metavar="NAME",
        help="the relay's name: the shepherd's log, dashboard and /v1/workers show its workers "
        "as from NAME/ADDRESS, and under --worker-keys its key's line names it (default: "
        "relay-HOSTNAME)",
    )
    give_up_after: float = option(
        1800.0,
        at_least=0,
        metavar="SECONDS",
        help="the total time to spend trying to get in, or back in after a lost link, before "
        "giving up (exit 1); retries wait about 1 s, then twice as long each time, up to 30 s, "
        "jittered; the relay's workers retry on their own meanwhile",
    )

    def check(self) -> None:
        if len(self.addresses) > 1:
            raise ConfigError(
                f"--connect {self.connect!r}: a relay joins one shepherd: pass its HOST:PORT only"
                " (its workers take a list: pcp-tui worker --connect RELAY:PORT,SHEPHERD:PORT)"
            )


@dataclass(frozen=True)
class ListenConfig:
    """listen: where the relay's workers connect"""

    host: str = option("0.0.0.0", help="address to listen on for workers")
    port: int = option(
        8081, at_least=0, at_most=65535, help="TCP port workers connect to (0: any free port)"
    )
    tls_cert: str | None = option(
        None,
        metavar="FILE",
        help="PEM certificate: the relay's workers connect over TLS (with "
        "--tls-fingerprint of this certificate)",
    )
    tls_key: str | None = option(None, metavar="FILE", help="PEM private key of --tls-cert")
    max_workers: int = option(
        1024, at_least=1, help="worker connections the relay carries at once; more are closed"
    )

    def check(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together: pass both or neither")


@dataclass(frozen=True, init=False)
class RelayConfig(Sections):
    """Every option of a relay process; built from `pcp-tui relay`'s flags or from Python."""

    connection: RelayConnectionConfig = field(default_factory=RelayConnectionConfig)
    listen: ListenConfig = field(default_factory=ListenConfig)
    log: LogConfig = field(default_factory=LogConfig)
