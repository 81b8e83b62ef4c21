"""`--resume DIR`: the run as its checkpoint saved it, and what an option given again may change.

A checkpoint's meta.json holds every option of the run that wrote it (the token
aside, which `checkpoint.keep_token` keeps beside it, readable by its owner only).
A resume starts from those, so `pcp-tui shepherd --resume DIR` alone continues
the run as it was: same port, token, metrics file, headless or dashboard. An
option given again (flag or --config file) wins where it does not change what
the run computes (--port, --metrics, --workers, --rounds...); one that would
(seed, learning rates, inner steps, aggregate, sequence length, model: see
`config.run.RUN_SECTIONS`) is refused, naming the flag and both values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pcp_tui.app.config_file import checked
from pcp_tui.config import ConfigError, RunConfig, flat_names
from pcp_tui.config.run import defines_run
from pcp_tui.shepherd.run import checkpoint

# Options a checkpoint's record never sets: where this resume reads from and writes to.
_NOT_RESTORED = ("resume", "checkpoint_dir", "token")


def resumed_config(directory: str, given: dict[str, Any], defaults: RunConfig) -> RunConfig:
    """The run saved in `directory`, with the options in `given` that may change applied
    (printed, each with its saved value: "resuming DIR with --rounds 40 (was 20)").

    ConfigError for an option that would change the run's meaning, or a saved record
    that is not a run's options; CheckpointError when there is no checkpoint to read.
    """
    info = checkpoint.inspect(directory)
    saved = saved_options(info)
    for flat in flat_names(RunConfig):  # declaration order: --model before the data's options
        value = given.get(flat)
        if flat in given and flat in saved and defines_run(flat) and value != saved[flat]:
            flag = flat_names(RunConfig)[flat].flag
            raise ConfigError(
                f"{flag} {_shown(value)} would change the run saved in {directory} (it was "
                f"trained with {flag} {_shown(saved[flat])}); resume without {flag}, or start "
                "a new run with another --checkpoint-dir"
            )
    values = {**saved, **given, "resume": directory}
    values["checkpoint_dir"] = given.get("checkpoint_dir") or directory  # keep saving there
    changed = [
        f"{flat_names(RunConfig)[flat].flag} {_shown(given[flat])} (was {_shown(saved[flat])})"
        for flat in flat_names(RunConfig)
        if flat in given
        and flat in saved
        and given[flat] != saved[flat]
        and flat not in _NOT_RESTORED
    ]
    if changed:  # say what differs from the run as it was, so a typo shows
        print(f"resuming {directory} with {', '.join(changed)}", flush=True)
    return defaults.replace(**values)


def saved_options(info: checkpoint.CheckpointInfo) -> dict[str, Any]:
    """{flat name: value} of the options meta.json recorded, each checked against its type.

    Options this version no longer has are skipped; a checkpoint that predates the
    record gives {} (the run's options then come from the command line, as before).
    """
    record = info.meta.get("config", {})
    where = Path(info.path) / "meta.json"
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: its config is not a table of options; a damaged checkpoint")
    known = flat_names(RunConfig)
    options: dict[str, object] = {}
    for flat, value in record.items():
        spec = known.get(flat)
        if spec is None or flat in _NOT_RESTORED:
            continue
        if value is None and spec.optional:
            options[flat] = None
            continue
        if spec.option.table and isinstance(value, list):  # JSON wrote the pairs as lists
            value = {str(pair[0]): pair[1] for pair in value if isinstance(pair, list | tuple)}
        options[flat] = checked(spec, value, f"config.{flat}", where)
    return options


def _shown(value: Any) -> str:
    return "(none)" if value is None else str(value)
