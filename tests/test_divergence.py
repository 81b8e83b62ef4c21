"""A diverging run stops after its last good round and says why (issue 27 item 3).

Before: "roundResult.losses[0] is nan" dropped every worker and the round repeated
for ever (413 repeats in 5 minutes).
"""

from __future__ import annotations

import contextlib
import math
import re

import numpy as np
import pytest
import trio

from pcp_tui import protocol
from pcp_tui.diloco.screening import BadResult, Refusal
from pcp_tui.diloco.validation import Assignment, LossDeltaValidator
from pcp_tui.shepherd.coordinator import RunFailed, Shepherd
from pcp_tui.shepherd.rounds.divergence import NAN_TRIES, diverged
from pcp_tui.shepherd.run import checkpoint
from pcp_tui.shepherd.run.events import Event, Lost, ResultRefused
from pcp_tui.shepherd.run.history import RoundRecord
from pcp_tui.testing import (
    OutputProcess,
    free_port,
    join_as,
    run_shepherd,
    shepherd_command,
    until,
    worker_command,
)
from pcp_tui.training.build import build_workload

from .conftest import small_config

NAN_LOSS = "worker 0 lost: roundResult.losses[8] is nan; it must be within [-inf, inf]"


def test_every_result_non_finite_is_divergence():
    events = [
        Lost(NAN_LOSS, worker="w0", non_finite=True),
        ResultRefused(
            "... reported losses hold NaN or Inf", worker="w1", round=2, refusal=Refusal.NON_FINITE
        ),
    ]
    why = diverged(events, 2, 10, None)
    assert why is not None and "every result of round 2 was non-finite" in why
    assert "first at inner step 9 of 10" in why


def test_results_validation_refuses_for_blowing_up_their_own_loss_are_divergence():
    """With loss-delta validation on, a diverging worker's result is refused for raising the
    loss on its own batches over `BLOW_UP` times (`Refusal.BLOWN_UP`): every result of the
    round so refused is the run diverging; one that merely fails to lower it
    (`Refusal.NO_GAIN`) is not. The refusal's kind decides, not its text."""
    refused, w0 = "refused worker 0's round 1 result: ", {"worker": "w0", "round": 1}
    blown = ResultRefused(refused + "from 5.55 to 91.2", refusal=Refusal.BLOWN_UP, **w0)
    flat = ResultRefused(refused + "from 5.55 to 91.2", refusal=Refusal.NO_GAIN, **w0)
    why = diverged([blown], 1, 10, None)
    assert why is not None and "every result of round 1 diverged" in why
    assert diverged([blown, flat], 1, 10, None) is None  # a flat result: a worker's problem
    assert diverged([flat], 1, 10, None) is None  # the same words, but not a blow-up


def test_the_validator_says_which_refusal_it_is():
    """What `diverged` reads comes from the validator as a kind, not as words."""
    before = {"w": np.zeros(1, np.float32)}
    validator = LossDeltaValidator(lambda p, b: 1.0 + float(p["w"][0]) ** 2, lambda a, n: None)
    claim = Assignment(0, 0, 1)
    with pytest.raises(BadResult) as blown:
        validator.score({"w": np.full(1, 2.0, np.float32)}, 1, claim, number=1, params=before)
    with pytest.raises(BadResult) as flat:
        validator.score({"w": np.full(1, 1e-6, np.float32)}, 1, claim, number=1, params=before)
    assert (blown.value.refusal, flat.value.refusal) == (Refusal.BLOWN_UP, Refusal.NO_GAIN)


def test_a_peers_own_words_are_not_divergence():
    """A peer may end its connection with an `error` whose message reads like the decoder's
    ("losses[0] is nan"). Matched as text, a hostile sole participant of a round ended the
    whole run as diverged; only the decoder's refusal (`protocol.NonFinite`) marks it."""
    said = Lost(
        "worker 0 lost: the worker reported internal: roundResult.losses[0] is nan",
        worker="w0",
    )
    assert diverged([said], 2, 10, None) is None


def test_the_decoder_tells_a_non_finite_number_by_its_type():
    """What sets `Lost.non_finite`: a NaN (or an infinity out of range) in a field that
    must be finite raises `protocol.NonFinite`; other malformed numbers do not."""
    result = protocol.RoundResult(round=1, tokens=8, losses=(2.0, float("nan")), inner_steps=2)
    with pytest.raises(protocol.NonFinite, match=r"losses\[1\] is nan"):
        protocol.decode(b"".join(protocol.encode(result)))
    late = protocol.RoundResult(round=1, tokens=8, losses=(2.0, 2.0), inner_steps=2)
    protocol.decode(b"".join(protocol.encode(late)))  # finite: taken


