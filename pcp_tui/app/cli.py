"""`pcp-tui`: shepherd, worker and demo commands."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from pcp_tui import __version__
from pcp_tui.app import link_emulator, plot
from pcp_tui.app.config_file import load_config_file
from pcp_tui.app.options_cli import add_flags, passed_values
from pcp_tui.config import ConfigError, LogConfig, RunConfig, WorkerConfig
from pcp_tui.config.options import validate_section
from pcp_tui.config.relay import RelayConfig
from pcp_tui.config.worker import BACKENDS

if TYPE_CHECKING:  # the worker loads on demand: `pcp-tui --help` stays fast
    from pcp_tui.worker.rounds import Faults


def _add_run_options(parser: argparse.ArgumentParser, defaults: RunConfig) -> None:
    """--config, then one flag per RunConfig option (pcp_tui.config), grouped by section."""
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        help="read run options from a TOML file (see examples/run.toml); flags given here win",
    )
    parser.set_defaults(run_defaults=defaults)
    add_flags(parser, RunConfig, defaults, only_passed=True)  # the file's values stay beneath


def _add_log_options(parser: argparse.ArgumentParser) -> None:
    """--log-level and --log-file: the log section every command shares with the worker's."""
    add_flags(parser, WorkerConfig, WorkerConfig(), sections=["log"])


class _StandardError(logging.StreamHandler):
    """Standard error as it is when a record is written, not when logging was set up.

    The dashboard points stderr at the null device when its terminal closes, and
    a test's captured stream is closed after it: a handler that kept the old
    stream would write to a closed file.
    """

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it; stderr is read live
        pass


def configure_logging(level: str, path: str | None) -> None:
    """Send `pcp_tui` loggers at `level` to `path` (appended) or standard error.

    Only pcp-tui's own loggers get the level: debug for JAX would flood the log.
    """
    handler = logging.FileHandler(path, encoding="utf-8") if path else _StandardError()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("pcp_tui")
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


def _config_from(args: argparse.Namespace) -> RunConfig:
    """Command defaults, then the --config file, then the flags actually passed.

    With --resume, the checkpoint's record of the run comes between the defaults and
    what is given (`pcp_tui.app.resume`), and its kept token before a random one.
    """
    values = load_config_file(args.config) if args.config else {}
    values.update(passed_values(args, RunConfig))
    resume = values.get("resume")
    if resume:
        from pcp_tui.app.resume import resumed_config

        config = resumed_config(resume, values, args.run_defaults)
    else:
        config = args.run_defaults.replace(**values)
    if not config.security.token:
        config = config.replace(token=os.environ.get("PCP_TOKEN") or None)
    if resume and not config.security.token:
        from pcp_tui.shepherd.run.checkpoint import saved_token

        config = config.replace(token=saved_token(resume))
    return config.validate()


