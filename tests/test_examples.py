"""The examples cannot rot: every file in examples/ is loaded, parsed or run here."""

from __future__ import annotations

import functools
import json
import math
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import pytest

from pcp_tui.app.cli import _config_from, build_parser, parse_args
from pcp_tui.app.config_file import load_config_file, reference_toml
from pcp_tui.app.plot import with_evals
from pcp_tui.config import RunConfig
from pcp_tui.training.build import model_config, preset_name
from pcp_tui.training.model_file import load_spec
from pcp_tui.training.models import gpt2

from .conftest import worker_env

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _uncommented(text: str) -> str:
    """run.toml with every `# key = value` line switched on."""
    return "\n".join(re.sub(r"^# (\w+ = .*)$", r"\1", line) for line in text.splitlines())


def test_run_toml_loads_and_lists_every_option(tmp_path):
    assert load_config_file(EXAMPLES / "run.toml") == {}  # all commented: the defaults
    switched = tmp_path / "all.toml"
    switched.write_text(_uncommented((EXAMPLES / "run.toml").read_text()))
    values = load_config_file(switched)
    defaults = RunConfig().flat()
    assert set(values) == set(defaults), "run.toml must list every option"
    RunConfig(**values).validate()
    shown = {name: value for name, value in values.items() if defaults[name] is not None}
    assert shown == {name: defaults[name] for name in shown}, "run.toml must show the defaults"


def test_run_toml_is_the_generated_reference():
    """It is generated from the declarations in pcp_tui/config, so it cannot drift from them."""
    assert (EXAMPLES / "run.toml").read_text() == reference_toml(), (
        "examples/run.toml is stale: python -m pcp_tui.app.config_file > examples/run.toml"
    )


def test_mlp_model_builds_and_its_loss_falls_with_plain_sgd():
    spec = load_spec(f"{EXAMPLES / 'mlp_model.py'}:build", RunConfig())
    data = spec.data
    params = spec.init(jax.random.PRNGKey(0))
    batch = {key: array[:256] for key, array in data.train.items()}
    grad = jax.jit(jax.value_and_grad(spec.loss))
    first, _ = grad(params, batch)
    for _ in range(30):
        value, g = grad(params, batch)
        params = jax.tree.map(lambda p, d: p - 0.5 * d, params, g)
    assert value < first * 0.8


@pytest.mark.e2e
def test_the_example_model_trains_well_with_the_readme_command(tmp_path):
    """The README's command, default settings: the eval loss falls every evaluated round.

    It fell to 0.78 by round 4 and then rose every round to 0.84 (see the example's
    `init` and `synthetic_data` for why); now 1.65 at round 1, 0.51 at round 12.
    """
    metrics = tmp_path / "run.jsonl"
    command = ["demo", "--model", "examples/mlp_model.py:build", "--workers", "2", "--headless",
               "--batch-size", "32", "--metrics", str(metrics)]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "pcp_tui", *command],
        cwd=EXAMPLES.parent,
        capture_output=True,
        text=True,
        timeout=600,
        env=worker_env(),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [row["eval_loss"] for row in with_evals(rows)]
    # a round's eval runs beside the next round and is skipped while the last still runs (a
    # loaded machine): each eval that ran is below the one before; the last one is awaited
    done = [loss for loss in evals if loss is not None]
    assert len(evals) == 12 and evals[-1] is not None, evals
    assert all(b < a for a, b in zip(done, done[1:], strict=False)), evals
    assert evals[-1] < 0.55, evals


def _commands(markdown: Path) -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", markdown.read_text(), re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("pcp-tui ")]


@pytest.mark.parametrize(
    "argv", _commands(EXAMPLES / "multi_host.md"), ids=lambda argv: " ".join(argv[:3])
)
def test_multi_host_commands_parse_with_the_real_cli(argv, monkeypatch):
    monkeypatch.chdir(EXAMPLES.parent)
    args = build_parser().parse_args(argv)
    if args.command in ("shepherd", "demo"):
        config = _config_from(args)
        assert config.network.workers == 2
    else:
        host, _, port = args.connect.rpartition(":")
        assert host == "10.0.0.5" and port.isdigit()


def _documented_commands() -> list[tuple[str, list[str]]]:
    """(file, argv) of every `pcp-tui ...` line in a bash block of the README and docs/
    (continuation lines joined, comments dropped; `...` stands for more options).
    examples/multi_host.md has its own test above."""
    root = EXAMPLES.parent
    found = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if line.strip().startswith("pcp-tui ") and "..." not in line:
                    found.append((path.name, shlex.split(line, comments=True)[1:]))
    return found


