"""Compute utilization and bytes against data parallelism: exact values for constructed rounds.

A real `Round` takes real round results (screened and folded in as the shepherd
does), then `record()` is given the round's wall seconds so that every share is
an exact binary fraction; the views (headless line, operator API, Prometheus)
read the record that comes out.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import trio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from pcp_tui import protocol
from pcp_tui.app.api_bodies import RunCollector, job_json, metrics_json, workers_json
from pcp_tui.app.headless import fixed, format_round, times_fewer
from pcp_tui.diloco.outer import PseudoGradientMean
from pcp_tui.diloco.screening import BadResult, ResultScreen
from pcp_tui.shepherd.rounds.results import Round, data_parallel_bytes, utilization
from pcp_tui.shepherd.run.history import RoundRecord
from pcp_tui.shepherd.run.state import RunState, WorkerView

SHAPES = {"w": (4, 3), "b": (3,)}
PARAMETERS = 15  # 4 x 3 + 3
INNER_STEPS = 10


def result(compute_seconds: float, scale: float = 1e-3) -> protocol.Message:
    """A well-formed round result for round 1 that says it computed for `compute_seconds`."""
    body = protocol.RoundResult(
        round=1, tokens=100, losses=(2.0,), compute_seconds=compute_seconds, inner_steps=10
    )
    tensors = {n: np.full(s, scale, np.float32) for n, s in SHAPES.items()}
    return protocol.Message(body, tensors, wire_bytes=64)


def closed_round(results: dict[str, protocol.Message], participants: list[str]) -> Round:
    """A real round for `participants` that took `results` (a refused one is finished, not counted)."""

    async def main() -> Round:
        screen = ResultScreen(SHAPES, max_tokens=1000)
        current = Round(1, participants, PseudoGradientMean(tuple(SHAPES)), screen)
        for worker_id, message in results.items():
            try:
                await current.add(worker_id, message)
            except BadResult:
                current.finish(worker_id)
        await current.close()
        return current

    return trio.run(main)


def test_each_worker_is_its_compute_over_the_round_and_the_run_is_their_mean():
    run, each = utilization({"a": 3.0, "b": 1.5}, 4.0)
    assert each == {"a": 0.75, "b": 0.375}
    assert run == 4.5 / (2 * 4.0) == 0.5625


def test_a_reported_compute_time_beyond_the_round_counts_as_the_whole_round():
    run, each = utilization({"fast-clock": 10.0, "honest": 2.0}, 4.0)
    assert each == {"fast-clock": 1.0, "honest": 0.5}
    assert run == 0.75


@pytest.mark.parametrize(
    ("compute", "seconds"), [({}, 4.0), ({"a": 1.0}, 0.0)], ids=["no contributors", "no time"]
)
def test_a_round_with_nothing_to_divide_is_zero(compute, seconds):
    assert utilization(compute, seconds) == (0.0, {})


def test_data_parallel_bytes_are_gradient_out_and_back_every_step_for_every_worker():
    assert data_parallel_bytes(parameter_count=1000, inner_steps=10, contributors=3) == (
        2 * 4 * 1000 * 10 * 3
    )
    assert data_parallel_bytes(1000, 10, 0) == 0


def test_the_record_carries_utilization_of_contributors_only_and_data_parallel_bytes():
    current = closed_round(
        {"a": result(3.0), "b": result(1.0), "bad": result(4.0, scale=np.nan)},
        participants=["a", "b", "bad", "silent"],
    )
    record = current.record(
        None, 1000, 600, parameter_count=PARAMETERS, inner_steps=INNER_STEPS, seconds=4.0
    )
    assert record.worker_ids == ("a", "b")
    assert record.worker_utilization == {"a": 0.75, "b": 0.25}  # not the refused or silent one
    assert record.utilization == 0.5
    assert record.bytes_data_parallel == 2 * 4 * PARAMETERS * INNER_STEPS * 2 == 2400
    assert record.bytes_exchanged == 1600 and record.data_parallel_ratio() == 1.5
    row = record.as_json()
    assert row["utilization"] == 0.5 and row["worker_utilization"] == {"a": 0.75, "b": 0.25}
    assert row["bytes_data_parallel"] == 2400


def test_the_data_parallel_ratio_needs_bytes_on_both_sides():
    current = closed_round({"a": result(1.0)}, participants=["a"])
    assert current.record(None, 0, 0, seconds=2.0).data_parallel_ratio() is None
    assert current.record(None, 10, 0, seconds=2.0).data_parallel_ratio() is None  # no model size


def test_the_headless_line_shows_utilization_and_bytes_against_data_parallelism():
    current = closed_round({"a": result(3.0), "b": result(1.0)}, participants=["a", "b"])
    record = current.record(None, 40, 10, parameter_count=1500, inner_steps=10, seconds=4.0)
    line = format_round(record, rounds_total=5)
    assert "util  50%" in line
    assert line.endswith("x4,800 fewer bytes than DP")  # 2 x 4 x 1500 x 10 x 2 / 50
    assert "than DP" not in format_round(current.record(None, 0, 0, seconds=4.0), 5)


def test_a_diverged_loss_keeps_the_headless_columns_in_line():
    current = closed_round({"a": result(3.0), "b": result(1.0)}, participants=["a", "b"])
    normal = format_round(current.record(2.1064, 40, 10, seconds=4.0), rounds_total=5)
    for train, eval_loss in ((3.4e30, 1.7e38), (float("nan"), float("inf")), (-123.456, 12.5)):
        record = replace(current.record(eval_loss, 40, 10, seconds=4.0), train_loss=train)
        line = format_round(record, rounds_total=5)
        assert len(line) == len(normal) and line.index(" s ") == normal.index(" s "), line
    assert format_round(record, 5).split()[3:6] == ["-123.46", "eval", "12.500"]
    assert (fixed(3.4e30, 7), fixed(1.7e38, 6), fixed(float("nan"), 7)) == (
        "3.4e+30",
        " 2e+38",
        "    nan",
    )


@pytest.mark.parametrize(
    ("ratio", "text"), [(48.4, "x48 fewer"), (2.25, "x2.2 fewer"), (0.5, "x2.0 more")]
)
def test_times_fewer_says_which_way(ratio, text):
    assert times_fewer(ratio) == text


def run_state(record: RoundRecord) -> RunState:
    """A run with workers a, b (contributed) and late (joined after the round) and one round."""
    state = RunState(run_id="r", rounds_total=5, settings={"workers": 3})
    for index, worker_id in enumerate(("a", "b", "late")):
        state.workers[worker_id] = WorkerView(worker_id, index, "host")
    state.history.append(record)
    return state


def test_the_operator_api_shows_the_run_and_each_contributor_and_null_for_the_others():
    current = closed_round({"a": result(3.0), "b": result(1.0)}, participants=["a", "b"])
    record = current.record(None, 1000, 600, parameter_count=PARAMETERS, inner_steps=10, seconds=4)
    state = run_state(record)
    job = job_json(state)
    assert (job["utilization"], job["bytes_exchanged"], job["bytes_data_parallel"]) == (
        0.5,
        1600,
        2400,
    )
    shares = {w["id"]: w["utilization"] for w in workers_json(state)["workers"]}
    assert shares == {"a": 0.75, "b": 0.25, "late": None}
    metrics = metrics_json(state)
    assert metrics["rounds"][0]["worker_utilization"] == {"a": 0.75, "b": 0.25}
    assert metrics["bytes_data_parallel"] == 2400


def test_prometheus_has_the_run_gauge_and_one_sample_per_contributor():
    current = closed_round({"a": result(3.0), "b": result(1.0)}, participants=["a", "b"])
    record = current.record(None, 1000, 600, parameter_count=PARAMETERS, inner_steps=10, seconds=4)
    registry = CollectorRegistry()
    registry.register(RunCollector(run_state(record)))
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert [s.value for s in families["pcp_utilization"].samples] == [0.5]
    assert [s.value for s in families["pcp_round_bytes_data_parallel"].samples] == [2400]
    workers = {s.labels["worker"]: s.value for s in families["pcp_worker_utilization"].samples}
    assert workers == {"a": 0.75, "b": 0.25}
