"""Command-line flags generated from a config's declarations, one argument group per section.

Flags are flat (`--inner-steps`, not `--inner.steps`): each is its option's flat
name with dashes, so command lines written before the sections existed still work.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from pcp_tui.config.options import Sections, Spec, section_types, specs


def add_flags(
    parser: argparse.ArgumentParser,
    root: type[Sections],
    defaults: Sections,
    *,
    sections: Iterable[str] | None = None,
    only_passed: bool = False,
) -> None:
    """One `--flag` per option of `root` (or of its `sections`), grouped by section.

    `defaults` supply the values `--help` shows. With `only_passed`, a flag not
    given is absent from the parsed namespace (argparse.SUPPRESS), so a config
    file's value beneath it is not overwritten by a default; otherwise it holds
    the default.
    """
    chosen = list(sections or section_types(root))
    for name in chosen:
        title, _, description = (section_types(root)[name].__doc__ or name).partition(": ")
        flags = [spec for spec in specs(root) if spec.section == name and spec.option.cli]
        if not flags:  # else --help shows an empty group and no way to set it
            description = f"{description}; no flags: set it in a [{name}] section of --config"
        group = parser.add_argument_group(title, description or None)
        for spec in flags:
            _add_flag(group, spec, getattr(getattr(defaults, name), spec.name), only_passed)


def _add_flag(group: Any, spec: Spec, default: Any, only_passed: bool) -> None:
    text = spec.option.help  # choices show in the metavar, as argparse shows them: {a,b}
    if spec.option.hidden:
        text = argparse.SUPPRESS
    elif default not in (None, "") and spec.type is not bool and "(default:" not in text:
        text = f"{text} (default: {default})"
    options: dict[str, Any] = {
        "dest": spec.flat,
        "default": argparse.SUPPRESS if only_passed else default,
        "help": text,
    }
    flag = spec.flag
    if spec.type is bool:  # a switch: --quiet turns on, --no-reconnect turns off
        options["action"] = "store_false" if default else "store_true"
        flag = f"--no-{flag[2:]}" if default else flag
    else:
        choices = spec.option.choices
        metavar = "{" + ",".join(choices) + "}" if choices else spec.option.metavar
        options.update(type=spec.type, metavar=metavar, required=spec.option.required)
    group.add_argument(flag, **options)


def passed_values(args: argparse.Namespace, root: type[Sections]) -> dict[str, Any]:
    """{flat name: value} of `root`'s options present in `args`."""
    return {spec.flat: getattr(args, spec.flat) for spec in specs(root) if hasattr(args, spec.flat)}
