"""The run's exported graphs: which export serves which worker, exported when first needed.

One `jax.export` artifact holds lowerings for the platforms it was exported
for, over a number of devices. The run starts with one export for
`--platforms` on one device (the shepherd evaluates with it too); a worker
whose platform is not among them, or that trains on N > 1 devices as one
(its hello's device count), gets a dedicated export, made the first time such
a worker joins and kept for the next: for N devices, the per-device step runs
inside `shard_map` with its collectives written out (`training.export`), which
is what lets custom calls such as cuDNN attention run on each device's rows.

IREE workers (any `--backend` with `--runtime iree`: CPUs, Vulkan GPUs, Apple
GPUs) all get the export for `cpu` alone. IREE compiles the cpu lowering for
any target: it is plain StableHLO, without GPU custom calls, and a
single-platform export has no platform-index argument, so the module carries
no per-platform `case` around every matmul for IREE to compile, and then skip,
on each call. What cannot be served is refused with a reason naming what
would work.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import trio

from pcp_tui import protocol
from pcp_tui.backends import CUDNN_ATTENTION_CALLS, SOURCE_PLATFORM
from pcp_tui.config import ConfigError, RunConfig
from pcp_tui.training.export import InnerOptimizer, TrainingGraphs, build_graphs
from pcp_tui.training.sharding import LayoutError, unmatched_rule
from pcp_tui.training.workload import Workload

# (platforms, devices, score rows) -> graphs
Export = Callable[[tuple[str, ...], int, int], TrainingGraphs]
Shape = tuple[tuple[str, ...], int]  # the platforms an export is lowered for, its device count


class Unservable(Exception):
    """No export of this run can serve the worker; the message says what would."""


class GraphLibrary:
    """Exports by platform set and device count, made once each; `for_worker` picks a worker's."""

    def __init__(
        self,
        export: Export,
        main_platforms: tuple[str, ...],
        *,
        cuda_only: str = "",
        score_rows: int = 0,
    ):
        """`export(platforms, devices, score_rows)` builds the graphs; `cuda_only` says why, if
        only CUDA can; `score_rows` > 0: the main export has validation's `score_loss`."""
        self._export = export
        self.main_platforms = main_platforms
        self.score_rows = score_rows
        self._cuda_only = cuda_only
        self._made: dict[Shape, TrainingGraphs] = {}
        self._locks: dict[Shape, trio.Lock] = {}
        self.main: TrainingGraphs | None = None

    @classmethod
    def for_run(cls, config: RunConfig, workload: Workload, inner: InnerOptimizer) -> GraphLibrary:
        """The graphs of `workload` trained with `inner` as `config` says (chunk, attention);
        ConfigError for a `[sharding]` rule that names none of its parameters."""
        problem = unmatched_rule(config.sharding.rules, list(workload.params))
        if problem:
            raise ConfigError(problem)
        cudnn = config.model.attention == "cudnn"

        def export(platforms: tuple[str, ...], devices: int, score_rows: int) -> TrainingGraphs:
            here = jax.device_count()
            if cudnn and devices > here:  # JAX lowers cuDNN attention over real devices only
                raise LayoutError(
                    f"this run uses --attention cudnn, which JAX exports for a worker of {devices} "
                    f"devices only over as many devices of the shepherd's own, and it has {here}: "
                    f"join with --devices {here}, or run the shepherd on a host with {devices} "
                    "GPUs or without --attention cudnn"
                )
            return build_graphs(
                workload.loss_fn,
                workload.params,  # for shapes only
                workload.batch_spec,
                inner=inner,
                chunk_steps=config.inner.chunk,
                eval_batches=workload.eval_batch_count,
                platforms=platforms,
                custom_calls=CUDNN_ATTENTION_CALLS if cudnn else (),
                devices=devices,
                sharding=config.sharding.to_wire(),
                exchange_dtype=workload.compute_dtype,
                score_rows=score_rows,
            )

        # cuDNN attention exists only on CUDA, and its kernels are custom calls
        return cls(
            export,
            ("cuda",) if cudnn else tuple(config.model.platforms),
            cuda_only="this run uses --attention cudnn" if cudnn else "",
            score_rows=config.outer.validate_rows if config.outer.validating else 0,
        )

    def export_main(self) -> TrainingGraphs:
        """The run's first export, for `main_platforms` (blocking: call it in a thread)."""
        self.main = self._export(self.main_platforms, 1, self.score_rows)
        self._made[self.main_platforms, 1] = self.main
        return self.main

    def platforms_for(
        self, platform: protocol.Platform, runtime: protocol.Runtime
    ) -> tuple[str, ...]:
        """The export a worker on `platform` with `runtime` runs; Unservable if there is none."""
        if runtime == protocol.Runtime.IREE:
            if self._cuda_only:
                raise Unservable(
                    f"{self._cuda_only}, which IREE workers cannot run; join with "
                    "--runtime xla --backend cuda, or restart the shepherd without it"
                )
            if self.main is not None and self.main.platforms == (SOURCE_PLATFORM,):
                return self.main.platforms
            return (SOURCE_PLATFORM,)
        if self.main is not None and platform.value in self.main.platforms:
            return self.main.platforms
        if platform == protocol.Platform.VULKAN:
            raise Unservable(
                "JAX has no Vulkan platform; join with --runtime iree --backend vulkan"
            )
        if self._cuda_only:
            raise Unservable(f"{self._cuda_only}; join with --backend cuda")
        return (platform.value,)

    async def for_worker(
        self, platform: protocol.Platform, runtime: protocol.Runtime, devices: int = 1
    ) -> TrainingGraphs:
        """The graphs to put in the plan of a worker on `devices` devices, exported on first need."""
        shape = (self.platforms_for(platform, runtime), devices)
        lock = self._locks.setdefault(shape, trio.Lock())
        async with lock:  # workers of one new shape joining together wait for one export
            if shape not in self._made:
                try:
                    self._made[shape] = await trio.to_thread.run_sync(self._export, *shape, 0)
                except LayoutError as exc:  # this worker's devices cannot split the batch
                    raise Unservable(str(exc)) from None
                except Exception as exc:  # jax raises many types for a platform it cannot lower
                    raise Unservable(
                        f"this shepherd cannot export the graphs for {platform.value} on "
                        f"{devices} device(s) ({exc}); join with --devices 1, "
                        f"--runtime iree --backend {platform.value}, or "
                        f"--backend {' or '.join(self.main.platforms if self.main else ('cpu',))}"
                    ) from None
        return self._made[shape]
