"""The plan both sides share, the rules across its fields, and what each side may receive when.

`protocol.Plan` is the wire type: the shepherd builds one (`build`) and the
worker receives it unchanged. What no single field can say lives here, next to
it, and both sides call the same functions:

- token arithmetic: a batch row counts `tokens_per_row` tokens (the sequence
  length for LM windows, 1 for a row of a custom dataset), so a round of
  `inner_steps` steps trains on at most `max_result_tokens(plan)` tokens;
- a round result carries exactly the plan's parameters as float32 tensors,
  so the shepherd knows its size from the header, before a payload byte arrives;
- `RECEIVES`: for each side, which message kinds are valid in which stage of
  a connection; anything else from an admitted peer ends that connection.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence

from pcp_tui import protocol
from pcp_tui.config.run import schedule_problem
from pcp_tui.contract.checks import plan_tensors_problem

GRAPHS = ("train_chunk", "init_opt_state")  # the graphs a plan ships, by name
SMALL_MESSAGE_BYTES = 64 * 1024  # every kind but roundResult, after admission
_HEADER_BYTES_PER_TENSOR = 512  # a tensor header on the wire, name included, generously
RESULT_DTYPE = "float32"
Fragments = tuple[tuple[str, ...], ...]  # the tensor names of each fragment (plain: one)


class ResultRefused(protocol.ProtocolError):
    """A round result whose tensor headers are not the plan's: refused before its payload."""

    code = "badResult"


def tokens_per_row(batch_kind: protocol.BatchKind, seq_len: int) -> int:
    """Tokens one batch row trains on: a window of `seq_len` tokens, or one dataset row."""
    return seq_len if batch_kind == protocol.BatchKind.WINDOWS else 1


def max_result_tokens(plan: protocol.Plan) -> int:
    """The most tokens a round result may report for this plan."""
    return plan.inner_steps * plan.batch_size * plan.tokens_per_row


def plan_problem(plan: protocol.Plan, tensors: Mapping[str, object]) -> str | None:
    """Why a received plan cannot be trained on, or None: the worker's check of what it got."""
    graphs = {graph.name for graph in plan.graphs}
    if not set(GRAPHS) <= graphs:
        return f"the plan names graphs {sorted(graphs)}; it needs train_chunk and init_opt_state"
    missing = [graph.tensor for graph in plan.graphs if graph.tensor not in tensors]
    if missing:
        return f"the plan lacks its graph tensors {missing}"
    if min(plan.inner_steps, plan.chunk_steps, plan.batch_size, plan.tokens_per_row) < 1:
        return "the plan's inner steps, chunk steps, batch size and tokens per row must be >= 1"
    if plan.tokens_per_row != tokens_per_row(plan.batch_kind, plan.seq_len):
        return (
            f"a {plan.batch_kind.value} plan counts {tokens_per_row(plan.batch_kind, plan.seq_len)} "
            f"tokens per row, this one says {plan.tokens_per_row}"
        )
    return fragments_problem(plan)


def worker_header_check(memory_bytes: int) -> protocol.HeaderCheck:
    """What a worker checks of each message's header, before any payload byte is read.

    The plan's tensors must be the ones it names and fit in half of the worker's
    `memory_bytes` (`checks.plan_tensors_problem`); round starts and fragment updates
    carry parameters (bounded by `worker_limits` once the plan is in); nothing else
    carries tensors or more than a small message's bytes.
    """

    def check(body: protocol.Body, specs, frame_bytes: int) -> None:
        if isinstance(body, protocol.Plan):
            problem = plan_tensors_problem(body, specs, memory_bytes)
            if problem is not None:
                raise protocol.MalformedMessage(f"plan refused: {problem}")
        elif not isinstance(body, protocol.RoundStart | protocol.FragmentUpdate) and (
            specs or frame_bytes > SMALL_MESSAGE_BYTES
        ):
            raise protocol.FrameTooLarge(
                f"a {body.KIND} may carry no tensors and at most {SMALL_MESSAGE_BYTES} bytes"
            )

    return check


def worker_limits(plan: protocol.Plan) -> protocol.Limits:
    """What a worker receives once it has compiled `plan`: the global parameters (the plan's
    count of float32 values, at most) and small messages; never again a plan's size."""
    values = 4 * plan.param_count
    return dataclasses.replace(
        protocol.Limits(),
        max_message_bytes=result_frame_bytes(plan.param_names, 0),
        max_tensors=len(plan.param_names),
        max_tensor_bytes=values,
        max_total_tensor_bytes=values,
    )


def fragments(plan: protocol.Plan) -> Fragments:
    """The plan's fragments as tuples of tensor names (plain DiLoCo: one, every tensor)."""
    return tuple(tuple(fragment.tensors) for fragment in plan.fragments)


