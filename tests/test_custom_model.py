"""Any JAX model: a model file on the shepherd, workers that have only pcp-tui.

The end-to-end test starts real worker processes in an empty temporary
directory whose `sys.path` holds pcp-tui's own packages and nothing else (no
repository root, no examples/): they train the example MLP from the exported
graph and their rows of its data set alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import trio

from pcp_tui import protocol
from pcp_tui.config import ConfigError
from pcp_tui.contract import plan as contract
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.training import corpus, shards
from pcp_tui.training.build import build_workload
from pcp_tui.training.model_file import Dataset, ModelSpec, build_custom_workload, load_spec

from .conftest import small_config, worker_command, worker_env

REPO = Path(__file__).resolve().parents[1]
MLP = f"{REPO / 'examples' / 'mlp_model.py'}:build"


def _isolated_env(home: Path) -> dict[str, str]:
    """Environment whose sys.path sees only pcp_tui, protocol and backends (linked, not copied)."""
    site = home / "site"
    site.mkdir(exist_ok=True)
    for package in ("pcp_tui", "protocol", "backends"):
        if not (site / package).exists():
            (site / package).symlink_to(REPO / package)
    return {**worker_env(), "PYTHONPATH": str(site), "PYTHONSAFEPATH": "1"}


def _isolated_worker(port: int, home: Path) -> subprocess.Popen:
    return subprocess.Popen(
        worker_command(port),
        cwd=home,
        env=_isolated_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.e2e
def test_isolated_workers_train_the_example_model(tmp_path):
    config = small_config(
        model=MLP,
        batch_size=32,
        rounds=3,
        inner_steps=10,
        chunk_steps=5,
        workers=2,
        inner_lr=3e-3,
        warmup_steps=2,
        eval_batches=4,
    )
    workload = build_workload(config, shards=2)
    assert workload.name == "mlp-16x64x4" and isinstance(workload.shards[0], dict)
    shepherd = Shepherd(config, workload)
    workers = []

    async def main():
        async with trio.open_nursery() as nursery:
            port = await nursery.start(shepherd.run)
            workers.extend(_isolated_worker(port, tmp_path) for _ in range(2))

    try:
        trio.run(main)
        for worker in workers:
            assert worker.wait(timeout=60) == 0, worker.stdout.read()
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
            worker.stdout.close()
    history = shepherd.state.history
    assert [r.workers for r in history] == [2, 2, 2]
    assert history[0].tokens == 2 * 10 * 32  # a row counts as one token
    initial = shepherd.evaluate(workload.params)
    assert history[-1].eval_loss < 0.9 * initial


def test_rows_are_sharded_disjointly_and_sampled_reproducibly():
    arrays = corpus.row_arrays({"y": np.arange(10), "x": np.arange(20.0).reshape(10, 2)}, "test")
    assert (
        list(arrays) == ["x", "y"]
        and arrays["x"].dtype == np.float32
        and arrays["y"].dtype == np.int32
    )
    row_shards = corpus.split_rows(arrays, 3)
    assert sorted(np.concatenate([s["y"] for s in row_shards]).tolist()) == list(range(10))
    shard = (row_shards[1]["x"], row_shards[1]["y"])
    x, y = shards.sample_rows(shard, steps=4, batch_size=5, seed=0, stream=(1, 2, 0))
    assert x.shape == (4, 5, 2) and y.shape == (4, 5)
    np.testing.assert_array_equal(x[..., 0], 2 * y)  # rows stay aligned across arrays
    assert set(y.ravel()) <= set(row_shards[1]["y"].tolist())
    again = shards.sample_rows(shard, steps=4, batch_size=5, seed=0, stream=(1, 2, 0))
    np.testing.assert_array_equal(again[1], y)
    other = shards.sample_rows(shard, steps=4, batch_size=5, seed=0, stream=(1, 2, 1))
    assert not np.array_equal(other[1], y)


def shipped_plan(shard, seq_len: int = 16) -> tuple[protocol.Plan, dict]:
    """A plan carrying `shard`, through real Cap'n Proto bytes, as a worker receives it."""
    shipped = shards.shard_plan(shard)
    plan = protocol.Plan(
        shard_tensor=shipped.shard_tensor,
        shard_fingerprint=shipped.fingerprint,
        batch_kind=shipped.batch_kind,
        data_tensors=shipped.data_tensors,
        seq_len=seq_len,
        tokens_per_row=contract.tokens_per_row(shipped.batch_kind, seq_len),
    )
    message = protocol.decode(b"".join(bytes(b) for b in protocol.encode(plan, shipped.tensors)))
    return message.body, message.tensors


