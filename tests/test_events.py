"""Events are typed: one class per kind, each with the fields its readers use."""

from __future__ import annotations

import json

import pytest

from pcp_tui.app.headless import MetricsWriter
from pcp_tui.shepherd.run import events
from pcp_tui.shepherd.run.events import Event, EventKind, Lost, Stragglers
from pcp_tui.shepherd.run.state import RunState


def _classes(base: type[Event]) -> list[type[Event]]:
    found = []
    for cls in base.__subclasses__():
        found += [cls, *_classes(cls)]
    return found


def test_every_kind_has_exactly_one_class():
    concrete = [cls for cls in _classes(Event) if "kind" in vars(cls)]
    assert sorted(cls.kind for cls in concrete) == sorted(EventKind)
    assert events.WorkerEvent not in concrete  # the worker events' base, of no kind itself


def test_an_event_refuses_a_field_its_kind_does_not_have():
    with pytest.raises(TypeError, match="shard"):
        Lost("worker 0 lost: reset", worker="w0", shard=3)  # type: ignore[call-arg]


def test_the_metrics_file_gets_an_events_fields(tmp_path):
    state = RunState(run_id="r", rounds_total=2, settings={})
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(str(path), state)
    state.subscribe(writer)
    state.emit(Stragglers("round 1 closed without b", workers=["b"]))
    writer.close()
    row = json.loads(path.read_text())
    assert (row["event"], row["workers"], row["message"]) == (
        "stragglers",
        ["b"],
        "round 1 closed without b",
    )