def partition_problem(fragments: Sequence[Sequence[str]], param_names: Sequence[str]) -> str | None:
    """Why `fragments` is not a partition of `param_names` into non-empty parts, or None."""
    seen: list[str] = [name for fragment in fragments for name in fragment]
    if any(not fragment for fragment in fragments):
        return "a fragment names no tensor"
    if len(seen) != len(set(seen)):
        return "a tensor is named by more than one fragment"
    if set(seen) != set(param_names):
        missing = sorted(set(param_names) - set(seen))[:3]
        extra = sorted(set(seen) - set(param_names))[:3]
        return (
            f"the fragments are not the plan's parameters (missing {missing}, unexpected {extra})"
        )
    return None


def fragments_problem(plan: protocol.Plan) -> str | None:
    """Why the plan's fragments and their schedule cannot be trained on, or None."""
    if not plan.fragments:
        return "the plan has no fragments (plain DiLoCo has one: every parameter)"
    problem = partition_problem(fragments(plan), plan.param_names)
    if problem is None:
        problem = schedule_problem(
            plan.inner_steps, len(plan.fragments), plan.overlap_steps, plan.chunk_steps
        )
    if problem is None and not 0 <= plan.mix_alpha <= 1:
        problem = f"its mix alpha {plan.mix_alpha} is not in [0, 1]"
    return None if problem is None else f"the plan's fragments cannot run: {problem}"


def round_steps_problem(plan: protocol.Plan, steps: int) -> str | None:
    """Why a roundStart's `steps` (its H_k, --adaptive-steps) cannot run, or None.

    A round may be shorter than the plan's H, never longer (results are screened
    against H's tokens), and its fragment schedule, scaled to `steps`, must fit
    the plan's chunks and τ as H's does.
    """
    if not 1 <= steps <= plan.inner_steps:
        return f"it asks for {steps} inner steps; the plan allows 1 to {plan.inner_steps}"
    problem = schedule_problem(steps, len(plan.fragments), plan.overlap_steps, plan.chunk_steps)
    return None if problem is None else f"a round of {steps} steps cannot run: {problem}"


def result_frame_bytes(param_names: Sequence[str], inner_steps: int) -> int:
    """The largest Cap'n Proto part (headers, losses) an honest round result can have."""
    return SMALL_MESSAGE_BYTES + _HEADER_BYTES_PER_TENSOR * len(param_names) + 8 * inner_steps


def result_header_problem(
    shapes: Mapping[str, tuple[int, ...]], specs: Sequence[protocol.TensorSpec]
) -> str | None:
    """Why a round result's tensor headers are not exactly the plan's parameters, or None."""
    names = [spec.name for spec in specs]
    if sorted(names) != sorted(shapes):
        missing = sorted(set(shapes) - set(names))[:3]
        extra = sorted(set(names) - set(shapes))[:3]
        return f"its tensors are not the plan's parameters (missing {missing}, unexpected {extra})"
    for spec in specs:
        if spec.dtype != RESULT_DTYPE or tuple(spec.shape) != tuple(shapes[spec.name]):
            return (
                f"{spec.name} is {spec.dtype}{list(spec.shape)}, "
                f"the plan's is {RESULT_DTYPE}{list(shapes[spec.name])}"
            )
    return None


def fragment_header_problem(
    shapes: Mapping[str, tuple[int, ...]],
    fragments: Sequence[Sequence[str]],
    body: protocol.RoundResult,
    specs: Sequence[protocol.TensorSpec],
) -> str | None:
    """Why a result's headers are not exactly its fragment's parameters, or None."""
    if body.fragment >= len(fragments):
        return f"fragment {body.fragment} does not exist; the plan has {len(fragments)}"
    names = fragments[body.fragment]
    return result_header_problem({n: shapes[n] for n in names}, specs)


class Stage(enum.Enum):
    """Where an admitted connection is, as the receiving side sees it."""

    PLANNED = "planned"  # worker: welcomed, plan not yet in; shepherd: plan sent, not ready
    READY = "ready"  # the worker compiled its graphs and trains rounds


_ALWAYS = frozenset(Stage)
# kind -> the stages in which a peer may send it; the one table of the conversation.
RECEIVES: dict[str, dict[str, frozenset[Stage]]] = {
    "shepherd": {
        "ready": frozenset({Stage.PLANNED}),
        "progress": frozenset({Stage.READY}),
        "roundResult": frozenset({Stage.READY}),
        "heartbeat": _ALWAYS,
        "error": _ALWAYS,
        "goodbye": _ALWAYS,
    },
    "worker": {
        "plan": frozenset({Stage.PLANNED}),
        "roundStart": frozenset({Stage.READY}),
        "fragmentUpdate": frozenset({Stage.READY}),
        "heartbeat": _ALWAYS,
        "error": _ALWAYS,
        "goodbye": _ALWAYS,
    },
}


def out_of_turn(side: str, kind: str, stage: Stage) -> str | None:
    """Why `kind` may not reach `side` in `stage`, or None when it may."""
    stages = RECEIVES[side].get(kind)
    if stages is None:
        return f"a {side} never accepts {kind} after the handshake"
    if stage not in stages:
        return f"{kind} is not valid while the connection is {stage.value}"
    return None
