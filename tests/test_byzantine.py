"""A token-holding worker that tampers with its pseudo-gradient cannot wreck the run.

Real shepherd, real workers (`Worker`, in this process) over TCP on 127.0.0.1; the
attacker is the real worker with faulty_worker's "scale" fault (its result scaled before
sending): by 1e6 (refused by the inner-optimizer bound) or by −1 (a sign flip, within every
norm bound: refused by loss-delta validation, and shown to bite without it), in plain
and in streaming rounds.
"""

from __future__ import annotations

import pytest
import trio

from pcp_tui.diloco.screening import Refusal
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.testing import local_worker
from pcp_tui.testing.faulty_worker import FAULTS
from pcp_tui.training.build import build_workload

from .conftest import small_config


async def _joined(shepherd: Shepherd, worker_id: str, *, polls: int = 6000) -> None:
    """Poll until the worker is in the pool (bounded in count, not a time assertion)."""
    for _ in range(polls):
        if worker_id in shepherd.state.workers:
            return
        await trio.sleep(0.05)
    raise AssertionError(f"{worker_id} never joined")


def _train(
    attacker: bool, factor: float = 1e6, validate: str = "loss-delta", **changes
) -> Shepherd:
    """Two honest workers (shards 0 and 1, in that order), and the attacker third if asked,
    sending `factor`·Δ (`changes`: more of the run's config)."""
    config = small_config(
        **{"rounds": 3, "inner_steps": 4, "chunk_steps": 2, **changes},
        workers=3 if attacker else 2,
        validate=validate,
    )
    shepherd = Shepherd(config, build_workload(config, shards=2))

    async def main():
        async with trio.open_nursery() as nursery:
            port = await nursery.start(shepherd.run)
            for name in ("honest0", "honest1", *(["evil"] if attacker else [])):
                # the same worker, its results times `factor`
                faults = FAULTS["scale"].make(factor=factor, results=0) if name == "evil" else None
                nursery.start_soon(local_worker(port, name, faults=faults).run)
                await _joined(shepherd, name)

    trio.run(main)
    return shepherd


@pytest.fixture(scope="module")
def honest() -> Shepherd:
    """The two honest workers alone."""
    return _train(attacker=False)


def test_a_huge_first_result_is_refused_and_the_run_matches_honest_only(honest):
    attacked = _train(attacker=True)
    refused = [e for e in attacked.state.events if e.kind == "bad_result"]
    assert [e.worker for e in refused] == ["evil"] * 3  # from round 1 on, every round
    assert all("the most the plan's inner optimizer" in e.message for e in refused)
    assert [set(r.worker_ids) for r in attacked.state.history] == [{"honest0", "honest1"}] * 3
    # the same two results aggregated as without the attacker: the same model, to the bit
    attacked_losses = [r.eval_loss for r in attacked.state.history]
    honest_losses = [r.eval_loss for r in honest.state.history]
    assert attacked_losses == honest_losses


def test_a_sign_flip_bites_without_validation_and_is_refused_with_it(honest):
    """−Δ passes every norm screen and centered clip (it sits as far from the center as an
    honest result): without validation it costs the run; with it (the default) it is refused
    every round (as it comes: none of its results has counted; `Round.suspect`), and the run
    is the honest workers' alone, to the bit. Trusted workers' results are checked a round
    late (`tests/test_validation.py`)."""
    undefended = _train(attacker=True, factor=-1.0, validate="off")
    assert not [e for e in undefended.state.events if e.kind == "bad_result"]
    final = {run: run.state.history[-1].eval_loss for run in (undefended, honest)}
    assert final[undefended] > 1.03 * final[honest]  # measured: +4.8% (4.858 vs 4.633)
    attacked = _train(attacker=True, factor=-1.0)
    refused = [e for e in attacked.state.events if e.kind == "bad_result"]
    # checked as it comes, every round: no result of the attacker's has ever counted
    assert [(e.worker, e.round) for e in refused] == [("evil", 1), ("evil", 2), ("evil", 3)]
    assert all("a result must lower it" in e.message for e in refused)
    assert [set(r.worker_ids) for r in attacked.state.history] == [{"honest0", "honest1"}] * 3
    assert [r.eval_loss for r in attacked.state.history] == [
        r.eval_loss for r in honest.state.history
    ]


STREAMING = dict(inner_steps=8, streaming_fragments=2, overlap_steps=2)


def test_a_sign_flip_in_a_streaming_run_bites_without_validation_and_is_refused_with_it():
    """--streaming-fragments 2: the attacker flips each fragment result. Scored as its
    fragment's tensors moved on θ, on the batches its worker trained before that fragment's
    send, every flipped one is refused as `no_gain`, and every honest one counts."""
    undefended = _train(attacker=True, factor=-1.0, validate="off", **STREAMING)
    assert not [e for e in undefended.state.events if e.kind == "bad_result"]
    attacked = _train(attacker=True, factor=-1.0, **STREAMING)
    refused = [e for e in attacked.state.events if e.kind == "bad_result"]
    assert [(e.worker, e.refusal) for e in refused] == [("evil", Refusal.NO_GAIN)] * 6
    assert sorted(e.round for e in refused) == [1, 1, 2, 2, 3, 3]  # both fragments, each round
    history = attacked.state.history
    assert [(set(r.worker_ids), r.fragment_results) for r in history] == [
        ({"honest0", "honest1"}, (2, 2))
    ] * 3
    # each flip is taken out of its step a round later; without validation it costs the run
    final = {run: run.state.history[-1].eval_loss for run in (undefended, attacked)}
    assert final[undefended] > 1.05 * final[attacked], final  # measured: +8.3% (4.639 vs 4.285)
