"""Every option of a run, in one dataclass: the CLI and config files fill it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

QUANTIZATIONS = ("none", "bfloat16", "int8Block")


class ConfigError(ValueError):
    """An option has a value that cannot work; the message says which and why."""


@dataclass(frozen=True)
class RunConfig:
    # model and data
    model: str = "tiny"  # a preset of pcp_tui.models (tiny | small | gpt2)
    data: str | None = None  # None: the embedded corpus (Python's own stdlib sources)
    data_max_bytes: int = 4 * 2**20
    seq_len: int = 128
    batch_size: int = 16
    compute_dtype: str = "float32"  # float32 | bfloat16
    attention: str = "xla"  # xla | cudnn
    # DiLoCo
    rounds: int = 20
    inner_steps: int = 50  # H
    chunk_steps: int = 10  # inner steps per compiled call (progress granularity)
    inner_optimizer: str = "adamw"  # adamw | sgd
    inner_lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    outer_optimizer: str = "nesterov"  # nesterov | sgd
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    compression: str = "none"  # pseudo-gradient quantization: none | bfloat16 | int8Block
    seed: int = 0
    # evaluation
    eval_every: int = 1
    eval_batches: int = 8
    # run shape
    workers: int = 2  # workers to wait for before round 1
    host: str = "0.0.0.0"
    port: int = 8080
    heartbeat_seconds: float = 2.0
    heartbeat_timeout: float = 20.0
    round_timeout: float = 0.0  # 0: wait for every worker of the round
    min_workers: int = 1  # fewest results a round needs once started
    token: str | None = None
    metrics: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 5  # rounds; a checkpoint is also written when the run stops
    resume: str | None = None  # checkpoint directory to continue from
    # admission and transport security (see pcp_tui/admission.py, pcp_tui/tls.py)
    tls_cert: str | None = None  # PEM certificate: workers then connect over TLS
    tls_key: str | None = None  # PEM private key of tls_cert
    handshake_timeout: float = 10.0  # seconds a new connection has to finish its handshake
    max_handshakes_per_host: int = 8  # unfinished handshakes one address may hold at once
    max_handshakes: int = 64  # unfinished handshakes in all
    platforms: tuple[str, ...] = field(default=("cpu", "cuda", "rocm"))

    def replace(self, **changes) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def validate(self) -> RunConfig:
        """Raise ConfigError for values that cannot work."""
        positive = (
            "rounds",
            "inner_steps",
            "chunk_steps",
            "batch_size",
            "seq_len",
            "workers",
            "eval_every",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}"
                )
        if self.inner_optimizer not in ("adamw", "sgd"):
            raise ConfigError(
                f"--inner-optimizer must be adamw or sgd, got {self.inner_optimizer!r}"
            )
        if self.outer_optimizer not in ("nesterov", "sgd"):
            raise ConfigError(
                f"--outer-optimizer must be nesterov or sgd, got {self.outer_optimizer!r}"
            )
        if self.compression not in QUANTIZATIONS:
            raise ConfigError(f"--compression must be one of {', '.join(QUANTIZATIONS)}")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ConfigError("--compute-dtype must be float32 or bfloat16")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        if self.inner_lr <= 0 or self.outer_lr <= 0:
            raise ConfigError("learning rates must be positive")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together: pass both or neither")
        if (
            self.handshake_timeout <= 0
            or self.max_handshakes_per_host < 1
            or self.max_handshakes < 1
        ):
            raise ConfigError(
                "--handshake-timeout, --max-handshakes-per-host and --max-handshakes must be positive"
            )
        return self

    @property
    def chunk(self) -> int:
        """Inner steps per compiled call: the largest divisor of H not above chunk_steps."""
        k = min(self.chunk_steps, self.inner_steps)
        while self.inner_steps % k:
            k -= 1
        return k
