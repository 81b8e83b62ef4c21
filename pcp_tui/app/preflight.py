"""Checks that run before a shepherd or demo loads data and model: fail in a second, not later.

Each raises ConfigError (exit 2) for an option that cannot work, naming the
option and what to do; a busy port is a RunFailed (exit 1), a missing or
unreadable checkpoint a CheckpointError.
"""

from __future__ import annotations

import difflib
import errno
import functools
import os
import socket
import tempfile
from pathlib import Path

from pcp_tui.app.api import bearer_token
from pcp_tui.config import ConfigError, RunConfig
from pcp_tui.shepherd.coordinator import RunFailed
from pcp_tui.shepherd.run import checkpoint
from pcp_tui.shepherd.serving.worker_keys import WorkerKeys


def preflight(config: RunConfig) -> None:
    """What can be checked before data and model load: model, address, files, the resumed round.

    ConfigError (exit 2) for an option that cannot work, RunFailed for a busy port,
    CheckpointError for a missing or unreadable checkpoint.
    """
    _check_model(config.model.name)
    if config.model.attention == "cudnn":
        _check_cudnn()
    _check_listen(config.network.host, config.network.port)
    if config.operator.api_port:
        bearer_token(config)  # no token, no API: say so before the data loads
    if config.checkpoints.dir:
        _check_writable(config.checkpoints.dir)
    if config.operator.metrics:
        try:
            with open(config.operator.metrics, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            raise ConfigError(
                f"cannot write --metrics {config.operator.metrics} ({exc.strerror or exc})"
            ) from None
    if config.security.worker_keys:
        WorkerKeys(config.security.worker_keys)  # a bad line says so now, not after the model
    if config.checkpoints.resume:
        saved = checkpoint.inspect(config.checkpoints.resume)
        if saved.round >= config.outer.rounds:
            raise ConfigError(
                f"checkpoint {saved.path} is at round {saved.round} of {config.outer.rounds}; "
                "pass a larger --rounds to train further"
            )


def _check_model(model: str) -> None:
    """A GPT-2 preset or an existing model file, before minutes of loading find out."""
    from pcp_tui.training.model_file import is_model_file
    from pcp_tui.training.models.gpt2 import PRESETS

    if is_model_file(model):
        path = Path(model.partition(":")[0]).expanduser()
        if not path.is_file():
            raise ConfigError(f"--model {model!r}: no file {path.resolve()}")
        return
    if model not in PRESETS:
        close = difflib.get_close_matches(model, PRESETS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"--model {model!r} is not a preset: {hint}presets are {', '.join(PRESETS)}, "
            "or pass a model file path/to/model.py:build"
        )


def _check_cudnn() -> None:
    """Trace cuDNN attention once: the shepherd exports it, so its JAX needs CUDA and cuDNN."""
    import jax
    import jax.numpy as jnp

    shape = jax.ShapeDtypeStruct((1, 8, 1, 16), jnp.bfloat16)
    attention = functools.partial(
        jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"
    )
    try:
        jax.eval_shape(attention, shape, shape, shape)
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        raise ConfigError(
            f"--attention cudnn needs JAX with CUDA and cuDNN on the shepherd, which exports "
            f"the graph ({exc}); run the shepherd on a CUDA machine, or use --attention xla"
        ) from None


def _check_listen(host: str, port: int) -> None:
    """Bind (and let go) where the shepherd will listen, as trio.open_tcp_listeners does."""
    try:
        addresses = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise ConfigError(
            f"--host {host!r} does not resolve ({exc.strerror}): give an address of this "
            "machine, or 0.0.0.0 for all of them"
        ) from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            if os.name != "nt":
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise _listen_problem(host, port, exc) from None


def _listen_problem(host: str, port: int, exc: OSError) -> Exception:
    if exc.errno == errno.EADDRNOTAVAIL:
        return ConfigError(
            f"--host {host} is not an address of this machine ({exc.strerror}): listen on one "
            "of its addresses, or 0.0.0.0 for all of them"
        )
    if exc.errno == errno.EADDRINUSE:
        return RunFailed(
            f"cannot listen on {host}:{port}: the port is in use (by another program or run); "
            "pick another --port, or --port 0 for any free one"
        )
    if exc.errno == errno.EACCES:
        return ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror}): ports below 1024 need "
            "privileges; pick a --port above 1023"
        )
    return RunFailed(f"cannot listen on {host}:{port} ({exc.strerror or exc})")


def _check_writable(directory: str) -> None:
    """Create `directory` and a file in it now, not at the first checkpoint rounds later."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".pcp-tui-write-test-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"cannot write checkpoints to {directory} ({exc.strerror or exc}): "
            "choose a writable --checkpoint-dir"
        ) from None
