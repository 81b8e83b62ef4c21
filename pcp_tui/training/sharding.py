"""How a worker with several local devices places a run's arrays on them: the `[sharding]` section.

A worker with N devices (`pcp-tui worker --devices N`) gets the run's graphs
exported for N devices (`training.export`), laid out on a one-axis mesh of
its devices by these rules:

- the batch is always split over the devices (data parallel): each device
  runs B/N rows and the gradients are averaged across devices before the
  optimizer step;
- a parameter, and the optimizer state that has its shape, is either
  replicated (a copy on every device: mode `data`) or split on one axis
  (`fsdp`, the default: each device holds 1/N of it, gathers it whole for the
  step and keeps 1/N of its gradient), chosen per parameter by name patterns:

    [sharding]
    mode = "fsdp"                      # default of parameters no rule names
    rules = { "wte" = "replicated", "h.*.mlp.*" = "fsdp" }   # first match wins

This is GT2's per-layer sharding signal, done as a JAX mesh layout. A layout
moves arrays, never changes what is computed: a wrong guess costs memory or
communication inside the worker, not correctness (the values equal the
one-device run up to the order of float sums).
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Sequence

from pcp_tui.config.run import LAYOUTS, MAX_PATTERN_CHARS, MAX_RULES, MODES  # noqa: F401

Shape = tuple[int, ...]
Axis = int | None  # as `pcp_tui.backends.Axis`: split over the devices, or None for a copy on each


class LayoutError(ValueError):
    """This worker's devices cannot run the plan as laid out; the message says which option to change."""


def param_layout(name: str, ndim: int, mode: str, rules: Sequence[tuple[str, str]]) -> str:
    """`replicated` or `fsdp` for the parameter `name`: the first rule that matches, else `mode`.

    Mode `fsdp` splits matrices only: vectors (biases, norm scales) are small,
    and splitting them would add a gather per use for little memory.
    """
    for pattern, layout in rules:
        if fnmatch.fnmatchcase(name, pattern):
            return str(layout)
    return "fsdp" if mode == "fsdp" and ndim >= 2 else "replicated"


def unmatched_rule(rules: Sequence[tuple[str, str]], names: Sequence[str]) -> str | None:
    """Why a rule is a mistake: it matches none of the parameters `names` (a typo, another
    model's names), naming a few of them, the closest first; None if every rule matches one
    (or there is no parameter to match: nothing to split)."""
    for pattern, layout in rules:
        if names and not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.5)
            spread = [names[round(i * (len(names) - 1) / 5)] for i in range(6)]  # first to last
            shown = list(dict.fromkeys([*close, *spread]))
            return (
                f"[sharding] rule {pattern!r} = {layout!r} matches no parameter of this model; "
                f"its {len(names)} parameters include {', '.join(shown)}"
            )
    return None


def split_axis(shape: Shape, devices: int) -> Axis:
    """The axis an `fsdp` parameter is split on: its largest one that `devices` divides, or None."""
    divisible = [axis for axis, size in enumerate(shape) if size % devices == 0]
    return max(divisible, key=lambda axis: shape[axis], default=None)


def param_axes(
    names: Sequence[str], shapes: Sequence[Shape], sharding, devices: int
) -> tuple[Axis, ...]:
    """Per parameter, the axis split over `devices` (None: replicated), from a plan's sharding."""
    rules = [(rule.pattern, rule.layout) for rule in sharding.rules]
    axes = []
    for name, shape in zip(names, shapes, strict=True):
        layout = param_layout(name, len(shape), sharding.mode, rules)
        axes.append(split_axis(shape, devices) if layout == "fsdp" else None)
    return tuple(axes)


def state_axes(state: Sequence[Shape], params: Sequence[Shape], axes: Sequence[Axis]) -> list[Axis]:
    """Axes of the optimizer state's flat leaves: each placed like the parameter it belongs to.

    Optimizers keep per-parameter state as trees in parameter order (Adam: a
    step count, then the first moments, then the second), so walking the
    leaves while cycling through the parameters pairs each moment with its
    parameter by shape. A leaf that does not pair (a count) is replicated:
    a placement, never a value, so a miss costs memory, not correctness.
    """
    placed, next_param = [], 0
    for shape in state:
        if params and shape == params[next_param % len(params)]:
            placed.append(axes[next_param % len(params)])
            next_param += 1
        else:
            placed.append(None)
    return placed
