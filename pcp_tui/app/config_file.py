"""Run options from a TOML file (`--config run.toml`), and the reference file examples/run.toml.

A file holds sections named as RunConfig's (``[inner]`` then ``steps = 50``),
top-level flat names (``inner_steps = 50``, as files written before the
sections were), or both; dashes may stand for underscores. (TOML allows no
``model = "small"`` beside a ``[model]`` table: such a file writes ``name``
inside ``[model]``, and ``path`` inside ``[data]``.) Anything else is an
error that names the key and the closest valid one: a typo must not silently
fall back to a default and waste a training run. Flags given on the command
line win over the file.

`python -m pcp_tui.app.config_file > examples/run.toml` regenerates the
reference file from the declarations; tests/test_examples.py keeps it equal.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from pcp_tui.config import ConfigError, RunConfig
from pcp_tui.config.options import Sections, Spec, flat_names, section_types, specs, unknown


def load_config_file(path: str | Path, root: type[Sections] = RunConfig) -> dict[str, Any]:
    """{flat name: value} from the TOML file at `path`, type-checked against `root`."""
    path = Path(path)
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read --config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path} is not valid TOML: {exc}") from None
    flat, kinds = flat_names(root), section_types(root)
    values = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name in kinds and isinstance(value, dict):
            in_section = {s.name: s for s in specs(root) if s.section == name}
            for inner_key, inner_value in value.items():
                spec = in_section.get(inner_key.replace("-", "_"))
                if spec is None:
                    raise unknown(inner_key, in_section, f"in section [{name}] of {path}")
                values[spec.flat] = checked(spec, inner_value, f"{name}.{inner_key}", path)
        elif name in flat:
            values[name] = checked(flat[name], value, key, path)
        else:
            raise unknown(key, [*flat, *kinds], f"in {path}")
    return values


def checked(spec: Spec, value: Any, key: str, path: Path) -> Any:
    """`value` if it has the option's type (an int is a float too); else a ConfigError."""
    if spec.option.table:
        if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
            return tuple(value.items())
        wanted = 'a table of "pattern" = "layout"'
    elif spec.type is tuple:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        wanted = "a list of strings"
    elif spec.type is bool:
        if isinstance(value, bool):
            return value
        wanted = "true or false"
    elif isinstance(value, bool):
        wanted = {int: "an integer", float: "a number"}.get(spec.type, "a string")
    elif spec.type is float and isinstance(value, int | float):
        return float(value)
    elif isinstance(value, spec.type):
        return value
    else:
        wanted = {int: "an integer", float: "a number"}.get(spec.type, "a string")
    raise ConfigError(f"option {key!r} in {path} must be {wanted}, got {value!r}")


_HEADER = """\
# pcp-tui run options: `pcp-tui shepherd --config examples/run.toml` (or `demo`).
# Every option of a run, commented out at its default; uncomment what you change.
# Flags given on the command line override this file. Keys are the option names
# with underscores (chunk_steps) or dashes (chunk-steps); an unknown key is an error.
# Top-level flat names (inner_steps = 50) are read too, as the flags spell them.
# The values shown are the shepherd's defaults (`demo` starts from smaller ones).
# Generated from pcp_tui/config: python -m pcp_tui.app.config_file > examples/run.toml
"""


def reference_toml(root: type[Sections] = RunConfig) -> str:
    """The reference file: every section and option, its help, commented out at its default."""
    defaults = root()
    lines = [_HEADER.rstrip("\n")]
    for section, kind in section_types(root).items():
        lines += ["", f"# {kind.__doc__}", f"[{section}]"]
        for spec in specs(root):
            if spec.section != section:
                continue
            value = getattr(getattr(defaults, section), spec.name)
            shown = spec.option.example if value is None else value
            flag = f"{spec.flag}: " if spec.option.cli else ""
            if spec.option.table:
                assert isinstance(shown, tuple), f"{spec.flat}: a table option holds pairs"
                written = _table(shown)
            else:
                written = _toml(shown)
            lines += [f"# {flag}{spec.description}", f"# {spec.name} = {written}"]
    return "\n".join(lines) + "\n"


def _table(pairs: tuple[tuple[str, str], ...]) -> str:
    """A TOML inline table for (key, value) string pairs."""
    return "{" + ", ".join(f"{_toml(k)} = {_toml(v)}" for k, v in pairs) + "}"


def _toml(value: Any) -> str:
    """A TOML literal for a bool, number, string or tuple of strings."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string for these values
    return repr(value)


if __name__ == "__main__":
    print(reference_toml(), end="")
