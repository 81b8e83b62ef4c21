"""What the operator API answers: JSON bodies and Prometheus families, read from `RunState`.

Pure functions of the state (and one Prometheus collector over it), so the
same numbers reach /v1/job, /v1/metrics and /metrics, and nothing here knows
about HTTP (the API turns a NaN loss into JSON's null; Prometheus takes it as it is).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pcp_tui import __version__
from pcp_tui.shepherd.run.history import RoundRecord
from pcp_tui.shepherd.run.state import RunState, RunStatus, WorkerView

_RECENT_ROUNDS = 100  # rounds /v1/metrics lists; its totals cover the whole run


def _last_round(state: RunState) -> RoundRecord | None:
    return state.history[-1] if state.history else None


def worker_utilization(state: RunState, worker_id: str) -> float | None:
    """The worker's share of the last round spent computing; None if it did not contribute.

    A worker that joined late, was lost or whose result was refused has no share
    in that round: null in JSON and no sample in Prometheus, never a made-up zero.
    """
    last = _last_round(state)
    return last.worker_utilization.get(worker_id) if last else None


def controller_json(state: RunState) -> dict[str, Any]:
    """/v1/controller: which run this is and where it listens (never the join token)."""
    return {
        "run_id": state.run_id,
        "version": __version__,
        "address": state.address,
        "api_address": state.api_address,
        "status": state.status,
        "model": state.model_name,
        "param_count": state.param_count,
        "elapsed_seconds": state.elapsed(),
    }


def job_json(state: RunState) -> dict[str, Any]:
    """/v1/job: progress, the latest losses and throughput, utilization and ETA (null until round 1)."""
    last = _last_round(state)
    return {
        "run_id": state.run_id,
        "status": state.status,
        "round": state.round,
        "rounds_total": state.rounds_total,
        "rounds_done": state.rounds_done(),
        "train_loss": last.train_loss if last else None,
        "eval_loss": state.last_eval_loss(),
        "tokens_per_second": last.tokens_per_second if last else None,
        "utilization": last.utilization if last else None,
        "bytes_exchanged": last.bytes_exchanged if last else None,
        "bytes_data_parallel": last.bytes_data_parallel if last else None,
        "eta_seconds": state.eta_seconds(),
        "elapsed_seconds": state.elapsed(),
        "workers_active": len(state.active_workers()),
        "workers_wanted": state.settings.get("workers"),
        "settings": state.settings,
    }


def worker_json(view: WorkerView, now: float, utilization: float | None = None) -> dict[str, Any]:
    """One worker as /v1/workers lists it; `now` is `time.monotonic()` for `seconds_since_heard`.

    `utilization` is its share of the last round spent computing (`worker_utilization`).
    """
    return {
        "id": view.worker_id,
        "index": view.index,
        "host": view.host,
        "backend": view.backend,
        "devices": view.devices,
        "state": view.state,
        "round": view.round,
        "step": view.step,
        "total_steps": view.total_steps,
        "loss": view.loss,
        "tokens_per_second": view.tokens_per_second,
        "bytes_in": view.bytes_in,
        "bytes_out": view.bytes_out,
        "rounds_contributed": view.rounds_contributed,
        "utilization": utilization,
        "seconds_since_heard": max(now - view.last_heard, 0.0),
        "reason": view.reason,
        **view.stats_json(),
    }


def workers_json(state: RunState) -> dict[str, Any]:
    """/v1/workers: every worker the run has seen, lost and departed ones included."""
    now = time.monotonic()
    return {
        "workers": [
            worker_json(view, now, worker_utilization(state, view.worker_id))
            for view in state.workers.values()
        ]
    }


def metrics_json(state: RunState) -> dict[str, Any]:
    """/v1/metrics: whole-run totals and the latest rounds (as the JSONL metrics file writes them)."""
    history = state.history
    rounds = []
    for record in history[-_RECENT_ROUNDS:]:
        row = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}  # shallow
        row["worker_ids"] = list(record.worker_ids)
        row["worker_utilization"] = dict(record.worker_utilization)
        rounds.append(row)
    return {
        "rounds_done": len(history),
        "tokens": sum(r.tokens for r in history),
        "bytes_sent": state.bytes_sent,
        "bytes_received": state.bytes_received,
        "bytes_saved": sum(r.bytes_saved for r in history),
        "bytes_data_parallel": sum(r.bytes_data_parallel for r in history),
        "seconds": state.elapsed(),
        "best_eval_loss": min(
            (r.eval_loss for r in history if r.eval_loss is not None), default=None
        ),
        "rounds": rounds,
    }


# ------------------------------------------------------------------ Prometheus


class RunCollector(Collector):
    """Prometheus families read from `RunState` at scrape time (nothing is kept twice).

    Run families: `pcp_run_info`, `pcp_run_status` (one sample per status, 1 for
    the current one), `pcp_round`, `pcp_rounds_planned`, `pcp_rounds_completed_total`,
    losses, throughput, utilization, bytes and tokens. Per-worker families
    (`pcp_worker_*`) carry a `worker` label with the worker's id.
    """

    def __init__(self, state: RunState):
        self.state = state

    def collect(self) -> Iterator[Metric]:
        yield from self._run_families()
        yield from self._worker_families()

    def _run_families(self) -> Iterator[Metric]:
        state = self.state
        last = _last_round(state)
        info = GaugeMetricFamily(
            "pcp_run_info", "The run: id, model, version", labels=["run_id", "model", "version"]
        )
        info.add_metric([state.run_id, state.model_name, __version__], 1)
        yield info
        status = GaugeMetricFamily(
            "pcp_run_status", "1 for the run's current status", labels=["status"]
        )
        for each in RunStatus:
            status.add_metric([each.value], 1 if state.status == each else 0)
        yield status
        yield GaugeMetricFamily("pcp_round", "Round in progress (or last run)", value=state.round)
        yield GaugeMetricFamily(
            "pcp_rounds_planned", "Rounds the run is configured for", value=state.rounds_total
        )
        yield CounterMetricFamily(
            "pcp_rounds_completed", "Rounds finished", value=len(state.history)
        )
        yield CounterMetricFamily(
            "pcp_tokens",
            "Tokens trained on, all workers",
            value=sum(r.tokens for r in state.history),
        )
        yield CounterMetricFamily("pcp_bytes_sent", "Bytes sent to workers", value=state.bytes_sent)
        yield CounterMetricFamily(
            "pcp_bytes_received", "Bytes received from workers", value=state.bytes_received
        )
        yield GaugeMetricFamily(
            "pcp_workers_active",
            "Workers connected and not lost",
            value=len(state.active_workers()),
        )
        optional = {
            "pcp_train_loss": (
                "Mean inner-step train loss of the last round",
                None if last is None else last.train_loss,
            ),
            "pcp_eval_loss": ("Latest held-out loss", state.last_eval_loss()),
            "pcp_tokens_per_second": (
                "Tokens per second of the last round",
                None if last is None else last.tokens_per_second,
            ),
            "pcp_round_seconds": (
                "Wall seconds of the last round",
                None if last is None else last.round_seconds,
            ),
            "pcp_utilization": (
                "Compute seconds / (contributors x round seconds), last round",
                None if last is None else last.utilization,
            ),
            "pcp_round_bytes": (
                "Bytes sent and received in the last round",
                None if last is None else last.bytes_exchanged,
            ),
            "pcp_round_bytes_data_parallel": (
                "Bytes synchronous data parallelism would have exchanged in the last round",
                None if last is None else last.bytes_data_parallel,
            ),
            "pcp_eta_seconds": ("Estimated seconds to the last round", state.eta_seconds()),
        }
        for name, (doc, value) in optional.items():
            if value is not None:  # no sample rather than a made-up zero before round 1
                yield GaugeMetricFamily(name, doc, value=value)

    def _worker_families(self) -> Iterator[Metric]:
        views = list(self.state.workers.values())
        now = time.monotonic()
        info = GaugeMetricFamily(
            "pcp_worker_info",
            "A worker the run has seen",
            labels=["worker", "index", "host", "backend", "runtime", "state"],
        )
        for view in views:
            labels = [view.worker_id, str(view.index), view.host, view.backend, view.runtime]
            info.add_metric([*labels, view.state], 1)
        yield info
        for name, doc, kind, read in _WORKER_FAMILIES:
            family = kind(name, doc, labels=["worker"])
            for view in views:
                value = read(view, now)
                if value is not None:
                    family.add_metric([view.worker_id], value)
            yield family
        share = GaugeMetricFamily(
            "pcp_worker_utilization",
            "Compute seconds / round seconds in the last round (contributors only)",
            labels=["worker"],
        )
        for view in views:
            value = worker_utilization(self.state, view.worker_id)
            if value is not None:
                share.add_metric([view.worker_id], value)
        yield share


_WORKER_FAMILIES: tuple[tuple[str, str, type, Callable[[WorkerView, float], float | None]], ...] = (
    ("pcp_worker_step", "Inner step within the round", GaugeMetricFamily, lambda w, _: w.step),
    ("pcp_worker_loss", "Latest inner-step loss", GaugeMetricFamily, lambda w, _: w.loss),
    (
        "pcp_worker_tokens_per_second",
        "Latest throughput",
        GaugeMetricFamily,
        lambda w, _: w.tokens_per_second,
    ),
    (
        "pcp_worker_bytes_in",
        "Bytes received from the worker",
        CounterMetricFamily,
        lambda w, _: w.bytes_in,
    ),
    (
        "pcp_worker_bytes_out",
        "Bytes sent to the worker",
        CounterMetricFamily,
        lambda w, _: w.bytes_out,
    ),
    (
        "pcp_worker_rounds_contributed",
        "Rounds whose average took this worker's result",
        CounterMetricFamily,
        lambda w, _: w.rounds_contributed,
    ),
    (
        "pcp_worker_seconds_since_heard",
        "Seconds since the last message",
        GaugeMetricFamily,
        lambda w, now: max(now - w.last_heard, 0.0),
    ),
    ("pcp_worker_shard", "The data shard it trains", GaugeMetricFamily, lambda w, _: w.shard),
    ("pcp_worker_devices", "Devices it reported", GaugeMetricFamily, lambda w, _: w.devices),
    (
        "pcp_worker_processes",
        "Processes (hosts) of a site, one worker over multi-controller JAX",
        GaugeMetricFamily,
        lambda w, _: w.processes,
    ),
    (
        "pcp_worker_compile_seconds",
        "Seconds it took to compile the training graphs",
        GaugeMetricFamily,
        lambda w, _: w.compile_seconds,
    ),
    (
        "pcp_worker_steps_trained",
        "Inner steps it trained since its process started",
        CounterMetricFamily,
        lambda w, _: w.steps_trained,
    ),
    (
        "pcp_worker_tokens_trained",
        "Tokens it trained on since its process started",
        CounterMetricFamily,
        lambda w, _: w.tokens_trained,
    ),
    (
        "pcp_worker_memory_bytes",
        "Device memory in use (process resident memory on CPU)",
        GaugeMetricFamily,
        lambda w, _: w.memory_in_use,
    ),
    (
        "pcp_worker_memory_peak_bytes",
        "Most device memory in use so far",
        GaugeMetricFamily,
        lambda w, _: w.memory_peak,
    ),
    (
        "pcp_worker_memory_limit_bytes",
        "Device memory it has",
        GaugeMetricFamily,
        lambda w, _: w.memory_limit,
    ),
    (
        "pcp_worker_gpu_utilization",
        "GPU busy share 0..1 (NVML; absent where not measured)",
        GaugeMetricFamily,
        lambda w, _: w.gpu_utilization,
    ),
)
