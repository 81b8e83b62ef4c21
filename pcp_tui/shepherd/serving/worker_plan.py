"""What one worker is sent to train, and what it may send back in return.

`worker_plan` builds the plan message a worker gets once welcomed: the
training graphs for its platform, its data shard, the run's hyper-parameters
and the fragments the rounds sync (plain DiLoCo: one). `bind_to_plan` then bounds what that
worker may send: every message is checked from its header, before any payload
byte is read, its size and tensors against the plan's parameters. Both are
`pool.WorkerPool`'s, which serves the connection.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pcp_tui import protocol
from pcp_tui.config import RunConfig
from pcp_tui.contract import plan as contract
from pcp_tui.shepherd.rounds.claims import ResultClaims
from pcp_tui.shepherd.serving.connection import WorkerLink
from pcp_tui.training import shards
from pcp_tui.training.export import TrainingGraphs
from pcp_tui.training.workload import Workload

Fragments = tuple[tuple[str, ...], ...]  # the round engine's partition of the parameters


def worker_plan(
    config: RunConfig,
    workload: Workload,
    graphs: TrainingGraphs,
    *,
    run_id: str,
    slot: int,
    fragments: Fragments,
) -> tuple[protocol.Plan, dict[str, np.ndarray]]:
    """(the plan, its tensors) for the worker that trains shard `slot` with `graphs`."""
    shard = workload.shards[slot]
    tensors = {
        f"graph/{name}": np.frombuffer(blob, np.uint8)
        for name, blob in graphs.as_dict().items()
        if name != "eval_loss"
    }
    shipped = shards.shard_plan(shard)  # LM windows or rows of a custom dataset
    tensors.update(shipped.tensors)
    plan = protocol.Plan(
        run_id=run_id,
        model_name=workload.name,
        param_count=workload.param_count,
        graphs=tuple(
            protocol.GraphInfo(
                name, tuple(protocol.Platform(p) for p in graphs.platforms), f"graph/{name}"
            )
            for name in ("train_chunk", "init_opt_state")
        ),
        param_names=tuple(graphs.param_names),
        inner_steps=config.inner.steps,
        chunk_steps=graphs.chunk_steps,
        batch_size=config.data.batch_size,
        seq_len=config.data.seq_len,
        seed=config.model.seed,
        shard_tensor=shipped.shard_tensor,
        shard_fingerprint=shipped.fingerprint,
        worker_slot=slot,
        compression=protocol.Quantization(config.outer.compression),
        batch_kind=shipped.batch_kind,
        data_tensors=shipped.data_tensors,
        tokens_per_row=contract.tokens_per_row(shipped.batch_kind, config.data.seq_len),
        sharding=config.sharding.to_wire(),
        fragments=tuple(protocol.Fragment(names) for names in fragments),
        overlap_steps=config.inner.overlap,
        # plain DiLoCo's one fragment takes the global value as it is (α 0, no overlap)
        mix_alpha=config.inner.mix_alpha if config.inner.streaming else 0.0,
        overlap_merge=protocol.OverlapMerge(
            config.inner.overlap_merge if config.inner.streaming else "mix"
        ),
    )
    return plan, tensors


def bind_to_plan(
    link: WorkerLink, plan: protocol.Plan, workload: Workload, fragments: Fragments
) -> None:
    """From now on this peer may send only small messages, and results of the plan's size.

    Every message is checked from its header, before any payload byte is
    read: its kind against the stage of the connection (`contract.RECEIVES`),
    its tensors against the plan's parameters (the stage check is the link's own).
    """
    shapes = {name: tuple(workload.params[name].shape) for name in plan.param_names}
    link.stream.limits = dataclasses.replace(
        link.stream.limits,
        max_message_bytes=contract.result_frame_bytes(plan.param_names, plan.inner_steps),
        max_tensors=len(shapes),
        max_losses=plan.inner_steps,
    )

    def check(body: protocol.Body, specs, frame_bytes: int) -> None:
        if isinstance(body, protocol.RoundResult) and body.folded:  # a relay's notice
            if not link.view.via or specs:
                raise protocol.MalformedMessage(
                    "a folded result is a relay's notice, with no tensors; no worker sends one"
                )
        elif isinstance(body, protocol.RoundResult):
            problem = contract.fragment_header_problem(shapes, fragments, body, specs)
            if problem is not None:
                raise contract.ResultRefused(f"round result refused: {problem}")
        elif specs or frame_bytes > contract.SMALL_MESSAGE_BYTES:
            raise protocol.FrameTooLarge(
                f"a {body.KIND} may carry no tensors and at most "
                f"{contract.SMALL_MESSAGE_BYTES} bytes"
            )

    link.check_tensors = check
    link.rounds.claims = ResultClaims(
        tokens_per_step=plan.batch_size * plan.tokens_per_row, fragments=len(fragments)
    )
