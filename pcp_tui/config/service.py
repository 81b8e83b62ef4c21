"""The shepherd as a service: the sections of RunConfig about who connects and how.

Where it listens and how long it waits for a worker (`NetworkConfig`), who may
join and how much an unproven or slow peer may hold (`SecurityConfig`), where
the run is saved (`CheckpointConfig`), and what an operator watches it through
(`OperatorConfig`). Declared like every section (`pcp_tui.config.options`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pcp_tui.config.options import ConfigError, option

# A heartbeat timeout spans at least this many intervals: one late beat is not a lost worker.
HEARTBEATS_PER_TIMEOUT = 3


@dataclass(frozen=True)
class NetworkConfig:
    """network: where the shepherd listens, how many workers it waits for, when it gives up on one"""

    host: str = option("0.0.0.0", help="address to listen on")
    port: int = option(
        8080, at_least=0, at_most=65535, help="TCP port to listen on (0: any free port)"
    )
    workers: int = option(2, at_least=1, help="workers to wait for before round 1")
    min_workers: int = option(
        1,
        at_least=1,
        help="fewest results a round needs before --round-timeout or the straggler window "
        "may close it (at most --workers)",
    )
    round_timeout: float = option(
        0.0,
        at_least=0,
        help="close a round after this many seconds with the results it has (0: wait for all)",
    )
    straggler_factor: float = option(
        4.0,
        at_least=0,
        help="once --min-workers results are in, each other worker has this many times "
        "their time, or its own (its latest result's, or this round's as its progress "
        "projects it) if longer, up to this factor squared times theirs (from its "
        "roundStart's delivery), before the round closes without it; a result under way "
        "is waited for (0: wait for all)",
    )
    straggler_min_seconds: float = option(
        60.0,
        above=0,
        help="the least time --straggler-factor gives a worker, in seconds",
    )
    heartbeat_seconds: float = option(
        2.0,
        above=0,
        help="heartbeat interval, of the shepherd and (told in the welcome) its workers",
    )
    heartbeat_timeout: float = option(
        20.0,
        help="seconds of silence before a worker counts as lost (at least 3x --heartbeat-seconds)",
    )
    streams: int = option(
        1,
        at_least=1,
        at_most=16,
        help="TCP connections each worker's session is striped over (1: one, as before); "
        "one stream moves at most its window per round trip, so long fat links need several",
    )
    relays: int = option(
        0,
        at_least=0,
        help="relays (pcp-tui relay) that may connect with the token, each carrying its "
        "workers' connections over one link (0: none; a relay sees its workers' bytes, so "
        "allow only relays you run)",
    )

    def check(self) -> None:
        if self.heartbeat_timeout < HEARTBEATS_PER_TIMEOUT * self.heartbeat_seconds:
            raise ConfigError(
                f"--heartbeat-timeout ({self.heartbeat_timeout:g} s) must be at least "
                f"{HEARTBEATS_PER_TIMEOUT}x --heartbeat-seconds ({self.heartbeat_seconds:g} s): "
                "a worker counts as lost after that much silence, so it needs room for several "
                "heartbeats (e.g. 10x)"
            )
        if self.min_workers > self.workers:
            raise ConfigError(
                f"--min-workers {self.min_workers} is more than --workers {self.workers}: "
                "--min-workers is the fewest results a round needs before --round-timeout "
                "may close it, so it cannot exceed the workers the run waits for"
            )


@dataclass(frozen=True)
class SecurityConfig:
    """security: who may join, over what, and how much an unproven or slow peer may hold"""

    token: str | None = option(
        None,
        example="change-me",
        help="join token workers must prove (default: $PCP_TOKEN or a random one; "
        "prefer $PCP_TOKEN to keep secrets out of files you share)",
    )
    tls_cert: str | None = option(
        None,
        example="shepherd.pem",
        help="PEM certificate: workers connect over TLS (the join command then pins its "
        "fingerprint)",
    )
    tls_key: str | None = option(None, example="shepherd.key", help="PEM private key of --tls-cert")
    worker_keys: str | None = option(
        None,
        example="workers.keys",
        metavar="FILE",
        help="admit only workers that sign the handshake with a key listed here, one "
        "'ssh-ed25519 KEY NAME' line each (pcp-tui keygen prints it), as worker id NAME; "
        "remove a line to revoke it: the file is re-read when it changes, and that worker "
        "leaves before the next round (default: anyone with the token)",
    )
    weight_per: str = option(
        "address",
        choices=("address", "id"),
        help="what one share of the aggregate's weight belongs to in an open run (no "
        "--worker-keys): address, the ids that connect from one address (an IPv6 /64; a "
        "relayed worker's is its relay's) share one id's weight, so a token holder gains none by "
        "joining as many ids; id, every id weighs its own tokens (for runs whose token "
        "holders are all trusted: ids on one machine then count in full). With "
        "--worker-keys every key is one id",
    )
    handshake_timeout: float = option(
        10.0,
        above=0,
        help="seconds a new connection has to prove the token before it is dropped (and a "
        "welcomed worker to attach its --streams connections before it goes on with one)",
    )
    max_handshakes_per_host: int = option(
        8, at_least=1, help="unfinished handshakes one address may hold; more are closed at once"
    )
    max_handshakes: int = option(
        64, at_least=1, help="unfinished handshakes in all; more are closed at once"
    )
    max_worker_connections: int = option(
        0,
        at_least=0,
        help="admitted worker connections at once; more are refused as busy (0: --workers + 2)",
    )
    ready_timeout: float = option(
        600.0,
        above=0,
        help="seconds an admitted worker has to compile the plan and say ready before its "
        "connection is dropped; when every connection is taken, one not ready after 45 s "
        "(or a quarter of this, if less) already gives its slot to a newcomer, as does a "
        "ready one that shows no progress or result that long after its round started",
    )
    min_upload_rate: float = option(
        1e6,
        above=0,
        help="bytes/s a round result upload (and a message to a worker) must average after "
        "--upload-grace; slower links are dropped",
    )
    upload_grace: float = option(
        10.0,
        at_least=0,
        help="seconds a round result upload (or a message to a worker) may take before "
        "--min-upload-rate applies",
    )

    def check(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together: pass both or neither")


@dataclass(frozen=True)
class CheckpointConfig:
    """checkpoints: where the run is saved, how often, and where it resumes from"""

    dir: str | None = option(
        None,
        flat="checkpoint_dir",
        example="checkpoints",
        help="write checkpoints (safetensors + JSON) into this directory "
        "(default: the --resume directory, if any)",
    )
    every: int = option(
        5,
        flat="checkpoint_every",
        at_least=1,
        help="checkpoint every N rounds (and when the run stops)",
    )
    resume: str | None = option(
        None,
        example="checkpoints",
        help="continue the run from the latest checkpoint in this directory",
    )


@dataclass(frozen=True)
class OperatorConfig:
    """operator: what a person running the shepherd watches it through"""

    api_host: str = option(
        "127.0.0.1",
        help="address the operator API listens on (0.0.0.0: every interface; keep it private)",
    )
    api_port: int = option(
        0,
        at_least=0,
        at_most=65535,
        help="serve the operator HTTP API and Prometheus /metrics on this port "
        "(0: no API; HTTPS with --tls-cert)",
    )
    api_token_env: str = option(
        "PCP_API_TOKEN",
        help="environment variable that holds the API's bearer token "
        "(required when --api-port is set)",
    )
    headless: bool = option(False, help="no dashboard: one line per round")
    metrics: str | None = option(
        None, example="run.jsonl", help="append JSON Lines metrics to this file"
    )
    trace: str | None = option(
        None,
        example="shepherd.trace",
        help="append one JSON line per protocol message sent or received to this file "
        "(rotated at 64 MiB)",
    )
    wandb: str | None = option(
        None,
        example="my-project",
        help="log round metrics to this Weights & Biases project (extra: pcp-tui[wandb]; "
        "WANDB_MODE=offline: no network)",
    )
    tensorboard: str | None = option(
        None,
        example="runs/",
        help="write round metrics as TensorBoard event files into this directory "
        "(extra: pcp-tui[tensorboard])",
    )

    def check(self) -> None:
        if not self.api_token_env.isidentifier():
            raise ConfigError(
                f"--api-token-env must name an environment variable (letters, digits, _), "
                f"got {self.api_token_env!r}"
            )
