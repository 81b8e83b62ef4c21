"""Every option of a run, in one dataclass: the CLI and config files fill it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

QUANTIZATIONS = ("none", "bfloat16", "int8Block")
# A heartbeat timeout spans at least this many intervals: one late beat is not a lost worker.
HEARTBEATS_PER_TIMEOUT = 3


class ConfigError(ValueError):
    """An option has a value that cannot work; the message says which and why."""


# Valid ranges, checked by RunConfig.validate (which names the option in its error).
_AT_LEAST_ONE = (
    "rounds",
    "inner_steps",
    "chunk_steps",
    "batch_size",
    "seq_len",
    "data_max_bytes",
    "workers",
    "eval_every",
    "eval_batches",
    "min_workers",
    "checkpoint_every",
    "max_handshakes_per_host",
    "max_handshakes",
)
_NOT_NEGATIVE = (
    "warmup_steps",
    "weight_decay",
    "grad_clip",
    "round_timeout",
    "seed",
    "max_worker_connections",
    "upload_grace",
    "overlap_steps",
)
_CHOICES = {
    "inner_optimizer": ("adamw", "sgd"),
    "outer_optimizer": ("nesterov", "sgd"),
    "aggregate": ("mean", "trimmed-mean", "median", "centered-clip"),
    "compression": QUANTIZATIONS,
    "compute_dtype": ("float32", "bfloat16"),
    "attention": ("xla", "cudnn"),
}


def _require(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ConfigError(f"--{name.replace('_', '-')} {rule}, got {value!r}")


@dataclass(frozen=True)
class RunConfig:
    # model and data
    model: str = "tiny"  # a preset of pcp_tui.training.models (tiny | small | gpt2)
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
    aggregate: str = "centered-clip"  # mean | trimmed-mean | median | centered-clip
    compression: str = "none"  # pseudo-gradient quantization: none | bfloat16 | int8Block
    seed: int = 0
    # Streaming DiLoCo (pcp_tui/diloco/streaming.py); 1 fragment is plain DiLoCo
    streaming_fragments: int = 1  # F: fragments synced on a staggered schedule each round
    overlap_steps: int = 1  # τ: inner steps a fragment's exchange overlaps before its merge
    mix_alpha: float = 0.5  # α: a merge keeps α of the local fragment, takes 1 − α of the global
    # workers of different speeds (pcp_tui/shepherd/pacing.py)
    adaptive_steps: bool = False  # inner steps per worker in proportion to its measured speed
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
    max_worker_connections: int = 0  # admitted connections at once; 0: --workers + 2
    min_upload_rate: float = 1e6  # bytes/s a result upload must average once upload_grace is over
    upload_grace: float = 10.0  # seconds an upload may take before min_upload_rate applies
    # operator API (see pcp_tui/shepherd/api.py)
    api_host: str = "127.0.0.1"
    api_port: int = 0  # 0: no API
    api_token_env: str = "PCP_API_TOKEN"  # environment variable holding the API's bearer token
    trace: str | None = None  # JSON Lines, one per message (see pcp_tui/contract/trace.py)
    platforms: tuple[str, ...] = field(default=("cpu", "cuda", "rocm"))

    def replace(self, **changes) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def validate(self) -> RunConfig:
        """Raise ConfigError for values that cannot work, naming the option and its range."""
        for name in _AT_LEAST_ONE:
            _require(getattr(self, name) >= 1, name, "must be at least 1", getattr(self, name))
        for name in _NOT_NEGATIVE:
            _require(getattr(self, name) >= 0, name, "must be 0 or more", getattr(self, name))
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            _require(value in allowed, name, f"must be one of {', '.join(allowed)}", value)
        _require(
            0 <= self.port <= 65535, "port", "must be in 0..65535 (0: any free port)", self.port
        )
        for name in ("inner_lr", "outer_lr"):
            _require(getattr(self, name) > 0, name, "must be positive", getattr(self, name))
        _require(
            0 <= self.outer_momentum < 1,
            "outer_momentum",
            "must be in [0, 1) (0: no momentum)",
            self.outer_momentum,
        )
        _require(
            self.heartbeat_seconds > 0,
            "heartbeat_seconds",
            "must be positive",
            self.heartbeat_seconds,
        )
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
        if self.attention == "cudnn" and self.compute_dtype != "bfloat16":
            raise ConfigError(
                "--attention cudnn needs --compute-dtype bfloat16 (cuDNN fused attention has "
                "no float32 kernel); pass both, or --attention xla"
            )
        self._validate_streaming()
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together: pass both or neither")
        _require(
            0 <= self.api_port <= 65535,
            "api_port",
            "must be in 0..65535 (0: no API)",
            self.api_port,
        )
        _require(
            self.api_token_env.isidentifier(),
            "api_token_env",
            "must name an environment variable (letters, digits, _)",
            self.api_token_env,
        )
        _require(
            self.handshake_timeout > 0,
            "handshake_timeout",
            "must be positive",
            self.handshake_timeout,
        )
        _require(
            self.min_upload_rate > 0, "min_upload_rate", "must be positive", self.min_upload_rate
        )
        return self

    def _validate_streaming(self) -> None:
        from pcp_tui.diloco.streaming import schedule_problem  # numpy only; keeps config light

        _require(
            self.streaming_fragments >= 1,
            "streaming_fragments",
            "must be at least 1 (1: plain DiLoCo)",
            self.streaming_fragments,
        )
        _require(0 <= self.mix_alpha <= 1, "mix_alpha", "must be in [0, 1]", self.mix_alpha)
        problem = schedule_problem(
            self.inner_steps, self.streaming_fragments, self.overlap_steps, self.chunk
        )
        if problem is not None:
            raise ConfigError(problem)
        if self.adaptive_steps and self.streaming:
            raise ConfigError(
                "--adaptive-steps works with plain DiLoCo only (a streaming round's fragment "
                "schedule assumes every worker trains H steps); drop one of the two"
            )

    @property
    def streaming(self) -> bool:
        """Whether rounds sync the model in fragments (Streaming DiLoCo), not all at once."""
        return self.streaming_fragments > 1

    @property
    def worker_connections(self) -> int:
        """Admitted connections the shepherd holds at once: the option, or --workers + 2.

        The margin lets a replacement join before a lost worker's silence is noticed.
        """
        return self.max_worker_connections or self.workers + 2

    @property
    def chunk(self) -> int:
        """Inner steps per compiled call: the largest divisor of H not above chunk_steps.

        Streaming also needs every send and merge point between two chunks: k then
        divides H / F and τ as well (τ = 1 means chunks of one step).
        """
        k = min(self.chunk_steps, self.inner_steps)
        share = self.inner_steps // max(self.streaming_fragments, 1) or 1
        steps = (
            (self.inner_steps, share, self.overlap_steps) if self.streaming else (self.inner_steps,)
        )
        while k > 1 and any(n % k for n in steps if n):
            k -= 1
        return max(k, 1)