def test_a_nan_loss_marks_the_lost_event_and_a_peers_words_do_not():
    """Over a real socket into a real shepherd: a peer whose `error` message reads like the
    decoder's refusal of a NaN loss is lost (`non_finite` False), and its round is repeated;
    a result whose computeSeconds is NaN is a peer breaking the rules, lost without it; a
    result whose losses hold a NaN is lost with `non_finite`, and when every result of two
    tries of its round in a row is, that is the run diverging: it ends saying so (one try
    could be a lone peer's lie). (Read as text, the first peer's words ended the run.)"""
    config = small_config(workers=1, rounds=1, inner_steps=2, chunk_steps=2, validate="off")
    shepherd = Shepherd(config, build_workload(config, shards=1))

    async def peer(port: int, worker_id: str, answer) -> None:
        stream, welcome = await join_as(port, worker_id)
        assert welcome.kind == "welcome", welcome.body
        plan = (await stream.receive()).body
        await stream.send(protocol.Ready(compile_seconds=0.0))
        start = await stream.receive()
        while start.kind != "roundStart":
            start = await stream.receive()
        # the shepherd hangs up at the header of a result it refuses: maybe mid-send
        with contextlib.suppress(protocol.ConnectionClosed, trio.BrokenResourceError):
            await answer(stream, plan, start.body.round)
            while True:
                await stream.receive()

    async def nan_loss(stream, plan, number: int) -> None:
        names = plan.fragments[0].tensors
        body = protocol.RoundResult(
            round=number, tokens=8, losses=(2.0, float("nan")), inner_steps=2
        )
        await stream.send(body, {n: np.zeros_like(shepherd.params[n]) for n in names})

    async def nan_seconds(stream, plan, number: int) -> None:
        names = plan.fragments[0].tensors
        body = protocol.RoundResult(
            round=number, tokens=8, losses=(2.0, 1.0), inner_steps=2, compute_seconds=math.nan
        )
        await stream.send(body, {n: np.zeros_like(shepherd.params[n]) for n in names})

    async def words(stream, plan, number: int) -> None:
        said = "roundResult.losses[1] is nan; it must be within [-inf, inf]"
        await stream.send(protocol.Error(protocol.ErrorCode.INTERNAL, said))

    def repeats() -> int:
        return sum(e.kind == "round_repeated" for e in shepherd.state.events)

    async def scenario(port: int) -> None:
        await peer(port, "talker", words)
        await until(lambda: repeats() == 1)
        await peer(port, "clock", nan_seconds)  # a NaN time is a peer's lie, not divergence
        await until(lambda: repeats() == 2)
        await peer(port, "nan", nan_loss)  # one try of NaN losses could be one peer's lie
        await until(lambda: repeats() == 3)
        await peer(port, "nan", nan_loss)  # the round diverges again: the run stops

    with pytest.raises(ExceptionGroup) as ended:  # out of run_shepherd's nursery
        run_shepherd(shepherd, scenario)
    (failure,) = ended.value.exceptions
    assert isinstance(failure, RunFailed), failure
    assert "every result of round 1 was non-finite (first at inner step 2 of 2)" in str(failure)
    lost = {e.worker: e for e in shepherd.state.events if isinstance(e, Lost)}
    assert not lost["talker"].non_finite and "losses[1] is nan" in lost["talker"].message
    assert not lost["clock"].non_finite and "computeSeconds is nan" in lost["clock"].message
    assert lost["nan"].non_finite and "losses[1] is nan" in lost["nan"].message


def test_a_round_lost_for_another_reason_too_is_repeated_not_stopped():
    """One NaN worker and one worker whose link broke: that is not the model diverging."""
    events = [
        Lost(NAN_LOSS, worker="w0", non_finite=True),
        Lost("worker 1 lost: connection reset", worker="w1"),
    ]
    assert diverged(events, 2, 10, None) is None
    assert diverged([], 2, 10, None) is None  # no result and no failure: e.g. the run stopping


def _record(eval_loss: float | None) -> RoundRecord:
    return RoundRecord(
        round=3,
        train_loss=2.0,
        eval_loss=eval_loss,
        round_seconds=1.0,
        compute_seconds=1.0,
        communication_seconds=0.0,
        straggler_seconds=0.0,
        tokens=100,
        tokens_per_second=100.0,
        bytes_sent=10,
        bytes_received=10,
        workers=2,
        worker_ids=("w0", "w1"),
    )


def test_a_non_finite_eval_loss_is_divergence_and_a_finite_one_is_not():
    assert (
        diverged([], 3, 10, _record(float("nan"))) == "round 3's outer step made the eval loss nan"
    )
    one_nan: list[Event] = [
        Lost(NAN_LOSS, worker="w0", non_finite=True)
    ]  # one worker's NaN among healthy results
    assert diverged(one_nan, 3, 10, _record(2.5)) is None
    assert diverged(one_nan, 3, 10, _record(None)) is None  # no eval this round


@pytest.mark.e2e
def test_inner_lr_50_stops_with_one_line_and_keeps_the_last_good_checkpoint(tmp_path):
    """The issue's reproduction, with a real shepherd and a real worker."""
    port = free_port()
    checkpoints = tmp_path / "ck"
    shepherd = OutputProcess(
        shepherd_command(
            port,
            *("--workers", "1", "--rounds", "8", "--inner-steps", "10", "--warmup-steps", "0"),
            *("--inner-lr", "50", "--grad-clip", "0"),
            *("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1"),
        ),
    )
    worker = None
    try:
        shepherd.wait_for("listening on")
        worker = OutputProcess(worker_command(port, "--id", "w0"))
        assert shepherd.finish() == 1, shepherd.output
    finally:
        shepherd.kill()
        if worker is not None:
            worker.kill()
    last = shepherd.lines[-1]
    found = re.search(
        # non-finite, or (validation refusing it) its own batches' loss blown up: lr 50 does
        # either, by the order of the float operations
        r"^pcp-tui: error: the run diverged: every result of round (\d+) (?:was non-finite "
        r"\(first at inner step \d+ of 10\)|diverged: non-finite, or raising) .*; (?:the checkpoint of round (\d+) in \S+ is kept|"
        r"no round had finished, nothing is saved); try a lower --inner-lr \(now 50\)",
        last,
    )
    assert found, shepherd.output
    # tried once more (one try could be one peer's lie), then stopped
    assert shepherd.output.count("repeating it") == NAN_TRIES - 1, shepherd.output
    diverged_in, kept = int(found.group(1)), found.group(2)
    if kept is not None:
        assert int(kept) == diverged_in - 1
        assert checkpoint.load_latest(checkpoints).round == int(kept)  # finite: it loads
