"""The held-out eval off the rounds' path (`shepherd/run/evaluation.py`), on a real `RunState`.

The eval is a real function in a real thread, held until the test lets it go:
which round's eval runs, which are skipped and where a loss lands do not
depend on how fast the thread is.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import trio

from pcp_tui.shepherd.rounds.engine import copy_tensors
from pcp_tui.shepherd.run import checkpoint
from pcp_tui.shepherd.run.checkpoint_writer import CheckpointWriter
from pcp_tui.shepherd.run.evaluation import HeldOutEval
from pcp_tui.shepherd.run.events import EventKind
from pcp_tui.shepherd.run.state import RoundRecord, RunState


def _record(number: int) -> RoundRecord:
    return RoundRecord(
        round=number,
        train_loss=2.0,
        eval_loss=None,
        round_seconds=1.0,
        compute_seconds=1.0,
        communication_seconds=0.0,
        straggler_seconds=0.0,
        tokens=100,
        tokens_per_second=100.0,
        bytes_sent=10,
        bytes_received=10,
        workers=1,
        worker_ids=("w0",),
    )


class HeldEval:
    """θ -> the sum of its `w`, once `release` is set; records what it was given."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.seen: list[float] = []

    def __call__(self, params) -> float:
        assert self.release.wait(timeout=60), "the test never released the eval"
        self.seen.append(float(params["w"].sum()))
        return self.seen[-1]


def _evals(state: RunState, evaluate, diverged=None, every: int = 1) -> HeldOutEval:
    return HeldOutEval(
        evaluate,
        copy_tensors,
        state,
        every=every,
        last_round=4,
        diverged=diverged or (lambda number, loss: None),
    )


async def test_the_next_rounds_eval_is_skipped_with_one_warning_while_one_runs():
    state = RunState(run_id="r", rounds_total=4, settings={})
    evaluate = HeldEval()
    evals = _evals(state, evaluate)
    params = {"w": np.ones(4, np.float32)}
    async with trio.open_nursery() as nursery:
        state.history.append(_record(1))
        await evals.start(1, params, nursery)
        params["w"] += 1  # round 2's outer step, in place: round 1's eval has its own copy
        for number in (2, 3):
            state.history.append(_record(number))
            await evals.start(number, params, nursery)
        evaluate.release.set()
        await evals.idle()
        assert await evals.final(4, params) == 8.0  # awaited, on θ as it is
    assert evaluate.seen == [4.0, 8.0]  # round 1's θ, then the last round's
    assert [r.eval_loss for r in state.history] == [4.0, None, None]
    assert evals.skipped == [2, 3]
    skipped = [e for e in state.events if e.kind == EventKind.EVAL_SKIPPED]
    assert len(skipped) == 1 and "--eval-every (now 1)" in skipped[0].message
    assert "round 2's eval skipped: round 1's still runs" in skipped[0].message
    [evaluated] = [e for e in state.events if e.kind == EventKind.EVALUATED]
    assert evaluated.fields() == {"round": 1, "eval_loss": 4.0}


async def test_every_and_the_last_round_say_which_rounds_are_due():
    evals = _evals(RunState(run_id="r", rounds_total=4, settings={}), HeldEval(), every=3)
    assert [n for n in range(1, 5) if evals.due(n)] == [3, 4]


async def test_a_non_finite_eval_that_ends_after_its_round_is_reported_as_divergence():
    state = RunState(run_id="r", rounds_total=4, settings={})
    told: list[tuple[int, float]] = []
    evals = _evals(state, lambda params: float("nan"), lambda n, loss: told.append((n, loss)))
    async with trio.open_nursery() as nursery:
        state.history.append(_record(2))
        await evals.start(2, {"w": np.ones(2, np.float32)}, nursery)
    assert len(told) == 1 and told[0][0] == 2 and math.isnan(told[0][1])
    assert math.isnan(state.history[0].eval_loss)


async def test_a_checkpoint_records_the_eval_of_the_parameters_it_saves(tmp_path):
    """Its meta's eval_loss lagged a round: the meta was taken as the checkpoint was asked
    for, while that round's eval still ran, so round k's checkpoint said round k-1's loss
    (round 1's said null). The write now waits for the eval, off the round's path: a
    second checkpoint asked for meanwhile stops the wait (the round never waits for an
    eval), and `eval_round` says whose loss it wrote."""
    state = RunState(run_id="r", rounds_total=4, settings={})
    evaluate = HeldEval()
    evals = _evals(state, evaluate)
    writer = CheckpointWriter(str(tmp_path), state)
    params = {"w": np.ones(4, np.float32)}

    def snapshot():
        return copy_tensors(params), {}

    async with trio.open_nursery() as nursery:
        for number in (1, 2):  # round 2's checkpoint is asked for while round 1's eval runs
            state.history.append(_record(number))
            await evals.start(number, params, nursery)
            await writer.save(number, {}, snapshot, nursery, evals.idle)
            params["w"] += 1
        evaluate.release.set()
        await writer.idle()
        state.history.append(_record(3))
        await evals.start(3, params, nursery)  # no checkpoint after it: this write waits
        await writer.save(3, {}, snapshot, nursery, evals.idle)
        await writer.idle()
    meta = {n: checkpoint.load_latest(tmp_path / f"round-{n:06d}").meta for n in (1, 2, 3)}
    assert [(meta[n]["eval_round"], meta[n]["eval_loss"]) for n in (1, 2, 3)] == [
        (None, None),  # its eval had not ended when round 2's checkpoint was asked for
        (1, 4.0),  # round 2's eval was skipped (round 1's ran): the newest, named
        (3, 12.0),  # the parameters it saved
    ]