def worker_config_from(args: argparse.Namespace) -> WorkerConfig:
    """`pcp-tui worker`'s flags as a WorkerConfig (unset flags hold their defaults)."""
    return WorkerConfig(**passed_values(args, WorkerConfig)).validate()


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a usage error is one line and where to look, not the whole usage.

    `pcp-tui shepherd --inner-steps ten` otherwise prints the ~50-line usage of the
    command above the one line that matters. Subcommands get this class too
    (`add_subparsers` makes its parsers of the parent's type).
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pcp-tui",
        description="Train across loosely connected machines (DiLoCo).",
        allow_abbrev=False,  # `--inner-step 5` must be an error, not a guess at --inner-steps
    )
    parser.add_argument("--version", action="version", version=f"pcp-tui {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    shepherd = _command(commands, "shepherd", help="coordinate a run: workers connect to it")
    _add_run_options(shepherd, RunConfig())
    _add_log_options(shepherd)

    demo = _command(
        commands, "demo", help="shepherd plus local worker processes on the embedded corpus"
    )
    demo.add_argument(
        "--backend",
        default="cpu",
        choices=BACKENDS,
        help="backend of the local workers (default: cpu)",
    )
    _add_run_options(
        demo,
        RunConfig(
            rounds=12, inner_steps=25, port=0, host="127.0.0.1", warmup_steps=25, inner_lr=2e-3
        ),
    )
    _add_log_options(demo)

    worker = _command(commands, "worker", help="join a shepherd and train")
    add_flags(worker, WorkerConfig, WorkerConfig())
    relay = _command(
        commands,
        "relay",
        help="carry a site's workers to a shepherd (started with --relays) over one link",
    )
    add_flags(relay, RelayConfig, RelayConfig())
    keygen = _command(
        commands, "keygen", help="make a worker's key: its line goes in a shepherd's --worker-keys"
    )
    keygen.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="write the private key here (OpenSSH format, mode 0600; never overwritten)",
    )
    keygen.add_argument(
        "--name",
        metavar="ID",
        help="the worker id the key is issued to (default: this host's name)",
    )
    link_emulator.add_parser(commands)
    plot.add_parser(commands)
    sample = _command(commands, "sample", help="generate text from a GPT-2 checkpoint")
    sample.add_argument(
        "--checkpoint",
        "--checkpoint-dir",
        dest="checkpoint",
        required=True,
        metavar="DIR",
        help="a run's --checkpoint-dir (its latest checkpoint) or one of its round-NNNNNN directories",
    )
    sample.add_argument("--prompt", default="", help="text to continue")
    sample.add_argument("--tokens", type=int, default=200, help="bytes to generate (default: 200)")
    sample.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="softmax temperature: lower is more predictable (default: 0.8)",
    )
    sample.add_argument(
        "--top-k",
        type=int,
        default=40,
        help="sample only among the k likeliest next bytes (default: 40)",
    )
    sample.add_argument(
        "--seed", type=int, default=0, help="random seed: the same seed, the same text (default: 0)"
    )
    return parser


def _command(commands, name: str, **options) -> argparse.ArgumentParser:
    """A subcommand's parser; like the top one, it takes only whole option names."""
    return commands.add_parser(name, allow_abbrev=False, **options)


