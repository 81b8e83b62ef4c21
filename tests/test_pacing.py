"""--adaptive-steps: a slow worker's round is sized to its speed, the fast one trains H.

A real worker and a real worker made three times slower (`faulty_worker slow`:
every compiled chunk sleeps twice its own compute time), through real sockets.
"""

from __future__ import annotations

import subprocess

import pytest
import trio

from pcp_tui.config import ConfigError
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.shepherd.pacing import StepPacing
from pcp_tui.shepherd.rounds import Round
from pcp_tui.testing import faulty_worker_command
from pcp_tui.training.build import build_workload

from .conftest import small_config, worker_env

H, CHUNK = 20, 5


def test_steps_follow_speed_in_whole_chunks():
    pacing = StepPacing(H, CHUNK)
    assert pacing.steps_for(["a", "b"]) == {"a": H, "b": H}  # nobody measured yet
    measured = Round(1, ["a", "b", "c"], _NoMean(), None)
    measured.contributors = ["a", "b", "c"]
    measured.steps_by_worker = {"a": 20, "b": 20, "c": 20}
    measured.compute_seconds = {"a": 1.0, "b": 2.0, "c": 100.0}
    pacing.observe(measured)
    assert pacing.steps_for(["a", "b", "c", "new"]) == {"a": 20, "b": 10, "c": 5, "new": 20}
    assert pacing.steps_for(["b", "c"]) == {"b": 20, "c": 5}  # the fastest present trains H


def test_adaptive_steps_need_plain_diloco():
    with pytest.raises(ConfigError, match="plain DiLoCo only"):
        small_config(adaptive_steps=True, streaming_fragments=2, inner_steps=8).validate()


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
