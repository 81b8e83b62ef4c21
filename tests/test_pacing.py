"""--adaptive-steps: a slow worker's round is sized to its speed, the fast one trains H.

Unit tests for the speed estimate (smoothed over rounds, afresh on a new
connection) and the step sizes; then a real worker and a real worker made three
times slower (`faulty_worker slow`: every compiled chunk sleeps twice its own
compute time), through real sockets (both in this process, except where the
test signals the slow one), in plain DiLoCo and in Streaming DiLoCo
(against the one-page reference, given the steps the pacing chose).
"""

from __future__ import annotations

import signal
import subprocess

import numpy as np
import optax
import pytest
import trio

from pcp_tui import protocol
from pcp_tui.config.run import schedule_problem
from pcp_tui.contract import plan as contract
from pcp_tui.diloco import reference
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.shepherd.rounds.pacing import SMOOTHING, SpeedEstimate, StepPacing
from pcp_tui.shepherd.rounds.results import Round
from pcp_tui.testing import (
    faulty_worker_command,
    local_worker,
    pause_after_round,
    run_shepherd,
    until,
    worker_batches,
)
from pcp_tui.testing.faulty_worker import FAULTS
from pcp_tui.training.build import build_workload

from .conftest import small_config, worker_env

H, CHUNK = 20, 5
_slow = FAULTS["slow"].make  # every compiled chunk takes `factor` times as long


def _measured(steps: dict, seconds: dict, connections: dict | None = None) -> Round:
    """A closed round whose contributors trained `steps` in `seconds` on `connections`."""
    measured = Round(1, list(steps), _NoMean(), None, connections=connections)
    measured.contributors = list(steps)
    measured.steps_by_worker, measured.compute_seconds = dict(steps), dict(seconds)
    return measured


def test_steps_follow_speed_in_whole_chunks():
    pacing = StepPacing(H, CHUNK)
    assert pacing.steps_for(["a", "b"]) == {"a": H, "b": H}  # nobody measured yet
    pacing.observe(_measured({"a": 20, "b": 20, "c": 20}, {"a": 1.0, "b": 2.0, "c": 100.0}))
    assert pacing.steps_for(["a", "b", "c", "new"]) == {"a": 20, "b": 10, "c": 5, "new": 20}
    assert pacing.steps_for(["b", "c"]) == {"b": 20, "c": 5}  # the fastest present trains H


def test_the_fastest_worker_trains_h_whatever_its_speed():
    """H x s / s is 19.999999999999996 for H = 20 and this speed (a worker's, measured in a
    test run): the floor to whole chunks then gave the fastest worker 15 steps, not 20."""
    pacing = StepPacing(H, CHUNK)
    speed = 127.16273496967807
    pacing.observe(_measured({"fast": 20, "slow": 5}, {"fast": 20 / speed, "slow": 5 / 37.1}))
    assert pacing.speed("fast") == speed
    assert pacing.steps_for(["fast", "slow"]) == {"fast": H, "slow": CHUNK}


class _Connection:
    """Stands in for a WorkerLink: an object a round's roundStart went to."""


def test_one_slow_round_moves_the_estimate_by_the_smoothing_not_all_the_way():
    estimate = SpeedEstimate(smoothing=0.25)
    link = _Connection()
    assert estimate.update(8.0, link) == 8.0  # the first measurement is taken as it is
    assert estimate.update(4.0, link) == 7.0  # 8 + 0.25 x (4 - 8)
    assert estimate.update(4.0, None) == 6.25  # None: the same connection
    assert estimate.update(2.0, _Connection()) == 2.0  # a reconnect starts over


def test_a_gc_pause_does_not_halve_the_next_round_but_a_lasting_slowdown_shows():
    pacing, fast, slow = StepPacing(H, CHUNK), _Connection(), _Connection()
    links = {"fast": fast, "slow": slow}
    pacing.observe(_measured({"fast": 20, "slow": 20}, {"fast": 1.0, "slow": 1.0}, links))
    pacing.observe(_measured({"fast": 20, "slow": 20}, {"fast": 1.0, "slow": 2.0}, links))
    assert pacing.speed("slow") == 20 * (1 - SMOOTHING) + 10 * SMOOTHING
    assert pacing.steps_for(["fast", "slow"]) == {"fast": 20, "slow": 15}  # not 10
    for _ in range(3):  # it really is half as fast now: the estimate follows within rounds
        pacing.observe(_measured({"fast": 20, "slow": 10}, {"fast": 1.0, "slow": 1.0}, links))
    assert 10 < pacing.speed("slow") < 10 + 7 * (1 - SMOOTHING) ** 3 + 1e-9
    assert pacing.steps_for(["fast", "slow"]) == {"fast": 20, "slow": 10}