class Interrupted(BaseException):
    """SIGTERM or SIGHUP outside a run's own signal handling (see `signals.SignalStop`).

    The exit code is 128 + the signal's number: 143 for SIGTERM, 129 for SIGHUP.
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_TERMINATING = (signal.SIGTERM, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else []))


def _terminate(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`parser.parse_args`, but an unknown option is named with its command and the closest option.

    argparse alone answers `pcp-tui shepherd --wokers 2` with the top-level usage
    (which lists only the commands) and no hint, and `pcp-tui worker --conect X`
    with "required: --connect", never naming the typo: unknown options are looked
    for before argparse checks what is required. Exits 2 like argparse.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    first = next((word for word in argv if not word.startswith("-")), None)
    if first is not None and first not in commands.choices:  # argparse 3.11 suggests nothing
        close = difflib.get_close_matches(first, commands.choices, n=1)
        hint = f"did you mean {close[0]}?" if close else f"commands: {', '.join(commands.choices)}"
        parser.error(f"unknown command {first!r}; {hint}")
    command = first
    if command is not None:
        options = [o for a in commands.choices[command]._actions for o in a.option_strings]
        after = argv[argv.index(command) + 1 :]
        unknown = []
        for i, word in enumerate(after):
            if word.startswith("--") and word != "--" and word.split("=", 1)[0] not in options:
                value = after[i + 1] if i + 1 < len(after) and "=" not in word else "-"
                unknown += [word] if value.startswith("-") else [word, value]
        if unknown:
            _unrecognized(command, unknown, options)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        options = [o for a in commands.choices[args.command]._actions for o in a.option_strings]
        _unrecognized(args.command, unknown, options)
    return args


def _unrecognized(command: str, unknown: list[str], options: list[str]) -> NoReturn:
    """Say which options are unknown, and the closest known one ('did you mean --workers?')."""
    hint = ""
    for word in unknown:
        if word.startswith("--"):
            close = difflib.get_close_matches(word.split("=", 1)[0], options, n=1, cutoff=0.7)
            if close:
                hint = f"; did you mean {close[0]}?"
                break
    print(
        f"pcp-tui {command}: error: unrecognized arguments: {' '.join(unknown)}{hint} "
        f"(pcp-tui {command} --help lists every option)",
        file=sys.stderr,
    )
    sys.exit(2)


def main(argv: Sequence[str] | None = None, *, faults: Faults | None = None) -> int:
    """`pcp-tui` with `argv`; `faults` (tests: `pcp_tui.testing.faulty_worker`) go to a worker."""
    args = parse_args(build_parser(), argv)
    if threading.current_thread() is not threading.main_thread():
        return _main(args, faults)
    # like Ctrl-C: a message, not a death (SIGHUP: the terminal closed)
    previous = {signum: signal.signal(signum, _terminate) for signum in _TERMINATING}
    try:
        return _main(args, faults)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _main(args: argparse.Namespace, faults: Faults | None = None) -> int:
    try:
        if getattr(args, "log_level", None):
            validate_section(LogConfig(level=args.log_level, file=args.log_file), "log")
            level = args.log_level  # a worker's --quiet drops warnings, not a level asked for
            if getattr(args, "quiet", False) and level == LogConfig().level and not args.log_file:
                level = "error"
            try:
                configure_logging(level, args.log_file)
            except OSError as exc:
                raise ConfigError(
                    f"cannot write --log-file {args.log_file} ({exc.strerror or exc})"
                ) from None
        return _dispatch(args, faults)
    except ConfigError as exc:
        print(f"pcp-tui: error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted) as exc:
        return _interrupted(exc.signum if isinstance(exc, Interrupted) else signal.SIGINT)
    except BaseExceptionGroup as group:  # a signal inside trio nurseries arrives wrapped
        if group.split((KeyboardInterrupt, Interrupted))[1] is not None:
            raise
        terminated: BaseException | None = group.subgroup(Interrupted)
        while isinstance(terminated, BaseExceptionGroup):
            terminated = terminated.exceptions[0]
        return _interrupted(
            terminated.signum if isinstance(terminated, Interrupted) else signal.SIGINT
        )


def _interrupted(signum: int) -> int:
    print(f"pcp-tui: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
    return 128 + signum


def _dispatch(args: argparse.Namespace, faults: Faults | None = None) -> int:
    if args.command == "sample":
        return _sample(args)
    if args.command == "emulate-link":
        return link_emulator.run(args)
    if args.command == "plot":
        return plot.run(args)
    if args.command == "keygen":
        return _keygen(args)
    if args.command == "relay":
        from pcp_tui.app.launch import run_relay

        return run_relay(RelayConfig(**passed_values(args, RelayConfig)).validate())
    if args.command == "worker":
        from pcp_tui.app.launch import run_worker

        return run_worker(worker_config_from(args), faults=faults)
    from pcp_tui.shepherd.run.checkpoint import CheckpointError

    try:
        config = _config_from(args)
    except CheckpointError as exc:  # --resume: nothing to read, or nothing to trust
        print(f"pcp-tui: error: {exc}", file=sys.stderr)
        return 2  # an option that cannot work, as the README promises
    from pcp_tui.app.launch import run_demo, run_shepherd

    headless = config.operator.headless
    if args.command == "demo":
        if config.security.worker_keys:
            raise ConfigError(
                "--worker-keys is for pcp-tui shepherd: the demo's workers hold no key"
            )
        return run_demo(config, headless=headless, backend=args.backend)
    return run_shepherd(config, headless=headless)


def _keygen(args: argparse.Namespace) -> int:
    """Write a new worker key to --out and print its public line (stdout: `>> workers.keys`)."""
    import platform

    from pcp_tui.contract import keys

    name = args.name or platform.node() or "worker"
    problem = keys.name_problem(name)
    if problem is not None:
        raise ConfigError(f"--name {name!r}: {problem}")
    key = keys.generate()
    keys.write_private_key(key, args.out)
    print(keys.public_line(key, name))
    print(
        f"pcp-tui: wrote {args.out} (keep it on the worker, private); add the line above to the "
        f"shepherd's --worker-keys file, then start the worker with --key {args.out} --id {name}",
        file=sys.stderr,
    )
    return 0


def _sample(args: argparse.Namespace) -> int:
    from pcp_tui.app.sample import sample_text
    from pcp_tui.shepherd.run.checkpoint import CheckpointError

    try:
        text = sample_text(
            args.checkpoint,
            args.prompt,
            tokens=args.tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
        )
    except CheckpointError as exc:
        print(f"pcp-tui: error: {exc}", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
