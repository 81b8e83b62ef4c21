"""Every `benchmarks/bench_*.py` runs at its `--smoke` size and prints its table and ratio line.

A benchmark nobody runs rots unseen: an API it calls changes, an option stops
parsing, a division meets a zero. Each one here runs as a real process of this
interpreter (the installed package: the checkout is neither the working
directory nor on PYTHONPATH), at the smallest size that takes the same code
path; the test reads the table's first line and the ratio against the
benchmark's baseline from its output and checks the ratio is a finite number.
A new benchmark fails here until it has a `--smoke` size
(`pcp_tui.testing.parse_with_smoke`) and an entry in `EXPECTED`.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pcp_tui.testing import worker_env

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("bench_*.py"))
RATIO = r"^ratio_\w+=(\S+)$"

#: name: (the first line of its table, the ratio against its baseline: a regular expression
#: whose group is the number; every line it matches is checked)
EXPECTED = {
    "bench_4bit_grids": (r"^grid\s+block\s+relative MSE", RATIO),
    "bench_byzantine": (r"^\| attack \| defence \| final eval \|", RATIO),
    "bench_change": (r"^\| M values \| quantization \|", RATIO),
    "bench_compression": (r"^encoding\s+MB received", RATIO),
    "bench_decode": (r"^\| M values \| quantization \| decode before", RATIO),
    "bench_faults": (r"^\| fault \| seconds to notice \|", RATIO),
    "bench_iree": (r"^runtime\s+compile s", RATIO),
    "bench_mesh": (r"^worker\(s\)\s+tokens/s", RATIO),
    "bench_mixed_speeds": (r"^\s+run rounds fast util", RATIO),
    "bench_outer_step": (r"^\| M values \| k \| results \|", RATIO),
    "bench_overshoot": (r"^round worker c rows \| L at s", RATIO),
    "bench_quality": (r"^\| run \| rounds \| tokens \|", RATIO),
    "bench_resume_clip": (r"^aggregate\s+run\s+eval loss per round", RATIO),
    "bench_shepherd_eval": (r"^\s+eval batches\s+validate\s+busy", RATIO),
    "bench_shepherd_scale": (r"^\s+workers\s+relays\s+round s", RATIO),
    "bench_shepherd_scale --simulated": (r"^\s+workers\s+relays\s+relayed\s+CPU s", RATIO),
    "bench_site_messages": (r"^method\s+MB/s", RATIO),
    "bench_stragglers": (r"^\| scenario \| rounds with an honest result \|", RATIO),
    "bench_streaming": (r"^\s+run\s+util\s+x plain", RATIO),
    "bench_squatters": (r"^squatters\s+both honest workers admitted", RATIO),
    "bench_sybil_copies": (r"^round id  own: seen unseen", RATIO),
    "bench_streams": (r"^streams\s+seconds", RATIO),
    "bench_tensor_transfer": (r"^method\s+MB\s+wire MB", RATIO),
    "bench_wan": (r"^\s+link\s+round s", RATIO),
    "bench_worker_overhead": (r"^method\s+tokens/s \(median\)", RATIO),
    # no baseline: the worker's own seconds a round without compute
    "bench_worker_sync": (r"^worker sync ", r"round without compute (\S+) s"),
}


#: a benchmark's other modes, each smoked too (its EXPECTED key: "name --flag")
MODES = {"bench_shepherd_scale": ["--simulated"]}


def _params():
    marks = [pytest.mark.bench, pytest.mark.e2e]  # each runs as a process of its own
    for path in BENCHMARKS:
        for mode in ["", *MODES.get(path.stem, [])]:
            name = f"{path.stem} {mode}".strip()
            yield pytest.param(path, mode, marks=marks, id=name.replace(" --", "-"))


@pytest.mark.parametrize(("path", "mode"), _params())
def test_smoke(path: Path, mode: str, tmp_path: Path) -> None:
    name = f"{path.stem} {mode}".strip()
    assert name in EXPECTED, (
        f"{name}: add its table's first line and its ratio line to EXPECTED in {__file__}"
    )
    table, ratio = EXPECTED[name]
    env = worker_env()
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [sys.executable, str(path), "--smoke", *mode.split()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard, not a measurement
    )
    if "unrecognized arguments: --smoke" in done.stderr:
        pytest.fail(
            f"{path.name} has no --smoke size: give it one (pcp_tui.testing.parse_with_smoke)"
        )
    output = f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, f"{path.name} --smoke exited with {done.returncode}\n{output}"
    assert re.search(table, done.stdout, re.M), f"no table ({table!r}) in\n{output}"
    numbers = re.findall(ratio, done.stdout, re.M)
    assert numbers, f"no ratio line ({ratio!r}) in\n{output}"
    for number in numbers:
        assert math.isfinite(float(number)), f"{path.name}: ratio {number}\n{output}"
