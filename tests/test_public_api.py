"""The names a user imports, and `pcp_tui.train` running a real local flock."""

from __future__ import annotations

import subprocess
import sys

import pytest

import pcp_tui
from pcp_tui.testing import SMALL_RUN


@pytest.mark.e2e
def test_every_public_name_resolves_and_nothing_generic_is_installed(tmp_path):
    for name in pcp_tui.__all__:
        assert getattr(pcp_tui, name) is not None, name
    # protocol/ and backends/ install inside pcp_tui only: a user's own `protocol` module wins
    (tmp_path / "protocol.py").write_text("MINE = True\n")
    (tmp_path / "backends").mkdir()
    (tmp_path / "backends" / "__init__.py").write_text("MINE = True\n")
    probe = (
        "import protocol, backends, pcp_tui.protocol, pcp_tui.backends;"
        "print(protocol.MINE, backends.MINE, pcp_tui.protocol.PROTOCOL_VERSION > 0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True", "True", "True"]


@pytest.mark.e2e
def test_importing_pcp_tui_loads_no_model_or_dashboard_code_and_a_worker_no_shepherd():
    probe = (
        "import sys, pcp_tui, pcp_tui.worker.client;"
        "print(sorted(m for m in sys.modules if m.startswith(('pcp_tui.training.models',"
        " 'pcp_tui.training.corpus', 'pcp_tui.app.dashboard', 'textual'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    probe = (  # what `pcp-tui worker` loads: no operator API server, no shepherd
        "import sys, pcp_tui.app.cli, pcp_tui.app.launch, pcp_tui.app.worker_view,"
        " pcp_tui.worker.client;"
        "print(sorted(m for m in sys.modules if m.startswith(('hypercorn', 'prometheus_client',"
        " 'pcp_tui.app.api', 'pcp_tui.app.headless', 'pcp_tui.shepherd'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.e2e  # real local worker processes
def test_train_runs_a_local_flock_and_returns_its_history():
    options = {k: v for k, v in SMALL_RUN.items() if k not in ("token", "heartbeat_seconds")}
    state = pcp_tui.train(workers=2, rounds=2, inner_steps=4, chunk_steps=2, **options)
    assert state.status == "done"
    assert [record.round for record in state.history] == [1, 2]
    assert all(record.workers == 2 for record in state.history)
    assert state.history[-1].eval_loss < state.history[0].eval_loss
