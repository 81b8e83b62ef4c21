"""Numbers and names in the few cells a terminal dashboard has for them."""

from __future__ import annotations

import math

from rich.cells import cell_len


def duration(seconds: float | None) -> str:
    """12:03 or 1:02:03; '-' when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    minutes, secs = divmod(int(max(seconds, 0)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def compact_count(value: float) -> str:
    """1234567 -> '1.23M': parameter counts and tokens/s in narrow columns."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.0f}"


def compact_bytes(count: float) -> str:
    """At most four characters: 512B, 9.8K, 123K, 16M, 1.2G."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            value = count / size
            return f"{value:.1f}{unit}" if value < 9.95 else f"{value:.0f}{unit}"
    return f"{count:.0f}B"


def short_bytes(count: float) -> str:
    """At most six characters: 512 B, 9.8 KB, 200 MB."""
    text = compact_bytes(count)
    return f"{text[:-1]} B" if text.endswith("B") else f"{text[:-1]} {text[-1]}B"


def loss_text(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.4f}"


def clip(text: str, width: int) -> str:
    """`text` cut to `width` cells with an ellipsis when it is longer."""
    return text if cell_len(text) <= width else text[: max(width - 1, 0)] + "…"