@pytest.mark.parametrize(
    ("where", "argv"),
    _documented_commands(),
    ids=lambda x: " ".join(x[:3]) if isinstance(x, list) else x,
)
def test_every_documented_command_parses_with_the_real_cli(where, argv, capsys):
    """An option renamed or dropped in the CLI fails here, not on a user's first try."""
    try:
        parse_args(build_parser(), argv)
    except SystemExit as exc:
        if exc.code:
            pytest.fail(f"{where}: pcp-tui {' '.join(argv)}: {capsys.readouterr().err.strip()}")


def test_multi_host_recipe_covers_workers_tls_and_custom_models():
    argvs = [" ".join(argv) for argv in _commands(EXAMPLES / "multi_host.md")]
    for flag in ("--tls-cert", "--tls-key", "--tls-fingerprint", "--tls-ca", "--config", "--model"):
        assert any(flag in argv for argv in argvs), flag


def test_the_readme_model_file_works(tmp_path):
    readme = (EXAMPLES.parent / "README.md").read_text()
    section = readme[readme.index("## Train your own JAX model") :]
    source = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "model.py").write_text(source)
    spec = load_spec(str(tmp_path / "model.py"), RunConfig())
    batch = {key: array[:64] for key, array in spec.data.train.items()}
    value = spec.loss(spec.init(jax.random.PRNGKey(0)), batch)
    assert value.shape == () and 0.5 < float(value) < 5


def test_every_documented_pip_install_names_this_checkout_and_extras_it_has():
    """pcp-tui has no release: a documented install is of the checkout (`.`, `-e .`, `git+`), or
    adds extras to the installed checkout (`'pcp-tui[iree]'`), and each extra named exists
    (pip only warns about an unknown one and installs nothing for it)."""
    extras = set(
        tomllib.loads((EXAMPLES.parent / "pyproject.toml").read_text())["project"][
            "optional-dependencies"
        ]
    )
    installs = [
        (path.name, target)
        for path in [EXAMPLES.parent / "README.md", *EXAMPLES.glob("*.md")]
        for command in re.findall(r"pip install\s+([^`#;\n]+)", path.read_text())
        for target in shlex.split(re.sub(r"<[^>]*>", "URL", command))
        if not target.startswith("-") or target == "-e"
    ]
    assert installs, "no pip install documented"
    for where, target in installs:
        if target == "-e" or target.startswith("git+"):
            continue
        name, _, named = target.partition("[")
        assert name in (".", "pcp-tui"), f"{where}: pip install {target} is not this checkout"
        assert name == "." or named, f"{where}: pip install {target} fetches an unreleased package"
        unknown = set(named.rstrip("]").split(",")) - extras - {""}
        assert not unknown, f"{where}: pip install {target}: no extra {sorted(unknown)}"


def test_the_gpt2_preset_sizes_in_the_readme_and_its_name():
    row = next(
        line
        for line in (EXAMPLES.parent / "README.md").read_text().splitlines()
        if line.startswith("| `--model tiny")
    )
    for vocab, size in ((256, "86M"), (50_257, "124M")):
        preset = model_config(RunConfig(model="gpt2"), vocab)
        shapes = jax.eval_shape(functools.partial(gpt2.init, preset), jax.random.PRNGKey(0))
        count = sum(math.prod(s.shape) for s in shapes.values())
        assert f"{count / 1e6:.0f}M" == size and size in row
    assert "50,257-token vocabulary" in row
    assert preset_name("gpt2") == "gpt2" and preset_name("tiny") == "gpt2-tiny"


def test_every_package_of_the_checkout_is_in_the_wheel():
    """pyproject.toml lists the packages a wheel holds (protocol/ and backends/ install under
    pcp_tui): a folder left off installed without it (`pip install .` lacked
    pcp_tui.shepherd.rounds, .run and .serving, and `pcp-tui shepherd` failed to import),
    while the editable install of the README and CI still found it."""
    root = EXAMPLES.parent
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    moved = {f"pcp_tui.{name}": name for name in ("protocol", "backends")}
    packages = {
        ".".join(init.parent.relative_to(root).parts)
        for init in (root / "pcp_tui").rglob("__init__.py")
    }
    assert set(setuptools["packages"]) == packages | set(moved)
    assert setuptools["package-dir"] == moved
    assert all((root / folder / "__init__.py").is_file() for folder in moved.values())
