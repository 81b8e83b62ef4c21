"""`pcp-tui`: shepherd, worker and demo commands."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from pcp_tui import __version__
from pcp_tui.app import link_emulator
from pcp_tui.app.config_file import load_config_file
from pcp_tui.config import ConfigError, RunConfig

# Help for the run options; every RunConfig field becomes a --flag.
_HELP = {
    "model": "model preset: tiny (CPU demo), small, gpt2 (86M on bytes, 124M on GPT-2 tokens); or a model file path/to/model.py:build",
    "data": "text file, folder of text, or nanoGPT .bin tokens (default: the embedded Python-stdlib corpus)",
    "data_max_bytes": "bytes of the embedded/text corpus to use",
    "seq_len": "tokens per training sequence",
    "batch_size": "sequences per inner step, per worker",
    "compute_dtype": "float32 | bfloat16 (mixed precision: float32 params, bf16 matmuls)",
    "attention": "xla | cudnn (GPU workers only)",
    "rounds": "outer rounds (DiLoCo syncs) to run",
    "inner_steps": "H: inner optimizer steps per worker per round",
    "chunk_steps": "inner steps per compiled call (progress granularity)",
    "inner_optimizer": "adamw | sgd",
    "inner_lr": "inner learning rate (peak, after warm-up)",
    "warmup_steps": "inner learning-rate warm-up steps",
    "weight_decay": "inner AdamW weight decay (matrices only)",
    "grad_clip": "inner gradient clipping by global norm (0: off)",
    "outer_optimizer": "nesterov | sgd",
    "outer_lr": "outer learning rate (DiLoCo: 0.7)",
    "outer_momentum": "outer Nesterov momentum in [0, 1) (DiLoCo: 0.9)",
    "aggregate": "how results combine: centered-clip (robust: a minority cannot steer) | mean | trimmed-mean | median",
    "compression": "pseudo-gradient encoding: none | bfloat16 | int8Block",
    "seed": "seed for initialisation and data order",
    "streaming_fragments": "Streaming DiLoCo: F fragments of whole tensors, each synced once a round on a staggered schedule (1: plain DiLoCo)",
    "overlap_steps": "Streaming DiLoCo: τ inner steps a fragment's exchange overlaps with training before it merges",
    "adaptive_steps": "size each worker's round to its measured speed (the fastest trains H), so a round does not wait for the slowest; results count by tokens",
    "mix_alpha": "Streaming DiLoCo: a merge keeps α of the local fragment and takes 1 − α of the new global one",
    "eval_every": "evaluate on the held-out split every N rounds",
    "eval_batches": "held-out batches per evaluation",
    "workers": "workers to wait for before round 1",
    "host": "address to listen on",
    "port": "TCP port to listen on (0: any free port)",
    "heartbeat_seconds": "heartbeat interval, of the shepherd and (told in the welcome) its workers",
    "heartbeat_timeout": "seconds of silence before a worker counts as lost (at least 3x --heartbeat-seconds)",
    "round_timeout": "close a round after this many seconds with the results it has (0: wait for all)",
    "min_workers": "fewest results a round needs before --round-timeout may close it (at most --workers)",
    "token": "join token workers must prove (default: $PCP_TOKEN or a random one)",
    "metrics": "append JSON Lines metrics to this file",
    "checkpoint_dir": "write checkpoints (safetensors + JSON) into this directory (default: the --resume directory, if any)",
    "checkpoint_every": "checkpoint every N rounds (and when the run stops)",
    "resume": "continue the run from the latest checkpoint in this directory",
    "tls_cert": "PEM certificate: workers connect over TLS (the join command then pins its fingerprint)",
    "tls_key": "PEM private key of --tls-cert",
    "handshake_timeout": "seconds a new connection has to prove the token before it is dropped",
    "max_handshakes_per_host": "unfinished handshakes one address may hold; more are closed at once",
    "max_handshakes": "unfinished handshakes in all; more are closed at once",
    "max_worker_connections": "admitted worker connections at once; more are refused as busy (0: --workers + 2)",
    "min_upload_rate": "bytes/s a round result upload must average after --upload-grace; slower ones are dropped",
    "upload_grace": "seconds a round result upload may take before --min-upload-rate applies",
    "api_host": "address the operator API listens on (0.0.0.0: every interface; keep it private)",
    "api_port": "serve the operator HTTP API and Prometheus /metrics on this port (0: no API; HTTPS with --tls-cert)",
    "api_token_env": "environment variable that holds the API's bearer token (required when --api-port is set)",
    "trace": "append one JSON line per protocol message sent or received to this file (rotated at 64 MiB)",
}
_SKIP = {"platforms"}


def _add_run_options(parser: argparse.ArgumentParser, defaults: RunConfig) -> None:
    group = parser.add_argument_group("run options")
    group.add_argument(
        "--config",
        metavar="FILE.toml",
        help="read run options from a TOML file; flags given here win",
    )
    parser.set_defaults(
        run_defaults=defaults
    )  # flags are SUPPRESSed: only those passed reach _config_from
    for field in dataclasses.fields(RunConfig):
        if field.name in _SKIP:
            continue
        default = getattr(defaults, field.name)
        kind = type(default) if default is not None else str
        text = _HELP.get(field.name, "")
        if default is not None and "(default:" not in text:  # None: the help says what happens
            text = f"{text} (default: {default})"
        if kind is bool:  # a switch: --adaptive-steps, not --adaptive-steps true
            group.add_argument(
                f"--{field.name.replace('_', '-')}",
                dest=field.name,
                action="store_true",
                default=argparse.SUPPRESS,
                help=text,
            )
            continue
        group.add_argument(
            f"--{field.name.replace('_', '-')}",
            dest=field.name,
            type=kind,
            default=argparse.SUPPRESS,
            help=text,
        )


LOG_LEVELS = ("debug", "info", "warning", "error")


def _add_log_options(parser: argparse.ArgumentParser) -> None:
    """--log-level and --log-file: connection-level diagnostics beside the run's own output."""
    group = parser.add_argument_group("logging")
    group.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="warning",
        help="info: joins, losses, refusals and reconnects; debug: also every message sent "
        "and received, with its size (default: warning)",
    )
    group.add_argument(
        "--log-file",
        default=None,
        metavar="PATH",
        help="append the log to this file instead of standard error",
    )


