"""--adaptive-steps: a slow worker's round is sized to its speed, the fast one trains H.

A real worker and a real worker made three times slower (`faulty_worker slow`:
every compiled chunk sleeps twice its own compute time), through real sockets.
"""

from __future__ import annotations

import subprocess

import pytest
import trio

from pcp_tui.config.run import schedule_problem
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.shepherd.pacing import SMOOTHING, SpeedEstimate, StepPacing
from pcp_tui.shepherd.rounds import Round
from pcp_tui.testing import faulty_worker_command
from pcp_tui.training.build import build_workload

from .conftest import small_config, worker_env

H, CHUNK = 20, 5


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


@pytest.mark.e2e
def test_a_slow_worker_trains_fewer_steps_and_still_counts(spawn_worker):
    config = small_config(
        workers=2, rounds=3, inner_steps=H, chunk_steps=CHUNK, adaptive_steps=True
    )
    shepherd = Shepherd(config, build_workload(config, shards=2))

    async def main():
        async with trio.open_nursery() as nursery:
            port = await nursery.start(shepherd.run)
            spawn_worker(port, "--id", "fast")
            command = faulty_worker_command(port, "slow", "--id", "slow", factor=3.0)
            slow = subprocess.Popen(
                command, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
            )
            try:
                while not any(e.kind == "done" for e in shepherd.state.events):
                    await trio.sleep(0.05)
            finally:
                await trio.to_thread.run_sync(slow.wait)

    trio.run(main)
    history = shepherd.state.history
    full = H * config.data.batch_size * config.data.seq_len
    assert [r.workers for r in history] == [2] * 3  # the slow worker is never dropped
    assert history[0].tokens == 2 * full  # round 1: nobody measured, both train H
    assert all(full < r.tokens < 2 * full for r in history[1:])  # then the slow one trains less
    # one round's speeds are noisy on a loaded box; over the run the slow worker trains less
    trained = {worker: shepherd.state.workers[worker].steps_trained for worker in ("fast", "slow")}
    assert trained["slow"] < trained["fast"], trained
    steps = shepherd.pacing.steps_for(["fast", "slow"])
    assert max(steps.values()) == H and CHUNK <= min(steps.values()) < H
    print("fast worker utilization by round:", [r.worker_utilization["fast"] for r in history])
