"""Where a worker with several local devices puts each input and output of the plan's graphs.

The shepherd ships one portable artifact per graph, exported for one device;
a worker with N devices compiles it over a one-axis mesh of them with the
layouts made here (see `pcp_tui.training.sharding` for the rules):

- ``train_chunk(params, opt_state, batches[K, B, ...], first_step)``: the
  batch axis B of every batch leaf is split over the devices; parameters and
  their optimizer state are replicated or split as the plan's sharding says;
  the chunk's outputs are placed as its inputs, so the next chunk (and the
  donation of its inputs) needs no copy;
- ``init_opt_state(params) -> opt_state``: the same parameter and state placements.

The shepherd still sees one worker: one pseudo-gradient, the plan's batch per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from pcp_tui import protocol
from pcp_tui.backends import Axis, Layout, LayoutFor
from pcp_tui.training.sharding import LayoutError, Shape, param_axes, state_axes

_BATCH_AXIS = 1  # of a chunk's batches [K, B, ...]: axis 0 is the chunk's inner steps


@dataclass
class GraphLayouts:
    """The layouts of one plan's graphs on `devices` devices, and the parameters' placement."""

    plan: protocol.Plan
    devices: int
    param_axes: tuple[Axis, ...] | None = None  # known once train_chunk's shapes are read

    def __post_init__(self) -> None:
        if self.plan.batch_size % self.devices:
            raise LayoutError(
                f"this run's batch size {self.plan.batch_size} does not split over this worker's "
                f"{self.devices} devices: restart the worker with --devices set to a divisor of "
                f"{self.plan.batch_size} (--devices 1 always works), or the shepherd with "
                f"--batch-size a multiple of {self.devices}"
            )

    def _params(self, shapes: tuple[Shape, ...]) -> tuple[Axis, ...]:
        names = self.plan.param_names
        if len(shapes) < len(names):
            raise LayoutError(f"the graph takes {len(shapes)} inputs, fewer than its parameters")
        axes = param_axes(names, shapes[: len(names)], self.plan.sharding, self.devices)
        self.param_axes = axes
        return axes

    def train_chunk(self, inputs: tuple[Shape, ...], outputs: tuple[Shape, ...]) -> Layout:
        """params, opt_state, batches, first_step -> params, opt_state, losses."""
        n = len(self.plan.param_names)
        leaves = (
            len(self.plan.data_tensors) if self.plan.batch_kind == protocol.BatchKind.ROWS else 1
        )
        params = self._params(inputs)
        state = state_axes(inputs[n : len(inputs) - leaves - 1], inputs[:n], params)
        return Layout(
            inputs=(*params, *state, *[_BATCH_AXIS] * leaves, None),
            outputs=(*params, *state, None),
        )

    def init_opt_state(self, inputs: tuple[Shape, ...], outputs: tuple[Shape, ...]) -> Layout:
        """params -> opt_state."""
        params = self._params(inputs)
        return Layout(inputs=params, outputs=tuple(state_axes(outputs, inputs, params)))

    def of(self, graph: str) -> LayoutFor:
        return {"train_chunk": self.train_chunk, "init_opt_state": self.init_opt_state}[graph]
