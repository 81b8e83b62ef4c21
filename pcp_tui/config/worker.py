"""WorkerConfig: every option of `pcp-tui worker`, declared like RunConfig's; and LogConfig.

LogConfig is a section of both commands: the worker's config holds it, and the
shepherd and demo commands take the same flags (`--log-level`, `--log-file`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pcp_tui.config.options import ConfigError, Sections, option

LOG_LEVELS = ("debug", "info", "warning", "error")
BACKENDS = ("auto", "cpu", "cuda", "rocm", "metal", "vulkan")
RUNTIMES = ("auto", "xla", "iree")


def default_compile_cache() -> str:
    """$PCP_COMPILE_CACHE, else pcp-tui/xla under $XDG_CACHE_HOME (default ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("PCP_COMPILE_CACHE", os.path.join(base, "pcp-tui", "xla"))


def parse_connect(text: str) -> tuple[str, int]:
    """`HOST:PORT` or `[IPv6]:PORT` -> (host, port); ConfigError says what is wrong and how."""
    example = "e.g. 10.0.0.5:8080 or [::1]:8080"
    if "://" in text:
        scheme = text.partition("://")[0]
        raise ConfigError(
            f"--connect wants HOST:PORT, got {text!r}: leave out {scheme}:// "
            f"(workers speak PCP over TCP, not {scheme}), {example}"
        )
    if text.startswith("["):
        host, bracket, port_text = text[1:].partition("]:")
        if not bracket or not host:
            raise ConfigError(f"--connect wants [IPv6]:PORT, got {text!r} ({example})")
    else:
        host, colon, port_text = text.rpartition(":")
        if ":" in host:
            raise ConfigError(
                f"--connect {text!r}: put an IPv6 address in brackets, e.g. [{host}]:{port_text}"
            )
        if not colon or not host:
            raise ConfigError(f"--connect wants HOST:PORT, got {text!r} ({example})")
    if not (port_text.isascii() and port_text.isdigit() and 1 <= int(port_text) <= 65535):
        raise ConfigError(f"--connect {text!r}: the port must be a number in 1..65535")
    if any(c.isspace() or c in "/?#@[]" for c in host):
        raise ConfigError(f"--connect {text!r}: {host!r} is not a host name or address")
    return host, int(port_text)


@dataclass(frozen=True)
class ConnectionConfig:
    """connection: which shepherd to join, how to prove it, and how long to keep trying"""

    connect: str = option(
        "",
        required=True,
        metavar="HOST:PORT",
        help="the shepherd's address, or a relay's (pcp-tui relay); several, comma-separated "
        "(e.g. a relay's, then the shepherd's): each try after a failed or lost connection "
        "goes to the next",
    )
    token: str | None = option(None, help="join token the shepherd printed (default: $PCP_TOKEN)")
    worker_id: str | None = option(
        None, flag="id", help="stable worker id (default: host-pid-random)"
    )
    key: str | None = option(
        None,
        metavar="FILE",
        help="sign the handshake with this private key (pcp-tui keygen --out FILE), as a "
        "shepherd with --worker-keys asks; join with the --id its line there names",
    )
    reconnect: bool = option(  # a switch on by default: its help describes --no-reconnect
        True, help="exit instead of reconnecting when the link breaks"
    )
    give_up_after: float = option(
        1800.0,
        at_least=0,
        metavar="SECONDS",
        help="the total time to spend trying to get in, or back in after a lost connection, "
        "before giving up (exit 1): connects, handshakes and the waits between them all count, "
        "and a connect that is then refused is no welcome; retries wait about 1 s, then twice "
        "as long each time, up to 30 s, jittered: a run that ended while this worker was cut "
        "off never says goodbye to it",
    )
    tls_ca: str | None = option(
        None,
        metavar="FILE",
        help="connect over TLS, trusting the shepherd's certificate if this CA signed it "
        "(with --tls-fingerprint too, the certificate must pass both)",
    )
    tls_fingerprint: str | None = option(
        None,
        metavar="SHA256",
        help="connect over TLS, trusting only the shepherd certificate with this SHA-256 "
        "(printed in its join command; with --tls-ca too, the certificate must pass both)",
    )
    source_address: str | None = option(
        None,
        metavar="ADDRESS",
        help="the local address to connect from (a machine with several; default: the one "
        "the route to the shepherd picks)",
    )

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) of --connect (its first); ConfigError says what is wrong and how to fix it."""
        return self.addresses[0]

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Every (host, port) of --connect, in order."""
        return [parse_connect(text.strip()) for text in self.connect.split(",")]

    def check(self) -> None:
        self.addresses  # noqa: B018 (parsing is the check)


