"""Config from one declaration: flat names, nested sections, generated flags and their groups."""

from __future__ import annotations

import pytest

from pcp_tui.app.cli import _config_from, build_parser, main, worker_config_from
from pcp_tui.config import FLAT_PATHS, ConfigError, InnerConfig, RunConfig, WorkerConfig, specs


def test_flat_names_nested_dicts_and_sections_build_the_same_config():
    flat = RunConfig(inner_steps=5, model="small", data="corpus.txt")
    assert flat == RunConfig(
        inner={"steps": 5}, model={"name": "small"}, data={"path": "corpus.txt"}
    )
    assert flat == RunConfig(inner=InnerConfig(steps=5), model="small", data="corpus.txt")
    assert (flat.inner.steps, flat.model.name, flat.data.path) == (5, "small", "corpus.txt")
    changed = flat.replace(inner_lr=0.5, outer={"rounds": 3})
    assert (changed.inner.steps, changed.inner.lr, changed.outer.rounds) == (5, 0.5, 3)
    assert changed.replace(**changed.flat()) == changed  # a checkpoint's flat record rebuilds it


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"inner_step": 5},
            r"unknown option 'inner_step' for RunConfig; did you mean 'inner_steps'",
        ),
        ({"inner": {"step": 5}}, r"unknown option 'step' in section 'inner'; did you mean 'steps'"),
    ],
)
def test_an_unknown_name_is_refused_with_the_closest_one(options, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**options)


def _other_value(spec):
    """A valid value unlike the default, for a flag round trip."""
    if spec.option.choices:
        return next(c for c in spec.option.choices if c != spec.default)
    if spec.type is str:
        return "X_VALUE"  # a name, so --api-token-env takes it too
    if spec.option.below is not None or spec.option.at_most == 1:  # in [0, 1) or [0, 1]
        return spec.default / 2
    return spec.default + 2 if spec.type is int else spec.default + 2.5


def test_every_run_option_has_its_flag_in_its_section_group_and_lands_in_its_field():
    parser = build_parser()
    shepherd = parser._subparsers._group_actions[0].choices["shepherd"]
    groups = {g.title: {a.dest for a in g._group_actions} for g in shepherd._action_groups}
    for spec in specs(RunConfig):
        if not spec.option.cli:
            continue
        assert spec.flat in groups[spec.section], (spec.flag, spec.section)
        if spec.flat == "resume":  # reads a checkpoint: tests/test_resume.py
            continue
        value = _other_value(spec)
        args = ["shepherd", spec.flag, str(value)]
        if spec.type is bool:  # a switch: the flag alone sets it
            value, args = True, ["shepherd", spec.flag]
        if spec.flat == "attention":
            args += ["--compute-dtype", "bfloat16"]  # cudnn needs it
        if spec.flat in ("tls_cert", "tls_key"):
            args += ["--tls-key" if spec.flat == "tls_cert" else "--tls-cert", "pair"]
        if spec.flat == "heartbeat_seconds":
            args += ["--heartbeat-timeout", "100"]
        if spec.flat == "min_workers":
            args += ["--workers", "9"]
        if spec.flat == "streaming_fragments":  # H a multiple of F, τ below H / F
            args += ["--inner-steps", str(20 * value)]
        config = _config_from(parser.parse_args(args))
        assert getattr(getattr(config, spec.section), spec.name) == value, spec.flag
    assert FLAT_PATHS["inner_steps"] == "inner.steps" and len(FLAT_PATHS) == len(specs(RunConfig))


def test_worker_flags_build_a_worker_config():
    argv = ["worker", "--connect", "[::1]:8080", "--id", "w", "--no-reconnect", "--quiet"]
    config = worker_config_from(build_parser().parse_args([*argv, "--backend", "cpu"]))
    assert config.connection.address == ("::1", 8080)
    assert (config.connection.worker_id, config.connection.reconnect) == ("w", False)
    assert (config.output.quiet, config.compute.backend, config.log.level) == (
        True,
        "cpu",
        "warning",
    )
    assert config == WorkerConfig(
        connect="[::1]:8080", worker_id="w", reconnect=False, quiet=True, backend="cpu"
    ).replace(compile_cache=config.compute.compile_cache)
    with pytest.raises(ConfigError, match="--backend must be one of auto, cpu"):
        worker_config_from(build_parser().parse_args([*argv, "--backend", "tpu"]))


def test_a_site_process_is_told_what_its_flags_lack():
    site = ["worker", "--connect", "10.0.0.5:8080", "--num-processes", "2"]
    config = worker_config_from(
        build_parser().parse_args([*site, "--coordinator-address", "10.0.0.7:9123"])
    )
    assert (config.site.num_processes, config.site.process_id) == (2, 0)
    with pytest.raises(ConfigError, match="--num-processes 2 needs --coordinator-address"):
        worker_config_from(build_parser().parse_args(site))
    with pytest.raises(
        ConfigError, match=r"--process-id 2 is not one of the site's 2 processes \(0 to 1\)"
    ):
        worker_config_from(
            build_parser().parse_args([*site, "--coordinator-address", "h:1", "--process-id", "2"])
        )
    with pytest.raises(ConfigError, match="--coordinator-address wants HOST:PORT, got '10.0.0.7'"):
        worker_config_from(build_parser().parse_args([*site, "--coordinator-address", "10.0.0.7"]))
    alone = ["worker", "--connect", "10.0.0.5:8080"]
    with pytest.raises(ConfigError, match="--coordinator-address makes this process one of a s"):
        worker_config_from(build_parser().parse_args([*alone, "--coordinator-address", "h:1"]))
    with pytest.raises(ConfigError, match=r"\(0 to 0\) \(pass --num-processes N\)"):
        worker_config_from(build_parser().parse_args([*alone, "--process-id", "1"]))


def test_a_bad_log_level_is_a_config_error_before_logging_is_set_up(capsys):
    assert main(["shepherd", "--log-level", "verbose"]) == 2
    assert capsys.readouterr().err == (
        "pcp-tui: error: --log-level must be one of debug, info, warning, error, got 'verbose'\n"
    )
