"""Run options from a TOML file (`--config run.toml`); flags given on the command line win.

The file holds top-level ``key = value`` lines whose keys are RunConfig field
names (``inner_steps`` or ``inner-steps``), and one section, ``[sharding]``
(see `pcp_tui.training.sharding`). Anything else is an error that
names the key and lists the valid ones: a typo must not silently fall back to a
default and waste a training run.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from pcp_tui.config import ConfigError, RunConfig
from pcp_tui.training.sharding import ShardingConfig

_DEFAULTS = RunConfig()


def load_config_file(path: str | Path) -> dict[str, Any]:
    """{field: value} from the TOML file at `path`, type-checked against RunConfig."""
    path = Path(path)
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read --config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path} is not valid TOML: {exc}") from None
    values = {}
    if "sharding" in table:  # the one section (a TOML table): see pcp_tui.training.sharding
        try:
            values["sharding"] = ShardingConfig.from_table(table.pop("sharding"), str(path))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    fields = {f.name for f in dataclasses.fields(RunConfig)} - {"sharding"}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in fields:
            raise ConfigError(
                f"unknown option {key!r} in {path}; valid options: {', '.join(sorted(fields))}"
            )
        values[name] = _checked(name, value, path)
    return values


def _checked(name: str, value: Any, path: Path) -> Any:
    default = getattr(_DEFAULTS, name)
    if isinstance(default, tuple):
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        wanted = "a list of strings"
    elif isinstance(default, bool):
        if isinstance(value, bool):
            return value
        wanted = "true or false"
    elif isinstance(default, float):
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        wanted = "a number"
    elif isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        wanted = "an integer"
    else:  # str, or None meaning an optional str
        if isinstance(value, str):
            return value
        wanted = "a string"
    raise ConfigError(f"option {name!r} in {path} must be {wanted}, got {value!r}")