@dataclass(frozen=True)
class ComputeConfig:
    """compute: where the shipped graphs run"""

    backend: str = option(
        "auto",
        choices=BACKENDS,
        help="where to run the graphs; auto picks cuda, rocm or metal when present, else cpu "
        "(with --runtime iree: vulkan, metal, else cpu)",
    )
    runtime: str = option(
        "auto",
        choices=RUNTIMES,
        help="what compiles the graphs: xla (through JAX) or iree (pip install 'pcp-tui[iree]'; "
        "any Vulkan GPU, Apple GPUs, CPUs); auto is xla where JAX serves the backend, iree where "
        "only IREE does, e.g. vulkan",
    )
    iree_flags: str = option(
        "",
        metavar="FLAGS",
        help="extra iree-compile flags for --runtime iree, space-separated, e.g. "
        "--iree-flags=--iree-vulkan-target=ampere for code made for the GPU (IREE's generic "
        "Vulkan target is much slower)",
    )
    devices: str = option(
        "all",
        metavar="all|N",
        help="train on all (or the first N) local devices of the backend as one worker: the "
        "batch is split across them and the run's [sharding] places the parameters; the run's "
        "--batch-size must be a multiple of N",
    )
    compile_cache: str = option(
        factory=default_compile_cache,
        metavar="DIR",
        help="keep compiled graphs here so a restart does not recompile ('' to disable; "
        "a site of several processes keeps none)",
    )

    @property
    def device_count(self) -> int | None:
        """--devices as a count: None for all."""
        return None if self.devices == "all" else int(self.devices)

    def check(self) -> None:
        if self.devices != "all" and not (self.devices.isdigit() and int(self.devices) >= 1):
            raise ConfigError(
                f"--devices must be all or a positive number of devices, got {self.devices!r}"
            )


@dataclass(frozen=True)
class SiteConfig:
    """site: several hosts' processes as one worker (multi-controller JAX)"""

    coordinator_address: str = option(
        "",
        metavar="HOST:PORT",
        help="make this process one of a site's: the address of process 0's coordination "
        "service, which process 0 binds on every interface (no authentication: keep it on a "
        "trusted LAN); every process of the site passes the same",
    )
    num_processes: int = option(
        1,
        at_least=1,
        metavar="N",
        help="the site's processes, one a host (with --coordinator-address)",
    )
    process_id: int = option(
        0,
        at_least=0,
        metavar="I",
        help="this process's place in the site, 0 to N-1: process 0 joins the shepherd, the "
        "others follow it; the site ends as one if any of them dies or loses the shepherd",
    )

    def check(self) -> None:
        if self.num_processes > 1 and not self.coordinator_address:
            raise ConfigError(
                f"--num-processes {self.num_processes} needs --coordinator-address HOST:PORT "
                "(process 0's host and a free port, the same on every process of the site)"
            )
        if self.coordinator_address and self.num_processes == 1:
            raise ConfigError(
                "--coordinator-address makes this process one of a site's: pass "
                "--num-processes N (the site's processes, 2 or more) and --process-id I"
            )
        if self.coordinator_address:
            try:
                parse_connect(self.coordinator_address)
            except ConfigError as exc:
                raise ConfigError(str(exc).replace("--connect", "--coordinator-address")) from None
        if self.process_id >= self.num_processes:
            hint = " (pass --num-processes N)" if self.num_processes == 1 else ""
            raise ConfigError(
                f"--process-id {self.process_id} is not one of the site's {self.num_processes} "
                f"processes (0 to {self.num_processes - 1}){hint}"
            )


@dataclass(frozen=True)
class OutputConfig:
    """output: what the worker shows and records"""

    quiet: bool = option(
        False,
        help="print only errors: no status lines, no warnings (no TLS, ...); --log-level info "
        "or debug and --log-file still log",
    )
    trace: str | None = option(
        None,
        metavar="FILE",
        help="append one JSON line per protocol message sent or received to FILE "
        "(rotated at 64 MiB)",
    )
    parent_fd: int | None = option(  # a demo's local workers: see launch._worker_process
        None, hidden=True, help="pipe whose end-of-file means the demo that started it exited"
    )


@dataclass(frozen=True)
class LogConfig:
    """logging: connection-level diagnostics beside the run's own output"""

    level: str = option(
        "warning",
        flat="log_level",
        choices=LOG_LEVELS,
        help="info: joins, losses, refusals and reconnects; debug: also every message sent "
        "and received, with its size",
    )
    file: str | None = option(
        None,
        flat="log_file",
        metavar="PATH",
        help="append the log to this file instead of standard error",
    )


@dataclass(frozen=True, init=False)
class WorkerConfig(Sections):
    """Every option of a worker process; built from `pcp-tui worker`'s flags or from Python."""

    connection: ConnectionConfig = field(default_factory=ConnectionConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    site: SiteConfig = field(default_factory=SiteConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    log: LogConfig = field(default_factory=LogConfig)
