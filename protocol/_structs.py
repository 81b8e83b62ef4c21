"""Typed messages to Cap'n Proto structs and back: `write` sets fields, `read` checks every bound.

Both walk a dataclass's fields with their type hints: a nested dataclass is a
struct, a tuple a list, an enum its schema enum; Python names are the schema's
in snake_case (`camel` maps one to the other). `read` refuses what a field's
bound (`_fields`) or closed set (`_enums`) does not allow, as a
`MalformedMessage` naming the field.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import typing
from typing import Any

from ._enums import BY_WIRE_VALUE
from ._errors import MalformedMessage, NonFinite
from ._fields import ID_CHARS


def camel(name: str) -> str:
    """The schema's name of a Python field: `worker_id` -> `workerId`."""
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def write(builder, value) -> None:
    """Set every field of the dataclass `value` on the Cap'n Proto struct `builder`."""
    hints = _hints(type(value))
    for item in dataclasses.fields(value):
        wire, data, hint = camel(item.name), getattr(value, item.name), hints[item.name]
        if dataclasses.is_dataclass(hint):
            write(builder.init(wire), data)
        elif typing.get_origin(hint) is tuple:
            element = typing.get_args(hint)[0]
            items = builder.init(wire, len(data))
            for index, entry in enumerate(data):
                if dataclasses.is_dataclass(element):
                    write(items[index], entry)
                else:
                    items[index] = _scalar(element, entry)
        else:
            setattr(builder, wire, _scalar(hint, data))


def _scalar(hint, data):
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(data).value  # also accepts the member's value, refuses anything else
    return data


def read(cls: type, reader, limits, where: str):
    """The dataclass `cls` from a Cap'n Proto struct reader, every bound checked."""
    hints = _hints(cls)
    values = {}
    for item in dataclasses.fields(cls):
        wire = camel(item.name)
        values[item.name] = _read_value(
            hints[item.name], getattr(reader, wire), item.metadata, limits, f"{where}.{wire}"
        )
    return cls(**values)


def _read_value(hint, raw, meta, limits, where: str):
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return read(hint, raw, limits, where)
    if typing.get_origin(hint) is tuple:
        bound = meta["items"]
        cap = getattr(limits, bound) if isinstance(bound, str) else bound
        if len(raw) > cap:
            raise MalformedMessage(f"{where} has {len(raw)} entries; the limit is {cap}")
        element = typing.get_args(hint)[0]
        item_meta = {"chars": meta.get("chars", ID_CHARS)}
        return tuple(
            _read_value(element, entry, item_meta, limits, f"{where}[{index}]")
            for index, entry in enumerate(raw)
        )
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        member = BY_WIRE_VALUE[hint].get(raw.raw)
        if member is None:
            raise MalformedMessage(f"{where} is {raw.raw}, not a known {hint.__name__}")
        return member
    if hint is str:
        return _checked_text(raw, meta.get("chars", ID_CHARS), where)
    if hint is bytes:
        data = bytes(raw)
        if len(data) > meta["bytes"]:
            raise MalformedMessage(f"{where} is {len(data)} bytes; the limit is {meta['bytes']}")
        return data
    if hint is bool:
        return bool(raw)
    if hint is float:
        number = float(raw)
        if meta.get("finite") and not math.isfinite(number):
            raise NonFinite(f"{where} is {number}; it must be a finite number", where)
        low, high = meta.get("range", (-math.inf, math.inf))
        if math.isnan(number) or (not math.isfinite(number) and not low <= number <= high):
            raise NonFinite(f"{where} is {number}; it must be within [{low}, {high}]", where)
        if not low <= number <= high:
            raise MalformedMessage(f"{where} is {number}; it must be within [{low}, {high}]")
        return number
    return int(raw)


def _checked_text(raw, chars: int, where: str) -> str:
    text = str(raw)
    if len(text) > chars:
        raise MalformedMessage(f"{where} is {len(text)} characters; the limit is {chars}")
    return text
