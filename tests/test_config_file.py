"""`--config run.toml`: the file fills RunConfig, flags actually passed override it."""

from __future__ import annotations

import pytest

from pcp_tui.app.cli import _config_from, build_parser, main
from pcp_tui.app.config_file import load_config_file
from pcp_tui.config import ConfigError, RunConfig


def _config(*argv: str):
    return _config_from(build_parser().parse_args(list(argv)))


def test_file_fills_options_and_passed_flags_win(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        "rounds = 3\ninner-steps = 7\ninner_lr = 1\n"
        '[model]\nname = "small"\nplatforms = ["cpu"]\n[network]\nmin-workers = 2\n'
    )
    config = _config("shepherd", "--config", str(path), "--rounds", "5")
    assert (config.outer.rounds, config.inner.steps, config.inner.lr) == (5, 7, 1.0)
    assert (config.model.platforms, config.network.min_workers) == (("cpu",), 2)
    assert config.model.name == "small"
    assert config.network.port == 8080  # untouched options keep the command's defaults
    demo = _config("demo", "--config", str(path))
    assert demo.outer.rounds == 3 and demo.network.port == 0  # demo's own defaults under the file
    assert _config("demo", "--rounds", "12").outer.rounds == 12  # a flag equal to the default


def test_a_sectioned_file_and_flat_keys_give_the_same_config(tmp_path):
    flat, sectioned = tmp_path / "flat.toml", tmp_path / "sectioned.toml"
    flat.write_text('inner_steps = 7\ndata = "corpus.txt"\ncheckpoint_every = 2\n')
    sectioned.write_text(
        '[inner]\nsteps = 7\n[data]\npath = "corpus.txt"\n[checkpoints]\nevery = 2\n'
    )
    assert load_config_file(flat) == load_config_file(sectioned)
    config = RunConfig(**load_config_file(sectioned))
    assert (config.inner.steps, config.data.path, config.checkpoints.every) == (7, "corpus.txt", 2)


def test_unknown_key_names_it_and_the_valid_ones(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text("round = 3\n")
    with pytest.raises(ConfigError, match=r"unknown option 'round' in .*valid options: .*rounds"):
        load_config_file(path)
    assert main(["shepherd", "--config", str(path)]) == 2
    assert "unknown option 'round'" in capsys.readouterr().err
    path.write_text("[inner]\nstep = 3\n")
    with pytest.raises(ConfigError, match=r"'step' in section \[inner\].*did you mean 'steps'"):
        load_config_file(path)


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


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"checkpoint_every": 0}, "--checkpoint-every must be at least 1, got 0"),
        ({"heartbeat_timeout": 0.0}, r"--heartbeat-timeout \(0 s\) must be at least 3x"),
        ({"heartbeat_timeout": 5.9}, r"must be at least 3x --heartbeat-seconds \(2 s\)"),
        ({"heartbeat_seconds": 0.0}, "--heartbeat-seconds must be positive"),
        ({"attention": "foo"}, "--attention must be one of xla, cudnn, got 'foo'"),
        ({"eval_batches": 0}, "--eval-batches must be at least 1"),
        ({"rounds": 0}, "--rounds must be at least 1"),
        ({"inner_steps": 0}, "--inner-steps must be at least 1"),
        ({"batch_size": 0}, "--batch-size must be at least 1"),
        ({"seq_len": 0}, "--seq-len must be at least 1"),
        ({"chunk_steps": 0}, "--chunk-steps must be at least 1"),
        ({"data_max_bytes": 0}, "--data-max-bytes must be at least 1"),
        ({"workers": 0}, "--workers must be at least 1"),
        ({"inner_lr": 0.0}, "--inner-lr must be positive"),
        ({"outer_lr": -1.0}, "--outer-lr must be positive"),
        ({"warmup_steps": -1}, "--warmup-steps must be 0 or more"),
        ({"weight_decay": -0.1}, "--weight-decay must be 0 or more"),
        ({"grad_clip": -1.0}, "--grad-clip must be 0 or more"),
        ({"seed": -1}, "--seed must be 0 or more"),
        ({"outer_momentum": 1.0}, r"--outer-momentum must be in \[0, 1\)"),
        ({"outer_momentum": -0.5}, r"--outer-momentum must be in \[0, 1\)"),
        ({"round_timeout": -1.0}, "--round-timeout must be 0 or more"),
        ({"min_workers": 0}, "--min-workers must be at least 1"),
        ({"min_workers": 3}, "--min-workers 3 is more than --workers 2: .*--round-timeout"),
        ({"port": 65536}, r"--port must be in 0..65535"),
        ({"port": -1}, r"--port must be in 0..65535"),
        (
            {"compression": "gzip"},
            "--compression must be one of none, bfloat16, int8Block, int4Block",
        ),
        ({"inner_optimizer": "adam"}, "--inner-optimizer must be one of adamw, sgd"),
        ({"handshake_timeout": 0.0}, "--handshake-timeout must be positive"),
        ({"max_handshakes": 0}, "--max-handshakes must be at least 1"),
        ({"tls_cert": "c.pem"}, "--tls-cert and --tls-key go together"),
    ],
)
def test_values_that_cannot_work_are_refused_with_the_option_and_its_range(changes, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**changes).validate()


def test_the_edges_of_every_range_are_accepted():
    RunConfig(
        outer_momentum=0.0,
        round_timeout=0.0,
        warmup_steps=0,
        grad_clip=0.0,
        weight_decay=0.0,
        port=0,
        min_workers=2,
        workers=2,
        heartbeat_seconds=0.5,
        heartbeat_timeout=1.5,
        eval_batches=1,
        checkpoint_every=1,
    ).validate()


def test_a_bad_value_on_the_command_line_exits_2_naming_it(capsys):
    missing = "/nonexistent/corpus"  # were the value let through, the run would stop here, not hang
    assert main(["shepherd", "--checkpoint-every", "0", "--data", missing]) == 2
    assert (
        capsys.readouterr().err == "pcp-tui: error: --checkpoint-every must be at least 1, got 0\n"
    )


def test_no_checkpoint_dir_unless_asked():
    # a resume keeps checkpointing where it resumed from: test_resume, on a real checkpoint
    assert _config("shepherd").checkpoints.dir is None