def test_a_reconnected_worker_is_measured_afresh():
    pacing, a, first = StepPacing(H, CHUNK), _Connection(), _Connection()
    for _ in range(3):
        pacing.observe(_measured({"a": 20, "b": 5}, {"a": 1.0, "b": 1.0}, {"a": a, "b": first}))
    assert pacing.steps_for(["a", "b"])["b"] == 5
    again = _Connection()  # b came back, maybe on a faster machine: its hello describes it
    assert pacing.steps_for(["a", "b"], {"a": a, "b": again}) == {"a": 20, "b": 20}  # unmeasured
    assert pacing.steps_for(["a", "b"], {"a": a, "b": first})["b"] == 5
    pacing.observe(_measured({"a": 20, "b": 5}, {"a": 1.0, "b": 0.25}, {"a": a, "b": again}))
    assert pacing.speed("b") == 20.0 and pacing.steps_for(["a", "b"])["b"] == 20


@pytest.mark.parametrize(
    ("steps", "chunk_steps", "overlap", "quantum", "least"),
    [(24, 1, 1, 2, 4), (24, 2, 2, 4, 8), (40, 5, 0, 10, 10)],
)
def test_streaming_pacing_keeps_every_round_schedulable(
    steps, chunk_steps, overlap, quantum, least
):
    inner = small_config(
        inner_steps=steps,
        chunk_steps=chunk_steps,
        streaming_fragments=2,
        overlap_steps=overlap,
        adaptive_steps=True,
    ).inner
    pacing = StepPacing.for_config(inner)
    assert (pacing.quantum, pacing.least) == (quantum, least)
    speeds = {"fast": 1.0, **{f"w{i}": 1.0 / i for i in range(1, 12)}}
    pacing.observe(_measured(dict.fromkeys(speeds, steps), {w: 1 / s for w, s in speeds.items()}))
    for worker, h in pacing.steps_for(speeds).items():
        problem = schedule_problem(h, 2, overlap, inner.chunk)
        assert problem is None and h <= steps, (worker, h, problem)


class _NoMean:
    def reset(self) -> None:
        pass


async def test_a_slow_worker_trains_fewer_steps_and_still_counts():
    config = small_config(
        workers=2, rounds=3, inner_steps=H, chunk_steps=CHUNK, adaptive_steps=True
    )
    shepherd = Shepherd(config, build_workload(config, shards=2))

    async with trio.open_nursery() as nursery:  # ends with the run: its goodbye ends the workers
        port = await nursery.start(shepherd.run)
        nursery.start_soon(local_worker(port, "fast").run)
        nursery.start_soon(local_worker(port, "slow", faults=_slow(factor=3.0)).run)
    history = shepherd.state.history
    full = H * config.data.batch_size * config.data.seq_len
    tokens = [r.tokens for r in history]
    assert [r.workers for r in history] == [2] * 3, tokens  # the slow worker is never dropped
    assert tokens[0] == 2 * full  # round 1: nobody measured, both train H
    assert all(full < t <= 2 * full for t in tokens[1:]), tokens  # the faster one trains H
    # one round's speeds are noisy on a loaded box; over the run the slow worker trains less
    assert sum(tokens[1:]) < 2 * full * (len(tokens) - 1), tokens
    trained = {worker: shepherd.state.workers[worker].steps_trained for worker in ("fast", "slow")}
    assert trained["slow"] < trained["fast"], trained
    steps = shepherd.engine.pacing.steps_for(["fast", "slow"])
    speeds = {w: shepherd.engine.pacing.speed(w) for w in ("fast", "slow")}
    assert max(steps.values()) == H and CHUNK <= min(steps.values()) < H, (steps, speeds)
    print("fast worker utilization by round:", [r.worker_utilization["fast"] for r in history])