def configure_logging(level: str, path: str | None) -> None:
    """Send `pcp_tui` loggers at `level` to `path` (appended) or standard error.

    Only pcp-tui's own loggers get the level: debug for JAX would flood the log.
    """
    handler = logging.FileHandler(path, encoding="utf-8") if path else logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("pcp_tui")
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


def _config_from(args: argparse.Namespace) -> RunConfig:
    """Command defaults, then the --config file, then the flags actually passed."""
    fields = [f.name for f in dataclasses.fields(RunConfig)]
    values = {name: getattr(args.run_defaults, name) for name in fields}
    if args.config:
        values.update(load_config_file(args.config))
    values.update(
        {name: getattr(args, name) for name in fields if name not in _SKIP and hasattr(args, name)}
    )
    if not values.get("token"):
        values["token"] = os.environ.get("PCP_TOKEN") or None
    if values.get("resume") and not values.get("checkpoint_dir"):
        values["checkpoint_dir"] = values["resume"]  # a resumed run keeps checkpointing there
    return RunConfig(**values).validate()


def _default_cache() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("PCP_COMPILE_CACHE", os.path.join(base, "pcp-tui", "xla"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pcp-tui",
        description="Train across loosely connected machines (DiLoCo).",
        allow_abbrev=False,  # `--inner-step 5` must be an error, not a guess at --inner-steps
    )
    parser.add_argument("--version", action="version", version=f"pcp-tui {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    shepherd = _command(commands, "shepherd", help="coordinate a run: workers connect to it")
    shepherd.add_argument(
        "--headless", action="store_true", help="no dashboard: one line per round"
    )
    _add_run_options(shepherd, RunConfig())
    _add_log_options(shepherd)

    demo = _command(
        commands, "demo", help="shepherd plus local worker processes on the embedded corpus"
    )
    demo.add_argument("--headless", action="store_true", help="no dashboard: one line per round")
    demo.add_argument(
        "--backend", default="cpu", help="backend of the local workers (default: cpu)"
    )
    _add_run_options(
        demo,
        RunConfig(
            rounds=12, inner_steps=25, port=0, host="127.0.0.1", warmup_steps=25, inner_lr=2e-3
        ),
    )
    _add_log_options(demo)

    worker = _command(commands, "worker", help="join a shepherd and train")
    worker.add_argument(
        "--connect", required=True, metavar="HOST:PORT", help="the shepherd's address"
    )
    worker.add_argument(
        "--token", default=None, help="join token the shepherd printed (default: $PCP_TOKEN)"
    )
    worker.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "cpu", "cuda", "rocm", "metal"],
        help="where to run the graphs; auto picks cuda, rocm or metal when present, else cpu (default: auto)",
    )
    worker.add_argument(
        "--id", dest="worker_id", default=None, help="stable worker id (default: host-pid-random)"
    )
    worker.add_argument(
        "--no-reconnect",
        action="store_true",
        help="exit instead of reconnecting when the link breaks",
    )
    worker.add_argument(
        "--give-up-after",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="stop reconnecting (exit 1) after this long without being admitted by the shepherd "
        "(a TCP connect that is then refused does not count); retries wait about 1 s, then "
        "twice as long each time, up to 30 s: a run that ended while this worker was cut off "
        "never says goodbye to it (default: 1800)",
    )
    worker.add_argument(
        "--tls-ca",
        default=None,
        metavar="FILE",
        help="connect over TLS, trusting the shepherd's certificate if this CA signed it "
        "(with --tls-fingerprint too, the certificate must pass both)",
    )
    worker.add_argument(
        "--tls-fingerprint",
        default=None,
        metavar="SHA256",
        help="connect over TLS, trusting only the shepherd certificate with this SHA-256 "
        "(printed in its join command; with --tls-ca too, the certificate must pass both)",
    )
    worker.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="append one JSON line per protocol message sent or received to FILE (rotated at 64 MiB)",
    )
    worker.add_argument("--quiet", action="store_true", help="print only errors")
    _add_log_options(worker)
    worker.add_argument(  # a demo's local workers: see launch._worker_process
        "--parent-fd", type=int, default=None, help=argparse.SUPPRESS
    )
    worker.add_argument(
        "--compile-cache",
        default=_default_cache(),
        metavar="DIR",
        help="keep compiled graphs here so a restart does not recompile ('' to disable)",
    )
    link_emulator.add_parser(commands)
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
    sample.add_argument("--tokens", type=int, default=200, help="bytes to generate")
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
    """SIGTERM or SIGHUP outside a run's own signal handling (see `headless.SignalStop`).

    The exit code is 128 + the signal's number: 143 for SIGTERM, 129 for SIGHUP.
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_TERMINATING = (signal.SIGTERM, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else []))


def _terminate(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        return _main(args)
    # like Ctrl-C: a message, not a death (SIGHUP: the terminal closed)
    previous = {signum: signal.signal(signum, _terminate) for signum in _TERMINATING}
    try:
        return _main(args)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _main(args: argparse.Namespace) -> int:
    try:
        if getattr(args, "log_level", None):
            try:
                configure_logging(args.log_level, args.log_file)
            except OSError as exc:
                raise ConfigError(
                    f"cannot write --log-file {args.log_file} ({exc.strerror or exc})"
                ) from None
        return _dispatch(args)
    except ConfigError as exc:
        print(f"pcp-tui: error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted) as exc:
        return _interrupted(exc.signum if isinstance(exc, Interrupted) else signal.SIGINT)
    except BaseExceptionGroup as group:  # a signal inside trio nurseries arrives wrapped
        if group.split((KeyboardInterrupt, Interrupted))[1] is not None:
            raise
        terminated = group.subgroup(Interrupted)
        while isinstance(terminated, BaseExceptionGroup):
            terminated = terminated.exceptions[0]
        return _interrupted(terminated.signum if terminated is not None else signal.SIGINT)


def _interrupted(signum: int) -> int:
    print(f"pcp-tui: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
    return 128 + signum


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "sample":
        return _sample(args)
    if args.command == "emulate-link":
        return link_emulator.run(args)
    if args.command == "worker":
        from pcp_tui.app.launch import run_worker

        return run_worker(args)
    config = _config_from(args)
    from pcp_tui.app.launch import run_demo, run_shepherd

    if args.command == "demo":
        return run_demo(config, headless=args.headless, backend=args.backend)
    return run_shepherd(config, headless=args.headless)


def _sample(args: argparse.Namespace) -> int:
    from pcp_tui.app.sample import sample_text
    from pcp_tui.shepherd.checkpoint import CheckpointError

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
