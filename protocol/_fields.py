"""What every message field may hold: the bounds a peer's values are checked against at decode.

Bounds live on the fields (`_text`, `_items`, `_finite`, `_within`), next to the
type, so there is one place to read what a peer may send. A list bound may name
a `Limits` attribute instead of a number: the receiver sets that one (a
shepherd caps `losses` at the round's inner steps). `_structs.read` enforces
them; the message modules (`_session`, `_plan`, `_rounds`) declare them.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any, ClassVar

ID_CHARS = 128  # ids, names, versions, host names
REASON_CHARS = 4096  # human-readable reasons and error messages
TENSOR_NAME_CHARS = 256
MAX_SHARDING_RULES = 256  # rules of a plan's sharding section


def _text(chars: int = ID_CHARS, default: str = "") -> Any:
    return field(default=default, metadata={"chars": chars})


def _items(bound: int | str, *, chars: int = ID_CHARS, default: tuple = ()) -> Any:
    return field(default=default, metadata={"items": bound, "chars": chars})


def _finite(default: float = 0.0) -> Any:
    return field(default=default, metadata={"finite": True})


def _within(low: float, high: float, default: float) -> Any:
    """A finite number in [low, high]; anything else is refused at decode."""
    return field(default=default, metadata={"finite": True, "range": (low, high)})


class Body:
    """Base of every message body; `KIND` is its member of the Envelope union."""

    KIND: ClassVar[str]