@pytest.mark.e2e
def test_a_worker_too_slow_for_the_window_is_measured_by_its_late_result(spawn_worker):
    """A worker that misses round 1's straggler window with H steps was never measured
    (pacing saw contributors only), so it got H again after it caught up, and was late
    again for ever. Its late result now measures it: round 3 sizes it to its speed.

    slow holds round 1 until the test's go (SIGUSR1), given once round 1 has closed without
    it: it is late whatever the machine's load. (Made late by its speed alone, a 10x
    slower worker under CI load sometimes reported progress inside the window, whose
    projection rightly extended the window for it, and no result was ever late.)"""
    config = small_config(
        workers=2,
        rounds=3,
        inner_steps=H,
        chunk_steps=CHUNK,
        adaptive_steps=True,
        straggler_factor=4.0,
        straggler_min_seconds=0.5,
    )
    shepherd = Shepherd(config, build_workload(config, shards=2))

    async def scenario(port):
        pause_after_round(shepherd, 2)  # held until slow's round-1 result is in
        spawn_worker(port, "--id", "fast")
        command = faulty_worker_command(port, "slow", "--id", "slow", factor=3.0, hold=1)
        slow = subprocess.Popen(
            command, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        try:
            await until(lambda: any(e.kind == "stragglers" for e in shepherd.state.events))
            slow.send_signal(signal.SIGUSR1)
            await until(
                lambda: shepherd.state.status == "paused" and len(shepherd.state.history) == 2
            )
            await until(lambda: any(e.kind == "late_result" for e in shepherd.state.events))
            shepherd.resume()
            await until(lambda: any(e.kind == "done" for e in shepherd.state.events))
        finally:
            slow.kill()
            await trio.to_thread.run_sync(slow.wait)

    run_shepherd(shepherd, scenario)
    history = shepherd.state.history
    stragglers = [e for e in shepherd.state.events if e.kind == "stragglers"]
    assert stragglers[0].workers == ["slow"] and history[0].worker_ids == ("fast",)
    assert history[1].worker_ids == ("fast",)  # slow sat round 2 out, still on round 1
    assert set(history[2].worker_ids) == {"fast", "slow"}  # measured, sized, in time
    full = H * config.data.batch_size * config.data.seq_len
    assert history[2].tokens < 2 * full  # slow trained fewer than H steps
    assert shepherd.engine.pacing.speed("slow") < shepherd.engine.pacing.speed("fast")


def test_adaptive_streaming_scales_each_schedule_and_equals_the_reference():
    """--adaptive-steps with --streaming-fragments 2: a fast and a 3x slower real worker, inner
    SGD. The pacing sizes each round from the speeds it measured (recorded, not faked); each
    worker runs its fragment schedule scaled to its steps, and the shepherd's parameters equal
    `reference.streaming_diloco` given those step counts (tolerances as in test_streaming)."""
    steps, lr = 8, 0.1
    config = small_config(
        workers=2,
        rounds=3,
        inner_steps=steps,
        chunk_steps=1,
        inner_optimizer="sgd",
        inner_lr=lr,
        warmup_steps=0,
        grad_clip=0.0,
        aggregate="mean",
        eval_every=3,
        streaming_fragments=2,
        overlap_steps=1,
        mix_alpha=0.5,
        adaptive_steps=True,
    )
    workload = build_workload(config, shards=2)
    shepherd = Shepherd(config, workload)
    given = _record_steps(shepherd.engine.pacing)

    async def scenario(port):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(local_worker(port, "fast").run)
            await until(lambda: "fast" in shepherd.state.workers)  # index 0: shard 0's stream
            nursery.start_soon(local_worker(port, "slow", faults=_slow(factor=3.0)).run)

    run_shepherd(shepherd, scenario)
    history = shepherd.state.history
    assert [r.fragment_results for r in history] == [(2, 2)] * 3
    assert given[0] == {"fast": steps, "slow": steps}  # nobody measured before round 1
    assert all(max(g.values()) == steps for g in given), given  # the faster one trains H
    assert any(g["slow"] < steps for g in given[1:]), given  # the schedules did differ
    per_step = config.data.batch_size * config.data.seq_len
    rounds = [
        [
            (
                worker_batches(workload, config, slot, number, given[number - 1][worker]),
                h * per_step,
            )
            for slot, worker in enumerate(("fast", "slow"))
            for h in [given[number - 1][worker]]
        ]
        for number in range(1, 4)
    ]
    expected = reference.streaming_diloco(
        workload.loss_fn,
        workload.params,
        rounds,
        inner=optax.sgd(lr),
        outer=reference.outer_optimizer("nesterov"),
        fragments=shepherd.engine.fragments,
        overlap=1,
        alpha=0.5,
        merge=config.inner.overlap_merge,
    )
    for name, value in expected.items():
        np.testing.assert_allclose(shepherd.params[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def _record_steps(pacing: StepPacing) -> list[dict[str, int]]:
    """Each round's steps as `pacing` decides them (its own decision, kept for the reference)."""
    given: list[dict[str, int]] = []
    decide = pacing.steps_for

    def recording(workers, connections=None):
        given.append(decide(workers, connections))
        return given[-1]

    pacing.steps_for = recording
    return given


def test_a_worker_refuses_a_round_its_fragment_schedule_cannot_run():
    plan = protocol.Plan(
        param_names=("a", "b"),
        inner_steps=8,
        chunk_steps=1,
        fragments=(protocol.Fragment(("a",)), protocol.Fragment(("b",))),
        overlap_steps=1,
    )
    assert contract.round_steps_problem(plan, 4) is None  # shares of 2 steps, τ = 1
    assert "allows 1 to 8" in contract.round_steps_problem(plan, 10)  # longer than H: never
    assert "--overlap-steps 1" in contract.round_steps_problem(plan, 2)  # τ fills the share
    assert "multiple of --streaming-fragments" in contract.round_steps_problem(plan, 5)
