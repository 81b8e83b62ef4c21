"""The machinery behind one declaration per option: `option()`, `Spec`, and `Sections`.

A *section* is a frozen dataclass whose fields are declared with `option(...)`;
a *root* (RunConfig, WorkerConfig) is a `Sections` dataclass whose fields are
sections. From the declarations, `specs(root)` lists every option once, with its
flat name (`inner_steps`), its nested path (`inner.steps`), its type and its rules;
the CLI (`pcp_tui.app.options_cli`), the TOML reader and reference file
(`pcp_tui.app.config_file`) and `Sections.validate` are all generated from it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from typing import Any, ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _cache_by_type(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """`functools.cache` for functions of a class: typed as `fn` itself, because mypy's
    Hashable check refuses every `type[X]` value (python/mypy#11470) though a class hashes."""
    return functools.cache(fn)  # type: ignore[return-value]  # mypy#11470, as above


class ConfigError(ValueError):
    """An option has a value that cannot work; the message says which and why."""


@dataclass(frozen=True)
class Option:
    """What a field declares besides its type and default: help, name on the CLI, rules.

    `flat` is the option's name outside its section (keyword arguments, flags,
    flat TOML keys); by default the field's own name. `flag` overrides the
    command-line spelling (`--id` for `worker_id`). The range rules are checked by
    `Sections.validate` and name the flag in their error. A bool is a switch:
    `--quiet` when it defaults to False, `--no-reconnect` when it defaults to
    True (its help then says what the switch does).
    """

    help: str
    flat: str | None = None
    flag: str | None = None
    at_least: float | None = None
    at_most: float | None = None
    above: float | None = None
    below: float | None = None
    choices: tuple[str, ...] | None = None
    example: object = None  # run.toml shows it for an option whose default is None
    cli: bool = True  # False: settable from Python and TOML only
    hidden: bool = False  # a flag left out of --help (for pcp-tui's own use)
    required: bool = False  # on the command line
    metavar: str | None = None
    table: bool = False  # a tuple of (key, value) strings, written as a TOML table

    def rule(self) -> str | None:
        """The range or choice as the error states it, e.g. 'must be at least 1'."""
        if self.choices is not None:
            return f"must be one of {', '.join(self.choices)}"
        low, high = self.at_least, self.at_most
        if low is not None and high is not None:
            return f"must be in {low:g}..{high:g}"
        if low is not None and self.below is not None:
            return f"must be in [{low:g}, {self.below:g})"
        if self.above == 0:
            return "must be positive"
        if self.above is not None:
            return f"must be more than {self.above:g}"
        if low == 0:
            return "must be 0 or more"
        if low is not None:
            return f"must be at least {low:g}"
        return None

    def allows(self, value: Any) -> bool:
        if self.choices is not None:
            return value in self.choices
        return not (
            (self.at_least is not None and value < self.at_least)
            or (self.at_most is not None and value > self.at_most)
            or (self.above is not None and value <= self.above)
            or (self.below is not None and value >= self.below)
        )


def option(default: Any = MISSING, *, help: str, factory: Any = MISSING, **rules: Any) -> Any:
    """Declare one option: `steps: int = option(50, help="...", flat="inner_steps", at_least=1)`.

    `factory` computes the default when the section is built (e.g. from the
    environment); `rules` are `Option`'s fields.
    """
    return dataclasses.field(
        default=default, default_factory=factory, metadata={"option": Option(help=help, **rules)}
    )


@dataclass(frozen=True)
class Spec:
    """One option as the generators see it: where it lives, its type, default and rules."""

    section: str
    name: str
    type: type  # int, float, str, bool or tuple (of str)
    optional: bool  # None is a valid value
    default: Any
    option: Option

    @property
    def flat(self) -> str:
        return self.option.flat or self.name

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def flag(self) -> str:
        """`--inner-steps`; an option with no flag (`cli=False`) as its --config file names it,
        `[sharding] mode`."""
        if not self.option.cli:
            return f"[{self.section}] {self.name}"
        return "--" + (self.option.flag or self.flat).replace("_", "-")

    @property
    def description(self) -> str:
        """The help, with the choices when there are some: the text of --help and run.toml."""
        choices = self.option.choices
        return f"{self.option.help} ({' | '.join(choices)})" if choices else self.option.help


def _plain_type(hint: Any) -> tuple[type, bool]:
    """(int, False) for `int`, (str, True) for `str | None`, (tuple, False) for tuple[str, ...]."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (kind,) = [a for a in args if a is not type(None)]
        return _plain_type(kind)[0], True
    return (typing.get_origin(hint) or hint), False


def section_types(root: type) -> dict[str, type]:
    """{section name: section class} of a root, in declaration order."""
    hints = typing.get_type_hints(root)
    return {f.name: hints[f.name] for f in dataclasses.fields(root)}


@_cache_by_type
def section_specs(section: str, kind: type) -> tuple[Spec, ...]:
    """The options of one section class, named `section` in its root."""
    hints = typing.get_type_hints(kind)
    found = []
    for f in dataclasses.fields(kind):
        plain, optional = _plain_type(hints[f.name])
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            raise TypeError(f"{kind.__name__}.{f.name}: an option needs a default")
        found.append(Spec(section, f.name, plain, optional, default, f.metadata["option"]))
    return tuple(found)


@_cache_by_type
def specs(root: type) -> tuple[Spec, ...]:
    """Every option of `root`, section by section; refuses two options with one flat name."""
    found = [s for name, kind in section_types(root).items() for s in section_specs(name, kind)]
    seen: dict[str, Spec] = {}
    for spec in found:
        if spec.flat in seen:
            raise TypeError(f"{root.__name__}: two options are named {spec.flat!r}")
        seen[spec.flat] = spec
    return tuple(found)


def _check_range(spec: Spec, section: object) -> None:
    value = getattr(section, spec.name)
    if value is not None and not spec.option.allows(value):
        raise ConfigError(f"{spec.flag} {spec.option.rule()}, got {value!r}")


def validate_section(section: object, name: str) -> None:
    """One section's declared ranges, then its `check()`: for a section used on its own."""
    for spec in section_specs(name, type(section)):
        _check_range(spec, section)
    check = getattr(section, "check", None)
    if check:
        check()


@_cache_by_type
def flat_names(root: type) -> dict[str, Spec]:
    """{flat name: Spec}: `inner_steps` -> the option at `inner.steps`."""
    return {spec.flat: spec for spec in specs(root)}


def unknown(name: str, known: typing.Iterable[str], where: str) -> ConfigError:
    """An unknown option's error: its name, the closest known one, and the list."""
    known = sorted(set(known))
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(f"unknown option {name!r} {where}; {hint}valid options: {', '.join(known)}")


class Sections:
    """Base of a root config: built and replaced by flat names, nested sections, or both.

    `RunConfig(inner_steps=5)`, `RunConfig(inner={"steps": 5})` and
    `RunConfig(inner=InnerConfig(steps=5))` are the same config. A section given
    whole is an instance of its class (or a dict of its fields' changes); any other
    value under a section's name is the flat option of that name (`model="small"`
    is `model.name`).
    """

    def __init__(self, **options: Any) -> None:
        for name, section in self._assembled(None, options).items():
            object.__setattr__(self, name, section)

    def replace(self, **changes: Any) -> typing.Self:
        """A copy with `changes`, named as the constructor takes them."""
        return type(self)(**self._assembled(self, changes))

    @classmethod
    def _assembled(cls, base: Sections | None, options: Mapping[str, Any]) -> dict[str, Any]:
        kinds, flat = section_types(cls), flat_names(cls)
        whole: dict[str, Any] = {}
        changes: dict[str, dict[str, Any]] = {name: {} for name in kinds}
        for key, value in options.items():
            if key in kinds and isinstance(value, kinds[key]):
                whole[key] = value
            elif key in kinds and isinstance(value, Mapping):
                fields = {f.name for f in dataclasses.fields(kinds[key])}
                for name in value:
                    if name not in fields:
                        raise unknown(name, fields, f"in section {key!r}")
                changes[key].update(value)
            elif key in flat:
                changes[flat[key].section][flat[key].name] = value
            else:
                raise unknown(key, [*flat, *kinds], f"for {cls.__name__}")
        built = {}
        for name, kind in kinds.items():
            start = whole.get(name, getattr(base, name) if base is not None else None)
            built[name] = (
                dataclasses.replace(start, **changes[name])
                if start is not None
                else kind(**changes[name])
            )
        return built

    def flat(self) -> dict[str, Any]:
        """{flat name: value} of every option, e.g. for a checkpoint's record of the run."""
        return {
            spec.flat: getattr(getattr(self, spec.section), spec.name) for spec in specs(type(self))
        }

    def validate(self) -> typing.Self:
        """Raise ConfigError for a value that cannot work, naming its flag and its range.

        First each option's declared range or choices, then each section's
        `check()` (rules across its options), then the root's `check()`.
        """
        for spec in specs(type(self)):
            _check_range(spec, getattr(self, spec.section))
        for name in section_types(type(self)):
            check = getattr(getattr(self, name), "check", None)
            if check:
                check()
        self.check()
        return self

    def check(self) -> None:
        """Rules across sections; a root overrides it when it has some."""
