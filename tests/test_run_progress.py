"""How far a run got, as the headless log, the ETA and /v1/job say it, also after a --resume;
and what stopping it now will do, as the line a signal prints says.

A resumed shepherd's history holds only the rounds it ran itself; the round numbers
go on from the checkpoint's. Counting the history as "rounds done" made a run
resumed after round 10 of 20 say "run done after 10 rounds" at its end and
estimate 19 rounds left after its first.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from pcp_tui.app.api_bodies import job_json
from pcp_tui.app.headless import clean_stop_plan
from pcp_tui.shepherd.coordinator import EXPORT_NOTE_SECONDS, with_notes
from pcp_tui.shepherd.run.history import RoundRecord
from pcp_tui.shepherd.run.state import RunState
from pcp_tui.training.model_file import ModelFileError


def record(number: int, seconds: float) -> RoundRecord:
    return RoundRecord(
        round=number,
        train_loss=2.0,
        eval_loss=None,
        round_seconds=seconds,
        compute_seconds=seconds,
        communication_seconds=0.0,
        straggler_seconds=0.0,
        tokens=100,
        tokens_per_second=100 / seconds,
        bytes_sent=10,
        bytes_received=10,
        workers=1,
        worker_ids=("a",),
    )


def test_a_fresh_run_counts_its_rounds():
    state = RunState(run_id="r", rounds_total=5, settings={})
    assert (state.rounds_done(), state.eta_seconds()) == (0, None)
    state.history += [record(1, 4.0), record(2, 6.0)]
    assert state.rounds_done() == 2
    assert state.eta_seconds() == 15.0  # 3 rounds left at their mean, 5 s
    assert state.rounds_summary() == "after 2 rounds"
    assert job_json(state)["rounds_done"] == 2
    state.history = state.history[:1]
    assert state.rounds_summary() == "after 1 round"  # a --rounds 1 run said "after 1 rounds"


def test_a_resumed_run_counts_from_its_checkpoints_round():
    state = RunState(run_id="r", rounds_total=20, settings={})
    state.first_round = 11  # resumed from the checkpoint of round 10
    assert state.rounds_done() == 10 and job_json(state)["rounds_done"] == 10
    state.history += [record(11, 3.0), record(12, 5.0)]
    assert state.rounds_done() == 12
    assert state.eta_seconds() == 32.0  # 8 rounds left, not 18
    assert state.rounds_summary() == "after round 12 of 20 (2 rounds since resuming after round 10)"
    state.history = state.history[:1]
    assert state.rounds_summary() == "after round 11 of 20 (1 round since resuming after round 10)"


def test_the_stop_line_promises_only_what_the_stop_will_do():
    state = RunState(run_id="r", rounds_total=5, settings={})
    state.status = "waiting"  # for workers: no round to finish, nothing to checkpoint yet
    assert clean_stop_plan(state, checkpoints=True) == "stopping and telling workers goodbye"
    state.status = "training"
    assert clean_stop_plan(state, checkpoints=True) == (
        "stopping after the current round, writing the checkpoint and telling workers goodbye"
    )
    assert clean_stop_plan(state, checkpoints=False) == (
        "stopping after the current round and telling workers goodbye"
    )
    state.status, state.history = "paused", [record(1, 4.0)]
    assert clean_stop_plan(state, checkpoints=True) == (
        "stopping, writing the checkpoint and telling workers goodbye"
    )


def test_a_long_export_says_it_is_still_exporting_and_its_error_leaves_bare():
    notes: list[float] = []

    async def export() -> str:
        await trio.sleep(47)  # a big model's export: nothing to show for most of a minute
        return "graphs"

    async def failing() -> None:
        await trio.sleep(1)
        raise ModelFileError("model.py:3: in loss: TypeError: ...")

    async def main() -> None:
        # the total counts on the notes' clock: never less than the last "so far" (it was the
        # jax.export call's own time, and "still exporting (15 s so far)" ended "exported in 12.1 s")
        assert await with_notes(export, notes.append) == ("graphs", 47)
        with pytest.raises(ModelFileError):  # not an ExceptionGroup around it
            await with_notes(failing, notes.append)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert notes == [EXPORT_NOTE_SECONDS, 2 * EXPORT_NOTE_SECONDS, 3 * EXPORT_NOTE_SECONDS]