def test_plan_fields_round_trip_and_reject_a_tampered_shard():
    shard = {"x": np.ones((6, 3), np.float32), "y": np.arange(6, dtype=np.int32)}
    plan, tensors = shipped_plan(shard)
    assert plan.batch_kind == "rows" and plan.data_tensors == ("data/x", "data/y")
    assert plan.seq_len == 16 and plan.tokens_per_row == 1  # a row is one token; seqLen untouched
    kind, arrays = shards.shard_from_plan(plan, tensors)
    assert kind == "rows" and [a.shape for a in arrays] == [(6, 3), (6,)]
    tensors["data/y"] = tensors["data/y"] + 1
    with pytest.raises(shards.DataError, match="fingerprint"):
        shards.shard_from_plan(plan, tensors)
    plan, tensors = shipped_plan(np.arange(100, dtype=np.uint8))
    assert shards.shard_from_plan(plan, tensors)[0] == "windows" and plan.tokens_per_row == 16


def test_model_file_errors_say_what_to_fix(tmp_path):
    with pytest.raises(ConfigError, match="no file"):
        load_spec(f"{tmp_path / 'missing.py'}:build", small_config())
    model = tmp_path / "model.py"
    model.write_text("def build(config):\n    return 42\n")
    with pytest.raises(ConfigError, match="has no function 'make'"):
        load_spec(f"{model}:make", small_config())
    with pytest.raises(ConfigError, match="must return pcp_tui.ModelSpec"):
        load_spec(f"{model}:build", small_config())
    with pytest.raises(shards.DataError, match="same number of rows"):
        corpus.row_arrays({"x": np.zeros((3, 2)), "y": np.zeros(4)}, "data.train")


def test_a_dataset_without_val_holds_out_rows(tmp_path, monkeypatch):
    spec = ModelSpec(
        name="linear",
        init=lambda key: {"w": np.zeros(2, np.float32)},
        loss=lambda p, batch: ((batch["x"] @ p["w"] - batch["y"]) ** 2).mean(),
        data=lambda: Dataset(train={"x": np.arange(400.0).reshape(200, 2), "y": np.ones(200)}),
    )
    monkeypatch.setattr("pcp_tui.training.model_file.load_spec", lambda model, config: spec)
    workload = build_custom_workload(small_config(model="linear.py", batch_size=4), shards=2)
    assert workload.corpus.summary == "dataset linear: 190 train / 10 held-out rows"
    held = np.arange(19, 200, 20)  # every 20th row: rows sorted by anything are held out evenly
    assert workload.corpus.val["x"][:, 0].tolist() == (2 * held).tolist()
    assert not np.isin(2 * held, workload.corpus.train["x"][:, 0]).any()
    assert [len(s["x"]) for s in workload.shards] == [95, 95]
    assert workload.eval_batch_count == 2 and workload.batch_spec[0].shape == (4, 2)


@pytest.mark.e2e
def test_the_isolated_worker_cannot_import_the_model_file(tmp_path):
    probe = "import importlib.util as u, pcp_tui; print(u.find_spec('examples'), u.find_spec('mlp_model'))"
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=_isolated_env(tmp_path),
        capture_output=True,
        text=True,
    )
    assert result.stdout.split() == ["None", "None"], result.stderr
    assert os.listdir(tmp_path) == ["site"]


@pytest.mark.parametrize("model", ["tiny", MLP])
def test_the_shepherds_first_call_feeds_its_eval_and_score_graphs_their_own_inputs(model):
    """A GPU shepherd runs its eval and score graphs once on zeros before the run
    (`coordinator._first_call`); the inputs it builds from each graph's avals must be the
    (parameters, batch) that graph takes: one token array, or a tuple of row arrays."""
    from pcp_tui.backends import select_backend
    from pcp_tui.shepherd.coordinator import _first_call
    from pcp_tui.shepherd.rounds.engine import inner_optimizer
    from pcp_tui.shepherd.run.graphs import GraphLibrary

    config = small_config(model=model, batch_size=8, inner_steps=4, chunk_steps=2)
    assert config.outer.validating
    workload = build_workload(config, shards=2)
    graphs = GraphLibrary.for_run(config, workload, inner_optimizer(config)).export_main()
    backend = select_backend("cpu", 1)
    count = len(graphs.param_names)
    for name in ("eval_loss", "score_loss"):
        graph = backend.load(name, getattr(graphs, name), own=True)
        assert len(graph.in_avals) > count + (model == MLP)  # rows: x and y, after the params
        _first_call(graph, count)
