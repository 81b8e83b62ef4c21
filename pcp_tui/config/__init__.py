"""Every option, declared once: RunConfig (shepherd, demo) and WorkerConfig (worker).

An option is one field of a section dataclass, e.g. in `InnerConfig`::

    steps: int = option(50, flat="inner_steps", at_least=1, help="H: inner steps per round")

That line gives its type, default, range and help. Generated from it:

- the flag `--inner-steps` with its help, in the `inner` group of `--help`
  (`pcp_tui.app.options_cli`); flags stay flat, named by `flat`;
- the TOML keys `[inner] steps = 50` and the flat `inner_steps = 50`, and the
  reference file `examples/run.toml` (`pcp_tui.app.config_file`; regenerate with
  `python -m pcp_tui.app.config_file > examples/run.toml`, a test keeps it equal);
- validation of its range (`RunConfig.validate`); rules across options are the
  `check()` methods of the sections: cudnn needs bfloat16 (`ModelConfig`), the
  heartbeat timeout spans 3 heartbeats and --min-workers <= --workers
  (`NetworkConfig`), --tls-cert and --tls-key go together (`SecurityConfig`);
  a rule across sections would be `RunConfig.check`;
- the keyword `RunConfig(inner_steps=5)` / `config.replace(inner_steps=5)`.

Code reads options nested: `config.inner.steps`. `FLAT_PATHS` maps each flat
name to its nested path.

To add an option: add one `option(...)` field to the section it belongs to
(with `flat=` when the field's name alone would be unclear outside its section:
`steps` is `inner_steps`), read it as `config.section.field`, and regenerate
examples/run.toml. Nothing else: flag, help group, TOML key and range check follow.
A new section is a frozen dataclass of such fields plus one field of RunConfig.

Why not a library: tyro and draccus (levanter's parser) prefix a nested field
with its section (`--inner.steps`); tyro's OmitArgPrefixes drops the section
instead (`--steps`, which then clashes between inner and outer). Neither spells
today's `--inner-steps`, so every command line, README line, test and benchmark
would change, and their help and error texts are their own (tyro's in rich
boxes). pydantic-settings has a TOML source and a CLI, but swaps frozen
dataclasses for pydantic models with nested flags and its own errors, for a
large compiled dependency. What we need (flat flags, sections, ranges whose
errors name the flag, a TOML reader that names the close match, a generated
reference file) is ~250 lines over `dataclasses.fields`, in
`pcp_tui.config.options` and the two generators in `pcp_tui.app`.
"""

from pcp_tui.config.options import ConfigError, Option, Sections, Spec, flat_names, option, specs
from pcp_tui.config.run import (
    QUANTIZATIONS,
    DataConfig,
    EvaluationConfig,
    InnerConfig,
    ModelConfig,
    OuterConfig,
    RunConfig,
    ShardingConfig,
)
from pcp_tui.config.service import (
    HEARTBEATS_PER_TIMEOUT,
    CheckpointConfig,
    NetworkConfig,
    OperatorConfig,
    SecurityConfig,
)
from pcp_tui.config.worker import (
    BACKENDS,
    LOG_LEVELS,
    ComputeConfig,
    ConnectionConfig,
    LogConfig,
    OutputConfig,
    WorkerConfig,
)

FLAT_PATHS = {flat: spec.path for flat, spec in flat_names(RunConfig).items()}

__all__ = [
    "BACKENDS",
    "FLAT_PATHS",
    "HEARTBEATS_PER_TIMEOUT",
    "LOG_LEVELS",
    "QUANTIZATIONS",
    "CheckpointConfig",
    "ComputeConfig",
    "ConfigError",
    "ConnectionConfig",
    "DataConfig",
    "EvaluationConfig",
    "InnerConfig",
    "LogConfig",
    "ModelConfig",
    "NetworkConfig",
    "OperatorConfig",
    "Option",
    "OuterConfig",
    "OutputConfig",
    "RunConfig",
    "Sections",
    "SecurityConfig",
    "ShardingConfig",
    "Spec",
    "WorkerConfig",
    "flat_names",
    "option",
    "specs",
]
