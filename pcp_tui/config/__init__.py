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
  `check()` methods of the sections (`NetworkConfig.check`: heartbeat timeout
  and min workers) and of the root;
- the keyword `RunConfig(inner_steps=5)` / `config.replace(inner_steps=5)`.

Code reads options nested: `config.inner.steps`. `FLAT_PATHS` maps each flat
name to its nested path.

To add an option: add one `option(...)` field to the section it belongs to
(with `flat=` if the field name alone would be ambiguous outside its section),
read it as `config.section.field`, and regenerate examples/run.toml. Nothing else.

Why not a library: draccus (levanter's) and tyro derive nested flags
(`--inner.steps`) and would break every existing command line unless each
option were renamed back by hand; tyro also brings rich, docstring-parser and
typeguard, draccus PyYAML and its own argparse subclass. pydantic-settings has
a TOML source and a CLI, but swaps frozen dataclasses for pydantic models, its
own error texts and nested flags, for a large compiled dependency. What we need
(flat flags, sections, ranges with errors that name the flag, a TOML reader
that names the close match, a generated reference file) is ~200 lines over
`dataclasses.fields`, in `pcp_tui.config.options`.
"""

from pcp_tui.config.options import ConfigError, Option, Sections, Spec, flat_names, option, specs
from pcp_tui.config.run import (
    HEARTBEATS_PER_TIMEOUT,
    QUANTIZATIONS,
    CheckpointConfig,
    DataConfig,
    EvaluationConfig,
    InnerConfig,
    ModelConfig,
    NetworkConfig,
    OperatorConfig,
    OuterConfig,
    RunConfig,
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
    "Spec",
    "WorkerConfig",
    "flat_names",
    "option",
    "specs",
]
