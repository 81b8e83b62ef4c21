"""RelayConfig: every option of `pcp-tui relay`, declared like WorkerConfig's.

A relay joins the shepherd as a worker does (the `connection` section is the
worker's: --connect, --token, --id, --key, TLS to the shepherd, --give-up-after)
and serves workers as the shepherd does (`listen`: where, with which TLS
certificate, how many at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pcp_tui.config.options import ConfigError, Sections, option
from pcp_tui.config.worker import ConnectionConfig, LogConfig


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

    connection: ConnectionConfig = field(default_factory=ConnectionConfig)
    listen: ListenConfig = field(default_factory=ListenConfig)
    log: LogConfig = field(default_factory=LogConfig)
