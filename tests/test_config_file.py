"""`--config run.toml`: the file fills RunConfig, flags actually passed override it."""

from __future__ import annotations

import pytest

from pcp_tui.cli import _config_from, build_parser, main
from pcp_tui.config import ConfigError
from pcp_tui.config_file import load_config_file


def _config(*argv: str):
    return _config_from(build_parser().parse_args(list(argv)))


def test_file_fills_options_and_passed_flags_win(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'rounds = 3\ninner-steps = 7\ninner_lr = 1\nplatforms = ["cpu"]\nmodel = "small"\n'
    )
    config = _config("shepherd", "--config", str(path), "--rounds", "5")
    assert (config.rounds, config.inner_steps, config.inner_lr, config.platforms) == (
        5,
        7,
        1.0,
        ("cpu",),
    )
    assert (
        config.model == "small" and config.port == 8080
    )  # untouched options keep the command's defaults
    demo = _config("demo", "--config", str(path))
    assert demo.rounds == 3 and demo.port == 0  # demo's own defaults under the file
    assert (
        _config("demo", "--rounds", "12").rounds == 12
    )  # a flag equal to the default still counts


def test_unknown_key_names_it_and_the_valid_ones(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text("round = 3\n")
    with pytest.raises(ConfigError, match=r"unknown option 'round' in .*valid options: .*rounds"):
        load_config_file(path)
    assert main(["shepherd", "--config", str(path)]) == 2
    assert "unknown option 'round'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rounds = 2.5", "must be an integer"),
        ("rounds = true", "must be an integer"),
        ('inner_lr = "fast"', "must be a number"),
        ("model = 3", "must be a string"),
        ("rounds = ", "not valid TOML"),
    ],
)
def test_wrong_types_are_refused(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=message):
        load_config_file(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read --config"):
        load_config_file(tmp_path / "nope.toml")
